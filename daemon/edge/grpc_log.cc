#include "daemon/edge/grpc_log.h"

#include <grpc/support/log.h>

#include <mutex>
#include <set>
#include <string>
#include <string_view>

#include "common/base/log.h"

namespace flashckpt {
namespace {

// gRPC logs a failed TLS handshake on every connection attempt (a peer that retries every second
// would fill the log) with OpenSSL's reason: "Handshake failed with fatal error SSL_ERROR_SSL:
// error:0A000086:SSL routines::certificate verify failed." The first of each reason is a warning of
// our own; repeats go to debug. At most kMaxReasons reasons are remembered (then all go to debug).
constexpr std::string_view kHandshakeFailed = "Handshake failed with fatal error ";
constexpr size_t kMaxReasons = 64;

// True the first time `reason` is seen.
bool FirstTime(const std::string& reason) {
  static std::mutex mu;
  static std::set<std::string>* seen = new std::set<std::string>();  // never destroyed: gRPC may log at exit
  std::lock_guard<std::mutex> lock(mu);
  if (seen->size() >= kMaxReasons) return false;
  return seen->insert(reason).second;
}

void ToDaemonLog(gpr_log_func_args* args) {
  const std::string_view message = args->message != nullptr ? args->message : "";
  if (message.rfind(kHandshakeFailed, 0) == 0) {
    std::string reason(message.substr(kHandshakeFailed.size()));
    while (!reason.empty() && (reason.back() == '.' || reason.back() == '\n')) reason.pop_back();
    if (FirstTime(reason)) {
      Logger("grpc")->warn("tls handshake failed reason=\"{}\" (logged once per reason; a peer with a certificate "
                           "this daemon's CA did not sign, an expired one, or a plaintext client on a TLS port)",
                           reason);
    } else {
      Logger("grpc")->debug("tls handshake failed reason=\"{}\"", reason);
    }
    return;
  }
  spdlog::level::level_enum level = spdlog::level::info;
  if (args->severity == GPR_LOG_SEVERITY_ERROR) level = spdlog::level::err;
  if (args->severity == GPR_LOG_SEVERITY_DEBUG) level = spdlog::level::debug;
  Logger("grpc")->log(level, "{} file={}:{}", message, args->file, args->line);
}

}  // namespace

void RouteGrpcLogsToDaemonLog() { gpr_set_log_function(ToDaemonLog); }

}  // namespace flashckpt

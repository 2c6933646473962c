#include "daemon/edge/grpc_log.h"

#include <grpc/support/log.h>

#include "common/base/log.h"

namespace flashckpt {
namespace {

void ToDaemonLog(gpr_log_func_args* args) {
  spdlog::level::level_enum level = spdlog::level::info;
  if (args->severity == GPR_LOG_SEVERITY_ERROR) level = spdlog::level::err;
  if (args->severity == GPR_LOG_SEVERITY_DEBUG) level = spdlog::level::debug;
  Logger("grpc")->log(level, "{} file={}:{}", args->message, args->file, args->line);
}

}  // namespace

void RouteGrpcLogsToDaemonLog() { gpr_set_log_function(ToDaemonLog); }

}  // namespace flashckpt

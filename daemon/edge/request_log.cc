#include "daemon/edge/request_log.h"

#include <grpcpp/server_context.h>

#include <algorithm>
#include <cstdlib>

#include "common/base/log.h"
#include "proto/convert.h"

namespace flashckpt {
namespace {

bool IsRefusal(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNIMPLEMENTED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return true;
    default:
      return false;
  }
}

// A refusal's message often quotes the request (a job name, a tensor name): in the log it is one
// line of printable ASCII, so that a peer cannot forge lines, with quotes and backslashes escaped,
// other bytes as \xNN, and at most kMaxLoggedMessage bytes of it.
constexpr size_t kMaxLoggedMessage = 2048;

std::string Printable(const std::string& text) {
  std::string out;
  out.reserve(std::min(text.size(), kMaxLoggedMessage) + 16);
  for (size_t i = 0; i < text.size() && i < kMaxLoggedMessage; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > kMaxLoggedMessage) out += "...(" + std::to_string(text.size()) + " bytes)";
  return out;
}

// "/flashckpt.v1.Checkpoint/Register" -> "Register".
std::string ShortMethod(const char* method) {
  std::string m = method != nullptr ? method : "";
  size_t slash = m.rfind('/');
  return slash == std::string::npos ? m : m.substr(slash + 1);
}

class RefusalLog : public grpc::experimental::Interceptor {
 public:
  RefusalLog(grpc::experimental::ServerRpcInfo* info, const PeerTable* peers) : info_(info), peers_(peers) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (!status.ok()) {
        std::string peer = info_->server_context() != nullptr ? info_->server_context()->peer() : "";
        auto level = IsRefusal(status.error_code()) ? spdlog::level::warn : spdlog::level::info;
        Logger("rpc")->log(level, "refused rpc={} code={} {} message=\"{}\"", ShortMethod(info_->method()),
                           GrpcCodeName(status.error_code()), DescribePeer(peers_, peer),
                           Printable(status.error_message()));
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* info_;
  const PeerTable* peers_;
};

}  // namespace

void PeerTable::Note(int fd, const PeerCredentials& peer) {
  MutexLock lock(&mu_);
  by_fd_[fd] = peer;
}

std::optional<PeerCredentials> PeerTable::Find(const std::string& peer) const {
  if (peer.rfind("fd:", 0) != 0) return std::nullopt;
  char* end = nullptr;
  long fd = std::strtol(peer.c_str() + 3, &end, 10);
  if (end == peer.c_str() + 3 || *end != '\0') return std::nullopt;
  MutexLock lock(&mu_);
  auto it = by_fd_.find(static_cast<int>(fd));
  if (it == by_fd_.end()) return std::nullopt;
  return it->second;
}

std::string DescribePeer(const PeerTable* peers, const std::string& peer) {
  if (peers != nullptr) {
    if (auto cred = peers->Find(peer)) {
      return "pid=" + std::to_string(cred->pid) + " uid=" + std::to_string(cred->uid) +
             " gid=" + std::to_string(cred->gid);
    }
  }
  return "peer=" + (peer.empty() ? std::string("unknown") : peer);
}

grpc::experimental::Interceptor* RefusalLogFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new RefusalLog(info, peers_);
}

}  // namespace flashckpt

#include "daemon/edge/tcp_listener.h"

#include <grpcpp/health_check_service_interface.h>

#include "common/base/log.h"
#include "daemon/edge/limits.h"
#include "daemon/edge/request_log.h"

namespace flashckpt {

TcpListener::TcpListener(CheckpointService* local, const DaemonConfig& config)
    : config_(config), service_(local, config.tcp_allow_writes) {}

TcpListener::~TcpListener() { Shutdown(std::chrono::system_clock::now()); }

Status TcpListener::Start() {
  ASSIGN_OR_RETURN(ListenAddress address, ParseListenAddress(config_.listen));
  const bool tls = !config_.tls_cert.empty();
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (tls) {
    grpc::SslServerCredentialsOptions ssl;
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    ASSIGN_OR_RETURN(pair.cert_chain,
                     ReadPem(config_.tls_cert, "--tls-cert", "-----BEGIN CERTIFICATE-----", "certificate"));
    ASSIGN_OR_RETURN(pair.private_key, ReadPem(config_.tls_key, "--tls-key", "PRIVATE KEY-----", "private key"));
    ssl.pem_key_cert_pairs.push_back(std::move(pair));
    credentials = grpc::SslServerCredentials(ssl);
  }
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second daemon would then share the port and take half
  // of the connections instead of failing to start.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Read-only, the listener takes only GetStatus, ListCheckpoints and WatchEvents requests, a few bytes each: an
  // unauthenticated caller gets no 16 MiB buffers out of it.
  builder.SetMaxReceiveMessageSize(config_.tcp_allow_writes ? kMaxRequestMessageBytes : kMaxReadOnlyRequestBytes);
  builder.RegisterService(&service_);
  // Refused calls are logged with the caller's address (no credentials on TCP).
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<RefusalLogFactory>(nullptr));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.AddListeningPort(address.Target(), credentials, &port_);
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0) {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
    server_.reset();
    return FailedPrecondition("--listen " + address.Target() + ": could not listen there (is the port in use or the " +
                              "address not one of this host's?" +
                              (tls ? " do --tls-cert and --tls-key hold a matching certificate and key?" : "") + ")");
  }
  ListenAddress bound = address;
  bound.port = static_cast<uint16_t>(port_);  // the kernel's choice for port 0
  if (!address.loopback && !tls) {
    Logger("rpc")->warn(
        "tcp listener on {} is not loopback and has no TLS: calls and answers travel in clear text and any host "
        "that reaches the port can make them; give --tls-cert and --tls-key, or listen on 127.0.0.1",
        address.Target());
  }
  if (!address.loopback && config_.tcp_allow_writes) {
    Logger("rpc")->warn(
        "--tcp-allow-writes on the non-loopback address {}: TCP callers are not authenticated (TLS does not check "
        "clients), so any host that reaches the port can open sessions and register memory",
        address.Target());
  }
  // Last: whoever waits for this line (an operator's script, the tests) has the warnings above by then.
  Logger("rpc")->info("listening tcp={} tls={} writes={}", bound.Target(), tls ? "on" : "off",
                      config_.tcp_allow_writes ? "allowed" : "refused");
  return Status::OK();
}

void TcpListener::SetServing(bool serving) {
  if (server_ && server_->GetHealthCheckService() != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(serving);
  }
}

void TcpListener::Shutdown(std::chrono::system_clock::time_point deadline) {
  if (!server_) return;
  server_->Shutdown(deadline);
  server_->Wait();
  server_.reset();
}

}  // namespace flashckpt

// The optional TCP listener of flashckptd (--listen HOST:PORT), beside the UNIX socket: a
// grpc::Server of its own whose only service is TcpCheckpointService (daemon/edge/tcp_service.h), so
// that operators can run `flashckpt status --address` from elsewhere. Over TCP there are no peer
// credentials (SO_PEERCRED), hence the read-only default; TLS (--tls-cert, --tls-key) authenticates
// the daemon to its clients and encrypts the traffic, it does not authenticate the clients.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/base/status.h"
#include "common/io/net.h"
#include "daemon/core/daemon.h"
#include "daemon/edge/tcp_service.h"

namespace flashckpt {

class TcpListener {
 public:
  // `local` (the UNIX socket's service) must outlive the listener.
  TcpListener(CheckpointService* local, const DaemonConfig& config);
  ~TcpListener();

  // Reads the TLS files if given, binds and starts serving. Refuses unreadable or non-PEM TLS
  // files and an address it cannot bind (SO_REUSEPORT is off: a port another process holds is an
  // error, not a shared port). Warns when a non-loopback address is served without TLS.
  Status Start();
  // Stops accepting and cancels calls still running at `deadline`.
  void Shutdown(std::chrono::system_clock::time_point deadline);

  // The overall status of the listener's grpc.health.v1.Health service (read-only, always served).
  void SetServing(bool serving);
  int port() const { return port_; }  // the bound port, after Start
  uint64_t denied_calls() const { return service_.denied_calls(); }

 private:
  const DaemonConfig& config_;
  TcpCheckpointService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace flashckpt

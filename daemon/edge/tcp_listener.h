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
#include "daemon/core/daemon.h"
#include "daemon/edge/tcp_service.h"

namespace flashckpt {

// A parsed --listen value.
//   "9000" or ":9000"  -> 127.0.0.1:9000 (loopback unless a host is given explicitly)
//   "10.0.0.5:9000", "0.0.0.0:9000", "[::1]:9000", "[::]:9000", "localhost:9000", "node7:9000"
// Port 0 lets the kernel choose; the listener logs the port it bound.
struct ListenAddress {
  std::string host;  // without brackets
  uint16_t port = 0;
  bool ipv6 = false;      // host is an IPv6 literal
  bool loopback = false;  // 127.0.0.0/8, ::1 (also v4-mapped) or "localhost"
  // "127.0.0.1:9000", "[::1]:9000": what gRPC binds.
  std::string Target() const;
};
// `flag` names the flag in the message of a value it refuses.
Result<ListenAddress> ParseListenAddress(std::string_view text, std::string_view flag = "--listen");

// Reads a PEM file given by a TLS flag (`flag`, for the message), which must hold a line with
// `marker` ("-----BEGIN CERTIFICATE-----", "PRIVATE KEY-----"): unreadable, oversized (1 MiB) or
// marker-less files are refused here, by name, rather than as an opaque gRPC failure to bind.
Result<std::string> ReadPem(const std::string& path, const char* flag, std::string_view marker, const char* what);

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

// The daemon's listeners. The UNIX socket: it accepts connections itself, checks each peer's
// credentials (SO_PEERCRED) against the allowed uids/gids, and only then hands the connection to
// gRPC (grpc::AddInsecureChannelFromFd). A refused peer is closed and logged with its uid and pid;
// an accepted one's credentials are kept by fd (PeerTable), so every call a handler refuses is
// logged with the caller's pid and uid (RefusalLogFactory, daemon/edge/request_log.h).
// With --listen, also a TCP listener on a gRPC server of its own (daemon/edge/tcp_listener.h); with
// --metrics-listen, the Prometheus scrape endpoint (daemon/observe/metrics_http.h). Both gRPC servers
// serve the standard health service (grpc.health.v1.Health) beside flashckpt's own.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "daemon/edge/request_log.h"
#include "daemon/edge/service.h"
#include "daemon/edge/tcp_listener.h"
#include "daemon/parity/parity_service.h"
#include "daemon/replica/replica_server.h"
#include "daemon/observe/metrics_http.h"

namespace flashckpt {

// OK when no process accepts connections on the UNIX socket `path` (none there, or a stale one a
// dead daemon left); FailedPrecondition when one does. flashckptd checks this before its daemon
// adopts or deletes anything, and Server::Start again before it replaces a stale socket.
Status CheckNoDaemonListening(const std::string& path);

class Server {
 public:
  explicit Server(Daemon* daemon) : daemon_(daemon), service_(daemon) {}
  ~Server();

  // Creates the socket's directory if needed (0750), refuses a socket another daemon listens on,
  // binds the socket with mode 0660 and starts accepting; then starts the TCP listener if the
  // config asks for one, and the metrics endpoint (an error there fails the start; Shutdown
  // cleans up either way).
  Status Start();
  // Stops accepting, cancels open streams and waits up to `grace` for handlers to return.
  void Shutdown(std::chrono::milliseconds grace);
  // The overall status (service "") of the standard health service, grpc.health.v1.Health, that
  // both listeners serve (on TCP also without --tcp-allow-writes): SERVING from Start, NOT_SERVING
  // once the daemon begins to stop.
  void SetServing(bool serving);

  uint64_t refused_peers() const { return refused_.load(); }
  // The replica listener's bound port, 0 without --replica-listen.
  int replica_port() const { return replica_ ? replica_->port() : 0; }
  // The TCP listener's bound port, 0 without --listen.
  int tcp_port() const { return tcp_ ? tcp_->port() : 0; }
  // The metrics endpoint's bound port, 0 without --metrics-listen.
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }
  // Calls refused on the TCP listener for want of --tcp-allow-writes.
  uint64_t tcp_denied_calls() const { return tcp_ ? tcp_->denied_calls() : 0; }

 private:
  void AcceptLoop();
  bool PeerAllowed(int fd);

  Daemon* daemon_;
  PeerTable peers_;  // the credentials of the socket's accepted connections, for the refusal log
  CheckpointService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<TcpListener> tcp_;
  std::unique_ptr<ReplicaStore> replica_store_;  // outlives replica_, which serves it
  std::unique_ptr<ParityStore> parity_store_;  // --ec-group; outlive replica_, which serves them
  std::unique_ptr<ParityService> parity_service_;
  std::unique_ptr<ReplicaServer> replica_;
  std::unique_ptr<MetricsHttpServer> metrics_;
  int listen_fd_ = -1;
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace flashckpt

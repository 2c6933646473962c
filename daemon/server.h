// The daemon's UNIX-socket listener. It accepts connections itself, checks each peer's
// credentials (SO_PEERCRED) against the allowed uids/gids, and only then hands the connection to
// gRPC (grpc::AddInsecureChannelFromFd). A refused peer is closed and logged with its uid and pid.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "daemon/service.h"

namespace flashckpt {

class Server {
 public:
  explicit Server(Daemon* daemon) : daemon_(daemon), service_(daemon) {}
  ~Server();

  // Creates the socket's directory if needed (0750), refuses a socket another daemon listens on,
  // binds the socket with mode 0660 and starts accepting.
  Status Start();
  // Stops accepting, cancels open streams and waits up to `grace` for handlers to return.
  void Shutdown(std::chrono::milliseconds grace);

  uint64_t refused_peers() const { return refused_.load(); }

 private:
  void AcceptLoop();
  bool PeerAllowed(int fd);

  Daemon* daemon_;
  CheckpointService service_;
  std::unique_ptr<grpc::Server> server_;
  int listen_fd_ = -1;
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace flashckpt

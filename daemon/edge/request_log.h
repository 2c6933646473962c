// Who called, and what was refused. The UNIX socket's accept thread (daemon/edge/server.cc) reads
// each connection's credentials (SO_PEERCRED) and notes them here under the fd it hands to gRPC;
// gRPC names such a connection "fd:<n>" (ServerContext::peer()), so a handler's peer is known by
// pid, uid and gid for as long as the connection lives. RefusalLog is a server interceptor that logs
// every call a handler ends with a status other than OK: the RPC, the code and message, and the
// peer (pid and uid on the socket; the address, as gRPC formats it, on TCP).
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <map>
#include <optional>
#include <string>

#include "common/base/mutex.h"

namespace flashckpt {

struct PeerCredentials {
  int pid = 0;
  uint32_t uid = 0, gid = 0;
};

// The credentials of the socket's connections by fd. Thread-safe. An fd number that the kernel
// gives to a new connection is noted again at its accept, before gRPC reads from it.
class PeerTable {
 public:
  void Note(int fd, const PeerCredentials& peer) EXCLUDES(mu_);
  // The credentials of a connection gRPC calls `peer` ("fd:<n>"); nullopt for another peer string
  // (TCP) or an fd never noted.
  std::optional<PeerCredentials> Find(const std::string& peer) const EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  std::map<int, PeerCredentials> by_fd_ GUARDED_BY(mu_);
};

// "pid=123 uid=1000 gid=1000" for a socket peer, "peer=ipv4:127.0.0.1:5000" for another.
std::string DescribePeer(const PeerTable* peers, const std::string& peer);

// Logs, on the "rpc" logger, every call that ends with a status other than OK:
//   refused rpc=Register code=FAILED_PRECONDITION pid=123 uid=1000 gid=1000 message="..."
// A request the caller got wrong or that the daemon's state does not allow (INVALID_ARGUMENT,
// NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION, PERMISSION_DENIED, UNIMPLEMENTED,
// RESOURCE_EXHAUSTED) is a warning; the rest (a wait that ran out, a stopping daemon, a failing
// disk, which the core logs itself) are info. `peers` (may be null: none known) must outlive the
// server.
class RefusalLogFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RefusalLogFactory(const PeerTable* peers) : peers_(peers) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

 private:
  const PeerTable* peers_;
};

}  // namespace flashckpt

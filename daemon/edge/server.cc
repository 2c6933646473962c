#include "daemon/edge/server.h"

#include <fcntl.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "common/base/log.h"
#include "common/io/fs.h"
#include "daemon/edge/config.h"
#include "daemon/edge/limits.h"
#include "daemon/parity/parity_sender.h"

namespace flashckpt {

Server::~Server() { Shutdown(std::chrono::milliseconds(0)); }

namespace {

Result<sockaddr_un> SocketAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path) {
    return InvalidArgument("--socket path must be 1 to " + std::to_string(sizeof addr.sun_path - 1) + " bytes");
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  return addr;
}

}  // namespace

Status CheckNoDaemonListening(const std::string& path) {
  ASSIGN_OR_RETURN(sockaddr_un addr, SocketAddress(path));
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return Status::OK();  // no socket yet
  if (!S_ISSOCK(st.st_mode)) return FailedPrecondition(path + " exists and is not a socket");
  UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (probe.valid() && ::connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    // The listener's credentials, as the kernel recorded them when it called listen().
    ucred peer{};
    socklen_t len = sizeof peer;
    std::string who;
    if (::getsockopt(probe.get(), SOL_SOCKET, SO_PEERCRED, &peer, &len) == 0 && peer.pid > 0) {
      who = " (pid " + std::to_string(peer.pid) + ")";
    }
    return FailedPrecondition("another daemon" + who + " is listening on " + path +
                              "; this one has touched nothing (stop that daemon first, or give this one another "
                              "--socket)");
  }
  return Status::OK();
}

Status Server::Start() {
  const std::string& path = daemon_->config().socket_path;
  ASSIGN_OR_RETURN(sockaddr_un addr, SocketAddress(path));
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (!dir.empty() && !PathExists(dir)) RETURN_IF_ERROR(MakeDirs(dir, 0750));
  RETURN_IF_ERROR(CheckNoDaemonListening(path));
  if (PathExists(path)) ::unlink(path.c_str());  // stale socket of a daemon that died
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus("socket", path);
  // Bind with a restrictive umask so the socket never exists with wider permissions than 0660.
  mode_t old_mask = ::umask(0117);
  int bound = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  int bind_errno = errno;
  ::umask(old_mask);
  if (bound != 0) return ErrnoStatus("bind", path, bind_errno);
  if (::chmod(path.c_str(), 0660) != 0) return ErrnoStatus("chmod", path);
  if (::listen(fd.get(), 128) != 0) return ErrnoStatus("listen", path);

  if (!daemon_->config().replica_listen.empty()) {
    // Made before the first GetStatus can come in, which reports what it holds.
    Daemon* daemon = daemon_;
    replica_store_ = std::make_unique<ReplicaStore>(
        HostMemory{[daemon](uint64_t bytes, const std::string& what) { return daemon->ReserveHostMemory(bytes, what); },
                   [daemon](uint64_t bytes) { daemon->ReleaseHostMemory(bytes); }},
        daemon_->config().max_rank_bytes,
        ReplicaLimits{kMaxReplicasPerOrigin, daemon_->config().replica_max_bytes_per_peer});
    service_.set_replica_store(replica_store_.get());
  }
  if (const ParitySender* parity = daemon_->parity()) {
    Daemon* daemon = daemon_;
    parity_store_ = std::make_unique<ParityStore>(
        parity->group(), parity->self(),
        HostMemory{[daemon](uint64_t bytes, const std::string& what) { return daemon->ReserveHostMemory(bytes, what); },
                   [daemon](uint64_t bytes) { daemon->ReleaseHostMemory(bytes); }});
    parity_service_ = std::make_unique<ParityService>(
        parity_store_.get(), daemon_->config().replica_allow_names, parity->hosts(),
        [daemon](const std::string& job, uint32_t rank, int64_t step, const std::string& run_id, int64_t resumed_from) {
          return daemon->OwnParityImage(job, rank, step, run_id, resumed_from);
        });
    parity_service_->set_heard_of([daemon](const std::string& job, int64_t step) { daemon->ParityHeardOf(job, step); });
    service_.set_parity_store(parity_store_.get());
  }
  // For every server built from here on (the TCP listener's too): grpc.health.v1.Health, SERVING.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kMaxRequestMessageBytes);
  builder.RegisterService(&service_);
  // Every call a handler refuses is logged with the peer's pid and uid (request_log.h).
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<RefusalLogFactory>(&peers_));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  server_ = builder.BuildAndStart();
  if (!server_) return Unavailable("could not start the gRPC server");
  listen_fd_ = fd.Release();  // closed in Shutdown
  acceptor_ = std::thread([this] { AcceptLoop(); });
  Logger("rpc")->info("listening socket={}", path);
  if (!daemon_->config().listen.empty()) {
    tcp_ = std::make_unique<TcpListener>(&service_, daemon_->config());
    RETURN_IF_ERROR(tcp_->Start());
  }
  if (replica_store_) {
    replica_ = std::make_unique<ReplicaServer>(replica_store_.get(), ReplicaListenConfigOf(daemon_->config()));
    if (parity_service_) replica_->AddService(parity_service_.get());
    RETURN_IF_ERROR(replica_->Start());
  }
  if (!daemon_->config().metrics_listen.empty()) {
    // Stopped before the replica listener and its store go (Shutdown).
    metrics_ = std::make_unique<MetricsHttpServer>(daemon_->config().metrics_listen, [this] {
      std::string text = daemon_->RenderMetrics();
      if (replica_) text += RenderReplicaMetrics(*replica_store_, replica_->service());
      if (parity_service_) text += RenderParityMetrics(*parity_store_, *parity_service_, *daemon_->parity());
      return text;
    });
    RETURN_IF_ERROR(metrics_->Start());
  }
  return Status::OK();
}

bool Server::PeerAllowed(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    Logger("rpc")->warn("refused peer: SO_PEERCRED failed: {}", std::strerror(errno));
    return false;
  }
  const DaemonConfig& c = daemon_->config();
  bool ok = cred.uid == 0 || cred.uid == ::getuid() ||
            std::find(c.allow_uids.begin(), c.allow_uids.end(), cred.uid) != c.allow_uids.end() ||
            std::find(c.allow_gids.begin(), c.allow_gids.end(), cred.gid) != c.allow_gids.end();
  if (!ok) {
    refused_ += 1;
    Logger("rpc")->warn("refused peer uid={} gid={} pid={} (allowed: root, uid {}, --allow-uid, --allow-gid)", cred.uid,
                        cred.gid, cred.pid, ::getuid());
  } else {
    peers_.Note(fd, PeerCredentials{cred.pid, cred.uid, cred.gid});  // gRPC's peer "fd:<fd>" from here on
  }
  return ok;
}

void Server::AcceptLoop() {
  while (!stopping_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    int ready = ::poll(&p, 1, 1000);  // Shutdown() wakes it; the timeout is a fallback
    if (ready <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    if (!PeerAllowed(fd)) {
      ::close(fd);
      continue;
    }
    grpc::AddInsecureChannelFromFd(server_.get(), fd);  // gRPC owns the fd from here on
  }
}

void Server::SetServing(bool serving) {
  if (server_ && server_->GetHealthCheckService() != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(serving);
  }
  if (tcp_) tcp_->SetServing(serving);
}

void Server::Shutdown(std::chrono::milliseconds grace) {
  const auto deadline = std::chrono::system_clock::now() + grace;  // one grace for both listeners
  if (metrics_) metrics_->Stop();
  metrics_.reset();
  // The TCP listener first: it forwards to service_.
  if (tcp_) tcp_->Shutdown(deadline);
  tcp_.reset();
  if (replica_) replica_->Shutdown(std::chrono::system_clock::now());  // peers push again; no grace taken
  replica_.reset();
  if (!server_) return;
  stopping_ = true;
  if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);  // wakes the acceptor's poll at once
  if (acceptor_.joinable()) acceptor_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
  server_->Shutdown(deadline);
  server_->Wait();
  server_.reset();
  ::unlink(daemon_->config().socket_path.c_str());
}

}  // namespace flashckpt

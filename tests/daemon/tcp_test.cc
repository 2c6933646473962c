// flashckptd as a real process with --listen, driven over TCP with the generated stub (the client
// library speaks only the UNIX socket). Without --tcp-allow-writes the read-only RPCs are served and
// every other one is PERMISSION_DENIED naming the flag, even with a session id obtained on the UNIX
// socket; with it, a whole save goes through TCP.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <regex>
#include <thread>

#include "common/io/fs.h"
#include "health.grpc.pb.h"
#include "raw_rpc.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;

// A flashckptd process on a socket and root under a fresh temporary directory, its output in
// daemon.log there.
class DaemonProcess {
 public:
  DaemonProcess() {
    char tmpl[] = "/tmp/flashckpt-tcp-test-XXXXXX";
    if (::mkdtemp(tmpl) != nullptr) dir_ = tmpl;
  }
  ~DaemonProcess() {
    Stop();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // Starts it with `extra` flags and waits (30 s) for the "listening tcp=HOST:PORT" line.
  Status Start(const std::vector<std::string>& extra) {
    if (dir_.empty()) return IOError("mkdtemp failed");
    std::vector<std::string> args = {FLASHCKPTD_PATH, "--socket",          socket(), "--root",
                                     dir_ + "/root",  "--max-host-memory", "64MiB"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string log = this->log();
    pid_ = ::fork();
    if (pid_ < 0) return ErrnoStatus("fork", FLASHCKPTD_PATH);
    if (pid_ == 0) {  // only async-signal-safe calls until exec
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (fd < 0) ::_exit(126);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    static const std::regex kListening("listening tcp=(\\S+):([0-9]+) ");
    auto deadline = std::chrono::steady_clock::now() + 30s;
    while (std::chrono::steady_clock::now() < deadline) {
      auto text = ReadSmallFile(log, 1 << 20);
      std::smatch m;
      if (text.ok() && std::regex_search(*text, m, kListening)) {
        port_ = std::stoi(m[2].str());
        return Status::OK();
      }
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return Unavailable("flashckptd exited before listening:\n" + (text.ok() ? *text : ""));
      }
      std::this_thread::sleep_for(20ms);
    }
    return DeadlineExceeded("flashckptd logged no 'listening tcp=' line within 30 s");
  }
  // SIGTERM without waiting.
  void Terminate() const {
    if (pid_ > 0) ::kill(pid_, SIGTERM);
  }
  // SIGTERM and wait: the exit status, or -1 when not running.
  int Stop() {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  std::string socket() const { return dir_ + "/flashckptd.sock"; }
  std::string root() const { return dir_ + "/root"; }
  std::string log() const { return dir_ + "/daemon.log"; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  std::unique_ptr<v1::Checkpoint::Stub> TcpStub() const {
    return v1::Checkpoint::NewStub(grpc::CreateChannel(address(), grpc::InsecureChannelCredentials()));
  }
  std::unique_ptr<v1::Checkpoint::Stub> UnixStub() const {
    return v1::Checkpoint::NewStub(grpc::CreateChannel("unix:" + socket(), grpc::InsecureChannelCredentials()));
  }

 private:
  std::string dir_;
  pid_t pid_ = -1;
  int port_ = 0;
};

// Every write RPC (all but GetStatus, ListCheckpoints and WatchEvents), as one call each with `session`.
std::vector<std::pair<std::string, grpc::Status>> CallEveryWriteRpc(v1::Checkpoint::Stub* stub,
                                                                    const std::string& session) {
  std::vector<std::pair<std::string, grpc::Status>> out;
  auto call = [&](const char* name, auto fn) {
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    out.emplace_back(name, fn(&ctx));
  };
  call("Register", [&](grpc::ClientContext* c) {
    v1::RegisterResponse r;
    return stub->Register(c, SmallRegistration(session), &r);
  });
  call("BeginSnapshot", [&](grpc::ClientContext* c) {
    v1::BeginSnapshotRequest q;
    q.set_session_id(session);
    q.set_step(1);
    v1::BeginSnapshotResponse r;
    return stub->BeginSnapshot(c, q, &r);
  });
  call("Commit", [&](grpc::ClientContext* c) {
    v1::CommitRequest q;
    q.set_session_id(session);
    q.set_step(1);
    v1::CommitResponse r;
    return stub->Commit(c, q, &r);
  });
  call("AbortSnapshot", [&](grpc::ClientContext* c) {
    v1::AbortSnapshotRequest q;
    q.set_session_id(session);
    v1::AbortSnapshotResponse r;
    return stub->AbortSnapshot(c, q, &r);
  });
  call("WaitPersisted", [&](grpc::ClientContext* c) {
    v1::WaitPersistedRequest q;
    q.set_session_id(session);
    q.set_step(1);
    v1::WaitPersistedResponse r;
    return stub->WaitPersisted(c, q, &r);
  });
  call("Restore", [&](grpc::ClientContext* c) {
    v1::RestoreRequest q;
    q.set_session_id(session);
    v1::RestoreResponse r;
    return stub->Restore(c, q, &r);
  });
  call("Restorable", [&](grpc::ClientContext* c) {
    v1::RestorableRequest q;
    q.set_session_id(session);
    v1::RestorableResponse r;
    return stub->Restorable(c, q, &r);
  });
  call("GetEma", [&](grpc::ClientContext* c) {
    v1::GetEmaRequest q;
    q.set_session_id(session);
    v1::GetEmaResponse r;
    return stub->GetEma(c, q, &r);
  });
  call("ReleaseSlot", [&](grpc::ClientContext* c) {
    v1::ReleaseSlotRequest q;
    q.set_session_id(session);
    v1::ReleaseSlotResponse r;
    return stub->ReleaseSlot(c, q, &r);
  });
  return out;
}

TEST(TcpListener, ServesStatusAndListAndRefusesEveryOtherRpcWithoutTheFlag) {
  DaemonProcess d;
  ASSERT_OK(d.Start({"--listen", "127.0.0.1:0"}));
  auto tcp = d.TcpStub();
  {
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::StatusResponse status;
    grpc::Status s = tcp->GetStatus(&ctx, v1::StatusRequest{}, &status);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(status.root(), d.root());
  }
  {
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::ListCheckpointsResponse list;
    grpc::Status s = tcp->ListCheckpoints(&ctx, v1::ListCheckpointsRequest{}, &list);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  // A trainer's session on the UNIX socket: its id does not open the TCP listener either.
  auto local = d.UnixStub();
  RawSession trainer(local.get(), "tcp-test", 0);
  ASSERT_FALSE(trainer.id().empty()) << trainer.status().error_message();
  int denied = 0;
  {
    RawSession remote(tcp.get(), "tcp-test", 1);
    EXPECT_TRUE(remote.id().empty());
    EXPECT_EQ(remote.status().error_code(), grpc::StatusCode::PERMISSION_DENIED) << remote.status().error_message();
    EXPECT_NE(remote.status().error_message().find("--tcp-allow-writes"), std::string::npos);
    denied += remote.status().error_code() == grpc::StatusCode::PERMISSION_DENIED;
  }
  for (const auto& [rpc, status] : CallEveryWriteRpc(tcp.get(), trainer.id())) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << rpc << ": " << status.error_message();
    EXPECT_NE(status.error_message().find("--tcp-allow-writes"), std::string::npos)
        << rpc << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(rpc), std::string::npos) << status.error_message();
    denied += status.error_code() == grpc::StatusCode::PERMISSION_DENIED;
  }
  std::printf("rpcs refused over tcp without --tcp-allow-writes: %d of 10\n", denied);
  EXPECT_EQ(denied, 10);

  // Nothing of that reached the daemon: the trainer registers on the socket as usual.
  grpc::ClientContext ctx;
  RawDeadline(&ctx);
  v1::RegisterResponse reg;
  grpc::Status s = local->Register(&ctx, SmallRegistration(trainer.id()), &reg);
  EXPECT_TRUE(s.ok()) << s.error_message();
  auto log = ReadSmallFile(d.log(), 1 << 20);
  ASSERT_OK(log.status());
  EXPECT_NE(log->find("refused tcp call rpc=Register"), std::string::npos) << *log;
}

TEST(TcpListener, ExitsZeroOnSigterm) {
  DaemonProcess d;
  ASSERT_OK(d.Start({"--listen", "127.0.0.1:0"}));
  auto tcp = d.TcpStub();
  {
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::StatusResponse status;
    ASSERT_TRUE(tcp->GetStatus(&ctx, v1::StatusRequest{}, &status).ok());
  }
  tcp.reset();  // an open connection would hold the shutdown for its whole grace (2 s)
  EXPECT_EQ(d.Stop(), 0) << "flashckptd must exit 0 on SIGTERM";
}

TEST(TcpListener, WithTcpAllowWritesAWholeSaveGoesThroughTcp) {
  DaemonProcess d;
  ASSERT_OK(d.Start({"--listen", "127.0.0.1:0", "--tcp-allow-writes"}));
  auto tcp = d.TcpStub();
  RawSession session(tcp.get(), "over-tcp", 0);
  ASSERT_FALSE(session.id().empty()) << session.status().error_message();
  {
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::RegisterResponse reg;
    grpc::Status s = tcp->Register(&ctx, SmallRegistration(session.id()), &reg);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_FALSE(reg.segment_name().empty());
  }
  v1::BeginSnapshotResponse ticket;
  {
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::BeginSnapshotRequest q;
    q.set_session_id(session.id());
    q.set_step(4);
    grpc::Status s = tcp->BeginSnapshot(&ctx, q, &ticket);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::CommitRequest q;
    q.set_session_id(session.id());
    q.set_slot(ticket.slot());
    q.set_generation(ticket.generation());
    q.set_step(4);
    q.set_persist(true);
    v1::CommitResponse r;
    grpc::Status s = tcp->Commit(&ctx, q, &r);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    RawDeadline(&ctx, 30s);
    v1::WaitPersistedRequest q;
    q.set_session_id(session.id());
    q.set_step(4);
    q.set_timeout_ms(20000);
    v1::WaitPersistedResponse r;
    grpc::Status s = tcp->WaitPersisted(&ctx, q, &r);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_TRUE(r.checkpoint_complete());
  }
  EXPECT_TRUE(PathExists(d.root() + "/over-tcp/checkpoint-4/metadata.json"));
  auto log = ReadSmallFile(d.log(), 1 << 20);
  ASSERT_OK(log.status());
  EXPECT_EQ(log->find("refused tcp call"), std::string::npos) << *log;
}

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

std::shared_ptr<grpc::Channel> Channel(const std::string& target) {
  return grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
}

// grpc.health.v1.Health/Check of the daemon as a whole ("").
grpc::Status Check(Health::Stub* stub, HealthCheckResponse* resp) {
  grpc::ClientContext ctx;
  RawDeadline(&ctx);
  return stub->Check(&ctx, HealthCheckRequest{}, resp);
}

// The standard health service on both listeners, the TCP one read-only: SERVING while up, a Watch
// sees NOT_SERVING once SIGTERM arrives, and nothing answers after the exit.
TEST(Health, ServingOnTheSocketAndTheReadOnlyTcpListenerThenNotServingOnSigterm) {
  DaemonProcess d;
  ASSERT_OK(d.Start({"--listen", "127.0.0.1:0"}));
  auto unix_health = Health::NewStub(Channel("unix:" + d.socket()));
  auto tcp_health = Health::NewStub(Channel(d.address()));
  for (Health::Stub* stub : {unix_health.get(), tcp_health.get()}) {
    HealthCheckResponse resp;
    grpc::Status s = Check(stub, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.status(), HealthCheckResponse::SERVING);
  }
  // A service name the daemon does not register is NOT_FOUND, as the protocol says.
  {
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    HealthCheckRequest req;
    req.set_service("no.such.Service");
    HealthCheckResponse resp;
    EXPECT_EQ(tcp_health->Check(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }

  grpc::ClientContext watch_ctx;
  RawDeadline(&watch_ctx, std::chrono::seconds(30));
  auto watch = unix_health->Watch(&watch_ctx, HealthCheckRequest{});
  HealthCheckResponse update;
  ASSERT_TRUE(watch->Read(&update));
  EXPECT_EQ(update.status(), HealthCheckResponse::SERVING);
  d.Terminate();
  ASSERT_TRUE(watch->Read(&update)) << "the Watch stream ended without a NOT_SERVING update";
  EXPECT_EQ(update.status(), HealthCheckResponse::NOT_SERVING);
  watch_ctx.TryCancel();
  (void)watch->Finish();
  EXPECT_EQ(d.Stop(), 0);

  HealthCheckResponse resp;
  EXPECT_EQ(Check(unix_health.get(), &resp).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Check(tcp_health.get(), &resp).error_code(), grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace flashckpt

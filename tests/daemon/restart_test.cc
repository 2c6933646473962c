// A trainer's first calls (Connect, Register) against a daemon that is down or restarting: they wait
// it out for ClientOptions::connect_timeout and then fail with kUnavailable, never earlier. And one
// daemon per state directory: a second one is refused before it adopts anything.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <thread>

#include "support/fault_injecting_io.h"
#include "common/io/fs.h"
#include "flashckpt/client.h"
#include "in_process_daemon.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

ClientOptions Options(const InProcessDaemon& d, const std::string& job, std::chrono::milliseconds patience) {
  ClientOptions o;
  o.socket_path = d.socket();
  o.job = job;
  o.rpc_timeout = 5s;
  o.slot_timeout = 2s;
  o.connect_timeout = patience;
  return o;
}

// One rank's tensors and its buffers.
struct Rank {
  std::vector<TensorSpec> specs = ModelAndMomentSpecs(1024);
  std::vector<float> w = std::vector<float>(1024, 1.5f), m = std::vector<float>(1024, -2.0f);
  std::vector<TensorBuffer> Buffers() {
    return {{"w", w.data(), w.size() * sizeof(float)}, {"w.exp_avg", m.data(), m.size() * sizeof(float)}};
  }
};

TEST(RestartTest, RegisterWaitsOutADaemonRestart) {
  InProcessDaemon d("flashckpt-restart-test");
  ASSERT_OK(d.Start());
  auto client = Client::Connect(Options(d, "reg", 10s));
  ASSERT_OK(client.status());
  // The daemon goes away after the session opened and comes back 1.5 s later: Register, called
  // while it is down, waits for it (the session is re-opened on the new daemon).
  d.Stop();
  std::thread restart([&] {
    std::this_thread::sleep_for(1500ms);
    ASSERT_OK(d.Start());
  });
  const auto begun = Clock::now();
  Rank rank;
  Status registered = (*client)->Register(Topology{}, rank.specs);
  const auto waited = Clock::now() - begun;
  restart.join();
  ASSERT_OK(registered);
  EXPECT_GE(waited, 1s) << "Register returned before the daemon was back";
  // The registration is the new daemon's: a save goes through it.
  auto snap = (*client)->Snapshot(1, rank.Buffers(), {});
  ASSERT_OK(snap.status());
  ASSERT_OK((*client)->WaitPersisted(1, 10s));
  EXPECT_TRUE(PathExists(d.root() + "/reg/checkpoint-1/metadata.json"));
}

TEST(RestartTest, RegisterGivesUpAtConnectTimeoutWhenTheDaemonStaysDown) {
  InProcessDaemon d("flashckpt-restart-test");
  ASSERT_OK(d.Start());
  auto client = Client::Connect(Options(d, "down", 1200ms));
  ASSERT_OK(client.status());
  d.Stop();
  const auto begun = Clock::now();
  Rank rank;
  Status registered = (*client)->Register(Topology{}, rank.specs);
  const auto waited = Clock::now() - begun;
  EXPECT_EQ(registered.code(), StatusCode::kUnavailable) << registered.ToString();
  EXPECT_NE(registered.message().find("connect_timeout"), std::string::npos) << registered.ToString();
  EXPECT_GE(waited, 1s);   // waited for the daemon ...
  EXPECT_LT(waited, 15s);  // ... and not without a bound
}

TEST(RestartTest, ConnectWaitsOutADaemonThatIsStopping) {
  // A daemon that has begun to stop still listens, but opens no session ("the daemon is
  // stopping", UNAVAILABLE): what a trainer started during `systemctl restart flashckptd` meets.
  InProcessDaemon d("flashckpt-restart-test");
  ASSERT_OK(d.Start());
  d.daemon()->Stop();
  {
    ClientOptions o = Options(d, "conn", 300ms);
    auto refused = Client::Connect(o);  // the stopping daemon is reached, and refuses the session
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status().ToString();
    EXPECT_NE(refused.status().message().find("stopping"), std::string::npos) << refused.status().ToString();
  }
  std::thread restart([&] {
    std::this_thread::sleep_for(1500ms);
    d.Stop();
    ASSERT_OK(d.Start());
  });
  const auto begun = Clock::now();
  auto client = Client::Connect(Options(d, "conn", 10s));
  const auto waited = Clock::now() - begun;
  restart.join();
  ASSERT_OK(client.status());
  EXPECT_GE(waited, 1s) << "Connect returned before the new daemon was up";
  Rank rank;
  ASSERT_OK((*client)->Register(Topology{}, rank.specs));
}

// One daemon per state directory: a second Daemon given a live one's state directory is refused at
// Start, names the owner and adopts nothing; the first goes on serving its trainer.
TEST(RestartTest, ASecondDaemonOnALiveStateDirectoryIsRefusedAndTouchesNothing) {
  InProcessDaemon live("flashckpt-restart-test");
  ASSERT_OK(live.Start());
  TestTrainer t = live.StartTrainer("held", 1024);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(1));
  const std::string state_dir = live.socket() + ".state";
  auto before = ListDir(state_dir);
  ASSERT_OK(before.status());

  InProcessDaemon second("flashckpt-restart-test");
  Status refused = second.Start([&](DaemonConfig& c) { c.state_dir = state_dir; });
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
  EXPECT_NE(refused.message().find("(pid " + std::to_string(::getpid()) + ") owns the state directory " + state_dir),
            std::string::npos)
      << refused.ToString();
  EXPECT_FALSE(PathExists(second.root())) << "the refused daemon made its root";
  second.Stop();
  auto after = ListDir(state_dir);
  ASSERT_OK(after.status());
  std::sort(before->begin(), before->end());
  std::sort(after->begin(), after->end());
  EXPECT_EQ(*after, *before) << "the refused daemon changed the live daemon's records";
  ASSERT_OK(t.Save(2));  // the live daemon's trainer never noticed
}

// The segments of `job` in /dev/shm, slot and EMA segments alike.
std::vector<std::string> SegmentsOf(const std::string& job) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("flashckpt." + job + ".", 0) == 0) out.push_back(name);
  }
  return out;
}

// The state directory is full: the record a registration writes first fails, and so does the one a
// commit writes before it is acknowledged. Each call fails naming the state directory; the failed
// registration leaves no segment, a failed commit loses no slot (more commits fail than there are
// slots), and once there is room again the rank registers and saves.
TEST(RestartTest, AFullStateDirectoryFailsRegistrationsAndCommitsAndLosesNothing) {
  FaultInjectingIo io;  // outlives the daemon
  InProcessDaemon d("flashckpt-restart-test");
  ASSERT_OK(d.Start([&](DaemonConfig& c) {
    c.state_io_env = &io;
    c.slots = 2;
  }));
  const std::string job = "full-state";
  auto client = d.Connect(job);
  ASSERT_TRUE(client);
  Rank rank;

  io.FailEvery(FaultInjectingIo::Op::kOpen, ENOSPC);
  const Status refused = client->Register(Topology{}, rank.specs);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
  EXPECT_NE(refused.message().find("state directory"), std::string::npos) << refused.ToString();
  EXPECT_EQ(SegmentsOf(job), std::vector<std::string>{}) << "a failed registration left its segment";

  io.Clear();
  ASSERT_OK(client->Register(Topology{}, rank.specs));
  io.FailEvery(FaultInjectingIo::Op::kOpen, ENOSPC);
  for (int64_t step = 1; step <= 3; ++step) {
    const Status failed = client->Snapshot(step, rank.Buffers(), {}).status();
    EXPECT_EQ(failed.code(), StatusCode::kResourceExhausted) << "step " << step << ": " << failed.ToString();
    EXPECT_NE(failed.message().find("state directory"), std::string::npos) << failed.ToString();
  }
  io.Clear();
  for (int64_t step = 4; step <= 7; ++step) {
    ASSERT_OK(client->Snapshot(step, rank.Buffers(), {}).status());
    ASSERT_OK(client->WaitPersisted(step, 10s));
  }
  EXPECT_GT(io.failures_injected(), 3u);
}

}  // namespace
}  // namespace flashckpt

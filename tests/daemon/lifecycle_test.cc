// The lifecycle of a job's memory and slots:
// - memory comes back: a job whose ranks have all gone gives its shared memory back after
//   --idle-release, or at once by ReleaseJob (flashckpt release), and only then;
// - a slot that a stopped trainer keeps filling shows its age in status and metrics.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>
#include <thread>

#include "client/cli/render.h"
#include "in_process_daemon.h"
#include "raw_rpc.h"
#include "support/offset_clock.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;

// Names in /dev/shm of the job's segments: its slot segments and its EMA segments.
std::set<std::string> ShmOf(const std::string& job) {
  std::set<std::string> out;
  const std::string prefix = "flashckpt." + job + ".";
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) out.insert(name);
  }
  return out;
}

bool Listed(const Daemon& d, const std::string& job) {
  const DaemonStatus status = d.GetStatus();
  return std::any_of(status.jobs.begin(), status.jobs.end(), [&](const JobStatus& j) { return j.job == job; });
}

// A unique job name per process, so that runs side by side do not meet in /dev/shm.
std::string JobName(const std::string& base) { return base + "-" + std::to_string(::getpid()); }

// A trainer with an EMA, one save persisted.
TestTrainer SavedTrainerWithEma(const InProcessDaemon& d, const std::string& job) {
  TestTrainer t;
  t.client = d.Connect(job);
  if (!t.client) return t;
  EmaOptions ema;
  ema.decay = 0.5;
  EXPECT_OK(t.client->Register(Topology{}, ModelAndMomentSpecs(1024), ema));
  t.w.resize(1024);
  t.m.resize(1024);
  t.bufs = {{"w", t.w.data(), 4096}, {"w.exp_avg", t.m.data(), 4096}};
  EXPECT_OK(t.Save(1));
  return t;
}

TEST(ReleaseTest, OperatorReleaseIsRefusedWhileARankIsConnectedThenFreesEverySegment) {
  InProcessDaemon d("flashckpt-release");
  ASSERT_OK(d.Start([](DaemonConfig& c) { c.idle_release = 0s; }));
  const std::string job = JobName("rel");
  TestTrainer t = SavedTrainerWithEma(d, job);
  ASSERT_TRUE(t.client);
  const std::set<std::string> segments = ShmOf(job);
  ASSERT_TRUE(segments.count(d.daemon()->EmaSegmentName(job, 0))) << "the EMA has its own segment";
  ASSERT_EQ(segments.size(), 2u);
  const uint64_t used = d.daemon()->GetStatus().host_memory_used;
  ASSERT_GT(used, 0u);

  auto refused = d.daemon()->ReleaseJob(job);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(refused.status().message(), "rank 0 is connected")) << refused.status().ToString();
  EXPECT_EQ(ShmOf(job), segments) << "a refused release touches nothing";

  auto events = d.daemon()->events().Subscribe(job);
  ASSERT_OK(events.status());
  t.client.reset();  // the trainer exits
  // The session's end reaches the daemon when the stream breaks: moments later.
  Result<ReleaseOutcome> released = NotFound("not tried");
  for (auto deadline = std::chrono::steady_clock::now() + 10s; std::chrono::steady_clock::now() < deadline;) {
    released = d.daemon()->ReleaseJob(job);
    if (released.ok() || released.status().code() != StatusCode::kFailedPrecondition) break;
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_OK(released.status());
  EXPECT_EQ(released->ranks, 1u);
  EXPECT_EQ(released->bytes, used);
  EXPECT_EQ(d.daemon()->GetStatus().host_memory_used, 0u);
  EXPECT_TRUE(ShmOf(job).empty()) << "slot and EMA segments are unlinked";
  EXPECT_FALSE(Listed(*d.daemon(), job));
  DaemonEvent event;
  ASSERT_EQ(events->Next(&event, std::chrono::steady_clock::now() + 5s), EventHub::Wait::kEvent);
  EXPECT_EQ(event.kind, DaemonEvent::Kind::kJobReleased);
  EXPECT_EQ(event.bytes, used);
  EXPECT_EQ(event.reason, "release");

  EXPECT_EQ(d.daemon()->ReleaseJob(job).status().code(), StatusCode::kNotFound) << "released once";
  // The checkpoint stays; the job comes back by registering again.
  EXPECT_TRUE(std::filesystem::exists(d.StepDir(job, 1) + "/metadata.json"));
  TestTrainer again = d.StartTrainer(job, 1024);  // the layout SavedTrainerWithEma saved
  ASSERT_TRUE(again.client);
  ASSERT_OK(again.client->Restore(std::nullopt, again.bufs, 10s).status());
  EXPECT_OK(again.Save(2));
}

TEST(ReleaseTest, AJobIdleForIdleReleaseGivesItsMemoryBack) {
  InProcessDaemon d("flashckpt-release");
  ASSERT_OK(d.Start([](DaemonConfig& c) { c.idle_release = 1s; }));
  const std::string idle = JobName("idle"), busy = JobName("busy");
  {
    TestTrainer t = SavedTrainerWithEma(d, idle);
    ASSERT_TRUE(t.client);
  }
  TestTrainer live = d.StartTrainer(busy, 1024);
  ASSERT_TRUE(live.client);
  ASSERT_OK(live.Save(1));
  ASSERT_EQ(ShmOf(idle).size(), 2u);
  const auto gone = std::chrono::steady_clock::now();
  while (Listed(*d.daemon(), idle) && std::chrono::steady_clock::now() - gone < 15s) std::this_thread::sleep_for(50ms);
  const double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - gone).count();
  EXPECT_FALSE(Listed(*d.daemon(), idle)) << "still held after " << after << " s";
  EXPECT_GE(after, 0.9) << "released before --idle-release ran out";
  // The segments are unlinked just after the job leaves the table (off the daemon's lock).
  const auto unlinked_by = std::chrono::steady_clock::now() + 5s;
  while (!ShmOf(idle).empty() && std::chrono::steady_clock::now() < unlinked_by) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(ShmOf(idle).empty());
  // A connected job keeps its memory however long it is idle.
  std::this_thread::sleep_for(1500ms);
  EXPECT_TRUE(Listed(*d.daemon(), busy));
  EXPECT_EQ(ShmOf(busy).size(), 1u);
  EXPECT_OK(live.Save(2));
}

// The idle release reads the daemon's clock (DaemonConfig::clock): moved an hour ahead, a job idle
// for a few seconds of real time is past a 10-minute --idle-release, and the housekeeper's next pass
// (at most 10 s later) releases it.
TEST(ReleaseTest, TheIdleReleaseGoesByTheDaemonsClock) {
  OffsetClock clock;
  InProcessDaemon d("flashckpt-release");
  ASSERT_OK(d.Start([&](DaemonConfig& c) {
    c.idle_release = 10min;
    c.clock = &clock;
  }));
  const std::string idle = JobName("idle");
  {
    TestTrainer t = d.StartTrainer(idle, 1024);
    ASSERT_TRUE(t.client);
    ASSERT_OK(t.Save(1));
  }
  ASSERT_TRUE(Listed(*d.daemon(), idle));
  // The clock moves once the daemon has seen the trainer go (its stream's end reaches the daemon
  // after the client is gone): the idle time counts from then.
  const auto closed_by = std::chrono::steady_clock::now() + 10s;
  while (d.daemon()->CountSessions().connected != 0 && std::chrono::steady_clock::now() < closed_by) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(d.daemon()->CountSessions().connected, 0u) << "the trainer's session is still open";
  clock.Advance(1h);
  const auto moved = std::chrono::steady_clock::now();
  while (Listed(*d.daemon(), idle) && std::chrono::steady_clock::now() - moved < 30s) std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(Listed(*d.daemon(), idle)) << "not released 30 s after the clock passed --idle-release";
}

TEST(ReleaseTest, ABudgetRefusalSaysHowMuchDisconnectedJobsHold) {
  InProcessDaemon d("flashckpt-release");
  // Room for one rank of 4 MiB (2 slots of 8 MiB) but not two.
  ASSERT_OK(d.Start([](DaemonConfig& c) {
    c.idle_release = 0s;
    c.max_host_memory = 24ull << 20;
  }));
  const std::string first = JobName("first"), second = JobName("second");
  {
    TestTrainer t = d.StartTrainer(first, 1 << 20);
    ASSERT_TRUE(t.client);
    ASSERT_OK(t.Save(1));
  }
  auto c = d.Connect(second);
  ASSERT_TRUE(c);
  Status refused;
  for (auto deadline = std::chrono::steady_clock::now() + 10s; std::chrono::steady_clock::now() < deadline;) {
    refused = c->Register(Topology{}, ModelAndMomentSpecs(1 << 20));
    if (Contains(refused.message(), "no rank connected")) break;  // once the first job's session has ended
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
  EXPECT_TRUE(Contains(refused.message(), "belongs to jobs with no rank connected")) << refused.ToString();
  EXPECT_TRUE(Contains(refused.message(), "flashckpt release --job")) << refused.ToString();
  ASSERT_OK(d.daemon()->ReleaseJob(first).status());
  EXPECT_OK(c->Register(Topology{}, ModelAndMomentSpecs(1 << 20)));
}

TEST(ReleaseTest, ASnapshotStillBeingWrittenKeepsTheJob) {
  FaultInjectingIo io;
  InProcessDaemon d("flashckpt-release");
  ASSERT_OK(d.Start([&](DaemonConfig& c) {
    c.idle_release = 1s;
    c.io_env = &io;
  }));
  const std::string job = JobName("slow");
  {
    TestTrainer t = d.StartTrainer(job, 1024);
    ASSERT_TRUE(t.client);
    io.SlowWrites(4s);
    ASSERT_OK(t.Snapshot(1).status());
  }  // the trainer exits with its snapshot committed, not yet written
  std::this_thread::sleep_for(300ms);
  auto refused = d.daemon()->ReleaseJob(job);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status().ToString();
  EXPECT_TRUE(Contains(refused.status().message(), "step 1")) << refused.status().ToString();
  std::this_thread::sleep_for(2s);  // idle for longer than --idle-release, but still writing
  EXPECT_TRUE(Listed(*d.daemon(), job));
  io.Clear();
  const auto start = std::chrono::steady_clock::now();
  while (Listed(*d.daemon(), job) && std::chrono::steady_clock::now() - start < 20s) std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(Listed(*d.daemon(), job)) << "released once written";
  EXPECT_TRUE(std::filesystem::exists(d.StepDir(job, 1) + "/metadata.json")) << "the snapshot was written first";
  d.Stop();
}

// A trainer stopped between BeginSnapshot and Commit (SIGSTOP, a debugger): its slot stays filling,
// and status, the CLI and the metrics say for how long.
TEST(StalledFillTest, StatusAndMetricsShowHowLongASlotHasBeenFilling) {
  InProcessDaemon d("flashckpt-stalled");
  ASSERT_OK(d.Start());
  const std::string job = JobName("stalled");
  auto stub = v1::Checkpoint::NewStub(grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials()));
  RawSession session(stub.get(), job, 0);
  ASSERT_FALSE(session.id().empty()) << session.status().error_message();
  {
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::RegisterResponse resp;
    ASSERT_TRUE(stub->Register(&ctx, SmallRegistration(session.id()), &resp).ok());
  }
  {
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::BeginSnapshotRequest req;
    req.set_session_id(session.id());
    req.set_step(7);
    v1::BeginSnapshotResponse resp;
    ASSERT_TRUE(stub->BeginSnapshot(&ctx, req, &resp).ok());
  }  // and no Commit: the trainer stopped here
  std::this_thread::sleep_for(1200ms);
  const DaemonStatus status = d.daemon()->GetStatus();
  ASSERT_EQ(status.jobs.size(), 1u);
  const RankStatus& rank = status.jobs[0].ranks.at(0);
  double filling = 0;
  for (const SlotStatus& slot : rank.slots) {
    if (slot.state == "filling") {
      EXPECT_EQ(slot.step, 7);
      filling = slot.filling_seconds;
    } else {
      EXPECT_EQ(slot.filling_seconds, 0) << slot.state;
    }
  }
  EXPECT_GE(filling, 1.0);
  EXPECT_LT(filling, 60.0);
  EXPECT_TRUE(Contains(cli::StatusText(status), "filling@7(1s)")) << cli::StatusText(status);
  const std::string metrics = d.daemon()->RenderMetrics();
  const std::string sample = "flashckpt_oldest_filling_seconds{job=\"" + job + "\"} ";
  const size_t at = metrics.find(sample);
  ASSERT_NE(at, std::string::npos) << metrics;
  EXPECT_GE(std::stod(metrics.substr(at + sample.size())), 1.0);
}

}  // namespace
}  // namespace flashckpt

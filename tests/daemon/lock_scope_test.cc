// The daemon's lock is never held across I/O: a rank whose registration is making its segment (in
// production: allocating and populating gigabytes of shared memory) holds up neither another rank's
// snapshots nor status, and status's first read of a huge root holds up no snapshot. Shown without
// timing: the test holds the daemon inside the I/O at a gate (an IoEnv) and drives the other rank
// meanwhile. A real daemon behind its gRPC service, driven by the real client library.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "common/io/fs.h"
#include "common/io/io_env.h"
#include "flashckpt.pb.h"
#include "flashckpt/client.h"
#include "in_process_daemon.h"
#include "io_gate.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// A registration writes its segment's record in the state directory, then makes the segment (in
// production the part that takes seconds), both in one call off the daemon's lock. The test holds
// the big rank's registration at the record's open while the small rank saves and persists six steps
// (three times its slots) and status is called: each would wait for the gate if the registration
// held the lock.
TEST(LockScopeTest, ARegistrationOffTheLockHoldsUpNoSnapshotAndNoStatus) {
  IoGate gate;
  GatedOpens io(&gate, "/flashckpt.big.");  // the big rank's records; outlives the daemon
  InProcessDaemon d("flashckpt-lock-scope-test");
  ASSERT_OK(d.Start([&](DaemonConfig& c) {
    c.state_io_env = &io;
    c.sweep_interval = std::chrono::milliseconds(0);
  }));
  auto small = d.Connect("small", 0);
  ASSERT_TRUE(small);
  std::vector<float> w(4096, 1.f), m(4096, 2.f);
  std::vector<TensorBuffer> bufs{{"w", w.data(), w.size() * 4}, {"w.exp_avg", m.data(), m.size() * 4}};
  ASSERT_OK(small->Register(Topology{}, ModelAndMomentSpecs(w.size())));
  auto big = d.Connect("big", 0, [](ClientOptions& o) { o.rpc_timeout = 100s; });  // held at the gate meanwhile
  ASSERT_TRUE(big);

  gate.Close();
  Status registered = Internal("the registration did not return");
  std::thread registration([&] { registered = big->Register(Topology{}, ModelAndMomentSpecs(64ull << 10)); });
  OpenAndJoinAtExit at_exit(&gate, &registration);
  for (int i = 0; i < 2000 && !gate.Holding(); ++i) std::this_thread::sleep_for(5ms);
  ASSERT_TRUE(gate.Holding()) << "the registration did not write its segment's record";

  constexpr int64_t kSteps = 6;  // three times the slots: persists must finish for snapshots to go on
  double worst_status = 0;
  for (int64_t step = 1; step <= kSteps; ++step) {
    const Status snapped = small->Snapshot(step, bufs, {}).status();
    ASSERT_TRUE(snapped.ok()) << "step " << step << ": " << snapped.ToString();
    const Status persisted = small->WaitPersisted(step, 10s);
    ASSERT_TRUE(persisted.ok()) << "step " << step << ": " << persisted.ToString();
    const auto begun = Clock::now();
    const DaemonStatus status = d.daemon()->GetStatus();
    worst_status = std::max(worst_status, Ms(Clock::now() - begun));
    auto job = std::find_if(status.jobs.begin(), status.jobs.end(), [](const auto& j) { return j.job == "small"; });
    ASSERT_NE(job, status.jobs.end());
    EXPECT_EQ(job->last_complete_step, step) << job->catalog_error;
  }
  EXPECT_TRUE(gate.Holding()) << "the registration went on before the gate opened: the test showed nothing";
  EXPECT_FALSE(gate.timed_out()) << "the registration waited out the gate's limit";

  gate.Open();
  registration.join();
  ASSERT_OK(registered);
  std::printf("FIGURES steps=%lld persisted while a registration was held, worst_status_ms=%.1f\n",
              static_cast<long long>(kSteps), worst_status);
}

// A long run keeps every checkpoint (retention off): tens of thousands of step directories. Status
// reads the root off the daemon's lock, once, and then knows the newest complete step: later calls
// read nothing from the root, and no snapshot or persist waits for the read. Shown without timing:
// the test holds status's listing of the job directory at a gate while the trainer saves steps.
TEST(LockScopeTest, StatusStaysFastWithTensOfThousandsOfStepDirectories) {
  IoGate gate;
  GatedListings io(&gate, "/long");  // outlives the daemon
  InProcessDaemon d("flashckpt-lock-scope-test");
  auto through_gate = [&](DaemonConfig& c) {
    c.io_env = &io;
    c.sweep_interval = std::chrono::milliseconds(0);  // only status reads the job directory here
  };
  ASSERT_OK(d.Start(through_gate));
  auto client = d.Connect("long", 0);
  ASSERT_TRUE(client);
  std::vector<float> w(1024, 1.f), m(1024, 2.f);
  std::vector<TensorBuffer> bufs{{"w", w.data(), w.size() * 4}, {"w.exp_avg", m.data(), m.size() * 4}};
  ASSERT_OK(client->Register(Topology{}, ModelAndMomentSpecs(w.size())));
  ASSERT_OK(client->Snapshot(1, bufs, {}).status());
  ASSERT_OK(client->WaitPersisted(1, 10s));
  // 50,000 newer directories that never completed (what a reader must look into, newest first).
  constexpr int kDirs = 50000;
  for (int i = 0; i < kDirs; ++i) {
    ASSERT_OK(MakeDirs(d.root() + "/long/checkpoint-" + std::to_string(100000 + i)));
  }
  // The daemon completed step 1 itself, so it knows it; a restarted daemon reads the root once.
  d.Stop();
  ASSERT_OK(d.Start(through_gate));
  client = d.Connect("long", 0);
  ASSERT_TRUE(client);
  ASSERT_OK(client->Register(Topology{}, ModelAndMomentSpecs(w.size())));
  ASSERT_OK(client->Restore(std::nullopt, bufs, 10s).status());  // a new process carries on by restoring

  // The first status call reads the root and is held in its listing; the trainer saves meanwhile.
  gate.Close();
  const uint64_t listings_before = io.listings();
  DaemonStatus first;
  double first_ms = 0;
  std::thread status_thread([&] {
    const auto begun = Clock::now();
    first = d.daemon()->GetStatus();
    first_ms = Ms(Clock::now() - begun);
  });
  OpenAndJoinAtExit at_exit(&gate, &status_thread);
  for (int i = 0; i < 2000 && !gate.Holding(); ++i) std::this_thread::sleep_for(5ms);
  ASSERT_TRUE(gate.Holding()) << "status did not list the job directory";

  constexpr int64_t kSteps = 6;  // three times the slots: persists must finish for snapshots to go on
  for (int64_t step = 2; step < 2 + kSteps; ++step) {
    const Status snapped = client->Snapshot(step, bufs, {}).status();
    ASSERT_TRUE(snapped.ok()) << "step " << step << ": " << snapped.ToString();
    const Status persisted = client->WaitPersisted(step, 10s);
    ASSERT_TRUE(persisted.ok()) << "step " << step << " waited for status to read the root: " << persisted.ToString();
  }
  EXPECT_TRUE(gate.Holding()) << "status finished before the gate opened: the test showed nothing";
  EXPECT_FALSE(gate.timed_out()) << "status waited out the gate's limit";

  gate.Open();
  status_thread.join();
  ASSERT_EQ(first.jobs.size(), 1u);
  EXPECT_EQ(first.jobs[0].last_complete_step, 1 + kSteps) << first.jobs[0].catalog_error;
  EXPECT_EQ(io.listings(), listings_before + 1);

  // The listing was made before steps 2.. completed, so the read found step 1; the completions it
  // missed were noted meanwhile. Later calls know the newest step and read nothing.
  const uint64_t listings = io.listings(), stats = io.stats_under();
  double worst_later = 0;
  for (int i = 0; i < 20; ++i) {
    const auto begun = Clock::now();
    DaemonStatus later = d.daemon()->GetStatus();
    worst_later = std::max(worst_later, Ms(Clock::now() - begun));
    ASSERT_EQ(later.jobs.size(), 1u);
    ASSERT_EQ(later.jobs[0].last_complete_step, 1 + kSteps) << later.jobs[0].catalog_error;
  }
  EXPECT_EQ(io.listings(), listings) << "status lists the job directory on every call";
  EXPECT_EQ(io.stats_under(), stats) << "status looks into step directories on every call";
  std::printf(
      "FIGURES dirs=%d first_status_ms=%.1f (held at the gate while %lld steps persisted) "
      "later_worst_status_ms=%.2f\n",
      kDirs, first_ms, static_cast<long long>(kSteps), worst_later);
}

}  // namespace
}  // namespace flashckpt

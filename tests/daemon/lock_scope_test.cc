// The daemon's lock is never held across I/O: a rank that registers gigabytes (allocating and
// populating its segment) holds up neither another rank's snapshots nor status. A real daemon behind
// its gRPC service, driven by the real client library from three threads.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "common/io/fs.h"
#include "flashckpt.pb.h"
#include "flashckpt/client.h"
#include "in_process_daemon.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

TEST(LockScopeTest, ALargeRegistrationHoldsUpNoSnapshotAndNoStatus) {
  InProcessDaemon d("flashckpt-lock-scope-test");
  constexpr uint64_t kBigElements = 256ull << 20;  // two fp32 tensors of 1 GiB: 2 GiB a slot, 4 GiB in all
  ASSERT_OK(d.Start([](DaemonConfig& c) { c.max_host_memory = 6ull << 30; }));

  // The small rank skips a step when both its slots are still being written instead of waiting for
  // one: how long the disk takes to persist is not what this test measures (a CI machine flushing
  // gigabytes of build output made a slot wait of seconds), the daemon's lock is.
  auto small = d.Connect("small", 0, [](ClientOptions& o) { o.skip_when_busy = true; });
  ASSERT_TRUE(small);
  std::vector<float> w(4096, 1.f), m(4096, 2.f);
  std::vector<TensorBuffer> bufs{{"w", w.data(), w.size() * 4}, {"w.exp_avg", m.data(), m.size() * 4}};
  ASSERT_OK(small->Register(Topology{}, ModelAndMomentSpecs(w.size())));
  auto big = d.Connect("big", 0, [](ClientOptions& o) { o.rpc_timeout = 120s; });  // seconds to make 4 GiB
  ASSERT_TRUE(big);

  std::atomic<bool> registering{false}, done{false};
  double worst_snapshot = 0, worst_status = 0;  // during the registration, each written by one thread
  Clock::time_point worst_snapshot_at;           // when the worst snapshot began
  int snapshots = 0, skipped = 0, statuses = 0;
  Status snapshot_error;
  std::thread saver([&] {
    for (int64_t step = 1; !done; ++step) {
      const auto begun = Clock::now();
      auto snap = small->Snapshot(step, bufs, {});
      const double ms = Ms(Clock::now() - begun);
      if (snap.status().code() == StatusCode::kResourceExhausted) {
        ++skipped;  // both slots busy: the step is skipped, the call returned at once
      } else if (!snap.ok()) {
        snapshot_error = snap.status();
        return;
      }
      if (registering) {
        if (ms > worst_snapshot) worst_snapshot_at = begun;
        worst_snapshot = std::max(worst_snapshot, ms);
        ++snapshots;
      }
      std::this_thread::sleep_for(10ms);
    }
  });
  std::thread poller([&] {
    while (!done) {
      const auto begun = Clock::now();
      (void)d.daemon()->GetStatus();
      const double ms = Ms(Clock::now() - begun);
      if (registering) {
        worst_status = std::max(worst_status, ms);
        ++statuses;
      }
      std::this_thread::sleep_for(20ms);
    }
  });

  std::this_thread::sleep_for(200ms);  // both loops running
  registering = true;
  const auto begun = Clock::now();
  Status registered = big->Register(Topology{}, ModelAndMomentSpecs(kBigElements));
  const double registration = Ms(Clock::now() - begun);
  registering = false;
  done = true;
  saver.join();
  poller.join();
  ASSERT_OK(registered);
  ASSERT_OK(snapshot_error);
  // When the worst snapshot began, from the start of the registration (compare with the daemon's
  // "created segment" log line: the daemon's part ends there, the client's mapping follows).
  std::printf("FIGURES registration_ms=%.0f worst_snapshot_ms=%.1f (%d snapshots, %d skipped for a busy slot, the "
              "worst began at %.0f ms) worst_status_ms=%.1f (%d calls)\n",
              registration, worst_snapshot, snapshots, skipped, Ms(worst_snapshot_at - begun), worst_status,
              statuses);
  // Making 4 GiB of shared memory takes seconds; a call that waited for it would take as long.
  ASSERT_GT(registration, 400) << "the registration was too quick to show anything";
  EXPECT_GT(snapshots, 0);
  EXPECT_GT(statuses, 0);
  EXPECT_LT(worst_snapshot, registration / 4) << "a snapshot of another rank waited for the registration";
  EXPECT_LT(worst_status, registration / 4) << "a status call waited for the registration";
}

// A long run keeps every checkpoint (retention off): tens of thousands of step directories. Status
// reads the root off the daemon's lock, once, and then knows the newest complete step: its cost does
// not grow with the directories, and no snapshot waits for it.
TEST(LockScopeTest, StatusStaysFastWithTensOfThousandsOfStepDirectories) {
  InProcessDaemon d("flashckpt-lock-scope-test");
  ASSERT_OK(d.Start());
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
  auto status_ms = [&] {
    const auto begun = Clock::now();
    DaemonStatus status = d.daemon()->GetStatus();
    EXPECT_GE(status.jobs[0].last_complete_step, 1) << status.jobs[0].catalog_error;
    return Ms(Clock::now() - begun);
  };
  // The daemon completed step 1 itself, so it knows it; a restarted daemon reads the root once.
  d.Stop();
  ASSERT_OK(d.Start());
  client = d.Connect("long", 0);
  ASSERT_TRUE(client);
  ASSERT_OK(client->Register(Topology{}, ModelAndMomentSpecs(w.size())));

  // The first status call reads the root; snapshots go on meanwhile.
  std::atomic<bool> reading{true};
  double first = 0;
  std::thread status_thread([&] {
    first = status_ms();
    reading = false;
  });
  double worst_snapshot = 0;
  int snapshots = 0;
  for (int64_t step = 2; reading; ++step) {
    const auto begun = Clock::now();
    auto snap = client->Snapshot(step, bufs, {});
    ASSERT_OK(snap.status());
    worst_snapshot = std::max(worst_snapshot, Ms(Clock::now() - begun));
    ++snapshots;
  }
  status_thread.join();
  double worst_later = 0;
  for (int i = 0; i < 20; ++i) worst_later = std::max(worst_later, status_ms());
  std::printf("FIGURES dirs=%d first_status_ms=%.1f later_worst_status_ms=%.2f snapshots_during_first=%d "
              "worst_snapshot_ms=%.1f\n",
              kDirs, first, worst_later, snapshots, worst_snapshot);
  EXPECT_LT(worst_later, std::max(5.0, first / 10)) << "status reads the root on every call";
  if (first > 50) {
    EXPECT_GT(snapshots, 0);
    EXPECT_LT(worst_snapshot, first / 2) << "a snapshot waited for status to read the root";
  }
}

}  // namespace
}  // namespace flashckpt

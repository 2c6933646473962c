// The daemon's lock is never held across I/O: a rank that registers gigabytes (allocating and
// populating its segment) holds up neither another rank's snapshots nor status. A real daemon behind
// its gRPC service, driven by the real client library from three threads.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "common/base/mutex.h"
#include "common/io/fs.h"
#include "common/io/io_env.h"
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

// Holds every listing of one directory (a path that ends with `suffix`) until Open(), and counts the
// listings and stats made under it: a status call that read the root would be seen, however fast the
// disk. Every other call goes straight to the OS.
class GatedListing final : public IoEnv {
 public:
  explicit GatedListing(std::string suffix) : suffix_(std::move(suffix)) {}
  void Close() {
    MutexLock lock(&mu_);
    closed_ = true;
  }
  void Open() {
    MutexLock lock(&mu_);
    closed_ = false;
    cv_.NotifyAll();
  }
  // Whether a listing is held at the gate now.
  bool Holding() {
    MutexLock lock(&mu_);
    return held_ > 0;
  }
  uint64_t listings() const { return listings_.load(); }
  uint64_t stats_under() const { return stats_under_.load(); }

  ssize_t Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) override {
    return base_->Pwrite(fd, buf, bytes, offset);
  }
  int Ftruncate(int fd, uint64_t bytes) override { return base_->Ftruncate(fd, bytes); }
  int Fdatasync(int fd) override { return base_->Fdatasync(fd); }
  int Fsync(int fd) override { return base_->Fsync(fd); }
  int Rename(const std::string& from, const std::string& to) override { return base_->Rename(from, to); }
  int Open(const std::string& path, int flags, unsigned mode) override { return base_->Open(path, flags, mode); }
  ssize_t Pread(int fd, void* buf, size_t bytes, uint64_t offset) override {
    return base_->Pread(fd, buf, bytes, offset);
  }
  int Stat(const std::string& path, struct stat* st) override {
    if (path.find(suffix_ + "/") != std::string::npos) stats_under_.fetch_add(1);
    return base_->Stat(path, st);
  }
  // The listing is made first and handed back when the gate opens: what is created meanwhile is
  // not in it.
  int ListDir(const std::string& dir, std::vector<std::string>* names) override {
    const int rc = base_->ListDir(dir, names);
    if (dir.size() >= suffix_.size() && dir.compare(dir.size() - suffix_.size(), suffix_.size(), suffix_) == 0) {
      listings_.fetch_add(1);
      MutexLock lock(&mu_);
      ++held_;
      // Bounded: a test that forgot to open the gate fails instead of hanging.
      const auto deadline = Clock::now() + 60s;
      while (closed_) {
        if (!cv_.WaitUntil(&lock, deadline)) break;
      }
      --held_;
    }
    return rc;
  }
  int Unlink(const std::string& path) override { return base_->Unlink(path); }
  int Mkdir(const std::string& path, unsigned mode) override { return base_->Mkdir(path, mode); }

 private:
  IoEnv* const base_ = IoEnv::Default();
  const std::string suffix_;
  Mutex mu_;
  CondVar cv_;
  bool closed_ GUARDED_BY(mu_) = false;
  int held_ GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> listings_{0}, stats_under_{0};
};

// A long run keeps every checkpoint (retention off): tens of thousands of step directories. Status
// reads the root off the daemon's lock, once, and then knows the newest complete step: later calls
// read nothing from the root, and no snapshot or persist waits for the read. Shown without timing:
// the test holds status's listing of the job directory at a gate while the trainer saves steps.
TEST(LockScopeTest, StatusStaysFastWithTensOfThousandsOfStepDirectories) {
  GatedListing io("/long");  // outlives the daemon
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

  // The first status call reads the root and is held in its listing; the trainer saves meanwhile.
  io.Close();
  struct OpenAtExit {
    GatedListing* io;
    ~OpenAtExit() { io->Open(); }
  } open_at_exit{&io};
  const uint64_t listings_before = io.listings();
  DaemonStatus first;
  double first_ms = 0;
  std::thread status_thread([&] {
    const auto begun = Clock::now();
    first = d.daemon()->GetStatus();
    first_ms = Ms(Clock::now() - begun);
  });
  struct JoinAtExit {
    std::thread* t;
    GatedListing* io;
    ~JoinAtExit() {
      io->Open();
      if (t->joinable()) t->join();
    }
  } join_at_exit{&status_thread, &io};
  for (int i = 0; i < 2000 && !io.Holding(); ++i) std::this_thread::sleep_for(5ms);
  ASSERT_TRUE(io.Holding()) << "status did not list the job directory";

  constexpr int64_t kSteps = 6;  // three times the slots: persists must finish for snapshots to go on
  for (int64_t step = 2; step < 2 + kSteps; ++step) {
    const Status snapped = client->Snapshot(step, bufs, {}).status();
    ASSERT_TRUE(snapped.ok()) << "step " << step << ": " << snapped.ToString();
    const Status persisted = client->WaitPersisted(step, 10s);
    ASSERT_TRUE(persisted.ok()) << "step " << step << " waited for status to read the root: " << persisted.ToString();
  }
  EXPECT_TRUE(io.Holding()) << "status finished before the gate opened: the test showed nothing";

  io.Open();
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
  std::printf("FIGURES dirs=%d first_status_ms=%.1f (held at the gate while %lld steps persisted) "
              "later_worst_status_ms=%.2f\n",
              kDirs, first_ms, static_cast<long long>(kSteps), worst_later);
}

}  // namespace
}  // namespace flashckpt

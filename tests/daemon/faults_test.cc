// Saves under injected file-system faults (tests/support/fault_injecting_io.h, given to the daemon through
// DaemonConfig::io_env): a real daemon behind its gRPC service on a temporary socket, driven by the
// real client library. What trainers and operators rely on:
// - a save whose Nth write (or fdatasync, rename, fsync of the directory) fails leaves no complete
//   checkpoint and no partial file of the step, leaves earlier checkpoints whole and LATEST alone,
//   frees its slot, is reported by WaitPersisted (the code tells a full disk from a failing one; the
//   message names the step, the file and the errno text) and in status; the next save works;
// - on a slow disk Snapshot() never waits for the writer beyond the backpressure policy, and status
//   shows how long the oldest write has been running;
// - with fatal_persist_errors, the snapshots after a failed save fail with its error.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "client/cli/render.h"
#include "common/format/layout.h"
#include "common/format/metadata.h"
#include "support/fault_injecting_io.h"
#include "common/io/fs.h"
#include "common/io/shm.h"
#include "common/read/verify.h"
#include "daemon/edge/wire.h"
#include "flashckpt.grpc.pb.h"
#include "flashckpt/admin.h"
#include "flashckpt/client.h"
#include "in_process_daemon.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;
using Op = FaultInjectingIo::Op;
using Clock = std::chrono::steady_clock;

class FaultsTest : public FaultyIoDaemonTest {
 protected:
  FaultsTest() : FaultyIoDaemonTest("flashckpt-faults-test") {}

  std::string Latest(const std::string& job) const {
    auto latest = ReadSmallFile(JobDir(job) + "/LATEST", 100);
    return latest.ok() ? *latest : latest.status().ToString();
  }
  // Rank 0 of the (one) job, as the daemon reports it.
  v1::RankStatus RankStatus() const {
    v1::StatusResponse s = ToProto(d_.daemon()->GetStatus());  // as the service sends it
    v1::RankStatus out;
    if (s.jobs_size() > 0 && s.jobs(0).ranks_size() > 0) out = s.jobs(0).ranks(0);
    return out;
  }
  // Waits (10 s at most) until rank 0 has a persist being written.
  bool WriteStarted() const {
    for (auto deadline = Clock::now() + 10s; RankStatus().oldest_write_seconds() == 0 && Clock::now() < deadline;) {
      std::this_thread::sleep_for(5ms);
    }
    return RankStatus().oldest_write_seconds() > 0;
  }
  std::string AbandonStepOne(const std::string& job);
  bool StepOneWritten(const std::string& job);
  // The daemon's answer to `flashckpt status`, fetched over the socket as the CLI does (through the
  // operator client, flashckpt/admin.h).
  DaemonStatus StatusOverTheSocket() const {
    AdminOptions options;
    options.socket_path = d_.socket();
    options.rpc_timeout = 5s;
    auto admin = AdminClient::Open(options);
    EXPECT_TRUE(admin.ok()) << admin.status().ToString();
    if (!admin.ok()) return {};
    auto status = admin.value()->Status();
    EXPECT_TRUE(status.ok()) << status.status().ToString();
    return status.ok() ? *status : DaemonStatus{};
  }

  // One rank of `job` with two tensors of n floats; each save fills them with the step.
  using Trainer = TestTrainer;
  Trainer StartTrainer(const std::string& job, uint64_t n, const std::function<void(ClientOptions&)>& tweak = {}) {
    return d_.StartTrainer(job, n, tweak);
  }

  // What a failed save of `step` must look like, with `last_good` the newest complete checkpoint
  // and `failures` the failed saves so far.
  void ExpectFailedCleanly(const std::string& job, int64_t step, const Status& s, int err, int64_t last_good,
                           uint64_t failures) {
    SCOPED_TRACE("step " + std::to_string(step));
    EXPECT_EQ(s.code(), err == ENOSPC ? StatusCode::kResourceExhausted : StatusCode::kIOError) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "saving step " + std::to_string(step) + " of job '" + job + "' failed"))
        << s.message();
    // The file (a failed fsync of the directory names the directory).
    EXPECT_TRUE(Contains(s.message(), StepDir(job, step) + "/") ||
                Contains(s.message(), "fsync directory " + StepDir(job, step) + ": "))
        << s.message();
    EXPECT_TRUE(Contains(s.message(), std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"))
        << s.message();
    // Not complete, and nothing of the step left: no temporary, no renamed file, no signal.
    EXPECT_FALSE(PathExists(StepDir(job, step) + "/metadata.json"));
    auto left = ListDir(StepDir(job, step));
    ASSERT_OK(left.status());
    EXPECT_TRUE(left->empty()) << "left in checkpoint-" << step << ": " << ::testing::PrintToString(*left);
    // Earlier checkpoints are whole, LATEST still names the newest of them.
    EXPECT_EQ(Latest(job), std::to_string(last_good) + "\n");
    EXPECT_OK(VerifyCheckpointDir(StepDir(job, last_good), nullptr));
    // Operators see it, the slot is free again.
    const v1::RankStatus rank = RankStatus();
    EXPECT_EQ(rank.failures(), failures);
    EXPECT_TRUE(Contains(rank.last_error(), "step " + std::to_string(step) + ": ")) << rank.last_error();
    EXPECT_TRUE(Contains(rank.last_error(), std::strerror(err))) << rank.last_error();
    for (const auto& slot : rank.slots()) EXPECT_EQ(slot.state(), "free") << "slot " << slot.index();
  }

};

// Every write of a save failing in turn with ENOSPC and with EIO, then random rounds (seeded) that
// also cut the writes short: each failed save is clean and the next save succeeds.
TEST_F(FaultsTest, ASaveWhoseNthWriteFailsIsCleanAndTheNextSaveSucceeds) {
  Trainer t = StartTrainer("nth", 64 * 1024);  // 256 KiB per tensor
  ASSERT_TRUE(t.client);
  const uint64_t before = io_.calls(Op::kWrite);
  ASSERT_OK(t.Save(1));
  // Two images (pieces, heads), extra, signal, then the catalog's metadata.json and LATEST. A failed
  // LATEST write comes after the checkpoint is complete (tests/daemon/read_faults_test.cc): every
  // write before it fails the save cleanly.
  const uint64_t writes = io_.calls(Op::kWrite) - before - 1;
  ASSERT_GE(writes, 5u);
  int64_t step = 1, last_good = 1;
  uint64_t failures = 0, good = 1;
  auto round = [&](uint64_t n, int err, bool short_writes) {
    SCOPED_TRACE("write " + std::to_string(n) + " of " + std::to_string(writes) + " fails with " + std::strerror(err) +
                 (short_writes ? ", writes short" : ""));
    if (short_writes) io_.ShortWrites(5000);
    io_.FailNth(Op::kWrite, n, err);
    Status s = t.Save(++step);
    io_.Clear();
    ASSERT_FALSE(s.ok());
    ExpectFailedCleanly("nth", step, s, err, last_good, ++failures);
    ASSERT_OK(t.Save(++step));  // faults off: the next save works and is complete
    EXPECT_OK(VerifyCheckpointDir(StepDir("nth", step), nullptr));
    EXPECT_EQ(Latest("nth"), std::to_string(step) + "\n");
    last_good = step;
    ++good;
  };
  for (int err : {ENOSPC, EIO}) {
    for (uint64_t n = 1; n <= writes && !HasFatalFailure(); ++n) round(n, err, false);
  }
  const unsigned seed = 20240917;
  std::mt19937 rng(seed);
  for (int i = 0; i < 8 && !HasFatalFailure(); ++i) {
    const uint64_t n = std::uniform_int_distribution<uint64_t>(1, writes)(rng);
    const int err = rng() % 2 ? ENOSPC : EIO;
    const bool short_writes = rng() % 2 == 0;
    round(n, err, short_writes);
  }
  EXPECT_EQ(io_.failures_injected(), failures);
  const v1::RankStatus rank = RankStatus();
  EXPECT_EQ(rank.failures(), failures);
  EXPECT_EQ(rank.persists(), good);
  std::printf(
      "[ faults   ] %llu write faults injected (%llu writes per save, seed %u, %llu short writes), "
      "%llu saves failed cleanly, %llu saves succeeded\n",
      static_cast<unsigned long long>(io_.failures_injected()), static_cast<unsigned long long>(writes), seed,
      static_cast<unsigned long long>(io_.short_writes()), static_cast<unsigned long long>(failures),
      static_cast<unsigned long long>(good));
}

// The first failed save, as an operator sees it: failures=1 and last_error in the status over the
// socket, in `flashckpt status`.
TEST_F(FaultsTest, TheFirstFailureShowsInStatus) {
  Trainer t = StartTrainer("first", 1000);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(1));
  io_.FailNth(Op::kWrite, 1, ENOSPC);
  Status s = t.Save(2);
  ExpectFailedCleanly("first", 2, s, ENOSPC, 1, 1);
  const DaemonStatus status = StatusOverTheSocket();
  ASSERT_EQ(status.jobs.size(), 1u);
  EXPECT_EQ(status.jobs[0].ranks[0].failures, 1u);
  EXPECT_EQ(status.jobs[0].last_complete_step, 1);
  const std::string text = cli::StatusText(status);
  EXPECT_TRUE(Contains(text, "step 2: RESOURCE_EXHAUSTED: write " + StepDir("first", 2) + "/")) << text;
  ASSERT_OK(t.Save(3));
}

// fdatasync, rename and the fsync of the directory failing (every call of one kind, or the Nth
// rename): the same clean failure. A failed directory fsync comes after the rename: the writer
// removes the renamed files again.
TEST_F(FaultsTest, FailingSyncRenameOrDirectorySyncIsCleanToo) {
  Trainer t = StartTrainer("sync", 1000);
  ASSERT_TRUE(t.client);
  const uint64_t renames_before = io_.calls(Op::kRename);
  ASSERT_OK(t.Save(1));
  // One per file of the rank (2 images, extra, signal), then metadata.index.json and metadata.json;
  // LATEST's rename, after the checkpoint is complete, is read_faults_test's.
  const uint64_t renames = io_.calls(Op::kRename) - renames_before - 1;
  ASSERT_EQ(renames, 6u);
  int64_t step = 1, last_good = 1;
  uint64_t failures = 0;
  auto round = [&](const std::function<void()>& inject, int err, const char* what) {
    SCOPED_TRACE(what);
    inject();
    Status s = t.Save(++step);
    io_.Clear();
    ExpectFailedCleanly("sync", step, s, err, last_good, ++failures);
    ASSERT_OK(t.Save(++step));
    last_good = step;
  };
  round([&] { io_.FailEvery(Op::kDataSync, EIO); }, EIO, "every fdatasync");
  round([&] { io_.FailEvery(Op::kDataSync, ENOSPC); }, ENOSPC, "every fdatasync, ENOSPC");
  for (uint64_t n = 1; n <= renames; ++n) {
    round([&] { io_.FailNth(Op::kRename, n, EIO); }, EIO, "the nth rename");
  }
  for (uint64_t n = 1; n <= 3; ++n) {  // images (one fsync for both), extra, signal
    round([&] { io_.FailNth(Op::kDirSync, n, EIO); }, EIO, "the nth directory fsync");
  }
  EXPECT_EQ(RankStatus().failures(), failures);
  std::printf("[ faults   ] %llu sync/rename faults injected, each save failed cleanly\n",
              static_cast<unsigned long long>(io_.failures_injected()));
}

// A slow disk (every write 500 ms: a save takes 2 s or more) and backpressure "skip": Snapshot()
// returns as soon as the slot is committed, and with every slot persisting the next one fails at
// once with RESOURCE_EXHAUSTED instead of waiting for the writer.
TEST_F(FaultsTest, SlowDiskWithSkipPolicyRefusesAtOnceWhenEverySlotIsBusy) {
  Trainer t = StartTrainer("skip", 1000, [](ClientOptions& o) { o.skip_when_busy = true; });
  ASSERT_TRUE(t.client);
  io_.SlowWrites(500ms);
  for (int64_t step : {1, 2}) {
    auto start = Clock::now();
    ASSERT_OK(t.Snapshot(step).status());
    EXPECT_LT(Clock::now() - start, 2s) << "Snapshot(" << step << ") waited for the writer";
  }
  auto start = Clock::now();
  auto third = t.Snapshot(3);
  const auto took = Clock::now() - start;
  ASSERT_EQ(third.status().code(), StatusCode::kResourceExhausted) << third.status().ToString();
  EXPECT_TRUE(Contains(third.status().message(), "backpressure policy skip")) << third.status().message();
  EXPECT_LT(took, 2s) << "a refused snapshot does not wait";
  // It was refused while both saves were still being written (it did not wait for either).
  const v1::RankStatus rank = RankStatus();
  for (const auto& slot : rank.slots()) EXPECT_EQ(slot.state(), "persisting") << "slot " << slot.index();
  EXPECT_EQ(rank.skipped(), 1u);
  io_.Clear();
  ASSERT_OK(t.client->WaitPersisted(2, 30s));
  ASSERT_OK(t.Save(3));  // a slot is free again
  EXPECT_EQ(RankStatus().skipped(), 1u);
}

// The same slow disk and backpressure "wait" with a 300 ms slot timeout: the snapshot waits that
// long, not for the writer, and fails with DEADLINE_EXCEEDED.
TEST_F(FaultsTest, SlowDiskWithWaitPolicyFailsAfterTheSlotTimeout) {
  Trainer t = StartTrainer("wait", 1000, [](ClientOptions& o) { o.slot_timeout = 300ms; });
  ASSERT_TRUE(t.client);
  io_.SlowWrites(750ms);  // a save takes 3 s or more
  ASSERT_OK(t.Snapshot(1).status());
  ASSERT_OK(t.Snapshot(2).status());
  auto start = Clock::now();
  auto third = t.Snapshot(3);
  const auto took = Clock::now() - start;
  ASSERT_EQ(third.status().code(), StatusCode::kDeadlineExceeded) << third.status().ToString();
  EXPECT_GE(took, 250ms) << "it waited for a slot";
  EXPECT_LT(took, 3s) << "it did not wait for a save to finish";
  const v1::RankStatus rank = RankStatus();
  for (const auto& slot : rank.slots()) EXPECT_EQ(slot.state(), "persisting") << "slot " << slot.index();
  io_.Clear();
  ASSERT_OK(t.client->WaitPersisted(2, 30s));
  ASSERT_OK(t.Save(4));
}

// Status shows how long the oldest write in flight has been running: positive during a slow save
// (over the socket, in the CLI's table and in the client's JSON), 0 and "-" when idle.
TEST_F(FaultsTest, StatusShowsHowLongTheOldestWriteHasRun) {
  Trainer t = StartTrainer("slow", 1000);
  ASSERT_TRUE(t.client);
  EXPECT_EQ(RankStatus().oldest_write_seconds(), 0.0);
  io_.SlowWrites(300ms);
  ASSERT_OK(t.Snapshot(1).status());
  DaemonStatus during = StatusOverTheSocket();
  for (auto deadline = Clock::now() + 10s;  // the writer takes the save within moments
       during.jobs[0].ranks[0].oldest_write_seconds == 0 && Clock::now() < deadline;) {
    std::this_thread::sleep_for(10ms);
    during = StatusOverTheSocket();
  }
  const double seconds = during.jobs[0].ranks[0].oldest_write_seconds;
  EXPECT_GT(seconds, 0.0);
  EXPECT_LT(seconds, 60.0);
  char shown[32];
  std::snprintf(shown, sizeof shown, "%.1fs", seconds);
  const std::string text = cli::StatusText(during);
  EXPECT_TRUE(Contains(text, "OLDEST WRITE")) << text;
  EXPECT_TRUE(Contains(text, std::string("  ") + shown + "  ")) << shown << " in\n" << text;
  EXPECT_GT(cli::StatusJson(during)["jobs"][0]["ranks"][0]["oldest_write_seconds"].get<double>(), 0.0);
  auto json = t.client->StatusJson();  // the status as the Python package's status() sees it
  ASSERT_OK(json.status());
  EXPECT_TRUE(Contains(*json, "\"oldest_write_seconds\"")) << *json;

  ASSERT_OK(t.client->WaitPersisted(1, 30s));
  const DaemonStatus idle = StatusOverTheSocket();
  EXPECT_EQ(idle.jobs[0].ranks[0].oldest_write_seconds, 0.0);
  EXPECT_EQ(cli::StatusJson(idle)["jobs"][0]["ranks"][0]["oldest_write_seconds"].get<double>(), 0.0);
}

// A stop (SIGTERM) with a slow write in flight: given time, the write finishes and the checkpoint
// completes; at its deadline the write is abandoned tidily (no temporary, no file, no signal, no
// metadata.json) and left, as after a crash, to the next daemon, which adopts and writes it.
TEST_F(FaultsTest, StopFinishesAWriteInFlightWithinItsDeadline) {
  Trainer t = StartTrainer("finish", 1000);
  ASSERT_TRUE(t.client);
  io_.SlowWrites(200ms);
  ASSERT_OK(t.Snapshot(1).status());
  std::thread stop([&] { d_.daemon()->Stop(Clock::now() + 30s); });
  std::this_thread::sleep_for(100ms);  // the write takes a second or more
  // Meanwhile new snapshots are refused, saying why.
  auto refused = t.Snapshot(2);
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status().ToString();
  EXPECT_TRUE(Contains(refused.status().message(), "the daemon is stopping")) << refused.status().ToString();
  stop.join();
  EXPECT_TRUE(PathExists(StepDir("finish", 1) + "/metadata.json"));
  EXPECT_OK(VerifyCheckpointDir(StepDir("finish", 1), nullptr));
}

// Saves step 1 of `job` with writes slow enough that a stop with a short deadline abandons it, and
// stops the daemon; returns the segment that is left, with its records, for the next daemon.
std::string FaultsTest::AbandonStepOne(const std::string& job) {
  const std::string state_dir = d_.socket() + ".state";
  {
    Trainer t = StartTrainer(job, 1000);
    EXPECT_TRUE(t.client);
    if (!t.client) return "";
    io_.SlowWrites(400ms);
    EXPECT_OK(t.Snapshot(1).status());
    EXPECT_TRUE(WriteStarted()) << "the write never started";
    const auto begun = Clock::now();
    d_.daemon()->Stop(Clock::now() + 100ms);
    // The write in progress sleeps out its 400 ms, then its next call fails: no more than that.
    EXPECT_LT(Clock::now() - begun, 2s);
    auto left = ListDir(StepDir(job, 1));
    if (left.ok()) {
      EXPECT_TRUE(left->empty()) << ::testing::PrintToString(*left);
    }
    EXPECT_FALSE(PathExists(StepDir(job, 1) + "/metadata.json"));
    d_.Stop();
  }
  // Its segment and records stay for the next daemon.
  auto records = ListDir(state_dir);
  EXPECT_OK(records.status());
  if (!records.ok()) return "";
  std::string segment;
  bool commit = false;
  for (const auto& r : *records) {
    if (r.size() > 4 && r.substr(r.size() - 4) == ".reg") segment = r.substr(0, r.size() - 4);
    if (r.find(".slot") != std::string::npos) commit = true;
  }
  EXPECT_FALSE(segment.empty()) << ::testing::PrintToString(*records);
  EXPECT_TRUE(commit) << ::testing::PrintToString(*records);
  EXPECT_TRUE(PathExists("/dev/shm/" + segment));
  io_.Clear();
  return segment;
}

// Waits (at most 30 s) for the next daemon to write step 1 of `job`.
bool FaultsTest::StepOneWritten(const std::string& job) {
  for (auto deadline = Clock::now() + 30s;
       !PathExists(StepDir(job, 1) + "/metadata.json") && Clock::now() < deadline;) {
    std::this_thread::sleep_for(10ms);
  }
  return PathExists(StepDir(job, 1) + "/metadata.json");
}

TEST_F(FaultsTest, StopAbandonsAWriteAtItsDeadlineAndTheNextDaemonWritesIt) {
  const std::string state_dir = d_.socket() + ".state";
  const std::string segment = AbandonStepOne("abandon");
  ASSERT_FALSE(segment.empty());
  ASSERT_OK(d_.Start([&](DaemonConfig& c) { c.io_env = &io_; }));
  ASSERT_TRUE(StepOneWritten("abandon")) << "the next daemon did not write step 1";
  EXPECT_OK(VerifyCheckpointDir(StepDir("abandon", 1), nullptr));
  d_.Stop();
  EXPECT_FALSE(PathExists("/dev/shm/" + segment)) << "a clean stop with nothing left keeps no segment";
  auto records = ListDir(state_dir);
  ASSERT_OK(records.status());
  records->erase(std::remove(records->begin(), records->end(), "daemon.lock"), records->end());  // stays, unlocked
  EXPECT_TRUE(records->empty()) << ::testing::PrintToString(*records);
}

// An upgrade after a crash: the segment a daemon of the release before format version 2 left (its
// header, and its slots' file headers, say version 1) is adopted, and its committed snapshot is
// written in the current format, whose checksum rule its old file headers would have misstated.
TEST_F(FaultsTest, ASegmentOfTheOlderFormatIsAdoptedAndItsStepWrittenInTheCurrentOne) {
  const std::string segment = AbandonStepOne("older");
  ASSERT_FALSE(segment.empty());
  {
    // Make it what the older release left: the segment header's version and every file header's.
    std::string bytes;
    {
      auto read = ReadSmallFile("/dev/shm/" + segment, 1ull << 30);
      ASSERT_OK(read.status());
      bytes = std::move(read).value();
    }
    uint32_t version = 0;
    std::memcpy(&version, bytes.data() + offsetof(SegmentHeader, format_version), sizeof version);
    ASSERT_EQ(version, static_cast<uint32_t>(kFormatVersion));
    version = 1;
    const std::string now = "\"format_version\":\"" + std::to_string(kFormatVersion) + "\"";
    const std::string old = "\"format_version\":\"1\"";
    ASSERT_EQ(now.size(), old.size());
    size_t replaced = 0;
    for (size_t at = bytes.find(now); at != std::string::npos; at = bytes.find(now, at + 1), ++replaced) {
      bytes.replace(at, now.size(), old);
    }
    ASSERT_GT(replaced, 0u) << "no file header in the segment";
    std::memcpy(bytes.data() + offsetof(SegmentHeader, format_version), &version, sizeof version);
    UniqueFd fd(::open(("/dev/shm/" + segment).c_str(), O_WRONLY | O_CLOEXEC));
    ASSERT_TRUE(fd.valid());
    ASSERT_OK(PwriteFull(fd.get(), bytes.data(), bytes.size(), 0, segment));
  }
  ASSERT_OK(d_.Start([&](DaemonConfig& c) { c.io_env = &io_; }));
  ASSERT_TRUE(StepOneWritten("older")) << "the next daemon did not adopt the older segment and write step 1";
  EXPECT_OK(VerifyCheckpointDir(StepDir("older", 1), nullptr));
  auto meta = ReadMetadataFile(StepDir("older", 1));
  ASSERT_OK(meta.status());
  EXPECT_EQ(meta->format_version, kFormatVersion);
  d_.Stop();
}

// A trainer waiting for its step when the stop (SIGTERM) begins is not refused for that: the stop
// finishes the write, and the wait returns OK.
TEST_F(FaultsTest, WaitPersistedDuringAStopReturnsOnceTheStopHasWrittenTheStep) {
  Trainer t = StartTrainer("stopwait", 1000);
  ASSERT_TRUE(t.client);
  io_.SlowWrites(200ms);
  ASSERT_OK(t.Snapshot(1).status());
  ASSERT_TRUE(WriteStarted()) << "the write never started";
  Status waited = Internal("not run");
  std::thread waiter([&] { waited = t.client->WaitPersisted(1, 30s); });
  std::this_thread::sleep_for(100ms);  // the wait has reached the daemon
  d_.daemon()->Stop(Clock::now() + 30s);
  waiter.join();
  EXPECT_OK(waited);
  EXPECT_TRUE(PathExists(StepDir("stopwait", 1) + "/metadata.json"));
}

// When the stop's deadline cuts the write off, the waiter is told that its step was left to the
// next daemon (which writes it), not merely that the daemon is stopping.
TEST_F(FaultsTest, WaitPersistedDuringAStopThatAbandonsTheWriteSaysItWasLeftToTheNextDaemon) {
  {
    Trainer t = StartTrainer("stopleft", 1000);
    ASSERT_TRUE(t.client);
    io_.SlowWrites(400ms);
    ASSERT_OK(t.Snapshot(1).status());
    ASSERT_TRUE(WriteStarted()) << "the write never started";
    Status waited = Internal("not run");
    std::thread waiter([&] { waited = t.client->WaitPersisted(1, 30s); });
    std::this_thread::sleep_for(50ms);
    d_.daemon()->Stop(Clock::now() + 100ms);
    waiter.join();
    EXPECT_EQ(waited.code(), StatusCode::kUnavailable) << waited.ToString();
    EXPECT_TRUE(Contains(waited.message(), "step 1 of job 'stopleft' was committed but not written"))
        << waited.ToString();
    EXPECT_TRUE(Contains(waited.message(), "left to the next daemon")) << waited.ToString();
    EXPECT_FALSE(PathExists(StepDir("stopleft", 1) + "/metadata.json"));
    d_.Stop();
  }
  // The next daemon writes it (and leaves no segment behind).
  io_.Clear();
  ASSERT_OK(d_.Start([&](DaemonConfig& c) { c.io_env = &io_; }));
  for (auto deadline = Clock::now() + 30s;
       !PathExists(StepDir("stopleft", 1) + "/metadata.json") && Clock::now() < deadline;) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(PathExists(StepDir("stopleft", 1) + "/metadata.json")) << "the next daemon did not write step 1";
}

// What a registration that reuses its rank's segment names is a segment that exists, so the trainer
// maps it: within one daemon (a new session of the rank) and after a restart whose daemon adopted
// it (the stop abandoned a snapshot in it). A daemon gives a segment back between its reply and
// the trainer's mapping only by stopping (shown last); the client takes a segment gone at mapping
// for the daemon going away (UNAVAILABLE) and registers again with the next one.
TEST_F(FaultsTest, AReusedSegmentIsOneTheTrainerCanMap) {
  v1::RegisterRequest request;
  request.mutable_topology()->set_world_size(1);
  request.mutable_topology()->set_tp_degree(1);
  request.mutable_topology()->set_pp_degree(1);
  request.mutable_topology()->set_shard_degree(1);
  for (const char* name : {"w", "w.exp_avg"}) {
    v1::TensorSpec* t = request.add_tensors();
    t->set_name(name);
    t->set_kind(std::string(name) == "w" ? v1::TENSOR_KIND_MODEL : v1::TENSOR_KIND_OPTIMIZER);
    t->set_dtype("F32");
    t->add_shape(1000);
  }
  auto registration = ParseRegistration(request);
  ASSERT_OK(registration.status());
  Daemon* d = d_.daemon();
  auto first_session = d->OpenSession("reuse", 0);
  ASSERT_OK(first_session.status());
  auto first = d->Register(*first_session, *registration);
  ASSERT_OK(first.status());
  d->CloseSession(*first_session);
  auto session = d->OpenSession("reuse", 0);
  ASSERT_OK(session.status());
  auto again = d->Register(*session, *registration);
  ASSERT_OK(again.status());
  EXPECT_EQ(again->segment_name, first->segment_name) << "not reused";
  EXPECT_OK(SharedSegment::Open(again->segment_name, again->segment_bytes).status());

  io_.SlowWrites(400ms);
  auto ticket = d->BeginSnapshot(*session, 1, 1s);
  ASSERT_OK(ticket.status());
  ASSERT_OK(d->Commit(*session, *ticket, 1, true, std::nullopt, ""));
  ASSERT_TRUE(WriteStarted()) << "the write never started";
  d->Stop(Clock::now() + 100ms);  // abandons step 1: the segment stays for the next daemon
  d_.Stop();
  io_.Clear();
  ASSERT_OK(d_.Start([&](DaemonConfig& c) { c.io_env = &io_; }));
  d = d_.daemon();
  session = d->OpenSession("reuse", 0);
  ASSERT_OK(session.status());
  auto adopted = d->Register(*session, *registration);
  ASSERT_OK(adopted.status());
  EXPECT_EQ(adopted->segment_name, first->segment_name) << "the adopted segment was not reused";
  EXPECT_OK(SharedSegment::Open(adopted->segment_name, adopted->segment_bytes).status());
  for (auto deadline = Clock::now() + 30s;
       !PathExists(StepDir("reuse", 1) + "/metadata.json") && Clock::now() < deadline;) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(PathExists(StepDir("reuse", 1) + "/metadata.json")) << "the next daemon did not write step 1";

  d->Stop();  // nothing abandoned: the stop unlinks the segment it has just named
  EXPECT_EQ(SharedSegment::Open(adopted->segment_name, adopted->segment_bytes).status().code(), StatusCode::kNotFound);
}

// fatal_persist_errors: after a failed save, Snapshot() fails with that save's error (code, step,
// file, errno) every time, even with the disk healthy again, until the trainer starts a new session.
TEST_F(FaultsTest, FatalPersistErrorsStopTheSnapshotsAfterAFailedSave) {
  Trainer t = StartTrainer("fatal", 1000, [](ClientOptions& o) { o.fatal_persist_errors = true; });
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(1));
  io_.FailNth(Op::kWrite, 2, ENOSPC);
  ExpectFailedCleanly("fatal", 2, t.Save(2), ENOSPC, 1, 1);
  for (int64_t step : {3, 4}) {
    Status s = t.Snapshot(step).status();
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "saving step 2 of job 'fatal' failed")) << s.message();
    EXPECT_TRUE(Contains(s.message(), StepDir("fatal", 2) + "/")) << s.message();
    EXPECT_TRUE(Contains(s.message(), "No space left on device (errno 28)")) << s.message();
    EXPECT_TRUE(Contains(s.message(), "fatal_persist_errors")) << s.message();
  }
  EXPECT_FALSE(PathExists(StepDir("fatal", 3)));
  const v1::RankStatus rank = RankStatus();
  for (const auto& slot : rank.slots()) EXPECT_EQ(slot.state(), "free") << "slot " << slot.index();
  EXPECT_OK(VerifyCheckpointDir(StepDir("fatal", 1), nullptr));

  // A restarted trainer (a new session) resumes and saves again.
  t.client->Close();
  Trainer again = StartTrainer("fatal", 1000, [](ClientOptions& o) { o.fatal_persist_errors = true; });
  ASSERT_TRUE(again.client);
  ASSERT_OK(again.client->Restore(std::nullopt, again.bufs, 10s).status());
  ASSERT_OK(again.Save(5));
}

// Without the option (the default) a failed save is reported and training goes on: covered above;
// here an I/O error (EIO) with the option on, caught at Commit: the slot was handed out before the
// save failed. Driven through the daemon's own API to place the failure between the two calls.
TEST_F(FaultsTest, FatalPersistErrorsAlsoFailACommitOfASlotTakenBeforeTheFailure) {
  Daemon* d = d_.daemon();
  auto session = d->OpenSession("commit", 0);
  ASSERT_OK(session.status());
  // ModelAndMomentSpecs(100) as a request: "w" (model) and "w.exp_avg" (optimizer), fp32 [100].
  v1::RegisterRequest request;
  request.mutable_topology()->set_world_size(1);
  request.mutable_topology()->set_tp_degree(1);
  request.mutable_topology()->set_pp_degree(1);
  request.mutable_topology()->set_shard_degree(1);
  for (const char* name : {"w", "w.exp_avg"}) {
    v1::TensorSpec* t = request.add_tensors();
    t->set_name(name);
    t->set_kind(std::string(name) == "w" ? v1::TENSOR_KIND_MODEL : v1::TENSOR_KIND_OPTIMIZER);
    t->set_dtype("F32");
    t->add_shape(100);
  }
  request.set_fatal_persist_errors(true);
  auto registration = ParseRegistration(request);
  ASSERT_OK(registration.status());
  ASSERT_OK(d->Register(*session, *registration).status());
  io_.SlowWrites(300ms);  // the failure comes after Begin(3) below
  io_.FailNth(Op::kWrite, 1, EIO);
  auto two = d->BeginSnapshot(*session, 2, 1s);
  ASSERT_OK(two.status());
  ASSERT_OK(d->Commit(*session, *two, 2, true, std::nullopt, ""));
  auto three = d->BeginSnapshot(*session, 3, 1s);
  ASSERT_OK(three.status());
  Status failed = d->WaitPersisted(*session, 2, 30s).status();
  ASSERT_EQ(failed.code(), StatusCode::kIOError) << failed.ToString();
  io_.Clear();
  Status commit = d->Commit(*session, *three, 3, true, std::nullopt, "");
  EXPECT_EQ(commit.code(), StatusCode::kIOError) << commit.ToString();
  EXPECT_TRUE(Contains(commit.message(), "saving step 2 of job 'commit' failed")) << commit.message();
  EXPECT_TRUE(Contains(commit.message(), "Input/output error (errno 5)")) << commit.message();
  ASSERT_OK(d->AbortSnapshot(*session, *three));  // as the client does after a failed commit
  EXPECT_EQ(d->BeginSnapshot(*session, 4, 1s).status().code(), StatusCode::kIOError);
  d->CloseSession(*session);
}

// Two daemons share a root, each with one rank of a job. The one whose rank signals last fails to
// complete the step (its metadata renames fail): its rank's files were in place, signal included,
// and a daemon with another rank of the step may be building metadata.json from them at that very
// moment. So they stay, the error says so, and the other daemon's sweep completes the step.
TEST_F(FaultsTest, AFailedCompletionOfAStepSharedWithAnotherDaemonKeepsTheRanksFiles) {
  InProcessDaemon other("flashckpt-faults-other");
  ASSERT_OK(other.Start([&](DaemonConfig& c) {
    c.root = d_.root();
    c.node_name = "other";
    c.sweep_interval = 100ms;
  }));
  const uint64_t n = 1000;
  auto start = [&](const InProcessDaemon& d, uint32_t rank) {
    Trainer t;
    t.client = d.Connect("shared", rank);
    if (!t.client) return t;
    Topology topo;
    topo.world_size = 2;
    topo.shard_rank = rank;
    topo.shard_degree = 2;
    EXPECT_OK(t.client->Register(topo, ModelAndMomentSpecs(n)));
    t.w.resize(n);
    t.m.resize(n);
    t.bufs = {{"w", t.w.data(), n * 4}, {"w.exp_avg", t.m.data(), n * 4}};
    return t;
  };
  Trainer zero = start(other, 0), one = start(d_, 1);
  ASSERT_TRUE(zero.client && one.client);
  ASSERT_OK(zero.Save(1));
  EXPECT_FALSE(PathExists(StepDir("shared", 1) + "/metadata.json")) << "rank 1 has not saved yet";

  io_.FailEvery(Op::kRename, EIO, "metadata");
  Status s = one.Save(1);
  ASSERT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "completing checkpoint " + StepDir("shared", 1))) << s.message();
  EXPECT_TRUE(Contains(s.message(), "this rank's files of the step were kept")) << s.message();
  EXPECT_TRUE(PathExists(StepDir("shared", 1) + "/saved_signal_1"));
  EXPECT_TRUE(PathExists(StepDir("shared", 1) + "/model_state.tp00_pp00_shard01.safetensors"));
  EXPECT_TRUE(PathExists(StepDir("shared", 1) + "/optimizer.tp00_pp00_shard01.safetensors"));

  // The other daemon's sweep (every 100 ms) completes the step with them.
  for (auto deadline = Clock::now() + 10s;
       !PathExists(StepDir("shared", 1) + "/metadata.json") && Clock::now() < deadline;) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(PathExists(StepDir("shared", 1) + "/metadata.json")) << "the sweep did not complete the step";
  EXPECT_OK(VerifyCheckpointDir(StepDir("shared", 1), nullptr));
  io_.Clear();
  zero.client.reset();
  other.Stop();
}

}  // namespace
}  // namespace flashckpt

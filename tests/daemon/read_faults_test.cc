// The read side and the catalog's own writes under injected file-system faults (the same IoEnv seam
// as the durable writes: tests/support/fault_injecting_io.h through DaemonConfig::io_env). What a trainer
// relies on when a shared filesystem misbehaves:
// - EIO or ESTALE while listing the job, stat'ing a checkpoint or reading metadata.json is an error
//   it gets (never "no checkpoint", never the step before);
// - EIO in the middle of a restore's reads fails the restore and hands no byte over;
// - a metadata.json or LATEST write that fails is reported, and LATEST keeps naming the previous
//   checkpoint;
// - a listing that takes seconds holds up no snapshot and no watchdog ping.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>

#include "support/fault_injecting_io.h"
#include "common/io/fs.h"
#include "common/read/verify.h"
#include "flashckpt.pb.h"
#include "flashckpt/client.h"
#include "in_process_daemon.h"
#include "io_gate.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;
using Op = FaultInjectingIo::Op;

class ReadFaultsTest : public FaultyIoDaemonTest {
 protected:
  ReadFaultsTest() : FaultyIoDaemonTest("flashckpt-read-faults-test") {}

  // One rank with two tensors of n floats; a save fills them with the step.
  using Trainer = TestTrainer;
  Trainer StartTrainer(const std::string& job, uint64_t n) { return d_.StartTrainer(job, n); }

  // Saves steps 1 and 2, then fills the buffers with 7 (what a failed restore must leave alone).
  Trainer TwoCheckpoints(const std::string& job, uint64_t n = 1024) {
    Trainer t = StartTrainer(job, n);
    EXPECT_TRUE(t.client);
    if (!t.client) return t;
    EXPECT_OK(t.Save(1));
    EXPECT_OK(t.Save(2));
    std::fill(t.w.begin(), t.w.end(), 7.f);
    std::fill(t.m.begin(), t.m.end(), -7.f);
    return t;
  }

  // A restore of the latest that must fail with `err` naming `path`, leaving the buffers alone.
  void ExpectRestoreFails(Trainer& t, int err, const std::string& path) {
    auto restored = t.client->Restore(std::nullopt, t.bufs, 10s);
    ASSERT_FALSE(restored.ok()) << "restored found=" << restored->found << " step=" << restored->step;
    EXPECT_EQ(restored.status().code(), StatusCode::kIOError) << restored.status().ToString();
    EXPECT_TRUE(Contains(restored.status().message(), path)) << restored.status().ToString();
    EXPECT_TRUE(Contains(restored.status().message(), std::strerror(err))) << restored.status().ToString();
    EXPECT_TRUE(t.All(7.f)) << "a failed restore handed bytes over";
  }
};

TEST_F(ReadFaultsTest, AListingThatFailsIsAnErrorNotAnEmptyJob) {
  for (int err : {EIO, ESTALE}) {
    SCOPED_TRACE(std::strerror(err));
    const std::string job = std::string("list-") + (err == EIO ? "eio" : "estale");
    Trainer t = TwoCheckpoints(job);
    ASSERT_TRUE(t.client);
    io_.FailEvery(Op::kList, err, "/" + job);
    ExpectRestoreFails(t, err, JobDir(job));
    auto listed = d_.daemon()->List(job);
    EXPECT_EQ(listed.status().code(), StatusCode::kIOError) << listed.status().ToString();
    io_.Clear();
    auto restored = t.client->Restore(std::nullopt, t.bufs, 10s);  // the filesystem is back
    ASSERT_OK(restored.status());
    EXPECT_EQ(restored->step, 2);
    EXPECT_TRUE(t.All(2.f));
  }
}

TEST_F(ReadFaultsTest, AStatOfTheNewestCheckpointThatFailsIsAnErrorNotTheStepBefore) {
  for (int err : {EIO, ESTALE}) {
    SCOPED_TRACE(std::strerror(err));
    const std::string job = std::string("stat-") + (err == EIO ? "eio" : "estale");
    Trainer t = TwoCheckpoints(job);
    ASSERT_TRUE(t.client);
    io_.FailEvery(Op::kStat, err, "checkpoint-2/metadata.json");
    ExpectRestoreFails(t, err, StepDir(job, 2) + "/metadata.json");
    io_.Clear();
  }
}

TEST_F(ReadFaultsTest, ReadingMetadataJsonThatFailsIsAnError) {
  Trainer t = TwoCheckpoints("meta");
  ASSERT_TRUE(t.client);
  io_.FailEvery(Op::kOpen, EIO, "checkpoint-2/metadata.json");
  ExpectRestoreFails(t, EIO, StepDir("meta", 2) + "/metadata.json");
}

TEST_F(ReadFaultsTest, AnEioInTheMiddleOfARestoreHandsNothingOver) {
  // 8 MiB tensors: each is read in several blocks. Reads from now on: metadata.index.json, then
  // metadata.json's head and the lists of the rank's two tensors, then the two files' headers (two
  // reads each), then the tensors' four blocks; the 11th read (the third block) fails.
  Trainer t = TwoCheckpoints("mid", 2u << 20);
  ASSERT_TRUE(t.client);
  const uint64_t before = io_.calls(Op::kRead);
  io_.FailNth(Op::kRead, 11, EIO);
  auto restored = t.client->Restore(std::nullopt, t.bufs, 10s);
  ASSERT_FALSE(restored.ok()) << "restored step " << restored->step;
  EXPECT_EQ(restored.status().code(), StatusCode::kIOError) << restored.status().ToString();
  EXPECT_TRUE(Contains(restored.status().message(), StepDir("mid", 2) + "/")) << restored.status().ToString();
  EXPECT_GT(io_.calls(Op::kRead) - before, 11u) << "the failed read was not in the middle of the restore";
  EXPECT_TRUE(t.All(7.f)) << "a failed restore handed bytes over";
  // The slot it took is free again: the next restore works.
  auto again = t.client->Restore(std::nullopt, t.bufs, 10s);
  ASSERT_OK(again.status());
  EXPECT_TRUE(t.All(2.f));
}

// Another daemon's retention (a shared root) deletes the checkpoint while a restore reads it. The
// restore either fails or hands over everything the rank saved: never tensors without their extra
// state. The reads are slowed so that the deletion falls after the tensor files were opened.
TEST_F(ReadFaultsTest, ACheckpointDeletedDuringARestoreNeverLosesTheExtraState) {
  Trainer t = StartTrainer("gone", 1024);
  ASSERT_TRUE(t.client);
  std::fill(t.w.begin(), t.w.end(), 2.f);
  std::fill(t.m.begin(), t.m.end(), -2.f);
  SnapshotOptions with_extra;
  with_extra.extra = R"({"data_position":12345})";
  ASSERT_OK(t.client->Snapshot(2, t.bufs, with_extra).status());
  ASSERT_OK(t.client->WaitPersisted(2, 30s));
  std::fill(t.w.begin(), t.w.end(), 7.f);
  io_.Slow(Op::kRead, 100ms);
  std::thread remover([&] {
    std::this_thread::sleep_for(550ms);  // metadata.json, the extra state and both headers are read by then
    std::filesystem::remove_all(StepDir("gone", 2));
  });
  auto restored = t.client->Restore(std::nullopt, t.bufs, 20s);
  remover.join();
  io_.Clear();
  if (restored.ok()) {
    EXPECT_EQ(restored->step, 2);
    EXPECT_EQ(restored->extra, with_extra.extra) << "the restore handed over tensors without their extra state";
    EXPECT_TRUE(t.All(2.f));
  } else {
    EXPECT_TRUE(restored.status().code() == StatusCode::kNotFound || restored.status().code() == StatusCode::kIOError)
        << restored.status().ToString();
    EXPECT_TRUE(std::all_of(t.w.begin(), t.w.end(), [](float x) { return x == 7.f; })) << "bytes handed over";
  }
}

// The extra state read back must be the rank's own for that step: one copied from another rank or
// step is refused, naming the file.
TEST_F(ReadFaultsTest, AnExtraStateOfAnotherRankOrStepIsRefused) {
  Trainer t = StartTrainer("foreign", 1024);
  ASSERT_TRUE(t.client);
  SnapshotOptions with_extra;
  with_extra.extra = R"({"step":1})";
  ASSERT_OK(t.client->Snapshot(1, t.bufs, with_extra).status());
  ASSERT_OK(t.client->WaitPersisted(1, 30s));
  with_extra.extra = R"({"step":2})";
  ASSERT_OK(t.client->Snapshot(2, t.bufs, with_extra).status());
  ASSERT_OK(t.client->WaitPersisted(2, 30s));
  const std::string extra = "/extra.rank00000.json";
  std::filesystem::copy_file(StepDir("foreign", 1) + extra, StepDir("foreign", 2) + extra,
                             std::filesystem::copy_options::overwrite_existing);
  auto restored = t.client->Restore(2, t.bufs, 10s);
  ASSERT_FALSE(restored.ok()) << "restored with extra " << restored->extra;
  EXPECT_EQ(restored.status().code(), StatusCode::kCorruption) << restored.status().ToString();
  EXPECT_TRUE(Contains(restored.status().message(), StepDir("foreign", 2) + extra)) << restored.status().ToString();
}

TEST_F(ReadFaultsTest, AFailedMetadataWriteIsReportedAndLeavesThePreviousCheckpointLatest) {
  Trainer t = StartTrainer("metawrite", 1024);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(1));
  io_.FailEvery(Op::kRename, EIO, "checkpoint-2/metadata.json");
  Status failed = t.Save(2);
  EXPECT_EQ(failed.code(), StatusCode::kIOError) << failed.ToString();
  EXPECT_TRUE(Contains(failed.message(), "metadata.json")) << failed.ToString();
  io_.Clear();
  EXPECT_FALSE(PathExists(StepDir("metawrite", 2) + "/metadata.json"));
  auto latest = ReadSmallFile(JobDir("metawrite") + "/LATEST", 64);
  ASSERT_OK(latest.status());
  EXPECT_EQ(*latest, "1\n");
  auto restored = t.client->Restore(std::nullopt, t.bufs, 10s);
  ASSERT_OK(restored.status());
  EXPECT_EQ(restored->step, 1);
  EXPECT_TRUE(t.All(1.f));
  ASSERT_OK(t.Save(3));  // and saving goes on
}

TEST_F(ReadFaultsTest, AFailedLatestWriteIsReportedAndLatestKeepsThePreviousStep) {
  Trainer t = StartTrainer("latestwrite", 1024);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(1));
  io_.FailEvery(Op::kRename, EIO, "latestwrite/LATEST");
  Status failed = t.Save(2);
  EXPECT_EQ(failed.code(), StatusCode::kIOError) << failed.ToString();
  EXPECT_TRUE(Contains(failed.message(), "LATEST")) << failed.ToString();
  io_.Clear();
  auto latest = ReadSmallFile(JobDir("latestwrite") + "/LATEST", 64);
  ASSERT_OK(latest.status());
  EXPECT_EQ(*latest, "1\n");
  // checkpoint-2's own files and metadata.json were durable before LATEST was tried: it stays whole.
  EXPECT_OK(VerifyCheckpointDir(StepDir("latestwrite", 2), nullptr));
  EXPECT_OK(VerifyCheckpointDir(StepDir("latestwrite", 1), nullptr));
}

// A listing of the root that takes as long as the file system makes it (an NFS server that stalls)
// holds up no snapshot, no persist and no watchdog ping. Shown without timing: status's listing of
// the job directory is held at a gate while the trainer saves and persists six steps (three times its
// slots) and the watchdog's check runs; each would wait for the gate if the listing held the lock.
TEST_F(ReadFaultsTest, ASlowListingHoldsUpNoSnapshotAndNoWatchdogPing) {
  Trainer t = StartTrainer("slow", 1024);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(1));
  // A daemon that has not read this root yet (its status cache is cold), on a file system whose
  // listings of the job directory wait at the gate.
  t.client.reset();
  d_.Stop();
  IoGate gate;
  GatedListings io(&gate, "/slow");
  // The daemon goes before `io` does (also when an assertion returns early).
  struct StopAtExit {
    InProcessDaemon* d;
    Trainer* t;
    ~StopAtExit() {
      t->client.reset();
      d->Stop();
    }
  } stop_at_exit{&d_, &t};
  ASSERT_OK(d_.Start([&](DaemonConfig& c) {
    c.io_env = &io;
    c.sweep_interval = std::chrono::milliseconds(0);  // only status lists the job directory here
  }));
  t = StartTrainer("slow", 1024);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.client->Restore(std::nullopt, t.bufs, 10s).status());  // a new process carries on by restoring
  gate.Close();
  std::thread status([&] { (void)d_.daemon()->GetStatus(); });
  OpenAndJoinAtExit at_exit(&gate, &status);
  for (int i = 0; i < 2000 && !gate.Holding(); ++i) std::this_thread::sleep_for(5ms);
  ASSERT_TRUE(gate.Holding()) << "status did not list the job directory";

  for (int64_t step = 2; step < 8; ++step) {
    ASSERT_OK(t.Save(step));             // snapshot and persist
    (void)d_.daemon()->CountSessions();  // what the watchdog ping waits for
  }
  EXPECT_TRUE(gate.Holding()) << "the listing went on before the gate opened: the test showed nothing";
  EXPECT_FALSE(gate.timed_out()) << "the listing waited out the gate's limit";
  gate.Open();
  status.join();
}

}  // namespace
}  // namespace flashckpt

// What the daemon leaves under --root: retention of old checkpoints (--keep), deletion by operators
// (Catalog::DeleteCheckpoint and CollectGarbage: `flashckpt delete` and `gc`), and a save that fails
// on a full disk (a real 16 MiB tmpfs) without harming earlier checkpoints. A real daemon behind its
// gRPC service on a temporary socket, driven by the real client library.
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <set>
#include <thread>

#include "common/base/mutex.h"
#include "common/base/names.h"
#include "common/format/metadata.h"
#include "common/format/safetensors.h"
#include "common/format/signal.h"
#include "common/io/fs.h"
#include "common/io/io_env.h"
#include "common/read/verify.h"
#include "daemon/edge/server.h"
#include "daemon/pipeline/catalog.h"
#include "daemon/pipeline/metadata_cache.h"
#include "flashckpt.pb.h"
#include "flashckpt/client.h"
#include "in_process_daemon.h"
#include "io_gate.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;

class OnDiskTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_OK(MakeDirs(root())); }
  void TearDown() override {
    StopDaemon();
    if (mounted_ && ::umount(root().c_str()) != 0) ADD_FAILURE() << "umount " << root() << ": " << strerror(errno);
  }

  // Mounts a tmpfs of `bytes` on the root; false (and the test should skip) where that is not allowed.
  bool MountTinyRoot(const std::string& size) {
    if (::mount("tmpfs", root().c_str(), "tmpfs", 0, ("size=" + size).c_str()) != 0) return false;
    mounted_ = true;
    return true;
  }

  void StartDaemon(uint32_t keep) {
    ASSERT_OK(d_.Start([&](DaemonConfig& c) { c.keep = keep; }));
  }
  void StopDaemon() { d_.Stop(); }

  std::string root() const { return d_.root(); }
  std::string JobDir(const std::string& job) const { return d_.JobDir(job); }
  std::string StepDir(const std::string& job, int64_t step) const { return d_.StepDir(job, step); }
  std::unique_ptr<Client> Connect(const std::string& job) { return d_.Connect(job); }

  // A session of job `job` with n-element tensors, registered, whose snapshots carry the step.
  using Trainer = TestTrainer;
  Trainer StartTrainer(const std::string& job, uint64_t n) { return d_.StartTrainer(job, n); }

  // A session of `rank` of two (tensor parallel, run `run`) on daemon `d`, registered with its half,
  // `n` elements, of the float tensor "w"; nullptr when it cannot connect.
  static std::unique_ptr<Client> ConnectHalf(const InProcessDaemon& d, const std::string& job, const std::string& run,
                                             uint32_t rank, uint64_t n) {
    auto c = d.Connect(job, rank, [&](ClientOptions& o) { o.run_id = run; });
    if (!c) return c;
    Topology t;
    t.world_size = 2;
    t.tp_degree = 2;
    t.tp_rank = rank;
    TensorSpec s;
    s.name = "w";
    s.shape = {n};
    s.global_shape = {2 * n};
    s.box_offset = {n * rank};
    s.box_shape = {n};
    EXPECT_OK(c->Register(t, {s}));
    return c;
  }

  // The entries of the job's directory, sorted.
  std::vector<std::string> Entries(const std::string& job) const {
    auto names = ListDir(JobDir(job));
    if (!names.ok()) return {};
    std::sort(names->begin(), names->end());
    return *names;
  }

  InProcessDaemon d_{"flashckpt-on-disk-test"};  // declared first of the members that need it
  bool mounted_ = false;
};

using Names = std::vector<std::string>;

TEST_F(OnDiskTest, KeepDeletesAllButTheNewestCompleteCheckpoints) {
  StartDaemon(/*keep=*/2);
  Trainer t = StartTrainer("kept", 1000);
  ASSERT_TRUE(t.client);
  for (int64_t step = 1; step <= 5; ++step) {
    ASSERT_OK(t.Save(step));
    // After each completion at most two complete checkpoints are left, the newest ones.
    Names want;
    for (int64_t s = std::max<int64_t>(1, step - 1); s <= step; ++s) want.push_back("checkpoint-" + std::to_string(s));
    want.push_back("LATEST");
    std::sort(want.begin(), want.end());
    EXPECT_EQ(Entries("kept"), want) << "after step " << step;  // also: no hidden .deleting-* left over
  }
  auto latest = ReadSmallFile(JobDir("kept") + "/LATEST", 100);
  ASSERT_OK(latest.status());
  EXPECT_EQ(*latest, "5\n");
  for (int64_t step : {4, 5}) EXPECT_OK(VerifyCheckpointDir(StepDir("kept", step), nullptr));
  auto listed = d_.daemon()->List("kept");
  ASSERT_OK(listed.status());
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].step, 4);
  EXPECT_EQ((*listed)[1].step, 5);
  EXPECT_TRUE((*listed)[1].latest);

  auto restored = t.client->Restore(std::nullopt, t.bufs, 10s);
  ASSERT_OK(restored.status());
  ASSERT_TRUE(restored->found);
  EXPECT_EQ(restored->step, 5);
  EXPECT_EQ(t.w[0], 5.f);
}

// WaitComplete returns once the step's commit is over, LATEST moved as well as metadata.json
// written: a daemon sharing the root sees the one a moment before the other, and a rank told
// "complete" must find LATEST naming the step. Shown here with LATEST set back by hand between
// the two; at its deadline WaitComplete takes metadata.json alone.
TEST_F(OnDiskTest, WaitCompleteWaitsUntilLatestNamesTheStep) {
  StartDaemon(/*keep=*/0);
  Trainer t = StartTrainer("committed", 1000);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(1));
  ASSERT_OK(t.Save(2));
  ASSERT_OK(t.client->WaitComplete(2, 10s));
  ASSERT_OK(WriteFileDurably(JobDir("committed"), "LATEST", "1\n"));  // as before the commit's end
  const auto start = std::chrono::steady_clock::now();
  std::thread latest([&] {
    std::this_thread::sleep_for(700ms);
    EXPECT_OK(WriteFileDurably(JobDir("committed"), "LATEST", "2\n"));
  });
  Status waited = t.client->WaitComplete(2, 10s);
  const auto took = std::chrono::steady_clock::now() - start;
  latest.join();
  ASSERT_OK(waited);
  EXPECT_GE(took, 600ms) << "WaitComplete returned while LATEST still named step 1";
  // LATEST never moved (its committer could not write it): the deadline's look takes the metadata.
  ASSERT_OK(WriteFileDurably(JobDir("committed"), "LATEST", "1\n"));
  EXPECT_OK(t.client->WaitComplete(2, 1s));
}

TEST_F(OnDiskTest, RetentionSparesStepsInUseAndNewerIncompleteDirectories) {
  StartDaemon(/*keep=*/0);  // keep everything: retention is driven by hand below
  Trainer t = StartTrainer("spare", 100);
  ASSERT_TRUE(t.client);
  for (int64_t step : {2, 3, 4, 5}) ASSERT_OK(t.Save(step));
  EXPECT_EQ(Entries("spare"), (Names{"LATEST", "checkpoint-2", "checkpoint-3", "checkpoint-4", "checkpoint-5"}));
  ASSERT_OK(MakeDirs(StepDir("spare", 1)));  // an incomplete one older than every complete one
  ASSERT_OK(MakeDirs(StepDir("spare", 7)));  // an incomplete one newer (a save in flight elsewhere)
  ASSERT_OK(WriteFileDurably(StepDir("spare", 7), "saved_signal_1", "{}"));

  Catalog catalog(root());
  StepInUse reading = catalog.Use("spare", 3);  // as a restore of step 3 in flight does
  auto deleted = catalog.ApplyRetention("spare", 1);
  ASSERT_OK(deleted.status());
  EXPECT_EQ(*deleted, (std::vector<int64_t>{1, 2, 4}));
  EXPECT_EQ(Entries("spare"), (Names{"LATEST", "checkpoint-3", "checkpoint-5", "checkpoint-7"}));
  EXPECT_OK(VerifyCheckpointDir(StepDir("spare", 3), nullptr));  // the one being read is whole

  reading.Reset();  // the restore filled its slot
  deleted = catalog.ApplyRetention("spare", 1);
  ASSERT_OK(deleted.status());
  EXPECT_EQ(*deleted, (std::vector<int64_t>{3}));
  EXPECT_EQ(Entries("spare"), (Names{"LATEST", "checkpoint-5", "checkpoint-7"}));
  auto latest = catalog.LatestComplete("spare");
  ASSERT_OK(latest.status());
  EXPECT_EQ(*latest, std::optional<int64_t>(5));
  EXPECT_OK(VerifyCheckpointDir(StepDir("spare", 5), nullptr));

  // The newest complete checkpoint is never deleted, whatever else is going on.
  deleted = catalog.ApplyRetention("spare", 1);
  ASSERT_OK(deleted.status());
  EXPECT_TRUE(deleted->empty());
}

TEST_F(OnDiskTest, ASaveThatFillsTheDiskFailsCleanlyAndTheNextOneSucceeds) {
  if (::getuid() != 0) GTEST_SKIP() << "needs root to mount a 16 MiB tmpfs as the checkpoint root";
  if (!MountTinyRoot("16m")) GTEST_SKIP() << "mount -t tmpfs failed: " << strerror(errno);
  StartDaemon(/*keep=*/0);
  // 3 MiB per tensor, 6 MiB per checkpoint: two fit in 16 MiB; the third fills the disk while its
  // files are written (both at once: which one fails first varies).
  const uint64_t n = (3u << 20) / 4;
  Trainer t = StartTrainer("full", n);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(1));
  ASSERT_OK(t.Save(2));
  Status failed = t.Save(3);
  ASSERT_EQ(failed.code(), StatusCode::kResourceExhausted) << failed.ToString();
  EXPECT_NE(failed.message().find("step 3"), std::string::npos) << failed.message();
  EXPECT_NE(failed.message().find("No space left on device"), std::string::npos) << failed.message();
  const bool names_a_file = failed.message().find(StepDir("full", 3) + "/optimizer.") != std::string::npos ||
                            failed.message().find(StepDir("full", 3) + "/model_state.") != std::string::npos;
  EXPECT_TRUE(names_a_file) << failed.message();

  // Nothing of step 3 claims to be there: no signal, no stray temporary, no renamed file.
  EXPECT_EQ(Entries("full"), (Names{"LATEST", "checkpoint-1", "checkpoint-2", "checkpoint-3"}));
  auto left = ListDir(StepDir("full", 3));
  ASSERT_OK(left.status());
  EXPECT_TRUE(left->empty()) << "left in checkpoint-3: " << ::testing::PrintToString(*left);
  EXPECT_FALSE(d_.daemon()->List("full").value().back().complete);
  // The earlier checkpoints are whole, and LATEST still names the newest of them.
  for (int64_t step : {1, 2}) EXPECT_OK(VerifyCheckpointDir(StepDir("full", step), nullptr));
  EXPECT_EQ(ReadSmallFile(JobDir("full") + "/LATEST", 100).value(), "2\n");

  // Operators see it; the slot is free again.
  auto status = d_.daemon()->GetStatus();
  ASSERT_EQ(status.jobs.size(), 1u);
  const RankStatus& rank = status.jobs[0].ranks[0];
  EXPECT_EQ(rank.failures, 1u);
  EXPECT_EQ(rank.persists, 2u);
  EXPECT_NE(rank.last_error.find("No space left on device"), std::string::npos) << rank.last_error;
  for (const SlotStatus& slot : rank.slots) EXPECT_EQ(slot.state, "free") << "slot " << slot.index;

  // Space comes back: the next save succeeds and is complete.
  ASSERT_OK(RemoveTree(StepDir("full", 1)));
  ASSERT_OK(t.Save(4));
  EXPECT_OK(VerifyCheckpointDir(StepDir("full", 4), nullptr));
  EXPECT_EQ(ReadSmallFile(JobDir("full") + "/LATEST", 100).value(), "4\n");
  EXPECT_EQ(d_.daemon()->GetStatus().jobs[0].ranks[0].failures, 1u);
}

TEST_F(OnDiskTest, WithKeepOneSavesGoOnForeverOnASmallDisk) {
  if (::getuid() != 0) GTEST_SKIP() << "needs root to mount a 16 MiB tmpfs as the checkpoint root";
  if (!MountTinyRoot("16m")) GTEST_SKIP() << "mount -t tmpfs failed: " << strerror(errno);
  StartDaemon(/*keep=*/1);
  Trainer t = StartTrainer("forever", (3u << 20) / 4);  // 6 MiB per checkpoint: two at a time fit
  ASSERT_TRUE(t.client);
  for (int64_t step = 1; step <= 6; ++step) ASSERT_OK(t.Save(step));
  EXPECT_EQ(Entries("forever"), (Names{"LATEST", "checkpoint-6"}));
  EXPECT_OK(VerifyCheckpointDir(StepDir("forever", 6), nullptr));
}

// `flashckpt delete` and `gc` go through these; the RPC edge is tested by tests/integration/test_manage.py.
class CatalogTest : public OnDiskTest {};

TEST_F(CatalogTest, DeleteRefusesTheNewestWithoutForceAndNeverDeletesAStepInUse) {
  StartDaemon(/*keep=*/0);
  Trainer t = StartTrainer("del", 100);
  ASSERT_TRUE(t.client);
  for (int64_t step : {2, 3, 4}) ASSERT_OK(t.Save(step));
  Catalog catalog(root());

  auto refused = catalog.DeleteCheckpoint("del", 4, /*force=*/false, {}, /*dry_run=*/false);
  ASSERT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("newest complete checkpoint"), std::string::npos);
  EXPECT_NE(refused.status().message().find("--force"), std::string::npos);
  EXPECT_NE(refused.status().message().find("LATEST would move back to step 3"), std::string::npos);
  EXPECT_OK(VerifyCheckpointDir(StepDir("del", 4), nullptr));

  StepInUse reading = catalog.Use("del", 3);  // a restore of step 3 in flight
  for (bool force : {false, true}) {
    auto in_use = catalog.DeleteCheckpoint("del", 3, force, {}, false);
    ASSERT_EQ(in_use.status().code(), StatusCode::kFailedPrecondition) << in_use.status().ToString();
    EXPECT_NE(in_use.status().message().find("in use"), std::string::npos) << in_use.status().ToString();
  }
  auto busy = catalog.DeleteCheckpoint("del", 2, false, /*busy=*/{2}, false);  // a slot persisting step 2
  EXPECT_EQ(busy.status().code(), StatusCode::kFailedPrecondition) << busy.status().ToString();

  auto planned = catalog.DeleteCheckpoint("del", 2, false, {}, /*dry_run=*/true);
  ASSERT_OK(planned.status());
  EXPECT_EQ(planned->deleted, (std::vector<int64_t>{2}));
  EXPECT_EQ(planned->latest, 4);
  planned = catalog.DeleteCheckpoint("del", 4, /*force=*/true, {}, /*dry_run=*/true);
  ASSERT_OK(planned.status());
  EXPECT_EQ(planned->latest, 3);  // what LATEST would become
  EXPECT_EQ(Entries("del"), (Names{"LATEST", "checkpoint-2", "checkpoint-3", "checkpoint-4"}));
  EXPECT_EQ(*ReadSmallFile(JobDir("del") + "/LATEST", 100), "4\n");

  auto deleted = catalog.DeleteCheckpoint("del", 2, false, {}, false);
  ASSERT_OK(deleted.status());
  EXPECT_EQ(deleted->deleted, (std::vector<int64_t>{2}));
  EXPECT_EQ(deleted->latest, 4);
  EXPECT_EQ(Entries("del"), (Names{"LATEST", "checkpoint-3", "checkpoint-4"}));
  EXPECT_EQ(catalog.DeleteCheckpoint("del", 2, false, {}, false).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(catalog.DeleteCheckpoint("../del", 2, false, {}, false).status().code(), StatusCode::kInvalidArgument);

  reading.Reset();
  deleted = catalog.DeleteCheckpoint("del", 4, /*force=*/true, {}, false);
  ASSERT_OK(deleted.status());
  EXPECT_EQ(deleted->latest, 3);
  auto latest = ReadSmallFile(JobDir("del") + "/LATEST", 100);
  ASSERT_OK(latest.status());
  EXPECT_EQ(*latest, "3\n");  // moved back
  auto restored = t.client->Restore(std::nullopt, t.bufs, 10s);
  ASSERT_OK(restored.status());
  EXPECT_EQ(restored->step, 3);

  deleted = catalog.DeleteCheckpoint("del", 3, /*force=*/true, {}, false);
  ASSERT_OK(deleted.status());
  EXPECT_FALSE(deleted->latest.has_value());
  EXPECT_EQ(Entries("del"), Names{});  // LATEST is gone with the last complete checkpoint
}

TEST_F(CatalogTest, GcKeepsTheNewestAndListsStepsInUseAsSkipped) {
  StartDaemon(/*keep=*/0);
  Trainer t = StartTrainer("gc", 100);
  ASSERT_TRUE(t.client);
  for (int64_t step : {2, 3, 4, 5}) ASSERT_OK(t.Save(step));
  ASSERT_OK(MakeDirs(StepDir("gc", 1)));  // an abandoned save: older than every complete one
  ASSERT_OK(MakeDirs(StepDir("gc", 9)));  // a save in flight: newer, left alone
  Catalog catalog(root());
  StepInUse reading = catalog.Use("gc", 3);
  EXPECT_EQ(catalog.CollectGarbage("gc", 0, {}, false).status().code(), StatusCode::kInvalidArgument);

  auto outcome = catalog.CollectGarbage("gc", 1, /*busy=*/{2}, /*dry_run=*/false);
  ASSERT_OK(outcome.status());
  EXPECT_EQ(outcome->deleted, (std::vector<int64_t>{1, 4}));
  ASSERT_EQ(outcome->skipped.size(), 2u);
  EXPECT_EQ(outcome->skipped[0].step, 2);
  EXPECT_EQ(outcome->skipped[1].step, 3);
  EXPECT_NE(outcome->skipped[1].reason.find("in use"), std::string::npos) << outcome->skipped[1].reason;
  EXPECT_EQ(outcome->latest, 5);
  EXPECT_EQ(Entries("gc"), (Names{"LATEST", "checkpoint-2", "checkpoint-3", "checkpoint-5", "checkpoint-9"}));

  reading.Reset();
  outcome = catalog.CollectGarbage("gc", 1, {}, false);
  ASSERT_OK(outcome.status());
  EXPECT_EQ(outcome->deleted, (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(outcome->skipped.empty());
  EXPECT_EQ(Entries("gc"), (Names{"LATEST", "checkpoint-5", "checkpoint-9"}));
  EXPECT_OK(VerifyCheckpointDir(StepDir("gc", 5), nullptr));
}

// An unreadable root is an error the trainer sees, never "no checkpoint": a restore must not start
// from step 0 (or from an older step) because the filesystem failed.
// A step of many ranks whose signals arrive one by one: each arrival asks the catalog whether the
// checkpoint is complete. The answer "not yet" must not cost a read of every signal already there
// (that made a step of N ranks cost N^2/2 reads, and 4 daemons on one root 4x that): it is one
// listing, and no signal is opened before all are present.
TEST_F(CatalogTest, AskingWhetherAStepIsCompleteReadsNoSignalBeforeAllArePresent) {
  constexpr uint32_t kRanks = 256;
  const std::string job = "many";
  CountingIo io(IoEnv::Default());
  Catalog catalog(root(), /*keep=*/0, &io);
  const std::string dir = catalog.CheckpointDir(job, 10);
  ASSERT_OK(MakeDirs(dir));
  const Attempt attempt{"many-run", 0};
  for (uint32_t r = 0; r + 1 < kRanks; ++r) {
    Signal s;
    s.rank = r;
    s.step = 10;
    s.run_id = attempt.run_id;
    s.world_size = kRanks;
    ASSERT_OK(WriteFileDurably(dir, SignalFileName(r), EncodeSignal(job, s, 0)));
    auto complete = catalog.MaybeComplete(job, 10, kRanks, attempt);
    ASSERT_OK(complete.status());
    ASSERT_FALSE(*complete) << "rank " << r;
  }
  const IoCounts counts = io.Counts();
  EXPECT_EQ(counts.reads, 0u) << "signals were read before all of them were there";
  // One listing per check and one lookup of the first rank it did not list (the last one).
  EXPECT_LE(counts.lists, uint64_t{kRanks});
  EXPECT_LE(counts.opens + counts.stats, uint64_t{3 * kRanks});
  EXPECT_FALSE(std::filesystem::exists(dir + "/metadata.json"));
  // The sweep passes over the step for one read, of the signal that says how many ranks it has.
  const IoCounts before = io.Counts();
  auto swept = catalog.CompleteSignalledSteps(job, {attempt}, 16);
  ASSERT_OK(swept.status());
  EXPECT_TRUE(swept->empty());
  EXPECT_LE(io.Counts().opens - before.opens, 3u);
}

// The ranks of a job that register at once read the head of metadata.json once between them (the
// file grows with the job: hundreds of MiB at thousands of ranks), and again once it changes.
TEST_F(CatalogTest, MetadataIsReadOnceForManyCallersAndAgainWhenTheFileChanges) {
  StartDaemon(/*keep=*/0);
  Trainer t = StartTrainer("meta", 1000);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(5));
  const std::string dir = StepDir("meta", 5);
  CountingIo io(IoEnv::Default());
  MetadataCache cache(&io, 2);
  std::vector<std::shared_ptr<const CheckpointMetadata>> got(16);
  std::vector<std::thread> callers;
  for (size_t i = 0; i < got.size(); ++i) {
    callers.emplace_back([&, i] {
      auto meta = cache.Get(dir);
      if (meta.ok()) got[i] = *meta;
    });
  }
  for (auto& c : callers) c.join();
  for (const auto& meta : got) {
    ASSERT_NE(meta, nullptr);
    EXPECT_EQ(meta.get(), got[0].get());  // one parse, shared
    EXPECT_EQ(meta->step, 5);
  }
  EXPECT_EQ(cache.loads(), 1u);
  EXPECT_EQ(io.Counts().opens, 2u);  // metadata.json and its index, for the head alone
  EXPECT_TRUE(got[0]->pieces.empty());
  EXPECT_EQ(got[0]->files.size(), 2u);
  // Written again (another inode): read again.
  auto text = ReadSmallFile(dir + "/metadata.json", 1 << 20);
  ASSERT_OK(text.status());
  ASSERT_OK(WriteFileDurably(dir, "metadata.json", *text));
  auto again = cache.Get(dir);
  ASSERT_OK(again.status());
  EXPECT_NE(again->get(), got[0].get());
  EXPECT_EQ(cache.loads(), 2u);
  // Gone: not complete, whatever was read before.
  ASSERT_EQ(::unlink((dir + "/metadata.json").c_str()), 0);
  EXPECT_EQ(cache.Get(dir).status().code(), StatusCode::kNotFound);
}

// Records the paths opened through it.
class OpenRecordingIo final : public ForwardingIoEnv {
 public:
  int Open(const std::string& path, int flags, unsigned mode) override {
    {
      MutexLock lock(&mu_);
      opened_.push_back(path);
    }
    return base()->Open(path, flags, mode);
  }
  // The opened paths that end with `suffix`.
  size_t OpenedEndingWith(const std::string& suffix) {
    MutexLock lock(&mu_);
    return static_cast<size_t>(std::count_if(opened_.begin(), opened_.end(), [&](const std::string& p) {
      return p.size() >= suffix.size() && p.compare(p.size() - suffix.size(), suffix.size(), suffix) == 0;
    }));
  }

 private:
  Mutex mu_;
  std::vector<std::string> opened_ GUARDED_BY(mu_);
};

// A rank's signal records its files' headers as they are in the files, and the completion builds
// metadata.json from them without opening a .safetensors file (a job of thousands of ranks has
// thousands of them, on the commit's critical path). A signal without them (an older release, a
// relayout, an import) has its files' headers read from the files, to the same metadata.
TEST_F(OnDiskTest, TheCompletionTakesTheFilesHeadersFromTheSignals) {
  StartDaemon(/*keep=*/0);
  Trainer t = StartTrainer("hdr", 3000);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(7));
  const std::string dir = StepDir("hdr", 7);
  auto text = ReadSmallFile(dir + "/" + SignalFileName(0), 1 << 20);
  ASSERT_OK(text.status());
  auto signal = ParseSignal(*text);
  ASSERT_OK(signal.status());
  size_t safetensors = 0;
  for (const std::string& f : signal->files) safetensors += f.find(".safetensors") != std::string::npos;
  ASSERT_GE(safetensors, 2u);
  ASSERT_EQ(signal->headers.size(), safetensors);
  for (const SignalHeader& h : signal->headers) {
    auto bytes = ReadSmallFile(dir + "/" + h.file, 1 << 24);
    ASSERT_OK(bytes.status());
    EXPECT_EQ(h.file_bytes, bytes->size()) << h.file;
    ASSERT_GE(bytes->size(), 8u) << h.file;
    auto length = ParseHeaderLength(reinterpret_cast<const unsigned char*>(bytes->data()), bytes->size());
    ASSERT_OK(length.status());
    const uint64_t n = *length;
    EXPECT_EQ(h.header_bytes, n) << h.file;
    std::string json = bytes->substr(8, n);
    json.erase(json.find_last_not_of(' ') + 1);
    EXPECT_EQ(h.json, json) << h.file;
  }
  auto written = ReadMetadataFile(dir);
  ASSERT_OK(written.status());
  const Attempt attempt = signal->attempt();

  // The same step completed again by a catalog that records what it opens.
  auto complete_again = [&](OpenRecordingIo* io) -> Result<CheckpointMetadata> {
    EXPECT_EQ(::unlink((dir + "/metadata.json").c_str()), 0);
    EXPECT_EQ(::unlink((dir + "/metadata.index.json").c_str()), 0);
    Catalog catalog(root(), /*keep=*/0, io);
    ASSIGN_OR_RETURN(bool done, catalog.MaybeComplete("hdr", 7, 1, attempt));
    if (!done) return Internal("not complete");
    return ReadMetadataFile(dir);
  };
  auto same_pieces = [&](const CheckpointMetadata& meta) {
    ASSERT_EQ(meta.pieces.size(), written->pieces.size());
    for (size_t i = 0; i < meta.pieces.size(); ++i) {
      const Piece& a = meta.pieces[i];
      const Piece& b = written->pieces[i];
      EXPECT_TRUE(a.key == b.key && a.file == b.file && a.begin == b.begin && a.end == b.end && a.xxh3 == b.xxh3 &&
                  a.box_offset == b.box_offset && a.box_shape == b.box_shape)
          << a.key;
    }
    EXPECT_EQ(meta.files.size(), written->files.size());
    for (size_t i = 0; i < std::min(meta.files.size(), written->files.size()); ++i) {
      EXPECT_EQ(meta.files[i].name, written->files[i].name);
      EXPECT_EQ(meta.files[i].bytes, written->files[i].bytes);
    }
  };
  StopDaemon();  // nothing else completes or sweeps the step meanwhile
  OpenRecordingIo from_signals;
  auto rebuilt = complete_again(&from_signals);
  ASSERT_OK(rebuilt.status());
  EXPECT_EQ(from_signals.OpenedEndingWith(".safetensors"), 0u);
  same_pieces(*rebuilt);
  EXPECT_OK(VerifyCheckpointDir(dir, nullptr));

  signal->headers.clear();
  ASSERT_OK(WriteFileDurably(dir, SignalFileName(0), EncodeSignal("hdr", *signal, 0)));
  OpenRecordingIo from_files;
  auto read = complete_again(&from_files);
  ASSERT_OK(read.status());
  EXPECT_EQ(from_files.OpenedEndingWith(".safetensors"), safetensors);
  same_pieces(*read);
}

// A node's ranks that restore the same tensors at once read their pieces of metadata.json once
// between them (each tensor's list holds every rank's pieces: one read per rank would cost a job of
// N ranks N reads of it), and what they read is freed once none of them holds it.
TEST_F(CatalogTest, RanksRestoringTheSameTensorsReadTheirPiecesOnce) {
  StartDaemon(/*keep=*/0);
  Trainer t = StartTrainer("pieces", 1000);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(5));
  const std::string dir = StepDir("pieces", 5);
  auto whole = ReadMetadataFile(dir);
  ASSERT_OK(whole.status());
  std::vector<std::string> names;
  for (const Piece& p : whole->pieces) names.push_back(p.key);
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  ASSERT_GE(names.size(), 2u);
  CountingIo io(IoEnv::Default());
  MetadataCache cache(&io, 4);
  std::vector<std::shared_ptr<const CheckpointMetadata>> got(16);
  std::vector<std::thread> ranks;
  for (size_t i = 0; i < got.size(); ++i) {
    ranks.emplace_back([&, i] {
      std::vector<std::string> asked = names;
      if (i % 2 == 1) std::reverse(asked.begin(), asked.end());  // the same set, in another order
      auto meta = cache.GetFor(dir, asked);
      if (meta.ok()) got[i] = *meta;
    });
  }
  for (auto& r : ranks) r.join();
  for (const auto& meta : got) {
    ASSERT_NE(meta, nullptr);
    EXPECT_EQ(meta.get(), got[0].get());  // one read, shared
  }
  EXPECT_EQ(got[0]->pieces.size(), whole->pieces.size());
  EXPECT_EQ(cache.loads(), 1u);
  EXPECT_EQ(io.Counts().opens, 2u);  // metadata.json and its index
  // Other names: a read of their own.
  auto one = cache.GetFor(dir, {names[0]});
  ASSERT_OK(one.status());
  EXPECT_EQ(cache.loads(), 2u);
  for (const Piece& p : (*one)->pieces) EXPECT_EQ(p.key, names[0]);
  // Held by none: freed, and read again by the next caller.
  std::weak_ptr<const CheckpointMetadata> first = got[0];
  got.clear();
  EXPECT_TRUE(first.expired());
  auto again = cache.GetFor(dir, names);
  ASSERT_OK(again.status());
  EXPECT_EQ(cache.loads(), 3u);
  // A head is kept without holders: the lineage check of every registration reads it.
  for (int i = 0; i < 2; ++i) {
    auto head = cache.Get(dir);
    ASSERT_OK(head.status());
  }
  EXPECT_EQ(cache.loads(), 4u);
}

TEST_F(OnDiskTest, AJobDirectoryThatIsAFileIsAnErrorNotAnEmptyJob) {
  StartDaemon(/*keep=*/0);
  Trainer t = StartTrainer("broken", 64);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(1));
  std::filesystem::remove_all(JobDir("broken"));
  ASSERT_OK(WriteFileDurably(root(), "broken", "not a directory"));  // ENOTDIR below it
  auto restored = t.client->Restore(std::nullopt, t.bufs, 5s);
  ASSERT_FALSE(restored.ok()) << "restored found=" << restored->found;
  EXPECT_EQ(restored.status().code(), StatusCode::kIOError) << restored.status().ToString();
  EXPECT_NE(restored.status().message().find(JobDir("broken")), std::string::npos) << restored.status().ToString();
  auto listed = d_.daemon()->List("broken");
  EXPECT_EQ(listed.status().code(), StatusCode::kIOError) << listed.status().ToString();
  // Status says why it shows no complete step, and keeps serving.
  DaemonStatus status = d_.daemon()->GetStatus();
  ASSERT_EQ(status.jobs.size(), 1u);
  EXPECT_EQ(status.jobs[0].last_complete_step, -1);
  EXPECT_NE(status.jobs[0].catalog_error.find("broken"), std::string::npos) << status.jobs[0].catalog_error;
}

TEST_F(OnDiskTest, AJobDirectoryThatIsADanglingLinkIsAnError) {
  StartDaemon(/*keep=*/0);
  Trainer t = StartTrainer("unmounted", 64);
  ASSERT_TRUE(t.client);
  ASSERT_EQ(::symlink((d_.dir() + "/not-mounted").c_str(), JobDir("unmounted").c_str()), 0) << strerror(errno);
  auto restored = t.client->Restore(std::nullopt, t.bufs, 5s);
  ASSERT_FALSE(restored.ok()) << "restored found=" << restored->found;
  EXPECT_NE(restored.status().message().find("symbolic link"), std::string::npos) << restored.status().ToString();
  // A job that never saved (no directory at all) is the one case of "no checkpoint".
  Trainer fresh = StartTrainer("fresh", 64);
  ASSERT_TRUE(fresh.client);
  auto none = fresh.client->Restore(std::nullopt, fresh.bufs, 5s);
  ASSERT_OK(none.status());
  EXPECT_FALSE(none->found);
}

TEST_F(OnDiskTest, ANewestCheckpointThatCannotBeToldCompleteIsAnErrorNotTheStepBefore) {
  StartDaemon(/*keep=*/0);
  Trainer t = StartTrainer("loop", 64);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(1));
  ASSERT_OK(t.Save(2));
  // checkpoint-2's metadata.json becomes a symbolic-link loop: stat fails with ELOOP.
  const std::string meta = StepDir("loop", 2) + "/metadata.json";
  ASSERT_EQ(::unlink(meta.c_str()), 0);
  ASSERT_EQ(::symlink(meta.c_str(), meta.c_str()), 0) << strerror(errno);
  auto restored = t.client->Restore(std::nullopt, t.bufs, 5s);
  ASSERT_FALSE(restored.ok()) << "restored step " << restored->step << " instead of failing";
  EXPECT_EQ(restored.status().code(), StatusCode::kIOError) << restored.status().ToString();
  EXPECT_NE(restored.status().message().find(meta), std::string::npos) << restored.status().ToString();
  // Status names it too, and `flashckpt list` (the catalog's List) fails instead of hiding it.
  EXPECT_NE(d_.daemon()->GetStatus().jobs[0].catalog_error.find(meta), std::string::npos);
  EXPECT_EQ(d_.daemon()->List("loop").status().code(), StatusCode::kIOError);
}

// Hides the saved_signal_<rank> files of other daemons' ranks from this daemon until Reveal(): a
// shared file system that shows one node's files to another late (NFS close-to-open caching).
class DelayedSignals final : public ForwardingIoEnv {
 public:
  explicit DelayedSignals(std::string hidden) : hidden_("/" + std::move(hidden)) {}
  void Reveal() { revealed_ = true; }

  int Open(const std::string& path, int flags, unsigned mode) override {
    if (Hidden(path)) {
      errno = ENOENT;
      return -1;
    }
    return base()->Open(path, flags, mode);
  }
  int Stat(const std::string& path, struct stat* st) override {
    if (Hidden(path)) {
      errno = ENOENT;
      return -1;
    }
    return base()->Stat(path, st);
  }
  int ListDir(const std::string& dir, std::vector<std::string>* names) override {
    const size_t before = names->size();
    const int rc = base()->ListDir(dir, names);
    if (rc == 0 && !revealed_) {
      names->erase(std::remove(names->begin() + static_cast<std::ptrdiff_t>(before), names->end(), hidden_.substr(1)),
                   names->end());
    }
    return rc;
  }

 private:
  bool Hidden(const std::string& path) const {
    return !revealed_ && path.size() >= hidden_.size() &&
           path.compare(path.size() - hidden_.size(), hidden_.size(), hidden_) == 0;
  }
  const std::string hidden_;
  std::atomic<bool> revealed_{false};
};

// Two daemons on one root, one rank each, each seeing the other's signal late: each writes its
// rank's signal, looks for the other's, misses it, and leaves the step incomplete. Once the files
// are visible, the sweep of either daemon completes every step; LATEST names the newest.
TEST_F(OnDiskTest, TheSweepCompletesStepsWhoseLastSignalsTwoDaemonsEachMissed) {
  const std::string job = "swept";
  DelayedSignals sees_no_rank1("saved_signal_1"), sees_no_rank0("saved_signal_0");
  auto sweeping = [](DelayedSignals* io) {
    return [io](DaemonConfig& c) {
      c.io_env = io;
      c.sweep_interval = 200ms;
    };
  };
  // d_ goes before the IoEnvs it reads through (also when an assertion returns early).
  struct StopAtExit {
    InProcessDaemon* d;
    ~StopAtExit() { d->Stop(); }
  } stop_at_exit{&d_};
  ASSERT_OK(d_.Start(sweeping(&sees_no_rank1)));
  InProcessDaemon other("flashckpt-sweep");
  ASSERT_OK(other.Start([&](DaemonConfig& c) {
    sweeping (&sees_no_rank0)(c);
    c.root = root();
  }));
  std::vector<float> w0(256), w1(256);
  auto connect = [&](const InProcessDaemon& d, uint32_t rank) { return ConnectHalf(d, job, "swept-run", rank, 256); };
  auto rank0 = connect(d_, 0);
  auto rank1 = connect(other, 1);
  ASSERT_TRUE(rank0 && rank1);
  for (int64_t step = 1; step <= 3; ++step) {
    std::fill(w0.begin(), w0.end(), static_cast<float>(step));
    std::fill(w1.begin(), w1.end(), static_cast<float>(-step));
    ASSERT_OK(rank0->Snapshot(step, {{"w", w0.data(), w0.size() * 4}}, {}).status());
    ASSERT_OK(rank1->Snapshot(step, {{"w", w1.data(), w1.size() * 4}}, {}).status());
    ASSERT_OK(rank0->WaitPersisted(step, 10s));
    ASSERT_OK(rank1->WaitPersisted(step, 10s));
  }
  // Both signals of every step are durable, and neither daemon saw the other's.
  for (int64_t step = 1; step <= 3; ++step) {
    EXPECT_TRUE(std::filesystem::exists(StepDir(job, step) + "/saved_signal_0"));
    EXPECT_TRUE(std::filesystem::exists(StepDir(job, step) + "/saved_signal_1"));
    EXPECT_FALSE(std::filesystem::exists(StepDir(job, step) + "/metadata.json")) << step;
  }
  sees_no_rank1.Reveal();
  sees_no_rank0.Reveal();
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  auto all_complete = [&] {
    for (int64_t step = 1; step <= 3; ++step) {
      if (!std::filesystem::exists(StepDir(job, step) + "/metadata.json")) return false;
    }
    return true;
  };
  while (!all_complete() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(20ms);
  for (int64_t step = 1; step <= 3; ++step) {
    EXPECT_TRUE(std::filesystem::exists(StepDir(job, step) + "/metadata.json")) << "step " << step << " not swept";
  }
  auto latest = ReadSmallFile(JobDir(job) + "/LATEST", 64);
  ASSERT_OK(latest.status());
  EXPECT_EQ(*latest, "3\n");
  ASSERT_OK(rank0->WaitComplete(3, 5s));
  // LATEST naming a newer step that this daemon does not see complete (another node's, shown late)
  // is never moved back by a sweep. Written twice, 1 s apart: a sweep that read LATEST before the
  // first write (and moves it forward to 3, as it may: a sweep replaces what it read) has renamed
  // its LATEST by the second; every sweep after that reads 9.
  ASSERT_OK(WriteFileDurably(JobDir(job), "LATEST", "9\n"));
  std::this_thread::sleep_for(1s);
  ASSERT_OK(WriteFileDurably(JobDir(job), "LATEST", "9\n"));
  std::this_thread::sleep_for(1s);  // five sweeps of each daemon
  latest = ReadSmallFile(JobDir(job) + "/LATEST", 64);
  ASSERT_OK(latest.status());
  EXPECT_EQ(*latest, "9\n") << "a sweep moved LATEST back from a step it did not see complete";
  // Two daemons that complete steps 1 and 3 at once both read LATEST before either replaced it; the
  // rename of step 1 may land last. The next sweep moves LATEST forward again.
  ASSERT_OK(WriteFileDurably(JobDir(job), "LATEST", "1\n"));
  const auto repaired_by = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < repaired_by) {
    latest = ReadSmallFile(JobDir(job) + "/LATEST", 64);
    if (latest.ok() && *latest == "3\n") break;
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_OK(latest.status());
  EXPECT_EQ(*latest, "3\n") << "the sweep left LATEST behind the newest complete step";
  rank0.reset();
  rank1.reset();
  other.Stop();
  d_.Stop();
}

// Counts the reads (preads) of the files whose paths end with `suffix`; an open alone (to tell
// which file a path is now) is not a read.
class ReadCountingIo final : public ForwardingIoEnv {
 public:
  explicit ReadCountingIo(std::string suffix) : suffix_(std::move(suffix)) {}
  int Open(const std::string& path, int flags, unsigned mode) override {
    const int fd = base()->Open(path, flags, mode);
    MutexLock lock(&mu_);
    const bool match = path.size() >= suffix_.size() &&
                       path.compare(path.size() - suffix_.size(), suffix_.size(), suffix_) == 0;
    if (match) {
      fds_.insert(fd);
    } else {
      fds_.erase(fd);  // a number reused for another file
    }
    return fd;
  }
  ssize_t Pread(int fd, void* buf, size_t bytes, uint64_t offset) override {
    {
      MutexLock lock(&mu_);
      if (fds_.count(fd) != 0) ++reads_;
    }
    return base()->Pread(fd, buf, bytes, offset);
  }
  size_t reads() {
    MutexLock lock(&mu_);
    return reads_;
  }

 private:
  const std::string suffix_;
  Mutex mu_;
  std::set<int> fds_ GUARDED_BY(mu_);
  size_t reads_ GUARDED_BY(mu_) = 0;
};

// metadata.json as written, with its "created" line (the time of the write) taken out.
std::string WithoutCreated(std::string json) {
  const size_t at = json.find("\n \"created\": ");
  if (at != std::string::npos) json.erase(at, json.find('\n', at + 1) - at);
  return json;
}

// A daemon whose persists of a step leave ranks of the step missing writes its part of the step
// (node_part_<token>.json: its ranks' files, rendered for metadata.json); the daemon that writes the
// last signal joins that part instead of reading those ranks' signals and parsing their headers, so
// what follows the last signal grows with the daemons, not with the ranks. A part is a hint: one
// whose rank's signal was written again since, one that cannot be parsed and one of another attempt
// are left out, and those ranks' signals are read; the metadata is the same either way, byte for
// byte what the files' own headers give.
TEST_F(OnDiskTest, TheLastDaemonJoinsTheOtherDaemonsPartInsteadOfReadingItsRanksSignals) {
  const std::string job = "parts";
  ReadCountingIo last_io("/saved_signal_1");
  struct StopAtExit {
    InProcessDaemon* d;
    ~StopAtExit() { d->Stop(); }
  } stop_at_exit{&d_};
  ASSERT_OK(d_.Start([&](DaemonConfig& c) { c.io_env = &last_io; }));
  InProcessDaemon other("flashckpt-parts");
  ASSERT_OK(other.Start([&](DaemonConfig& c) { c.root = root(); }));
  std::vector<float> w0(4096), w1(4096);
  auto connect = [&](const InProcessDaemon& d, uint32_t rank) { return ConnectHalf(d, job, "parts-run", rank, 4096); };
  auto rank0 = connect(d_, 0);
  auto rank1 = connect(other, 1);
  ASSERT_TRUE(rank0 && rank1);
  const std::string dir = StepDir(job, 4);
  auto parts_in_dir = [&] {
    std::vector<std::string> found;
    auto names = ListDir(dir);
    if (names.ok()) {
      for (const std::string& n : *names) {
        if (n.rfind("node_part_", 0) == 0) found.push_back(n);
      }
    }
    return found;
  };
  // Rank 1 first: its daemon persists it, finds rank 0 missing and writes its part.
  std::fill(w1.begin(), w1.end(), -4.0f);
  ASSERT_OK(rank1->Snapshot(4, {{"w", w1.data(), w1.size() * 4}}, {}).status());
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (parts_in_dir().empty() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(parts_in_dir().size(), 1u) << "the daemon of rank 1 wrote no part of step 4";
  std::fill(w0.begin(), w0.end(), 4.0f);
  ASSERT_OK(rank0->Snapshot(4, {{"w", w0.data(), w0.size() * 4}}, {}).status());
  ASSERT_OK(rank0->WaitPersisted(4, 10s));
  ASSERT_OK(rank1->WaitComplete(4, 10s));
  EXPECT_EQ(last_io.reads(), 0u) << "the completion read rank 1's signal";
  EXPECT_TRUE(parts_in_dir().empty()) << "the parts outlived the completion";
  EXPECT_OK(VerifyCheckpointDir(dir, nullptr));
  auto written = ReadSmallFile(dir + "/metadata.json", 1 << 24);
  ASSERT_OK(written.status());
  // The metadata the files' own headers give, with the same run and time, is the same text.
  auto from_files = BuildMetadataFromDir(dir);
  ASSERT_OK(from_files.status());
  auto parsed = ParseMetadataJson(*written);
  ASSERT_OK(parsed.status());
  from_files->run_id = parsed->run_id;
  from_files->resumed_from = parsed->resumed_from;
  from_files->created = parsed->created;
  EXPECT_EQ(MetadataToText(*from_files).json, *written);
  rank0.reset();
  rank1.reset();
  other.Stop();
  d_.Stop();

  // The same step completed again by catalogs standing for the two daemons, rank 1's part made by
  // `made_by` from rank 1's signal (or `noted`, another signal), rank 0 held by the completing one.
  auto read_signal = [&](uint32_t rank) {
    auto text = ReadSmallFile(dir + "/" + SignalFileName(rank), 1 << 20);
    EXPECT_OK(text.status());
    auto signal = ParseSignal(text.ok() ? *text : std::string());
    EXPECT_OK(signal.status());
    return signal.ok() ? *signal : Signal{};
  };
  const Signal signal0 = read_signal(0), signal1 = read_signal(1);
  const Attempt attempt = signal0.attempt();
  Catalog made_by(root());
  auto publish = [&](const Signal& noted) {
    made_by.parts().NoteRank(dir, job, noted);
    made_by.parts().Publish(dir, job, 4, noted.attempt());
  };
  auto uncomplete = [&] {
    EXPECT_EQ(::unlink((dir + "/metadata.json").c_str()), 0);
    EXPECT_EQ(::unlink((dir + "/metadata.index.json").c_str()), 0);
  };
  auto complete_again = [&](size_t* signal1_reads) -> Result<std::string> {
    ReadCountingIo io("/saved_signal_1");
    Catalog last(root(), /*keep=*/0, &io);
    last.parts().NoteRank(dir, job, signal0);
    ASSIGN_OR_RETURN(bool done, last.MaybeComplete(job, 4, 2, attempt));
    if (!done) return Internal("not complete");
    *signal1_reads = io.reads();
    ASSIGN_OR_RETURN(std::string json, ReadSmallFile(dir + "/metadata.json", 1 << 24));
    return WithoutCreated(json);
  };
  const std::string expected = WithoutCreated(*written);
  size_t reads = 99;
  uncomplete();
  publish(signal1);
  auto joined = complete_again(&reads);
  ASSERT_OK(joined.status());
  EXPECT_EQ(*joined, expected);
  EXPECT_EQ(reads, 0u) << "the part was not used";
  EXPECT_TRUE(parts_in_dir().empty());
  // Rank 1's signal written again since the part was made (same text, another file): read.
  uncomplete();
  publish(signal1);
  ASSERT_OK(WriteFileDurably(dir, SignalFileName(1), EncodeSignal(job, signal1, 0)));
  auto rewritten = complete_again(&reads);
  ASSERT_OK(rewritten.status());
  EXPECT_EQ(*rewritten, expected);
  EXPECT_EQ(reads, 1u) << "a part of a signal written again was used";
  // A part damaged on disk (one byte changed): left out, the signal read.
  uncomplete();
  publish(signal1);
  ASSERT_EQ(parts_in_dir().size(), 1u);
  auto part_text = ReadSmallFile(dir + "/" + parts_in_dir()[0], 1 << 24);
  ASSERT_OK(part_text.status());
  const size_t at = part_text->find("\"bytes\":") + 8;
  (*part_text)[at] = (*part_text)[at] == '1' ? '2' : '1';
  ASSERT_OK(WriteFileDurably(dir, parts_in_dir()[0], *part_text));
  auto torn = complete_again(&reads);
  ASSERT_OK(torn.status());
  EXPECT_EQ(*torn, expected);
  EXPECT_EQ(reads, 1u);
  // A part of another attempt: left out.
  Signal other_run = signal1;
  other_run.run_id = "another-run";
  uncomplete();
  publish(other_run);
  auto foreign = complete_again(&reads);
  ASSERT_OK(foreign.status());
  EXPECT_EQ(*foreign, expected);
  EXPECT_EQ(reads, 1u) << "a part of another attempt was used";
}

// Holds every pread at `gate`: a restore that takes as long as the test needs.
class GatedReads final : public ForwardingIoEnv {
 public:
  explicit GatedReads(IoGate* gate) : gate_(gate) {}
  ssize_t Pread(int fd, void* buf, size_t bytes, uint64_t offset) override {
    gate_->Pass();
    return base()->Pread(fd, buf, bytes, offset);
  }

 private:
  IoGate* const gate_;
};

// Two daemons on one root, retention (--keep 2) on the one that saves. While the other restores an
// older step that is falling out of retention, the saving daemon's retention skips it (the restore's
// lease in the root), and deletes it once the restore is done. A lease of a node that died keeps its
// step only until it expires.
TEST_F(OnDiskTest, RetentionOfAnotherDaemonSkipsAStepARestoreHoldsALeaseOn) {
  const std::string job = "leased";
  ASSERT_OK(d_.Start([](DaemonConfig& c) {
    c.keep = 2;
    c.node_name = "saver";
  }));
  IoGate gate;
  GatedReads reads(&gate);  // outlives the reading daemon
  InProcessDaemon reader("flashckpt-lease");
  ASSERT_OK(reader.Start([&](DaemonConfig& c) {
    c.root = root();
    c.io_env = &reads;
    c.node_name = "reader";
    c.sweep_interval = std::chrono::milliseconds(0);  // only the restore reads through the gate
  }));
  Trainer saver = StartTrainer(job, 1024);
  ASSERT_TRUE(saver.client);
  for (int64_t step = 1; step <= 3; ++step) ASSERT_OK(saver.Save(step));
  EXPECT_EQ(Entries(job), (std::vector<std::string>{"LATEST", "checkpoint-2", "checkpoint-3"}));

  // The restore of step 2 on the other daemon, held in its first read.
  TestTrainer restorer = reader.StartTrainer(job, 1024);
  ASSERT_TRUE(restorer.client);
  gate.Close();
  std::thread restore([&] {
    auto r = restorer.client->Restore(2, restorer.bufs, 30s);
    EXPECT_OK(r.status());
    if (r.ok()) {
      EXPECT_EQ(r->step, 2);
    }
  });
  OpenAndJoinAtExit at_exit(&gate, &restore);
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!gate.Holding() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  ASSERT_TRUE(gate.Holding()) << "the restore never reached its first read";
  // Steps 4 and 5 complete; retention keeps 4 and 5, deletes 3, and skips the leased 2.
  ASSERT_OK(saver.Save(4));
  ASSERT_OK(saver.Save(5));
  EXPECT_EQ(Entries(job),
            (std::vector<std::string>{".leases", "LATEST", "checkpoint-2", "checkpoint-4", "checkpoint-5"}));
  EXPECT_FALSE(gate.timed_out()) << "the restore waited out the gate's limit";
  gate.Open();
  restore.join();
  EXPECT_TRUE(restorer.All(2.f)) << "the restore read another step's bytes";
  ASSERT_OK(saver.Save(6));  // the next retention deletes 2: its lease is gone
  EXPECT_EQ(Entries(job), (std::vector<std::string>{"LATEST", "checkpoint-5", "checkpoint-6"}));

  // A lease of a node that died with it: step 5 stays while the lease lives, and goes once it has
  // expired (rewritten here with an expiry in the past, as time would make it).
  auto write_lost_lease = [&](int64_t expires_in_ms) {
    const auto now_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    ASSERT_OK(MakeDirs(JobDir(job) + "/.leases"));
    ASSERT_OK(WriteFileDurably(JobDir(job) + "/.leases", "checkpoint-5.lost-node.4242.0",
                               R"({"step": 5, "node": "lost-node", "pid": 4242, "expires_unix_ms": )" +
                                   std::to_string(now_ms + expires_in_ms) + "}\n"));
  };
  write_lost_lease(3600 * 1000);
  // gc --dry-run names the leased step among those it would skip, not among those it would delete.
  auto planned = d_.daemon()->DeleteCheckpoints(job, 0, /*keep=*/1, /*force=*/false, /*dry_run=*/true);
  ASSERT_OK(planned.status());
  EXPECT_EQ(planned->deleted, std::vector<int64_t>{});
  ASSERT_EQ(planned->skipped.size(), 1u);
  EXPECT_EQ(planned->skipped[0].step, 5);
  EXPECT_NE(planned->skipped[0].reason.find("leased by node lost-node pid 4242"), std::string::npos)
      << planned->skipped[0].reason;
  ASSERT_OK(saver.Save(7));
  EXPECT_EQ(Entries(job),
            (std::vector<std::string>{".leases", "LATEST", "checkpoint-5", "checkpoint-6", "checkpoint-7"}));
  write_lost_lease(-1);
  ASSERT_OK(saver.Save(8));
  // The expired lease was removed, and with it the lease directory.
  EXPECT_EQ(Entries(job), (std::vector<std::string>{"LATEST", "checkpoint-7", "checkpoint-8"}));
  restorer.client.reset();
  saver.client.reset();
  reader.Stop();
}

}  // namespace
}  // namespace flashckpt

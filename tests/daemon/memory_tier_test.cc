// Memory checkpoints (SnapshotOptions::tier = kMemory): kept in the daemon's slots, never written,
// restored from memory to a trainer that died, verified before they are handed over.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <thread>

#include "common/io/fs.h"
#include "common/io/shm.h"
#include "in_process_daemon.h"

namespace flashckpt {
namespace {

constexpr uint64_t kFloats = 4096;  // 16 KiB per tensor: several 4 KiB pages, one checksum chunk

// The /dev/shm path of `rank`'s slot segment of `job` (its only segment: no EMA).
std::string SegmentPath(const std::string& job, uint32_t rank = 0) {
  const std::string prefix = "flashckpt." + job + "." + std::to_string(rank) + ".";
  std::string found;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = entry.path().filename();
    if (name.rfind(prefix, 0) == 0) found = entry.path();
  }
  return found;
}

// Waits until the slot holding `step` is FREE in the segment's mirror (its memory checkpoint kept,
// checksums computed); returns its offset in the segment, or 0.
uint64_t KeptSlotOffset(const std::string& path, int64_t step) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    struct stat st {};
    if (fd.get() >= 0 && ::fstat(fd.get(), &st) == 0) {
      const uint64_t slot_bytes = (static_cast<uint64_t>(st.st_size) - kSegmentHeaderBytes) / 2;
      for (uint64_t slot = 0; slot < 2; ++slot) {
        const uint64_t at = kSegmentHeaderBytes + slot * slot_bytes;
        uint32_t state = 1, resident = 0;
        int64_t held = -1;
        if (::pread(fd.get(), &state, 4, static_cast<off_t>(at)) == 4 &&
            ::pread(fd.get(), &resident, 4, static_cast<off_t>(at + 4)) == 4 &&
            ::pread(fd.get(), &held, 8, static_cast<off_t>(at + 8)) == 8 && held == step && resident == 1 &&
            state == static_cast<uint32_t>(SlotState::kFree)) {
          return at;
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return 0;
}

// Flips one byte of the first tensor of the slot at `slot` (its first file image: an 8-byte header
// length, the header, then the tensor data).
void FlipTensorByte(const std::string& path, uint64_t slot) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  ASSERT_GE(fd.get(), 0);
  const uint64_t image = slot + kPageSize;
  uint64_t header = 0;
  ASSERT_EQ(::pread(fd.get(), &header, 8, static_cast<off_t>(image)), 8);
  const off_t byte = static_cast<off_t>(image + 8 + header + 16);
  char c = 0;
  ASSERT_EQ(::pread(fd.get(), &c, 1, byte), 1);
  c ^= 0x10;
  ASSERT_EQ(::pwrite(fd.get(), &c, 1, byte), 1);
}

// Rank `rank` of a job of `world` tensor-parallel ranks, each holding its part of w and of its moment.
TestTrainer StartRank(const InProcessDaemon& d, const std::string& job, uint32_t rank,
                      const std::function<void(ClientOptions&)>& tweak = {}, uint32_t world = 2) {
  TestTrainer t;
  t.client = d.Connect(job, rank, tweak);
  if (!t.client) return t;
  std::vector<TensorSpec> specs = ModelAndMomentSpecs(kFloats);
  for (TensorSpec& spec : specs) {
    spec.global_shape = {world * kFloats};
    spec.box_offset = {rank * kFloats};
    spec.box_shape = {kFloats};
  }
  Topology topology;
  topology.world_size = world;
  topology.tp_degree = world;
  topology.tp_rank = rank;
  EXPECT_OK(t.client->Register(topology, specs));
  t.w.resize(kFloats);
  t.m.resize(kFloats);
  t.bufs = {{"w", t.w.data(), kFloats * 4}, {"w.exp_avg", t.m.data(), kFloats * 4}};
  return t;
}

// Restores the latest into `t` and expects `step` from `tier`, every element of it.
void ExpectLatest(TestTrainer& t, int64_t step, Tier tier) {
  auto got = t.client->Restore(std::nullopt, t.bufs, std::chrono::seconds(10));
  ASSERT_OK(got.status());
  EXPECT_EQ(got->step, step);
  EXPECT_EQ(got->tier, tier);
  EXPECT_TRUE(t.All(static_cast<float>(step)));
}

class MemoryTierTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_OK(d_.Start()); }
  InProcessDaemon d_{"flashckpt-memory-test"};
};

TEST_F(MemoryTierTest, AMemoryCheckpointOutlivesItsTrainerAndIsNeverWritten) {
  TestTrainer t = d_.StartTrainer("memtier-mem", kFloats);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(10));
  ASSERT_OK(t.Memory(11));
  ASSERT_OK(t.Memory(12));
  // Kept once their checksums are computed in the background: Restorable waits for that.
  auto held = t.client->Restorable(std::chrono::seconds(10));
  ASSERT_OK(held.status());
  EXPECT_EQ(held->memory_steps, (std::vector<int64_t>{12, 11}));
  t.client.reset();  // the trainer dies: its session ends
  // Status and metrics show what the rank keeps.
  {
    const DaemonStatus status = d_.daemon()->GetStatus();
    ASSERT_EQ(status.jobs.size(), 1u);
    ASSERT_EQ(status.jobs[0].ranks.size(), 1u);
    const RankStatus& rank = status.jobs[0].ranks[0];
    EXPECT_EQ(rank.memory_step, 12);
    EXPECT_EQ(rank.memory_checkpoints, 2u);
    EXPECT_GE(rank.memory_bytes, 2 * 2 * kFloats * 4);
    // The slots holding them are named as such, with their steps, not as free.
    std::set<std::string> held_slots;
    for (const SlotStatus& slot : rank.slots) held_slots.insert(slot.state + "@" + std::to_string(slot.step));
    EXPECT_TRUE(held_slots.count("memory@11") && held_slots.count("memory@12"))
        << ::testing::PrintToString(held_slots);
    const std::string metrics = d_.daemon()->RenderMetrics();
    EXPECT_TRUE(Contains(metrics, "flashckpt_memory_checkpoint_step{job=\"memtier-mem\"} 12")) << metrics;
    EXPECT_TRUE(Contains(metrics, "flashckpt_memory_checkpoint_bytes{job=\"memtier-mem\"} " +
                                      std::to_string(rank.memory_bytes)))
        << metrics;
  }
  EXPECT_FALSE(std::filesystem::exists(d_.StepDir("memtier-mem", 11)));
  EXPECT_FALSE(std::filesystem::exists(d_.StepDir("memtier-mem", 12)));

  TestTrainer next = d_.StartTrainer("memtier-mem", kFloats);
  ASSERT_TRUE(next.client);
  auto r = next.client->Restore(std::nullopt, next.bufs, std::chrono::seconds(10));
  ASSERT_OK(r.status());
  EXPECT_TRUE(r->found);
  EXPECT_EQ(r->step, 12);
  EXPECT_EQ(r->tier, Tier::kMemory);
  EXPECT_EQ(r->extra, "{\"step\":12}");
  EXPECT_TRUE(next.All(12));
  EXPECT_FALSE(std::filesystem::exists(d_.StepDir("memtier-mem", 12)));

  // Step 11 by number, also from memory.
  r = next.client->Restore(11, next.bufs, std::chrono::seconds(10));
  ASSERT_OK(r.status());
  EXPECT_EQ(r->tier, Tier::kMemory);
  EXPECT_TRUE(next.All(11));
  // Step 10 is on disk; restoring it leaves the newer timeline, whose memory checkpoints go.
  r = next.client->Restore(10, next.bufs, std::chrono::seconds(10));
  ASSERT_OK(r.status());
  EXPECT_EQ(r->tier, Tier::kDisk);
  EXPECT_TRUE(next.All(10));
  EXPECT_EQ(next.client->Restore(12, next.bufs, std::chrono::seconds(10)).status().code(), StatusCode::kNotFound);
}

// A disk checkpoint of a rank that declares memory checkpoints is also its newest memory checkpoint
// once written; a rank that does not declare them keeps none of its disk checkpoints in memory.
TEST_F(MemoryTierTest, ADiskCheckpointIsAlsoTheNewestMemoryCheckpointOfARankThatTakesThem) {
  auto declare = [](ClientOptions& o) { o.memory_checkpoints = true; };
  TestTrainer t = d_.StartTrainer("memtier-disk", kFloats, declare);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Memory(9));
  ASSERT_OK(t.Save(10));
  auto held = t.client->Restorable(std::chrono::seconds(10));
  ASSERT_OK(held.status());
  EXPECT_EQ(held->memory_steps, (std::vector<int64_t>{10, 9}));
  EXPECT_EQ(held->disk_step, 10);
  t.client.reset();
  TestTrainer next = d_.StartTrainer("memtier-disk", kFloats, declare);
  ASSERT_TRUE(next.client);
  ExpectLatest(next, 10, Tier::kMemory);
  // Its bytes are verified like any memory checkpoint's: a flipped one sends the restore to the files.
  const uint64_t slot = KeptSlotOffset(SegmentPath("memtier-disk"), 10);
  ASSERT_NE(slot, 0u);
  FlipTensorByte(SegmentPath("memtier-disk"), slot);
  auto r = next.client->Restore(10, next.bufs, std::chrono::seconds(10));
  ASSERT_OK(r.status());
  EXPECT_EQ(r->tier, Tier::kDisk);
  EXPECT_TRUE(next.All(10));

  TestTrainer plain = d_.StartTrainer("memtier-plain", kFloats);
  ASSERT_TRUE(plain.client);
  ASSERT_OK(plain.Memory(9));
  ASSERT_OK(plain.Save(10));
  held = plain.client->Restorable(std::chrono::seconds(10));
  ASSERT_OK(held.status());
  EXPECT_EQ(held->memory_steps, std::vector<int64_t>{9});
}

TEST_F(MemoryTierTest, ANewerCheckpointOnDiskWinsOverAnOlderOneInMemory) {
  TestTrainer t = d_.StartTrainer("memtier-newer", kFloats);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Memory(5));
  ASSERT_OK(t.Save(6));
  t.client.reset();
  TestTrainer next = d_.StartTrainer("memtier-newer", kFloats);
  ASSERT_TRUE(next.client);
  auto r = next.client->Restore(std::nullopt, next.bufs, std::chrono::seconds(10));
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 6);
  EXPECT_EQ(r->tier, Tier::kDisk);
  EXPECT_TRUE(next.All(6));
}

TEST_F(MemoryTierTest, AFlippedByteIsNeverHandedOverAndTheDiskIsReadInstead) {
  TestTrainer t = d_.StartTrainer("memtier-flip", kFloats);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(10));
  ASSERT_OK(t.Memory(11));
  ASSERT_OK(t.Memory(12));
  const std::string segment = SegmentPath("memtier-flip");
  ASSERT_FALSE(segment.empty());
  const uint64_t slot = KeptSlotOffset(segment, 12);  // checksummed before the byte flips
  ASSERT_NE(slot, 0u);
  t.client.reset();
  FlipTensorByte(segment, slot);
  auto events = d_.daemon()->events().Subscribe("memtier-flip");

  TestTrainer next = d_.StartTrainer("memtier-flip", kFloats);
  ASSERT_TRUE(next.client);
  auto r = next.client->Restore(std::nullopt, next.bufs, std::chrono::seconds(10));
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 10);
  EXPECT_EQ(r->tier, Tier::kDisk);
  EXPECT_TRUE(next.All(10));
  // The rank's other memory checkpoint went with it: step 11 is on neither tier.
  EXPECT_EQ(next.client->Restore(11, next.bufs, std::chrono::seconds(10)).status().code(), StatusCode::kNotFound);
  // Operators see it: an event naming the rank and step, and the counter behind the alert.
  DaemonEvent event;
  bool seen = false;
  while (!seen && events->Next(&event, std::chrono::steady_clock::now() + std::chrono::seconds(5)) ==
                      EventHub::Wait::kEvent) {
    if (event.kind != DaemonEvent::Kind::kMemoryFallback) continue;
    seen = true;
    EXPECT_EQ(event.step, 12);
    EXPECT_EQ(event.rank, 0u);
    EXPECT_TRUE(Contains(event.reason, "checksum")) << event.reason;
  }
  EXPECT_TRUE(seen) << "no memory-fallback event";
  EXPECT_TRUE(Contains(d_.daemon()->RenderMetrics(), "flashckpt_memory_fallbacks_total{job=\"memtier-flip\"} 1"))
      << d_.daemon()->RenderMetrics();
}

// The client checks each chunk as it copies it, so a chunk that fails may come after others were
// copied. With no checkpoint on disk to read instead, the restore is an error, never found=false
// (which tells a trainer its buffers are untouched and it starts afresh).
TEST_F(MemoryTierTest, AFlippedByteWithNothingOnDiskIsAnErrorNotAFreshStart) {
  TestTrainer t = d_.StartTrainer("memtier-nodisk", kFloats);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Memory(3));
  const std::string segment = SegmentPath("memtier-nodisk");
  ASSERT_FALSE(segment.empty());
  const uint64_t slot = KeptSlotOffset(segment, 3);
  ASSERT_NE(slot, 0u);
  t.client.reset();
  FlipTensorByte(segment, slot);

  TestTrainer next = d_.StartTrainer("memtier-nodisk", kFloats);
  ASSERT_TRUE(next.client);
  auto r = next.client->Restore(std::nullopt, next.bufs, std::chrono::seconds(10));
  ASSERT_FALSE(r.ok()) << "found=" << r->found << " step=" << r->step;
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(r.status().message(), "no checkpoint on disk")) << r.status().ToString();
  // The memory checkpoint is gone; asked again, the job has nothing: a fresh start.
  r = next.client->Restore(std::nullopt, next.bufs, std::chrono::seconds(10));
  ASSERT_OK(r.status());
  EXPECT_FALSE(r->found);
}

// A tensor of no elements lies at the offset of the tensor after it: the checksums handed to the
// client still match each tensor, and the restore from memory goes through.
TEST_F(MemoryTierTest, ATensorOfNoElementsRestoresFromMemory) {
  std::vector<TensorSpec> specs = ModelAndMomentSpecs(kFloats);
  TensorSpec empty = specs[0];
  empty.name = "a.empty";
  empty.shape = {0};
  specs.insert(specs.begin(), empty);
  auto start = [&](TestTrainer& t) {
    t.client = d_.Connect("memtier-empty", 0);
    ASSERT_TRUE(t.client);
    ASSERT_OK(t.client->Register(Topology{}, specs));
    t.w.resize(kFloats);
    t.m.resize(kFloats);
    t.bufs = {{"a.empty", nullptr, 0}, {"w", t.w.data(), kFloats * 4}, {"w.exp_avg", t.m.data(), kFloats * 4}};
  };
  TestTrainer t;
  start(t);
  ASSERT_OK(t.Memory(4));
  t.client.reset();
  TestTrainer next;
  start(next);
  auto r = next.client->Restore(std::nullopt, next.bufs, std::chrono::seconds(10));
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 4);
  EXPECT_EQ(r->tier, Tier::kMemory);
  EXPECT_TRUE(next.All(4));
}

TEST_F(MemoryTierTest, RestorableListsTheVerifiedMemoryStepsAndTheNewestOnDisk) {
  TestTrainer t = d_.StartTrainer("memtier-list", kFloats);
  ASSERT_TRUE(t.client);
  {
    auto none = t.client->Restorable(std::chrono::seconds(10));
    ASSERT_OK(none.status());
    EXPECT_TRUE(none->memory_steps.empty());
    EXPECT_FALSE(none->disk_step.has_value());
  }
  ASSERT_OK(t.Save(10));
  ASSERT_OK(t.Memory(11));
  ASSERT_OK(t.Memory(12));
  const std::string segment = SegmentPath("memtier-list");
  ASSERT_FALSE(segment.empty());
  const uint64_t slot = KeptSlotOffset(segment, 11);
  ASSERT_NE(slot, 0u);
  t.client.reset();

  // A new process asks before it registers (its layout may not be known yet).
  std::unique_ptr<Client> next = d_.Connect("memtier-list");
  ASSERT_TRUE(next);
  auto listed = next->Restorable(std::chrono::seconds(10));
  ASSERT_OK(listed.status());
  EXPECT_EQ(listed->memory_steps, (std::vector<int64_t>{12, 11}));
  EXPECT_EQ(listed->disk_step, std::optional<int64_t>(10));
  EXPECT_TRUE(listed->extra.empty());
  // One step with its extra state (what a trainer registers before restoring it); a step not held.
  listed = next->Restorable(std::chrono::seconds(10), 11);
  ASSERT_OK(listed.status());
  EXPECT_EQ(listed->memory_steps, (std::vector<int64_t>{11}));
  EXPECT_EQ(listed->extra, "{\"step\":11}");
  listed = next->Restorable(std::chrono::seconds(10), 10);
  ASSERT_OK(listed.status());
  EXPECT_TRUE(listed->memory_steps.empty());
  EXPECT_TRUE(listed->extra.empty());
  EXPECT_EQ(next->Restorable(std::chrono::seconds(10), 0).status().code(), StatusCode::kInvalidArgument);

  // A checkpoint that no longer matches its checksums: listed unverified (its bytes are not read;
  // the restore that follows verifies them), not offered once verified, nor are the rank's others.
  FlipTensorByte(segment, slot);
  listed = next->Restorable(std::chrono::seconds(10), std::nullopt, /*verify=*/false);
  ASSERT_OK(listed.status());
  EXPECT_EQ(listed->memory_steps, (std::vector<int64_t>{12, 11}));
  listed = next->Restorable(std::chrono::seconds(10), 11, /*verify=*/false);
  ASSERT_OK(listed.status());
  EXPECT_EQ(listed->extra, "{\"step\":11}");
  listed = next->Restorable(std::chrono::seconds(10));
  ASSERT_OK(listed.status());
  EXPECT_TRUE(listed->memory_steps.empty()) << listed->memory_steps.size();
  EXPECT_EQ(listed->disk_step, std::optional<int64_t>(10));
}

TEST_F(MemoryTierTest, DiskExtraReadsTheExtraStateOfADiskCheckpointBeforeAnyRegistration) {
  TestTrainer t = d_.StartTrainer("memtier-diskextra", kFloats);
  ASSERT_TRUE(t.client);
  {
    auto none = t.client->DiskExtra(std::nullopt, std::chrono::seconds(10));
    ASSERT_OK(none.status());
    EXPECT_FALSE(none->disk_step.has_value());
  }
  for (int64_t step : {4, 6}) {
    SnapshotOptions o;
    o.extra = "{\"disk\":" + std::to_string(step) + "}";
    ASSERT_OK(t.client->Snapshot(step, t.bufs, o).status());
    ASSERT_OK(t.client->WaitPersisted(step, std::chrono::seconds(30)));
  }
  ASSERT_OK(t.Memory(7));  // newer, but in memory only: not a disk checkpoint
  t.client.reset();

  std::unique_ptr<Client> next = d_.Connect("memtier-diskextra");  // registers nothing
  ASSERT_TRUE(next);
  auto latest = next->DiskExtra(std::nullopt, std::chrono::seconds(10));
  ASSERT_OK(latest.status());
  EXPECT_EQ(latest->disk_step, std::optional<int64_t>(6));
  EXPECT_EQ(latest->extra, "{\"disk\":6}");
  EXPECT_TRUE(latest->memory_steps.empty());
  auto older = next->DiskExtra(4, std::chrono::seconds(10));
  ASSERT_OK(older.status());
  EXPECT_EQ(older->disk_step, std::optional<int64_t>(4));
  EXPECT_EQ(older->extra, "{\"disk\":4}");
  for (int64_t missing : {5, 7}) {  // never saved; held in memory only
    auto got = next->DiskExtra(missing, std::chrono::seconds(10));
    EXPECT_EQ(got.status().code(), StatusCode::kNotFound) << missing << ": " << got.status().ToString();
  }
  EXPECT_EQ(next->DiskExtra(0, std::chrono::seconds(10)).status().code(), StatusCode::kInvalidArgument);
  // The memory checkpoint is still there: nothing was restored or dropped.
  auto held = next->Restorable(std::chrono::seconds(10));
  ASSERT_OK(held.status());
  EXPECT_EQ(held->memory_steps.front(), 7);
}

TEST_F(MemoryTierTest, WaitingForAMemoryStepToBeWrittenFailsAtOnce) {
  TestTrainer t = d_.StartTrainer("memtier-wait", kFloats);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Memory(3));
  const auto begun = std::chrono::steady_clock::now();
  Status s = t.client->WaitPersisted(3, std::chrono::seconds(30));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "memory checkpoint")) << s.ToString();
  s = t.client->WaitComplete(3, std::chrono::seconds(30));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - begun, std::chrono::seconds(10)) << "not a timeout";
  // A disk save afterwards is waited for as any other.
  ASSERT_OK(t.Save(4));
}

TEST_F(MemoryTierTest, TheRanksOfAJobRestoreOneStepAndARetryGetsItAgain) {
  const std::string job = "memtier-plan";
  {
    TestTrainer r0 = StartRank(d_, job, 0), r1 = StartRank(d_, job, 1);
    ASSERT_TRUE(r0.client && r1.client);
    for (int64_t step : {5, 6}) {
      ASSERT_OK(r0.Memory(step));
      ASSERT_OK(r1.Memory(step));
    }
  }  // both trainers die
  TestTrainer r0 = StartRank(d_, job, 0), r1 = StartRank(d_, job, 1);
  ASSERT_TRUE(r0.client && r1.client);
  auto got = r0.client->Restore(std::nullopt, r0.bufs, std::chrono::seconds(10));
  ASSERT_OK(got.status());
  EXPECT_EQ(got->step, 6);
  EXPECT_EQ(got->tier, Tier::kMemory);
  EXPECT_TRUE(r0.All(6));
  // Rank 0 trains on before rank 1 restores: rank 1 still gets the step rank 0 took.
  ASSERT_OK(r0.Memory(7));
  got = r1.client->Restore(std::nullopt, r1.bufs, std::chrono::seconds(10));
  ASSERT_OK(got.status());
  EXPECT_EQ(got->step, 6);
  EXPECT_EQ(got->tier, Tier::kMemory);
  EXPECT_TRUE(r1.All(6));
  // A retry of the same process (its first answer lost, say) gets the same step, though rank 0 has
  // moved on so far that it no longer holds it (a new choice would be another step, or none).
  ASSERT_OK(r0.Memory(8));
  std::fill(r1.w.begin(), r1.w.end(), 0.0f);
  got = r1.client->Restore(std::nullopt, r1.bufs, std::chrono::seconds(10));
  ASSERT_OK(got.status());
  EXPECT_EQ(got->step, 6);
  EXPECT_TRUE(r1.All(6));
  ASSERT_OK(r1.Memory(7));
  ASSERT_OK(r1.Memory(8));

  // Rank 0 asks for the latest again after training on (a rollback): a new resume, not a retry.
  ExpectLatest(r0, 8, Tier::kMemory);

  // Both fail again: their new processes make a new plan, from the newer step.
  r0.client.reset();
  r1.client.reset();
  TestTrainer n0 = StartRank(d_, job, 0), n1 = StartRank(d_, job, 1);
  ASSERT_TRUE(n0.client && n1.client);
  ExpectLatest(n1, 8, Tier::kMemory);
  ExpectLatest(n0, 8, Tier::kMemory);
}

// Restores the latest into both ranks at once (each daemon waits for the other's rank) and expects
// `step` from `tier` on both.
void ExpectLatestTogether(TestTrainer& a, TestTrainer& b, int64_t step, Tier tier = Tier::kMemory) {
  Result<RestoreResult> by_b = Unavailable("not restored");
  std::thread other([&] { by_b = b.client->Restore(std::nullopt, b.bufs, std::chrono::seconds(10)); });
  auto by_a = a.client->Restore(std::nullopt, a.bufs, std::chrono::seconds(10));
  other.join();
  ASSERT_OK(by_a.status());
  ASSERT_OK(by_b.status());
  EXPECT_EQ(by_a->step, step);
  EXPECT_EQ(by_b->step, step);
  EXPECT_EQ(by_a->tier, tier);
  EXPECT_EQ(by_b->tier, tier);
  EXPECT_TRUE(a.All(static_cast<float>(step)));
  EXPECT_TRUE(b.All(static_cast<float>(step)));
}

// Two daemons on one root, a rank of the job on each: they agree on the step through the root. The
// same processes asking for the latest again after training on (a rollback) agree anew, on the
// newer step: the decision of their first resume, still in the root, is not taken again.
TEST(MemoryTierAgreement, ARollbackOnTwoDaemonsTakesTheStepTheRanksHoldNow) {
  const std::string job = "memtier-rollback";
  InProcessDaemon d1("flashckpt-memory-test"), d2("flashckpt-memory-test");
  ASSERT_OK(d1.Start());
  ASSERT_OK(d2.Start([&](DaemonConfig& c) { c.root = d1.root(); }));
  {
    TestTrainer r0 = StartRank(d1, job, 0), r1 = StartRank(d2, job, 1);
    ASSERT_TRUE(r0.client && r1.client);
    for (int64_t step : {5, 6}) {
      ASSERT_OK(r0.Memory(step));
      ASSERT_OK(r1.Memory(step));
    }
  }  // both trainers die
  TestTrainer r0 = StartRank(d1, job, 0), r1 = StartRank(d2, job, 1);
  ASSERT_TRUE(r0.client && r1.client);
  ExpectLatestTogether(r0, r1, 6);
  for (int64_t step : {7, 8}) {  // the slots now hold 7 and 8, no longer 6
    ASSERT_OK(r0.Memory(step));
    ASSERT_OK(r1.Memory(step));
  }
  ExpectLatestTogether(r0, r1, 8);
}

// A trainer whose daemon restarted carries on: its client re-attaches to the new daemon, and its
// next restore still takes part in the job's agreement with the other daemon's rank.
TEST(MemoryTierAgreement, ARankReattachedAfterItsDaemonRestartedAgreesWithTheOtherDaemons) {
  const std::string job = "memtier-reattach";
  InProcessDaemon d1("flashckpt-memory-test"), d2("flashckpt-memory-test");
  ASSERT_OK(d1.Start());
  ASSERT_OK(d2.Start([&](DaemonConfig& c) { c.root = d1.root(); }));
  const auto memory = [](ClientOptions& o) { o.memory_checkpoints = true; };
  TestTrainer r0 = StartRank(d1, job, 0, memory), r1 = StartRank(d2, job, 1, memory);
  ASSERT_TRUE(r0.client && r1.client);
  ASSERT_OK(r0.Snapshot(4).status());
  ASSERT_OK(r1.Snapshot(4).status());
  ASSERT_OK(r0.client->WaitComplete(4, std::chrono::seconds(10)));
  ASSERT_OK(r1.client->WaitComplete(4, std::chrono::seconds(10)));
  ASSERT_OK(r0.Memory(5));
  ASSERT_OK(r1.Memory(5));
  d1.Stop();  // rank 0's memory checkpoint goes with its daemon; rank 1 still holds 5
  ASSERT_OK(d1.Start());
  ExpectLatestTogether(r0, r1, 4, Tier::kDisk);  // the newest step both can restore
}

// The ranks' plan found nothing to restore: every rank of it gets nothing, also one that asks after
// a checkpoint of the job became complete (an earlier attempt's last write, say). Before, each rank
// looked for the latest complete checkpoint again: rank 0 started afresh and rank 1 restored it.
TEST_F(MemoryTierTest, NothingToRestoreIsTheAnswerForEveryRankOfThePlan) {
  const std::string job = "memtier-none";
  const auto memory = [](ClientOptions& o) { o.memory_checkpoints = true; };
  TestTrainer r0 = StartRank(d_, job, 0, memory), r1 = StartRank(d_, job, 1, memory);
  ASSERT_TRUE(r0.client && r1.client);
  auto first = r0.client->Restore(std::nullopt, r0.bufs, std::chrono::seconds(10));
  ASSERT_OK(first.status());
  EXPECT_FALSE(first->found);
  {
    // Step 7 of the job, complete, appears in the root: made by a daemon of its own, then copied in.
    InProcessDaemon other("flashckpt-memory-test");
    ASSERT_OK(other.Start());
    TestTrainer o0 = StartRank(other, job, 0), o1 = StartRank(other, job, 1);
    ASSERT_TRUE(o0.client && o1.client);
    ASSERT_OK(o0.Snapshot(7).status());
    ASSERT_OK(o1.Snapshot(7).status());
    ASSERT_OK(o0.client->WaitComplete(7, std::chrono::seconds(10)));
    std::filesystem::copy(other.JobDir(job), d_.JobDir(job),
                          std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
  }
  ASSERT_TRUE(std::filesystem::exists(d_.StepDir(job, 7) + "/metadata.json"));
  std::fill(r1.w.begin(), r1.w.end(), 0.0f);
  auto second = r1.client->Restore(std::nullopt, r1.bufs, std::chrono::seconds(10));
  ASSERT_OK(second.status());
  EXPECT_FALSE(second->found) << "rank 1 restored step " << second->step << " where rank 0 found nothing";
  EXPECT_TRUE(std::all_of(r1.w.begin(), r1.w.end(), [](float x) { return x == 0.0f; }));
}

// A daemon whose ranks of the job hold no memory checkpoints (and do not take them) answers them
// at once from the disk, and publishes one view of them all for the daemons that agree: a daemon
// whose rank takes memory checkpoints decides on the disk with it. Before, each rank's view
// replaced the last one's, the other daemon never saw both ranks and failed at its deadline.
TEST(MemoryTierAgreement, RanksHoldingNoMemoryOnADaemonAreAllSeenByTheDaemonsThatAgree) {
  const std::string job = "memtier-alone";
  InProcessDaemon d1("flashckpt-memory-test"), d2("flashckpt-memory-test");
  ASSERT_OK(d1.Start());
  ASSERT_OK(d2.Start([&](DaemonConfig& c) { c.root = d1.root(); }));
  const auto memory = [](ClientOptions& o) { o.memory_checkpoints = true; };
  {
    TestTrainer r0 = StartRank(d1, job, 0, memory, 3), r1 = StartRank(d2, job, 1, {}, 3),
                r2 = StartRank(d2, job, 2, {}, 3);
    ASSERT_TRUE(r0.client && r1.client && r2.client);
    for (TestTrainer* r : {&r0, &r1, &r2}) ASSERT_OK(r->Snapshot(4).status());
    ASSERT_OK(r0.client->WaitComplete(4, std::chrono::seconds(10)));
  }
  TestTrainer r0 = StartRank(d1, job, 0, memory, 3), r1 = StartRank(d2, job, 1, {}, 3),
              r2 = StartRank(d2, job, 2, {}, 3);
  ASSERT_TRUE(r0.client && r1.client && r2.client);
  for (TestTrainer* r : {&r1, &r2}) {
    auto got = r->client->Restore(std::nullopt, r->bufs, std::chrono::seconds(10));
    ASSERT_OK(got.status());
    EXPECT_EQ(got->step, 4);
  }
  auto got = r0.client->Restore(std::nullopt, r0.bufs, std::chrono::seconds(4));
  ASSERT_OK(got.status());
  EXPECT_EQ(got->step, 4);
  EXPECT_EQ(got->tier, Tier::kDisk);
  EXPECT_TRUE(r0.All(4));
}

TEST_F(MemoryTierTest, APlanThatALateRankCannotKeepFailsLoudlyUntilTheJobRestarts) {
  const std::string job = "memtier-lost";
  std::string segment1;
  uint64_t slot6 = 0;
  {
    TestTrainer r0 = StartRank(d_, job, 0), r1 = StartRank(d_, job, 1);
    ASSERT_TRUE(r0.client && r1.client);
    ASSERT_OK(r0.Snapshot(4).status());
    ASSERT_OK(r1.Save(4));
    ASSERT_OK(r0.client->WaitComplete(4, std::chrono::seconds(30)));
    for (int64_t step : {5, 6}) {
      ASSERT_OK(r0.Memory(step));
      ASSERT_OK(r1.Memory(step));
    }
    segment1 = SegmentPath(job, 1);
    ASSERT_FALSE(segment1.empty());
    slot6 = KeptSlotOffset(segment1, 6);
    ASSERT_NE(slot6, 0u);
  }
  TestTrainer r0 = StartRank(d_, job, 0), r1 = StartRank(d_, job, 1);
  ASSERT_TRUE(r0.client && r1.client);
  auto got = r0.client->Restore(std::nullopt, r0.bufs, std::chrono::seconds(10));
  ASSERT_OK(got.status());
  EXPECT_EQ(got->step, 6);
  EXPECT_EQ(got->tier, Tier::kMemory);
  // Rank 1's copy of step 6 goes bad after the plan verified it: rank 1 must not restore another
  // step while rank 0 trains from 6.
  FlipTensorByte(segment1, slot6);
  for (int attempt = 0; attempt < 2; ++attempt) {  // and a retry is told the same
    SCOPED_TRACE(attempt);
    Status s = r1.client->Restore(std::nullopt, r1.bufs, std::chrono::seconds(10)).status();
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "step 6")) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "restore every rank again")) << s.ToString();
  }
  // Restarted, the ranks agree on what is left: rank 1's memory went with the bad copy, so disk 4.
  r0.client.reset();
  r1.client.reset();
  TestTrainer n0 = StartRank(d_, job, 0), n1 = StartRank(d_, job, 1);
  ASSERT_TRUE(n0.client && n1.client);
  ExpectLatest(n0, 4, Tier::kDisk);
  ExpectLatest(n1, 4, Tier::kDisk);
}

TEST_F(MemoryTierTest, TheNewestMemoryCheckpointIsKeptWhileTheNextIsTaken) {
  TestTrainer t = d_.StartTrainer("memtier-keep", kFloats);
  ASSERT_TRUE(t.client);
  for (int64_t step = 1; step <= 20; ++step) {
    SCOPED_TRACE(step);
    ASSERT_OK(t.Memory(step));
  }
  t.client.reset();
  TestTrainer next = d_.StartTrainer("memtier-keep", kFloats);
  ASSERT_TRUE(next.client);
  auto r = next.client->Restore(std::nullopt, next.bufs, std::chrono::seconds(10));
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 20);
  EXPECT_EQ(r->tier, Tier::kMemory);
  EXPECT_TRUE(next.All(20));
  // With 2 slots, 19 is the other one kept; 18 was reused for 20.
  r = next.client->Restore(19, next.bufs, std::chrono::seconds(10));
  ASSERT_OK(r.status());
  EXPECT_EQ(r->tier, Tier::kMemory);
  EXPECT_TRUE(next.All(19));
  EXPECT_EQ(next.client->Restore(18, next.bufs, std::chrono::seconds(10)).status().code(), StatusCode::kNotFound);
}

TEST(MemoryTierLimits, MemoryCheckpointsNeedTwoSlots) {
  InProcessDaemon d("flashckpt-memory-test");
  ASSERT_OK(d.Start([](DaemonConfig& c) { c.slots = 1; }));
  TestTrainer t = d.StartTrainer("memtier-one", kFloats);
  ASSERT_TRUE(t.client);
  Status s = t.Memory(1);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "--slots")) << s.ToString();
  ASSERT_OK(t.Save(2));  // a disk save still works

  // A rank that declares memory checkpoints (ClientOptions::memory_checkpoints) is told at Register.
  std::unique_ptr<Client> declared =
      d.Connect("memtier-declared", 0, [](ClientOptions& o) { o.memory_checkpoints = true; });
  ASSERT_TRUE(declared);
  Status registered = declared->Register(Topology{}, ModelAndMomentSpecs(kFloats));
  EXPECT_EQ(registered.code(), StatusCode::kFailedPrecondition) << registered.ToString();
  EXPECT_TRUE(Contains(registered.message(), "with memory checkpoints: memory checkpoints need --slots >= 2"))
      << registered.ToString();
}

TEST_F(MemoryTierTest, ARankDeclaringMemoryCheckpointsRegistersWhenTheSlotsFit) {
  TestTrainer t = d_.StartTrainer("memtier-fits", kFloats, [](ClientOptions& o) { o.memory_checkpoints = true; });
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Memory(1));
}

TEST_F(MemoryTierTest, BadCombinationsAreRefused) {
  TestTrainer t = d_.StartTrainer("memtier-bad", kFloats);
  ASSERT_TRUE(t.client);
  SnapshotOptions o;
  o.tier = Tier::kMemory;
  o.persist = false;
  EXPECT_EQ(t.client->Snapshot(1, t.bufs, o).status().code(), StatusCode::kInvalidArgument);

}

// A rank with EMA tensors takes memory checkpoints too, each with the EMA of its step: a new process
// of the rank that restores one from memory gets that step's EMA, not the newest.
TEST_F(MemoryTierTest, AMemoryCheckpointOfARankWithEmaHoldsTheEmaOfItsStep) {
  EmaOptions with_ema;
  with_ema.decay = 0.5;
  std::unique_ptr<Client> first = d_.Connect("memtier-ema", 0, [](ClientOptions& o) { o.memory_checkpoints = true; });
  ASSERT_TRUE(first);
  ASSERT_OK(first->Register(Topology{}, ModelAndMomentSpecs(kFloats), with_ema));
  std::vector<float> w(kFloats), m(kFloats);
  const std::vector<TensorBuffer> bufs = {{"w", w.data(), kFloats * 4}, {"w.exp_avg", m.data(), kFloats * 4}};
  SnapshotOptions memory;
  memory.tier = Tier::kMemory;
  for (int64_t step : {1, 2}) {  // EMA 1.0 at step 1 (the first update copies), 0.5*1 + 0.5*3 = 2.0 at step 2
    std::fill(w.begin(), w.end(), step == 1 ? 1.0f : 3.0f);
    std::fill(m.begin(), m.end(), static_cast<float>(-step));
    ASSERT_OK(first->Snapshot(step, bufs, memory).status());
  }
  first.reset();

  std::unique_ptr<Client> second = d_.Connect("memtier-ema");
  ASSERT_TRUE(second);
  ASSERT_OK(second->Register(Topology{}, ModelAndMomentSpecs(kFloats), with_ema));
  auto restored = second->Restore(1, bufs, std::chrono::seconds(10));
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  ASSERT_TRUE(restored->found);
  EXPECT_EQ(restored->tier, Tier::kMemory);
  EXPECT_TRUE(std::all_of(w.begin(), w.end(), [](float x) { return x == 1.0f; }));
  std::vector<float> ema(kFloats);
  auto got = second->Ema({{"w", ema.data(), kFloats * 4}}, std::chrono::seconds(10));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->step, 1);
  EXPECT_TRUE(std::all_of(ema.begin(), ema.end(), [](float x) { return x == 1.0f; }))
      << "the EMA after restoring memory step 1 is " << ema[0] << ", not step 1's 1.0";
  // The EMA segment outlives a daemon by design; no daemon comes after this one.
  const std::string ema_segment = d_.daemon()->EmaSegmentName("memtier-ema", 0);
  second.reset();
  d_.Stop();
  SharedSegment::Unlink(ema_segment);
}

// --persist-on-stop: the newest memory checkpoint newer than the disk's is written at a stop.
TEST(MemoryTierStop, AStopWritesTheNewestMemoryCheckpointThatTheDiskLacks) {
  for (bool persist : {true, false}) {
    SCOPED_TRACE(persist);
    InProcessDaemon d("flashckpt-memory-test");
    ASSERT_OK(d.Start([&](DaemonConfig& c) { c.persist_on_stop = persist; }));
    TestTrainer t = d.StartTrainer("memtier-stop", kFloats);
    ASSERT_TRUE(t.client);
    ASSERT_OK(t.Save(10));
    ASSERT_OK(t.Memory(11));
    ASSERT_OK(t.Memory(12));
    ASSERT_NE(KeptSlotOffset(SegmentPath("memtier-stop"), 12), 0u);  // checksummed: kept
    t.client.reset();  // the trainer is gone (or still there: either way the daemon stops)
    d.Stop();
    EXPECT_EQ(std::filesystem::exists(d.StepDir("memtier-stop", 12) + "/metadata.json"), persist);
    EXPECT_FALSE(std::filesystem::exists(d.StepDir("memtier-stop", 11)));  // only the newest
    if (persist) {
      // Complete and restorable by the next daemon, with its extra state.
      ASSERT_OK(d.Start());
      TestTrainer again = d.StartTrainer("memtier-stop", kFloats);
      ASSERT_TRUE(again.client);
      auto r = again.client->Restore(std::nullopt, again.bufs, std::chrono::seconds(10));
      ASSERT_OK(r.status());
      EXPECT_EQ(r->step, 12);
      EXPECT_EQ(r->tier, Tier::kDisk);
      EXPECT_EQ(r->extra, "{\"step\":12}");
      EXPECT_TRUE(again.All(12));
    }
  }
}

TEST(MemoryTierStop, AMemoryCheckpointThatFailsItsChecksumsIsNotWrittenAtTheStop) {
  InProcessDaemon d("flashckpt-memory-test");
  ASSERT_OK(d.Start());
  TestTrainer t = d.StartTrainer("memtier-stop-bad", kFloats);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(10));
  ASSERT_OK(t.Memory(11));
  ASSERT_OK(t.Memory(12));
  const std::string segment = SegmentPath("memtier-stop-bad");
  const uint64_t slot = KeptSlotOffset(segment, 12);
  ASSERT_NE(slot, 0u);
  t.client.reset();
  FlipTensorByte(segment, slot);
  d.Stop();
  // Written, the flipped byte would have made a complete checkpoint with checksums of its own.
  EXPECT_FALSE(std::filesystem::exists(d.StepDir("memtier-stop-bad", 12) + "/metadata.json"));
  EXPECT_FALSE(std::filesystem::exists(d.StepDir("memtier-stop-bad", 11)));
  EXPECT_TRUE(std::filesystem::exists(d.StepDir("memtier-stop-bad", 10) + "/metadata.json"));
}

TEST(MemoryTierStop, NothingIsWrittenWhenTheDiskIsNewer) {
  InProcessDaemon d("flashckpt-memory-test");
  ASSERT_OK(d.Start());
  TestTrainer t = d.StartTrainer("memtier-stop-old", kFloats);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Memory(5));
  ASSERT_NE(KeptSlotOffset(SegmentPath("memtier-stop-old"), 5), 0u);
  ASSERT_OK(t.Save(6));
  t.client.reset();
  d.Stop();
  EXPECT_FALSE(std::filesystem::exists(d.StepDir("memtier-stop-old", 5)));
  EXPECT_TRUE(std::filesystem::exists(d.StepDir("memtier-stop-old", 6) + "/metadata.json"));
}

}  // namespace
}  // namespace flashckpt

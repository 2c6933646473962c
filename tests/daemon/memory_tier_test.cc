// Memory checkpoints (SnapshotOptions::tier = kMemory): kept in the daemon's slots, never written,
// restored from memory to a trainer that died, verified before they are handed over.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "common/io/fs.h"
#include "common/io/shm.h"
#include "in_process_daemon.h"

namespace flashckpt {
namespace {

constexpr uint64_t kFloats = 4096;  // 16 KiB per tensor: several 4 KiB pages, one checksum chunk

// A memory checkpoint of `step`: the trainer's tensors hold step / -step, its extra state names it.
Status Memory(TestTrainer& t, int64_t step) {
  std::fill(t.w.begin(), t.w.end(), static_cast<float>(step));
  std::fill(t.m.begin(), t.m.end(), static_cast<float>(-step));
  SnapshotOptions o;
  o.tier = Tier::kMemory;
  o.extra = "{\"step\":" + std::to_string(step) + "}";
  return t.client->Snapshot(step, t.bufs, o).status();
}

// The /dev/shm path of rank 0's slot segment of `job` (its only segment: no EMA).
std::string SegmentPath(const std::string& job) {
  const std::string prefix = "flashckpt." + job + ".0.";
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
        uint32_t state = 1;
        int64_t held = -1;
        if (::pread(fd.get(), &state, 4, static_cast<off_t>(at)) == 4 &&
            ::pread(fd.get(), &held, 8, static_cast<off_t>(at + 8)) == 8 && held == step &&
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

class MemoryTierTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_OK(d_.Start()); }
  InProcessDaemon d_{"flashckpt-memory-test"};
};

TEST_F(MemoryTierTest, AMemoryCheckpointOutlivesItsTrainerAndIsNeverWritten) {
  TestTrainer t = d_.StartTrainer("memtier-mem", kFloats);
  ASSERT_TRUE(t.client);
  ASSERT_OK(t.Save(10));
  ASSERT_OK(Memory(t, 11));
  ASSERT_OK(Memory(t, 12));
  t.client.reset();  // the trainer dies: its session ends
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

TEST_F(MemoryTierTest, ANewerCheckpointOnDiskWinsOverAnOlderOneInMemory) {
  TestTrainer t = d_.StartTrainer("memtier-newer", kFloats);
  ASSERT_TRUE(t.client);
  ASSERT_OK(Memory(t, 5));
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
  ASSERT_OK(Memory(t, 11));
  ASSERT_OK(Memory(t, 12));
  const std::string segment = SegmentPath("memtier-flip");
  ASSERT_FALSE(segment.empty());
  const uint64_t slot = KeptSlotOffset(segment, 12);  // checksummed before the byte flips
  ASSERT_NE(slot, 0u);
  t.client.reset();
  FlipTensorByte(segment, slot);

  TestTrainer next = d_.StartTrainer("memtier-flip", kFloats);
  ASSERT_TRUE(next.client);
  auto r = next.client->Restore(std::nullopt, next.bufs, std::chrono::seconds(10));
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 10);
  EXPECT_EQ(r->tier, Tier::kDisk);
  EXPECT_TRUE(next.All(10));
  // The rank's other memory checkpoint went with it: step 11 is on neither tier.
  EXPECT_EQ(next.client->Restore(11, next.bufs, std::chrono::seconds(10)).status().code(), StatusCode::kNotFound);
}

TEST_F(MemoryTierTest, TheNewestMemoryCheckpointIsKeptWhileTheNextIsTaken) {
  TestTrainer t = d_.StartTrainer("memtier-keep", kFloats);
  ASSERT_TRUE(t.client);
  for (int64_t step = 1; step <= 20; ++step) {
    SCOPED_TRACE(step);
    ASSERT_OK(Memory(t, step));
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
  Status s = Memory(t, 1);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "--slots")) << s.ToString();
  ASSERT_OK(t.Save(2));  // a disk save still works
}

TEST_F(MemoryTierTest, BadCombinationsAreRefused) {
  TestTrainer t = d_.StartTrainer("memtier-bad", kFloats);
  ASSERT_TRUE(t.client);
  SnapshotOptions o;
  o.tier = Tier::kMemory;
  o.persist = false;
  EXPECT_EQ(t.client->Snapshot(1, t.bufs, o).status().code(), StatusCode::kInvalidArgument);

  // A rank with EMA tensors: not yet.
  std::unique_ptr<Client> ema = d_.Connect("memtier-ema");
  ASSERT_TRUE(ema);
  EmaOptions with_ema;
  with_ema.decay = 0.9;
  ASSERT_OK(ema->Register(Topology{}, ModelAndMomentSpecs(kFloats), with_ema));
  std::vector<float> w(kFloats), m(kFloats);
  SnapshotOptions memory;
  memory.tier = Tier::kMemory;
  Status s = ema->Snapshot(1, {{"w", w.data(), kFloats * 4}, {"w.exp_avg", m.data(), kFloats * 4}}, memory).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "EMA")) << s.ToString();
  // The EMA segment outlives a daemon by design; no daemon comes after this one.
  const std::string ema_segment = d_.daemon()->EmaSegmentName("memtier-ema", 0);
  ema.reset();
  d_.Stop();
  SharedSegment::Unlink(ema_segment);
}

}  // namespace
}  // namespace flashckpt

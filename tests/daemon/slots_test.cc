#include "daemon/core/slots.h"

#include <fstream>
#include <memory>
#include <vector>

#include "common/io/fs.h"
#include "daemon/core/state_dir.h"
#include "daemon/edge/state_records.h"
#include "common/test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

TEST(SlotTable, SaveCycleFreesTheSlot) {
  SlotTable t(2);
  auto a = t.Acquire(SlotState::kFilling, 10);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(t.at(a->slot).state, SlotState::kFilling);
  ASSERT_OK(t.Commit(*a, 10));
  EXPECT_EQ(t.at(a->slot).state, SlotState::kCommitted);
  ASSERT_OK(t.BeginPersist(*a));
  EXPECT_EQ(t.at(a->slot).state, SlotState::kPersisting);
  ASSERT_OK(t.Release(*a, SlotState::kPersisting));
  EXPECT_EQ(t.CountIn(SlotState::kFree), 2u);
}

TEST(SlotTable, HandsOutEachSlotOnceUntilReleased) {
  SlotTable t(2);
  auto a = t.Acquire(SlotState::kFilling, 1);
  auto b = t.Acquire(SlotState::kFilling, 2);
  ASSERT_TRUE(a && b);
  EXPECT_NE(a->slot, b->slot);
  EXPECT_FALSE(t.Acquire(SlotState::kFilling, 3).has_value());
  ASSERT_OK(t.Release(*a, SlotState::kFilling));
  auto c = t.Acquire(SlotState::kRestoring, 4);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->slot, a->slot);
  EXPECT_GT(c->generation, a->generation);
}

TEST(SlotTable, CommitOfASlotNotHandedOutFails) {
  SlotTable t(2);
  Status s = t.Commit(SlotTicket{0, 1}, 5);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_EQ(t.Commit(SlotTicket{7, 1}, 5).code(), StatusCode::kInvalidArgument);
}

TEST(SlotTable, SecondCommitOfTheSameSlotFails) {
  SlotTable t(1);
  auto a = t.Acquire(SlotState::kFilling, 5);
  ASSERT_OK(t.Commit(*a, 5));
  Status again = t.Commit(*a, 5);
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.message().find("committed"), std::string::npos) << again.message();
}

TEST(SlotTable, StaleGenerationCannotTouchAReusedSlot) {
  SlotTable t(1);
  auto a = t.Acquire(SlotState::kFilling, 5);
  ASSERT_OK(t.Release(*a, SlotState::kFilling));
  auto b = t.Acquire(SlotState::kFilling, 6);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(t.Commit(*a, 5).code(), StatusCode::kFailedPrecondition);
  ASSERT_OK(t.Commit(*b, 6));
}

TEST(SlotTable, CommitMustNameTheStepTheSlotWasTakenFor) {
  SlotTable t(1);
  auto a = t.Acquire(SlotState::kFilling, 5);
  EXPECT_EQ(t.Commit(*a, 6).code(), StatusCode::kInvalidArgument);
}

TEST(SlotTable, AbandonFreesFillingAndRestoringButNotPersistingOrLoading) {
  SlotTable t(4);
  auto filling = t.Acquire(SlotState::kFilling, 1);
  auto persisting = t.Acquire(SlotState::kFilling, 2);
  ASSERT_OK(t.Commit(*persisting, 2));
  ASSERT_OK(t.BeginPersist(*persisting));
  auto restoring = t.Acquire(SlotState::kRestoring, 3);
  auto loading = t.Acquire(SlotState::kRestoring, 3);
  t.SetLoading(loading->slot, true);
  EXPECT_EQ(t.AbandonInFlight(), 2u);
  EXPECT_EQ(t.at(filling->slot).state, SlotState::kFree);
  EXPECT_EQ(t.at(restoring->slot).state, SlotState::kFree);
  EXPECT_EQ(t.at(persisting->slot).state, SlotState::kPersisting);
  EXPECT_EQ(t.at(loading->slot).state, SlotState::kRestoring);
}

// A memory snapshot of `step`: filled, committed and kept (its checksums computed).
SlotTicket KeepMemory(SlotTable& t, int64_t step) {
  auto ticket = t.Acquire(SlotState::kFilling, step, SlotTier::kMemory);
  EXPECT_TRUE(ticket.has_value()) << step;
  EXPECT_OK(t.Commit(*ticket, step));
  auto resident = std::make_shared<ResidentCheckpoint>();
  resident->step = step;
  EXPECT_OK(t.MakeResident(*ticket, resident));
  return *ticket;
}

TEST(SlotTable, TheNewestMemoryCheckpointIsKeptUntilANewerOneIsKept) {
  SlotTable t(2);
  const SlotTicket one = KeepMemory(t, 1);
  EXPECT_EQ(t.at(one.slot).state, SlotState::kFree);
  EXPECT_EQ(t.ResidentSteps(), std::vector<int64_t>{1});
  auto two = t.Acquire(SlotState::kFilling, 2, SlotTier::kMemory);
  ASSERT_TRUE(two.has_value());
  EXPECT_NE(two->slot, one.slot);
  // Step 1 is the only memory checkpoint: no slot for step 3, not even once step 2 has committed.
  EXPECT_FALSE(t.Acquire(SlotState::kFilling, 3, SlotTier::kMemory).has_value());
  ASSERT_OK(t.Commit(*two, 2));
  EXPECT_FALSE(t.Acquire(SlotState::kFilling, 3, SlotTier::kMemory).has_value());
  auto kept = std::make_shared<ResidentCheckpoint>();
  kept->step = 2;
  ASSERT_OK(t.MakeResident(*two, kept));
  EXPECT_EQ(t.ResidentSteps(), (std::vector<int64_t>{2, 1}));
  // Now step 1's slot may go; step 2's stays.
  auto three = t.Acquire(SlotState::kFilling, 3, SlotTier::kMemory);
  ASSERT_TRUE(three.has_value());
  EXPECT_EQ(three->slot, one.slot);
  EXPECT_EQ(t.ResidentIn(one.slot), nullptr);
  EXPECT_EQ(t.ResidentSteps(), std::vector<int64_t>{2});
}

TEST(SlotTable, ACommittedDiskSnapshotLetsTheNewestMemoryCheckpointGo) {
  SlotTable t(2);
  const SlotTicket one = KeepMemory(t, 1);
  auto disk = t.Acquire(SlotState::kFilling, 2);
  ASSERT_TRUE(disk.has_value());
  EXPECT_FALSE(t.Acquire(SlotState::kFilling, 3, SlotTier::kMemory).has_value());  // step 2 may still fail
  ASSERT_OK(t.Commit(*disk, 2));
  ASSERT_OK(t.BeginPersist(*disk));
  auto three = t.Acquire(SlotState::kFilling, 3, SlotTier::kMemory);
  ASSERT_TRUE(three.has_value());
  EXPECT_EQ(three->slot, one.slot);
}

TEST(SlotTable, SlotsHoldingNothingAreTakenFirst) {
  SlotTable t(3);
  const SlotTicket one = KeepMemory(t, 1);
  EXPECT_EQ(one.slot, 0u);
  const SlotTicket two = KeepMemory(t, 2);
  EXPECT_EQ(two.slot, 1u);
  auto disk = t.Acquire(SlotState::kFilling, 3);
  ASSERT_TRUE(disk.has_value());
  EXPECT_EQ(disk->slot, 2u);
  ASSERT_OK(t.Release(*disk, SlotState::kFilling));
  auto restore = t.Acquire(SlotState::kRestoring, 3);
  ASSERT_TRUE(restore.has_value());
  EXPECT_EQ(restore->slot, 2u);
  EXPECT_EQ(t.ResidentSteps(), (std::vector<int64_t>{2, 1}));
}

TEST(SlotTable, ARestoreHandsOverTheResidentSlotAndKeepsIt) {
  SlotTable t(2);
  const SlotTicket kept = KeepMemory(t, 5);
  EXPECT_FALSE(t.AcquireResident(4).has_value());
  auto r = t.AcquireResident(5);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->slot, kept.slot);
  EXPECT_GT(r->generation, kept.generation);
  EXPECT_EQ(t.at(r->slot).state, SlotState::kRestoring);
  EXPECT_FALSE(t.AcquireResident(5).has_value());  // handed out once
  EXPECT_EQ(t.AbandonInFlight(), 1u);                 // the trainer died while copying out
  EXPECT_EQ(t.ResidentSteps(), std::vector<int64_t>{5});
  auto again = t.AcquireResident(5);
  ASSERT_TRUE(again.has_value());
  ASSERT_OK(t.Release(*again, SlotState::kRestoring));
  EXPECT_EQ(t.ResidentSteps(), std::vector<int64_t>{5});
  // The stale ticket of the first hand-out can do nothing.
  EXPECT_EQ(t.Release(*r, SlotState::kRestoring).code(), StatusCode::kFailedPrecondition);
}

TEST(SlotTable, DroppingFromAStepForgetsItAndLaterOnes) {
  SlotTable t(3);
  KeepMemory(t, 1);
  KeepMemory(t, 2);
  auto three = t.Acquire(SlotState::kFilling, 3, SlotTier::kMemory);
  ASSERT_TRUE(three.has_value());
  ASSERT_OK(t.Commit(*three, 3));
  auto kept = std::make_shared<ResidentCheckpoint>();
  kept->step = 3;
  ASSERT_OK(t.MakeResident(*three, kept));
  EXPECT_EQ(t.DropResidentsFrom(2), 2u);
  EXPECT_EQ(t.ResidentSteps(), std::vector<int64_t>{1});
  EXPECT_EQ(t.CountIn(SlotState::kFree), 3u);
}

TEST(SlotTable, OnlyACommittedSlotOfTheSameStepIsKept) {
  SlotTable t(2);
  auto a = t.Acquire(SlotState::kFilling, 4, SlotTier::kMemory);
  ASSERT_TRUE(a.has_value());
  auto kept = std::make_shared<ResidentCheckpoint>();
  kept->step = 4;
  EXPECT_EQ(t.MakeResident(*a, kept).code(), StatusCode::kFailedPrecondition);  // not committed
  ASSERT_OK(t.Commit(*a, 4));
  kept->step = 3;
  EXPECT_EQ(t.MakeResident(*a, kept).code(), StatusCode::kInternal);
  EXPECT_TRUE(t.ResidentSteps().empty());
}

TEST(SlotTable, AnAdoptedMemoryCheckpointIsHeldAtItsGenerationAndProtectedAsTheNewest) {
  SlotTable t(2);
  auto kept = std::make_shared<ResidentCheckpoint>();
  kept->step = 44;
  ASSERT_OK(t.AdoptResident(SlotTicket{1, 90}, kept));
  EXPECT_EQ(t.ResidentSteps(), std::vector<int64_t>{44});
  EXPECT_EQ(t.at(1).generation, 90u);
  EXPECT_EQ(t.at(1).state, SlotState::kFree);
  // A slot that holds one already, or one that does not exist, takes no other.
  EXPECT_EQ(t.AdoptResident(SlotTicket{1, 91}, kept).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.AdoptResident(SlotTicket{2, 1}, kept).code(), StatusCode::kInvalidArgument);
  // The next snapshots take slot 0 (it holds nothing), never the adopted newest one.
  for (int64_t step = 45; step < 48; ++step) {
    auto next = t.Acquire(SlotState::kFilling, step, SlotTier::kDisk);
    ASSERT_TRUE(next.has_value());
    EXPECT_EQ(next->slot, 0u);
    ASSERT_OK(t.Release(*next, SlotState::kFilling));
  }
  auto filling = t.Acquire(SlotState::kFilling, 48, SlotTier::kMemory);
  ASSERT_TRUE(filling.has_value());
  EXPECT_FALSE(t.Acquire(SlotState::kFilling, 49, SlotTier::kMemory).has_value());  // 44 is the newest held
  // A restore takes it at a later generation than the one adopted.
  auto restore = t.AcquireResident(44);
  ASSERT_TRUE(restore.has_value());
  EXPECT_EQ(restore->slot, 1u);
  EXPECT_EQ(restore->generation, 91u);
}

// The state directory's records of a segment: a memory record sits beside commit records, even for
// a segment whose name contains ".slot"; a torn one is dropped; all go with the segment.
TEST(StateDirRecords, MemoryRecordsAreLoadedWithTheirSegmentAndRemovedWithIt) {
  testing::TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  EXPECT_FALSE(StateDir::Open(tmp.File("state"), nullptr).ok());  // no codec: refused, not a silent no-op
  auto dir = StateDir::Open(tmp.File("state"), &ProtoStateRecords());
  ASSERT_OK(dir.status());
  const std::string name = "flashckpt.a.slot1.0.tok";
  SegmentRecord seg;
  seg.job = "a.slot1";
  seg.segment_name = name;
  seg.slot_count = 3;
  ASSERT_OK(dir->SaveSegment(seg));
  CommitRecord commit;
  commit.slot = 0;
  commit.step = 30;
  commit.loss = 2.5;
  ASSERT_OK(dir->SaveCommit(name, commit));
  for (int64_t step : {44, 43}) {
    MemoryRecord mem;
    mem.slot = static_cast<uint32_t>(step - 42);
    mem.step = step;
    mem.sums.push_back(0x1234567890abcdefull);
    ASSERT_OK(dir->SaveMemory(name, mem));
  }
  std::ofstream(tmp.File("state/" + name + ".mem7")) << "not a record";
  auto loaded = dir->Load();
  ASSERT_EQ(loaded.size(), 1u);
  ASSERT_EQ(loaded[0].commits.size(), 1u);
  EXPECT_EQ(loaded[0].commits[0].step, 30);
  EXPECT_EQ(loaded[0].commits[0].loss, std::optional<double>(2.5));
  ASSERT_EQ(loaded[0].memory.size(), 2u);
  EXPECT_EQ(loaded[0].memory[0].step, 43);  // sorted by step
  EXPECT_EQ(loaded[0].memory[1].step, 44);
  ASSERT_EQ(loaded[0].memory[1].sums.size(), 1u);
  EXPECT_EQ(loaded[0].memory[1].sums[0], 0x1234567890abcdefull);
  EXPECT_FALSE(PathExists(tmp.File("state/" + name + ".mem7")));  // torn: dropped
  dir->RemoveMemory(name, 1);
  EXPECT_EQ(dir->Load()[0].memory.size(), 1u);
  dir->RemoveSegment(name);
  auto left = ListDir(tmp.File("state"));
  ASSERT_OK(left.status());
  EXPECT_TRUE(left->empty()) << left->front();
}

// Parity release records: one per job, loaded back by job; one whose content is not the job its name
// gives, or not a valid job, is dropped; segment loading leaves them alone.
TEST(StateDirRecords, ParityReleaseRecordsAreLoadedByJobAndBadOnesDropped) {
  testing::TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  auto dir = StateDir::Open(tmp.File("state"), &ProtoStateRecords());
  ASSERT_OK(dir.status());
  ASSERT_OK(dir->SaveParityRelease("job-b"));
  ASSERT_OK(dir->SaveParityRelease("job.a"));
  ASSERT_OK(dir->SaveParityRelease("job-b"));  // again: one record
  std::ofstream(tmp.File("state/other.released")) << "job-b";  // names another job
  std::ofstream(tmp.File("state/bad.released")) << "bad/name";
  EXPECT_TRUE(dir->Load().empty());
  EXPECT_EQ(dir->LoadParityReleases(), (std::vector<std::string>{"job-b", "job.a"}));  // by file name
  EXPECT_FALSE(PathExists(tmp.File("state/other.released")));
  EXPECT_FALSE(PathExists(tmp.File("state/bad.released")));
  EXPECT_TRUE(dir->RemoveParityRelease("job-b"));
  EXPECT_FALSE(dir->RemoveParityRelease("job-b"));  // none left: the daemon says nothing was heard
  EXPECT_EQ(dir->LoadParityReleases(), (std::vector<std::string>{"job.a"}));
  EXPECT_TRUE(dir->RemoveParityRelease("job.a"));
  auto left = ListDir(tmp.File("state"));
  ASSERT_OK(left.status());
  EXPECT_TRUE(left->empty()) << left->front();
}

}  // namespace
}  // namespace flashckpt

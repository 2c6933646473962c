#include "daemon/core/slots.h"

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

}  // namespace
}  // namespace flashckpt

// ResumeAgreement: the daemons of a job agreeing, through files in the root they share, on the
// step its ranks restore. Each "daemon" here is an agreement object of its own name over one real
// directory, as two daemons on two nodes would be over a shared root.

#include "daemon/core/resume_agreement.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>
#include <tuple>

#include "common/io/io_env.h"
#include "support/offset_clock.h"

namespace flashckpt {
namespace {

namespace fs = std::filesystem;

class ResumeAgreementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("resume_agreement_test." + std::to_string(::getpid()) + "." +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  ResumeAgreement Daemon(const std::string& name) { return ResumeAgreement(dir_.string(), name, IoEnv::Default(), clock_); }
  std::vector<std::string> Files(const std::string& prefix) const {
    std::vector<std::string> out;
    if (!fs::exists(dir_)) return out;
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().filename().string());
    }
    return out;
  }

  fs::path dir_;
  OffsetClock clock_;
};

TEST_F(ResumeAgreementTest, TwoDaemonsAgreeOnTheNewestStepEveryRankHolds) {
  ResumeAgreement a = Daemon("nodea");
  ResumeAgreement b = Daemon("nodeb");
  // Rank 0 on a holds 17 and 16, rank 1 on b (a replica fetched from a peer) 17 and 15; disk: 10.
  auto first = a.Round(2, {{0, "a-1", {17, 16}}}, 10);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_FALSE(first->has_value());  // rank 1 has not asked yet
  EXPECT_EQ(a.missing(), std::vector<uint32_t>{1});

  auto by_b = b.Round(2, {{1, "b-1", {17, 15}}}, 10);
  ASSERT_TRUE(by_b.ok() && by_b->has_value()) << by_b.status().ToString();
  EXPECT_TRUE((*by_b)->found);
  EXPECT_TRUE((*by_b)->memory);
  EXPECT_EQ((*by_b)->step, 17);

  auto by_a = a.Round(2, {{0, "a-1", {17, 16}}}, 10);
  ASSERT_TRUE(by_a.ok() && by_a->has_value());
  EXPECT_EQ((*by_a)->file, (*by_b)->file);  // one decision, read by the other
  EXPECT_EQ(std::make_tuple((*by_a)->step, (*by_a)->memory), std::make_tuple((*by_b)->step, (*by_b)->memory));

  // Done: the views go, the decision stays for ranks that ask late.
  a.Withdraw();
  b.Withdraw();
  EXPECT_TRUE(Files("view-").empty());
  EXPECT_EQ(Files("plan-").size(), 1u);
  ResumeAgreement late = Daemon("nodeb2");
  auto again = late.Round(2, {{1, "b-1", {}}}, 0);
  ASSERT_TRUE(again.ok() && again->has_value());
  EXPECT_EQ((*again)->step, 17);
}

TEST_F(ResumeAgreementTest, TheDiskWhenARankHoldsNoCommonStepOrTheDiskIsNewer) {
  {
    // Rank 1's node was lost with its memory and no peer had a copy: the disk's 10.
    ResumeAgreement a = Daemon("a"), b = Daemon("b");
    ASSERT_TRUE(a.Round(2, {{0, "a-1", {17}}}, 10).ok());
    auto plan = b.Round(2, {{1, "b-1", {}}}, 10);
    ASSERT_TRUE(plan.ok() && plan->has_value());
    EXPECT_EQ(std::make_tuple((*plan)->found, (*plan)->memory, (*plan)->step), std::make_tuple(true, false, 10));
    a.Withdraw();
    b.Withdraw();
  }
  {
    // The disk's 20, seen by one daemon only, is newer than the memory's 17 that both hold.
    ResumeAgreement a = Daemon("c"), b = Daemon("d");
    ASSERT_TRUE(a.Round(2, {{0, "c-1", {17}}}, 20).ok());
    auto plan = b.Round(2, {{1, "d-1", {17}}}, 10);
    ASSERT_TRUE(plan.ok() && plan->has_value());
    EXPECT_EQ(std::make_tuple((*plan)->memory, (*plan)->step), std::make_tuple(false, 20));
    a.Withdraw();
    b.Withdraw();
  }
  {
    // Nothing anywhere: no step, agreed too.
    ResumeAgreement a = Daemon("e"), b = Daemon("f");
    ASSERT_TRUE(a.Round(2, {{0, "e-1", {}}}, 0).ok());
    auto plan = b.Round(2, {{1, "f-1", {}}}, 0);
    ASSERT_TRUE(plan.ok() && plan->has_value());
    EXPECT_FALSE((*plan)->found);
  }
}

TEST_F(ResumeAgreementTest, AViewNotRewrittenForLongBelongsToAResumeThatIsOver) {
  ResumeAgreement old = Daemon("old");
  ASSERT_TRUE(old.Round(2, {{1, "old-1", {17}}}, 10).ok());  // then its daemon died, its view left behind
  clock_.Advance(ResumeAgreement::kViewFresh + std::chrono::seconds(1));
  ResumeAgreement a = Daemon("a");
  auto plan = a.Round(2, {{0, "a-1", {17}}}, 10);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->has_value());
  EXPECT_EQ(a.missing(), std::vector<uint32_t>{1});
  // Rank 1's new process on a fresh daemon: the plan is made for it, not for the old one.
  ResumeAgreement b = Daemon("b");
  auto made = b.Round(2, {{1, "b-1", {}}}, 10);
  ASSERT_TRUE(made.ok() && made->has_value());
  EXPECT_EQ(std::make_tuple((*made)->memory, (*made)->step), std::make_tuple(false, 10));
  // Temporaries of daemons that died writing a plan or a view.
  std::ofstream(dir_ / ".tmp.old.00000000deadbeef") << "{";
  std::ofstream(dir_ / "view-old.json.tmp.123.node.0") << "{";
  a.Withdraw();  // they are recent: kept (their writers may be writing them now)
  EXPECT_EQ(Files(".tmp.").size(), 1u);
  EXPECT_EQ(Files("view-").size(), 3u);  // old's, b's, and old's temporary (a's is withdrawn)
  // Ten minutes on, whoever withdraws next removes the dead daemon's view, its temporaries and the
  // old plan too.
  clock_.Advance(std::chrono::minutes(11));
  b.Withdraw();
  EXPECT_TRUE(Files("view-").empty());
  EXPECT_TRUE(Files("plan-").empty());
  EXPECT_TRUE(Files(".tmp.").empty());
}

TEST_F(ResumeAgreementTest, APlanOfEarlierProcessesIsNotTaken) {
  {
    ResumeAgreement a = Daemon("a"), b = Daemon("b");
    ASSERT_TRUE(a.Round(2, {{0, "a-1", {7}}}, 0).ok());
    auto plan = b.Round(2, {{1, "b-1", {7}}}, 0);
    ASSERT_TRUE(plan.ok() && plan->has_value());
    EXPECT_EQ((*plan)->step, 7);
    a.Withdraw();
    b.Withdraw();
  }
  // The job failed again after training to 12: new processes, new plan.
  ResumeAgreement a = Daemon("a"), b = Daemon("b");
  auto waiting = a.Round(2, {{0, "a-2", {12, 7}}}, 10);
  ASSERT_TRUE(waiting.ok());
  EXPECT_FALSE(waiting->has_value());
  auto plan = b.Round(2, {{1, "b-2", {12}}}, 10);
  ASSERT_TRUE(plan.ok() && plan->has_value());
  EXPECT_EQ(std::make_tuple((*plan)->memory, (*plan)->step), std::make_tuple(true, 12));
  EXPECT_EQ(Files("plan-").size(), 2u);
}

TEST_F(ResumeAgreementTest, MalformedAndForeignFilesAreIgnored) {
  fs::create_directories(dir_);
  const std::vector<std::pair<std::string, std::string>> junk = {
      {"view-x.json", "not json"},
      {"view-y.json", R"({"world":2,"written_ms":0,"disk":0,"ranks":[{"rank":5,"token":"t","steps":[1]}]})"},
      {"view-z.json", R"({"world":3,"written_ms":0,"disk":0,"ranks":[{"rank":1,"token":"t","steps":[99]}]})"},
      {"plan-0.json", R"({"world":2,"found":true,"step":99,"tier":"memory","ranks":{"0":"a-1","1":"b-1","2":"x"}})"},
      {"plan-1.json", R"({"world":2,"found":true,"step":-4,"tier":"memory","ranks":{"0":"a-1","1":"b-1"}})"},
      {"plan-2.json", R"({"world":2,"found":false,"step":0,"tier":"memory","ranks":{"0":"a-1","1":"b-1"}})"},
      {"plan-3.json", R"({"world":2,"found":true,"step":9,"tier":"memory","ranks":{"0":"a/1","1":"b-1"}})"},
  };
  for (const auto& [name, text] : junk) std::ofstream(dir_ / name) << text;
  ResumeAgreement a = Daemon("a"), b = Daemon("b");
  auto waiting = a.Round(2, {{0, "a-1", {3}}}, 0);
  ASSERT_TRUE(waiting.ok());
  EXPECT_FALSE(waiting->has_value());  // view-y's rank 5 and view-z's world of 3 do not cover rank 1
  auto plan = b.Round(2, {{1, "b-1", {3}}}, 0);
  ASSERT_TRUE(plan.ok() && plan->has_value());
  EXPECT_EQ(std::make_tuple((*plan)->memory, (*plan)->step), std::make_tuple(true, 3));
  // Bad input of our own is refused, not written.
  EXPECT_FALSE(a.Round(2, {{2, "a-1", {3}}}, 0).ok());
  EXPECT_FALSE(a.Round(2, {{0, "a/1", {3}}}, 0).ok());
  EXPECT_FALSE(a.Round(0, {}, 0).ok());
}

TEST_F(ResumeAgreementTest, DaemonsDecidingAtOnceTakeOneDecision) {
  // Four daemons of two ranks each, rounds run concurrently until each has the decision; rank 5
  // lacks step 30, so every one must take 20, the newest all eight hold.
  std::vector<AgreedPlan> got(4);
  std::vector<std::thread> threads;
  for (int d = 0; d < 4; ++d) {
    threads.emplace_back([&, d] {
      ResumeAgreement me = Daemon("d" + std::to_string(d));
      std::vector<RankView> mine;
      for (uint32_t r = 2u * static_cast<uint32_t>(d); r < 2u * static_cast<uint32_t>(d) + 2u; ++r) {
        mine.push_back({r, "d" + std::to_string(d) + "-" + std::to_string(r), r == 5 ? std::vector<int64_t>{20}
                                                                                    : std::vector<int64_t>{30, 20}});
      }
      for (int i = 0; i < 2000; ++i) {
        auto round = me.Round(8, mine, 10);
        ASSERT_TRUE(round.ok()) << round.status().ToString();
        if (round->has_value()) {
          got[d] = **round;
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      FAIL() << "daemon " << d << " never got the decision";
    });
  }
  for (auto& t : threads) t.join();
  for (const AgreedPlan& p : got) {
    EXPECT_EQ(std::make_tuple(p.memory, p.step), std::make_tuple(true, 20));
    EXPECT_EQ(p.file, got[0].file);
  }
  EXPECT_EQ(Files("plan-").size(), 1u);
}

}  // namespace
}  // namespace flashckpt

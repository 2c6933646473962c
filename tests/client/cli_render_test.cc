// What `flashckpt status` shows operators and scripts, from a hand-built StatusResponse.
#include <gtest/gtest.h>

#include <string>

#include "client/cli/render.h"

namespace flashckpt::cli {
namespace {

// Job "llama": rank 0 keeps an EMA, rank 1 holds only replicas (no EMA tensors).
v1::StatusResponse TwoRankStatus() {
  v1::StatusResponse s;
  s.set_version("0.1.0");
  s.set_uptime_seconds(75);
  s.set_host_memory_used(3ull << 30);
  s.set_host_memory_budget(8ull << 30);
  s.set_root("/var/lib/flashckpt");
  auto* job = s.add_jobs();
  job->set_job("llama");
  job->set_world_size(2);
  job->set_last_complete_step(1200);
  auto* r0 = job->add_ranks();
  r0->set_rank(0);
  r0->set_connected(true);
  r0->set_last_committed_step(1250);
  r0->set_last_persisted_step(1200);
  r0->set_ema_enabled(true);
  r0->set_ema_decay(0.9999);
  r0->set_ema_last_step(1250);
  r0->set_ema_updates_applied(117);
  r0->set_ema_updates_skipped(8);
  r0->set_ema_bytes(48ull << 20);
  auto* r1 = job->add_ranks();
  r1->set_rank(1);
  r1->set_connected(true);
  r1->set_last_committed_step(-1);
  r1->set_last_persisted_step(-1);
  r1->set_ema_last_step(-1);
  return s;
}

TEST(StatusText, ShowsTheEmaOfEachRank) {
  std::string text = StatusText(TwoRankStatus());
  EXPECT_NE(text.find("  ema on for 1 of 2 rank(s) here, decay 0.9999\n"), std::string::npos) << text;
  EXPECT_NE(text.find("  RANK  EMA   DECAY  EMA STEP  APPLIED  SKIPPED  EMA SIZE\n"), std::string::npos) << text;
  EXPECT_NE(text.find("   0  on   0.9999      1250      117        8  48.0 MiB\n"), std::string::npos) << text;
  EXPECT_NE(text.find("   1  off       -         -        -        -         -\n"), std::string::npos) << text;
}

TEST(StatusText, JobWithoutEmaSaysOffAndHasNoEmaTable) {
  v1::StatusResponse s = TwoRankStatus();
  s.mutable_jobs(0)->mutable_ranks(0)->set_ema_enabled(false);
  std::string text = StatusText(s);
  EXPECT_NE(text.find("  ema off\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("EMA STEP"), std::string::npos) << text;
}

TEST(StatusText, EmaWithoutUpdateYetShowsDash) {
  v1::StatusResponse s = TwoRankStatus();
  auto* r0 = s.mutable_jobs(0)->mutable_ranks(0);
  r0->set_ema_last_step(-1);
  r0->set_ema_updates_applied(0);
  r0->set_ema_updates_skipped(0);
  std::string text = StatusText(s);
  EXPECT_NE(text.find("   0  on   0.9999         -        0        0  48.0 MiB\n"), std::string::npos) << text;
}

// OLDEST WRITE: how long the rank's oldest persist in flight has run; "-" when none (0).
TEST(StatusText, ShowsHowLongTheOldestWriteHasRun) {
  v1::StatusResponse s = TwoRankStatus();
  s.mutable_jobs(0)->mutable_ranks(0)->set_oldest_write_seconds(2.34);
  std::string text = StatusText(s);
  EXPECT_NE(text.find("  RANK  CONNECTED  MEMORY  COMMITTED  PERSISTED  SLOTS  OLDEST WRITE  SNAPSHOTS  PERSISTS  "
                      "FAILURES  SKIPPED  LAST ERROR\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("     0  yes           0 B       1250       1200  -              2.3s          0"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("     1  yes           0 B          -          -  -                 -          0"),
            std::string::npos)
      << text;
  s.mutable_jobs(0)->mutable_ranks(0)->set_oldest_write_seconds(125);  // a stuck disk: minutes
  text = StatusText(s);
  EXPECT_NE(text.find("  -            2m 05s          0"), std::string::npos) << text;
}

TEST(StatusText, SaysWhetherTheDaemonHasCuda) {
  v1::StatusResponse s = TwoRankStatus();
  EXPECT_NE(StatusText(s).find("\ncuda    not compiled in\n"), std::string::npos) << StatusText(s);
  s.set_cuda_compiled(true);
  EXPECT_NE(StatusText(s).find("\ncuda    compiled in, no device\n"), std::string::npos) << StatusText(s);
  s.set_cuda_devices(8);
  EXPECT_NE(StatusText(s).find("\ncuda    compiled in, 8 devices\n"), std::string::npos) << StatusText(s);
  auto j = StatusJson(s);
  EXPECT_TRUE(j["cuda_compiled"].get<bool>());
  EXPECT_EQ(j["cuda_devices"].get<int>(), 8);
}

TEST(StatusJson, OldestWriteSecondsIsZeroWhenNothingIsBeingWritten) {
  v1::StatusResponse s = TwoRankStatus();
  s.mutable_jobs(0)->mutable_ranks(0)->set_oldest_write_seconds(2.5);
  auto j = StatusJson(s);
  EXPECT_DOUBLE_EQ(j["jobs"][0]["ranks"][0]["oldest_write_seconds"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(j["jobs"][0]["ranks"][1]["oldest_write_seconds"].get<double>(), 0.0);
}

TEST(StatusJson, EveryRankHasAnEmaObjectWithTheSameKeys) {
  auto j = StatusJson(TwoRankStatus());
  const auto& ranks = j["jobs"][0]["ranks"];
  ASSERT_EQ(ranks.size(), 2u);
  const auto& on = ranks[0]["ema"];
  EXPECT_EQ(on["enabled"], true);
  EXPECT_DOUBLE_EQ(on["decay"].get<double>(), 0.9999);
  EXPECT_EQ(on["last_step"], 1250);
  EXPECT_EQ(on["updates_applied"], 117);
  EXPECT_EQ(on["updates_skipped"], 8);
  EXPECT_EQ(on["bytes"], 48ull << 20);
  const auto& off = ranks[1]["ema"];
  EXPECT_EQ(off["enabled"], false);
  EXPECT_TRUE(off["decay"].is_null());
  EXPECT_TRUE(off["last_step"].is_null());
  EXPECT_EQ(off["updates_applied"], 0);
  EXPECT_EQ(off["bytes"], 0);
  std::vector<std::string> keys_on, keys_off;
  for (const auto& [k, v] : on.items()) keys_on.push_back(k);
  for (const auto& [k, v] : off.items()) keys_off.push_back(k);
  EXPECT_EQ(keys_on, keys_off);
}

TEST(StatusJson, EmaWithoutUpdateYetHasNullLastStep) {
  v1::StatusResponse s = TwoRankStatus();
  s.mutable_jobs(0)->mutable_ranks(0)->set_ema_last_step(-1);
  auto j = StatusJson(s);
  EXPECT_TRUE(j["jobs"][0]["ranks"][0]["ema"]["last_step"].is_null());
  EXPECT_EQ(j["jobs"][0]["ranks"][0]["ema"]["enabled"], true);
}

}  // namespace
}  // namespace flashckpt::cli

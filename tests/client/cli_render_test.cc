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

TEST(StatusText, OneLinePerJobWithLagRateAndFailures) {
  v1::StatusResponse s = TwoRankStatus();
  s.mutable_jobs(0)->mutable_ranks(0)->set_last_persist_gbps(4.0);
  s.mutable_jobs(0)->mutable_ranks(1)->set_last_persist_gbps(2.5);
  s.mutable_jobs(0)->mutable_ranks(1)->set_failures(3);
  std::string text = StatusText(s);
  EXPECT_NE(text.find("JOB    RANKS  COMMITTED  DURABLE  LAG  PERSIST GB/s  EMA  FAILURES\n"
                      "llama    2/2       1250     1200   50          3.25  on          3\n"),
            std::string::npos)
      << text;
  auto j = StatusJson(s);
  EXPECT_EQ(j["jobs"][0]["last_committed_step"], 1250);
  EXPECT_DOUBLE_EQ(j["jobs"][0]["ranks"][1]["last_persist_gbps"].get<double>(), 2.5);
}

TEST(StatusText, JobLineBeforeAnyCommit) {
  v1::StatusResponse s = TwoRankStatus();
  s.mutable_jobs(0)->set_last_complete_step(-1);
  s.mutable_jobs(0)->mutable_ranks(0)->set_last_committed_step(-1);
  std::string text = StatusText(s);
  EXPECT_NE(text.find("llama    2/2          -        -    -             -  on          0\n"), std::string::npos)
      << text;
}

TEST(EventText, OneLinePerEventWithItsFields) {
  v1::Event e;
  e.set_kind(v1::Event::PERSISTED);
  e.set_unix_seconds(1795396354.805);  // 2026-11-23T01:12:34.805Z
  e.set_job("llama");
  e.set_step(1200);
  e.set_rank(3);
  e.set_bytes(4000000000);
  e.set_seconds(2.0);
  EXPECT_EQ(EventText(e),
            "2026-11-23T01:12:34.805Z persisted   job=llama step=1200 rank=3 bytes=3.7GiB secs=2.00 gbps=2.00");
  EXPECT_DOUBLE_EQ(EventJson(e)["gbps"].get<double>(), 2.0);
  e.set_kind(v1::Event::PERSIST_FAILED);
  e.set_code("IO_ERROR");
  e.set_reason("write x: Input/output error (errno 5)");
  EXPECT_EQ(EventText(e),
            "2026-11-23T01:12:34.805Z failed      job=llama step=1200 rank=3 code=IO_ERROR "
            "error=\"write x: Input/output error (errno 5)\"");
  EXPECT_EQ(EventJson(e)["code"], "IO_ERROR");
  v1::Event lost;
  lost.set_kind(v1::Event::EVENTS_LOST);
  lost.set_unix_seconds(1795396354.805);
  lost.set_lost(6);
  EXPECT_EQ(EventText(lost), "2026-11-23T01:12:34.805Z lost        6 event(s) dropped: this watcher fell behind");
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

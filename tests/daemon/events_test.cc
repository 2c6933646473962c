// EventHub (the WatchEvents fan-out) and Metrics (the Prometheus exposition), without gRPC: also
// run under ThreadSanitizer.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "daemon/observe/events.h"
#include "daemon/observe/metrics.h"

namespace flashckpt {
namespace {

using Clock = std::chrono::steady_clock;

DaemonEvent MakeEvent(DaemonEvent::Kind kind, const std::string& job, int64_t step) {
  DaemonEvent e;
  e.kind = kind;
  e.job = job;
  e.step = step;
  return e;
}

EventHub::Wait NextWithin(EventHub::Subscription& s, DaemonEvent* e, int ms = 2000) {
  return s.Next(e, Clock::now() + std::chrono::milliseconds(ms));
}

TEST(EventHub, DeliversOnlyTheWatchedJobInOrder) {
  EventHub hub;
  auto a = hub.Subscribe("a");
  auto all = hub.Subscribe("");
  ASSERT_TRUE(a.ok() && all.ok());
  hub.Publish(MakeEvent(DaemonEvent::Kind::kSnapshotCommitted, "a", 1));
  hub.Publish(MakeEvent(DaemonEvent::Kind::kSnapshotCommitted, "b", 2));
  hub.Publish(MakeEvent(DaemonEvent::Kind::kPersisted, "a", 3));
  DaemonEvent e;
  ASSERT_EQ(NextWithin(*a, &e), EventHub::Wait::kEvent);
  EXPECT_EQ(e.step, 1);
  EXPECT_GT(e.unix_seconds, 1.6e9);  // stamped by Publish
  ASSERT_EQ(NextWithin(*a, &e), EventHub::Wait::kEvent);
  EXPECT_EQ(e.step, 3);
  EXPECT_EQ(e.kind, DaemonEvent::Kind::kPersisted);
  EXPECT_EQ(NextWithin(*a, &e, 20), EventHub::Wait::kTimeout);
  for (int64_t want : {1, 2, 3}) {
    ASSERT_EQ(NextWithin(*all, &e), EventHub::Wait::kEvent);
    EXPECT_EQ(e.step, want);
  }
}

TEST(EventHub, ASlowWatcherLosesTheOldestAndIsToldHowMany) {
  EventHub hub(/*queue_capacity=*/4);
  auto w = hub.Subscribe("");
  ASSERT_TRUE(w.ok());
  for (int64_t s = 1; s <= 10; ++s) hub.Publish(MakeEvent(DaemonEvent::Kind::kSnapshotCommitted, "j", s));
  DaemonEvent e;
  ASSERT_EQ(NextWithin(*w, &e), EventHub::Wait::kEvent);
  EXPECT_EQ(e.kind, DaemonEvent::Kind::kEventsLost);
  EXPECT_EQ(e.lost, 6u);
  for (int64_t want : {7, 8, 9, 10}) {
    ASSERT_EQ(NextWithin(*w, &e), EventHub::Wait::kEvent);
    EXPECT_EQ(e.step, want);
  }
  EXPECT_EQ(hub.dropped(), 6u);
  EXPECT_EQ(NextWithin(*w, &e, 20), EventHub::Wait::kTimeout);
}

TEST(EventHub, BoundsTheWatchersAndEndsThemOnClose) {
  EventHub hub(16, /*max_watchers=*/2);
  auto first = hub.Subscribe("");
  {
    auto second = hub.Subscribe("");
    ASSERT_TRUE(first.ok() && second.ok());
    auto third = hub.Subscribe("");
    ASSERT_FALSE(third.ok());
    EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(hub.watchers(), 2u);
  }
  EXPECT_EQ(hub.watchers(), 1u);  // the second unsubscribed in its destructor
  auto again = hub.Subscribe("x");
  ASSERT_TRUE(again.ok());

  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    hub.Close();
  });
  DaemonEvent e;
  auto start = Clock::now();
  EXPECT_EQ(first->Next(&e, Clock::now() + std::chrono::seconds(30)), EventHub::Wait::kClosed);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));  // woken by Close, not the deadline
  closer.join();
  auto late = hub.Subscribe("");
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), StatusCode::kUnavailable);
}

TEST(EventHub, ManyPublishersManyWatchers) {
  constexpr int kPublishers = 4, kWatchers = 3, kEach = 2000;
  EventHub hub(kPublishers * kEach);
  std::vector<EventHub::Subscription> subs;
  for (int i = 0; i < kWatchers; ++i) {
    auto s = hub.Subscribe("");
    ASSERT_TRUE(s.ok());
    subs.push_back(std::move(*s));
  }
  std::vector<std::thread> threads;
  std::vector<std::map<uint32_t, int64_t>> last(kWatchers);  // per watcher: last step per publisher
  std::vector<int> seen(kWatchers, 0);
  std::vector<bool> in_order(kWatchers, true);
  for (int w = 0; w < kWatchers; ++w) {
    threads.emplace_back([&, w] {
      DaemonEvent e;
      while (seen[w] < kPublishers * kEach && NextWithin(subs[w], &e, 10000) == EventHub::Wait::kEvent) {
        auto [it, fresh] = last[w].try_emplace(e.rank, -1);
        if (e.step != it->second + 1) in_order[w] = false;
        it->second = e.step;
        ++seen[w];
      }
    });
  }
  for (int p = 0; p < kPublishers; ++p) {
    threads.emplace_back([&, p] {
      for (int i = 0; i < kEach; ++i) {
        DaemonEvent e = MakeEvent(DaemonEvent::Kind::kPersisted, "j", i);
        e.rank = static_cast<uint32_t>(p);
        hub.Publish(std::move(e));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < kWatchers; ++w) {
    EXPECT_EQ(seen[w], kPublishers * kEach) << "watcher " << w;
    EXPECT_TRUE(in_order[w]) << "watcher " << w << " saw a publisher's events out of order";
  }
  EXPECT_EQ(hub.dropped(), 0u);
}

// The value of the sample `line_prefix` ("name{labels}") in `text`, or -1.
double SampleValue(const std::string& text, const std::string& line_prefix) {
  size_t at = text.find("\n" + line_prefix + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + 1 + line_prefix.size() + 1));
}

TEST(Metrics, CountsEventsByJobAndReason) {
  Metrics m;
  DaemonEvent persisted = MakeEvent(DaemonEvent::Kind::kPersisted, "llama", 10);
  persisted.bytes = 1000;
  persisted.seconds = 0.3;
  m.Observe(persisted);
  m.Observe(persisted);
  DaemonEvent failed = MakeEvent(DaemonEvent::Kind::kPersistFailed, "llama", 12);
  failed.code = "RESOURCE_EXHAUSTED";
  m.Observe(failed);
  m.Observe(MakeEvent(DaemonEvent::Kind::kCheckpointDeleted, "llama", 2));
  m.Observe(MakeEvent(DaemonEvent::Kind::kPersistAbandoned, "llama", 14));
  DaemonEvent complete = MakeEvent(DaemonEvent::Kind::kCheckpointComplete, "llama", 10);
  complete.unix_seconds = 1.8e9;
  m.Observe(complete);
  m.ObserveSlotWait("llama", 2.0, false);
  DaemonStatus status;
  status.version = "0.1.0";
  JobStatus& job = status.jobs.emplace_back();
  job.job = "llama";
  job.last_complete_step = 10;
  job.ranks.emplace_back().oldest_write_seconds = 4.5;
  std::string text = "\n" + m.Render(status, 7);
  EXPECT_EQ(SampleValue(text, "flashckpt_persists_total{job=\"llama\"}"), 2);
  EXPECT_EQ(SampleValue(text, "flashckpt_persisted_bytes_total{job=\"llama\"}"), 2000);
  EXPECT_EQ(SampleValue(text, "flashckpt_persist_failures_total{job=\"llama\",reason=\"RESOURCE_EXHAUSTED\"}"), 1);
  EXPECT_EQ(SampleValue(text, "flashckpt_checkpoints_deleted_total{job=\"llama\",reason=\"unknown\"}"), 1);
  EXPECT_EQ(SampleValue(text, "flashckpt_slot_wait_timeouts_total{job=\"llama\"}"), 1);
  EXPECT_EQ(SampleValue(text, "flashckpt_persists_abandoned_total{job=\"llama\"}"), 1);
  EXPECT_EQ(SampleValue(text, "flashckpt_snapshots_total{job=\"llama\"}"), 0);  // present from the start
  EXPECT_EQ(SampleValue(text, "flashckpt_last_durable_step{job=\"llama\"}"), 10);
  EXPECT_EQ(SampleValue(text, "flashckpt_oldest_write_seconds"), 4.5);
  EXPECT_EQ(SampleValue(text, "flashckpt_last_complete_timestamp_seconds{job=\"llama\"}"), 1.8e9);
  EXPECT_EQ(SampleValue(text, "flashckpt_watch_events_lost_total"), 7);
  // 0.3 s falls in the 0.5 bucket and every one above it, not in 0.25.
  EXPECT_EQ(SampleValue(text, "flashckpt_persist_duration_seconds_bucket{le=\"0.25\"}"), 0);
  EXPECT_EQ(SampleValue(text, "flashckpt_persist_duration_seconds_bucket{le=\"0.5\"}"), 2);
  EXPECT_EQ(SampleValue(text, "flashckpt_persist_duration_seconds_bucket{le=\"+Inf\"}"), 2);
  EXPECT_EQ(SampleValue(text, "flashckpt_persist_duration_seconds_count"), 2);
  EXPECT_NEAR(SampleValue(text, "flashckpt_persist_duration_seconds_sum"), 0.6, 1e-12);
}

TEST(Metrics, BoundsTheJobsItKeeps) {
  Metrics m;
  for (size_t i = 0; i < Metrics::kMaxJobs + 10; ++i) {
    m.Observe(MakeEvent(DaemonEvent::Kind::kSnapshotCommitted, "job" + std::to_string(i), 1));
  }
  std::string text = "\n" + m.Render(DaemonStatus{}, 0);
  EXPECT_EQ(SampleValue(text, "flashckpt_snapshots_total{job=\"job0\"}"), 1);
  EXPECT_EQ(SampleValue(text, "flashckpt_snapshots_total{job=\"_other\"}"), 10);
  EXPECT_EQ(SampleValue(text, "flashckpt_snapshots_total{job=\"job" + std::to_string(Metrics::kMaxJobs + 5) + "\"}"),
            -1);
}

TEST(Metrics, EscapesLabelValues) {
  Metrics m;
  m.Observe(MakeEvent(DaemonEvent::Kind::kSnapshotCommitted, "a\"b\\c\nd", 1));
  std::string text = "\n" + m.Render(DaemonStatus{}, 0);
  EXPECT_EQ(SampleValue(text, "flashckpt_snapshots_total{job=\"a\\\"b\\\\c\\nd\"}"), 1);
}

}  // namespace
}  // namespace flashckpt

// The daemon's Prometheus metrics: counters and histograms fed by its events (daemon/observe/events.h) and
// slot waits, and gauges read from a status snapshot at scrape time. Rendered in the Prometheus
// text exposition format (version 0.0.4) by Render; served over HTTP by daemon/observe/metrics_http.h.
//
// Per-job series are kept for at most kMaxJobs jobs; the events of further jobs count under the
// job label "_other", so a daemon that sees many short jobs keeps bounded memory.
//
// Thread safety: every method may be called from any thread; one mutex, a leaf lock, guards all.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/base/mutex.h"
#include "flashckpt/daemon_types.h"

namespace flashckpt {

// One metric's "# HELP" and "# TYPE" lines, and one sample line (`labels`: "" or `a="b"`), in the
// text exposition format: for the daemon's own metrics and for the listeners that add theirs.
void MetricHeader(std::string* out, const char* name, const char* type, const char* help);
void MetricSample(std::string* out, const std::string& name, const std::string& labels, double value);

// A cumulative histogram with fixed upper bounds (seconds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);
  // `name`_bucket{labels,le=...}, `name`_sum and `name`_count lines; `labels` is "" or `a="b"`.
  void Render(const std::string& name, const std::string& labels, std::string* out) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bound, not cumulative; one more for +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  static constexpr size_t kMaxJobs = 256;

  Metrics();

  // Counts the event in the series its kind feeds (kEventsLost is the watchers' and counts nowhere).
  void Observe(const DaemonEvent& event) EXCLUDES(mu_);
  // A BeginSnapshot that had to wait for a free slot, and how long it waited (also when it then
  // timed out: `got_slot` false).
  void ObserveSlotWait(const std::string& job, double seconds, bool got_slot) EXCLUDES(mu_);
  // The whole exposition: these counters and histograms, gauges from `status` (host memory,
  // oldest write in flight, last committed and durable step per job, CUDA presence, uptime), and
  // the events watchers lost (EventHub::dropped).
  std::string Render(const DaemonStatus& status, uint64_t watchers_lost) const EXCLUDES(mu_);

 private:
  struct JobSeries {
    uint64_t snapshots = 0, skipped = 0, slot_waits = 0, slot_wait_timeouts = 0;
    uint64_t ema_updates = 0, persists = 0, persisted_bytes = 0, completed = 0, abandoned = 0;
    uint64_t released = 0;  // times the job's shared memory was given back
    uint64_t release_written = 0;  // releases that first wrote a memory checkpoint newer than disk
    uint64_t release_dropped = 0;  // releases (--force) that dropped memory checkpoints newer than disk
    uint64_t split_attempts = 0;  // steps saved by its ranks in different attempts (never complete)
    uint64_t memory_fallbacks = 0;  // memory checkpoints that failed their checksums at a restore
    std::map<std::string, uint64_t> failures;  // by the error's code name
    std::map<std::string, uint64_t> deleted;   // by reason: retention, operator
    double last_complete_unix = 0;             // when this daemon last completed a checkpoint of the job
  };
  JobSeries& SeriesLocked(const std::string& job) REQUIRES(mu_);
  // The per-job counters of Render: one family per JobSeries counter, then failures and deletions by reason.
  void RenderJobCountersLocked(std::string* out) const REQUIRES(mu_);

  mutable Mutex mu_;
  std::map<std::string, JobSeries> jobs_ GUARDED_BY(mu_);
  Histogram persist_seconds_ GUARDED_BY(mu_);
  Histogram ema_seconds_ GUARDED_BY(mu_);
  Histogram slot_wait_seconds_ GUARDED_BY(mu_);
};

}  // namespace flashckpt

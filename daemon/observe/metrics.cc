#include "daemon/observe/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace flashckpt {
namespace {

// Label values are job names (common/base/names.h allows no quotes or backslashes), but escape anyway
// as the exposition format asks: a metric line must never be broken by what a client sent.
std::string Escape(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string JobLabel(const std::string& job) { return "job=\"" + Escape(job) + "\""; }

// The daemon itself: its build, CUDA, uptime and host memory.
void RenderDaemonGauges(const DaemonStatus& status, std::string* out) {
  MetricHeader(out, "flashckpt_build_info", "gauge", "Version of the running flashckptd (value is always 1).");
  MetricSample(out, "flashckpt_build_info", "version=\"" + Escape(status.version) + "\"", 1);
  MetricHeader(out, "flashckpt_cuda_compiled", "gauge", "1 when the daemon was built with CUDA.");
  MetricSample(out, "flashckpt_cuda_compiled", "", status.cuda_compiled ? 1 : 0);
  MetricHeader(out, "flashckpt_cuda_devices", "gauge", "CUDA devices the daemon's process sees (0: none or no CUDA).");
  MetricSample(out, "flashckpt_cuda_devices", "", std::max(0, status.cuda_devices));
  MetricHeader(out, "flashckpt_uptime_seconds", "gauge", "Seconds since the daemon started.");
  MetricSample(out, "flashckpt_uptime_seconds", "", status.uptime_seconds);
  MetricHeader(out, "flashckpt_host_memory_used_bytes", "gauge", "Host memory held by registered ranks' segments and by replicas held for peers (--replica-listen).");
  MetricSample(out, "flashckpt_host_memory_used_bytes", "", static_cast<double>(status.host_memory_used));
  MetricHeader(out, "flashckpt_host_memory_budget_bytes", "gauge", "The daemon's shared-memory budget (--max-host-memory).");
  MetricSample(out, "flashckpt_host_memory_budget_bytes", "", static_cast<double>(status.host_memory_budget));
}

// The --replicate-to peers: one series per peer of each.
void RenderReplicaPeerMetrics(const std::vector<ReplicaPeerStatus>& peers, std::string* out) {
  struct PeerMetric {
    const char* name;
    const char* type;
    const char* help;
    double (*value)(const ReplicaPeerStatus&);
  };
  static const PeerMetric kPeerMetrics[] = {
      {"flashckpt_replica_lag_steps", "gauge",
       "Newest memory checkpoint step of this node's ranks minus the newest the peer acknowledged (most over the ranks).",
       [](const ReplicaPeerStatus& p) { return static_cast<double>(p.lag_steps); }},
      {"flashckpt_replicas_sent_total", "counter", "Replicas the peer acknowledged.",
       [](const ReplicaPeerStatus& p) { return static_cast<double>(p.pushed); }},
      {"flashckpt_replica_sent_bytes_total", "counter", "Bytes of the replicas the peer acknowledged.",
       [](const ReplicaPeerStatus& p) { return static_cast<double>(p.bytes); }},
      {"flashckpt_replica_sends_failed_total", "counter", "Pushes to the peer that failed or were cancelled.",
       [](const ReplicaPeerStatus& p) { return static_cast<double>(p.failed); }},
      {"flashckpt_replica_send_queue", "gauge", "Memory checkpoints waiting for the peer (at most one per rank).",
       [](const ReplicaPeerStatus& p) { return static_cast<double>(p.queued); }},
      {"flashckpt_replica_send_bytes_per_second", "gauge", "Rate of the last push the peer acknowledged.",
       [](const ReplicaPeerStatus& p) { return p.last_gbps * 1e9; }},
  };
  if (!peers.empty()) {
    for (const PeerMetric& m : kPeerMetrics) {
      MetricHeader(out, m.name, m.type, m.help);
      for (const ReplicaPeerStatus& peer : peers) {
        MetricSample(out, m.name, "peer=\"" + Escape(peer.target) + "\"", m.value(peer));
      }
    }
  }
}

// Gauges from the status snapshot.
void RenderJobGauges(const DaemonStatus& status, std::string* out) {
  double oldest = 0;
  for (const auto& job : status.jobs) {
    for (const auto& rank : job.ranks) oldest = std::max(oldest, rank.oldest_write_seconds);
  }
  MetricHeader(out, "flashckpt_oldest_write_seconds", "gauge",
         "Age of the oldest persist being written (0: none); one that keeps growing means a slow or stuck disk.");
  MetricSample(out, "flashckpt_oldest_write_seconds", "", oldest);
  MetricHeader(out, "flashckpt_oldest_filling_seconds", "gauge",
         "Per job, how long its oldest slot has been filling since BeginSnapshot (0: none); one that keeps growing "
         "is a trainer stopped between BeginSnapshot and Commit.");
  for (const auto& job : status.jobs) {
    double filling = 0;
    for (const auto& rank : job.ranks) {
      for (const auto& slot : rank.slots) filling = std::max(filling, slot.filling_seconds);
    }
    MetricSample(out, "flashckpt_oldest_filling_seconds", JobLabel(job.job), filling);
  }
  MetricHeader(out, "flashckpt_registered_ranks", "gauge", "Ranks registered with this daemon, per job.");
  for (const auto& job : status.jobs) {
    MetricSample(out, "flashckpt_registered_ranks", JobLabel(job.job), static_cast<double>(job.ranks.size()));
  }
  MetricHeader(out, "flashckpt_last_committed_step", "gauge", "Newest step any rank of the job committed here (-1: none).");
  for (const auto& job : status.jobs) {
    int64_t last = -1;
    for (const auto& rank : job.ranks) last = std::max(last, rank.last_committed_step);
    MetricSample(out, "flashckpt_last_committed_step", JobLabel(job.job), static_cast<double>(last));
  }
  MetricHeader(out, "flashckpt_memory_checkpoint_step", "gauge",
         "The oldest of the newest memory checkpoints the job's ranks keep here (-1: a rank keeps none).");
  for (const auto& job : status.jobs) {
    int64_t common = job.ranks.empty() ? -1 : std::numeric_limits<int64_t>::max();
    for (const auto& rank : job.ranks) common = std::min(common, rank.memory_step);
    MetricSample(out, "flashckpt_memory_checkpoint_step", JobLabel(job.job), static_cast<double>(std::max<int64_t>(common, -1)));
  }
  MetricHeader(out, "flashckpt_memory_checkpoint_bytes", "gauge", "Bytes of the slots keeping the job's memory checkpoints.");
  for (const auto& job : status.jobs) {
    uint64_t bytes = 0;
    for (const auto& rank : job.ranks) bytes += rank.memory_bytes;
    MetricSample(out, "flashckpt_memory_checkpoint_bytes", JobLabel(job.job), static_cast<double>(bytes));
  }
  MetricHeader(out, "flashckpt_last_durable_step", "gauge", "Newest complete checkpoint of the job on disk (-1: none).");
  for (const auto& job : status.jobs) {
    MetricSample(out, "flashckpt_last_durable_step", JobLabel(job.job), static_cast<double>(job.last_complete_step));
  }
}

}  // namespace

void MetricHeader(std::string* out, const char* name, const char* type, const char* help) {
  *out += "# HELP ";
  *out += name;
  *out += ' ';
  *out += help;
  *out += "\n# TYPE ";
  *out += name;
  *out += ' ';
  *out += type;
  *out += '\n';
}

void MetricSample(std::string* out, const std::string& name, const std::string& labels, double value) {
  *out += name;
  if (!labels.empty()) *out += "{" + labels + "}";
  *out += ' ' + Number(value) + '\n';
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  if (!std::isfinite(value) || value < 0) value = 0;
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  counts_[i] += 1;
  sum_ += value;
  count_ += 1;
}

void Histogram::Render(const std::string& name, const std::string& labels, std::string* out) const {
  const std::string prefix = labels.empty() ? "" : labels + ",";
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    std::string le = i < bounds_.size() ? Number(bounds_[i]) : "+Inf";
    MetricSample(out, name + "_bucket", prefix + "le=\"" + le + "\"", static_cast<double>(cumulative));
  }
  MetricSample(out, name + "_sum", labels, sum_);
  MetricSample(out, name + "_count", labels, static_cast<double>(count_));
}

Metrics::Metrics()
    : persist_seconds_({0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500}),
      ema_seconds_({0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}),
      slot_wait_seconds_({0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300}) {}

Metrics::JobSeries& Metrics::SeriesLocked(const std::string& job) {
  auto it = jobs_.find(job);
  if (it != jobs_.end()) return it->second;
  if (jobs_.size() >= kMaxJobs) return jobs_["_other"];
  return jobs_[job];
}

void Metrics::Observe(const DaemonEvent& event) {
  MutexLock lock(&mu_);
  if (event.kind == DaemonEvent::Kind::kEventsLost) return;
  JobSeries& s = SeriesLocked(event.job);
  switch (event.kind) {
    case DaemonEvent::Kind::kSnapshotCommitted: s.snapshots += 1; break;
    case DaemonEvent::Kind::kSnapshotSkipped: s.skipped += 1; break;
    case DaemonEvent::Kind::kEmaUpdated:
      s.ema_updates += 1;
      ema_seconds_.Observe(event.seconds);
      break;
    case DaemonEvent::Kind::kPersisted:
      s.persists += 1;
      s.persisted_bytes += event.bytes;
      persist_seconds_.Observe(event.seconds);
      break;
    case DaemonEvent::Kind::kPersistFailed: s.failures[event.code.empty() ? "UNKNOWN" : event.code] += 1; break;
    case DaemonEvent::Kind::kPersistAbandoned: s.abandoned += 1; break;
    case DaemonEvent::Kind::kJobReleased:
      s.released += 1;
      if (event.code == "written") s.release_written += 1;
      if (event.code == "dropped") s.release_dropped += 1;
      break;
    case DaemonEvent::Kind::kSplitAttempt: s.split_attempts += 1; break;
    case DaemonEvent::Kind::kMemoryFallback: s.memory_fallbacks += 1; break;
    case DaemonEvent::Kind::kCheckpointComplete:
      s.completed += 1;
      s.last_complete_unix = std::max(s.last_complete_unix, event.unix_seconds);
      break;
    case DaemonEvent::Kind::kCheckpointDeleted: s.deleted[event.reason.empty() ? "unknown" : event.reason] += 1; break;
    default: break;
  }
}

void Metrics::ObserveSlotWait(const std::string& job, double seconds, bool got_slot) {
  MutexLock lock(&mu_);
  JobSeries& s = SeriesLocked(job);
  s.slot_waits += 1;
  if (!got_slot) s.slot_wait_timeouts += 1;
  slot_wait_seconds_.Observe(seconds);
}

// Per-job counters; a counter is rendered for every job seen, zero or not, so rate() works from
// the first scrape on.
void Metrics::RenderJobCountersLocked(std::string* out) const {
  struct CounterDef {
    const char* name;
    const char* help;
    uint64_t JobSeries::*field;
  };
  static constexpr CounterDef kCounters[] = {
      {"flashckpt_snapshots_total", "Snapshots committed by trainer ranks.", &JobSeries::snapshots},
      {"flashckpt_snapshots_skipped_total", "Snapshots skipped for want of a free slot (backpressure skip).",
       &JobSeries::skipped},
      {"flashckpt_slot_waits_total", "BeginSnapshot calls that had to wait for a free slot.", &JobSeries::slot_waits},
      {"flashckpt_slot_wait_timeouts_total", "Slot waits that ended at their deadline without a slot.",
       &JobSeries::slot_wait_timeouts},
      {"flashckpt_ema_updates_total", "EMA updates applied (a snapshot the loss gate rejects is not counted).",
       &JobSeries::ema_updates},
      {"flashckpt_persists_total", "Rank snapshots written durably.", &JobSeries::persists},
      {"flashckpt_persisted_bytes_total", "Bytes written durably by persists.", &JobSeries::persisted_bytes},
      {"flashckpt_persists_abandoned_total", "Committed snapshots left unwritten at a stop, for the next daemon.",
       &JobSeries::abandoned},
      {"flashckpt_checkpoints_completed_total", "Checkpoints made complete (metadata.json written) by this daemon.",
       &JobSeries::completed},
      {"flashckpt_jobs_released_total",
       "Times the job's shared memory was given back (idle for --idle-release, or flashckpt release).",
       &JobSeries::released},
      {"flashckpt_release_memory_written_total",
       "Releases (idle or flashckpt release) that first wrote the job's memory checkpoint newer than its newest "
       "complete checkpoint on disk.",
       &JobSeries::release_written},
      {"flashckpt_release_memory_dropped_total",
       "Releases (flashckpt release --force) that dropped memory checkpoints newer than the job's newest complete "
       "checkpoint on disk.",
       &JobSeries::release_dropped},
      {"flashckpt_split_steps_total",
       "Steps the job's ranks saved in different attempts (a rank restored while the others went on, or ranks "
       "launched apart with different runs): they never complete.",
       &JobSeries::split_attempts},
      {"flashckpt_memory_fallbacks_total",
       "Memory checkpoints that failed their checksums at a restore (the daemon's check, or the client's as it "
       "copied): dropped, never restored, the files read instead.",
       &JobSeries::memory_fallbacks},
  };
  for (const auto& def : kCounters) {
    MetricHeader(out, def.name, "counter", def.help);
    for (const auto& [job, s] : jobs_) MetricSample(out, def.name, JobLabel(job), static_cast<double>(s.*def.field));
  }
  MetricHeader(out, "flashckpt_persist_failures_total", "counter", "Failed persists, by the error's code.");
  for (const auto& [job, s] : jobs_) {
    for (const auto& [reason, n] : s.failures) {
      MetricSample(out, "flashckpt_persist_failures_total", JobLabel(job) + ",reason=\"" + Escape(reason) + "\"",
             static_cast<double>(n));
    }
  }
  MetricHeader(out, "flashckpt_checkpoints_deleted_total", "counter", "Checkpoint directories deleted, by reason.");
  for (const auto& [job, s] : jobs_) {
    for (const auto& [reason, n] : s.deleted) {
      MetricSample(out, "flashckpt_checkpoints_deleted_total", JobLabel(job) + ",reason=\"" + Escape(reason) + "\"",
             static_cast<double>(n));
    }
  }
}

std::string Metrics::Render(const DaemonStatus& status, uint64_t watchers_lost) const {
  MutexLock lock(&mu_);
  std::string out;
  out.reserve(8192);

  RenderDaemonGauges(status, &out);
  RenderJobCountersLocked(&out);
  RenderReplicaPeerMetrics(status.replica_peers, &out);

  MetricHeader(&out, "flashckpt_persist_duration_seconds", "histogram", "Time to write one rank's snapshot durably.");
  persist_seconds_.Render("flashckpt_persist_duration_seconds", "", &out);
  MetricHeader(&out, "flashckpt_ema_update_duration_seconds", "histogram", "Time of one rank's EMA update.");
  ema_seconds_.Render("flashckpt_ema_update_duration_seconds", "", &out);
  MetricHeader(&out, "flashckpt_slot_wait_seconds", "histogram", "Time BeginSnapshot waited for a free slot.");
  slot_wait_seconds_.Render("flashckpt_slot_wait_seconds", "", &out);

  RenderJobGauges(status, &out);
  MetricHeader(&out, "flashckpt_last_complete_timestamp_seconds", "gauge",
         "Unix time this daemon last completed a checkpoint of the job (0: not since it started).");
  for (const auto& [job, s] : jobs_)
    MetricSample(&out, "flashckpt_last_complete_timestamp_seconds", JobLabel(job), s.last_complete_unix);
  MetricHeader(&out, "flashckpt_watch_events_lost_total", "counter", "Events dropped for watchers that fell behind.");
  MetricSample(&out, "flashckpt_watch_events_lost_total", "", static_cast<double>(watchers_lost));
  return out;
}

}  // namespace flashckpt

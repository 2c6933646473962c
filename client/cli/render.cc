#include "client/cli/render.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "common/base/dtype.h"
#include "common/base/names.h"

namespace flashckpt::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

// Columns padded to their widest cell; numeric columns align right so digits line up.
class TextTable {
 public:
  TextTable(std::vector<std::string> header, std::vector<bool> right_aligned) : right_(std::move(right_aligned)) {
    rows_.push_back(std::move(header));
  }
  void AddRow(std::vector<std::string> row) { rows_.push_back(std::move(row)); }

  std::string Render(const std::string& indent) const {
    std::vector<size_t> width(rows_.front().size(), 0);
    for (const auto& row : rows_) {
      for (size_t c = 0; c < row.size() && c < width.size(); ++c) width[c] = std::max(width[c], row[c].size());
    }
    std::string out;
    for (const auto& row : rows_) {
      std::string line = indent;
      for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
        if (c > 0) line += "  ";
        std::string pad(width[c] - row[c].size(), ' ');
        bool last = c + 1 == row.size();
        if (c < right_.size() && right_[c])
          line += pad + row[c];
        else
          line += last ? row[c] : row[c] + pad;  // no trailing blanks
      }
      out += line + "\n";
    }
    return out;
  }

 private:
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

std::string StepText(int64_t step) { return step < 0 ? "-" : std::to_string(step); }

// "[4096, 1024]"
std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// A tensor of a checkpoint: every saved piece of one (name, kind).
struct InspectTensor {
  std::string name;
  TensorKind kind = TensorKind::kModel;
  DType dtype = DType::kF32;
  std::vector<uint64_t> global_shape;
  std::vector<const Piece*> pieces;
  uint64_t bytes = 0;  // of all its pieces
  bool mixed = false;  // pieces disagree on dtype or global shape (a corrupt checkpoint)
};

// By kind (model, optimizer, master_weight, ema), then name.
std::vector<InspectTensor> GroupTensors(const CheckpointMetadata& meta) {
  std::map<std::pair<int, std::string>, InspectTensor> by_key;
  for (const Piece& p : meta.pieces) {
    InspectTensor& t = by_key[{static_cast<int>(p.kind), p.key}];
    if (t.pieces.empty()) {
      t.name = p.key;
      t.kind = p.kind;
      t.dtype = p.dtype;
      t.global_shape = p.global_shape;
    } else if (t.dtype != p.dtype || t.global_shape != p.global_shape) {
      t.mixed = true;
    }
    t.pieces.push_back(&p);
    t.bytes += p.end - p.begin;
  }
  std::vector<InspectTensor> out;
  out.reserve(by_key.size());
  for (auto& [key, t] : by_key) out.push_back(std::move(t));
  return out;
}

uint64_t FileBytes(const CheckpointMetadata& meta) {
  uint64_t total = 0;
  for (const auto& f : meta.files) total += f.bytes;
  return total;
}

ordered_json StepJson(int64_t step) { return step < 0 ? ordered_json(nullptr) : ordered_json(step); }

// Decay as typed: 0.999, 0.9999, 0.99995 (enough digits to tell configurations apart).
std::string DecayText(double decay) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.10g", decay);
  return buf;
}

// The job's EMA in one line: "off", or "on for 2 of 4 rank(s) here, decay 0.999" (ranks whose
// weights are all replicas persisted by another rank hold no EMA and count as off).
std::string EmaSummaryText(const JobStatus& job) {
  int on = 0;
  std::vector<std::string> decays;  // distinct, in rank order; one unless ranks disagree
  for (const auto& rank : job.ranks) {
    if (!rank.ema_enabled) continue;
    ++on;
    std::string d = DecayText(rank.ema_decay);
    if (std::find(decays.begin(), decays.end(), d) == decays.end()) decays.push_back(d);
  }
  if (on == 0) return "off";
  std::string out =
      "on for " + std::to_string(on) + " of " + std::to_string(job.ranks.size()) + " rank(s) here, decay ";
  for (size_t i = 0; i < decays.size(); ++i) out += (i ? "/" : "") + decays[i];
  return out;
}

std::string SlotsText(const RankStatus& rank) {
  std::string out;
  for (const auto& s : rank.slots) {
    if (!out.empty()) out += " ";
    out += std::to_string(s.index) + ":" + s.state;
    if (s.state != "free" && s.step >= 0) out += "@" + std::to_string(s.step);
    // A slot filling for long: its trainer stopped between BeginSnapshot and Commit (SIGSTOP, a
    // debugger) or its copies are slow.
    if (s.state == "filling" && s.filling_seconds >= 1) out += "(" + FormatDuration(s.filling_seconds) + ")";
  }
  return out.empty() ? "-" : out;
}

// How long the rank's oldest persist being written has run: "-" when none, "0.4s" under a minute,
// then as FormatDuration.
std::string OldestWriteText(double seconds) {
  if (!(seconds > 0)) return "-";
  if (seconds >= 60) return FormatDuration(seconds);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1fs", seconds);
  return buf;
}

// "2026-11-23T01:02:03.456Z"
std::string UtcText(double unix_seconds) {
  if (!std::isfinite(unix_seconds) || unix_seconds < 0) unix_seconds = 0;
  auto whole = static_cast<std::time_t>(unix_seconds);
  int millis = static_cast<int>((unix_seconds - static_cast<double>(whole)) * 1000);
  std::tm tm{};
  gmtime_r(&whole, &tm);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, std::min(millis, 999));
  return buf;
}

const char* EventKindText(DaemonEvent::Kind kind) {
  switch (kind) {
    case DaemonEvent::Kind::kSnapshotCommitted: return "committed";
    case DaemonEvent::Kind::kSnapshotSkipped: return "skipped";
    case DaemonEvent::Kind::kEmaUpdated: return "ema-updated";
    case DaemonEvent::Kind::kPersisted: return "persisted";
    case DaemonEvent::Kind::kPersistFailed: return "failed";
    case DaemonEvent::Kind::kCheckpointComplete: return "complete";
    case DaemonEvent::Kind::kCheckpointDeleted: return "deleted";
    case DaemonEvent::Kind::kEventsLost: return "lost";
    case DaemonEvent::Kind::kPersistAbandoned: return "abandoned";
    case DaemonEvent::Kind::kJobReleased: return "released";
    case DaemonEvent::Kind::kSplitAttempt: return "split-attempt";
    case DaemonEvent::Kind::kMemoryFallback: return "memory-fallback";
    case DaemonEvent::Kind::kReplicaSent: return "replica-sent";
    case DaemonEvent::Kind::kReplicaFailed: return "replica-failed";
    default: return "unknown";
  }
}

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// "12.4GiB": FormatBytes without its space, so that key=value fields split on blanks.
std::string CompactBytes(uint64_t bytes) {
  std::string out = FormatBytes(bytes);
  out.erase(std::remove(out.begin(), out.end(), ' '), out.end());
  return out;
}

double Gbps(uint64_t bytes, double seconds) { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }

// The rate of the job's most recent persists: the mean of its ranks' last rates ("-" before any).
std::string JobGbpsText(const JobStatus& job) {
  double sum = 0;
  int n = 0;
  for (const auto& r : job.ranks) {
    if (r.last_persist_gbps > 0) {
      sum += r.last_persist_gbps;
      ++n;
    }
  }
  return n == 0 ? "-" : Fixed(sum / n, 2);
}

int64_t JobLastCommitted(const JobStatus& job) {
  int64_t last = -1;
  for (const auto& r : job.ranks) last = std::max(last, r.last_committed_step);
  return last;
}

// The attempts the job's ranks are in, one per distinct attempt ("3f2a9c01d4e5b687 (fresh): ranks 0,1"),
// "-" before any registration.
std::string RunsText(const JobStatus& job) {
  std::map<std::pair<std::string, int64_t>, std::vector<uint32_t>> by;
  for (const auto& r : job.ranks) {
    if (!r.run_id.empty()) by[{r.run_id, r.resumed_from}].push_back(r.rank);
  }
  if (by.empty()) return "-";
  std::string out;
  for (const auto& [attempt, ranks] : by) {
    if (!out.empty()) out += "; ";
    out += attempt.first + (attempt.second > 0 ? " resumed from step " + std::to_string(attempt.second) : " (fresh)");
    out += ": rank";
    out += ranks.size() > 1 ? "s" : "";
    for (size_t i = 0; i < ranks.size(); ++i) out += (i == 0 ? " " : ",") + std::to_string(ranks[i]);
  }
  return out;
}

// Whether the daemon has CUDA: what its own cudaGetDeviceCount saw (the trainers' devices are theirs).
std::string CudaText(const DaemonStatus& status) {
  if (!status.cuda_compiled) return "not compiled in";
  if (status.cuda_devices <= 0) return "compiled in, no device";
  return "compiled in, " + std::to_string(status.cuda_devices) +
         (status.cuda_devices == 1 ? " device" : " devices");
}

}  // namespace

std::string EventText(const DaemonEvent& e) {
  char kind[16];
  std::snprintf(kind, sizeof kind, "%-11s", EventKindText(e.kind));
  std::string out = UtcText(e.unix_seconds) + " " + kind;
  if (e.kind == DaemonEvent::Kind::kEventsLost) {
    return out + " " + std::to_string(e.lost) + " event(s) dropped: this watcher fell behind";
  }
  if (e.kind == DaemonEvent::Kind::kJobReleased) {
    // The memory checkpoint newer than disk it wrote first, or the newest one it dropped (--force).
    std::string memory;
    if (e.code == "written") memory = " written_step=" + std::to_string(e.step);
    if (e.code == "dropped") memory = " dropped_step=" + std::to_string(e.step);
    return out + " job=" + e.job + " bytes=" + CompactBytes(e.bytes) + " reason=" + e.reason + memory;
  }
  out += " job=" + e.job + " step=" + std::to_string(e.step);
  switch (e.kind) {
    case DaemonEvent::Kind::kCheckpointComplete: break;
    case DaemonEvent::Kind::kCheckpointDeleted: out += " reason=" + e.reason; break;
    case DaemonEvent::Kind::kSplitAttempt: out += " reason=\"" + e.reason + "\""; break;
    case DaemonEvent::Kind::kMemoryFallback:
      out += " rank=" + std::to_string(e.rank) + " reason=\"" + e.reason + "\"";
      break;
    case DaemonEvent::Kind::kReplicaSent:
      out += " rank=" + std::to_string(e.rank) + " peer=" + e.peer + " bytes=" + CompactBytes(e.bytes) +
             " secs=" + Fixed(e.seconds, 3) + " gbps=" + Fixed(Gbps(e.bytes, e.seconds), 2);
      break;
    case DaemonEvent::Kind::kReplicaFailed:
      out += " rank=" + std::to_string(e.rank) + " peer=" + e.peer + " error=\"" + e.reason + "\"";
      break;
    case DaemonEvent::Kind::kSnapshotCommitted:
      out += " rank=" + std::to_string(e.rank) + " bytes=" + CompactBytes(e.bytes) + " for=" + e.reason;
      break;
    case DaemonEvent::Kind::kEmaUpdated: out += " rank=" + std::to_string(e.rank) + " secs=" + Fixed(e.seconds, 3); break;
    case DaemonEvent::Kind::kPersisted:
      out += " rank=" + std::to_string(e.rank) + " bytes=" + CompactBytes(e.bytes) +
             " secs=" + Fixed(e.seconds, 2) + " gbps=" + Fixed(Gbps(e.bytes, e.seconds), 2);
      break;
    case DaemonEvent::Kind::kPersistFailed:
      out += " rank=" + std::to_string(e.rank) + " code=" + e.code + " error=\"" + e.reason + "\"";
      break;
    case DaemonEvent::Kind::kSnapshotSkipped:
    case DaemonEvent::Kind::kPersistAbandoned:
      out += " rank=" + std::to_string(e.rank) + " reason=\"" + e.reason + "\"";
      break;
    default: break;
  }
  return out;
}

ordered_json EventJson(const DaemonEvent& e) {
  ordered_json j;
  j["time"] = UtcText(e.unix_seconds);
  j["unix_seconds"] = e.unix_seconds;
  j["event"] = EventKindText(e.kind);
  if (e.kind == DaemonEvent::Kind::kEventsLost) {
    j["lost"] = e.lost;
    return j;
  }
  j["job"] = e.job;
  j["step"] = e.step;
  j["rank"] = e.rank;
  j["bytes"] = e.bytes;
  j["seconds"] = e.seconds;
  if (e.kind == DaemonEvent::Kind::kPersisted || e.kind == DaemonEvent::Kind::kReplicaSent) {
    j["gbps"] = Gbps(e.bytes, e.seconds);
  }
  if (!e.peer.empty()) j["peer"] = e.peer;
  if (!e.code.empty()) j["code"] = e.code;
  if (!e.reason.empty()) j["reason"] = e.reason;
  return j;
}

std::string FormatDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) seconds = 0;
  auto total = static_cast<unsigned long long>(seconds);
  unsigned long long d = total / 86400, h = total / 3600 % 24, m = total / 60 % 60, s = total % 60;
  char buf[64];
  if (d > 0)
    std::snprintf(buf, sizeof buf, "%llud %02lluh %02llum", d, h, m);
  else if (h > 0)
    std::snprintf(buf, sizeof buf, "%lluh %02llum %02llus", h, m, s);
  else if (m > 0)
    std::snprintf(buf, sizeof buf, "%llum %02llus", m, s);
  else
    std::snprintf(buf, sizeof buf, "%llus", s);
  return buf;
}

std::string StatusText(const DaemonStatus& status) {
  std::string out;
  out += "daemon  flashckptd " + status.version + ", up " + FormatDuration(status.uptime_seconds) + "\n";
  out += "memory  " + FormatBytes(status.host_memory_used) + " used of " + FormatBytes(status.host_memory_budget) +
         " budget";
  if (status.host_memory_budget > 0) {
    char pct[32];
    std::snprintf(
        pct, sizeof pct, " (%.1f%%)",
        100.0 * static_cast<double>(status.host_memory_used) / static_cast<double>(status.host_memory_budget));
    out += pct;
  }
  out += "\n";
  out += "root    " + status.root + "\n";
  if (!status.node_name.empty()) out += "node    " + status.node_name + "\n";
  out += "cuda    " + CudaText(status) + "\n";
  if (status.replica_listening) {
    out += "held    " + std::to_string(status.replicas_held) + " replica(s) of other nodes' ranks (" +
           FormatBytes(status.replica_held_bytes) + ")\n";
  }
  for (const ReplicaPeerStatus& peer : status.replica_peers) {
    // One line per --replicate-to peer: how far behind its copies are, and whether pushes fail.
    char gbps[32];
    std::snprintf(gbps, sizeof gbps, "%.2f GB/s", peer.last_gbps);
    out += "replica " + peer.target + "  lag " + std::to_string(peer.lag_steps) + " step(s), " +
           std::to_string(peer.pushed) + " sent (" + FormatBytes(peer.bytes) + ", last at " + gbps + "), " +
           std::to_string(peer.failed) + " failed, " + std::to_string(peer.queued) + " queued";
    if (!peer.last_error.empty()) out += ", last error: " + peer.last_error;
    out += "\n";
  }
  if (status.jobs.empty()) {
    out += "jobs    none registered\n";
    return out;
  }
  // At a glance: is each job being checkpointed, and how far behind is the disk?
  TextTable jobs({"JOB", "RANKS", "COMMITTED", "DURABLE", "LAG", "PERSIST GB/s", "EMA", "FAILURES"},
                 {false, true, true, true, true, true, false, true});
  for (const auto& job : status.jobs) {
    int64_t committed = JobLastCommitted(job);
    int64_t durable = job.last_complete_step;
    std::string lag = committed < 0 ? "-" : std::to_string(committed - std::max<int64_t>(durable, 0));
    uint64_t failures = 0;
    bool ema = false;
    for (const auto& r : job.ranks) {
      failures += r.failures;
      ema = ema || r.ema_enabled;
    }
    jobs.AddRow({job.job, std::to_string(job.ranks.size()) + "/" + std::to_string(job.world_size),
                 StepText(committed), StepText(durable), lag, JobGbpsText(job), ema ? "on" : "off",
                 std::to_string(failures)});
  }
  out += "\n" + jobs.Render("");
  for (const auto& job : status.jobs) {
    out += "\njob " + job.job + "  world size " + std::to_string(job.world_size) + ", " +
           std::to_string(job.ranks.size()) + " rank(s) here, last complete step " +
           StepText(job.last_complete_step) + "\n";
    if (!job.catalog_error.empty()) out += "  checkpoints cannot be read: " + job.catalog_error + "\n";
    out += "  run " + RunsText(job) + "\n";
    if (job.split_attempts > 0) {
      out += "  SPLIT ATTEMPT: " + std::to_string(job.split_attempts) +
             " step(s) saved by its ranks in different attempts will never complete; newest: " + job.split + "\n";
    }
    out += "  ema " + EmaSummaryText(job) + "\n";
    if (std::any_of(job.ranks.begin(), job.ranks.end(), [](const RankStatus& r) { return r.memory_checkpoints > 0; })) {
      // Memory checkpoints: per rank, its newest step, how many are kept and the slots' bytes.
      std::string kept;
      for (const RankStatus& r : job.ranks) {
        if (r.memory_checkpoints == 0) continue;
        kept += std::string(kept.empty() ? "" : ", ") + "rank " + std::to_string(r.rank) + " step " +
                std::to_string(r.memory_step) + " (" + std::to_string(r.memory_checkpoints) + " kept, " +
                CompactBytes(r.memory_bytes) + ")";
      }
      out += "  memory checkpoints: " + kept + "\n";
    }
    // OLDEST WRITE: how long the rank's oldest persist being written has been running.
    TextTable table({"RANK", "CONNECTED", "MEMORY", "COMMITTED", "PERSISTED", "SLOTS", "OLDEST WRITE", "SNAPSHOTS",
                     "PERSISTS", "FAILURES", "SKIPPED", "LAST ERROR"},
                    {true, false, true, true, true, false, true, true, true, true, true, false});
    for (const auto& rank : job.ranks) {
      table.AddRow({std::to_string(rank.rank), rank.connected ? "yes" : "no", FormatBytes(rank.segment_bytes),
                    StepText(rank.last_committed_step), StepText(rank.last_persisted_step), SlotsText(rank),
                    OldestWriteText(rank.oldest_write_seconds), std::to_string(rank.snapshots),
                    std::to_string(rank.persists), std::to_string(rank.failures), std::to_string(rank.skipped),
                    rank.last_error.empty() ? "-" : rank.last_error});
    }
    out += table.Render("  ");
    bool any_ema = std::any_of(job.ranks.begin(), job.ranks.end(), [](const auto& r) { return r.ema_enabled; });
    if (!any_ema) continue;
    // EMA STEP is the step of the last update applied; APPLIED and SKIPPED count updates (SKIPPED:
    // refused by the loss threshold); EMA SIZE is the size of the rank's ema.*.safetensors image.
    TextTable ema({"RANK", "EMA", "DECAY", "EMA STEP", "APPLIED", "SKIPPED", "EMA SIZE"},
                  {true, false, true, true, true, true, true});
    for (const auto& rank : job.ranks) {
      if (!rank.ema_enabled) {
        ema.AddRow({std::to_string(rank.rank), "off", "-", "-", "-", "-", "-"});
        continue;
      }
      ema.AddRow({std::to_string(rank.rank), "on", DecayText(rank.ema_decay), StepText(rank.ema_last_step),
                  std::to_string(rank.ema_updates_applied), std::to_string(rank.ema_updates_skipped),
                  FormatBytes(rank.ema_bytes)});
    }
    out += "\n" + ema.Render("  ");
  }
  return out;
}

ordered_json StatusJson(const DaemonStatus& status) {
  ordered_json out;
  out["version"] = status.version;
  out["uptime_seconds"] = status.uptime_seconds;
  out["host_memory_used"] = status.host_memory_used;
  out["host_memory_budget"] = status.host_memory_budget;
  out["root"] = status.root;
  out["node_name"] = status.node_name;
  out["cuda_compiled"] = status.cuda_compiled;
  out["cuda_devices"] = status.cuda_devices;
  ordered_json peers = ordered_json::array();
  for (const ReplicaPeerStatus& peer : status.replica_peers) {
    ordered_json p;
    p["target"] = peer.target;
    p["lag_steps"] = peer.lag_steps;
    p["pushed"] = peer.pushed;
    p["failed"] = peer.failed;
    p["bytes"] = peer.bytes;
    p["queued"] = peer.queued;
    p["last_gbps"] = peer.last_gbps;
    p["last_error"] = peer.last_error;
    peers.push_back(std::move(p));
  }
  out["replica_peers"] = std::move(peers);
  out["replica_listening"] = status.replica_listening;
  out["replicas_held"] = status.replicas_held;
  out["replica_held_bytes"] = status.replica_held_bytes;
  ordered_json jobs = ordered_json::array();
  for (const auto& job : status.jobs) {
    ordered_json j;
    j["job"] = job.job;
    j["world_size"] = job.world_size;
    j["last_complete_step"] = StepJson(job.last_complete_step);
    if (!job.catalog_error.empty()) j["catalog_error"] = job.catalog_error;
    j["split_attempts"] = job.split_attempts;
    j["split"] = job.split;
    j["last_committed_step"] = StepJson(JobLastCommitted(job));
    ordered_json ranks = ordered_json::array();
    for (const auto& rank : job.ranks) {
      ordered_json r;
      r["rank"] = rank.rank;
      r["connected"] = rank.connected;
      r["segment_bytes"] = rank.segment_bytes;
      r["last_committed_step"] = StepJson(rank.last_committed_step);
      r["last_persisted_step"] = StepJson(rank.last_persisted_step);
      r["run_id"] = rank.run_id;
      r["resumed_from"] = rank.resumed_from;
      r["memory_step"] = StepJson(rank.memory_step);
      r["memory_checkpoints"] = rank.memory_checkpoints;
      r["memory_bytes"] = rank.memory_bytes;
      ordered_json slots = ordered_json::array();
      for (const auto& s : rank.slots) {
        slots.push_back({{"index", s.index},
                         {"state", s.state},
                         {"step", StepJson(s.step)},
                         {"filling_seconds", s.filling_seconds}});
      }
      r["slots"] = std::move(slots);
      r["oldest_write_seconds"] = rank.oldest_write_seconds;  // 0: nothing being written
      r["last_persist_gbps"] = rank.last_persist_gbps;        // 0: none yet
      r["snapshots"] = rank.snapshots;
      r["persists"] = rank.persists;
      r["failures"] = rank.failures;
      r["skipped"] = rank.skipped;
      r["last_error"] = rank.last_error;
      // Same keys whether EMA is on or off, so scripts need not test for their presence.
      const bool on = rank.ema_enabled;
      r["ema"] = {{"enabled", on},
                  {"decay", on ? ordered_json(rank.ema_decay) : ordered_json(nullptr)},
                  {"last_step", on ? StepJson(rank.ema_last_step) : ordered_json(nullptr)},
                  {"updates_applied", rank.ema_updates_applied},
                  {"updates_skipped", rank.ema_updates_skipped},
                  {"bytes", rank.ema_bytes}};
      ranks.push_back(std::move(r));
    }
    j["ranks"] = std::move(ranks);
    jobs.push_back(std::move(j));
  }
  out["jobs"] = std::move(jobs);
  return out;
}

namespace {

// The distinct nodes of a step's signals, in rank order: "node-a,node-b"; more than three are
// shortened to the first three and a count ("a,b,c +5"); "-" when no signal records its node.
std::string NodesText(const CheckpointInfo& c) {
  std::vector<std::string> nodes;
  for (const SignalledRank& r : c.signalled) {
    if (!r.node.empty() && std::find(nodes.begin(), nodes.end(), r.node) == nodes.end()) nodes.push_back(r.node);
  }
  if (nodes.empty()) return "-";
  std::string out;
  for (size_t i = 0; i < nodes.size() && i < 3; ++i) out += (i ? "," : "") + nodes[i];
  if (nodes.size() > 3) out += " +" + std::to_string(nodes.size() - 3);
  return out;
}

struct MissingRank {
  uint32_t rank;
  std::string node;  // the node of the rank's newest signal in another step of the job; empty: none
};

// At most this many missing ranks are named per step (the count says how many there are).
constexpr size_t kMissingShown = 64;

// The ranks of an incomplete step that have not signalled (none when its world size is unknown),
// each with the node that signalled for it last in another step of the job: the node that lags.
// At most kMissingShown; `count` gets how many are missing.
std::vector<MissingRank> MissingRanks(const CheckpointInfo& c, const std::vector<CheckpointInfo>& list,
                                      uint64_t* count) {
  std::vector<MissingRank> out;
  *count = 0;
  if (c.complete || c.world_size == 0) return out;
  std::set<uint32_t> present;
  for (const SignalledRank& s : c.signalled) present.insert(s.rank);
  *count = c.world_size - std::min<uint64_t>(c.world_size, present.size());
  // The newest node of each rank over the job's other steps: one pass over what the list holds.
  std::map<uint32_t, std::pair<int64_t, std::string>> last;
  for (const CheckpointInfo& o : list) {
    if (o.job != c.job || o.step == c.step) continue;
    for (const SignalledRank& s : o.signalled) {
      if (s.node.empty()) continue;
      auto [it, fresh] = last.try_emplace(s.rank, o.step, s.node);
      if (!fresh && o.step > it->second.first) it->second = {o.step, s.node};
    }
  }
  for (uint32_t r = 0; r < c.world_size && out.size() < kMissingShown; ++r) {
    if (present.count(r) != 0) continue;
    auto it = last.find(r);
    out.push_back({r, it == last.end() ? std::string() : it->second.second});
  }
  return out;
}

// "3@node-b,7": the missing ranks and where they last wrote; "-" when none or unknown.
std::string MissingText(const std::vector<MissingRank>& missing, uint64_t count) {
  if (missing.empty()) return "-";
  std::string out;
  for (size_t i = 0; i < missing.size(); ++i) {
    if (i == 8) return out + " +" + std::to_string(count - 8);
    out += (i ? "," : "") + std::to_string(missing[i].rank) + (missing[i].node.empty() ? "" : "@" + missing[i].node);
  }
  return out;
}

// "0-3,6": a sorted list of ranks as ranges.
std::string RankRangesText(const std::vector<uint32_t>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ",") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return out;
}

}  // namespace

std::vector<StepRun> RunsOf(const std::vector<SignalledRank>& signalled) {
  std::vector<StepRun> runs;
  for (const SignalledRank& s : signalled) {
    auto it = std::find_if(runs.begin(), runs.end(), [&](const StepRun& r) {
      return r.run_id == s.run_id && r.resumed_from == s.resumed_from;
    });
    if (it == runs.end()) it = runs.insert(runs.end(), StepRun{s.run_id, s.resumed_from, {}});
    it->ranks.push_back(s.rank);
  }
  for (StepRun& r : runs) std::sort(r.ranks.begin(), r.ranks.end());
  return runs;
}

bool IsSplit(const CheckpointInfo& c) {
  return !c.complete && c.world_size > 0 && c.signalled.size() == c.world_size && RunsOf(c.signalled).size() > 1;
}

std::string StepRunText(const StepRun& run) {
  return (run.run_id.empty() ? std::string("(no run id)") : run.run_id) +
         (run.resumed_from > 0 ? " (resumed from " + std::to_string(run.resumed_from) + ")" : " (fresh)");
}

std::string RunsText(const std::vector<SignalledRank>& signalled) {
  const std::vector<StepRun> runs = RunsOf(signalled);
  if (runs.empty()) return "-";
  if (runs.size() == 1) return StepRunText(runs[0]);
  std::string out;
  for (const StepRun& r : runs) out += (out.empty() ? "" : "; ") + StepRunText(r) + " ranks " + RankRangesText(r.ranks);
  return out;
}

std::string ListText(const std::vector<CheckpointInfo>& list) {
  if (list.empty()) return "no checkpoints\n";
  TextTable table({"JOB", "STEP", "COMPLETE", "SIGNALS", "MISSING", "NODES", "BYTES", "LATEST", "PATH", "RUN"},
                  {false, true, false, true, false, false, true, false, false, false});
  for (const auto& c : list) {
    std::string signals = std::to_string(c.signals) + "/" + (c.world_size ? std::to_string(c.world_size) : "?");
    uint64_t count = 0;
    const std::vector<MissingRank> missing = MissingRanks(c, list, &count);
    // A split step (every rank signalled, in different attempts) never completes: said as such.
    const bool split = IsSplit(c);
    table.AddRow({c.job, std::to_string(c.step), c.complete ? "yes" : split ? "no (split)" : "no", signals,
                  MissingText(missing, count), NodesText(c), FormatBytes(c.bytes), c.latest ? "*" : "", c.path,
                  (split ? "split: " : "") + RunsText(c.signalled)});
  }
  return table.Render("");
}

ordered_json RunsJson(const std::vector<SignalledRank>& signalled) {
  ordered_json runs = ordered_json::array();
  for (const StepRun& r : RunsOf(signalled)) {
    runs.push_back({{"run_id", r.run_id}, {"resumed_from", r.resumed_from}, {"ranks", r.ranks}});
  }
  return runs;
}

ordered_json ListJson(const std::vector<CheckpointInfo>& list) {
  ordered_json out = ordered_json::array();
  for (const auto& c : list) {
    ordered_json signalled = ordered_json::array();
    for (const SignalledRank& r : c.signalled) {
      signalled.push_back({{"rank", r.rank}, {"node", r.node.empty() ? ordered_json(nullptr) : ordered_json(r.node)}});
    }
    ordered_json missing = ordered_json::array();
    uint64_t count = 0;
    for (const MissingRank& m : MissingRanks(c, list, &count)) {
      missing.push_back({{"rank", m.rank}, {"last_node", m.node.empty() ? ordered_json(nullptr) : ordered_json(m.node)}});
    }
    out.push_back({{"job", c.job},
                   {"step", c.step},
                   {"complete", c.complete},
                   {"signals", c.signals},
                   {"world_size", c.world_size ? ordered_json(c.world_size) : ordered_json(nullptr)},
                   {"bytes", c.bytes},
                   {"latest", c.latest},
                   {"path", c.path},
                   {"signalled", signalled},
                   {"missing", missing},  // the first 64
                   {"missing_count", count},
                   {"split", IsSplit(c)},
                   {"runs", RunsJson(c.signalled)}});
  }
  return out;
}

namespace {

// The node that wrote rank `rank`'s signal; "-" when none records it.
std::string NodeOfRank(const std::vector<SignalledRank>& signalled, uint32_t rank) {
  for (const SignalledRank& r : signalled) {
    if (r.rank == rank && !r.node.empty()) return r.node;
  }
  return "-";
}

// "node-a (ranks 0-3), node-b (ranks 4, 6)": the nodes in order of their first rank.
std::string NodesByRankText(const std::vector<SignalledRank>& signalled) {
  std::vector<std::pair<std::string, std::vector<uint32_t>>> nodes;
  for (const SignalledRank& r : signalled) {
    if (r.node.empty()) continue;
    auto it = std::find_if(nodes.begin(), nodes.end(), [&](const auto& n) { return n.first == r.node; });
    if (it == nodes.end()) it = nodes.insert(nodes.end(), {r.node, {}});
    it->second.push_back(r.rank);
  }
  if (nodes.empty()) return "not recorded";
  std::string out;
  for (const auto& [node, ranks] : nodes) {
    if (!out.empty()) out += ", ";
    std::string list;
    for (size_t i = 0; i < ranks.size();) {
      size_t j = i;
      while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
      if (!list.empty()) list += ", ";
      list += std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
      i = j + 1;
    }
    out += node + (ranks.size() == 1 ? " (rank " : " (ranks ") + list + ")";
  }
  return out;
}

}  // namespace

std::string InspectText(const std::string& dir, const CheckpointMetadata& meta,
                        const std::vector<SignalledRank>& signalled) {
  const auto tensors = GroupTensors(meta);
  const Topology& t = meta.topology;
  std::string out;
  out += "checkpoint  " + dir + "\n";
  out += "job         " + meta.job + "\n";
  out += "step        " + std::to_string(meta.step) + "\n";
  out +=
      "complete    yes (metadata.json)" + std::string(meta.created.empty() ? "" : ", created " + meta.created) + "\n";
  out += "format      version " + std::to_string(meta.format_version) + "\n";
  out += "topology    world size " + std::to_string(t.world_size) + ": tp " + std::to_string(t.tp_degree) + " x pp " +
         std::to_string(t.pp_degree) + " x shard " + std::to_string(t.shard_degree) + "\n";
  if (meta.ema) {
    const EmaRecord& e = *meta.ema;
    out += "ema         decay " + DecayText(e.decay) + ", interval " + std::to_string(e.interval) + ", init " + e.init +
           ", model params " + e.model_params;
    if (e.loss_threshold) out += ", loss threshold " + DecayText(*e.loss_threshold);
    out += "; " + std::to_string(e.updates_applied) + " updates applied, " + std::to_string(e.updates_skipped) +
           " skipped, last at step " + std::to_string(e.last_step) + "\n";
  } else {
    out += "ema         none\n";
  }
  out += "size        " + std::to_string(meta.files.size()) + " files, " + FormatBytes(FileBytes(meta)) + "; " +
         std::to_string(tensors.size()) + " tensors in " + std::to_string(meta.pieces.size()) + " pieces\n";
  out += "nodes       " + NodesByRankText(signalled) + "\n";
  out += "run         " +
         StepRunText(StepRun{meta.run_id, meta.resumed_from, {}}) + "\n";

  out += "\n";
  TextTable files({"FILE", "RANK", "TP", "PP", "SHARD", "NODE", "BYTES"}, {false, true, true, true, true, false, true});
  for (const auto& f : meta.files) {
    files.AddRow({f.name, std::to_string(f.rank), std::to_string(f.tp_rank), std::to_string(f.pp_rank),
                  std::to_string(f.shard_rank), NodeOfRank(signalled, f.rank), FormatBytes(f.bytes)});
  }
  out += files.Render("");

  out += "\n";
  TextTable table({"TENSOR", "KIND", "DTYPE", "GLOBAL SHAPE", "PIECES", "BYTES"},
                  {false, false, false, false, true, true});
  for (const auto& x : tensors) {
    table.AddRow({x.name, std::string(TensorKindName(x.kind)), std::string(DTypeName(x.dtype)) + (x.mixed ? "*" : ""),
                  ShapeText(x.global_shape), std::to_string(x.pieces.size()), FormatBytes(x.bytes)});
  }
  out += table.Render("");
  if (std::any_of(tensors.begin(), tensors.end(), [](const auto& x) { return x.mixed; })) {
    out += "* pieces disagree on dtype or global shape: run `flashckpt verify`\n";
  }
  return out;
}

ordered_json InspectJson(const std::string& dir, const CheckpointMetadata& meta,
                         const std::vector<SignalledRank>& signalled) {
  const auto tensors = GroupTensors(meta);
  const Topology& t = meta.topology;
  ordered_json out;
  out["dir"] = dir;
  out["job"] = meta.job;
  out["step"] = meta.step;
  out["complete"] = true;
  out["created"] = meta.created;
  out["run"] = {{"run_id", meta.run_id}, {"resumed_from", meta.resumed_from}};
  out["format_version"] = meta.format_version;
  out["topology"] = {{"world_size", t.world_size},
                     {"tp_degree", t.tp_degree},
                     {"pp_degree", t.pp_degree},
                     {"shard_degree", t.shard_degree}};
  if (meta.ema) {
    const EmaRecord& e = *meta.ema;
    out["ema"] = {{"decay", e.decay},
                  {"interval", e.interval},
                  {"init", e.init},
                  {"model_params", e.model_params},
                  {"loss_threshold", e.loss_threshold ? ordered_json(*e.loss_threshold) : ordered_json(nullptr)},
                  {"updates_applied", e.updates_applied},
                  {"updates_skipped", e.updates_skipped},
                  {"last_step", e.last_step}};
  } else {
    out["ema"] = nullptr;
  }
  ordered_json ranks = ordered_json::array();
  for (const SignalledRank& r : signalled) {
    ranks.push_back({{"rank", r.rank}, {"node", r.node.empty() ? ordered_json(nullptr) : ordered_json(r.node)}});
  }
  out["signalled"] = ranks;
  out["files"] = SavedFilesJson(meta.files);
  ordered_json list = ordered_json::array();
  uint64_t tensor_bytes = 0;
  for (const auto& x : tensors) {
    ordered_json pieces = ordered_json::array();
    for (const Piece* p : x.pieces) {
      ordered_json piece = {{"file", p->file},
                            {"shape", p->shape},
                            {"box_offset", p->box_offset},
                            {"box_shape", p->box_shape},
                            {"flat_range", p->flat_range ? ordered_json({p->flat_range->begin, p->flat_range->end})
                                                         : ordered_json(nullptr)},
                            {"bytes", p->end - p->begin}};
      pieces.push_back(std::move(piece));
    }
    tensor_bytes += x.bytes;
    list.push_back({{"name", x.name},
                    {"kind", std::string(TensorKindName(x.kind))},
                    {"dtype", std::string(DTypeName(x.dtype))},
                    {"global_shape", x.global_shape},
                    {"bytes", x.bytes},
                    {"pieces", std::move(pieces)}});
  }
  out["tensors"] = std::move(list);
  out["totals"] = {{"files", meta.files.size()},
                   {"file_bytes", FileBytes(meta)},
                   {"tensors", tensors.size()},
                   {"pieces", meta.pieces.size()},
                   {"tensor_bytes", tensor_bytes}};
  return out;
}

std::string DeleteText(const std::string& job, const DeleteResult& resp, bool dry_run) {
  std::string out;
  const std::string verb = dry_run ? "would delete" : "deleted";
  if (resp.deleted.empty()) {
    out += std::string(dry_run ? "would delete" : "deleted") + " nothing of job " + job + "\n";
  }
  for (int64_t step : resp.deleted) out += verb + " " + job + "/" + CheckpointDirName(step) + "\n";
  for (const auto& s : resp.skipped) {
    out += "skipped " + job + "/" + CheckpointDirName(s.step) + ": " + s.reason + "\n";
  }
  out += "latest  " +
         (resp.latest < 0 ? std::string("none (no complete checkpoint left)") : CheckpointDirName(resp.latest)) +
         "\n";
  return out;
}

ordered_json DeleteJson(const std::string& job, const DeleteResult& resp, bool dry_run) {
  ordered_json skipped = ordered_json::array();
  for (const auto& s : resp.skipped) skipped.push_back({{"step", s.step}, {"reason", s.reason}});
  return {{"job", job},
          {"dry_run", dry_run},
          {"deleted", std::vector<int64_t>(resp.deleted.begin(), resp.deleted.end())},
          {"skipped", std::move(skipped)},
          {"latest", StepJson(resp.latest)}};
}

std::string ProgressText(uint64_t done, uint64_t total, double seconds) {
  done = std::min(done, total);
  char buf[160];
  const double pct = total > 0 ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0;
  std::snprintf(buf, sizeof buf, "%s of %s (%.0f%%)", FormatBytes(done).c_str(), FormatBytes(total).c_str(), pct);
  std::string out = buf;
  if (done == 0 || !(seconds > 0)) return out;
  const double rate = static_cast<double>(done) / seconds;  // bytes per second
  std::snprintf(buf, sizeof buf, ", %.2f GB/s", rate / 1e9);
  out += buf;
  if (done < total) out += ", ETA " + FormatDuration(static_cast<double>(total - done) / rate);
  return out;
}

}  // namespace flashckpt::cli

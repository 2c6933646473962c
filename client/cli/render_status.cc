// `flashckpt status`: the daemon's status as text tables and as JSON.
#include "client/cli/render.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "client/cli/render_internal.h"
#include "common/base/names.h"

namespace flashckpt::cli {
namespace {

std::string StepText(int64_t step) { return step < 0 ? "-" : std::to_string(step); }

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

// The daemon's own lines: version and uptime, memory, root, node, CUDA, the replicas it holds, and
// one line per --replicate-to peer.
std::string DaemonText(const DaemonStatus& status) {
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
  if (status.ec_group) {
    out += "parity  member " + std::to_string(status.ec_member) + " of " + std::to_string(status.ec_members) +
           ", parity " + std::to_string(status.ec_parity) + ": " + std::to_string(status.parity_shares_held) +
           " share(s) held for the others (" + FormatBytes(status.parity_held_bytes) + "), " +
           std::to_string(status.parity_sent) + " sent, " + std::to_string(status.parity_failed) + " failed\n";
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
  return out;
}

// At a glance: is each job being checkpointed, and how far behind is the disk?
std::string JobsTableText(const DaemonStatus& status) {
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
  return jobs.Render("");
}

// OLDEST WRITE: how long the rank's oldest persist being written has been running.
std::string RanksTableText(const JobStatus& job) {
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
  return table.Render("  ");
}

// EMA STEP is the step of the last update applied; APPLIED and SKIPPED count updates (SKIPPED:
// refused by the loss threshold); EMA SIZE is the size of the rank's ema.*.safetensors image.
std::string EmaTableText(const JobStatus& job) {
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
  return ema.Render("  ");
}

// One job's section: its header lines (runs, split attempts, EMA, memory checkpoints), the table
// of its ranks and, when any rank keeps an EMA, the table of their EMA.
std::string JobText(const JobStatus& job) {
  std::string out;
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
  out += RanksTableText(job);
  bool any_ema = std::any_of(job.ranks.begin(), job.ranks.end(), [](const auto& r) { return r.ema_enabled; });
  if (!any_ema) return out;
  out += "\n" + EmaTableText(job);
  return out;
}

// StatusJson's parts: the --replicate-to peers, a rank, a job with its ranks.
ordered_json ReplicaPeersJson(const DaemonStatus& status) {
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
  return peers;
}

ordered_json RankJson(const RankStatus& rank) {
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
  return r;
}

ordered_json JobJson(const JobStatus& job) {
  ordered_json j;
  j["job"] = job.job;
  j["world_size"] = job.world_size;
  j["last_complete_step"] = StepJson(job.last_complete_step);
  if (!job.catalog_error.empty()) j["catalog_error"] = job.catalog_error;
  j["split_attempts"] = job.split_attempts;
  j["split"] = job.split;
  j["last_committed_step"] = StepJson(JobLastCommitted(job));
  ordered_json ranks = ordered_json::array();
  for (const auto& rank : job.ranks) ranks.push_back(RankJson(rank));
  j["ranks"] = std::move(ranks);
  return j;
}

}  // namespace

std::string StatusText(const DaemonStatus& status) {
  std::string out = DaemonText(status);
  if (status.jobs.empty()) {
    out += "jobs    none registered\n";
    return out;
  }
  out += "\n" + JobsTableText(status);
  for (const auto& job : status.jobs) out += JobText(job);
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
  out["replica_peers"] = ReplicaPeersJson(status);
  out["replica_listening"] = status.replica_listening;
  out["replicas_held"] = status.replicas_held;
  out["replica_held_bytes"] = status.replica_held_bytes;
  out["ec_group"] = status.ec_group;
  if (status.ec_group) {
    out["ec_member"] = status.ec_member;
    out["ec_members"] = status.ec_members;
    out["ec_parity"] = status.ec_parity;
  }
  out["parity_shares_held"] = status.parity_shares_held;
  out["parity_held_bytes"] = status.parity_held_bytes;
  out["parity_sent"] = status.parity_sent;
  out["parity_failed"] = status.parity_failed;
  out["parity_step"] = status.parity_step;
  ordered_json jobs = ordered_json::array();
  for (const auto& job : status.jobs) jobs.push_back(JobJson(job));
  out["jobs"] = std::move(jobs);
  return out;
}

}  // namespace flashckpt::cli

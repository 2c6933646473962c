#include "client/cli/render.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "common/names.h"

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

ordered_json StepJson(int64_t step) { return step < 0 ? ordered_json(nullptr) : ordered_json(step); }

// Decay as typed: 0.999, 0.9999, 0.99995 (enough digits to tell configurations apart).
std::string DecayText(double decay) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.10g", decay);
  return buf;
}

// The job's EMA in one line: "off", or "on for 2 of 4 rank(s) here, decay 0.999" (ranks whose
// weights are all replicas persisted by another rank hold no EMA and count as off).
std::string EmaSummaryText(const v1::JobStatus& job) {
  int on = 0;
  std::vector<std::string> decays;  // distinct, in rank order; one unless ranks disagree
  for (const auto& rank : job.ranks()) {
    if (!rank.ema_enabled()) continue;
    ++on;
    std::string d = DecayText(rank.ema_decay());
    if (std::find(decays.begin(), decays.end(), d) == decays.end()) decays.push_back(d);
  }
  if (on == 0) return "off";
  std::string out =
      "on for " + std::to_string(on) + " of " + std::to_string(job.ranks_size()) + " rank(s) here, decay ";
  for (size_t i = 0; i < decays.size(); ++i) out += (i ? "/" : "") + decays[i];
  return out;
}

std::string SlotsText(const v1::RankStatus& rank) {
  std::string out;
  for (const auto& s : rank.slots()) {
    if (!out.empty()) out += " ";
    out += std::to_string(s.index()) + ":" + s.state();
    if (s.state() != "free" && s.step() >= 0) out += "@" + std::to_string(s.step());
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

// Whether the daemon has CUDA: what its own cudaGetDeviceCount saw (the trainers' devices are theirs).
std::string CudaText(const v1::StatusResponse& status) {
  if (!status.cuda_compiled()) return "not compiled in";
  if (status.cuda_devices() <= 0) return "compiled in, no device";
  return "compiled in, " + std::to_string(status.cuda_devices()) +
         (status.cuda_devices() == 1 ? " device" : " devices");
}

}  // namespace

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

std::string StatusText(const v1::StatusResponse& status) {
  std::string out;
  out += "daemon  flashckptd " + status.version() + ", up " + FormatDuration(status.uptime_seconds()) + "\n";
  out += "memory  " + FormatBytes(status.host_memory_used()) + " used of " + FormatBytes(status.host_memory_budget()) +
         " budget";
  if (status.host_memory_budget() > 0) {
    char pct[32];
    std::snprintf(
        pct, sizeof pct, " (%.1f%%)",
        100.0 * static_cast<double>(status.host_memory_used()) / static_cast<double>(status.host_memory_budget()));
    out += pct;
  }
  out += "\n";
  out += "root    " + status.root() + "\n";
  out += "cuda    " + CudaText(status) + "\n";
  if (status.jobs().empty()) {
    out += "jobs    none registered\n";
    return out;
  }
  for (const auto& job : status.jobs()) {
    out += "\njob " + job.job() + "  world size " + std::to_string(job.world_size()) + ", " +
           std::to_string(job.ranks_size()) + " rank(s) here, last complete step " +
           StepText(job.last_complete_step()) + "\n";
    out += "  ema " + EmaSummaryText(job) + "\n";
    // OLDEST WRITE: how long the rank's oldest persist being written has been running.
    TextTable table({"RANK", "CONNECTED", "MEMORY", "COMMITTED", "PERSISTED", "SLOTS", "OLDEST WRITE", "SNAPSHOTS",
                     "PERSISTS", "FAILURES", "SKIPPED", "LAST ERROR"},
                    {true, false, true, true, true, false, true, true, true, true, true, false});
    for (const auto& rank : job.ranks()) {
      table.AddRow({std::to_string(rank.rank()), rank.connected() ? "yes" : "no", FormatBytes(rank.segment_bytes()),
                    StepText(rank.last_committed_step()), StepText(rank.last_persisted_step()), SlotsText(rank),
                    OldestWriteText(rank.oldest_write_seconds()), std::to_string(rank.snapshots()),
                    std::to_string(rank.persists()), std::to_string(rank.failures()), std::to_string(rank.skipped()),
                    rank.last_error().empty() ? "-" : rank.last_error()});
    }
    out += table.Render("  ");
    bool any_ema = std::any_of(job.ranks().begin(), job.ranks().end(), [](const auto& r) { return r.ema_enabled(); });
    if (!any_ema) continue;
    // EMA STEP is the step of the last update applied; APPLIED and SKIPPED count updates (SKIPPED:
    // refused by the loss threshold); EMA SIZE is the size of the rank's ema.*.safetensors image.
    TextTable ema({"RANK", "EMA", "DECAY", "EMA STEP", "APPLIED", "SKIPPED", "EMA SIZE"},
                  {true, false, true, true, true, true, true});
    for (const auto& rank : job.ranks()) {
      if (!rank.ema_enabled()) {
        ema.AddRow({std::to_string(rank.rank()), "off", "-", "-", "-", "-", "-"});
        continue;
      }
      ema.AddRow({std::to_string(rank.rank()), "on", DecayText(rank.ema_decay()), StepText(rank.ema_last_step()),
                  std::to_string(rank.ema_updates_applied()), std::to_string(rank.ema_updates_skipped()),
                  FormatBytes(rank.ema_bytes())});
    }
    out += "\n" + ema.Render("  ");
  }
  return out;
}

ordered_json StatusJson(const v1::StatusResponse& status) {
  ordered_json out;
  out["version"] = status.version();
  out["uptime_seconds"] = status.uptime_seconds();
  out["host_memory_used"] = status.host_memory_used();
  out["host_memory_budget"] = status.host_memory_budget();
  out["root"] = status.root();
  out["cuda_compiled"] = status.cuda_compiled();
  out["cuda_devices"] = status.cuda_devices();
  ordered_json jobs = ordered_json::array();
  for (const auto& job : status.jobs()) {
    ordered_json j;
    j["job"] = job.job();
    j["world_size"] = job.world_size();
    j["last_complete_step"] = StepJson(job.last_complete_step());
    ordered_json ranks = ordered_json::array();
    for (const auto& rank : job.ranks()) {
      ordered_json r;
      r["rank"] = rank.rank();
      r["connected"] = rank.connected();
      r["segment_bytes"] = rank.segment_bytes();
      r["last_committed_step"] = StepJson(rank.last_committed_step());
      r["last_persisted_step"] = StepJson(rank.last_persisted_step());
      ordered_json slots = ordered_json::array();
      for (const auto& s : rank.slots()) {
        slots.push_back({{"index", s.index()}, {"state", s.state()}, {"step", StepJson(s.step())}});
      }
      r["slots"] = std::move(slots);
      r["oldest_write_seconds"] = rank.oldest_write_seconds();  // 0: nothing being written
      r["snapshots"] = rank.snapshots();
      r["persists"] = rank.persists();
      r["failures"] = rank.failures();
      r["skipped"] = rank.skipped();
      r["last_error"] = rank.last_error();
      // Same keys whether EMA is on or off, so scripts need not test for their presence.
      const bool on = rank.ema_enabled();
      r["ema"] = {{"enabled", on},
                  {"decay", on ? ordered_json(rank.ema_decay()) : ordered_json(nullptr)},
                  {"last_step", on ? StepJson(rank.ema_last_step()) : ordered_json(nullptr)},
                  {"updates_applied", rank.ema_updates_applied()},
                  {"updates_skipped", rank.ema_updates_skipped()},
                  {"bytes", rank.ema_bytes()}};
      ranks.push_back(std::move(r));
    }
    j["ranks"] = std::move(ranks);
    jobs.push_back(std::move(j));
  }
  out["jobs"] = std::move(jobs);
  return out;
}

std::string ListText(const v1::ListCheckpointsResponse& list) {
  if (list.checkpoints().empty()) return "no checkpoints\n";
  TextTable table({"JOB", "STEP", "COMPLETE", "SIGNALS", "BYTES", "LATEST", "PATH"},
                  {false, true, false, true, true, false, false});
  for (const auto& c : list.checkpoints()) {
    std::string signals = std::to_string(c.signals()) + "/" + (c.world_size() ? std::to_string(c.world_size()) : "?");
    table.AddRow({c.job(), std::to_string(c.step()), c.complete() ? "yes" : "no", signals, FormatBytes(c.bytes()),
                  c.latest() ? "*" : "", c.path()});
  }
  return table.Render("");
}

ordered_json ListJson(const v1::ListCheckpointsResponse& list) {
  ordered_json out = ordered_json::array();
  for (const auto& c : list.checkpoints()) {
    out.push_back({{"job", c.job()},
                   {"step", c.step()},
                   {"complete", c.complete()},
                   {"signals", c.signals()},
                   {"world_size", c.world_size() ? ordered_json(c.world_size()) : ordered_json(nullptr)},
                   {"bytes", c.bytes()},
                   {"latest", c.latest()},
                   {"path", c.path()}});
  }
  return out;
}

}  // namespace flashckpt::cli

// The rendering shared by the commands' outputs (render_internal.h), durations, the answer of a
// delete or gc, and progress lines. Status, events, the checkpoint list and inspect are in
// render_status.cc, render_events.cc, render_list.cc and render_inspect.cc.
#include "client/cli/render.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "client/cli/render_internal.h"
#include "common/base/names.h"

namespace flashckpt::cli {

ordered_json StepJson(int64_t step) { return step < 0 ? ordered_json(nullptr) : ordered_json(step); }

std::string DecayText(double decay) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.10g", decay);
  return buf;
}

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string CompactBytes(uint64_t bytes) {
  std::string out = FormatBytes(bytes);
  out.erase(std::remove(out.begin(), out.end(), ' '), out.end());
  return out;
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

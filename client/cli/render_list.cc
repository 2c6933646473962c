// `flashckpt list`: the checkpoints as a table and as JSON, with the attempts that saved each step.
#include "client/cli/render.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "client/cli/render_internal.h"
#include "common/base/names.h"

namespace flashckpt::cli {
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

}  // namespace flashckpt::cli

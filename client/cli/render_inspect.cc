// `flashckpt inspect`: a complete checkpoint's metadata as text tables and as JSON.
#include "client/cli/render.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "client/cli/render_internal.h"
#include "common/base/dtype.h"
#include "common/base/names.h"

namespace flashckpt::cli {
namespace {

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

}  // namespace flashckpt::cli

// plan_bench: what planning a restore of a large job costs, from its metadata alone. It builds the
// metadata of a checkpoint of --ranks ranks (tp 8 x pp 4 x shard ranks/32, --tensors tensors per
// rank: a third model weights cut by rows over tp and written by shard 0, two thirds their Adam
// moments as flat ranges over shard), writes it as ROOT/plan/checkpoint-100/metadata.json (with its
// index, metadata.index.json) and the ranks' saved_signal files and LATEST (not the safetensors
// files: the planner never opens them), then times what a restoring daemon does for --plan-ranks
// ranks (one node) of another layout, tp 4 x pp 8 x shard ranks/32, whose moments straddle the
// saved ones:
//
//   read    ReadMetadataFor the names those ranks want: the index, metadata.json's head and those
//           tensors' lists of pieces
//   index   the pieces by tensor name (what FillSlotFromCheckpoint builds first)
//   plan    PlanPieceReads of every tensor of those ranks
//
// and prints the metadata's size, how much of it was read, `RESULT plan_ms_<ranks>=` (read + index +
// plan, the best of --repeat) for bench/scale_bench.py, which also times the CLI on the same root,
// and the time to read and parse the whole metadata.json (what inspect and verify do).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "common/base/names.h"
#include "common/format/metadata.h"
#include "common/format/signal.h"
#include "common/io/fs.h"
#include "common/read/reshard.h"

namespace flashckpt {
namespace {

constexpr uint32_t kTp = 8, kPp = 4;  // the saving layout; shard = ranks / 32
constexpr uint64_t kHidden = 512;     // every weight is [kHidden, kHidden] fp32
constexpr uint64_t kHeaderBytes = 1 << 20;

double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

std::string WeightName(uint32_t w) { return "layers." + std::to_string(w) + ".weight"; }

// The piece of weight `w` (or of one of its moments: `moment` 1 or 2) that rank (tp, shard) of a
// layout with `tp_degree` x `shard_degree` holds.
Piece PieceOf(uint32_t w, int moment, uint32_t tp, uint32_t tp_degree, uint32_t shard, uint32_t shard_degree) {
  Piece p;
  p.key = WeightName(w) + (moment == 1 ? ".exp_avg" : moment == 2 ? ".exp_avg_sq" : "");
  p.kind = moment == 0 ? TensorKind::kModel : TensorKind::kOptimizer;
  p.global_shape = {kHidden, kHidden};
  const uint64_t rows = kHidden / tp_degree;
  p.box_offset = {tp * rows, 0};
  p.box_shape = {rows, kHidden};
  if (moment == 0) {
    p.shape = p.box_shape;
  } else {
    const uint64_t n = rows * kHidden, chunk = n / shard_degree;
    p.flat_range = FlatRange{shard * chunk, (shard + 1) * chunk};
    p.shape = {chunk};
  }
  return p;
}

// The saving job's metadata: every rank's pieces, each in its rank's file.
CheckpointMetadata MakeMetadata(uint32_t ranks, uint32_t tensors) {
  const uint32_t shards = ranks / (kTp * kPp), per_stage = tensors / 3;
  CheckpointMetadata meta;
  meta.job = "plan";
  meta.step = 100;
  meta.topology = {ranks, 0, kTp, 0, kPp, 0, shards};
  meta.created = "2026-01-01T00:00:00Z";
  meta.run_id = "plan-bench";
  uint64_t hash = 0x9e3779b97f4a7c15ull;
  for (uint32_t r = 0; r < ranks; ++r) {
    const uint32_t tp = r % kTp, pp = (r / kTp) % kPp, shard = r / (kTp * kPp);
    for (const char* kind : {"model_state", "optimizer"}) {
      const bool model = std::string(kind) == "model_state";
      if (model && shard != 0) continue;  // the weights are replicas on the other shard ranks
      SavedFile f;
      f.name = FileStem(kind, tp, pp, shard) + ".safetensors";
      f.rank = r;
      f.tp_rank = tp, f.pp_rank = pp, f.shard_rank = shard;
      uint64_t offset = kHeaderBytes;
      for (uint32_t k = 0; k < per_stage; ++k) {
        const uint32_t w = pp * per_stage + k;
        for (int moment : model ? std::vector<int>{0} : std::vector<int>{1, 2}) {
          Piece p = PieceOf(w, moment, tp, kTp, shard, shards);
          uint64_t elements = 1;
          for (uint64_t d : p.shape) elements *= d;
          p.file = f.name;
          p.begin = offset;
          p.end = offset + elements * sizeof(float);
          offset = p.end;
          hash ^= hash << 13, hash ^= hash >> 7, hash ^= hash << 17;
          p.xxh3 = hash;
          meta.pieces.push_back(std::move(p));
        }
      }
      f.bytes = offset;
      meta.files.push_back(std::move(f));
    }
  }
  return meta;
}

// Each rank's saved_signal, as a real checkpoint has them (what `flashckpt list` reads).
Status WriteSignals(const std::string& dir, const CheckpointMetadata& meta) {
  std::vector<Signal> signals(meta.topology.world_size);
  for (uint32_t r = 0; r < signals.size(); ++r) {
    signals[r].rank = r;
    signals[r].step = meta.step;
    signals[r].run_id = meta.run_id;
    signals[r].node = "node" + std::to_string(r / 8);
    signals[r].world_size = meta.topology.world_size;
  }
  for (const SavedFile& f : meta.files) signals[f.rank].files.push_back(f.name);
  for (const Signal& s : signals) RETURN_IF_ERROR(WriteFileDurably(dir, SignalFileName(s.rank), EncodeSignal(meta.job, s, 0)));
  return Status::OK();
}

// The tensors rank `r` of the restoring layout (tp 4 x pp 8 x the same shard degree) wants.
std::vector<TensorSpec> WantedBy(uint32_t r, uint32_t ranks, uint32_t tensors) {
  const uint32_t tp_degree = 4, pp_degree = 8, shards = ranks / (tp_degree * pp_degree);
  const uint32_t tp = r % tp_degree, pp = (r / tp_degree) % pp_degree, shard = r / (tp_degree * pp_degree);
  const uint32_t weights = kPp * (tensors / 3), per_stage = weights / pp_degree;
  std::vector<TensorSpec> out;
  for (uint32_t k = 0; k < per_stage; ++k) {
    for (int moment : {0, 1, 2}) {
      Piece p = PieceOf(pp * per_stage + k, moment, tp, tp_degree, shard, shards);
      TensorSpec t;
      t.name = p.key;
      t.kind = p.kind;
      t.shape = p.shape;
      t.global_shape = p.global_shape;
      t.box_offset = p.box_offset;
      t.box_shape = p.box_shape;
      t.flat_range = p.flat_range;
      out.push_back(std::move(t));
    }
  }
  return out;
}

struct Timing {
  double read_ms = 0, index_ms = 0, plan_ms = 0;
  uint64_t runs = 0;
  MetadataReadStats stats;
  double total() const { return read_ms + index_ms + plan_ms; }
};

// The names the restoring ranks want, once each.
std::vector<std::string> NamesWanted(uint32_t ranks, uint32_t tensors, uint32_t plan_ranks) {
  std::vector<std::string> names;
  for (uint32_t r = 0; r < plan_ranks; ++r) {
    for (const TensorSpec& t : WantedBy(r, ranks, tensors)) names.push_back(t.name);
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

Result<Timing> TimeOnce(const std::string& dir, uint32_t ranks, uint32_t tensors, uint32_t plan_ranks) {
  Timing t;
  auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(CheckpointMetadata meta,
                   ReadMetadataFor(dir, NamesWanted(ranks, tensors, plan_ranks), IoEnv::Default(), &t.stats));
  t.read_ms = MsSince(start);
  start = std::chrono::steady_clock::now();
  std::multimap<std::string, const Piece*> by_key;
  for (const Piece& p : meta.pieces) by_key.emplace(p.key, &p);
  t.index_ms = MsSince(start);
  start = std::chrono::steady_clock::now();
  for (uint32_t r = 0; r < plan_ranks; ++r) {
    for (const TensorSpec& want : WantedBy(r, ranks, tensors)) {
      std::vector<const Piece*> candidates;
      auto [lo, hi] = by_key.equal_range(want.name);
      for (auto it = lo; it != hi; ++it) {
        if (it->second->kind == want.kind) candidates.push_back(it->second);
      }
      ASSIGN_OR_RETURN(ReshardPlan plan, PlanPieceReads(want, candidates));
      t.runs += plan.runs.size();
    }
  }
  t.plan_ms = MsSince(start);
  return t;
}

// The whole of metadata.json, read and parsed (what `flashckpt inspect` and `verify` do).
Result<double> TimeWholeParse(const std::string& dir, size_t* pieces) {
  auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(CheckpointMetadata meta, ReadMetadataFile(dir));
  *pieces = meta.pieces.size();
  return MsSince(start);
}

int Run(const std::string& root, uint32_t ranks, uint32_t tensors, uint32_t plan_ranks, int repeat) {
  if (ranks % 32 != 0 || tensors % 3 != 0 || (kPp * (tensors / 3)) % 8 != 0) {
    std::fprintf(stderr, "plan_bench: --ranks must be a multiple of 32 and --tensors of 3 (and 4/3 of it of 8)\n");
    return 2;
  }
  const std::string job_dir = root + "/plan", dir = job_dir + "/" + CheckpointDirName(100);
  if (Status s = MakeDirs(dir, 0755); !s.ok()) {
    std::fprintf(stderr, "plan_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  CheckpointMetadata meta = MakeMetadata(ranks, tensors);
  const MetadataText text = MetadataToText(meta);
  const std::string& json = text.json;
  if (Status s = WriteMetadataFiles(dir, meta); !s.ok()) {
    std::fprintf(stderr, "plan_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  if (Status s = WriteSignals(dir, meta); !s.ok()) {
    std::fprintf(stderr, "plan_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  if (Status s = WriteFileDurably(job_dir, "LATEST", "100\n"); !s.ok()) {
    std::fprintf(stderr, "plan_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("metadata: %u ranks, %zu files, %zu pieces, %.1f MiB (%.0f bytes per piece)\n", ranks,
              meta.files.size(), meta.pieces.size(), static_cast<double>(json.size()) / (1 << 20),
              static_cast<double>(json.size()) / static_cast<double>(meta.pieces.size()));
  Timing best;
  for (int i = 0; i < repeat; ++i) {
    auto t = TimeOnce(dir, ranks, tensors, plan_ranks);
    if (!t.ok()) {
      std::fprintf(stderr, "plan_bench: %s\n", t.status().ToString().c_str());
      return 1;
    }
    std::printf("run %d: read %.1f ms (%.1f of %.1f MiB of metadata.json and its index, %s), index %.1f ms, plan "
                "of %u ranks %.1f ms (%" PRIu64 " reads planned)\n",
                i + 1, t->read_ms, static_cast<double>(t->stats.bytes_read) / (1 << 20),
                static_cast<double>(t->stats.metadata_bytes) / (1 << 20),
                t->stats.used_index ? "through the index" : "whole: no usable index", t->index_ms, plan_ranks,
                t->plan_ms, t->runs);
    if (i == 0 || t->total() < best.total()) best = *t;
  }
  size_t pieces = 0;
  auto whole = TimeWholeParse(dir, &pieces);
  if (!whole.ok()) {
    std::fprintf(stderr, "plan_bench: %s\n", whole.status().ToString().c_str());
    return 1;
  }
  std::printf("whole metadata.json read and parsed (%zu pieces): %.1f ms\n", pieces, *whole);
  std::printf("RESULT metadata_bytes_%u=%zu\n", ranks, json.size());
  std::printf("RESULT metadata_index_bytes_%u=%zu\n", ranks, text.index.size());
  std::printf("RESULT metadata_read_bytes_%u=%" PRIu64 "\n", ranks, best.stats.bytes_read);
  std::printf("RESULT whole_parse_ms_%u=%.1f\n", ranks, *whole);
  std::printf("RESULT plan_ms_%u=%.1f\n", ranks, best.total());
  return 0;
}

}  // namespace
}  // namespace flashckpt

int main(int argc, char** argv) {
  std::string root;
  uint32_t ranks = 4096, tensors = 300, plan_ranks = 8;
  int repeat = 3;
  CLI::App app{"plan_bench: reading a large job's metadata and planning a restore into another layout"};
  app.add_option("--root", root, "checkpoint root to write the job 'plan' into")->required();
  app.add_option("--ranks", ranks, "ranks of the saved job (a multiple of 32)");
  app.add_option("--tensors", tensors, "tensors per saving rank (a multiple of 3)");
  app.add_option("--plan-ranks", plan_ranks, "restoring ranks planned (one node's)");
  app.add_option("--repeat", repeat, "timed runs; the best is reported")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  return flashckpt::Run(root, ranks, tensors, plan_ranks, repeat);
}

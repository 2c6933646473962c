#include "common/read/relayout.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <tuple>

#include "common/base/dtype.h"
#include "common/base/names.h"
#include "common/format/image.h"
#include "common/format/signal.h"
#include "common/io/fs.h"
#include "common/read/checkpoint_read.h"
#include "common/read/header_check.h"

namespace flashckpt {
namespace {

constexpr uint64_t kMaxNewRanks = 1u << 16;

// One tensor (key and kind) of the checkpoint, and how the checkpoint holds it.
struct Held {
  std::string key;
  TensorKind kind = TensorKind::kModel;
  DType dtype = DType::kF32;
  std::vector<uint64_t> global_shape;
  uint32_t stage = 0;               // saved pipeline stage
  std::optional<size_t> split_dim;  // dimension cut by tensor parallelism
  bool flat = false;                // saved as flat ranges of its box
  uint64_t bytes = 0;               // of the whole global tensor
};

uint64_t Numel(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;  // shapes come from a parsed checkpoint: their bytes fit 64 bits
  return n;
}

// Names in natural order: runs of digits compare as numbers, so "layers.2" sorts before "layers.10".
bool NaturalLess(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (std::isdigit(static_cast<unsigned char>(a[i])) && std::isdigit(static_cast<unsigned char>(b[j]))) {
      size_t ei = i, ej = j;
      while (ei < a.size() && std::isdigit(static_cast<unsigned char>(a[ei]))) ++ei;
      while (ej < b.size() && std::isdigit(static_cast<unsigned char>(b[ej]))) ++ej;
      std::string_view na(a.data() + i, ei - i), nb(b.data() + j, ej - j);
      while (na.size() > 1 && na[0] == '0') na.remove_prefix(1);
      while (nb.size() > 1 && nb[0] == '0') nb.remove_prefix(1);
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      i = ei;
      j = ej;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

std::vector<Held> Gather(const CheckpointMetadata& meta) {
  std::map<std::string, uint32_t> stage_of_file;
  for (const SavedFile& f : meta.files) stage_of_file[f.name] = f.pp_rank;
  std::map<std::pair<std::string, TensorKind>, Held> held;
  for (const Piece& p : meta.pieces) {
    auto [it, fresh] = held.try_emplace({p.key, p.kind});
    Held& h = it->second;
    const uint32_t stage = stage_of_file[p.file];
    if (fresh) {
      h.key = p.key;
      h.kind = p.kind;
      h.dtype = p.dtype;
      h.global_shape = p.global_shape;
      h.stage = stage;
      h.bytes = Numel(p.global_shape) * DTypeSize(p.dtype);
    }
    h.stage = std::min(h.stage, stage);
    h.flat = h.flat || p.flat_range.has_value();
    for (size_t d = 0; d < p.box_shape.size() && !h.split_dim; ++d) {
      if (p.box_shape[d] < p.global_shape[d]) h.split_dim = d;
    }
  }
  std::vector<Held> out;
  for (auto& [id, h] : held) {
    if (meta.topology.tp_degree == 1)
      h.split_dim = h.global_shape.size() >= 2 ? std::optional<size_t>(0) : std::nullopt;
    if (h.split_dim && h.global_shape[*h.split_dim] == 0) h.split_dim.reset();
    h.stage = std::min(h.stage, meta.topology.pp_degree - 1);
    out.push_back(std::move(h));
  }
  std::sort(out.begin(), out.end(), [](const Held& a, const Held& b) {
    if (a.stage != b.stage) return a.stage < b.stage;
    if (NaturalLess(a.key, b.key)) return true;
    if (NaturalLess(b.key, a.key)) return false;
    if (a.key != b.key) return a.key < b.key;  // "x.01" and "x.1": naturally equal, still distinct
    return a.kind < b.kind;
  });
  return out;
}

// Cuts a sequence of items with byte weights into `parts` runs of about equal bytes: the run of
// each item is where its midpoint falls.
std::vector<uint32_t> CutByBytes(const std::vector<uint64_t>& weights, uint32_t parts) {
  long double total = 0;
  for (uint64_t w : weights) total += static_cast<long double>(w);
  std::vector<uint32_t> run(weights.size());
  long double before = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    long double at = total > 0 ? (before + static_cast<long double>(weights[i]) / 2) / total
                               : (static_cast<long double>(i) + 0.5L) / static_cast<long double>(weights.size());
    run[i] = std::min<uint32_t>(parts - 1, static_cast<uint32_t>(at * parts));
    before += static_cast<long double>(weights[i]);
  }
  return run;
}

// New pipeline stage of every held tensor (parallel to `held`, which is in (stage, name) order).
std::vector<uint32_t> NewStages(const std::vector<Held>& held, uint32_t old_pp, uint32_t pp) {
  std::vector<uint32_t> stage(held.size());
  if (pp % old_pp == 0) {
    const uint32_t k = pp / old_pp;
    for (size_t i = 0; i < held.size();) {
      size_t j = i;
      std::vector<uint64_t> weights;
      while (j < held.size() && held[j].stage == held[i].stage) weights.push_back(held[j++].bytes);
      std::vector<uint32_t> run = CutByBytes(weights, k);
      for (size_t m = i; m < j; ++m) stage[m] = held[i].stage * k + run[m - i];
      i = j;
    }
  } else if (old_pp % pp == 0) {
    for (size_t i = 0; i < held.size(); ++i) stage[i] = held[i].stage / (old_pp / pp);
  } else {
    std::vector<uint64_t> weights;
    for (const Held& h : held) weights.push_back(h.bytes);
    stage = CutByBytes(weights, pp);
  }
  return stage;
}

// The piece of `h` that rank (tp, shard) writes, or nullopt.
std::optional<TensorSpec> PieceFor(const Held& h, uint32_t tp, uint32_t tp_degree, uint32_t shard,
                                   uint32_t shard_degree) {
  TensorSpec s;
  s.name = h.key;
  s.kind = h.kind;
  s.dtype = h.dtype;
  s.global_shape = h.global_shape;
  s.box_offset.assign(h.global_shape.size(), 0);
  s.box_shape = h.global_shape;
  if (h.split_dim && tp_degree > 1) {
    const size_t d = *h.split_dim;
    const uint64_t size = h.global_shape[d], block = (size + tp_degree - 1) / tp_degree, first = tp * block;
    if (first >= size) return std::nullopt;
    s.box_offset[d] = first;
    s.box_shape[d] = std::min(block, size - first);
  } else if (tp != 0) {
    return std::nullopt;  // held whole: written by tp rank 0
  }
  s.shape = s.box_shape;
  const bool sharded =
      (h.kind == TensorKind::kOptimizer || h.kind == TensorKind::kMasterWeight) && (shard_degree > 1 || h.flat);
  const uint64_t n = Numel(s.box_shape);
  if (!sharded || n == 0) {
    if (shard != 0) return std::nullopt;
    return s;
  }
  const uint64_t chunk = (n + shard_degree - 1) / shard_degree, begin = uint64_t{shard} * chunk;
  if (begin >= n) return std::nullopt;
  const uint64_t end = std::min(n, begin + chunk);
  s.flat_range = FlatRange{begin, end};
  s.shape = {end - begin};
  return s;
}

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

uint64_t AlignUp(uint64_t v) { return (v + kPageSize - 1) / kPageSize * kPageSize; }

Status PrepareDestination(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0755) == 0) return Status::OK();
  if (errno != EEXIST) return ErrnoStatus("mkdir", dir);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return ErrnoStatus("stat", dir);
  if (!S_ISDIR(st.st_mode)) return AlreadyExists(dir + " exists and is not a directory");
  ASSIGN_OR_RETURN(auto names, ListDir(dir));
  if (!names.empty()) return AlreadyExists(dir + " is not empty: the resharded checkpoint needs a new directory");
  return Status::OK();
}

// Fills one layout of a new rank from the source, stamps and writes its files into `dst`.
Status WriteLayout(const std::string& src, const CheckpointMetadata& meta, const RankLayout& layout, bool ema,
                   const std::string& dst, ParallelLoop* loop, std::vector<std::string>* names,
                   RelayoutReport* report) {
  std::unique_ptr<char, FreeDeleter> slot(static_cast<char*>(std::aligned_alloc(kPageSize, layout.slot_bytes)));
  if (!slot)
    return ResourceExhausted("cannot allocate " + std::to_string(layout.slot_bytes) + " bytes for rank " +
                             std::to_string(layout.rank) + "'s files");
  std::memset(slot.get(), 0, layout.slot_bytes);
  InitSlotImages(slot.get(), layout);
  FillOptions options;
  options.loop = loop;
  options.headers_checked = true;  // all of them, by RelayoutCheckpoint
  ASSIGN_OR_RETURN(FillStats stats, FillSlotFromCheckpoint(src, meta, layout, slot.get(), options));
  report->bytes_read += stats.bytes_read;
  for (size_t f = 0; f < layout.files.size(); ++f) {
    StampImage(slot.get(), layout, f, meta.step);
    if (ema) {
      StampEmaCounters(slot.get(), layout, f, meta.ema->updates_applied, meta.ema->updates_skipped,
                       meta.ema->last_step);
    }
    const FileImage& image = layout.files[f];
    const std::string name = image.stem + ".safetensors";
    RETURN_IF_ERROR(
        WriteImageDurably(dst, name, slot.get() + image.slot_offset, image.file_bytes(), AlignUp(image.file_bytes())));
    names->push_back(name);
    report->files += 1;
    report->bytes_written += image.file_bytes();
  }
  return Status::OK();
}

}  // namespace

Result<std::vector<NewRank>> PlanNewLayout(const CheckpointMetadata& meta, const Degrees& degrees) {
  if (degrees.tp == 0 || degrees.pp == 0 || degrees.shard == 0) return InvalidArgument("degrees must be at least 1");
  const uint64_t world = uint64_t{degrees.tp} * degrees.pp * degrees.shard;
  if (world > kMaxNewRanks)
    return InvalidArgument("tp * pp * shard = " + std::to_string(world) + " ranks: at most 65536");
  if (meta.topology.pp_degree == 0) return Corruption("the checkpoint's pp_degree is 0");
  const std::vector<Held> held = Gather(meta);
  const std::vector<uint32_t> stage = NewStages(held, meta.topology.pp_degree, degrees.pp);
  std::vector<NewRank> out;
  for (uint32_t r = 0; r < world; ++r) {
    NewRank nr;
    nr.rank = r;
    nr.topology =
        Topology{static_cast<uint32_t>(world),  r % degrees.tp, degrees.tp, (r / degrees.tp) % degrees.pp, degrees.pp,
                 r / (degrees.tp * degrees.pp), degrees.shard};
    for (size_t i = 0; i < held.size(); ++i) {
      if (stage[i] != nr.topology.pp_rank) continue;
      auto piece = PieceFor(held[i], nr.topology.tp_rank, degrees.tp, nr.topology.shard_rank, degrees.shard);
      if (!piece) continue;
      (held[i].kind == TensorKind::kEma ? nr.ema : nr.tensors).push_back(std::move(*piece));
    }
    out.push_back(std::move(nr));
  }
  return out;
}

Status RelayoutCheckpoint(const std::string& src, const std::string& dst, const Degrees& degrees,
                          uint64_t checksum_chunk, ParallelLoop* loop, RelayoutReport* report,
                          const std::function<void(const NewRank&, const RelayoutReport&)>& progress) {
  RelayoutReport local;
  if (report == nullptr) report = &local;
  *report = RelayoutReport{};
  RETURN_IF_ERROR(ValidateChecksumChunk(checksum_chunk));
  auto read = ReadMetadataFile(src);
  if (!read.ok()) {
    if (read.status().code() == StatusCode::kNotFound) {
      return NotFound(src + " has no metadata.json: only a complete checkpoint can be resharded");
    }
    return read.status();
  }
  const CheckpointMetadata meta = std::move(read).value();
  ASSIGN_OR_RETURN(std::vector<NewRank> ranks, PlanNewLayout(meta, degrees));
  // A reshard reads the whole checkpoint: every file's header is checked against metadata.json
  // once, here, before the destination is created, so a misplaced piece is refused with nothing
  // written.
  RETURN_IF_ERROR(CheckFileHeaders(src, meta));
  RETURN_IF_ERROR(PrepareDestination(dst));

  std::vector<std::string> names;
  LayoutExtras plain;
  plain.checksum_chunk = checksum_chunk;
  size_t rank_names = 0;
  for (const NewRank& nr : ranks) {
    const uint32_t files_before = report->files;
    const uint64_t bytes_before = report->bytes_written;
    if (!nr.tensors.empty()) {
      ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout(meta.job, nr.rank, nr.topology, nr.tensors, plain));
      RETURN_IF_ERROR(WriteLayout(src, meta, layout, /*ema=*/false, dst, loop, &names, report));
    }
    if (!nr.ema.empty()) {
      if (!meta.ema) return Corruption(src + ": EMA tensors without an EMA record in metadata.json");
      ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout(meta.job, nr.rank, nr.topology, nr.ema,
                                                          EmaFileExtras(*meta.ema, checksum_chunk)));
      RETURN_IF_ERROR(WriteLayout(src, meta, layout, /*ema=*/true, dst, loop, &names, report));
    }
    if (report->files > files_before) report->ranks += 1;
    // Every rank of the new layout signals, also one that holds nothing, as a saving rank would.
    Signal signal;
    signal.rank = nr.rank;
    signal.step = meta.step;
    signal.node = DefaultNodeName();  // the host that rewrote it
    signal.world_size = nr.topology.world_size;
    signal.files.assign(names.begin() + rank_names, names.end());
    rank_names = names.size();
    RETURN_IF_ERROR(WriteFileDurably(dst, SignalFileName(nr.rank),
                                     EncodeSignal(meta.job, signal, report->bytes_written - bytes_before)));
    if (progress) progress(nr, *report);
  }
  ASSIGN_OR_RETURN(CheckpointMetadata out, BuildMetadataFromFiles(dst, names));
  if (out.job != meta.job || out.step != meta.step) {
    return Internal("the rewritten files describe job '" + out.job + "' step " + std::to_string(out.step));
  }
  return WriteMetadataFiles(dst, out);
}

}  // namespace flashckpt

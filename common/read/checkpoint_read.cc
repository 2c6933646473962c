#include "common/read/checkpoint_read.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <vector>

#include "common/base/dtype.h"
#include "common/base/mutex.h"
#include "common/format/checksum.h"
#include "common/format/safetensors.h"
#include "common/io/fs.h"
#include "common/read/header_check.h"
#include "common/read/reshard.h"

namespace flashckpt {
namespace {

// Reads go in blocks of at most this size (for a piece read in part, through a buffer of it).
constexpr uint64_t kReadBuffer = 4u << 20;
// Whole pieces are read straight into the slot in blocks of this size, each hashed right after it
// is read, while it is still in the core's cache.
constexpr uint64_t kDirectBlock = 1u << 20;
// Whole-piece reads are merged into tasks of about this size, cut at piece boundaries or, inside a
// piece verified by its chunks, at chunk boundaries, so that a large file, and a large tensor, is
// read and verified by several threads.
constexpr uint64_t kTaskBytes = 4u << 20;

// A part of a saved piece that goes to a different place in the new layout.
struct Scatter {
  uint64_t file_offset;
  char* dest;
  uint64_t bytes;
};

// File bytes [begin, end) of adjacent whole saved pieces, read straight into place (same layout)
// and verified. `begin` and `end` are piece boundaries, or chunk boundaries of a piece whose whole
// checksum derives from its chunks (Piece::whole_from_chunks), which is then verified chunk by chunk.
struct DirectRead {
  IoEnv* io;
  int fd;
  const std::string* path;
  char* dest;  // where file byte `begin` goes
  uint64_t begin, end;
  std::vector<const Piece*> pieces;  // those [begin, end) covers, adjacent in the file and in the slot
};

// The parts of one saved piece that tensors in another layout need.
struct PartialRead {
  IoEnv* io;
  int fd;
  const std::string* path;
  const Piece* piece;
  std::vector<Scatter> parts;
};

// A tensor read in the checkpoint's fp32 into `staging`, narrowed into the slot at the end.
struct Conversion {
  std::unique_ptr<char[]> staging;
  uint64_t elements;
  DType to;
  char* dest;
};

struct Counters {
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> reads{0};
};

Status ChecksumMismatch(const std::string& path, const Piece& p, std::optional<size_t> chunk, uint64_t got,
                        uint64_t want) {
  std::string what =
      chunk ? "chunk " + std::to_string(*chunk) + " of tensor '" + p.key + "'" : "tensor '" + p.key + "'";
  return Corruption(path + ": " + what + " has checksum " + ChecksumHex(got) + ", the checkpoint records " +
                    ChecksumHex(want));
}

// Reads the run in blocks straight into the slot and hashes each block while it is still in
// cache, so verifying costs no second pass over memory. The checksum units are the chunks of a
// piece verified by its chunks, else whole pieces.
Status RunDirect(const DirectRead& r, Counters& counters) {
  Xxh3Stream hash;
  size_t piece = 0;  // the piece whose bytes come next
  // The unit being hashed: chunk `chunk` of the piece when `per_chunk`, else all of it.
  bool per_chunk = false;
  size_t chunk = 0;
  uint64_t unit_end = 0, want = 0;
  auto begin_unit = [&](uint64_t at) {
    const Piece& p = *r.pieces[piece];
    per_chunk = p.whole_from_chunks;
    if (per_chunk) {
      chunk = static_cast<size_t>((at - p.begin) / p.chunk_bytes);
      unit_end = std::min(p.end, p.begin + (chunk + 1) * p.chunk_bytes);
      want = p.chunk_xxh3[chunk];
    } else {
      chunk = 0;
      unit_end = p.end;
      want = p.xxh3;
    }
    hash.Reset();
  };
  begin_unit(r.begin);
  for (uint64_t pos = r.begin; pos < r.end;) {
    const uint64_t n = std::min(kDirectBlock, r.end - pos);
    char* block = r.dest + (pos - r.begin);
    RETURN_IF_ERROR(PreadFull(r.fd, block, n, pos, *r.path, r.io));
    counters.bytes_read += n;
    counters.reads += 1;
    for (uint64_t off = pos; off < pos + n;) {
      const uint64_t take = std::min(unit_end, pos + n) - off;
      hash.Update(block + (off - pos), take);
      off += take;
      if (off != unit_end) continue;
      if (hash.Digest() != want) {
        return ChecksumMismatch(*r.path, *r.pieces[piece], per_chunk ? std::optional<size_t>(chunk) : std::nullopt,
                                hash.Digest(), want);
      }
      if (off == r.end) break;
      if (off == r.pieces[piece]->end) ++piece;
      begin_unit(off);
    }
    pos += n;
  }
  return Status::OK();
}

// Reads the checksum units (chunks, or the whole piece if it has a single checksum) that hold the
// needed parts, verifies each unit, and copies the parts out.
Status RunPartial(PartialRead& r, Counters& counters) {
  const Piece& p = *r.piece;
  std::sort(r.parts.begin(), r.parts.end(),
            [](const Scatter& a, const Scatter& b) { return a.file_offset < b.file_offset; });
  const bool chunked = !p.chunk_xxh3.empty();
  const uint64_t unit = chunked ? p.chunk_bytes : p.end - p.begin;
  // Needed units as runs [first, last) of unit indices.
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  for (const Scatter& s : r.parts) {
    if (s.bytes == 0) continue;
    uint64_t first = (s.file_offset - p.begin) / unit, last = (s.file_offset + s.bytes - 1 - p.begin) / unit + 1;
    if (!runs.empty() && first <= runs.back().second) {
      runs.back().second = std::max(runs.back().second, last);
    } else {
      runs.emplace_back(first, last);
    }
  }
  const uint64_t buffer_bytes = std::min(kReadBuffer, p.end - p.begin);
  std::unique_ptr<char[]> buffer(new (std::nothrow) char[buffer_bytes]);
  if (!buffer) return ResourceExhausted("cannot allocate a read buffer of " + std::to_string(buffer_bytes) + " bytes");
  Xxh3Stream hash;
  size_t next = 0;  // first part that may still intersect what is read next
  for (auto [first, last] : runs) {
    const uint64_t lo = p.begin + first * unit, hi = std::min(p.end, p.begin + last * unit);
    uint64_t u = first, unit_end = std::min(p.end, lo + unit);
    hash.Reset();
    for (uint64_t pos = lo; pos < hi;) {
      const uint64_t n = std::min(buffer_bytes, hi - pos);
      RETURN_IF_ERROR(PreadFull(r.fd, buffer.get(), n, pos, *r.path, r.io));
      counters.bytes_read += n;
      counters.reads += 1;
      for (uint64_t off = pos; off < pos + n;) {
        const uint64_t take = std::min(unit_end, pos + n) - off;
        hash.Update(buffer.get() + (off - pos), take);
        off += take;
        if (off == unit_end) {
          const uint64_t want = chunked ? p.chunk_xxh3[u] : p.xxh3;
          if (hash.Digest() != want) {
            return ChecksumMismatch(*r.path, p, chunked ? std::optional<size_t>(u) : std::nullopt, hash.Digest(), want);
          }
          hash.Reset();
          ++u;
          unit_end = std::min(p.end, unit_end + unit);
        }
      }
      // Parts do not overlap (each needed element is read once), so sorted by offset they also end
      // in order: skip those that ended before this buffer, copy those that intersect it.
      while (next < r.parts.size() && r.parts[next].file_offset + r.parts[next].bytes <= pos) ++next;
      for (size_t k = next; k < r.parts.size() && r.parts[k].file_offset < pos + n; ++k) {
        const Scatter& s = r.parts[k];
        uint64_t from = std::max(s.file_offset, pos), to = std::min(s.file_offset + s.bytes, pos + n);
        if (from < to) std::memcpy(s.dest + (from - s.file_offset), buffer.get() + (from - pos), to - from);
      }
      pos += n;
    }
  }
  return Status::OK();
}

bool SameGeometry(const TensorSpec& t, const Piece& p) {
  if (t.kind != p.kind || t.dtype != p.dtype || t.global_shape != p.global_shape || t.box_offset != p.box_offset ||
      t.box_shape != p.box_shape || t.flat_range.has_value() != p.flat_range.has_value()) {
    return false;
  }
  return !t.flat_range || (t.flat_range->begin == p.flat_range->begin && t.flat_range->end == p.flat_range->end);
}

// The checkpoint's files, each opened once, on first use, before any data is read, and read by any
// thread with pread. Its header is checked against metadata.json first (unless the caller checked
// it already): the reads are planned from where metadata.json says each piece lies and goes, which
// no checksum covers.
class CheckpointFiles {
 public:
  CheckpointFiles(const std::string& dir, const CheckpointMetadata& meta, const FillOptions& options,
                  RecordedFiles recorded)
      : dir_(dir), meta_(meta), options_(options), recorded_(std::move(recorded)) {}

  // The fd and path of the file called `name`, opened (and its header checked) on the first call.
  Result<std::pair<int, const std::string*>> Open(const std::string& name) {
    auto it = files_.find(name);
    if (it == files_.end()) {
      std::string path = dir_ + "/" + name;
      ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(path, options_.io));
      if (!options_.headers_checked) {
        ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(fd.get(), path, options_.io));
        RETURN_IF_ERROR(CheckFileHeader(path, name, header, meta_, recorded_[name]).status());
      }
      it = files_.emplace(name, std::make_pair(std::move(path), std::move(fd))).first;
    }
    return std::pair<int, const std::string*>(it->second.second.get(), &it->second.first);
  }

 private:
  const std::string& dir_;
  const CheckpointMetadata& meta_;
  const FillOptions& options_;
  RecordedFiles recorded_;
  std::map<std::string, std::pair<std::string, UniqueFd>> files_;  // name -> (path, fd)
};

// A saved piece read whole straight into its place in the slot.
struct Whole {
  const Piece* piece;
  char* dest;
};

// The reads that fill a slot, tensor by tensor, before they are cut into tasks.
struct FillPlan {
  std::vector<Whole> whole;                              // same layout: whole pieces straight into place
  std::map<const Piece*, std::vector<Scatter>> partial;  // other layouts: parts of saved pieces
  std::vector<Conversion> conversions;
};

// Plans tensor `t`, `slot_bytes` bytes at `slot_dest`, from parts of the saved `candidates`, when
// none of them matches it whole.
Status PlanPartialTensor(const TensorSpec& t, uint64_t slot_bytes, const std::vector<const Piece*>& candidates,
                         char* slot_dest, const FillOptions& options, FillPlan* plan) {
  // Another layout, or another dtype: plan the reads by intersecting this rank's piece with the
  // saved ones. A conversion reads the saved fp32 values into staging memory first.
  char* dest = slot_dest;
  TensorSpec want = t;
  const DType saved = candidates.front()->dtype;
  if (saved != t.dtype && options.convert_dtype && saved == DType::kF32 && CanNarrowF32(t.dtype)) {
    const uint64_t elements = slot_bytes / DTypeSize(t.dtype);
    std::unique_ptr<char[]> staging(new (std::nothrow) char[elements * sizeof(float)]);
    if (!staging) return ResourceExhausted("cannot allocate fp32 staging memory for tensor '" + t.name + "'");
    want.dtype = saved;
    dest = staging.get();
    plan->conversions.push_back({std::move(staging), elements, t.dtype, slot_dest});
  }
  auto planned = PlanPieceReads(want, candidates);
  if (!planned.ok()) {
    // The layout's specs are valid: a refused plan means the checkpoint does not hold what this
    // rank asks for (another dtype or global shape), not a malformed request.
    Status s = planned.status();
    if (s.code() == StatusCode::kInvalidArgument) {
      std::string hint = saved != t.dtype && saved == DType::kF32 && CanNarrowF32(t.dtype)
                             ? " (ask for dtype conversion to narrow fp32 to " + std::string(DTypeName(t.dtype)) + ")"
                             : "";
      s = FailedPrecondition(s.message() + hint);
    }
    return s.WithContext("restoring into a different layout");
  }
  for (const ReadRun& run : planned->runs) {
    plan->partial[candidates[run.piece]].push_back({run.file_offset, dest + run.dest_offset, run.bytes});
  }
  return Status::OK();
}

// Plans the reads of tensor `i` of `layout` from the saved pieces of its name and kind: the one
// piece of the same geometry and size whole, else parts of them. kNotFound when none is saved.
Status PlanTensor(const std::string& dir, const RankLayout& layout, size_t i,
                  const std::multimap<std::string, const Piece*>& by_key, char* slot, const FillOptions& options,
                  FillPlan* plan) {
  const TensorSpec& t = layout.tensors[i];
  char* dest = slot + layout.placements[i].slot_offset;
  auto [lo, hi] = by_key.equal_range(t.name);
  std::vector<const Piece*> candidates;
  const Piece* match = nullptr;
  for (auto it = lo; it != hi; ++it) {
    if (it->second->kind != t.kind) continue;  // e.g. the EMA twin of a model weight
    candidates.push_back(it->second);
    // The byte size is checked too: metadata.json is untrusted, and a whole piece is read straight
    // into the tensor's place in the slot.
    if (match == nullptr && SameGeometry(t, *it->second) &&
        it->second->end - it->second->begin == layout.placements[i].bytes) {
      match = it->second;
    }
  }
  if (candidates.empty()) {
    return NotFound("tensor '" + t.name + "' (" + std::string(TensorKindName(t.kind)) + ") is not in the checkpoint " +
                    dir);
  }
  if (match != nullptr) {
    plan->whole.push_back({match, dest});
    return Status::OK();
  }
  return PlanPartialTensor(t, layout.placements[i].bytes, candidates, dest, options, plan);
}

// Whole pieces: sorted by file and offset, merged while adjacent in both the file and the slot,
// cut into tasks of about kTaskBytes at piece boundaries.
Result<std::vector<DirectRead>> CutDirectReads(std::vector<Whole>* whole, CheckpointFiles* files, IoEnv* io) {
  std::sort(whole->begin(), whole->end(), [](const Whole& a, const Whole& b) {
    return a.piece->file != b.piece->file ? a.piece->file < b.piece->file : a.piece->begin < b.piece->begin;
  });
  std::vector<DirectRead> direct;
  for (const Whole& w : *whole) {
    const Piece* p = w.piece;
    const uint64_t bytes = p->end - p->begin;
    if (p->whole_from_chunks && bytes > kTaskBytes) {
      // A large piece verified by its chunks: tasks of whole chunks, read and verified in parallel.
      ASSIGN_OR_RETURN(auto fd, files->Open(p->file));
      const uint64_t step = std::max<uint64_t>(1, kTaskBytes / p->chunk_bytes) * p->chunk_bytes;
      for (uint64_t at = p->begin; at < p->end; at += step) {
        direct.push_back({io, fd.first, fd.second, w.dest + (at - p->begin), at, std::min(p->end, at + step), {p}});
      }
      continue;
    }
    if (!direct.empty()) {
      DirectRead& last = direct.back();
      const Piece* prev = last.pieces.back();
      const bool adjacent = prev->file == p->file && prev->end == p->begin && last.end == p->begin &&
                            w.dest == last.dest + (p->begin - last.begin);
      if (adjacent && p->end - last.begin <= kTaskBytes) {
        last.pieces.push_back(p);
        last.end = p->end;
        continue;
      }
    }
    ASSIGN_OR_RETURN(auto fd, files->Open(p->file));
    direct.push_back({io, fd.first, fd.second, w.dest, p->begin, p->end, {p}});
  }
  return direct;
}

// Runs every direct and partial read as one task of `loop` (nullptr: on the caller's thread);
// returns the first error.
Status RunReads(std::vector<DirectRead>& direct, std::vector<PartialRead>& parts, ParallelLoop* loop,
                Counters& counters) {
  Mutex error_mu;
  Status first_error;
  auto task = [&](size_t k) {
    Status s = k < direct.size() ? RunDirect(direct[k], counters) : RunPartial(parts[k - direct.size()], counters);
    if (!s.ok()) {
      MutexLock lock(&error_mu);
      if (first_error.ok()) first_error = s;
    }
  };
  const size_t tasks = direct.size() + parts.size();
  if (loop != nullptr) {
    loop->Run(tasks, task);
  } else {
    for (size_t k = 0; k < tasks; ++k) task(k);
  }
  return first_error;
}

}  // namespace

Result<FillStats> FillSlotFromCheckpoint(const std::string& dir, const CheckpointMetadata& meta,
                                         const RankLayout& layout, char* slot, const FillOptions& options) {
  std::multimap<std::string, const Piece*> by_key;
  for (const auto& p : meta.pieces) by_key.emplace(p.key, &p);
  RecordedFiles recorded;
  if (!options.headers_checked) {
    ASSIGN_OR_RETURN(recorded, GroupPiecesByFile(dir, meta));
  }
  CheckpointFiles files(dir, meta, options, std::move(recorded));

  FillPlan plan;
  FillStats stats;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const TensorSpec& t = layout.tensors[i];
    if (!options.kinds.empty() &&
        std::find(options.kinds.begin(), options.kinds.end(), t.kind) == options.kinds.end()) {
      continue;  // not asked for: its slot bytes stay as they are
    }
    stats.bytes_needed += layout.placements[i].bytes;
    RETURN_IF_ERROR(PlanTensor(dir, layout, i, by_key, slot, options, &plan));
  }

  ASSIGN_OR_RETURN(std::vector<DirectRead> direct, CutDirectReads(&plan.whole, &files, options.io));
  std::vector<PartialRead> parts;
  for (auto& [piece, scatter] : plan.partial) {
    ASSIGN_OR_RETURN(auto fd, files.Open(piece->file));
    parts.push_back({options.io, fd.first, fd.second, piece, std::move(scatter)});
  }

  Counters counters;
  RETURN_IF_ERROR(RunReads(direct, parts, options.loop, counters));
  for (const Conversion& c : plan.conversions) {
    NarrowF32(reinterpret_cast<const float*>(c.staging.get()), c.elements, c.to, c.dest);
  }
  stats.bytes_read = counters.bytes_read;
  stats.reads = counters.reads;
  return stats;
}

}  // namespace flashckpt

#include "common/read/reshard.h"

#include <algorithm>
#include <string>
#include <utility>

#include "common/base/dtype.h"
#include "common/format/layout.h"

namespace flashckpt {
namespace {

std::string Dims(const std::vector<uint64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

// Where a piece's local elements sit in the global tensor. A 0-d tensor is treated as the 1-d
// tensor [1], so every region has at least one dimension and a last dimension to cut rows along.
struct Region {
  std::vector<uint64_t> offset;
  std::vector<uint64_t> shape;
  uint64_t flat_begin = 0;  // box-flat index of local element 0
  uint64_t flat_end = 0;
};

// A saved piece that may hold wanted elements, with what the segment walk needs precomputed.
struct Candidate {
  size_t index = 0;  // into `saved`
  Region region;
  std::vector<uint64_t> row_stride;  // rows of the box per step in each leading dimension
  uint64_t begin = 0;                // absolute file offset of local element 0
};

// Checks that the box lies in the global tensor and the flat range in the box, and builds the
// region; `count` gets the number of local elements. Every later product of the planner is bounded
// by a box's element count, which is checked here not to overflow.
Status MakeRegion(const std::vector<uint64_t>& global, const std::vector<uint64_t>& offset,
                  const std::vector<uint64_t>& shape, const std::optional<FlatRange>& flat, Region* region,
                  uint64_t* count) {
  if (offset.size() != global.size() || shape.size() != global.size()) {
    return InvalidArgument("box offset " + Dims(offset) + " and shape " + Dims(shape) +
                           " do not have the rank of the global shape " + Dims(global));
  }
  uint64_t numel = 1;
  for (size_t d = 0; d < global.size(); ++d) {
    uint64_t end;
    if (__builtin_add_overflow(offset[d], shape[d], &end) || end > global[d]) {
      return InvalidArgument("box offset " + Dims(offset) + " shape " + Dims(shape) + " leaves the global shape " +
                             Dims(global));
    }
    if (__builtin_mul_overflow(numel, shape[d], &numel)) {
      return InvalidArgument("box shape " + Dims(shape) + " has more than 2^64 elements");
    }
  }
  region->offset = offset;
  region->shape = shape;
  if (global.empty()) {
    region->offset = {0};
    region->shape = {1};
  }
  region->flat_begin = 0;
  region->flat_end = numel;
  if (flat) {
    if (flat->begin > flat->end || flat->end > numel) {
      return InvalidArgument("flat range [" + std::to_string(flat->begin) + ", " + std::to_string(flat->end) +
                             ") is not inside the box of " + std::to_string(numel) + " elements");
    }
    region->flat_begin = flat->begin;
    region->flat_end = flat->end;
  }
  *count = region->flat_end - region->flat_begin;
  return Status::OK();
}

// True when the boxes of `a` and `b` overlap (both non-empty).
bool BoxesOverlap(const Region& a, const Region& b) {
  for (size_t d = 0; d < a.shape.size(); ++d) {
    uint64_t lo = std::max(a.offset[d], b.offset[d]);
    uint64_t hi = std::min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d]);
    if (lo >= hi) return false;
  }
  return true;
}

Result<std::vector<Candidate>> CheckSavedPieces(const TensorSpec& want, const Region& want_region,
                                                const std::vector<const Piece*>& saved) {
  const std::string tensor = "tensor '" + want.name + "'";
  const uint64_t elem = DTypeSize(want.dtype);
  std::vector<Candidate> candidates;
  for (size_t i = 0; i < saved.size(); ++i) {
    const Piece* p = saved[i];
    if (p == nullptr) return InvalidArgument(tensor + ": saved piece " + std::to_string(i) + " is null");
    if (p->key != want.name) {
      return InvalidArgument(tensor + ": saved piece " + std::to_string(i) + " in file '" + p->file +
                             "' belongs to tensor '" + p->key + "'");
    }
    if (p->dtype != want.dtype) {
      return InvalidArgument(tensor + ": restore wants dtype " + std::string(DTypeName(want.dtype)) + " but file '" +
                             p->file + "' saved it as " + std::string(DTypeName(p->dtype)) +
                             "; register the tensor with the saved dtype and convert after restore");
    }
    if (p->global_shape != want.global_shape) {
      return InvalidArgument(tensor + ": restore wants global shape " + Dims(want.global_shape) + " but file '" +
                             p->file + "' saved it with global shape " + Dims(p->global_shape) +
                             "; resharding keeps the global shape");
    }
    Candidate c;
    c.index = i;
    c.begin = p->begin;
    uint64_t count = 0;
    Status s = MakeRegion(p->global_shape, p->box_offset, p->box_shape, p->flat_range, &c.region, &count);
    if (!s.ok()) return Corruption(tensor + ": saved piece in file '" + p->file + "': " + s.message());
    uint64_t bytes;
    if (__builtin_mul_overflow(count, elem, &bytes) || p->begin > p->end || p->end - p->begin != bytes) {
      return Corruption(tensor + ": saved piece in file '" + p->file + "' has bytes [" + std::to_string(p->begin) +
                        ", " + std::to_string(p->end) + ") but holds " + std::to_string(count) + " elements of " +
                        std::to_string(elem) + " bytes");
    }
    if (count == 0 || !BoxesOverlap(c.region, want_region)) continue;
    const size_t lead = c.region.shape.size() - 1;
    c.row_stride.assign(lead, 1);
    for (size_t d = lead; d-- > 1;) c.row_stride[d - 1] = c.row_stride[d] * c.region.shape[d];
    candidates.push_back(std::move(c));
  }
  return candidates;
}

struct Interval {
  uint64_t lo, hi;
};

// Appends `run` to `runs`, extending the last run when both continue it.
void AppendMerged(std::vector<ReadRun>* runs, const ReadRun& run) {
  if (!runs->empty()) {
    ReadRun& last = runs->back();
    if (last.piece == run.piece && last.file_offset + last.bytes == run.file_offset &&
        last.dest_offset + last.bytes == run.dest_offset) {
      last.bytes += run.bytes;
      return;
    }
  }
  runs->push_back(run);
}

// Covers what it can of the wanted row segment, columns [j0, j1) of the row whose leading
// coordinates are `row` (local element `dest0` at j0), from candidate `c`: appends the reads to
// `runs` and takes what they cover out of `uncovered` (`next` is scratch).
void CoverFromPiece(const Candidate& c, const std::vector<uint64_t>& row, uint64_t j0, uint64_t j1, uint64_t dest0,
                    uint64_t elem, std::vector<Interval>* uncovered, std::vector<Interval>* next,
                    std::vector<ReadRun>* runs) {
  const size_t last = row.size();
  const Region& pr = c.region;
  uint64_t prow = 0;  // row of the piece's box holding this row
  bool holds = true;
  for (size_t d = 0; d < last; ++d) {
    if (row[d] < pr.offset[d] || row[d] >= pr.offset[d] + pr.shape[d]) {
      holds = false;
      break;
    }
    prow += (row[d] - pr.offset[d]) * c.row_stride[d];
  }
  if (!holds) return;
  const uint64_t poff = pr.offset[last];
  const uint64_t pwidth = pr.shape[last];
  uint64_t a = std::max(j0, poff);
  uint64_t b = std::min(j1, poff + pwidth);
  if (a >= b) return;
  // Box-flat indices of columns a and b in the piece, clipped to its flat range.
  const uint64_t row_start = prow * pwidth;
  const uint64_t fa = std::max(row_start + (a - poff), pr.flat_begin);
  const uint64_t fb = std::min(row_start + (b - poff), pr.flat_end);
  if (fa >= fb) return;
  a = poff + (fa - row_start);
  b = poff + (fb - row_start);

  next->clear();
  for (const Interval& u : *uncovered) {
    const uint64_t x = std::max(u.lo, a);
    const uint64_t y = std::min(u.hi, b);
    if (x >= y) {
      next->push_back(u);
      continue;
    }
    const uint64_t local = row_start + (x - poff) - pr.flat_begin;
    runs->push_back(ReadRun{c.index, c.begin + local * elem, (dest0 + (x - j0)) * elem, (y - x) * elem});
    if (u.lo < x) next->push_back(Interval{u.lo, x});
    if (y < u.hi) next->push_back(Interval{y, u.hi});
  }
  uncovered->swap(*next);
}

}  // namespace

Result<ReshardPlan> PlanPieceReads(const TensorSpec& want_in, const std::vector<const Piece*>& saved) {
  ASSIGN_OR_RETURN(TensorSpec want, NormalizeTensorSpec(want_in));
  const std::string tensor = "tensor '" + want.name + "'";
  Region want_region;
  uint64_t want_count = 0;
  Status s = MakeRegion(want.global_shape, want.box_offset, want.box_shape, want.flat_range, &want_region, &want_count);
  if (!s.ok()) return InvalidArgument(tensor + ": wanted piece: " + s.message());
  ASSIGN_OR_RETURN(std::vector<Candidate> candidates, CheckSavedPieces(want, want_region, saved));

  const uint64_t elem = DTypeSize(want.dtype);
  ReshardPlan plan;
  if (want_count == 0) return plan;
  // NormalizeTensorSpec checked that the wanted byte count fits in 64 bits.
  plan.bytes = want_count * elem;

  const size_t rank = want_region.shape.size();  // >= 1
  const size_t last = rank - 1;
  const uint64_t width = want_region.shape[last];  // > 0 since want_count > 0

  // Global coordinates of the current row's leading dimensions.
  std::vector<uint64_t> row(last);
  uint64_t f = want_region.flat_begin;
  {
    uint64_t r = f / width;
    for (size_t d = last; d-- > 0;) {
      row[d] = want_region.offset[d] + r % want_region.shape[d];
      r /= want_region.shape[d];
    }
  }

  std::vector<Interval> uncovered, next;
  std::vector<ReadRun> segment_runs;
  while (f < want_region.flat_end) {
    const uint64_t col = f % width;
    const uint64_t n = std::min(width - col, want_region.flat_end - f);
    const uint64_t j0 = want_region.offset[last] + col;
    const uint64_t j1 = j0 + n;
    const uint64_t dest0 = f - want_region.flat_begin;  // local element index of column j0

    uncovered.assign(1, Interval{j0, j1});
    segment_runs.clear();
    for (const Candidate& c : candidates) {
      CoverFromPiece(c, row, j0, j1, dest0, elem, &uncovered, &next, &segment_runs);
      if (uncovered.empty()) break;
    }
    if (!uncovered.empty()) {
      std::vector<uint64_t> pos = row;
      if (!want.global_shape.empty()) pos.push_back(uncovered.front().lo);
      return NotFound(tensor + ": no saved piece holds the element at global position " + Dims(pos) +
                      " of global shape " + Dims(want.global_shape) + " (" + std::to_string(saved.size()) +
                      " pieces saved); the checkpoint does not cover the wanted box offset " + Dims(want.box_offset) +
                      " shape " + Dims(want.box_shape));
    }
    std::sort(segment_runs.begin(), segment_runs.end(),
              [](const ReadRun& x, const ReadRun& y) { return x.dest_offset < y.dest_offset; });
    for (const ReadRun& run : segment_runs) AppendMerged(&plan.runs, run);

    f += n;
    for (size_t d = last; d-- > 0;) {
      if (++row[d] < want_region.offset[d] + want_region.shape[d]) break;
      row[d] = want_region.offset[d];
    }
  }
  return plan;
}

}  // namespace flashckpt

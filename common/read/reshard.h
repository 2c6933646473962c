// The read planner of a resharding restore: which byte ranges of which saved pieces fill a tensor
// that a rank wants in a parallel layout different from the one that saved it.
//
// A tensor has a global shape G (rank r <= 8, row-major). A piece, saved or wanted, covers the box
// `box_offset` + `box_shape` of the global tensor; its local bytes are the whole box in row-major
// order or, with a flat range [b, e), the elements b..e-1 of the row-major flattening of the box
// (local element k is box-flat element b + k). A saved piece's bytes lie in its file at
// [begin, end).
//
// The planner walks the wanted elements as row segments: maximal runs of consecutive local
// elements that are also consecutive along the last dimension of one row of the global tensor (a
// flat range is cut at the rows of its box). Each segment is intersected with every saved piece
// that holds its row: the piece's box clips the last-dimension interval, its flat range clips it
// further (an interval of box-flat indices is an interval of columns within one row). The parts
// of the segment that no earlier piece covered are read from this one, so an element saved in
// several replicas is read exactly once, from the first piece in `saved` order that holds it.
// Reads adjacent both in a piece's file and in the wanted buffer are merged, so restoring into the
// layout that saved a tensor gives one read per piece.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/base/status.h"
#include "common/format/metadata.h"
#include "flashckpt/tensor.h"

namespace flashckpt {

// One read: `bytes` bytes at absolute `file_offset` of the file of saved piece `piece` (an index
// into the list given to PlanPieceReads) go to `dest_offset` of the wanted tensor's local buffer.
struct ReadRun {
  size_t piece = 0;
  uint64_t file_offset = 0;
  uint64_t dest_offset = 0;
  uint64_t bytes = 0;
};

// The reads that fill a wanted tensor, in increasing dest_offset order; their destinations do not
// overlap and together cover the whole local buffer, so `bytes` is its size.
struct ReshardPlan {
  std::vector<ReadRun> runs;
  uint64_t bytes = 0;
};

// Plans how to fill every element of `want` from `saved`, the pieces of the checkpoint saved under
// the key `want.name`. `want` is normalized here (NormalizeTensorSpec), so defaults may be left
// empty. Pure: no I/O, no shared state; thread-safe.
//
// Errors, each naming the key:
//   kInvalidArgument  `want` is malformed, a saved piece is null or has another key, or dtype or
//                     global shape of a saved piece differ from `want`'s;
//   kCorruption       a saved piece is inconsistent (box outside the global tensor, flat range
//                     outside its box, byte range not the size of its elements);
//   kNotFound         some wanted element is in no saved piece; the message gives the global
//                     position of the first such element in the wanted piece's local order.
Result<ReshardPlan> PlanPieceReads(const TensorSpec& want, const std::vector<const Piece*>& saved);

}  // namespace flashckpt

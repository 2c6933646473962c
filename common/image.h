// Turning a filled slot into finished file images: the step and per-tensor checksums are written
// into the fixed-width fields of each image's header, in place, so the slot bytes are the files.
#pragma once

#include <cstdint>

#include "common/checksum.h"
#include "common/layout.h"

namespace flashckpt {

// Copies the header templates of every file image into the slot. Done once per slot at
// registration; the trainer never writes header bytes.
void InitSlotImages(char* slot, const RankLayout& layout);

// Writes `step` and the xxh3-64 of every tensor of file image `file` into its header in the slot.
void StampImage(char* slot, const RankLayout& layout, size_t file, int64_t step);
// The two halves of StampImage, for callers that checksum tensors in parallel.
void StampStep(char* slot, const RankLayout& layout, size_t file, int64_t step);
void StampChecksum(char* slot, const RankLayout& layout, size_t tensor);
// StampChecksum of one tensor fed in pieces, so that each piece can be written out right after it
// is hashed. Feed the tensor's bytes in order, in pieces whose sizes are multiples of the tensor's
// checksum chunk (the last piece may be shorter), then Finish.
class ChecksumStamper {
 public:
  ChecksumStamper(char* slot, const RankLayout& layout, size_t tensor);
  // Bytes [from, to) of the tensor (tensor-relative offsets); `from` is where the last call ended.
  void Feed(uint64_t from, uint64_t to);
  void Finish();

 private:
  char* slot_;
  const Placement* p_;
  Xxh3Stream whole_;
};

// Writes the EMA counters into the fixed-width fields of an ema file image built with
// EmaFileExtras (common/metadata.h). A negative last_step (no update yet) is written as 0.
void StampEmaCounters(char* slot, const RankLayout& layout, size_t file, uint64_t updates_applied,
                      uint64_t updates_skipped, int64_t last_step);

}  // namespace flashckpt

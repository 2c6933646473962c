// Turning a filled slot into finished file images: the step and per-tensor checksums are written
// into the fixed-width fields of each image's header, in place, so the slot bytes are the files.
#pragma once

#include <cstdint>

#include "common/format/layout.h"

namespace flashckpt {

// A writer hashes and writes tensors in pieces of about this size (whole checksum chunks).
inline constexpr uint64_t kWritePiece = 16u << 20;

// Copies the header templates of every file image into the slot. Done once per slot at
// registration; the trainer never writes header bytes.
void InitSlotImages(char* slot, const RankLayout& layout);

// Writes `step` and the xxh3-64 of every tensor of file image `file` into its header in the slot.
void StampImage(char* slot, const RankLayout& layout, size_t file, int64_t step);
// The two halves of StampImage, for callers that checksum tensors in parallel.
void StampStep(char* slot, const RankLayout& layout, size_t file, int64_t step);
void StampChecksum(char* slot, const RankLayout& layout, size_t tensor);
// The two parts of StampChecksum, for a writer that hashes a tensor piece by piece while writing it:
// the per-chunk checksums of the tensor bytes [from, to) (`from` a multiple of the checksum chunk,
// `to` one too or the tensor's end; nothing for a tensor of one chunk), and the whole-tensor one.
// For a tensor of several chunks the whole checksum is computed from the stamped chunk checksums
// (CombineChunkChecksums, format version 2), so it must come after all of them and reads no data;
// for a tensor of one chunk it hashes the bytes.
void StampChunkChecksums(char* slot, const RankLayout& layout, size_t tensor, uint64_t from, uint64_t to);
void StampWholeChecksum(char* slot, const RankLayout& layout, size_t tensor);
// What a writer that hashes while it writes calls (the daemon's writer, write_bench): for each piece
// [from, to) of a tensor before its pages are written, StampPieceChecksums (its chunk checksums, and
// the whole checksum of a tensor of one chunk); once every piece of file image `file` is done and
// before its header is written, StampDerivedChecksums (the whole checksums of its tensors of several
// chunks, from their chunk checksums: no data is read).
void StampPieceChecksums(char* slot, const RankLayout& layout, size_t tensor, uint64_t from, uint64_t to);
void StampDerivedChecksums(char* slot, const RankLayout& layout, size_t file);

// Writes the EMA counters into the fixed-width fields of an ema file image built with
// EmaFileExtras (common/format/metadata.h). A negative last_step (no update yet) is written as 0.
void StampEmaCounters(char* slot, const RankLayout& layout, size_t file, uint64_t updates_applied,
                      uint64_t updates_skipped, int64_t last_step);

}  // namespace flashckpt

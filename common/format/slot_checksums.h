// The checksums of a memory checkpoint: every checksum chunk of every tensor of a slot, replicas
// included, hashed by the daemon after the commit and kept by the daemon (never in the segment,
// which trainers can write), so that a restore from memory verifies what it hands over.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/base/thread_pool.h"
#include "common/format/layout.h"

namespace flashckpt {

// The XXH3-64 of each chunk of layout.checksum_chunk bytes of each tensor, counted from the tensor's
// first byte (its last chunk may be shorter; an empty tensor has none). For a file tensor of several
// chunks these are the values the writer stamps into its file header (StampChunkChecksums), and for
// one of a single chunk the one value is its whole checksum.
struct SlotChecksums {
  uint64_t chunk_bytes = 0;
  std::vector<uint64_t> first;  // per tensor of the layout: the index of its first chunk in `sums`
  std::vector<uint64_t> sums;
};

// Hashes the slot's tensors on `loop`'s threads (nullptr: this thread), in tasks of whole chunks.
SlotChecksums ComputeSlotChecksums(const char* slot, const RankLayout& layout, ParallelLoop* loop);

// OK when `sums` has one value per chunk of every tensor of `layout` (read from a record, say);
// CORRUPTION saying what does not fit otherwise. Hashes nothing.
Status CheckSlotChecksumsFit(const RankLayout& layout, const SlotChecksums& sums);

// OK when every chunk hashes to its recorded value; CORRUPTION naming the first tensor and chunk
// that do not (and both values) otherwise, or when `sums` was not computed for this layout.
Status VerifySlotChecksums(const char* slot, const RankLayout& layout, const SlotChecksums& sums,
                           ParallelLoop* loop);

// The CORRUPTION both verifiers (the daemon's VerifySlotChecksums, the client's verified copy) return
// for chunk `chunk` of a tensor of `tensor_bytes` bytes that hashed to `found`, not `committed`.
Status ChunkMismatch(const std::string& tensor, uint64_t chunk, uint64_t chunk_bytes, uint64_t tensor_bytes,
                     uint64_t found, uint64_t committed);

}  // namespace flashckpt

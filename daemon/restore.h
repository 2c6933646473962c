// Restore: fills a slot with a complete checkpoint, in the rank's own layout or another one.
//
// Every tensor the rank registered is matched to a saved piece with the same key, dtype, global
// shape, box and flat range (replicas are found in whichever rank's file persisted them). Reads are
// sorted by file and offset and merged when adjacent in both the file and the slot, so the usual
// case is one large sequential read per file. Every piece's xxh3 is verified before the slot is
// handed to the client.
//
// A tensor whose saved pieces have another geometry (different tp/pp/shard degrees) is planned by
// PlanPieceReads (common/reshard.h): its box and flat range are intersected with the saved pieces,
// replicas are read once. Each contributing saved piece is then read whole through a bounded
// buffer, so its checksum is verified, and the parts this rank needs are copied out of it.
#pragma once

#include <cstdint>
#include <string>

#include "common/layout.h"
#include "common/metadata.h"
#include "common/status.h"

namespace flashckpt {

struct RestoreStats {
  uint64_t bytes_needed = 0;  // bytes of the rank's tensors
  uint64_t bytes_read = 0;    // bytes read from disk (whole saved pieces, for their checksums)
  uint64_t reads = 0;  // pread calls after merging
};

Result<RestoreStats> FillSlotFromCheckpoint(const std::string& checkpoint_dir, const CheckpointMetadata& meta,
                                            const RankLayout& layout, char* slot);

}  // namespace flashckpt

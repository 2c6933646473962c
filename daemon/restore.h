// Restore: fills a slot with a complete checkpoint, in the rank's own (same) layout.
//
// Every tensor the rank registered is matched to a saved piece with the same key, dtype, global
// shape, box and flat range (replicas are found in whichever rank's file persisted them). Reads are
// sorted by file and offset and merged when adjacent in both the file and the slot, so the usual
// case is one large sequential read per file. Every piece's xxh3 is verified before the slot is
// handed to the client.
#pragma once

#include <cstdint>
#include <string>

#include "common/layout.h"
#include "common/metadata.h"
#include "common/status.h"

namespace flashckpt {

struct RestoreStats {
  uint64_t bytes_read = 0;
  uint64_t reads = 0;  // pread calls after merging
};

Result<RestoreStats> FillSlotFromCheckpoint(const std::string& checkpoint_dir, const CheckpointMetadata& meta,
                                            const RankLayout& layout, char* slot);

}  // namespace flashckpt

#include "daemon/core/registration.h"

#include "common/base/names.h"

namespace flashckpt {

Status CheckRankBytes(const RankLayout& layout, uint64_t limit) {
  if (limit == 0) return Status::OK();
  uint64_t total = 0;
  for (const Placement& p : layout.placements) {
    // BuildRankLayout bounds each tensor and their sum (kMaxSlotBytes): this cannot overflow.
    total += p.bytes;
  }
  if (total <= limit) return Status::OK();
  return ResourceExhausted("tensors: job '" + layout.job + "' rank " + std::to_string(layout.rank) + " registers " +
                           FormatBytes(total) + " (" + std::to_string(total) + " bytes) in " +
                           std::to_string(layout.tensors.size()) + " tensors, above the per-rank cap of " +
                           FormatBytes(limit) + " (--max-rank-bytes)");
}

}  // namespace flashckpt

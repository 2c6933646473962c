// A replica's description of where its tensors lie in the origin's slot, with the chunk checksums of
// its bytes and the attempt that took it: ReplicaMeta::layout, replica.proto's ReplicaLayout. The
// origin encodes it; a daemon that fetches the replica back decodes it and checks it against the
// rank's own layout before it trusts a byte (peer_fetch.cc).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/format/layout.h"
#include "common/format/slot_checksums.h"

namespace flashckpt {

struct ReplicaLayout {
  struct Tensor {
    std::string name;
    uint64_t slot_offset = 0;
    uint64_t bytes = 0;
  };
  std::vector<Tensor> tensors;
  SlotChecksums sums;
  std::string run_id;        // the attempt that took it
  int64_t resumed_from = 0;
  uint64_t image_offset = 0;  // where the replica's bytes begin in the slot
  uint64_t layout_fingerprint = 0;
  // A rank with the daemon's EMA: the EMA of the step, whose image follows the slot's bytes in the
  // replica (replica.proto's ReplicaEma): where it lies in the slot, its size, the fingerprint of
  // the EMA plan's layout, the checksums of its tensors and the EMA's counters.
  struct Ema {
    uint64_t image_offset = 0;
    uint64_t image_bytes = 0;
    uint64_t layout_fingerprint = 0;
    SlotChecksums sums;
    bool initialized = false;
    uint64_t updates_applied = 0;
    uint64_t updates_skipped = 0;
    int64_t last_step = -1;
    int64_t last_seen = -1;
  };
  std::optional<Ema> ema;
};

// The description of a memory checkpoint of a rank laid out as `layout`.
ReplicaLayout ReplicaLayoutOf(const RankLayout& layout, uint64_t layout_fingerprint, uint64_t image_offset,
                              const SlotChecksums& sums, const std::string& run_id, int64_t resumed_from);
std::string EncodeReplicaLayout(const ReplicaLayout& layout);
// CORRUPTION when `bytes` (a peer's, untrusted) do not parse.
Result<ReplicaLayout> DecodeReplicaLayout(const std::string& bytes);

}  // namespace flashckpt

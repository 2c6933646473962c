// One registered rank's slot segment as the daemon holds it: the rank's layout, the mapped shared
// memory, the slot state machine, the rank's EMA and the host memory they count against.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/format/layout.h"
#include "common/io/shm.h"
#include "daemon/core/slots.h"
#include "daemon/core/state_dir.h"
#include "daemon/pipeline/ema.h"
#include "daemon/pipeline/ema_stage.h"

namespace flashckpt {

class Core;

// A slot is the rank layout's bytes followed, with EMA on, by room for one EMA image. The slot
// table and the memory checkpoints queued for their checksums are the daemon's to guard
// (Core::mu_): they are reached only through Core::Slots, Core::MemoryPending and Core::Mirror,
// which require that lock, so clang's thread-safety analysis checks every use. The rest is set at
// construction and read freely.
class RankSegment {
 public:
  RankSegment(RankLayout l, std::unique_ptr<SharedSegment> s, uint32_t count, std::unique_ptr<RankEma> e,
              uint64_t stride, uint64_t ema_offset, std::atomic<uint64_t>* counter, const StateDir* state_dir);
  ~RankSegment();
  RankSegment(const RankSegment&) = delete;
  RankSegment& operator=(const RankSegment&) = delete;

  char* Slot(uint32_t i) const { return shm->data() + kSegmentHeaderBytes + slot_stride * i; }
  // Base pointer for the EMA plan's offsets so that its image lands in the slot's EMA room.
  char* SlotEmaBase(uint32_t i) const { return Slot(i) + ema_area - ema->plan().layout.files[0].slot_offset; }

  const RankLayout layout;
  // ReplicaLayoutFingerprint(layout): what the rank's replicas carry, and what a fetched one must match.
  const uint64_t layout_fingerprint;
  const std::shared_ptr<SharedSegment> shm;  // shared: a part lent to gRPC keeps the mapping (SliceLoans)
  const std::unique_ptr<RankEma> ema;  // null when the job has no EMA (or this rank no EMA tensors)
  uint64_t tensor_bytes = 0;           // the rank's tensors in one slot (replicas included)
  const uint64_t slot_stride;          // bytes per slot
  const uint64_t ema_area;             // offset of the EMA image room within a slot
  // With EMA: ReplicaLayoutFingerprint of its plan's layout, which a fetched replica's EMA must match.
  const uint64_t ema_fingerprint;
  // Host memory this segment (and its EMA segment) counts against the daemon's budget.
  uint64_t accounted() const { return accounted_; }

  // A memory snapshot queued for its checksums, with its slot.
  struct PendingMemory {
    uint32_t slot = 0;
    std::shared_ptr<ResidentCheckpoint> resident;
  };

 private:
  friend class Core;
  // Copies slot `i`'s state into its header page, for inspection and for the next daemon.
  void MirrorSlot(uint32_t i, const SlotInfo& info) const;

  SlotTable slots_;           // Core::mu_
  // Core::mu_: the memory snapshots queued for their checksums in the EMA stage, with their slots.
  std::vector<PendingMemory> memory_pending_;
  std::atomic<uint64_t>* const used_;  // the daemon's host-memory counter
  const uint64_t accounted_;          // bytes counted in *used (segment + EMA segment)
  const StateDir* const state_;       // its records are removed with the segment's name
};

// Points `job` (EmaJob's stage fields) at slot `ticket` of `segment`, and holds the segment in
// it; with `job->persist` or `job->resident` set first, at the slot's room for the EMA image too.
void PointEmaJobAt(const std::shared_ptr<RankSegment>& segment, SlotTicket ticket, EmaJob* job);

}  // namespace flashckpt

// The slot state machine of one rank's segment.
//
//   FREE --Acquire(kFilling)--> FILLING --Commit--> COMMITTED --BeginPersist--> PERSISTING --Release--> FREE
//   FREE --Acquire(kRestoring)--> RESTORING --Release--> FREE
//   PERSISTING --ReleaseWritten--> FREE, holding the snapshot as a memory checkpoint when it was to
//   be kept once written (KeepOnceWritten: a disk checkpoint doubles as the newest memory one)
//   FILLING / RESTORING --Abandon (trainer gone or aborted)--> FREE
//
// Memory checkpoints (tier kMemory) are kept in FREE slots: COMMITTED --MakeResident--> FREE holding
// it (`resident`), once its checksums are computed; AcquireResident hands it to a restore (RESTORING,
// still holding it). Acquire takes slots that hold nothing first, then the one holding the oldest
// memory checkpoint, and never the rank's newest one unless a newer disk snapshot is already
// committed: a crash at any moment leaves the newest memory checkpoint intact.
//
// Every hand-out bumps the slot's generation; a commit or release must name the generation it was
// given, so a stale or duplicated request cannot touch a slot that has since been reused.
// Not thread-safe: the owner (the daemon's registry) guards it with its mutex.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/format/signal.h"
#include "common/format/slot_checksums.h"
#include "common/io/shm.h"
#include "daemon/pipeline/snapshot.h"

namespace flashckpt {

// Where a snapshot goes: written to files (kDisk), or kept in its slot as a memory checkpoint.
enum class SlotTier : uint8_t { kDisk, kMemory };

struct SlotInfo {
  SlotState state = SlotState::kFree;
  int64_t step = -1;
  uint64_t generation = 0;
  SlotTier tier = SlotTier::kDisk;  // of the snapshot it was last handed out for
  bool loading = false;  // RESTORING and the daemon is still filling it: not abandonable
  std::chrono::steady_clock::time_point handed_out{};  // when the daemon last gave it out for a snapshot (HandOut)
  // The memory checkpoint the slot holds (FREE, or RESTORING while a restore hands it over); null:
  // none. Kept through Release and AbandonInFlight; any other hand-out of the slot forgets it.
  std::shared_ptr<const ResidentCheckpoint> resident;
  // A disk snapshot being written (PERSISTING) of a rank that takes memory checkpoints: the memory
  // checkpoint it becomes once written (ReleaseWritten); forgotten if the write fails.
  std::shared_ptr<const ResidentCheckpoint> once_written;
};

// The steps of `steps` (newest first) that `held` also has, in the same order: the memory
// checkpoints several ranks hold in common.
std::vector<int64_t> StepsAlsoIn(const std::vector<int64_t>& steps, const std::vector<int64_t>& held);

class SlotTable {
 public:
  explicit SlotTable(uint32_t count) : slots_(count) {}

  uint32_t size() const { return static_cast<uint32_t>(slots_.size()); }
  const SlotInfo& at(uint32_t slot) const { return slots_[slot]; }
  uint32_t CountIn(SlotState state) const;
  // When the daemon gave `slot` out for a snapshot (status: how long it has been filling).
  void SetHandedOut(uint32_t slot, std::chrono::steady_clock::time_point when) { slots_[slot].handed_out = when; }

  // FREE -> `purpose` (kFilling or kRestoring) for a snapshot of `tier`; nullopt when no slot may be
  // taken. Slots that hold no memory checkpoint go first (lowest index), then the one holding the
  // oldest; the newest memory checkpoint is never taken unless a disk snapshot of a later step is
  // committed or being written.
  std::optional<SlotTicket> Acquire(SlotState purpose, int64_t step, SlotTier tier = SlotTier::kDisk);
  // The FREE slot holding memory checkpoint `step` -> RESTORING, still holding it; nullopt if none does.
  std::optional<SlotTicket> AcquireResident(int64_t step);
  // The FREE slot holding memory checkpoint `step` -> PERSISTING (written after all, as at a stop
  // with --persist-on-stop); Release(kPersisting) frees it. nullopt if no slot holds it.
  std::optional<SlotTicket> PersistResident(int64_t step);
  // COMMITTED -> FREE holding `resident` (a memory snapshot whose checksums are computed).
  Status MakeResident(const SlotTicket& ticket, std::shared_ptr<const ResidentCheckpoint> resident);
  // RESTORING -> FREE holding `resident`: a peer's replica the daemon fetched into the slot and checked.
  Status KeepFetched(const SlotTicket& ticket, std::shared_ptr<const ResidentCheckpoint> resident);
  // Forgets every memory checkpoint of step >= `from`; returns how many.
  uint32_t DropResidentsFrom(int64_t from);
  // The steps of the memory checkpoints held, newest first.
  std::vector<int64_t> ResidentSteps() const;
  // The memory checkpoint of `step` a slot holds; null when none does.
  std::shared_ptr<const ResidentCheckpoint> ResidentOf(int64_t step) const;
  // The memory checkpoint held by `slot`, or null.
  std::shared_ptr<const ResidentCheckpoint> ResidentIn(uint32_t slot) const { return slots_[slot].resident; }
  // FILLING -> COMMITTED for the ticket's slot and generation.
  Status Commit(const SlotTicket& ticket, int64_t step);
  // COMMITTED -> PERSISTING.
  Status BeginPersist(const SlotTicket& ticket);
  // `expected` -> FREE (a PERSISTING slot forgets the checkpoint it was to keep once written).
  Status Release(const SlotTicket& ticket, SlotState expected);
  // PERSISTING (the ticket's slot and its memory checkpoint's step): keep `resident` once written.
  Status KeepOnceWritten(const SlotTicket& ticket, std::shared_ptr<const ResidentCheckpoint> resident);
  // PERSISTING -> FREE after a successful write, holding what KeepOnceWritten gave it (if anything,
  // and not dropped since) as a memory checkpoint.
  Status ReleaseWritten(const SlotTicket& ticket);
  // Marks a RESTORING slot as being filled by the daemon (or done being filled).
  void SetLoading(uint32_t slot, bool loading) { slots_[slot].loading = loading; }
  bool AnyLoading() const {
    for (const SlotInfo& s : slots_) {
      if (s.loading) return true;
    }
    return false;
  }
  // Every FILLING and RESTORING slot that is not loading -> FREE (the trainer is gone).
  uint32_t AbandonInFlight();
  // FREE -> COMMITTED with the given step and generation: a restarted daemon adopting a snapshot
  // its predecessor had acknowledged. Later hand-outs continue after `generation`.
  Status Adopt(const SlotTicket& ticket, int64_t step);
  // FREE -> FREE holding `resident` at the given generation: a restarted daemon adopting a memory
  // checkpoint its predecessor kept.
  Status AdoptResident(const SlotTicket& ticket, std::shared_ptr<const ResidentCheckpoint> resident);

 private:
  Status Check(const SlotTicket& ticket, SlotState expected, const char* action) const;
  // `expected` -> FREE holding `resident` (of the step the slot was handed out for).
  Status Keep(const SlotTicket& ticket, SlotState expected, std::shared_ptr<const ResidentCheckpoint> resident,
              const char* action);
  // The slot Acquire may take, or -1.
  int Pick() const;
  SlotTicket HandOut(uint32_t slot, SlotState purpose, int64_t step, SlotTier tier);
  std::vector<SlotInfo> slots_;
};

}  // namespace flashckpt

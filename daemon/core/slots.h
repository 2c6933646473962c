// The slot state machine of one rank's segment.
//
//   FREE --Acquire(kFilling)--> FILLING --Commit--> COMMITTED --BeginPersist--> PERSISTING --Release--> FREE
//   FREE --Acquire(kRestoring)--> RESTORING --Release--> FREE
//   FILLING / RESTORING --Abandon (trainer gone or aborted)--> FREE
//
// Every hand-out bumps the slot's generation; a commit or release must name the generation it was
// given, so a stale or duplicated request cannot touch a slot that has since been reused.
// Not thread-safe: the owner (the daemon's registry) guards it with its mutex.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/base/status.h"
#include "common/io/shm.h"

namespace flashckpt {

struct SlotTicket {
  uint32_t slot = 0;
  uint64_t generation = 0;
};

struct SlotInfo {
  SlotState state = SlotState::kFree;
  int64_t step = -1;
  uint64_t generation = 0;
  bool loading = false;  // RESTORING and the daemon is still filling it: not abandonable
  std::chrono::steady_clock::time_point handed_out{};  // when Acquire last gave it out
};

class SlotTable {
 public:
  explicit SlotTable(uint32_t count) : slots_(count) {}

  uint32_t size() const { return static_cast<uint32_t>(slots_.size()); }
  const SlotInfo& at(uint32_t slot) const { return slots_[slot]; }
  uint32_t CountIn(SlotState state) const;

  // FREE -> `purpose` (kFilling or kRestoring); nullopt when no slot is free.
  std::optional<SlotTicket> Acquire(SlotState purpose, int64_t step);
  // FILLING -> COMMITTED for the ticket's slot and generation.
  Status Commit(const SlotTicket& ticket, int64_t step);
  // COMMITTED -> PERSISTING.
  Status BeginPersist(const SlotTicket& ticket);
  // `expected` -> FREE.
  Status Release(const SlotTicket& ticket, SlotState expected);
  // Marks a RESTORING slot as being filled by the daemon (or done being filled).
  void SetLoading(uint32_t slot, bool loading) { slots_[slot].loading = loading; }
  // Every FILLING and RESTORING slot that is not loading -> FREE (the trainer is gone).
  uint32_t AbandonInFlight();
  // FREE -> COMMITTED with the given step and generation: a restarted daemon adopting a snapshot
  // its predecessor had acknowledged. Later hand-outs continue after `generation`.
  Status Adopt(const SlotTicket& ticket, int64_t step);

 private:
  Status Check(const SlotTicket& ticket, SlotState expected, const char* action) const;
  std::vector<SlotInfo> slots_;
};

}  // namespace flashckpt

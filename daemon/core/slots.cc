#include "daemon/core/slots.h"

#include <algorithm>
#include <string>

namespace flashckpt {

uint32_t SlotTable::CountIn(SlotState state) const {
  uint32_t n = 0;
  for (const auto& s : slots_) n += s.state == state ? 1 : 0;
  return n;
}

int SlotTable::Pick() const {
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state == SlotState::kFree && slots_[i].resident == nullptr) return static_cast<int>(i);
  }
  // Every free slot holds a memory checkpoint. The newest one is kept unless a disk snapshot of a
  // later step has committed (it is written, or adopted and written by the next daemon).
  int newest = -1, oldest = -1;
  int64_t newest_disk = -1;
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    const SlotInfo& s = slots_[i];
    if ((s.state == SlotState::kCommitted || s.state == SlotState::kPersisting) && s.tier == SlotTier::kDisk) {
      newest_disk = std::max(newest_disk, s.step);
    }
    if (s.resident == nullptr) continue;
    if (newest < 0 || s.resident->step > slots_[newest].resident->step) newest = static_cast<int>(i);
  }
  const bool keep_newest = newest >= 0 && slots_[newest].resident->step >= newest_disk;
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    const SlotInfo& s = slots_[i];
    if (s.state != SlotState::kFree || (keep_newest && static_cast<int>(i) == newest)) continue;
    if (oldest < 0 || s.resident->step < slots_[oldest].resident->step) oldest = static_cast<int>(i);
  }
  return oldest;
}

SlotTicket SlotTable::HandOut(uint32_t slot, SlotState purpose, int64_t step, SlotTier tier) {
  SlotInfo& s = slots_[slot];
  s.state = purpose;
  s.once_written.reset();
  s.step = step;
  s.tier = tier;
  s.generation += 1;
  return SlotTicket{slot, s.generation};
}

std::optional<SlotTicket> SlotTable::Acquire(SlotState purpose, int64_t step, SlotTier tier) {
  const int slot = Pick();
  if (slot < 0) return std::nullopt;
  slots_[slot].resident.reset();
  return HandOut(static_cast<uint32_t>(slot), purpose, step, tier);
}

std::optional<SlotTicket> SlotTable::AcquireResident(int64_t step) {
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    const SlotInfo& s = slots_[i];
    if (s.state == SlotState::kFree && s.resident != nullptr && s.resident->step == step) {
      return HandOut(i, SlotState::kRestoring, step, SlotTier::kMemory);
    }
  }
  return std::nullopt;
}

std::vector<int64_t> StepsAlsoIn(const std::vector<int64_t>& steps, const std::vector<int64_t>& held) {
  std::vector<int64_t> both;
  for (int64_t s : steps) {
    if (std::find(held.begin(), held.end(), s) != held.end()) both.push_back(s);
  }
  return both;
}

std::optional<SlotTicket> SlotTable::PersistResident(int64_t step) {
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    const SlotInfo& s = slots_[i];
    if (s.state == SlotState::kFree && s.resident != nullptr && s.resident->step == step) {
      return HandOut(i, SlotState::kPersisting, step, SlotTier::kMemory);  // still holding it
    }
  }
  return std::nullopt;
}

Status SlotTable::Keep(const SlotTicket& ticket, SlotState expected, std::shared_ptr<const ResidentCheckpoint> resident,
                       const char* action) {
  RETURN_IF_ERROR(Check(ticket, expected, action));
  if (resident == nullptr || resident->step != slots_[ticket.slot].step) {
    return Internal(std::string(action) + ": slot " + std::to_string(ticket.slot) + " holds step " +
                    std::to_string(slots_[ticket.slot].step) + ", not the memory checkpoint given");
  }
  slots_[ticket.slot].state = SlotState::kFree;
  slots_[ticket.slot].resident = std::move(resident);
  return Status::OK();
}

Status SlotTable::MakeResident(const SlotTicket& ticket, std::shared_ptr<const ResidentCheckpoint> resident) {
  return Keep(ticket, SlotState::kCommitted, std::move(resident), "keep");
}

Status SlotTable::KeepFetched(const SlotTicket& ticket, std::shared_ptr<const ResidentCheckpoint> resident) {
  return Keep(ticket, SlotState::kRestoring, std::move(resident), "keep fetched");
}

uint32_t SlotTable::DropResidentsFrom(int64_t from) {
  uint32_t n = 0;
  for (auto& s : slots_) {
    if (s.resident != nullptr && s.resident->step >= from) {
      s.resident.reset();
      ++n;
    }
    if (s.once_written != nullptr && s.once_written->step >= from) {
      s.once_written->dropped.store(true);  // the EMA stage need not compute its checksums
      s.once_written.reset();
      ++n;
    }
  }
  return n;
}

std::vector<int64_t> SlotTable::ResidentSteps() const {
  std::vector<int64_t> steps;
  for (const auto& s : slots_) {
    if (s.resident != nullptr) steps.push_back(s.resident->step);
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

std::shared_ptr<const ResidentCheckpoint> SlotTable::ResidentOf(int64_t step) const {
  for (const auto& s : slots_) {
    if (s.resident != nullptr && s.resident->step == step) return s.resident;
  }
  return nullptr;
}

Status SlotTable::Check(const SlotTicket& ticket, SlotState expected, const char* action) const {
  if (ticket.slot >= slots_.size()) {
    return InvalidArgument(std::string(action) + ": slot " + std::to_string(ticket.slot) + " does not exist (" +
                           std::to_string(slots_.size()) + " slots)");
  }
  const SlotInfo& s = slots_[ticket.slot];
  if (s.generation != ticket.generation) {
    return FailedPrecondition(std::string(action) + ": slot " + std::to_string(ticket.slot) + " generation " +
                              std::to_string(ticket.generation) + " was not handed out (current generation " +
                              std::to_string(s.generation) + ")");
  }
  if (s.state != expected) {
    return FailedPrecondition(std::string(action) + ": slot " + std::to_string(ticket.slot) + " is " +
                              SlotStateName(s.state) + ", expected " + SlotStateName(expected));
  }
  return Status::OK();
}

Status SlotTable::Commit(const SlotTicket& ticket, int64_t step) {
  RETURN_IF_ERROR(Check(ticket, SlotState::kFilling, "commit"));
  if (slots_[ticket.slot].step != step) {
    return InvalidArgument("commit: slot " + std::to_string(ticket.slot) + " was handed out for step " +
                           std::to_string(slots_[ticket.slot].step) + ", not " + std::to_string(step));
  }
  slots_[ticket.slot].state = SlotState::kCommitted;
  return Status::OK();
}

Status SlotTable::BeginPersist(const SlotTicket& ticket) {
  RETURN_IF_ERROR(Check(ticket, SlotState::kCommitted, "persist"));
  slots_[ticket.slot].state = SlotState::kPersisting;
  return Status::OK();
}

Status SlotTable::Release(const SlotTicket& ticket, SlotState expected) {
  RETURN_IF_ERROR(Check(ticket, expected, "release"));
  slots_[ticket.slot].state = SlotState::kFree;
  slots_[ticket.slot].once_written.reset();
  return Status::OK();
}

Status SlotTable::KeepOnceWritten(const SlotTicket& ticket, std::shared_ptr<const ResidentCheckpoint> resident) {
  RETURN_IF_ERROR(Check(ticket, SlotState::kPersisting, "keep once written"));
  if (resident == nullptr || resident->step != slots_[ticket.slot].step || slots_[ticket.slot].resident != nullptr) {
    return Internal("keep once written: slot " + std::to_string(ticket.slot) + " holds step " +
                    std::to_string(slots_[ticket.slot].step) + ", not the checkpoint given");
  }
  slots_[ticket.slot].once_written = std::move(resident);
  return Status::OK();
}

Status SlotTable::ReleaseWritten(const SlotTicket& ticket) {
  RETURN_IF_ERROR(Check(ticket, SlotState::kPersisting, "release"));
  SlotInfo& s = slots_[ticket.slot];
  s.state = SlotState::kFree;
  if (s.once_written != nullptr && !s.once_written->dropped.load()) s.resident = std::move(s.once_written);
  s.once_written.reset();
  return Status::OK();
}

uint32_t SlotTable::AbandonInFlight() {
  uint32_t n = 0;
  for (auto& s : slots_) {
    if (s.state == SlotState::kFilling || (s.state == SlotState::kRestoring && !s.loading)) {
      s.state = SlotState::kFree;
      ++n;
    }
  }
  return n;
}

Status SlotTable::Adopt(const SlotTicket& ticket, int64_t step) {
  if (ticket.slot >= slots_.size()) {
    return InvalidArgument("slot " + std::to_string(ticket.slot) + " does not exist (" +
                           std::to_string(slots_.size()) + " slots)");
  }
  SlotInfo& s = slots_[ticket.slot];
  if (s.state != SlotState::kFree) {
    return FailedPrecondition("slot " + std::to_string(ticket.slot) + " is " + SlotStateName(s.state) +
                              ", cannot adopt a snapshot into it");
  }
  s.state = SlotState::kCommitted;
  s.step = step;
  s.tier = SlotTier::kDisk;
  s.generation = ticket.generation;
  s.resident.reset();
  return Status::OK();
}

Status SlotTable::AdoptResident(const SlotTicket& ticket, std::shared_ptr<const ResidentCheckpoint> resident) {
  if (ticket.slot >= slots_.size()) {
    return InvalidArgument("slot " + std::to_string(ticket.slot) + " does not exist (" +
                           std::to_string(slots_.size()) + " slots)");
  }
  SlotInfo& s = slots_[ticket.slot];
  if (s.state != SlotState::kFree || s.resident != nullptr || resident == nullptr) {
    return FailedPrecondition("slot " + std::to_string(ticket.slot) + " is " + SlotStateName(s.state) +
                              ", cannot adopt a memory checkpoint into it");
  }
  s.step = resident->step;
  s.tier = SlotTier::kMemory;
  s.generation = ticket.generation;
  s.resident = std::move(resident);
  return Status::OK();
}

}  // namespace flashckpt

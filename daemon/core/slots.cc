#include "daemon/core/slots.h"

#include <string>

namespace flashckpt {

uint32_t SlotTable::CountIn(SlotState state) const {
  uint32_t n = 0;
  for (const auto& s : slots_) n += s.state == state ? 1 : 0;
  return n;
}

std::optional<SlotTicket> SlotTable::Acquire(SlotState purpose, int64_t step) {
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state != SlotState::kFree) continue;
    slots_[i].state = purpose;
    slots_[i].step = step;
    slots_[i].generation += 1;
    slots_[i].handed_out = std::chrono::steady_clock::now();
    return SlotTicket{i, slots_[i].generation};
  }
  return std::nullopt;
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
  s.generation = ticket.generation;
  return Status::OK();
}

}  // namespace flashckpt

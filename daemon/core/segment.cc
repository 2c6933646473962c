#include "daemon/core/segment.h"

#include "common/base/log.h"
#include "common/base/names.h"
#include "daemon/parity/parity_sender.h"
#include "daemon/replica/replica_sender.h"

namespace flashckpt {

RankSegment::RankSegment(RankLayout l, std::unique_ptr<SharedSegment> s, uint32_t count, std::unique_ptr<RankEma> e,
                         uint64_t stride, uint64_t ema_offset, std::atomic<uint64_t>* counter,
                         const StateDir* state_dir)
    : layout(std::move(l)),
      layout_fingerprint(ReplicaLayoutFingerprint(layout)),
      shm(std::move(s)),
      ema(std::move(e)),
      slot_stride(stride),
      ema_area(ema_offset),
      ema_fingerprint(ema ? ReplicaLayoutFingerprint(ema->plan().layout) : 0),
      slots_(count),
      used_(counter),
      accounted_(shm->size() + (ema ? ema->bytes() : 0)),
      state_(state_dir) {
  for (const Placement& p : layout.placements) tensor_bytes += p.bytes;  // once, not per commit
  used_->fetch_add(accounted_);
}

RankSegment::~RankSegment() {
  used_->fetch_sub(accounted_);
  if (!shm->owns_name()) {  // a stop left snapshots in it: the next daemon adopts it with its records
    Logger("shm")->info("kept segment={} bytes={} for the next daemon", shm->name(), FormatBytes(shm->size()));
    return;
  }
  if (state_ != nullptr) state_->RemoveSegment(shm->name());
  Logger("shm")->info("released segment={} bytes={}", shm->name(), FormatBytes(shm->size()));
}

void RankSegment::MirrorSlot(uint32_t i, const SlotInfo& s) const {
  auto* h = reinterpret_cast<SlotHeader*>(Slot(i));
  h->step.store(s.step, std::memory_order_relaxed);
  h->generation.store(s.generation, std::memory_order_relaxed);
  h->resident.store(s.resident != nullptr ? 1 : 0, std::memory_order_relaxed);
  h->state.store(static_cast<uint32_t>(s.state), std::memory_order_release);
}

void PointEmaJobAt(const std::shared_ptr<RankSegment>& segment, SlotTicket ticket, EmaJob* job) {
  job->segment = segment;
  job->ticket = ticket;
  job->layout = &segment->layout;
  job->slot = segment->Slot(ticket.slot);
  job->ema = segment->ema.get();
  job->ema_image = (job->persist || job->resident) && segment->ema ? segment->SlotEmaBase(ticket.slot) : nullptr;
}

}  // namespace flashckpt

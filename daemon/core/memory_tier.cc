// The memory tier's side of a save: whether memory checkpoints fit the slots, which ones a new
// snapshot may drop, the replica offered to the peers for each one kept, and a memory step written
// to disk on request (release, stop).

#include <algorithm>

#include "common/base/log.h"
#include "daemon/core/memory_tier.h"
#include "daemon/core/save_path.h"
#include "daemon/parity/parity_sender.h"
#include "daemon/replica/replica_sender.h"
#include "daemon/replica/replica_layout.h"

namespace flashckpt {

Status MemoryTier::MemoryTierFits(uint32_t slots) {
  if (slots < 2) {
    return FailedPrecondition("memory checkpoints need --slots >= 2: one slot keeps the newest memory checkpoint "
                              "while the next one is filled (the rank's segment has " + std::to_string(slots) +
                              ")");
  }
  return Status::OK();
}

bool MemoryTier::DiskSnapshotsHoldEverything(const RankSegment& segment) {
  if (segment.ema) return false;
  for (const Placement& p : segment.layout.placements) {
    if (p.file < 0) return false;
  }
  return true;
}

uint32_t MemoryTier::DropMemoryFrom(Core& c_, RankSegment& segment, int64_t from) {
  uint32_t dropped = c_.Slots(segment).DropResidentsFrom(from);
  for (const auto& p : c_.MemoryPending(segment)) {
    if (p.resident->step >= from && !p.resident->dropped.exchange(true)) dropped += 1;
  }
  // The mirrors no longer say those slots hold them: a restarted daemon does not adopt them.
  for (uint32_t i = 0; i < c_.Slots(segment).size(); ++i) c_.Mirror(segment, i);
  return dropped;
}

uint64_t MemoryTier::ReplicaAttemptNumber(Core& c_, RankState& state) {
  // A new number for each attempt, restore and process of the rank: whatever a peer holds from
  // before is older. The wall clock, but above every number seen for the rank (a clock set back, or
  // a replacement node whose clock is behind the old one's).
  if (state.attempt_number == 0 || state.numbered != state.attempt() || state.numbered_process != state.process) {
    state.numbered = state.attempt();
    state.numbered_process = state.process;
    const auto now_ms = static_cast<uint64_t>(c_.clock_.WallMs());
    state.attempt_number = std::max(now_ms, state.attempt_floor + 1);
    state.attempt_floor = state.attempt_number;
  }
  return state.attempt_number;
}

void MemoryTier::RestoredLocked(Core& c_, const std::string& job, uint32_t rank, RankState& state, int64_t step) {
  state.Restored(step, c_.clock_.WallMs());
  // The peers let go of what they hold of a later step of the attempt the rank leaves (a rollback).
  if (c_.sender_) c_.sender_->Retract(job, rank, step, ReplicaAttemptNumber(c_, state));
}

void MemoryTier::OfferReplicaLocked(Core& c_, const std::shared_ptr<RankSegment>& segment, uint32_t slot, const std::string& job,
                                uint32_t rank) {
  if (!c_.sender_ && !c_.parity_) return;
  std::shared_ptr<const ResidentCheckpoint> resident = c_.Slots(*segment).ResidentIn(slot);
  auto jit = c_.jobs_.find(job);
  if (!resident || jit == c_.jobs_.end()) return;
  // A rank with EMA: the replica carries the EMA image of the step, which lies in the slot's EMA
  // room, right after the slot's tensors: the pushed range grows by the image.
  if (segment->ema && (!resident->ema || segment->ema_area != segment->layout.slot_bytes)) return;
  auto rit = jit->second.ranks.find(rank);
  if (rit == jit->second.ranks.end() || rit->second.segment != segment) return;
  RankState& state = rit->second;
  if (resident->attempt != state.attempt()) return;  // a predecessor's, finished late
  const uint64_t attempt_number = ReplicaAttemptNumber(c_, state);
  const RankLayout& layout = segment->layout;

  auto out = std::make_shared<OutgoingReplica>();
  out->meta.job = job;
  out->meta.rank = rank;
  out->meta.step = resident->step;
  out->meta.attempt = attempt_number;
  out->meta.world_size = resident->world_size;
  out->meta.bytes = layout.slot_bytes - kSlotImageOffset;
  ReplicaLayout where = ReplicaLayoutOf(layout, segment->layout_fingerprint, kSlotImageOffset, resident->sums,
                                        resident->attempt.run_id, resident->attempt.resumed_from);
  if (segment->ema) {
    ReplicaLayout::Ema ema;
    ema.image_offset = segment->ema_area;
    ema.image_bytes = segment->ema->plan().image_bytes();
    ema.layout_fingerprint = segment->ema_fingerprint;
    ema.sums = resident->ema_sums;
    ema.initialized = resident->ema->initialized;
    ema.updates_applied = resident->ema->updates_applied;
    ema.updates_skipped = resident->ema->updates_skipped;
    ema.last_step = resident->ema->last_step;
    ema.last_seen = resident->ema->last_seen;
    out->meta.bytes += ema.image_bytes;
    where.ema = std::move(ema);
  }
  out->meta.layout = EncodeReplicaLayout(where);
  out->meta.extra = resident->extra;
  out->meta.origin_node = c_.config_.node_name;
  out->meta.run_id = resident->attempt.run_id;
  out->meta.resumed_from = resident->attempt.resumed_from;
  out->keep = segment;
  out->mapping = segment->shm;
  out->data = segment->Slot(slot) + kSlotImageOffset;
  // The push streams the slot while the rank goes on: the checkpoint is still the one sent as long
  // as the slot holds it (a slot is reused only after it lets go of its memory checkpoint).
  out->still_held = [core = &c_, segment, slot, resident] {
    MutexLock lock(&core->mu_);
    return core->Slots(*segment).ResidentIn(slot) == resident;
  };
  if (c_.parity_) {
    // The rank's place among this node's ranks of the job (JobState::parity_order), and how many
    // there are: those placed, or more when more hold a segment (their places come next).
    JobState& job_state = jit->second;
    auto& order = job_state.parity_order;
    for (auto it = order.begin(); it != order.end();) {
      auto r = job_state.ranks.find(it->first);
      it = r == job_state.ranks.end() || !r->second.segment ? order.erase(it) : std::next(it);
    }
    uint32_t with_segment = 0;
    for (const auto& [r, s] : job_state.ranks) with_segment += s.segment ? 1 : 0;
    const uint64_t mine = order.emplace(rank, job_state.parity_next).first->second;
    if (mine == job_state.parity_next) ++job_state.parity_next;
    uint32_t position = 0;
    for (const auto& [r, seq] : order) position += seq < mine ? 1 : 0;
    c_.parity_->Offer({out, position, std::max(static_cast<uint32_t>(order.size()), with_segment)});
  }
  if (c_.sender_) c_.sender_->Offer(std::move(out));
}

Result<OwnImage> MemoryTier::OwnImageLocked(Core& c_, const std::string& job, uint32_t rank, int64_t step,
                                            const Attempt& attempt) {
  auto jit = c_.jobs_.find(job);
  if (jit != c_.jobs_.end()) {
    auto rit = jit->second.ranks.find(rank);
    if (rit != jit->second.ranks.end() && rit->second.segment) {
      const std::shared_ptr<RankSegment>& segment = rit->second.segment;
      for (uint32_t slot = 0; slot < c_.Slots(*segment).size(); ++slot) {
        std::shared_ptr<const ResidentCheckpoint> resident = c_.Slots(*segment).ResidentIn(slot);
        if (!resident || resident->step != step || !(resident->attempt == attempt)) continue;
        // As OfferReplicaLocked sends it: with EMA, the image runs on into the slot's EMA room.
        if (segment->ema && (!resident->ema || segment->ema_area != segment->layout.slot_bytes)) break;
        OwnImage image;
        image.keep = segment;
        image.data = segment->Slot(slot) + kSlotImageOffset;
        image.bytes = segment->layout.slot_bytes - kSlotImageOffset +
                      (segment->ema ? segment->ema->plan().image_bytes() : 0);
        image.still_held = [core = &c_, segment, slot, resident] {
          MutexLock lock(&core->mu_);
          return core->Slots(*segment).ResidentIn(slot) == resident;
        };
        return image;
      }
    }
  }
  return NotFound("no memory checkpoint of job '" + job + "' rank " + std::to_string(rank) + " step " +
                  std::to_string(step) + " of " + AttemptText(attempt) + " is held here");
}

Result<uint32_t> MemoryTier::PersistMemoryStep(const std::string& name, int64_t step, int64_t disk, const char* why) {
  // Each rank's slot goes PERSISTING (nobody else takes it) and is verified against the checksums
  // taken after its commit, without the lock: memory that changed since is never written.
  struct Pinned {
    uint32_t rank;
    std::shared_ptr<RankSegment> segment;
    SlotTicket ticket;
    std::shared_ptr<const ResidentCheckpoint> resident;
    Status verified;
  };
  std::vector<Pinned> pinned;
  {
    MutexLock lock(&c_.mu_);
    auto jit = c_.jobs_.find(name);
    if (jit == c_.jobs_.end()) return NotFound("job '" + name + "' is no longer held");
    for (auto& [r, rank] : jit->second.ranks) {
      if (!rank.segment) continue;
      std::optional<SlotTicket> ticket = c_.Slots(*rank.segment).PersistResident(step);
      if (!ticket) continue;  // dropped meanwhile
      c_.Mirror(*rank.segment, ticket->slot);
      pinned.push_back({r, rank.segment, *ticket, c_.Slots(*rank.segment).ResidentIn(ticket->slot), Status::OK()});
    }
  }
  ParallelLoop verifiers(c_.config_.restore_threads > 0 ? c_.config_.restore_threads - 1 : 0);
  Status intact;
  for (Pinned& p : pinned) {
    p.verified = VerifySlotChecksums(p.segment->Slot(p.ticket.slot), p.segment->layout, p.resident->sums, &verifiers);
    if (intact.ok() && !p.verified.ok()) intact = p.verified;
  }
  MutexLock lock(&c_.mu_);
  uint32_t ranks = 0;
  Status submit_error;
  for (Pinned& p : pinned) {
    RankState* rank = nullptr;
    if (auto jit = c_.jobs_.find(name); jit != c_.jobs_.end()) {
      if (auto rit = jit->second.ranks.find(p.rank); rit != jit->second.ranks.end()) rank = &rit->second;
    }
    if (!intact.ok() || rank == nullptr) {
      (void)c_.Slots(*p.segment).Release(p.ticket, SlotState::kPersisting);
      c_.Mirror(*p.segment, p.ticket.slot);
      const std::string instead = std::string("not writing it ") + why;
      if (!p.verified.ok()) MemoryFailedLocked(c_, *p.segment, name, p.rank, step, p.verified, instead.c_str());
      continue;
    }
    // Signalled in the attempt of the process that took it, as its own disk saves are.
    PersistRequest request = c_.save->MakePersistRequest(name, p.rank, rank->session_id, rank->process, p.resident->world_size,
                                                p.resident->attempt, p.segment, p.ticket, step, p.resident->extra);
    request.sole_writer = c_.HoldsEveryRankLocked(name, p.resident->world_size);
    if (Status submitted = c_.writer_->Submit(std::move(request)); !submitted.ok()) {
      (void)c_.Slots(*p.segment).Release(p.ticket, SlotState::kPersisting);
      c_.Mirror(*p.segment, p.ticket.slot);
      Logger("writer")->error("persist {} not queued job={} step={} rank={} error=\"{}\"", why, name, step, p.rank,
                              submitted.ToString());
      if (submit_error.ok()) submit_error = submitted;
      continue;
    }
    ranks += 1;
  }
  c_.cv_.NotifyAll();
  if (!intact.ok()) {
    Logger("writer")->error("persist {}: job={} memory step={} not written: a rank's copy failed its checksums", why,
                            name, step);
    return intact.WithContext("memory step " + std::to_string(step) + " of job '" + name + "'");
  }
  if (!submit_error.ok()) return submit_error;
  Logger("writer")->info("persist {}: job={} memory step={} ranks={} (disk's latest: {})", why, name, step, ranks,
                         disk < 0 ? std::string("none") : std::to_string(disk));
  return ranks;
}

uint32_t MemoryTier::PersistMemoryOnStop() {
  // Per job: the memory steps every rank of it here holds, newest first.
  std::map<std::string, std::vector<int64_t>> common;
  {
    MutexLock lock(&c_.mu_);
    for (const auto& [name, job] : c_.jobs_) {
      std::vector<int64_t> steps = CommonMemoryStepsLocked(c_, job);
      if (!steps.empty()) common[name] = std::move(steps);
    }
  }
  uint32_t queued = 0;
  for (const auto& [name, steps] : common) {
    // Read without the lock. A root that cannot be read: the memory checkpoint is written anyway
    // (a step already complete on disk is then written again, which is harmless).
    Result<std::optional<int64_t>> latest = c_.catalog_.LatestComplete(name);
    const int64_t disk = latest.ok() ? latest->value_or(-1) : -1;
    const int64_t step = steps.front();
    if (step <= disk) {
      Logger("writer")->info("persist on stop: job={} newest memory step={} is not newer than the disk's step={}",
                             name, step, disk);
      continue;
    }
    Result<uint32_t> ranks = PersistMemoryStep(name, step, disk, "on stop");
    if (ranks.ok()) queued += *ranks;
  }
  return queued;
}
void MemoryTier::MemoryFailedLocked(Core& c_, RankSegment& segment, const std::string& job, uint32_t rank, int64_t step,
                                const Status& error, const char* instead) {
  const uint32_t dropped = DropMemoryFrom(c_, segment, std::numeric_limits<int64_t>::min());
  Logger("restore")->warn("memory checkpoint failed its checksums, {} instead job={} rank={} step={} dropped={} "
                          "error=\"{}\"",
                          instead, job, rank, step, dropped, error.ToString());
  DaemonEvent event;
  event.kind = DaemonEvent::Kind::kMemoryFallback;
  event.job = job;
  event.rank = rank;
  event.step = step;
  event.reason = error.ToString();
  c_.Emit(std::move(event));
}

Status MemoryTier::VerifyResident(const std::string& job, uint32_t rank, const std::shared_ptr<RankSegment>& segment,
                              int64_t step, ParallelLoop* verifiers, const char* instead, std::string* extra) {
  std::optional<SlotTicket> ticket;
  std::shared_ptr<const ResidentCheckpoint> resident;
  {
    MutexLock lock(&c_.mu_);
    ticket = c_.Slots(*segment).AcquireResident(step);
    if (!ticket) return NotFound("memory checkpoint step " + std::to_string(step) + " is no longer held");
    resident = c_.Slots(*segment).ResidentIn(ticket->slot);
    c_.Slots(*segment).SetLoading(ticket->slot, true);
    c_.Mirror(*segment, ticket->slot);
  }
  Status verified = VerifyResidentBytes(*segment, ticket->slot, *resident, verifiers);
  MutexLock lock(&c_.mu_);
  c_.Slots(*segment).SetLoading(ticket->slot, false);
  (void)c_.Slots(*segment).Release(*ticket, SlotState::kRestoring);  // still holding it
  c_.Mirror(*segment, ticket->slot);
  c_.cv_.NotifyAll();
  if (!verified.ok()) MemoryFailedLocked(c_, *segment, job, rank, step, verified, instead);
  if (verified.ok() && extra != nullptr) *extra = resident->extra;
  return verified;
}

Status MemoryTier::VerifyResidentBytes(const RankSegment& segment, uint32_t slot, const ResidentCheckpoint& resident,
                                       ParallelLoop* verifiers, bool tensors_in_client) {
  RETURN_IF_ERROR(tensors_in_client
                      ? CheckSlotChecksumsFit(segment.layout, resident.sums)
                      : VerifySlotChecksums(segment.Slot(slot), segment.layout, resident.sums, verifiers));
  if (!segment.ema) return Status::OK();
  if (!resident.ema) {
    return FailedPrecondition("memory checkpoint step " + std::to_string(resident.step) +
                              " holds no EMA, and the rank has EMA tensors");
  }
  Status ema = VerifySlotChecksums(segment.SlotEmaBase(slot), segment.ema->plan().layout, resident.ema_sums, verifiers);
  return ema.ok() ? ema : ema.WithContext("the EMA image of memory checkpoint step " + std::to_string(resident.step));
}

std::vector<int64_t> MemoryTier::CommonMemoryStepsLocked(const Core& c_, const JobState& job) {
  bool first = true;
  std::vector<int64_t> steps;
  for (const auto& [r, rank] : job.ranks) {
    if (!rank.segment) continue;
    std::vector<int64_t> held = c_.Slots(*rank.segment).ResidentSteps();  // newest first
    steps = first ? std::move(held) : StepsAlsoIn(steps, held);
    first = false;
  }
  return steps;
}

bool MemoryTier::MemoryStepWrittenLocked(const Core& c_, const JobState& job, int64_t step) {
  for (const auto& [r, rank] : job.ranks) {
    if (!rank.segment) continue;
    const std::vector<int64_t> held = c_.Slots(*rank.segment).ResidentSteps();
    if (std::find(held.begin(), held.end(), step) == held.end()) continue;
    if (rank.last_persisted < step) return false;
  }
  return true;
}

}  // namespace flashckpt

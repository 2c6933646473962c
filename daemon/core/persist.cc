// After a commit (SavePath, save_path.h): the pipeline it is sent down (SendOnLocked), the persist
// request the writer gets, the one completion each snapshot reports back (the writer's OnPersisted,
// or the EMA stage's OnStageDone for one not persisted), and WaitPersisted.

#include <algorithm>

#include "common/base/log.h"
#include "common/base/names.h"
#include "daemon/core/lineage.h"
#include "daemon/core/memory_tier.h"
#include "daemon/core/save_path.h"

namespace flashckpt {
namespace {

constexpr size_t kMaxFailedSteps = 64;  // failed steps remembered per rank for WaitPersisted

// The state directory's record of a memory checkpoint kept in `slot` (`written`: a disk snapshot,
// kept once written).
MemoryRecord MemoryRecordOf(uint32_t slot, const ResidentCheckpoint& resident, bool written) {
  MemoryRecord record;
  record.slot = slot;
  record.written = written;
  record.step = resident.step;
  record.resumed_from = resident.attempt.resumed_from;
  record.run_id = resident.attempt.run_id;
  record.world_size = resident.world_size;
  record.extra = resident.extra;
  record.checksum_chunk = resident.sums.chunk_bytes;
  record.first_chunk = resident.sums.first;
  record.sums = resident.sums.sums;
  record.ema = resident.ema;
  record.ema_sums = resident.ema_sums;
  return record;
}

// Records a memory checkpoint kept in `slot` of segment `segment_name` in the state directory, before
// the slot's header says it holds it; a failure leaves the checkpoint kept but not adoptable.
void SaveMemoryRecord(Core& c_, const std::string& segment_name, uint32_t slot, const ResidentCheckpoint& resident,
                      bool written) EXCLUDES(c_.mu_) {
  Status saved = c_.state_.SaveMemory(segment_name, MemoryRecordOf(slot, resident, written));
  if (!saved.ok()) {
    c_.state_.RemoveMemory(segment_name, slot);  // an older record of the slot must not match
    Logger("save")->warn("memory checkpoint segment={} step={} not recorded in the state directory: it is kept, "
                         "but a restarted daemon will not adopt it: {}",
                         segment_name, resident.step, saved.ToString());
  }
}

// WaitPersisted (and WaitComplete) of a step the rank committed as a memory checkpoint.
Status MemoryStepNotWritten(int64_t step) {
  return FailedPrecondition("step " + std::to_string(step) +
                            " is a memory checkpoint of this rank (tier memory): the daemon keeps it in memory and "
                            "never writes it, so it is never persisted or complete");
}

// What a trainer is told about a failed save of `step`: the writer's code (kResourceExhausted for a
// full disk) and message (the call, the file, the errno text, what became of this rank's files),
// and what to do.
Status SaveFailed(const std::string& job, int64_t step, const Status& cause, const std::string& root) {
  std::string advice = cause.code() == StatusCode::kResourceExhausted
                           ? "; free space under " + root + " (or run with --keep N) and save again"
                           : "";
  return Status(cause.code(), "saving step " + std::to_string(step) + " of job '" + job + "' failed: " +
                                  cause.message() + "; earlier checkpoints are untouched" + advice);
}

// A persist's outcome in the rank's record: its counts, its newest persisted step, or the step's
// failure (fatal for `session_id` when it registered with fatal_persist_errors). `process`: the
// rank's process that committed it (a predecessor's save finished late counts only in the totals).
void NotePersistOutcomeLocked(Core& c_, const std::string& job, uint32_t rank_id, const std::string& session_id,
                              uint64_t process, int64_t step, const Status& status, uint64_t bytes, double seconds)
    REQUIRES(c_.mu_) {
  auto jit = c_.jobs_.find(job);
  if (jit == c_.jobs_.end()) return;
  auto rit = jit->second.ranks.find(rank_id);
  if (rit == jit->second.ranks.end()) return;
  RankState& rank = rit->second;
  const bool own = rank.process == process;  // else a predecessor's save, finished late
  if (status.ok()) {
    rank.persists += 1;
    if (own) rank.last_persisted = std::max(rank.last_persisted, step);
    jit->second.newest_persisted = std::max(jit->second.newest_persisted, step);
    if (seconds > 0) rank.last_persist_gbps = static_cast<double>(bytes) / seconds / 1e9;
    if (own) rank.failed.erase(step);
  } else {
    rank.failures += 1;
    rank.last_error = "step " + std::to_string(step) + ": " + status.ToString();
    if (own) rank.failed[step] = status;
    while (rank.failed.size() > kMaxFailedSteps) rank.failed.erase(rank.failed.begin());
    if (rank.fatal_persist_errors && rank.session_id == session_id && rank.fatal_error.ok()) {
      Status failed = SaveFailed(job, step, status, c_.config_.root);
      rank.fatal_error = Status(failed.code(), failed.message() +
                                                   "; no snapshot is taken after a failed save as this rank "
                                                   "registered with fatal_persist_errors: fix the cause and "
                                                   "restart the trainer, which resumes from the last complete "
                                                   "checkpoint");
    }
  }
}

}  // namespace

PersistRequest SavePath::MakePersistRequest(const std::string& job, uint32_t rank, const std::string& session_id,
                                          uint64_t process,
                                          uint32_t world_size, const Attempt& attempt,
                                          const std::shared_ptr<RankSegment>& segment, const SlotTicket& ticket,
                                          int64_t step, std::string extra,
                                          std::shared_ptr<const ResidentCheckpoint> once_written) {
  PersistRequest req;
  req.job = job;
  req.rank = rank;
  req.world_size = world_size;
  req.node = c_.config_.node_name;
  req.step = step;
  req.attempt = attempt;
  req.layout = &segment->layout;
  req.slot = segment->Slot(ticket.slot);
  if (segment->ema) {
    req.ema_layout = &segment->ema->plan().layout;
    req.ema_base = segment->SlotEmaBase(ticket.slot);
  }
  req.extra = std::move(extra);
  req.keep_alive = segment;
  req.header = reinterpret_cast<const SlotHeader*>(segment->Slot(ticket.slot));
  req.copy_timeout = c_.config_.copy_timeout;
  req.mixed = [this, job, rank, session_id, step](const std::map<uint32_t, Signal>& signals) {
    c_.lineage->OnMixedStep(job, rank, session_id, step, signals);
  };
  req.done = [this, job, rank, session_id, process, segment, ticket, step, once_written](
                 const Status& s, uint64_t bytes, double secs) {
    OnPersisted(job, rank, session_id, process, segment, ticket, step, once_written, s, bytes, secs);
  };
  return req;
}

Status SavePath::SendOnLocked(Core& c_, EmaJob job) {
  RankSegment& segment = *job.segment;
  const bool to_stage = job.ema != nullptr || job.resident != nullptr;
  if (!job.persist && !to_stage) {
    RETURN_IF_ERROR(c_.Slots(segment).Release(job.ticket, SlotState::kCommitted));
    c_.Mirror(segment, job.ticket.slot);
    c_.cv_.NotifyAll();
    return Status::OK();
  }
  if (job.persist) {
    RETURN_IF_ERROR(c_.Slots(segment).BeginPersist(job.ticket));
    if (job.resident) {
      Status kept = c_.Slots(segment).KeepOnceWritten(job.ticket, job.resident);
      if (!kept.ok()) Logger("save")->error("disk snapshot not kept in memory: {}", kept.ToString());
    }
    c_.Mirror(segment, job.ticket.slot);
  }
  if (to_stage) {
    c_.ema_stage_->Submit(std::move(job));  // in commit order
    return Status::OK();
  }
  Status submitted = c_.writer_->Submit(std::move(job.request));
  if (!submitted.ok()) {
    c_.state_.RemoveCommit(segment.shm->name(), job.ticket.slot);
    (void)c_.Slots(segment).Release(job.ticket, SlotState::kPersisting);
    c_.Mirror(segment, job.ticket.slot);
    c_.cv_.NotifyAll();
    Logger("writer")->error("persist not queued job={} step={} rank={} error=\"{}\"", job.job, job.step, job.rank,
                            submitted.ToString());
    return submitted;
  }
  return Status::OK();
}

void SavePath::OnStageDone(EmaJob job) {
  if (job.resident && !job.resident->dropped.load()) {
    // Recorded before the slot's header says it holds the checkpoint (below), so a restarted daemon
    // finds the checksums of every memory checkpoint it may adopt.
    SaveMemoryRecord(c_, job.segment->shm->name(), job.ticket.slot, *job.resident, /*written=*/false);
  }
  // A snapshot of a rank with EMA (EMA-only, or a memory checkpoint) has a commit record, so that a
  // restarted daemon still applies it: no longer needed once applied.
  if (job.segment->ema) c_.state_.RemoveCommit(job.segment->shm->name(), job.ticket.slot);
  // Released after the lock: when the job holds the last reference to a retired segment, unmapping
  // and unlinking it must not happen under c_.mu_.
  std::shared_ptr<RankSegment> held = job.segment;
  MutexLock lock(&c_.mu_);
  RankSegment& segment = *job.segment;
  Status done = Status::OK();
  if (job.resident) {
    auto& pending = c_.MemoryPending(segment);
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](const RankSegment::PendingMemory& p) { return p.resident == job.resident; }),
                  pending.end());
    // Not kept: the trainer's copies failed (the EMA stage logged why), or it was dropped.
    const bool keep = !job.resident->dropped.load();
    if (!keep) {
      Logger("save")->info("memory checkpoint not kept job={} rank={} step={}: dropped, or its copies failed",
                           job.job, job.rank, job.step);
    }
    done = keep ? c_.Slots(segment).MakeResident(job.ticket, job.resident)
                : c_.Slots(segment).Release(job.ticket, SlotState::kCommitted);
    c_.Mirror(segment, job.ticket.slot);
    if (keep && done.ok()) MemoryTier::OfferReplicaLocked(c_, job.segment, job.ticket.slot, job.job, job.rank);
  } else {
    done = c_.Slots(segment).Release(job.ticket, SlotState::kCommitted);
    c_.Mirror(segment, job.ticket.slot);
  }
  if (!done.ok()) Logger("save")->error("slot not freed after the EMA stage: {}", done.ToString());
  c_.cv_.NotifyAll();
}

void SavePath::OnPersisted(const std::string& job, uint32_t rank_id, const std::string& session_id, uint64_t process,
                         const std::shared_ptr<RankSegment>& segment, SlotTicket ticket, int64_t step,
                         const std::shared_ptr<const ResidentCheckpoint>& once_written, const Status& status,
                         uint64_t bytes, double seconds) {
  if (status.code() == StatusCode::kCancelled) {
    MutexLock lock(&c_.mu_);
    if (c_.Slots(*segment).at(ticket.slot).tier == SlotTier::kMemory) {
      // A memory checkpoint written at the stop (--persist-on-stop) has no commit record: nothing
      // is left for the next daemon, and the write was only ever a bonus.
      Logger("writer")->warn("persist on stop cut off at the stop timeout job={} step={} rank={}: not written ({})",
                             job, step, rank_id, status.message());
      return;
    }
    // Abandoned at the stop timeout (its temporaries and partial files removed): as after a crash,
    // the commit record and the segment stay, and the slot stays PERSISTING in its mirror, so the
    // next daemon adopts it and writes it without passing it through the EMA stage again.
    segment->shm->KeepName();
    c_.stop_abandoned_ += 1;
    c_.NoteAbandonedLocked(job, rank_id, step);
    Logger("writer")->warn("abandoned job={} step={} rank={} stage=write: committed, left to the next daemon ({})", job,
                           step, rank_id, status.message());
    DaemonEvent event;
    event.kind = DaemonEvent::Kind::kPersistAbandoned;
    event.job = job;
    event.rank = rank_id;
    event.step = step;
    event.reason = "write cut off at the stop timeout";
    c_.Emit(std::move(event));
    c_.cv_.NotifyAll();
    return;
  }
  // Written (or failed and reported): a restarted daemon must not write it again.
  c_.state_.RemoveCommit(segment->shm->name(), ticket.slot);
  if (status.ok() && once_written && !once_written->dropped.load()) {
    // Recorded before the slot's header says it holds the checkpoint (ReleaseWritten, below).
    SaveMemoryRecord(c_, segment->shm->name(), ticket.slot, *once_written, /*written=*/true);
  }
  MutexLock lock(&c_.mu_);
  if (c_.stopping_ && status.ok()) c_.stop_finished_ += 1;
  // Written: the slot keeps it as a memory checkpoint when the rank takes them (KeepOnceWritten).
  Status released = status.ok() ? c_.Slots(*segment).ReleaseWritten(ticket)
                                : c_.Slots(*segment).Release(ticket, SlotState::kPersisting);
  if (!released.ok()) Logger("writer")->error("slot release after persist failed: {}", released.ToString());
  c_.Mirror(*segment, ticket.slot);
  if (released.ok() && status.ok()) MemoryTier::OfferReplicaLocked(c_, segment, ticket.slot, job, rank_id);  // kept once written
  NotePersistOutcomeLocked(c_, job, rank_id, session_id, process, step, status, bytes, seconds);
  DaemonEvent event;
  event.job = job;
  event.rank = rank_id;
  event.step = step;
  event.bytes = bytes;
  event.seconds = seconds;
  if (!status.ok()) {
    event.kind = DaemonEvent::Kind::kPersistFailed;
    event.code = std::string(StatusCodeName(status.code()));
    event.reason = status.message();
  } else {
    event.kind = DaemonEvent::Kind::kPersisted;
  }
  c_.Emit(std::move(event));
  if (status.ok()) {
    double gbps = seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
    Logger("writer")->info("persisted job={} step={} rank={} bytes={} secs={:.3f} gbps={:.2f}", job, step, rank_id,
                           FormatBytes(bytes), seconds, gbps);
  } else {
    Logger("writer")->error("persist failed job={} step={} rank={} error=\"{}\"", job, step, rank_id,
                            status.ToString());
  }
  c_.cv_.NotifyAll();
}

// A stop does not fail a waiter: it still finishes the writes in flight until its deadline, so
// the waiter learns its step's outcome (written, failed, or left to the next daemon) within its
// own timeout. The stop empties the job table when it is done with the writes; a waiter that
// wakes after that reads what the stop left of its rank (c_.stopped_ranks_).
Result<WaitResult> SavePath::WaitPersisted(const std::string& session_id, int64_t step,
                                         std::chrono::milliseconds timeout) {
  auto deadline = c_.clock_.Now() + timeout;
  std::string job;
  bool timed_out = false;
  MutexLock lock(&c_.mu_);
  for (;;) {
    bool final = false;
    ASSIGN_OR_RETURN(const RankState* rank, c_.WaitedRank(session_id, &final));
    job = c_.sessions_.at(session_id).job;
    if (!rank->split_error.ok()) return rank->split_error;
    if (auto failed = rank->failed.find(step); failed != rank->failed.end()) {
      // The writer's error keeps its code (kResourceExhausted for a full disk) and names the file.
      return SaveFailed(job, step, failed->second, c_.config_.root);
    }
    if (rank->memory_steps.count(step) != 0) return MemoryStepNotWritten(step);
    if (rank->last_persisted >= step) {
      WaitResult r;
      r.persisted_step = rank->last_persisted;
      lock.Unlock();
      ASSIGN_OR_RETURN(r.checkpoint_complete, c_.catalog_.IsComplete(job, step));
      return r;
    }
    if (rank->abandoned.count(step) != 0) {
      // UNAVAILABLE, as for a daemon that is down: the step is not lost, the next daemon adopts
      // its slot segment and writes it.
      return Unavailable("step " + std::to_string(step) + " of job '" + job +
                         "' was committed but not written before the daemon's stop timeout (--stop-timeout); it "
                         "was left to the next daemon, which writes it when it starts: wait for it again once "
                         "the daemon has restarted");
    }
    if (rank->last_committed < step) {
      // Persisted before a daemon restart, which forgot it: the rank's signal is on disk.
      const uint32_t rank_id = c_.sessions_.at(session_id).rank;
      const Attempt attempt = rank->attempt();
      lock.Unlock();
      ASSIGN_OR_RETURN(bool signalled, c_.catalog_.HasSignal(job, rank_id, step, attempt));
      if (signalled) {
        WaitResult r;
        r.persisted_step = step;
        ASSIGN_OR_RETURN(r.checkpoint_complete, c_.catalog_.IsComplete(job, step));
        return r;
      }
      lock.Lock();
      ASSIGN_OR_RETURN(rank, c_.WaitedRank(session_id, &final));
      if (rank->last_committed >= step) continue;
      return FailedPrecondition("step " + std::to_string(step) + " was never committed by this rank (last commit: " +
                                std::to_string(rank->last_committed) + ")");
    }
    if (final) {
      // The stop is done with every write and this step was none of them.
      return Unavailable("the daemon stopped before step " + std::to_string(step) + " of job '" + job +
                         "' was written; connect again once it has restarted");
    }
    if (timed_out) {
      return DeadlineExceeded("step " + std::to_string(step) + " was not persisted within " +
                              std::to_string(timeout.count()) +
                              " ms (last persisted: " + std::to_string(rank->last_persisted) + ")");
    }
    // Looked at once more after the deadline: the rank may be gone from the job table by then.
    timed_out = !c_.clock_.WaitUntil(&c_.cv_, &lock, deadline);
  }
}

}  // namespace flashckpt

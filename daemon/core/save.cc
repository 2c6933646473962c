// The save path of the daemon: BeginSnapshot hands out a slot, Commit sends the snapshot down the
// pipeline (SendOnLocked and the completions are in persist.cc).

#include <algorithm>

#include "common/base/log.h"
#include "common/base/names.h"
#include "daemon/core/lineage.h"
#include "daemon/core/memory_tier.h"
#include "daemon/core/registrar.h"
#include "daemon/core/save_path.h"

namespace flashckpt {
namespace {

constexpr size_t kMaxExtraBytes = 4u << 20;
constexpr size_t kMaxMemorySteps = 64;  // memory checkpoint steps remembered per rank, likewise

// The state directory's record of a commit, when the snapshot will be persisted or averaged: the
// name of the rank's segment it goes with (empty: none needed, or the ticket is not FILLING, which
// SlotTable::Commit then refuses with its reason). Refuses a commit of a rank with a fatal error, and
// persist=true for a memory checkpoint.
Result<std::string> CommitRecordLocked(Core& c_, const std::string& session_id, const SlotTicket& ticket, int64_t step,
                                       bool persist, std::optional<double> loss, const std::string& extra,
                                       CommitRecord* record) REQUIRES(c_.mu_) {
  ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
  if (!rank->fatal_error.ok()) return rank->fatal_error;  // the client aborts its slot
  const SlotTable& slots = c_.Slots(*rank->segment);
  const SlotInfo* slot = ticket.slot < slots.size() ? &slots.at(ticket.slot) : nullptr;
  if (slot != nullptr && slot->generation == ticket.generation && slot->tier == SlotTier::kMemory && persist) {
    return InvalidArgument("step " + std::to_string(step) + " was begun as a memory checkpoint: commit it with "
                           "persist=false (a memory checkpoint is kept in its slot, not written)");
  }
  if (slot == nullptr || slot->state != SlotState::kFilling || slot->generation != ticket.generation ||
      !(persist || rank->segment->ema)) {
    return std::string();
  }
  record->slot = ticket.slot;
  record->generation = ticket.generation;
  record->step = step;
  record->persist = persist;
  record->resumed_from = rank->resumed_from;
  record->run_id = rank->run_id;
  record->world_size = rank->topology.world_size;
  record->loss = loss;
  if (persist) record->extra = extra;
  return rank->segment->shm->name();
}

// A commit accepted by the slots: the rank's counts and steps, the attempt of a persisted step
// (NoteAttemptLocked), and the SNAPSHOT_COMMITTED event.
void NoteCommittedLocked(Core& c_, RankState* rank, const SessionInfo& who, const std::string& session_id,
                         const SlotTicket& ticket, int64_t step, bool persist, bool memory) REQUIRES(c_.mu_) {
  c_.Mirror(*rank->segment, ticket.slot);
  rank->snapshots += 1;
  rank->last_committed = step;
  rank->failed.erase(step);  // a new attempt at the step: an older failure no longer describes it
  if (memory) {
    rank->memory_steps.insert(step);
    while (rank->memory_steps.size() > kMaxMemorySteps) rank->memory_steps.erase(rank->memory_steps.begin());
  } else {
    rank->memory_steps.erase(step);
  }
  if (persist) Lineage::NoteAttemptLocked(c_, who.job, who.rank, session_id, step, rank->attempt());
  DaemonEvent event;
  event.kind = DaemonEvent::Kind::kSnapshotCommitted;
  event.job = who.job;
  event.rank = who.rank;
  event.step = step;
  event.bytes = rank->segment->tensor_bytes;
  event.reason = memory ? "memory" : persist ? "persist" : "ema only";
  c_.Emit(std::move(event));
}

// What BeginSnapshot checks once it has let the lock go.
struct BeginChecks {
  std::string job;
  std::map<int64_t, Topology> held;  // steps of an earlier layout to look at on disk
  Topology topology;
  bool check_lineage = false;
  std::string run_id;
  bool overwrite = false;
  bool new_process = true;
  uint64_t check_launch = 0;  // the launch this session joined, to compare with the newest
};

// BeginSnapshot's checks of the rank: a fatal or split error, a run not agreed, a step that does
// not follow the last, a memory checkpoint it cannot take, a layout hold; and what is left to check.
Result<BeginChecks> BeginChecksLocked(Core& c_, const std::string& session_id, int64_t step, SlotTier tier)
    REQUIRES(c_.mu_) {
  BeginChecks checks;
  ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
  checks.job = c_.sessions_[session_id].job;
  const std::string& job = checks.job;
  if (!rank->fatal_error.ok()) return rank->fatal_error;
  if (!rank->split_error.ok()) return rank->split_error;
  if (!rank->run_unagreed.ok() && rank->topology.world_size > 1) {
    // Its ranks on other daemons could be in another run: its checkpoints might never complete.
    return FailedPrecondition(
        "job '" + job + "' rank " + std::to_string(c_.sessions_[session_id].rank) +
        " has no run shared with the job's other ranks: none was named, and agreeing on one through the root "
        "failed (" + rank->run_unagreed.ToString() + "); give every rank of a launch one run id "
        "(ClientOptions::run_id, run_id= in Python, or FLASHCKPT_RUN_ID, e.g. the scheduler's job id with its "
        "restart count), or make the root writable");
  }
  if (step <= rank->last_begun) {
    return InvalidArgument("step " + std::to_string(step) + " does not follow this session's last snapshot, step " +
                           std::to_string(rank->last_begun) + "; steps must increase");
  }
  if (tier == SlotTier::kMemory) {
    RETURN_IF_ERROR(MemoryTier::MemoryTierFits(c_.Slots(*rank->segment).size()));
  }
  ASSIGN_OR_RETURN(checks.held, Registrar::LayoutHoldLocked(c_, job, *rank));
  checks.topology = rank->topology;
  checks.check_lineage = !rank->lineage_checked && rank->resumed_from == 0;
  checks.run_id = rank->run_id;
  checks.overwrite = rank->overwrite;
  checks.new_process = !rank->reattached;
  if (rank->run_agreed && !rank->launch_checked) checks.check_launch = rank->agreed_launch;
  return checks;
}

// BeginSnapshot's checks on disk, without the lock: the layout hold, the launch, the lineage, and a
// step already complete.
Status CheckBeginOnDisk(Core& c_, const std::string& session_id, int64_t step, SlotTier tier,
                        const BeginChecks& checks) EXCLUDES(c_.mu_) {
  const std::string& job = checks.job;
  if (!checks.held.empty()) RETURN_IF_ERROR(c_.registrar->CheckLayoutHold(job, checks.topology, checks.held));
  // The launch first: it deletes nothing, and a rank of a stale launch must not start a lineage.
  if (checks.check_launch > 0) {
    RETURN_IF_ERROR(c_.lineage->CheckLaunchCurrent(session_id, job, checks.run_id, checks.check_launch));
  }
  if (checks.check_lineage) {
    RETURN_IF_ERROR(c_.lineage->CheckLineage(session_id, job, checks.run_id, checks.overwrite, checks.new_process));
  }
  // A memory checkpoint writes no file: no need to look at the disk on the trainer's path.
  ASSIGN_OR_RETURN(bool complete, tier == SlotTier::kMemory ? false : c_.catalog_.IsComplete(job, step));
  if (complete) {
    return AlreadyExists("checkpoint-" + std::to_string(step) + " of job '" + job +
                         "' is already complete; a complete checkpoint is never overwritten");
  }
  return Status::OK();
}

// Takes a free slot for `step` (SavePath::HandOut), waiting until `deadline` (`timeout` after the
// call began) for one unless the rank's backpressure policy is skip. DEADLINE_EXCEEDED when none
// became free; `*waited`: whether it waited at all.
Result<SlotTicket> AwaitSlotLocked(Core& c_, const std::string& session_id, const std::string& job, int64_t step,
                                   SlotTier tier, std::chrono::steady_clock::time_point deadline,
                                   std::chrono::milliseconds timeout, MutexLock* lock, bool* waited)
    REQUIRES(c_.mu_) {
  for (;;) {
    ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
    if (rank->session_id != session_id) return Cancelled("the session was replaced");
    if (auto ticket = c_.Slots(*rank->segment).Acquire(SlotState::kFilling, step, tier)) {
      SavePath::HandOut(c_, rank, *ticket, step);
      return *ticket;
    }
    if (rank->policy == Backpressure::kSkip) {
      rank->skipped += 1;
      Status skipped = ResourceExhausted("no free slot for step " + std::to_string(step) + ": all " +
                                         std::to_string(c_.Slots(*rank->segment).size()) +
                                         " slots are still persisting (backpressure policy skip)");
      DaemonEvent event;
      event.kind = DaemonEvent::Kind::kSnapshotSkipped;
      event.job = job;
      event.rank = c_.sessions_[session_id].rank;
      event.step = step;
      event.reason = skipped.message();
      c_.Emit(std::move(event));
      return skipped;
    }
    *waited = true;
    if (!c_.clock_.WaitUntil(&c_.cv_, lock, deadline)) {
      ASSIGN_OR_RETURN(RankState * r, c_.RankOf(session_id, true));
      if (auto ticket = c_.Slots(*r->segment).Acquire(SlotState::kFilling, step, tier)) {
        SavePath::HandOut(c_, r, *ticket, step);
        return *ticket;
      }
      return DeadlineExceeded("no slot became free within " + std::to_string(timeout.count()) + " ms for step " +
                              std::to_string(step) + "; the disk is slower than the save rate");
    }
  }
}

}  // namespace

// A slot handed out for filling starts complete (copied_until 0: a trainer whose commit goes ahead
// of its copies lowers it before committing) and with its EMA not done (ema_done).
void SavePath::HandOut(Core& c_, RankState* rank, const SlotTicket& ticket, int64_t step) {
  auto* header = reinterpret_cast<SlotHeader*>(rank->segment->Slot(ticket.slot));
  header->ema_done.store(kEmaNotDone, std::memory_order_release);
  header->copied_until.store(0, std::memory_order_release);
  c_.Slots(*rank->segment).SetHandedOut(ticket.slot, c_.clock_.Now());
  c_.Mirror(*rank->segment, ticket.slot);
  rank->last_begun = step;
  rank->process_last_begun = std::max(rank->process_last_begun, step);
}

Result<SlotTicket> SavePath::BeginSnapshot(const std::string& session_id, int64_t step,
                                           std::chrono::milliseconds timeout, SlotTier tier) {
  if (step < 0) return InvalidArgument("step must be non-negative, got " + std::to_string(step));
  BeginChecks checks;
  {
    MutexLock lock(&c_.mu_);
    ASSIGN_OR_RETURN(checks, BeginChecksLocked(c_, session_id, step, tier));
  }
  RETURN_IF_ERROR(CheckBeginOnDisk(c_, session_id, step, tier, checks));
  const auto start = c_.clock_.Now();
  MutexLock lock(&c_.mu_);
  {
    // Memory checkpoints of this step or later belong to a timeline the job has left (it resumed
    // from an earlier step): they are never restored.
    ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
    MemoryTier::DropMemoryFrom(c_, *rank->segment, step);
  }
  bool waited = false;
  Result<SlotTicket> ticket =
      AwaitSlotLocked(c_, session_id, checks.job, step, tier, start + timeout, timeout, &lock, &waited);
  // A wait for a slot shows in the metrics, whether it got one or timed out.
  const bool timed_out = ticket.status().code() == StatusCode::kDeadlineExceeded;
  if (waited && (ticket.ok() || timed_out)) {
    c_.metrics_.ObserveSlotWait(checks.job, std::chrono::duration<double>(c_.clock_.Now() - start).count(),
                                ticket.ok());
  }
  return ticket;
}

Status SavePath::Commit(const std::string& session_id, const SlotTicket& ticket, int64_t step, bool persist,
                      std::optional<double> loss, std::string extra) {
  if (extra.size() > kMaxExtraBytes) {
    return InvalidArgument("extra state of " + std::to_string(extra.size()) + " bytes exceeds the " +
                           std::to_string(kMaxExtraBytes) + "-byte limit");
  }
  // A snapshot that will be persisted or averaged is recorded in the state directory before the
  // commit is acknowledged, so that a restarted daemon still finishes it. Written without the lock.
  CommitRecord record;
  std::string segment_name;
  {
    MutexLock lock(&c_.mu_);
    ASSIGN_OR_RETURN(segment_name, CommitRecordLocked(c_, session_id, ticket, step, persist, loss, extra, &record));
  }
  if (!segment_name.empty()) {
    if (Status saved = c_.state_.SaveCommit(segment_name, record); !saved.ok()) {
      return saved.WithContext("recording the commit of step " + std::to_string(step) + " in the state directory");
    }
  }
  MutexLock lock(&c_.mu_);
  auto rank_or = c_.RankOf(session_id, true);
  Status committed = rank_or.ok() ? c_.Slots(*(*rank_or)->segment).Commit(ticket, step) : rank_or.status();
  if (!committed.ok() || (*rank_or)->segment->shm->name() != segment_name) {
    if (!segment_name.empty()) c_.state_.RemoveCommit(segment_name, ticket.slot);
    if (!committed.ok()) return committed;
  }
  RankState* rank = *rank_or;
  const SessionInfo who = c_.sessions_[session_id];
  const bool memory = c_.Slots(*rank->segment).at(ticket.slot).tier == SlotTier::kMemory;
  NoteCommittedLocked(c_, rank, who, session_id, ticket, step, persist, memory);

  std::shared_ptr<RankSegment> segment = rank->segment;
  EmaJob job;
  job.step = step;
  job.loss = loss;
  job.persist = persist;
  job.job = who.job;
  job.rank = who.rank;
  // A memory checkpoint is kept in its slot once the EMA stage has computed its checksums over the
  // finished copies (with the rank's EMA, the EMA of its step too). A disk snapshot of a rank that takes memory checkpoints is also checksummed by
  // the EMA stage, and kept as the rank's newest memory checkpoint once written
  // (SlotTable::KeepOnceWritten).
  const bool also_memory = persist && rank->memory_checkpoints && !segment->ema;
  if (memory || also_memory) {
    job.resident = std::make_shared<ResidentCheckpoint>();
    job.resident->step = step;
    job.resident->attempt = rank->attempt();
    job.resident->world_size = rank->topology.world_size;
    job.resident->extra = memory ? std::move(extra) : extra;  // a disk snapshot's request takes the original
    if (memory) c_.MemoryPending(*segment).push_back({ticket.slot, job.resident});
  }
  PointEmaJobAt(segment, ticket, &job);
  if (persist) {
    job.request = MakePersistRequest(who.job, who.rank, session_id, rank->process, rank->topology.world_size,
                                     rank->attempt(), segment, ticket, step, std::move(extra), job.resident);
    job.request.committed_ms = c_.clock_.WallMs();
    job.request.sole_writer = c_.HoldsEveryRankLocked(who.job, rank->topology.world_size);
  }
  return SendOnLocked(c_, std::move(job));
}

Status SavePath::AbortSnapshot(const std::string& session_id, const SlotTicket& ticket) {
  MutexLock lock(&c_.mu_);
  ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
  RETURN_IF_ERROR(c_.Slots(*rank->segment).Release(ticket, SlotState::kFilling));
  c_.Mirror(*rank->segment, ticket.slot);
  c_.cv_.NotifyAll();
  return Status::OK();
}

}  // namespace flashckpt

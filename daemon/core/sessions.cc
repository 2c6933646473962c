// Sessions: a trainer rank's session opened and closed, and the rank state a call finds by its
// session id.

#include "common/base/log.h"
#include "common/base/names.h"
#include "daemon/core/registrar.h"
#include "daemon/core/texts.h"

namespace flashckpt {

Result<std::string> Registrar::OpenSession(const std::string& job, uint32_t rank, bool reattach) {
  RETURN_IF_ERROR(ValidateJobName(job));
  ASSIGN_OR_RETURN(std::string token, RandomToken());
  MutexLock lock(&c_.mu_);
  if (c_.stopping_) return Unavailable(kStoppingMessage);
  // A restarted trainer may connect before the daemon has seen its predecessor's stream break.
  auto deadline = c_.clock_.Now() + std::chrono::seconds(3);
  for (;;) {
    if (c_.stopping_) return Unavailable(kStoppingMessage);
    if (c_.releasing_.count(job) != 0) {  // its segments are being unlinked: a moment
      if (!c_.clock_.WaitUntil(&c_.cv_, &lock, deadline)) {
        return Unavailable("job '" + job + "' is being released (its shared memory given back); connect again");
      }
      continue;
    }
    auto jit = c_.jobs_.find(job);
    if (jit == c_.jobs_.end()) break;
    auto rit = jit->second.ranks.find(rank);
    if (rit == jit->second.ranks.end() || rit->second.session_id.empty()) break;
    if (!c_.clock_.WaitUntil(&c_.cv_, &lock, deadline)) {
      return FailedPrecondition("rank " + std::to_string(rank) + " of job '" + job +
                                "' already has a live session; one process per rank");
    }
  }
  RankState& state = c_.jobs_[job].ranks[rank];
  state.session_id = token;
  state.last_begun = -1;
  state.resumed_from = 0;
  state.client_verifying.reset();
  state.run_id.clear();
  state.pending_run.clear();
  state.run_agreed = false;
  state.run_unagreed = Status::OK();
  state.agreed_launch = 0;
  state.launch_checked = false;
  state.split_error = Status::OK();
  state.reattached = reattach;
  if (!reattach || state.attempt_began_ms == 0) state.attempt_began_ms = c_.clock_.WallMs();
  // A process that re-attaches keeps its token, unless this daemon has none for it (it re-attached
  // after a restart): it needs one to take part in the job's agreement with other daemons.
  if (!reattach || state.process_token.empty()) {
    state.process_token = c_.instance_ + "-" + std::to_string(++c_.processes_seen_);
  }
  if (!reattach) {
    // A new process: the steps its predecessor committed and persisted are not its own, and a
    // WaitPersisted of the new one must not be answered by them (a step persisted before, by
    // another process, is still found through its signal on disk).
    state.process += 1;
    state.process_last_begun = -1;
    state.lineage_checked = false;
    state.last_committed = -1;
    state.last_persisted = -1;
    state.failed.clear();
    state.memory_steps.clear();
  }
  state.registered = false;
  state.fatal_error = Status::OK();  // a new trainer process: a failure of the previous one is not its own
  c_.sessions_[token] = SessionInfo{job, rank};
  Logger("rpc")->info("session open job={} rank={} reattach={}", job, rank, reattach);
  return token;
}

void Registrar::CloseSession(const std::string& session_id) {
  MutexLock lock(&c_.mu_);
  auto it = c_.sessions_.find(session_id);
  if (it == c_.sessions_.end()) return;
  auto& rank = c_.jobs_[it->second.job].ranks[it->second.rank];
  uint32_t abandoned = 0;
  if (rank.session_id == session_id) {
    rank.session_id.clear();
    rank.gone_since = c_.clock_.Now();
    if (rank.segment) {
      abandoned = c_.Slots(*rank.segment).AbandonInFlight();
      for (uint32_t i = 0; i < c_.Slots(*rank.segment).size(); ++i) c_.Mirror(*rank.segment, i);
      // A memory snapshot committed before its (streamed) copies finished never will be: the trainer
      // is gone. It is dropped now rather than waited for until the copy timeout.
      // So is a disk snapshot's keeping once written: the writer fails it at the copy timeout.
      auto unfinished = [&](uint32_t slot) {
        const auto& header = *reinterpret_cast<const SlotHeader*>(rank.segment->Slot(slot));
        const uint64_t until = header.copied_until.load(std::memory_order_acquire);
        return until != 0 && until < rank.segment->layout.slot_bytes;
      };
      for (const auto& p : c_.MemoryPending(*rank.segment)) {
        if (unfinished(p.slot)) p.resident->dropped.store(true);
      }
      for (uint32_t i = 0; i < c_.Slots(*rank.segment).size(); ++i) {
        const auto& once_written = c_.Slots(*rank.segment).at(i).once_written;
        if (once_written != nullptr && unfinished(i)) once_written->dropped.store(true);
      }
    }
  }
  Logger("rpc")->info("session closed job={} rank={} abandoned_slots={}", it->second.job, it->second.rank, abandoned);
  c_.sessions_.erase(it);
  c_.cv_.NotifyAll();
}

SessionCounts Registrar::CountSessions() const {
  MutexLock lock(&c_.mu_);
  SessionCounts counts;
  counts.jobs = c_.jobs_.size();
  for (const auto& [name, job] : c_.jobs_) {
    counts.ranks += job.ranks.size();
    for (const auto& [r, rank] : job.ranks) counts.connected += rank.session_id.empty() ? 0 : 1;
  }
  return counts;
}
}  // namespace flashckpt

// Runs and attempts: which run a registration joins, the lineage check of a session's first
// snapshot (a fresh start never inherits another run's checkpoints), split attempts (ranks that
// saved one step in different attempts, so it never completes), and WaitComplete.
#include <algorithm>

#include "common/base/log.h"
#include "daemon/core/lineage.h"
#include "daemon/core/save_path.h"

namespace flashckpt {
namespace {

constexpr size_t kTrackedSteps = 64;  // recent steps whose committed attempts are compared, per job
constexpr size_t kSplitSteps = 64;    // split steps remembered per job for WaitComplete
// A part of another attempt counts as committed while this attempt ran only when it was committed
// this long after the attempt began: the commits of ranks that restore together (a rollback of the
// whole job) and modest skew between the nodes' clocks are not taken for a split.
constexpr int64_t kConcurrentMarginMs = 1000;

// "step 30: rank 0 in run a1 (fresh), rank 1 in run a1 resumed from step 20"
std::string SplitText(int64_t step, const std::map<uint32_t, Attempt>& by_rank) {
  std::string out = "step " + std::to_string(step) + ":";
  bool first = true;
  for (const auto& [rank, attempt] : by_rank) {
    out += std::string(first ? " " : ", ") + "rank " + std::to_string(rank) + " in " + AttemptText(attempt);
    first = false;
  }
  return out;
}

std::string RanksText(const std::vector<uint32_t>& ranks) {
  std::string out;
  for (uint32_t r : ranks) out += (out.empty() ? "" : ",") + std::to_string(r);
  return out;
}

// "0-3,6" for ranks 0,1,2,3,6 (sorted): a step of a thousand ranks is described in a line.
std::string RangesText(const std::vector<uint32_t>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ",") + std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

// "step 30: ranks 0-3 in run a (fresh); ranks 4-7 in run b (fresh)": the step's signals by attempt.
std::string MixedText(int64_t step, const std::map<uint32_t, Signal>& signals) {
  std::vector<std::pair<Attempt, std::vector<uint32_t>>> groups;
  for (const auto& [rank, signal] : signals) {
    const Attempt attempt = signal.attempt();
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == attempt; });
    if (g == groups.end()) {
      groups.push_back({attempt, {}});
      g = groups.end() - 1;
    }
    g->second.push_back(rank);
  }
  std::string out = "step " + std::to_string(step) + ":";
  for (size_t i = 0; i < groups.size(); ++i) {
    out += std::string(i == 0 ? " " : "; ") + (groups[i].second.size() == 1 ? "rank " : "ranks ") +
           RangesText(groups[i].second) + " in " + AttemptText(groups[i].first);
  }
  return out;
}

}  // namespace

Status Lineage::CheckRunKept(const RankState& state, const Registration& reg) {
  if (state.run_id.empty() || reg.run_id.empty() || reg.run_id == state.run_id) return Status::OK();
  return InvalidArgument("this session belongs to run " + state.run_id + "; a registration cannot move it to run " +
                         reg.run_id + " (a new run is a new process)");
}

bool Lineage::NamedLiveRunLocked(const Core& c_, const JobState& job, uint32_t rank) {
  for (const auto& [r, other] : job.ranks) {
    if (r == rank || other.session_id.empty()) continue;
    if (other.registered && !other.run_id.empty() && !other.run_agreed) return true;
    if (!other.registered && !other.pending_run.empty() && !other.run_agreed) return true;
  }
  return false;
}

std::string Lineage::ChooseRunLocked(const Core& c_, const JobState& job, uint32_t rank, const RankState& state,
                                    const Registration& reg, const std::string& agreed,
                                    const std::string& drawn) {
  if (!state.run_id.empty()) return state.run_id;  // this session registered before: its run is fixed
  if (!reg.run_id.empty()) return reg.run_id;
  if (!state.pending_run.empty()) return state.pending_run;  // chosen by this registration before it waited
  // A run the launcher or user named, live here: it is the job's run.
  for (const auto& [r, other] : job.ranks) {
    if (r != rank && !other.session_id.empty() && other.registered && !other.run_id.empty() && !other.run_agreed) {
      return other.run_id;
    }
  }
  if (!agreed.empty()) return agreed;  // the launch the root says this rank is part of
  for (const auto& [r, other] : job.ranks) {
    if (r == rank || other.session_id.empty()) continue;
    if (other.registered && !other.run_id.empty()) return other.run_id;
  }
  // No live rank is registered: join a registration in progress, else start the run.
  for (const auto& [r, other] : job.ranks) {
    if (r != rank && !other.session_id.empty() && !other.registered && !other.pending_run.empty()) {
      return other.pending_run;
    }
  }
  return drawn;
}

Status Lineage::CheckLineage(const std::string& session_id, const std::string& job, const std::string& run_id,
                            bool overwrite, bool new_process) {
  // The newest complete checkpoint the session would carry on from: the one LATEST names (two small
  // reads), or where there is none (LATEST missing, torn, or naming a step that is gone) the newest
  // on disk, so that a fresh start never carries on after a checkpoint LATEST no longer names. A new
  // process looks at every run's, its own included: its run's checkpoints were written by an earlier
  // process, and one that did not restore is a fresh start, whatever id it reuses.
  ASSIGN_OR_RETURN(std::optional<Catalog::RunCheckpoint> latest, c_.catalog_.LatestRun(job));
  if (!latest) {
    ASSIGN_OR_RETURN(latest, c_.catalog_.NewestComplete(job, new_process ? std::string() : run_id));
  }
  const std::string fix = "restore to continue it, use another job name, or register a new run (another run id, "
                          "or none: the daemon draws one) with overwrite (ClientOptions::overwrite, overwrite=True "
                          "in Python, --fresh) to start a new lineage, which deletes the job's checkpoints of other "
                          "runs";
  if (latest && !latest->run_id.empty() && latest->run_id == run_id && new_process) {
    return FailedPrecondition("job '" + job + "' already has complete checkpoints of run " + run_id +
                              " (the newest is step " + std::to_string(latest->step) +
                              "), written by an earlier process of that run, and this process started fresh "
                              "instead of restoring (a reused run id does not make it the same run): " + fix);
  }
  if (overwrite) {
    std::set<int64_t> busy;
    {
      MutexLock lock(&c_.mu_);
      auto jit = c_.jobs_.find(job);
      if (jit == c_.jobs_.end() || jit->second.overwritten_for.count(run_id) == 0) busy = c_.BusyStepsLocked(job);
      else overwrite = false;  // another rank of the run did it
    }
    if (overwrite) {
      ASSIGN_OR_RETURN(DeletionOutcome outcome, c_.catalog_.DeleteOtherRuns(job, run_id, busy));
      Logger("catalog")->warn("overwrite job={} run={} deleted={} skipped={}: a new lineage starts", job, run_id,
                              outcome.deleted.size(), outcome.skipped.size());
      for (const auto& skipped : outcome.skipped) {
        if (skipped.reason.rfind("already gone", 0) == 0) continue;  // deleted meanwhile (another rank)
        return FailedPrecondition("job '" + job + "': starting run " + run_id + " with overwrite could not delete " +
                                  "checkpoint-" + std::to_string(skipped.step) + " (" + skipped.reason +
                                  "); try again when it is no longer in use");
      }
    }
  } else if (latest && latest->run_id.empty()) {
    // Written before runs had ids: a job that was running when the daemon was upgraded carries on.
    Logger("rpc")->warn("lineage job={} run={}: a complete checkpoint (step {}) has no run id; not checked", job,
                        run_id, latest->step);
  } else if (latest && latest->run_id != run_id) {
    return FailedPrecondition("job '" + job + "' already has complete checkpoints of another run (the newest is step " +
                              std::to_string(latest->step) + ", of run " + latest->run_id + ") and this run (" +
                              run_id + ") started fresh instead of restoring: " + fix);
  }
  MutexLock lock(&c_.mu_);
  if (overwrite) c_.jobs_[job].overwritten_for.insert(run_id);
  auto it = c_.sessions_.find(session_id);
  if (it != c_.sessions_.end()) {
    RankState& rank = c_.jobs_[it->second.job].ranks[it->second.rank];
    if (rank.session_id == session_id) rank.lineage_checked = true;
  }
  return Status::OK();
}

Status Lineage::CheckLaunchCurrent(const std::string& session_id, const std::string& job, const std::string& run_id,
                                  uint64_t launch) {
  ASSIGN_OR_RETURN(uint64_t newest, c_.launches_.Newest(job));
  if (newest > launch) {
    return FailedPrecondition(
        "job '" + job + "': this rank joined launch " + std::to_string(launch) + " (run " + run_id +
        ") through the root, but launch " + std::to_string(newest) +
        " has begun since (ranks that found their places in launch " + std::to_string(launch) +
        " taken: a relaunch), so this rank is not in its launch's run and their checkpoints could never "
        "complete; restart every rank of the job together, or give every rank of a launch one run id "
        "(ClientOptions::run_id, run_id= in Python, or FLASHCKPT_RUN_ID, e.g. the scheduler's job id with its "
        "restart count)");
  }
  MutexLock lock(&c_.mu_);
  auto it = c_.sessions_.find(session_id);
  if (it != c_.sessions_.end()) {
    RankState& rank = c_.jobs_[it->second.job].ranks[it->second.rank];
    if (rank.session_id == session_id) rank.launch_checked = true;
  }
  return Status::OK();
}

void Lineage::NoteAttemptLocked(Core& c_, const std::string& name, uint32_t rank, const std::string& session_id, int64_t step,
                               const Attempt& attempt) {
  JobState& job = c_.jobs_[name];
  auto& by_rank = job.committed_attempts[step];
  by_rank[rank] = JobState::Committed{session_id, attempt};
  // Only live sessions count: a gone one's commit may be overwritten by its successor's.
  std::map<uint32_t, Attempt> live;
  JobState::Split split;
  bool differ = false;
  for (const auto& [r, committed] : by_rank) {
    auto rit = job.ranks.find(r);
    if (rit == job.ranks.end() || rit->second.session_id != committed.session_id) continue;
    live[r] = committed.attempt;
    split.sessions[r] = committed.session_id;
    differ = differ || committed.attempt != attempt;
  }
  // Bounded, oldest steps first (after the last use of by_rank: a resumed run's step may be the
  // oldest one and go at once).
  while (job.committed_attempts.size() > kTrackedSteps) job.committed_attempts.erase(job.committed_attempts.begin());
  if (!differ || LiveSplitLocked(c_, job, step) != nullptr) return;
  split.text = SplitText(step, live);
  NoteSplitLocked(c_, name, rank, step, std::move(split));
}

void Lineage::OnMixedStep(const std::string& name, uint32_t rank, const std::string& session_id, int64_t step,
                         const std::map<uint32_t, Signal>& signals) {
  auto own = signals.find(rank);
  if (own == signals.end()) return;
  MutexLock lock(&c_.mu_);
  auto jit = c_.jobs_.find(name);
  if (jit == c_.jobs_.end() || LiveSplitLocked(c_, jit->second, step) != nullptr) return;  // known already
  JobState& job = jit->second;
  auto rit = job.ranks.find(rank);
  if (rit == job.ranks.end() || session_id.empty() || rit->second.session_id != session_id) return;  // gone
  const int64_t began = rit->second.attempt_began_ms;
  // A part of another attempt committed after this one began (by more than kConcurrentMarginMs) was
  // saved by a live process while this one ran: no rank of either will save the step again in the other's attempt. One committed
  // before is an earlier attempt's, left by a process that has since stopped or restored; its rank
  // overwrites it when it reaches the step in this attempt (WaitComplete names it at its deadline
  // if it never does). Parts that do not say when they were committed are not counted.
  uint32_t live_other = 0;
  for (const auto& [r, signal] : signals) {
    if (signal.attempt() != own->second.attempt() && began > 0 && signal.committed_ms > began + kConcurrentMarginMs) {
      ++live_other;
    }
  }
  if (live_other == 0) {
    Logger("rpc")->info("mixed step job={} {}: parts of an earlier attempt, left before this one began (rank {}); "
                        "they are saved again",
                        name, MixedText(step, signals), rank);
    return;
  }
  JobState::Split split;
  split.text = MixedText(step, signals);
  for (const auto& [r, signal] : signals) {
    auto lit = job.ranks.find(r);
    if (lit != job.ranks.end() && !lit->second.session_id.empty() && lit->second.attempt() == signal.attempt()) {
      split.sessions[r] = lit->second.session_id;  // the ranks of this daemon that took part, still live
    }
  }
  NoteSplitLocked(c_, name, rank, step, std::move(split));
}

const JobState::Split* Lineage::LiveSplitLocked(const Core& c_, const JobState& job, int64_t step) {
  auto it = job.split_steps.find(step);
  if (it == job.split_steps.end()) return nullptr;
  for (const auto& [r, session] : it->second.sessions) {
    auto rit = job.ranks.find(r);
    if (rit == job.ranks.end() || rit->second.session_id != session) return nullptr;  // restarted since
  }
  return &it->second;
}

void Lineage::NoteSplitLocked(Core& c_, const std::string& name, uint32_t rank, int64_t step, JobState::Split split) {
  JobState& job = c_.jobs_[name];
  const std::string text = split.text;
  job.split_steps[step] = std::move(split);
  while (job.split_steps.size() > kSplitSteps) job.split_steps.erase(job.split_steps.begin());
  job.split_attempts += 1;
  job.split = text;
  // Every live rank of the job hears it at its next snapshot or wait: none of its later steps can
  // complete either, in this mix of attempts.
  const Status error = FailedPrecondition("checkpoint-" + std::to_string(step) + " of job '" + name +
                                          "' is split: its ranks saved it in different attempts (" + text +
                                          "), so it and every later step of these processes can never complete; "
                                          "restart every rank of the job from one checkpoint");
  for (auto& [r, state] : job.ranks) {
    if (!state.session_id.empty() && state.split_error.ok()) state.split_error = error;
  }
  Logger("rpc")->error("split attempt job={} {}: this step never completes; restart every rank of the job from one "
                       "checkpoint",
                       name, text);
  DaemonEvent event;
  event.kind = DaemonEvent::Kind::kSplitAttempt;
  event.job = name;
  event.rank = rank;
  event.step = step;
  event.reason = text;
  c_.Emit(std::move(event));
  c_.cv_.NotifyAll();
}

Status Lineage::WaitComplete(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout) {
  const auto deadline = c_.clock_.Now() + timeout;
  // The rank's own part first; complete or not, the commit is over only once LATEST has moved too
  // (IsCommitted below).
  RETURN_IF_ERROR(c_.save->WaitPersisted(session_id, step, timeout).status());
  std::string job;
  uint32_t rank_id = 0, world_size = 0;
  Attempt attempt;
  {
    MutexLock lock(&c_.mu_);
    bool final = false;
    ASSIGN_OR_RETURN(const RankState* rank, c_.WaitedRank(session_id, &final));
    job = c_.sessions_.at(session_id).job;
    rank_id = c_.sessions_.at(session_id).rank;
    world_size = rank->topology.world_size;
    attempt = rank->attempt();
  }
  // WaitPersisted also returns when a later step is durable: a step this rank skipped (or saved in
  // another attempt) has no part of it from this rank and will not complete in this attempt.
  ASSIGN_OR_RETURN(bool complete, c_.catalog_.IsCommitted(job, step));
  if (complete) return Status::OK();
  ASSIGN_OR_RETURN(bool part, c_.catalog_.HasSignal(job, rank_id, step, attempt));
  if (!part) {
    return FailedPrecondition("checkpoint-" + std::to_string(step) + " of job '" + job + "' holds no part of rank " +
                              std::to_string(rank_id) + " in this attempt (" + AttemptText(attempt) +
                              "): it did not save that step (skipped, or saved before it restored)");
  }
  for (;;) {
    {
      MutexLock lock(&c_.mu_);
      bool final = false;
      ASSIGN_OR_RETURN(const RankState* rank, c_.WaitedRank(session_id, &final));
      (void)rank;
      if (final) {
        return Unavailable("the daemon stopped before checkpoint-" + std::to_string(step) + " of job '" + job +
                           "' was complete; this rank's part is written: wait again once it has restarted");
      }
      auto jit = c_.jobs_.find(job);
      if (jit != c_.jobs_.end()) {
        if (const JobState::Split* split = LiveSplitLocked(c_, jit->second, step)) {
          return FailedPrecondition("checkpoint-" + std::to_string(step) + " of job '" + job +
                                    "' is split: its ranks saved it in different attempts (" + split->text +
                                    "), so it can never complete; restart every rank of the job from one checkpoint");
        }
      }
      // Completion by another daemon sharing the root is seen on the next look at the disk.
      const auto next = std::min(deadline, c_.clock_.Now() + std::chrono::milliseconds(200));
      if (c_.clock_.Now() < deadline) (void)c_.clock_.WaitUntil(&c_.cv_, &lock, next);
    }
    // One look at the root per 200 ms for all the ranks of this daemon that wait for the step (a
    // completion by this daemon is known at once); the last look, at the deadline, is a fresh one,
    // and takes metadata.json alone: a LATEST its committer could not write does not make a
    // complete checkpoint an error.
    const bool last = c_.clock_.Now() >= deadline;
    ASSIGN_OR_RETURN(complete, last ? c_.catalog_.IsComplete(job, step)
                                    : c_.catalog_.IsCompleteShared(job, step, std::chrono::milliseconds(200)));
    if (complete) return Status::OK();
    if (last) break;
  }
  // The deadline: what the step's signals say about why it is not complete. A signal of another
  // attempt may be a rank that has not reached the step yet in this one (its old signal is still
  // there), or a split across daemons: both are named, neither is counted as a split here.
  ASSIGN_OR_RETURN(auto attempts, c_.catalog_.SignalAttempts(job, step, world_size));
  std::vector<uint32_t> missing, other;
  for (uint32_t r = 0; r < world_size; ++r) {
    auto a = attempts.find(r);
    if (a == attempts.end()) {
      missing.push_back(r);
    } else if (a->second != attempt) {
      other.push_back(r);
    }
  }
  std::string why = std::to_string(world_size - missing.size() - other.size()) + " of " +
                    std::to_string(world_size) + " ranks have written their part in this attempt (" +
                    AttemptText(attempt) + ")";
  if (!missing.empty()) why += "; waiting for rank(s) " + RanksText(missing);
  if (!other.empty()) {
    why += "; the part of rank(s) " + RanksText(other) + " is of another attempt (" +
           SplitText(step, [&] {
             std::map<uint32_t, Attempt> o;
             for (uint32_t r : other) o[r] = attempts.at(r);
             return o;
           }()) +
           "): they have not saved the step again yet, or they run in another attempt (ranks on several daemons "
           "need one run id: ClientOptions::run_id or FLASHCKPT_RUN_ID)";
  }
  return DeadlineExceeded("checkpoint-" + std::to_string(step) + " of job '" + job + "' is not complete after " +
                          std::to_string(timeout.count()) + " ms: " + why);
}

}  // namespace flashckpt

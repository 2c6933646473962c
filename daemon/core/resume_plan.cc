// The resume planner: the step every rank of a job restores (ResumePlanFor, MakeResumePlan; with
// the job's other daemons, AgreeWithOtherDaemons), and when an agreed plan no longer holds (a
// memory checkpoint it counted on lost or overtaken).

#include <algorithm>

#include "common/base/log.h"
#include "daemon/core/memory_tier.h"
#include "daemon/core/restorer.h"
#include "daemon/core/resume_agreement.h"

namespace flashckpt {
namespace {

// What a rank is published as in the job's agreement: its trainer process and the newest step that
// process began to save. A retry (nothing saved since) meets the decision made for it again; the
// same process asking after it trained on and saved (a rollback) is a new resume, which the daemons
// decide anew, as PlanStaleLocked judges the plan kept here. (A plan file names the tokens of the
// ranks it was made for, and stays in the root for minutes.)
// Empty (not publishable) for a rank whose process has no token.
std::string AgreementToken(const RankState& rank) {
  if (rank.process_token.empty()) return "";
  return rank.process_token + ":" + std::to_string(std::max<int64_t>(rank.process_last_begun, 0));
}

}  // namespace

Result<ResumePlan> Restorer::ResumePlanFor(const std::string& session_id, std::chrono::steady_clock::time_point deadline,
                                         std::chrono::milliseconds timeout) {
  std::string job;
  uint32_t rank_id = 0, world_size = 1;
  bool alone_asked = false;  // no plan here, but the job's other daemons hear of this rank
  {
    MutexLock lock(&c_.mu_);
    for (;;) {
      ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
      job = c_.sessions_[session_id].job;
      rank_id = c_.sessions_[session_id].rank;
      world_size = rank->topology.world_size;
      JobState& state = c_.jobs_[job];
      state.plan_asks[rank_id] = rank->process;  // before any wait: a plan being made includes it
      auto& plan = state.resume_plan;
      if (plan && PlanStaleLocked(c_, state, *plan, *rank)) plan.reset();
      if (plan) {
        if (!plan->lost.ok()) return plan->lost;
        plan->taken[rank_id] = rank->process;  // a retry of the same process takes it again
        return *plan;
      }
      // A job none of whose ranks here holds a memory checkpoint (kept or queued) or says it takes
      // them needs no plan: each rank reads the latest complete checkpoint, as it always has. One
      // that does and has ranks elsewhere agrees with their daemons (MakeResumePlan): they may hold
      // newer steps, or this daemon's ranks may hold none yet (a node that replaced a lost one).
      bool memory = false;
      for (const auto& [r, other] : state.ranks) {
        memory = memory || other.declares_memory_checkpoints ||
                 (other.segment && (!c_.Slots(*other.segment).ResidentSteps().empty() ||
                                    !c_.MemoryPending(*other.segment).empty()));
      }
      if (!memory && !state.planning) {
        if (AllRanksHereLocked(c_, state, world_size) || rank->process_token.empty()) return ResumePlan{};
        // Ranks elsewhere may hold memory checkpoints and wait for every rank's view: this one's
        // holds none, so they decide on the disk, which is what this rank reads. The daemon's view
        // lists every rank here that asked so, whose process is still the one that asked.
        state.alone_asks[rank_id] = {rank->process, AgreementToken(*rank), c_.clock_.Now()};
        state.alone_changes += 1;
        alone_asked = true;
        break;
      }
      if (!state.planning) {
        state.planning = true;
        break;
      }
      if (!c_.clock_.WaitUntil(&c_.cv_, &lock, deadline)) {
        return DeadlineExceeded("another rank of job '" + job + "' did not finish choosing the step to restore within " +
                                std::to_string(timeout.count()) + " ms");
      }
    }
  }
  if (alone_asked) {
    ResumeAgreement agreement(c_.catalog_.JobDir(job) + "/.resume", c_.instance_, c_.RootIo(), c_.clock_);
    ASSIGN_OR_RETURN(std::optional<int64_t> latest, c_.catalog_.LatestComplete(job));
    for (;;) {
      // The view lists every rank here that asked so and still runs the process that asked. Ranks
      // asking at once each write it: one whose list was overtaken meanwhile writes it again.
      std::vector<RankView> alone;
      uint64_t seen = 0;
      {
        MutexLock lock(&c_.mu_);
        auto it = c_.jobs_.find(job);
        if (it == c_.jobs_.end()) return ResumePlan{};
        JobState& state = it->second;
        const auto now = c_.clock_.Now();
        for (auto a = state.alone_asks.begin(); a != state.alone_asks.end();) {
          auto other = state.ranks.find(a->first);
          if (other == state.ranks.end() || other->second.process != a->second.process || a->first >= world_size ||
              now - a->second.at > ResumeAgreement::kViewFresh) {
            a = state.alone_asks.erase(a);
            continue;
          }
          alone.push_back(RankView{a->first, a->second.token, {}});
          ++a;
        }
        seen = state.alone_changes;
      }
      Result<std::optional<AgreedPlan>> round = agreement.Round(world_size, alone, latest.value_or(0));
      if (!round.ok()) {
        Logger("restore")->warn("resume view job={} rank={} not published: {}", job, rank_id,
                                round.status().ToString());
        return ResumePlan{};
      }
      // Every rank's view was fresh, and the daemons' decision is there (the disk's step, or none,
      // since these ranks hold no memory checkpoint): this rank takes it as the others do.
      ResumePlan decided;
      if (round->has_value() && !(*round)->memory) {
        decided.decided = true;
        decided.made = c_.clock_.Now();
        decided.found = (*round)->found;
        decided.step = (*round)->step;
        decided.tier = SlotTier::kDisk;
      }
      MutexLock lock(&c_.mu_);
      auto it = c_.jobs_.find(job);
      if (it == c_.jobs_.end() || it->second.alone_changes == seen) return decided;
    }
  }
  Result<ResumePlan> made = MakeResumePlan(job, world_size, deadline, timeout);
  MutexLock lock(&c_.mu_);
  auto it = c_.jobs_.find(job);
  if (it != c_.jobs_.end()) it->second.planning = false;
  c_.cv_.NotifyAll();
  if (!made.ok()) return made.status();
  if (it == c_.jobs_.end()) return made;
  auto rank = it->second.ranks.find(rank_id);
  if (rank == it->second.ranks.end()) return made;
  made->taken[rank_id] = rank->second.process;
  made->world_size = world_size;
  made->run_id = rank->second.run_id;
  if (world_size > 1) it->second.resume_plan = *made;
  Logger("restore")->info("resume plan job={} step={} from={} ranks={}", job, made->step,
                          made->tier == SlotTier::kMemory ? "memory" : "disk", world_size);
  return made;
}

Result<ResumePlan> Restorer::MakeResumePlan(const std::string& job, uint32_t world_size,
                                          std::chrono::steady_clock::time_point deadline,
                                          std::chrono::milliseconds timeout) {
  ResumePlan plan;
  plan.decided = true;
  plan.made = c_.clock_.Now();
  // The newest complete checkpoint on disk (read without the lock): the plan when memory has nothing
  // newer that every rank holds.
  ASSIGN_OR_RETURN(std::optional<int64_t> latest, c_.catalog_.LatestComplete(job));
  if (latest) {
    plan.found = true;
    plan.step = *latest;
  }
  // Newer replicas of the ranks on the peers join their memory checkpoints.
  for (uint32_t r = 0; r < world_size; ++r) c_.memory->FetchPeerReplica(job, r, deadline);
  bool all_here = false;
  {
    MutexLock lock(&c_.mu_);
    auto it = c_.jobs_.find(job);
    if (it == c_.jobs_.end()) return plan;
    all_here = AllRanksHereLocked(c_, it->second, world_size);
  }
  if (!all_here) return AgreeWithOtherDaemons(job, world_size, latest, deadline, timeout);
  // Memory only when every rank of the job has its segment here and their pending checksums are
  // computed: then the steps all of them hold.
  std::vector<std::shared_ptr<RankSegment>> segments;
  std::vector<int64_t> common;
  {
    MutexLock lock(&c_.mu_);
    for (;;) {
      segments.clear();
      auto it = c_.jobs_.find(job);
      if (it == c_.jobs_.end()) return plan;
      bool pending = false;
      for (uint32_t r = 0; r < world_size; ++r) {
        auto rank = it->second.ranks.find(r);
        if (rank == it->second.ranks.end() || !rank->second.segment ||
            rank->second.topology.world_size != world_size) {
          return plan;
        }
        for (const auto& p : c_.MemoryPending(*rank->second.segment)) pending = pending || !p.resident->dropped.load();
        segments.push_back(rank->second.segment);
      }
      if (!pending) break;
      if (!c_.clock_.WaitUntil(&c_.cv_, &lock, deadline)) {
        return DeadlineExceeded("the checksums of the job's last memory checkpoints were not computed within " +
                                std::to_string(timeout.count()) + " ms");
      }
    }
    for (uint32_t r = 0; r < world_size; ++r) {
      std::vector<int64_t> held = c_.Slots(*segments[r]).ResidentSteps();  // newest first
      common = r == 0 ? std::move(held) : StepsAlsoIn(common, held);
    }
  }
  // Newest first, not older than the disk's: verified on every rank, one after the other, each slot
  // pinned (RESTORING, loading) while its checksums are read without the lock.
  ParallelLoop verifiers(c_.config_.restore_threads > 0 ? c_.config_.restore_threads - 1 : 0);
  for (int64_t step : common) {
    if (latest && step < *latest) break;
    bool everywhere = true;
    for (uint32_t r = 0; r < world_size && everywhere; ++r) {
      Status verified = c_.memory->VerifyResident(job, r, segments[r], step, &verifiers, "the job restores from disk");
      if (verified.code() == StatusCode::kNotFound) everywhere = false;  // taken or dropped meanwhile
      if (!verified.ok() && verified.code() != StatusCode::kNotFound) return plan;  // the disk's
    }
    if (everywhere) {
      plan.found = true;
      plan.step = step;
      plan.tier = SlotTier::kMemory;
      return plan;
    }
  }
  return plan;
}

bool Restorer::AllRanksHereLocked(const Core& c_, const JobState& job, uint32_t world_size) {
  for (uint32_t r = 0; r < world_size; ++r) {
    auto rank = job.ranks.find(r);
    if (rank == job.ranks.end() || !rank->second.segment || rank->second.topology.world_size != world_size) return false;
  }
  return true;
}

Result<ResumePlan> Restorer::AgreeWithOtherDaemons(const std::string& job, uint32_t world_size,
                                                   std::optional<int64_t> latest,
                                                   std::chrono::steady_clock::time_point deadline,
                                                   std::chrono::milliseconds timeout) {
  ResumeAgreement agreement(c_.catalog_.JobDir(job) + "/.resume", c_.instance_, c_.RootIo(), c_.clock_);
  for (;;) {
    // The ranks that asked this daemon (their process still the one that asked), each with the
    // memory checkpoints held of it here once their checksums are computed.
    std::vector<RankView> mine;
    const auto round_began = c_.clock_.Now();
    bool stopping = false;
    {
      MutexLock lock(&c_.mu_);
      stopping = c_.stopping_;
    }
    if (stopping) {
      agreement.Withdraw();  // reads and removes files in the root: not under mu_
      return Unavailable("the daemon is stopping");
    }
    {
      MutexLock lock(&c_.mu_);
      auto it = c_.jobs_.find(job);
      if (it == c_.jobs_.end()) return NotFound("job '" + job + "' was released while its ranks chose a step");
      for (const auto& [r, process] : it->second.plan_asks) {
        auto rank = it->second.ranks.find(r);
        if (r >= world_size || rank == it->second.ranks.end() || rank->second.process != process ||
            !rank->second.segment || rank->second.topology.world_size != world_size) {
          continue;
        }
        bool pending = false;
        for (const auto& p : c_.MemoryPending(*rank->second.segment)) pending = pending || !p.resident->dropped.load();
        if (pending) continue;  // published once its last memory checkpoints are checksummed
        mine.push_back(RankView{r, AgreementToken(rank->second), c_.Slots(*rank->second.segment).ResidentSteps()});
      }
    }
    Result<std::optional<AgreedPlan>> round = agreement.Round(world_size, mine, latest.value_or(0));
    if (!round.ok() || *round) agreement.Withdraw();
    if (!round.ok()) return round.status().WithContext("agreeing with the job's other daemons on the step to restore");
    if (*round) {
      const AgreedPlan& agreed = **round;
      ResumePlan plan;
      plan.decided = true;
      plan.made = c_.clock_.Now();
      plan.found = agreed.found;
      plan.step = agreed.step;
      plan.tier = agreed.memory ? SlotTier::kMemory : SlotTier::kDisk;
      Logger("restore")->info("resume agreed job={} step={} from={} ranks={} here={} plan={}", job, plan.step,
                              agreed.memory ? "memory" : "disk", world_size, mine.size(), agreed.file);
      return plan;
    }
    const auto now = c_.clock_.Now();
    if (now >= deadline) {
      std::string missing;
      for (uint32_t r : agreement.missing()) {
        if (missing.size() > 200) {
          missing += ", ...";
          break;
        }
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      agreement.Withdraw();
      const std::string why = missing.empty() ? "the plan made for these ranks could not be read"
                                              : "no daemon published rank(s) " + missing;
      return DeadlineExceeded("the daemons of job '" + job + "' did not agree on the step to restore within " +
                              std::to_string(timeout.count()) + " ms: " + why +
                              " (every rank of the job asks its daemon for the latest step; they meet in " +
                              c_.catalog_.JobDir(job) + "/.resume)");
    }
    // The next round in 50 ms (each reads the shared root: not on every wake-up of cv_), sooner
    // when the daemon stops.
    const auto next = std::min(deadline, round_began + std::chrono::milliseconds(50));
    MutexLock lock(&c_.mu_);
    while (!c_.stopping_ && c_.clock_.WaitUntil(&c_.cv_, &lock, next)) {
    }
  }
}

Status Restorer::PlanLostLocked(Core& c_, const std::string& job, int64_t step, StatusCode code, const std::string& why) {
  Status lost(code, "memory checkpoint step " + std::to_string(step) + ", which the job's ranks restore, " + why +
                        " on this rank; restart and restore every rank again (they then agree on another step)");
  // Only the plan that chose this step: a newer plan (made by restarted ranks meanwhile) stays good.
  if (auto it = c_.jobs_.find(job); it != c_.jobs_.end() && it->second.resume_plan &&
                                 it->second.resume_plan->step == step &&
                                 it->second.resume_plan->tier == SlotTier::kMemory) {
    it->second.resume_plan->lost = lost;
  }
  Logger("restore")->error("resume plan lost job={} step={} error=\"{}\"", job, step, lost.ToString());
  return lost;
}

bool Restorer::PlanStaleLocked(const Core& c_, const JobState& job, const ResumePlan& plan, const RankState& rank) {
  if (c_.clock_.Now() - plan.made > std::chrono::minutes(10)) return true;
  if (plan.world_size != rank.topology.world_size || plan.run_id != rank.run_id) return true;
  // The asking rank has saved since: it trained on from the plan's step, so this is a new resume
  // (a rollback, say), not a retry.
  if (rank.process_last_begun > plan.step) return true;
  for (const auto& [r, process] : plan.taken) {
    // A rank that took it runs another process now: the job failed and restarts again. (Its own
    // process may be asking again: a retry, which gets the same plan.)
    auto other = job.ranks.find(r);
    if (other == job.ranks.end() || other->second.process != process) return true;
  }
  return false;
}
}  // namespace flashckpt

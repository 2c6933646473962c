// Restores: checkpoints read into slots, memory checkpoints handed over, the resume plan ranks of
// a job agree on, EMA copies (restore.cc, resume_plan.cc).
// A unit of the core (core.h): its state is the Core's, guarded by Core::mu_.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "daemon/core/core.h"
#include "daemon/core/outcomes.h"
#include "daemon/core/registration.h"

namespace flashckpt {

class Restorer {
 public:
  explicit Restorer(Core& core) : c_(core) {}
  Restorer(const Restorer&) = delete;
  Restorer& operator=(const Restorer&) = delete;

  // Daemon's calls of the same names: daemon.h states their contracts.
  Result<RestoreOutcome> Restore(const std::string& session_id, int64_t step, const RestoreWant& want,
                                 std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  Result<RestoreCandidates> Restorable(const std::string& session_id, std::chrono::milliseconds timeout,
                                       int64_t extra_of = 0, bool verify = true) EXCLUDES(c_.mu_);
  Result<RestoreCandidates> DiskExtra(const std::string& session_id, int64_t step) EXCLUDES(c_.mu_);
  Result<EmaCopy> GetEma(const std::string& session_id, std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  Status ReleaseSlot(const std::string& session_id, const SlotTicket& ticket, const std::string& corrupt = "")
      EXCLUDES(c_.mu_);
  // A slot the daemon fills for the trainer to read (restore, EMA copy).
  struct LoadingSlot {
    std::shared_ptr<RankSegment> segment;
    SlotTicket ticket;
  };
  // The memory path of Restore: the rank's memory checkpoint `step` (0: its newest, for a job of one
  // rank, when not older than the latest complete checkpoint) verified and handed over in its own
  // slot; found=false when there is none to hand over, or it failed its checksums (then the rank's
  // memory checkpoints are dropped, with a warning). With `verify_in_client` it is handed over with
  // its chunk checksums for the client to check while it copies (ReleaseSlot reports a mismatch).
  Result<RestoreOutcome> RestoreFromMemory(const std::string& session_id, int64_t step, bool verify_in_client,
                                           std::chrono::steady_clock::time_point deadline,
                                           std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  // The step the ranks of a job of several ranks restore when they ask for the latest: the newest
  // memory checkpoint that every rank of the job holds in this daemon, verified on every rank, if
  // it is not older than the latest complete checkpoint on disk; else that checkpoint. Made once
  // (by the first rank to ask) and taken by each rank, so ranks that restore at different times
  // (the early ones already saving again) still agree.
  Result<ResumePlan> ResumePlanFor(const std::string& session_id, std::chrono::steady_clock::time_point deadline,
                                   std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  Result<ResumePlan> MakeResumePlan(const std::string& job, uint32_t world_size,
                                    std::chrono::steady_clock::time_point deadline,
                                    std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  // The plan of a job not all of whose ranks are here: agreed with the job's other daemons through
  // the root (resume_agreement.h), once every rank of the world has asked its daemon. `latest`:
  // the newest complete step on disk as this daemon sees it.
  Result<ResumePlan> AgreeWithOtherDaemons(const std::string& job, uint32_t world_size, std::optional<int64_t> latest,
                                           std::chrono::steady_clock::time_point deadline,
                                           std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  // Whether every rank 0..world_size-1 of `job` is registered here with that world size.
  static bool AllRanksHereLocked(const Core& c_, const JobState& job, uint32_t world_size) REQUIRES(c_.mu_);
  // The job's plan chose memory checkpoint `step`, which this rank no longer holds or which failed
  // its checksums: the plan keeps the error for the ranks that take it later (until their new
  // processes make another plan), and the error says to restore every rank again, since the
  // others may already train from that step.
  static Status PlanLostLocked(Core& c_, const std::string& job, int64_t step, StatusCode code, const std::string& why)
      REQUIRES(c_.mu_);
  // The plan belongs to an earlier resume: made more than 10 minutes ago, for another world size or
  // run than `rank`'s, `rank` has saved a later step since, or a rank that took it runs another
  // process since.
  static bool PlanStaleLocked(const Core& c_, const JobState& job, const ResumePlan& plan, const RankState& rank) REQUIRES(c_.mu_);
  // Waits until `deadline` for the rank's committed snapshots to have reached the EMA (so a load or
  // copy of the EMA is not overtaken by a stale update) and for a free slot, then takes it
  // RESTORING and loading. `step` nullopt: the rank's last committed step. `purpose` names the
  // wait in the timeout error.
  Result<LoadingSlot> AcquireLoadingSlot(const std::string& session_id, std::optional<int64_t> step, bool need_ema,
                                         std::chrono::steady_clock::time_point deadline,
                                         std::chrono::milliseconds timeout, const char* purpose) EXCLUDES(c_.mu_);
  // Ends the loading: the slot stays RESTORING for the trainer to release, or is freed when
  // `failure` is not ok (returned) or the session has ended (kCancelled). Requires mu_.
  static Status FinishLoadingSlotLocked(Core& c_, const std::string& session_id, const LoadingSlot& slot, const Status& failure)
      REQUIRES(c_.mu_);

 private:
  Core& c_;
};

}  // namespace flashckpt

// Runs and attempts: the run a registering rank joins, the checks that a first snapshot continues
// the job's lineage, and the attempts and splits of each step (lineage.cc).
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

class Lineage {
 public:
  explicit Lineage(Core& core) : c_(core) {}
  Lineage(const Lineage&) = delete;
  Lineage& operator=(const Lineage&) = delete;

  // Daemon's calls of the same names: daemon.h states their contracts.
  Status WaitComplete(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  // The run a registration joins: this session's earlier one, else the request's, else the one this
  // registration chose before it let mu_ go (pending_run), else the run a live registered rank of the
  // job named, else `agreed` (the launch it joined in the root, when it asked), else the run of the
  // job's live registered ranks, else the run a live rank's registration in progress chose, else
  // `drawn`. Register chooses it (pending_run) in the hold of mu_ that found no conflicting rank, so
  // ranks registering at once agree, and again in the hold that marks the rank registered.
  static std::string ChooseRunLocked(const Core& c_, const JobState& job, uint32_t rank, const RankState& state, const Registration& reg,
                              const std::string& agreed, const std::string& drawn) REQUIRES(c_.mu_);
  // Whether a live rank of `job` other than `rank` is in (or registering into) a run that was named
  // (by the request or the environment), not agreed through the root: a rank naming none joins it.
  static bool NamedLiveRunLocked(const Core& c_, const JobState& job, uint32_t rank) REQUIRES(c_.mu_);
  // A session's run never changes: an error when `reg` names another than the session's.
  static Status CheckRunKept(const RankState& state, const Registration& reg);
  // The first BeginSnapshot of a session that did not restore: refused while the job's newest
  // complete checkpoint is another run's, unless the session registered with overwrite, which then
  // deletes the checkpoints that are not its run's (once per run). A `new_process` (not a
  // re-attachment) is refused by its own run's complete checkpoints too, overwrite or not: reusing
  // a run id without restoring is a fresh start. File I/O: without mu_.
  Status CheckLineage(const std::string& session_id, const std::string& job, const std::string& run_id,
                      bool overwrite, bool new_process) EXCLUDES(c_.mu_);
  // The first BeginSnapshot of a session whose run was agreed through the root's launches: refused
  // when a newer launch than the one it joined has begun since (Launches::Newest), so a rank of a
  // relaunch that took a free place in an older, partial launch never saves in that launch's run.
  // File I/O: without mu_.
  Status CheckLaunchCurrent(const std::string& session_id, const std::string& job, const std::string& run_id,
                            uint64_t launch) EXCLUDES(c_.mu_);
  // Records that `rank`'s session committed `step` in `attempt`; when another live session of the
  // job committed the same step in another attempt, the step is split: counted, logged, an event.
  static void NoteAttemptLocked(Core& c_, const std::string& job, uint32_t rank, const std::string& session_id, int64_t step,
                         const Attempt& attempt) REQUIRES(c_.mu_);
  // The writer found all signals of `step` present, this session's last, but of several attempts
  // (another daemon's ranks wrote some): a split when one of the other attempts committed its part
  // after this session's attempt began (both were alive), else an older attempt's leftovers, which
  // its ranks overwrite when they save the step again.
  void OnMixedStep(const std::string& job, uint32_t rank, const std::string& session_id, int64_t step,
                   const std::map<uint32_t, Signal>& signals) EXCLUDES(c_.mu_);
  // Counts a split step (once) with its description and sessions: status, metrics, an event, the log.
  static void NoteSplitLocked(Core& c_, const std::string& job, uint32_t rank, int64_t step, JobState::Split split) REQUIRES(c_.mu_);
  // The split of `step` while every session that took part in it is still the rank's, else null.
  static const JobState::Split* LiveSplitLocked(const Core& c_, const JobState& job, int64_t step) REQUIRES(c_.mu_);

 private:
  Core& c_;
};

}  // namespace flashckpt

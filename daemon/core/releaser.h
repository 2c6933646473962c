// Releasing jobs: by an operator (ReleaseJob) or once idle, and the housekeeper's chores
// (release.cc).
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

class Releaser {
 public:
  explicit Releaser(Core& core) : c_(core) {}
  Releaser(const Releaser&) = delete;
  Releaser& operator=(const Releaser&) = delete;

  // Daemon's calls of the same names: daemon.h states their contracts.
  Result<ReleaseOutcome> ReleaseJob(const std::string& job, const std::string& reason = "release", bool force = false,
                                    std::chrono::milliseconds timeout = std::chrono::seconds(120)) EXCLUDES(c_.mu_);
  // ReleaseJob's first part: has memory step `step` of `name` written and waits for it (until
  // `deadline`). An error, naming the step and the disk's, when it could not be written.
  Status WriteMemoryBeforeRelease(const std::string& name, int64_t step, int64_t disk,
                                  std::chrono::steady_clock::time_point deadline) EXCLUDES(c_.mu_);
  // NOT_FOUND, UNAVAILABLE or FAILED_PRECONDITION (naming why) when `name` cannot be released now.
  static Status ReleasableLocked(const Core& c_, const std::string& name) REQUIRES(c_.mu_);
  static std::string ReleaseBlocker(const Core& c_, const JobState& job) REQUIRES(c_.mu_);
  // Takes the job out of jobs_ (into releasing_ until DropReleased is done with it).
  static std::vector<std::shared_ptr<RankSegment>> DetachJobLocked(Core& c_, const std::string& name, ReleaseOutcome* outcome)
      REQUIRES(c_.mu_);
  // Unlinks the detached segments and their EMA segments, then lets the job's name be used again.
  void DropReleased(const std::string& name, std::vector<std::shared_ptr<RankSegment>> segments,
                    const ReleaseOutcome& outcome, const std::string& reason) EXCLUDES(c_.mu_);
  // No rank connected, nothing left to write, and the last rank gone for config_.idle_release.
  static bool IdleDueLocked(const Core& c_, const JobState& job) REQUIRES(c_.mu_);
  // The housekeeper's chores (housekeeper.h), one pass each. Idle release: releases the jobs idle for
  // config_.idle_release, and the kept EMA segments of jobs that did not come back.
  void ReleaseIdleJobs() EXCLUDES(c_.mu_);
  // The sweep: Catalog::CompleteSignalledSteps for each job the daemon knows, without mu_ while it
  // reads the root.
  void SweepSignalledSteps() EXCLUDES(c_.mu_);
  // Takes the kept EMA segments (kept_emas_) idle for config_.idle_release out of the table, their
  // jobs into releasing_: (segment, job) pairs for DropKeptEmas, which unlinks them without mu_.
  static std::vector<std::pair<std::string, std::string>> TakeIdleKeptEmasLocked(Core& c_) REQUIRES(c_.mu_);
  void DropKeptEmas(const std::vector<std::pair<std::string, std::string>>& due) EXCLUDES(c_.mu_);

 private:
  Core& c_;
};

}  // namespace flashckpt

// Sessions and registration: the one place a rank joins its job, its run and its layout, and
// gets its segment (registration.cc, sessions.cc).
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

class Registrar {
 public:
  explicit Registrar(Core& core) : c_(core) {}
  Registrar(const Registrar&) = delete;
  Registrar& operator=(const Registrar&) = delete;

  // Daemon's calls of the same names: daemon.h states their contracts.
  Result<std::string> OpenSession(const std::string& job, uint32_t rank, bool reattach = false) EXCLUDES(c_.mu_);
  void CloseSession(const std::string& session_id) EXCLUDES(c_.mu_);
  Result<RegisterReply> Register(const std::string& session_id, const Registration& registration) EXCLUDES(c_.mu_);
  SessionCounts CountSessions() const EXCLUDES(c_.mu_);
  // Waits, until `deadline`, while the daemon reads a slot of the session's rank (a restore, or
  // another rank's resume plan verifying it); returns the rank, looked up again.
  static Result<RankState*> WaitSlotsLoadedLocked(Core& c_, const std::string& session_id, MutexLock* lock,
                                           std::chrono::steady_clock::time_point deadline) REQUIRES(c_.mu_);
  // The layout hold of BeginSnapshot (JobState::held_steps): an error, naming the step, while a
  // held step is still in a slot of the job (committed or being written), else the held steps
  // left to look at on disk (none when the session restored a checkpoint).
  static Result<std::map<int64_t, Topology>> LayoutHoldLocked(const Core& c_, const std::string& job, const RankState& rank) REQUIRES(c_.mu_);
  // The rest of the hold, on disk (without mu_): an error while a held step's directory exists
  // without metadata.json; the steps found complete or gone are dropped from the hold.
  Status CheckLayoutHold(const std::string& job, const Topology& now, const std::map<int64_t, Topology>& held)
      EXCLUDES(c_.mu_);
  // Register's steps (registration.cc). The run a rank that names none joins through the root's
  // launches (file I/O: without mu_); empty when the rank names one, or a live rank here decides it.
  struct AgreedRun {
    std::string run;
    uint64_t launch = 0;
    Status error;  // the launches could not be read or written: the first snapshot is refused
  };
  Result<AgreedRun> AgreeRunThroughRoot(const std::string& session_id, const Registration& reg,
                                        const std::string& drawn_run) EXCLUDES(c_.mu_);
  // Waits (5 s at most) while a live rank of the job holds another layout or another run than
  // `wanted`, then refuses naming it; returns the rank, looked up again.
  static Result<RankState*> AwaitNoConflictLocked(Core& c_, const std::string& session_id, const Registration& reg,
                                           const std::string& wanted, MutexLock* lock) REQUIRES(c_.mu_);
  // The job changes its layout to `topology`: the steps of the old one still in progress are held
  // (JobState::held_steps), and the segments of its gone ranks dropped.
  static void HoldPreviousLayoutLocked(Core& c_, const std::string& name, JobState* job, uint32_t rank, const Topology& topology)
      REQUIRES(c_.mu_);
  // A new segment for a registration: the budget checked, the rank's segment retired (into the
  // caller's `retired`, which goes after mu_) and the bytes reserved; the segment is then made
  // without mu_ (CreateRecordedSegment) and published, unless another registration of the rank
  // overtook this one (`created` is the caller's, so that it goes after mu_ then).
  struct SegmentReservation {
    uint64_t bytes = 0;       // counted in registering_bytes_ until published
    uint64_t generation = 0;  // RankState::registrations when reserved
  };
  static Result<SegmentReservation> ReserveSegmentLocked(Core& c_, const std::string& session_id, const RankLayout& layout,
                                                  const std::optional<EmaPlan>& ema_plan,
                                                  std::shared_ptr<RankSegment>* retired) REQUIRES(c_.mu_);
  static Result<RankState*> PublishSegmentLocked(Core& c_, const std::string& session_id, const SegmentReservation& reserved,
                                          Result<std::shared_ptr<RankSegment>> made,
                                          std::shared_ptr<RankSegment>* created) REQUIRES(c_.mu_);
  // The rank's EMA continues only `run_id`'s average: another run's updates still queued are applied
  // first (30 s at most), then the average starts afresh.
  Status StartEmaRun(const std::shared_ptr<RankSegment>& segment, const std::string& job, uint32_t rank,
                     const std::string& run_id) EXCLUDES(c_.mu_);
  // MemoryTierFits as a registration's refusal; `warn`: says what 2 slots cost.
  Status MemoryCheckpointsFit(const SessionInfo& who, uint32_t slots, bool warn) const;
  // Creates the rank's segment under `name` (O_EXCL), or with `adopt` maps that existing segment
  // and checks its header against the layout (its contents are kept). `run_id`: the run the rank
  // registers in, as far as known (RankEma::Open: an EMA segment an older release left).
  Result<std::shared_ptr<RankSegment>> CreateSegment(const std::string& job, uint32_t rank, RankLayout layout,
                                                     std::optional<EmaPlan> ema, const EmaConfig& config,
                                                     uint32_t slot_count, const std::string& name, bool adopt,
                                                     const std::string& run_id = "") EXCLUDES(c_.mu_);
  // A new segment for a registration, with its record written first (see recovery.cc). Does file
  // I/O and allocates: called without mu_.
  Result<std::shared_ptr<RankSegment>> CreateRecordedSegment(const std::string& job, uint32_t rank, RankLayout layout,
                                                             std::optional<EmaPlan> ema_plan,
                                                             const EmaConfig& ema_config,
                                                             const Registration& registration,
                                                             const std::string& run_id) EXCLUDES(c_.mu_);

 private:
  Core& c_;
};

}  // namespace flashckpt

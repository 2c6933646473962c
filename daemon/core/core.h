// The state the core's units share, and the one mutex that guards it.
//
// Daemon (daemon.h) is a facade; the work is done by units with one concern each:
//   Registrar   sessions and registration: the one place a rank joins its job, run and layout
//               (registration.cc, sessions.cc)
//   Lineage     which run a rank joins, and the attempts and splits of a step (lineage.cc)
//   SavePath    BeginSnapshot, Commit and the hand-over to the EMA stage and the writer (save.cc)
//   MemoryTier  memory checkpoints: their verification, replica offers, peer fetch, their writes
//               at stop and release (memory_tier.cc, peer_fetch.cc)
//   Restorer    restores, resume plans, EMA copies and the slots they fill (restore.cc,
//               resume_plan.cc)
//   Releaser    releasing jobs, by an operator or once idle, and the housekeeper's chores
//               (release.cc)
//   Recovery    adopting the segments a predecessor left (recovery.cc)
// Each unit holds a reference to this Core and reaches the others through its pointers.
//
// Why one lock for all of them: each decision of the core (register a rank, hand out a slot,
// commit, restore, release a job) reads and changes the same rank's session, slot table and
// memory checkpoints together, and must be atomic with respect to every other. Split locks would
// need an order across units for each of these, which is where the races of earlier designs
// came from (a registration deciding on a table another unit was changing). So mu_ guards the
// session table, the job table, every rank's slot table and counters; it is not held across file
// I/O but for one unlink of a state-directory record on two failure paths (a commit the slots
// refuse, a submit the writer refuses). It may be held while taking the writer's own lock (Submit,
// InFlight), never the other way round. cv_ is signalled whenever a slot is freed, a persist
// finishes or a session ends, and every wait on it has a deadline.
//
// Threads: gRPC handler threads call in concurrently; the EMA stage's and writer's threads call
// back on completion; the housekeeper runs its chores.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/base/clock.h"
#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/io/io_env.h"
#include "daemon/core/core_types.h"
#include "daemon/core/daemon_config.h"
#include "daemon/core/job_state.h"
#include "daemon/core/segment.h"
#include "daemon/core/slots.h"
#include "daemon/core/state_dir.h"
#include "daemon/observe/events.h"
#include "daemon/observe/metrics.h"
#include "daemon/pipeline/catalog.h"
#include "daemon/pipeline/ema_stage.h"
#include "daemon/pipeline/launches.h"
#include "daemon/pipeline/writer.h"

namespace flashckpt {

class ReplicaSender;
class ParitySender;
class Registrar;
class Lineage;
class SavePath;
class MemoryTier;
class Restorer;
class Releaser;
class Recovery;

class Core {
 public:
  // `config.node_name` set (Daemon fills the default).
  explicit Core(DaemonConfig config);
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  // What the daemon does to its checkpoint root goes through this (DaemonConfig::io_env, or the OS),
  // counted (RootIoCounts).
  IoEnv* RootIo() const { return &root_io_; }
  IoCounts RootIoCounts() const { return root_io_.Counts(); }

  // Shared memory held by jobs with no rank connected (for the budget's refusal).
  uint64_t DisconnectedBytesLocked() const REQUIRES(mu_);
  // Steps a slot of the job is filling, has committed or is persisting: never deleted.
  std::set<int64_t> BusyStepsLocked(const std::string& job) const REQUIRES(mu_);
  // Looks up the rank of a live session; the caller holds mu_.
  Result<RankState*> RankOf(const std::string& session_id, bool need_segment) REQUIRES(mu_);
  // Whether all `world_size` ranks of `job` are registered here: no other daemon writes its steps.
  bool HoldsEveryRankLocked(const std::string& job, uint32_t world_size) const REQUIRES(mu_);
  // The rank a WaitPersisted waits on. Unlike RankOf it answers while the daemon is stopping, as the
  // stop still finishes the writes in flight; once the stop is done with them (stopped_ranks_),
  // `*final` is set and the rank's record is the one the stop left.
  Result<const RankState*> WaitedRank(const std::string& session_id, bool* final) const REQUIRES(mu_);
  // Records that the stop left `step` of the rank to the next daemon. Requires mu_.
  void NoteAbandonedLocked(const std::string& job, uint32_t rank, int64_t step) REQUIRES(mu_);
  // Counts the event in the metrics and hands it to the watchers. Takes only leaf locks: callable
  // with mu_ held.
  void Emit(DaemonEvent event);
  // The segment's slot table and memory checkpoints queued for their checksums are guarded by mu_
  // too: these reach them (RankSegment makes Core a friend).
  SlotTable& Slots(RankSegment& segment) REQUIRES(mu_) { return segment.slots_; }
  const SlotTable& Slots(const RankSegment& segment) const REQUIRES(mu_) { return segment.slots_; }
  std::vector<RankSegment::PendingMemory>& MemoryPending(RankSegment& segment) REQUIRES(mu_) {
    return segment.memory_pending_;
  }
  // Copies the slot's state into its header page for inspection (and the next daemon).
  void Mirror(const RankSegment& segment, uint32_t slot) const REQUIRES(mu_) {
    segment.MirrorSlot(slot, segment.slots_.at(slot));
  }
  // The same for a segment no other thread can reach yet: made or adopted, not yet in jobs_ (it is
  // published there under mu_). Unchecked by the analysis; CreateSegment and AdoptSegment only.
  static SlotTable& UnpublishedSlots(RankSegment& segment) { return segment.slots_; }
  static void MirrorUnpublished(const RankSegment& segment, uint32_t slot) {
    segment.MirrorSlot(slot, segment.slots_.at(slot));
  }

  const DaemonConfig config_;
  const Clock& clock_;  // config_.clock: every time the core reads, and every deadline it waits for
  const std::chrono::steady_clock::time_point started_;
  mutable CountingIo root_io_;  // RootIo: counts, then passes on to config_.io_env (thread-safe)
  StateDir state_;           // set once by Daemon::Start
  std::string ema_scope_;    // set once by Daemon::Start, before any segment (EmaSegmentName)
  // This daemon process among all of a job's daemons (random, set once by Daemon::Start): it names
  // its resume view and, with a rank's process number, the rank's trainer process in a plan.
  std::string instance_;
  StateDirLock state_lock_;  // taken by Daemon::Start, held for the daemon's life
  EventHub events_;
  Metrics metrics_;
  Catalog catalog_;
  // The launches of each job in the root: the run a rank that names none joins (Register).
  Launches launches_;
  // Leases on the steps this daemon reads or writes, in the root (lease_ttl; written with the real
  // file system, not io_env: they are bookkeeping, not checkpoint data).
  Leases leases_;
  std::unique_ptr<Writer> writer_;
  std::unique_ptr<EmaStage> ema_stage_;    // set once by Daemon::Start
  std::unique_ptr<ReplicaSender> sender_;  // set once by Daemon::Start with --replicate-to; stopped by Stop
  std::unique_ptr<ParitySender> parity_;   // set once by Daemon::Start with --ec-group; stopped by Stop
  std::atomic<uint64_t> host_memory_used_{0};
  std::atomic<uint64_t> replica_memory_used_{0};  // the part of it that ReserveHostMemory took

  // The units, each owned by the Daemon and living as long as it (set by its constructor).
  Registrar* registrar = nullptr;
  Lineage* lineage = nullptr;
  SavePath* save = nullptr;
  MemoryTier* memory = nullptr;
  Restorer* restorer = nullptr;
  Releaser* releaser = nullptr;
  Recovery* recovery = nullptr;

  mutable Mutex mu_;
  CondVar cv_;
  uint64_t registering_bytes_ GUARDED_BY(mu_) = 0;  // reserved by registrations making their segments
  bool stopping_ GUARDED_BY(mu_) = false;
  uint64_t processes_seen_ GUARDED_BY(mu_) = 0;  // RankState::process_token's count
  uint64_t stop_finished_ GUARDED_BY(mu_) = 0;   // persists finished in Stop
  uint64_t stop_abandoned_ GUARDED_BY(mu_) = 0;  // and abandoned
  // What each connected rank had persisted, failed and abandoned when the stop was done with the
  // writes, by session id: the job table is emptied then, and a WaitPersisted that wakes after it
  // reads its step's outcome here.
  std::map<std::string, RankState> stopped_ranks_ GUARDED_BY(mu_);
  std::map<std::string, SessionInfo> sessions_ GUARDED_BY(mu_);
  std::map<std::string, JobState> jobs_ GUARDED_BY(mu_);
  // Jobs being released: their segments are unlinked outside mu_, and a session of the job waits
  // for that (OpenSession) so that it never maps a name about to go.
  std::set<std::string> releasing_ GUARDED_BY(mu_);
  // EMA segments a stopped predecessor left for jobs with no rank connected (StateDir::KeptEma),
  // by segment name: unlinked by the idle release once idle, unless their job came back.
  struct KeptEma {
    std::string job;
    std::chrono::steady_clock::time_point since;
  };
  std::map<std::string, KeptEma> kept_emas_ GUARDED_BY(mu_);
};

}  // namespace flashckpt

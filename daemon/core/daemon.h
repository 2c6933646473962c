// The daemon's core: sessions, registered ranks and their segments, the save and restore paths.
// The gRPC service (daemon/edge/service.*) is a thin translation layer on top of this class.
//
// Threads: gRPC handler threads call in concurrently; writer threads call back on completion.
// One mutex (mu_) guards the session table, the job table, every rank's slot table and counters;
// it is not held across file I/O but for one unlink of a state-directory record on two failure
// paths (a commit the slots refuse, a submit the writer refuses). It may be held while taking the
// writer's own lock (Submit, InFlight), never the other way round. cv_ is signalled whenever a slot
// is freed, a persist finishes or a session ends, and every wait on it has a deadline.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/base/thread_pool.h"
#include "common/format/layout.h"
#include "common/io/io_env.h"
#include "common/io/shm.h"
#include "daemon/core/core_types.h"
#include "daemon/core/daemon_config.h"
#include "daemon/core/housekeeper.h"
#include "daemon/core/job_state.h"
#include "daemon/core/outcomes.h"
#include "daemon/core/registration.h"
#include "daemon/core/segment.h"
#include "daemon/core/slots.h"
#include "daemon/core/state_dir.h"
#include "daemon/observe/events.h"
#include "daemon/observe/metrics.h"
#include "daemon/pipeline/catalog.h"
#include "daemon/pipeline/ema.h"
#include "daemon/pipeline/ema_stage.h"
#include "daemon/pipeline/launches.h"
#include "daemon/pipeline/writer.h"

namespace flashckpt {

struct AdoptedCommit;  // recovery.cc
class ReplicaSender;
struct ReplicaMeta;



class Daemon {
 public:
  explicit Daemon(DaemonConfig config);
  ~Daemon();

  // Creates the root directory, starts the writer, and adopts the slot segments a predecessor
  // left behind (daemon/core/recovery.cc): their committed snapshots are persisted again.
  Status Start() EXCLUDES(mu_);
  // Memory outside the slot segments (the replicas held for peers, daemon/replica/replica_store.h),
  // counted in --max-host-memory with them: Reserve fails with RESOURCE_EXHAUSTED, saying `what`
  // needed the bytes, when they do not fit; Release gives back what Reserve took.
  Status ReserveHostMemory(uint64_t bytes, const std::string& what) EXCLUDES(mu_);
  void ReleaseHostMemory(uint64_t bytes);

  // Refuses new work (UNAVAILABLE, saying the daemon is stopping), wakes every waiter, and lets
  // the EMA stage and the writer finish what was committed until `deadline`. What is not written
  // by then is abandoned: the writes stop at their next piece and remove their temporaries and
  // partial files, never writing a signal or metadata.json for it; its commit record and slot
  // segment stay, so the next daemon adopts and writes it, as after a crash. Logs what was
  // finished and what was abandoned. Idempotent.
  void Stop(std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max()) EXCLUDES(mu_);

  // `reattach`: the trainer process of the rank's last session carrying on (SessionRequest.reattach).
  Result<std::string> OpenSession(const std::string& job, uint32_t rank, bool reattach = false) EXCLUDES(mu_);
  void CloseSession(const std::string& session_id) EXCLUDES(mu_);

  // fatal_persist_errors (in the request): once a persist of this session fails, its BeginSnapshot
  // and Commit fail with that error (code and message) until the trainer starts a new session; off,
  // a failed persist is reported by WaitPersisted and status only and snapshots go on.
  // `registration`: checked by ParseRegistration (the edge's job); its layout is checked here.
  Result<RegisterReply> Register(const std::string& session_id, const Registration& registration) EXCLUDES(mu_);
  // tier kMemory: a memory checkpoint, kept in its slot once committed and never written
  // (FAILED_PRECONDITION with fewer than 2 slots, or for a rank with EMA tensors).
  Result<SlotTicket> BeginSnapshot(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout,
                                   SlotTier tier = SlotTier::kDisk) EXCLUDES(mu_);
  Status Commit(const std::string& session_id, const SlotTicket& ticket, int64_t step, bool persist,
                std::optional<double> loss, std::string extra) EXCLUDES(mu_);
  Status AbortSnapshot(const std::string& session_id, const SlotTicket& ticket) EXCLUDES(mu_);
  Result<WaitResult> WaitPersisted(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout) EXCLUDES(mu_);
  // Waits for this rank's files of `step` (WaitPersisted), then until checkpoint `step` is complete,
  // whoever completes it. Fails with the rank's persist error; FAILED_PRECONDITION when the step can
  // never complete because its ranks saved it in different attempts (seen at commit among this
  // daemon's sessions, or in the signals once `timeout` is up), naming the ranks and attempts; or
  // DEADLINE_EXCEEDED naming the ranks whose signals are missing.
  Status WaitComplete(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout) EXCLUDES(mu_);
  // step 0 means the latest complete checkpoint; found=false when there is none.
  // Fills a slot with checkpoint `step` (0: the latest complete one) in the rank's layout, as `want`
  // says (RestoreWant). The rank's own memory checkpoint of that step (0: its newest, for a job of
  // one rank and when it is not older than the latest complete checkpoint) is handed over instead,
  // in its own slot, once its checksums verify; one that fails them is dropped with every other
  // memory checkpoint of the rank, logged, and the files are read.
  Result<RestoreOutcome> Restore(const std::string& session_id, int64_t step, const RestoreWant& want,
                                 std::chrono::milliseconds timeout) EXCLUDES(mu_);
  // The rank's candidates for the step its job restores: the memory checkpoints it holds here
  // (after the checksums still queued for them are computed, waiting until `timeout`), each
  // verified, and the job's newest complete checkpoint on disk. One that fails its checksums is
  // dropped with the rank's others (MEMORY_FALLBACK) and not listed. Needs no registration.
  // `extra_of` > 0: only that memory step is looked at, and its extra state is answered too.
  Result<RestoreCandidates> Restorable(const std::string& session_id, std::chrono::milliseconds timeout,
                                       int64_t extra_of = 0) EXCLUDES(mu_);
  // Copies the current EMA into a slot (RESTORING until ReleaseSlot). initialized=false: no update yet.
  struct EmaCopy {
    bool initialized = false;
    int64_t step = -1;
    SlotTicket ticket;
  };
  Result<EmaCopy> GetEma(const std::string& session_id, std::chrono::milliseconds timeout) EXCLUDES(mu_);
  // `corrupt` non-empty: the client found a chunk of the memory checkpoint handed over in the slot
  // not matching its checksum (what it found); the rank's memory checkpoints are dropped as when the
  // daemon's own verification fails, and a resume plan on that step is lost.
  Status ReleaseSlot(const std::string& session_id, const SlotTicket& ticket, const std::string& corrupt = "")
      EXCLUDES(mu_);

  Result<std::vector<CheckpointInfo>> List(const std::string& job) const;
  // `flashckpt delete` (step > 0: that checkpoint; force allows the newest complete one) or
  // `flashckpt gc` (step 0, keep >= 1: retention's rule) through the catalog (Catalog::
  // DeleteCheckpoint, CollectGarbage). Besides the catalog's steps in use (restores, writers), a
  // step that a slot of this daemon is filling, has committed or is persisting is never deleted.
  Result<DeletionOutcome> DeleteCheckpoints(const std::string& job, int64_t step, uint32_t keep, bool force,
                                            bool dry_run) EXCLUDES(mu_);
  // Forgets a job none of whose ranks is connected, once nothing of it is waiting to be written:
  // unlinks its slot segments (with their records) and its EMA segments, which the checkpoints
  // hold. `reason` is the event's ("release": an operator; "idle": --idle-release). NOT_FOUND for
  // a job the daemon does not hold; FAILED_PRECONDITION, naming why, while a rank is connected or
  // a snapshot of it is still on its way to disk.
  // A job's memory checkpoint newer than its newest complete one on disk is written first (the call
  // waits up to `timeout` for it), and the job is kept if it cannot be; `force` drops it instead.
  Result<ReleaseOutcome> ReleaseJob(const std::string& job, const std::string& reason = "release", bool force = false,
                                    std::chrono::milliseconds timeout = std::chrono::seconds(120)) EXCLUDES(mu_);

  // Jobs, ranks and connected ranks, from memory (takes mu_ and nothing else: no file I/O).
  struct Counts {
    size_t jobs = 0, ranks = 0, connected = 0;
  };
  Counts CountSessions() const EXCLUDES(mu_);
  // The daemon's memory, jobs and ranks; each job's last complete step is read from the root
  // without the daemon's lock (a failure to read it is the job's catalog_error).
  DaemonStatus GetStatus() const EXCLUDES(mu_);
  // The name of the EMA segment this daemon keeps for `rank` of `job` (EmaSegmentName with this
  // daemon's scope: a hash of its state directory, or of its root when it has none). Set by Start.
  std::string EmaSegmentName(const std::string& job, uint32_t rank) const;

  const DaemonConfig& config() const { return config_; }
  // What the daemon does to its checkpoint root goes through this (DaemonConfig::io_env, or the OS).
  IoEnv* RootIo() const { return config_.io_env != nullptr ? config_.io_env : IoEnv::Default(); }

  // What happened to snapshots and checkpoints, for WatchEvents; closed at the end of Stop.
  EventHub& events() { return events_; }
  // The Prometheus exposition of the daemon's metrics and current status.
  std::string RenderMetrics() const EXCLUDES(mu_);

 private:
  // Stop's --persist-on-stop: hands the writer, for each job, its newest memory checkpoint held by
  // every rank of it here, if newer than the job's latest complete checkpoint. Returns how many
  // ranks' snapshots were queued.
  uint32_t PersistMemoryOnStop() EXCLUDES(mu_);
  // Hands the writer memory checkpoint `step` of every rank of `name` here that holds it, each
  // verified against its checksums first (`disk`: the newest complete step, for the log; `why`:
  // "on stop", "before release"). Returns how many ranks' writes were queued; an error when a copy
  // failed its checksums (nothing is written then) or a write could not be queued.
  Result<uint32_t> PersistMemoryStep(const std::string& name, int64_t step, int64_t disk, const char* why)
      EXCLUDES(mu_);
  // The jobs and ranks part of GetStatus, from memory: takes mu_ (and the writer's lock).
  void FillJobsStatus(DaemonStatus* out) const EXCLUDES(mu_);

  // Why the job's memory cannot be given back now, or "" when it can: a connected rank, or a
  // snapshot still in a slot on its way through the EMA stage or the writer.
  // The memory steps every rank of `job` here holds, newest first.
  std::vector<int64_t> CommonMemoryStepsLocked(const JobState& job) const REQUIRES(mu_);
  // Whether every rank of `job` here holding memory step `step` has written it (this process).
  bool MemoryStepWrittenLocked(const JobState& job, int64_t step) const REQUIRES(mu_);
  // ReleaseJob's first part: has memory step `step` of `name` written and waits for it (until
  // `deadline`). An error, naming the step and the disk's, when it could not be written.
  Status WriteMemoryBeforeRelease(const std::string& name, int64_t step, int64_t disk,
                                  std::chrono::steady_clock::time_point deadline) EXCLUDES(mu_);
  // NOT_FOUND, UNAVAILABLE or FAILED_PRECONDITION (naming why) when `name` cannot be released now.
  Status ReleasableLocked(const std::string& name) const REQUIRES(mu_);
  std::string ReleaseBlocker(const JobState& job) const REQUIRES(mu_);
  // Takes the job out of jobs_ (into releasing_ until DropReleased is done with it).
  std::vector<std::shared_ptr<RankSegment>> DetachJobLocked(const std::string& name, ReleaseOutcome* outcome)
      REQUIRES(mu_);
  // Unlinks the detached segments and their EMA segments, then lets the job's name be used again.
  void DropReleased(const std::string& name, std::vector<std::shared_ptr<RankSegment>> segments,
                    const ReleaseOutcome& outcome, const std::string& reason) EXCLUDES(mu_);
  // No rank connected, nothing left to write, and the last rank gone for config_.idle_release.
  bool IdleDueLocked(const JobState& job) const REQUIRES(mu_);
  // The housekeeper's chores (housekeeper.h), one pass each. Idle release: releases the jobs idle for
  // config_.idle_release, and the kept EMA segments of jobs that did not come back.
  void ReleaseIdleJobs() EXCLUDES(mu_);
  // The sweep: Catalog::CompleteSignalledSteps for each job the daemon knows, without mu_ while it
  // reads the root.
  void SweepSignalledSteps() EXCLUDES(mu_);
  // Takes the kept EMA segments (kept_emas_) idle for config_.idle_release out of the table, their
  // jobs into releasing_: (segment, job) pairs for DropKeptEmas, which unlinks them without mu_.
  std::vector<std::pair<std::string, std::string>> TakeIdleKeptEmasLocked() REQUIRES(mu_);
  void DropKeptEmas(const std::vector<std::pair<std::string, std::string>>& due) EXCLUDES(mu_);
  // Shared memory held by jobs with no rank connected (for the budget's refusal).
  uint64_t DisconnectedBytesLocked() const REQUIRES(mu_);

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
                                           std::chrono::milliseconds timeout) EXCLUDES(mu_);
  // The step the ranks of a job of several ranks restore when they ask for the latest: the newest
  // memory checkpoint that every rank of the job holds in this daemon, verified on every rank, if
  // it is not older than the latest complete checkpoint on disk; else that checkpoint. Made once
  // (by the first rank to ask) and taken by each rank, so ranks that restore at different times
  // (the early ones already saving again) still agree.
  Result<ResumePlan> ResumePlanFor(const std::string& session_id, std::chrono::steady_clock::time_point deadline,
                                   std::chrono::milliseconds timeout) EXCLUDES(mu_);
  Result<ResumePlan> MakeResumePlan(const std::string& job, uint32_t world_size,
                                    std::chrono::steady_clock::time_point deadline,
                                    std::chrono::milliseconds timeout) EXCLUDES(mu_);
  // The job's plan chose memory checkpoint `step`, which this rank no longer holds or which failed
  // its checksums: the plan keeps the error for the ranks that take it later (until their new
  // processes make another plan), and the error says to restore every rank again, since the
  // others may already train from that step.
  Status PlanLostLocked(const std::string& job, int64_t step, StatusCode code, const std::string& why)
      REQUIRES(mu_);
  // The plan belongs to an earlier resume: made more than 10 minutes ago, for another world size or
  // run than `rank`'s, `rank` has saved a later step since, or a rank that took it runs another
  // process since.
  bool PlanStaleLocked(const JobState& job, const ResumePlan& plan, const RankState& rank) const REQUIRES(mu_);
  // Waits, until `deadline`, while the daemon reads a slot of the session's rank (a restore, or
  // another rank's resume plan verifying it); returns the rank, looked up again.
  Result<RankState*> WaitSlotsLoadedLocked(const std::string& session_id, MutexLock* lock,
                                           std::chrono::steady_clock::time_point deadline) REQUIRES(mu_);
  // Waits until `deadline` for the rank's committed snapshots to have reached the EMA (so a load or
  // copy of the EMA is not overtaken by a stale update) and for a free slot, then takes it
  // RESTORING and loading. `step` nullopt: the rank's last committed step. `purpose` names the
  // wait in the timeout error.
  Result<LoadingSlot> AcquireLoadingSlot(const std::string& session_id, std::optional<int64_t> step, bool need_ema,
                                         std::chrono::steady_clock::time_point deadline,
                                         std::chrono::milliseconds timeout, const char* purpose) EXCLUDES(mu_);
  // Ends the loading: the slot stays RESTORING for the trainer to release, or is freed when
  // `failure` is not ok (returned) or the session has ended (kCancelled). Requires mu_.
  Status FinishLoadingSlotLocked(const std::string& session_id, const LoadingSlot& slot, const Status& failure)
      REQUIRES(mu_);

  // The layout hold of BeginSnapshot (JobState::held_steps): an error, naming the step, while a
  // held step is still in a slot of the job (committed or being written), else the held steps
  // left to look at on disk (none when the session restored a checkpoint).
  Result<std::map<int64_t, Topology>> LayoutHoldLocked(const std::string& job, const RankState& rank) const
      REQUIRES(mu_);
  // The rest of the hold, on disk (without mu_): an error while a held step's directory exists
  // without metadata.json; the steps found complete or gone are dropped from the hold.
  Status CheckLayoutHold(const std::string& job, const Topology& now, const std::map<int64_t, Topology>& held)
      EXCLUDES(mu_);
  // Register's steps (registration.cc). The run a rank that names none joins through the root's
  // launches (file I/O: without mu_); empty when the rank names one, or a live rank here decides it.
  struct AgreedRun {
    std::string run;
    uint64_t launch = 0;
    Status error;  // the launches could not be read or written: the first snapshot is refused
  };
  Result<AgreedRun> AgreeRunThroughRoot(const std::string& session_id, const Registration& reg,
                                        const std::string& drawn_run) EXCLUDES(mu_);
  // Waits (5 s at most) while a live rank of the job holds another layout or another run than
  // `wanted`, then refuses naming it; returns the rank, looked up again.
  Result<RankState*> AwaitNoConflictLocked(const std::string& session_id, const Registration& reg,
                                           const std::string& wanted, MutexLock* lock) REQUIRES(mu_);
  // The job changes its layout to `topology`: the steps of the old one still in progress are held
  // (JobState::held_steps), and the segments of its gone ranks dropped.
  void HoldPreviousLayoutLocked(const std::string& name, JobState* job, uint32_t rank, const Topology& topology)
      REQUIRES(mu_);
  // A new segment for a registration: the budget checked, the rank's segment retired (into the
  // caller's `retired`, which goes after mu_) and the bytes reserved; the segment is then made
  // without mu_ (CreateRecordedSegment) and published, unless another registration of the rank
  // overtook this one (`created` is the caller's, so that it goes after mu_ then).
  struct SegmentReservation {
    uint64_t bytes = 0;       // counted in registering_bytes_ until published
    uint64_t generation = 0;  // RankState::registrations when reserved
  };
  Result<SegmentReservation> ReserveSegmentLocked(const std::string& session_id, const RankLayout& layout,
                                                  const std::optional<EmaPlan>& ema_plan,
                                                  std::shared_ptr<RankSegment>* retired) REQUIRES(mu_);
  Result<RankState*> PublishSegmentLocked(const std::string& session_id, const SegmentReservation& reserved,
                                          Result<std::shared_ptr<RankSegment>> made,
                                          std::shared_ptr<RankSegment>* created) REQUIRES(mu_);
  // The rank's EMA continues only `run_id`'s average: another run's updates still queued are applied
  // first (30 s at most), then the average starts afresh.
  Status StartEmaRun(const std::shared_ptr<RankSegment>& segment, const std::string& job, uint32_t rank,
                     const std::string& run_id) EXCLUDES(mu_);
  // MemoryTierFits as a registration's refusal; `warn`: says what 2 slots cost.
  Status MemoryCheckpointsFit(const SessionInfo& who, uint32_t slots, bool ema, bool warn) const;
  // The run a registration joins: this session's earlier one, else the request's, else the one this
  // registration chose before it let mu_ go (pending_run), else the run a live registered rank of the
  // job named, else `agreed` (the launch it joined in the root, when it asked), else the run of the
  // job's live registered ranks, else the run a live rank's registration in progress chose, else
  // `drawn`. Register chooses it (pending_run) in the hold of mu_ that found no conflicting rank, so
  // ranks registering at once agree, and again in the hold that marks the rank registered.
  std::string ChooseRunLocked(const JobState& job, uint32_t rank, const RankState& state, const Registration& reg,
                              const std::string& agreed, const std::string& drawn) const REQUIRES(mu_);
  // Whether a live rank of `job` other than `rank` is in (or registering into) a run that was named
  // (by the request or the environment), not agreed through the root: a rank naming none joins it.
  bool NamedLiveRunLocked(const JobState& job, uint32_t rank) const REQUIRES(mu_);
  // A session's run never changes: an error when `reg` names another than the session's.
  static Status CheckRunKept(const RankState& state, const Registration& reg);
  // The first BeginSnapshot of a session that did not restore: refused while the job's newest
  // complete checkpoint is another run's, unless the session registered with overwrite, which then
  // deletes the checkpoints that are not its run's (once per run). A `new_process` (not a
  // re-attachment) is refused by its own run's complete checkpoints too, overwrite or not: reusing
  // a run id without restoring is a fresh start. File I/O: without mu_.
  Status CheckLineage(const std::string& session_id, const std::string& job, const std::string& run_id,
                      bool overwrite, bool new_process) EXCLUDES(mu_);
  // The first BeginSnapshot of a session whose run was agreed through the root's launches: refused
  // when a newer launch than the one it joined has begun since (Launches::Newest), so a rank of a
  // relaunch that took a free place in an older, partial launch never saves in that launch's run.
  // File I/O: without mu_.
  Status CheckLaunchCurrent(const std::string& session_id, const std::string& job, const std::string& run_id,
                            uint64_t launch) EXCLUDES(mu_);
  // Steps a slot of the job is filling, has committed or is persisting: never deleted.
  std::set<int64_t> BusyStepsLocked(const std::string& job) const REQUIRES(mu_);
  // Records that `rank`'s session committed `step` in `attempt`; when another live session of the
  // job committed the same step in another attempt, the step is split: counted, logged, an event.
  void NoteAttemptLocked(const std::string& job, uint32_t rank, const std::string& session_id, int64_t step,
                         const Attempt& attempt) REQUIRES(mu_);
  // The writer found all signals of `step` present, this session's last, but of several attempts
  // (another daemon's ranks wrote some): a split when one of the other attempts committed its part
  // after this session's attempt began (both were alive), else an older attempt's leftovers, which
  // its ranks overwrite when they save the step again.
  void OnMixedStep(const std::string& job, uint32_t rank, const std::string& session_id, int64_t step,
                   const std::map<uint32_t, Signal>& signals) EXCLUDES(mu_);
  // Counts a split step (once) with its description and sessions: status, metrics, an event, the log.
  void NoteSplitLocked(const std::string& job, uint32_t rank, int64_t step, JobState::Split split) REQUIRES(mu_);
  // The split of `step` while every session that took part in it is still the rank's, else null.
  const JobState::Split* LiveSplitLocked(const JobState& job, int64_t step) const REQUIRES(mu_);
  // Looks up the rank of a live session; the caller holds mu_.
  Result<RankState*> RankOf(const std::string& session_id, bool need_segment) REQUIRES(mu_);
  // The rank a WaitPersisted waits on. Unlike RankOf it answers while the daemon is stopping, as the
  // stop still finishes the writes in flight; once the stop is done with them (stopped_ranks_),
  // `*final` is set and the rank's record is the one the stop left.
  Result<const RankState*> WaitedRank(const std::string& session_id, bool* final) const REQUIRES(mu_);
  // Records that the stop left `step` of the rank to the next daemon. Requires mu_.
  void NoteAbandonedLocked(const std::string& job, uint32_t rank, int64_t step) REQUIRES(mu_);
  // `session_id`: the session that committed the step (a failure counts as fatal for it only).
  // `process`: the rank's process (RankState::process) that committed it.
  void OnPersisted(const std::string& job, uint32_t rank, const std::string& session_id, uint64_t process,
                   const std::shared_ptr<RankSegment>& segment, SlotTicket ticket, int64_t step, const Status& status,
                   uint64_t bytes, double seconds) EXCLUDES(mu_);
  // Creates the rank's segment under `name` (O_EXCL), or with `adopt` maps that existing segment
  // and checks its header against the layout (its contents are kept). `run_id`: the run the rank
  // registers in, as far as known (RankEma::Open: an EMA segment an older release left).
  Result<std::shared_ptr<RankSegment>> CreateSegment(const std::string& job, uint32_t rank, RankLayout layout,
                                                     std::optional<EmaPlan> ema, const EmaConfig& config,
                                                     uint32_t slot_count, const std::string& name, bool adopt,
                                                     const std::string& run_id = "") EXCLUDES(mu_);
  // A new segment for a registration, with its record written first (see recovery.cc). Does file
  // I/O and allocates: called without mu_.
  Result<std::shared_ptr<RankSegment>> CreateRecordedSegment(const std::string& job, uint32_t rank, RankLayout layout,
                                                             std::optional<EmaPlan> ema_plan,
                                                             const EmaConfig& ema_config,
                                                             const Registration& registration,
                                                             const std::string& run_id) EXCLUDES(mu_);
  // The EMA stage's callback: counts the update, then FinishCommittedLocked.
  void OnEmaApplied(EmaJob job, bool applied, double seconds) EXCLUDES(mu_);
  // The persist request of a committed slot; `done` reports to OnPersisted.
  // `session_id`: the committing session ("" for a snapshot adopted after a restart).
  PersistRequest MakePersistRequest(const std::string& job, uint32_t rank, const std::string& session_id, uint64_t process,
                                    uint32_t world_size, const Attempt& attempt,
                                    const std::shared_ptr<RankSegment>& segment, const SlotTicket& ticket, int64_t step,
                                    std::string extra);

  // Counts the event in the metrics and hands it to the watchers. Takes only leaf locks: callable
  // with mu_ held.
  void Emit(DaemonEvent event);

  // Crash recovery (daemon/core/recovery.cc).
  Status AdoptSegments() EXCLUDES(mu_);
  Status AdoptSegment(const StateDir::Adoptable& record) EXCLUDES(mu_);
  // AdoptSegment's steps, on a segment not yet published: its commit records (the snapshots to
  // replay; those already durable are released), its memory records (the memory-only steps held),
  // then the segment published in the job table with its snapshots queued.
  Result<std::vector<AdoptedCommit>> AdoptCommits(const StateDir::Adoptable& record, const Registration& reg,
                                                  const std::shared_ptr<RankSegment>& segment);
  std::vector<int64_t> AdoptMemoryRecords(const StateDir::Adoptable& record, const Registration& reg,
                                          const std::shared_ptr<RankSegment>& segment);
  void PublishAdopted(const StateDir::Adoptable& record, const Registration& reg,
                      const std::shared_ptr<RankSegment>& segment, std::vector<AdoptedCommit> pending,
                      const std::vector<int64_t>& memory_steps) EXCLUDES(mu_);
  // Removes `<name>.tmp.<pid>.<n>` files left in the job's checkpoint directories by writers that
  // are gone (a zombie or a pid another program reuses counts as gone: IsTemporaryWriterAlive).
  void RemoveStaleTemporaries(const std::string& job);
  // Hands a committed slot to the writer (persist) or frees it. Requires mu_.
  Status FinishCommittedLocked(EmaJob job) REQUIRES(mu_);
  // With --replicate-to, when a peer holds a replica of the rank newer than its newest memory
  // checkpoint here (a rank restarted on a replacement node has none), or, with `step` > 0, a replica
  // of that step when this daemon does not hold it: fetches it into a
  // slot of the rank's, checks it (its layout against the rank's, every chunk against its checksum)
  // and keeps it as a memory checkpoint of the rank (ResidentCheckpoint::from_peer), which the
  // memory path then restores. A peer that cannot be asked and a replica of another layout are
  // logged, one that fails its checksums also with a MEMORY_FALLBACK event, and the restore goes on
  // without it (peer_fetch.cc). The fetch takes at most half the time left to `deadline`.
  // Only a replica that continues the job's lineage here is used (ContinuesLineage); one that does
  // not is logged with a MEMORY_FALLBACK event "replica ... not used: <why>". A replica never
  // beats a step held here, in memory or as the newest complete checkpoint on disk.
  void FetchPeerReplica(const std::string& job, uint32_t rank, std::chrono::steady_clock::time_point deadline,
                        int64_t step = 0) EXCLUDES(mu_);
  // The lineage a job is on at this daemon, for FetchPeerReplica: the run of its newest complete
  // checkpoint on disk (and that step), and the runs of the rank's memory checkpoints here.
  struct Lineage {
    std::set<std::string> runs;
    std::string disk_run;
    int64_t disk_step = 0;
  };
  // Whether replica `m` continues `lineage`: of one of its runs, or of an attempt that restored a
  // complete checkpoint of the job here (its resumed_from step is complete on disk). Any replica
  // does where nothing is held here. FAILED_PRECONDITION saying why not. Reads the disk.
  Status ContinuesLineage(const std::string& job, const ReplicaMeta& m, const Lineage& lineage) EXCLUDES(mu_);
  // The rank's number for its current attempt on the replica channel (ReplicaMeta::attempt):
  // numbered afresh after a restore and in a new process. Requires mu_.
  uint64_t ReplicaAttemptNumber(RankState& state) REQUIRES(mu_);
  // The rank restored `step` (RankState::Restored); with --replicate-to its peers are told
  // (ReplicaSender::Retract). Requires mu_.
  void RestoredLocked(const std::string& job, uint32_t rank, RankState& state, int64_t step) REQUIRES(mu_);
  // With --replicate-to: queues the memory checkpoint that `slot` of the rank's segment now holds
  // for the peers (ReplicaSender::Offer). Only one of the rank's current attempt is sent.
  void OfferReplicaLocked(const std::shared_ptr<RankSegment>& segment, uint32_t slot, const std::string& job,
                          uint32_t rank) REQUIRES(mu_);
  // Gives a FILLING slot to the rank (BeginSnapshot): resets its copy progress, mirrors it. Needs mu_.
  void HandOut(RankState* rank, const SlotTicket& ticket, int64_t step) REQUIRES(mu_);

  const DaemonConfig config_;
  const Clock& clock_;  // config_.clock: every time the core reads, and every deadline it waits for
  const std::chrono::steady_clock::time_point started_;
  StateDir state_;           // set once by Start
  std::string ema_scope_;    // set once by Start, before any segment (EmaSegmentName)
  StateDirLock state_lock_;  // taken by Start, held for the daemon's life
  EventHub events_;
  Metrics metrics_;
  Catalog catalog_;
  // The launches of each job in the root: the run a rank that names none joins (Register).
  Launches launches_;
  // Leases on the steps this daemon reads or writes, in the root (lease_ttl; written with the real
  // file system, not io_env: they are bookkeeping, not checkpoint data).
  Leases leases_;
  std::unique_ptr<Writer> writer_;
  std::unique_ptr<EmaStage> ema_stage_;  // set once by Start
  std::unique_ptr<ReplicaSender> sender_;  // set once by Start with --replicate-to; stopped by Stop
  std::atomic<uint64_t> host_memory_used_{0};
  std::atomic<uint64_t> replica_memory_used_{0};  // the part of it that ReserveHostMemory took
  uint64_t registering_bytes_ GUARDED_BY(mu_) = 0;  // reserved by registrations making their segments

  // The segment's slot table and EMA count are guarded by mu_ too: these reach them.
  SlotTable& Slots(RankSegment& segment) REQUIRES(mu_) { return segment.slots_; }
  const SlotTable& Slots(const RankSegment& segment) const REQUIRES(mu_) { return segment.slots_; }
  uint32_t& EmaPending(RankSegment& segment) REQUIRES(mu_) { return segment.ema_pending_; }
  uint32_t EmaPending(const RankSegment& segment) const REQUIRES(mu_) { return segment.ema_pending_; }
  std::vector<RankSegment::PendingMemory>& MemoryPending(RankSegment& segment) REQUIRES(mu_) {
    return segment.memory_pending_;
  }
  // Snapshots queued for the EMA itself (not memory checkpoints queued for their checksums).
  uint32_t EmaUpdatesPending(const RankSegment& segment) const REQUIRES(mu_) {
    return segment.ema_pending_ - static_cast<uint32_t>(segment.memory_pending_.size());
  }
  // Whether a rank with a segment of `slots` slots (with EMA tensors: `ema`) can take memory
  // checkpoints: FAILED_PRECONDITION naming the reason when it cannot (checked at Register when the
  // rank declares them, and at each memory BeginSnapshot).
  static Status MemoryTierFits(uint32_t slots, bool ema);
  // Whether a disk snapshot of the segment's rank can double as a memory checkpoint: it has no EMA
  // and holds no replica (a disk snapshot copies only the tensors the rank writes; a replica's bytes
  // in its slot would be of an older step).
  static bool DiskSnapshotsHoldEverything(const RankSegment& segment);
  // Forgets the rank's memory checkpoints of step >= `from`: those kept, and those still queued for
  // their checksums (they are then not kept). Returns how many.
  uint32_t DropMemoryFrom(RankSegment& segment, int64_t from) REQUIRES(mu_);
  // Memory checkpoint `step` of `job` rank `rank` failed its checksums (`error`): every memory
  // checkpoint of the rank is dropped (memory that failed once is not trusted again), with a
  // warning saying what the restore does `instead` and a MEMORY_FALLBACK event (the metric).
  void MemoryFailedLocked(RankSegment& segment, const std::string& job, uint32_t rank, int64_t step,
                          const Status& error, const char* instead) REQUIRES(mu_);
  // Pins memory checkpoint `step` of the segment (RESTORING and loading: nobody else takes it),
  // verifies its checksums without mu_ on `verifiers`, and lets it go again, still kept. kNotFound
  // when the segment no longer holds it; a checksum failure goes through MemoryFailedLocked
  // (`instead`) and is returned. `extra`, when given, receives the checkpoint's extra state.
  Status VerifyResident(const std::string& job, uint32_t rank, const std::shared_ptr<RankSegment>& segment,
                        int64_t step, ParallelLoop* verifiers, const char* instead, std::string* extra = nullptr)
      EXCLUDES(mu_);
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

  mutable Mutex mu_;
  CondVar cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
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
  // by segment name: unlinked by the idle-release thread once idle, unless their job came back.
  struct KeptEma {
    std::string job;
    std::chrono::steady_clock::time_point since;
  };
  std::map<std::string, KeptEma> kept_emas_ GUARDED_BY(mu_);
  std::unique_ptr<Housekeeper> housekeeper_;  // set once by Start, stopped by Stop
};

}  // namespace flashckpt

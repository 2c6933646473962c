// The checkpoints on disk under --root: where they go, when one is complete, which is the latest.
//
// A checkpoint directory is complete iff it holds metadata.json. Whichever daemon sees the last
// saved_signal_<rank> of a step builds metadata.json from the files' own headers and then moves
// LATEST forward; both are written with the durable rename sequence, so doing it twice is harmless.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/format/signal.h"
#include "common/io/io_env.h"
#include "common/read/listing.h"
#include "daemon/pipeline/lease.h"
#include "daemon/pipeline/metadata_cache.h"
#include "daemon/pipeline/node_parts.h"

namespace flashckpt {

// What a deletion (retention, `flashckpt delete`, `flashckpt gc`) did, or with dry_run would do.
struct DeletionOutcome {
  struct Skipped {
    int64_t step = 0;
    std::string reason;  // in use here (a restore reading it, a writer writing it), or "leased by ..."
  };
  std::vector<int64_t> deleted;   // oldest first
  std::vector<Skipped> skipped;   // oldest first
  std::optional<int64_t> latest;  // the newest complete checkpoint afterwards (what LATEST says)
};

class Catalog;

// What the catalog tells its listener: a checkpoint became complete (metadata.json written by this
// daemon), or a checkpoint directory was deleted (`reason`: "retention", or "delete" and "gc" for
// the operator's `flashckpt delete` and `flashckpt gc`).
enum class CatalogChange { kCompleted, kDeleted };
using CatalogListener =
    std::function<void(CatalogChange change, const std::string& job, int64_t step, std::string_view reason)>;

// Marks one step of a job as in use (a restore reading it, a writer writing it): retention does not
// delete it while the guard lives, and with leases (Catalog::SetLeases) neither does any other
// daemon that writes the same root. Move-only; the step is released in the destructor.
class StepInUse {
 public:
  StepInUse() = default;
  StepInUse(StepInUse&& o) noexcept;
  StepInUse& operator=(StepInUse&& o) noexcept;
  StepInUse(const StepInUse&) = delete;
  StepInUse& operator=(const StepInUse&) = delete;
  ~StepInUse() { Reset(); }
  void Reset();

 private:
  friend class Catalog;
  StepInUse(Catalog* catalog, std::string job, int64_t step, std::string lease)
      : catalog_(catalog), job_(std::move(job)), step_(step), lease_(std::move(lease)) {}
  Catalog* catalog_ = nullptr;
  std::string job_;
  int64_t step_ = 0;
  std::string lease_;  // its lease file in the shared root (Leases::Take); empty: none
};

class Catalog {
 public:
  // keep: after a checkpoint completes, retention keeps the newest `keep` complete checkpoints of the
  // job and deletes older ones (0 keeps everything; --keep).
  // `io`: every file-system call of the catalog goes through it (tests inject faults); not owned.
  explicit Catalog(std::string root, uint32_t keep = 0, IoEnv* io = IoEnv::Default())
      : root_(std::move(root)), keep_(keep), io_(io), metadata_(io, kMetadataKept), parts_(io, NewNodePartToken()) {}

  // Called after each change, on the thread that made it, with no catalog lock held but the job's
  // completion lock. Set once, before the catalog is used.
  void SetListener(CatalogListener listener) { listener_ = std::move(listener); }
  // Leases in the root (daemon/pipeline/lease.h): Use takes one, and every deletion skips a step
  // with a live lease of any daemon. Not owned; set once, before the catalog is used; null: none.
  void SetLeases(Leases* leases) { leases_ = leases; }

  const std::string& root() const { return root_; }
  std::string JobDir(const std::string& job) const { return root_ + "/" + job; }
  std::string CheckpointDir(const std::string& job, int64_t step) const;

  // Called after a rank's signal is durable: when all `world_size` signals of the step are present
  // and come from `attempt` (the run and the step the ranks resumed from: common/format/signal.h),
  // and metadata.json is not there yet, writes metadata.json (with the attempt) from the files those
  // signals list and advances LATEST. Signals left by an earlier attempt that crashed are not
  // counted: the ranks of the new attempt overwrite them. Returns whether the checkpoint is complete.
  // When this call wrote metadata.json and `keep` > 0, it then applies retention (ApplyRetention);
  // a retention failure is logged, never returned: the new checkpoint is complete either way.
  // `mixed` (optional): filled with every rank's signal when all are present but not all of `attempt`.
  // `loop` (optional): reads the signals and the files' headers on its threads.
  Result<bool> MaybeComplete(const std::string& job, int64_t step, uint32_t world_size, const Attempt& attempt,
                             std::map<uint32_t, Signal>* mixed = nullptr, ParallelLoop* loop = nullptr);
  // Removes `names` (files of step `step` of `job`, in order, stopping at the first that cannot be
  // removed) unless the step is complete; returns
  // how many it removed, or that it kept them (nothing) because metadata.json is there. Under the
  // job's lock, so this daemon's MaybeComplete never builds metadata.json from files that go
  // meanwhile; another daemon's completion is not excluded (the writer's caller decides).
  Result<std::optional<size_t>> RemoveUnlessComplete(const std::string& job, int64_t step,
                                                     const std::vector<std::string>& names);
  // The sweep: completes the steps among the newest `max_steps` step directories of `job` that are
  // not complete but hold the signals of all their ranks, of one attempt (the signals' world_size
  // says how many: older signals that do not record it are left to the daemon that wrote them).
  // On a shared root the last two signals of a step may be written by two daemons at once, each
  // missing the other's, or one daemon may see another's files late (NFS): every daemon sweeps its
  // jobs so that such a step completes anyway (MaybeComplete, which may run on several daemons:
  // metadata.json is written whole and renamed into place, LATEST moves forward only). Returns the
  // steps it completed.
  // Only steps whose signals are of one of `attempts` (those of the job's live sessions) are
  // completed: a step left by an attempt that has since restarted from an older step stays as it
  // is, for the new attempt to save again. LATEST is moved forward when it names an older step than
  // the newest complete one seen, or nothing (MoveLatestForward). A step that cannot be read does not
  // stop the others: the first such error is returned after all were looked at.
  Result<std::vector<int64_t>> CompleteSignalledSteps(const std::string& job, const std::vector<Attempt>& attempts,
                                                      size_t max_steps);

  // Protects `step` of `job` from retention until the returned guard is destroyed. Thread-safe.
  // A reader registers first and checks that the checkpoint is (still) complete afterwards: a
  // deletion either happened before the registration (the reader sees no checkpoint) or waits for
  // none and skips the step.
  StepInUse Use(const std::string& job, int64_t step) EXCLUDES(use_mu_);

  // Retention for `job` with `keep` (> 0) complete checkpoints kept: deletes every complete
  // checkpoint older than the newest `keep` complete ones, and every incomplete directory older
  // than the oldest kept complete one, except steps in use (Use). Never deletes the newest complete
  // checkpoint. A directory is first renamed to a hidden
  // `.deleting-checkpoint-<step>.<pid>.<place>` (so no reader ever sees half of it), then removed. Returns the deleted steps, oldest first.
  // Serialized with completion per job; blocks for the removals.
  Result<std::vector<int64_t>> ApplyRetention(const std::string& job, uint32_t keep);

  // `flashckpt gc`: the same rule as retention for any `keep` >= 1, with what was skipped and why.
  // `busy`: further steps to treat as in use (the daemon's slots that are filling or persisting
  // them). dry_run: plans only. Serialized with completion per job; blocks for the removals.
  Result<DeletionOutcome> CollectGarbage(const std::string& job, uint32_t keep, const std::set<int64_t>& busy,
                                         bool dry_run);
  // `flashckpt delete`: deletes checkpoint directory `step` of `job`, complete or not. kNotFound
  // when there is none; kFailedPrecondition when it is the newest complete checkpoint and !force
  // (the message says so), or when it is in use (Use, or in `busy`: never deleted, even with
  // force). When LATEST named it, LATEST moves to the newest remaining complete checkpoint, or is
  // removed when none remains. dry_run: checks and plans only.
  Result<DeletionOutcome> DeleteCheckpoint(const std::string& job, int64_t step, bool force,
                                           const std::set<int64_t>& busy, bool dry_run);

  // Errors are never taken for absence: on a shared filesystem an EIO, ESTALE, EACCES or ENOTDIR is
  // exactly when a trainer must not start from scratch or from an older step. Only ENOENT means
  // "not there"; every other failure is returned, naming the path.
  //
  // Whether checkpoint `step` of `job` is complete (its metadata.json exists).
  Result<bool> IsComplete(const std::string& job, int64_t step) const;
  // Whether its commit is over: complete, and LATEST names it or a newer step. The committing daemon
  // writes LATEST right after metadata.json, so a daemon sharing the root may see the one before the
  // other: what WaitComplete waits for, so that a rank told "complete" finds LATEST moved.
  Result<bool> IsCommitted(const std::string& job, int64_t step) const;
  // The head of metadata.json of checkpoint `step` of `job` (no pieces), read once for every caller
  // while the file stays the same (MetadataCache: the ranks of a job that register share it).
  // kNotFound when the checkpoint is not complete.
  Result<std::shared_ptr<const CheckpointMetadata>> Metadata(const std::string& job, int64_t step) const {
    return metadata_.Get(CheckpointDir(job, step));
  }
  // The metadata of checkpoint `step` of `job` with the pieces of the tensors named in `names` only
  // (ReadMetadataFor: through metadata.index.json), read once for the callers that ask for the same
  // names while one of them holds it (MetadataCache: a node's ranks restoring at once share it).
  // kNotFound when it is not complete.
  Result<std::shared_ptr<const CheckpointMetadata>> MetadataFor(const std::string& job, int64_t step,
                                                                const std::vector<std::string>& names) const {
    return metadata_.GetFor(CheckpointDir(job, step), names);
  }
  // IsCommitted, looked up in the root at most once per `max_age` for each job and step, whoever
  // asks: the ranks of a daemon that wait for one step (WaitComplete) share one look per period
  // instead of one each. The answer may be up to `max_age` old.
  Result<bool> IsCompleteShared(const std::string& job, int64_t step, std::chrono::milliseconds max_age) const
      EXCLUDES(looked_mu_);
  // Whether `rank` has written its part of `step` in `attempt`: its saved_signal is in place
  // (signals are written last, after the rank's files are durable). A signal that is missing, or
  // left by another attempt, is false; one that cannot be read or parsed is an error.
  Result<bool> HasSignal(const std::string& job, uint32_t rank, int64_t step, const Attempt& attempt) const;
  // The attempt of each signal of `step` among ranks 0..world_size-1 (a rank without one is absent).
  Result<std::map<uint32_t, Attempt>> SignalAttempts(const std::string& job, int64_t step, uint32_t world_size) const;
  // The checkpoint LATEST names with the run that wrote it (metadata.json's run_id, empty for one
  // written before runs had ids): two small reads, no listing of the job's directories. nullopt
  // when there is no LATEST, or it names no complete checkpoint.
  struct RunCheckpoint {
    int64_t step = 0;
    std::string run_id;
  };
  Result<std::optional<RunCheckpoint>> LatestRun(const std::string& job) const;
  // The newest complete checkpoint of the job on disk (not LATEST: a directory with metadata.json)
  // with the run that wrote it, by its saved_signal_0 (metadata.json's run_id when that cannot be
  // read), passing over those of run `skip_run` (empty: none passed over); nullopt when there is no
  // other. One listing of the job's directory and a small read per complete checkpoint, newest
  // first, until one is found. A checkpoint written before runs had ids is returned with an empty
  // run_id (never passed over).
  Result<std::optional<RunCheckpoint>> NewestComplete(const std::string& job, const std::string& skip_run) const;
  // A run that starts a new lineage of the job (ClientOptions::overwrite): deletes every checkpoint
  // directory that is another run's (complete ones it wrote, incomplete ones holding its signals and
  // none of `run_id`), except steps in use (Use, or `busy`), which are skipped.
  // Listeners see reason "overwrite"; LATEST follows as for any deletion.
  Result<DeletionOutcome> DeleteOtherRuns(const std::string& job, const std::string& run_id,
                                          const std::set<int64_t>& busy);
  // The newest complete checkpoint of the job; nullopt when the job directory does not exist or
  // holds no complete checkpoint. A job directory that cannot be listed (or is a dangling link), or
  // a checkpoint whose completeness cannot be told, is an error.
  Result<std::optional<int64_t>> LatestComplete(const std::string& job) const;

  // The newest complete checkpoint of `job` as this catalog knows it, for status: read from the
  // root (LatestComplete, without any lock held) the first time and when older than `max_age`,
  // moved forward by every completion this catalog writes and read again after every deletion. So
  // a status call costs nothing per checkpoint on disk, except the one that refreshes (which other
  // daemons writing the same root need). Errors are returned, and read again on the next call.
  Result<std::optional<int64_t>> KnownLatest(const std::string& job, std::chrono::steady_clock::duration max_age) const;

  // Every checkpoint directory (complete or not) of `job`, or of every job when empty; by job, step.
  Result<std::vector<CheckpointInfo>> List(const std::string& job) const;

  // What this daemon wrote of the steps not complete yet, rendered for their completion (the
  // writer notes each rank and publishes the daemon's part of a step; MaybeComplete uses them).
  NodeParts& parts() { return parts_; }

 private:
  friend class StepInUse;
  // The lock that serializes completion, retention and deletion of one job (held across their
  // file I/O: it is the job's, not the catalog's). Made on first use, never removed.
  Mutex& JobMutex(const std::string& job) EXCLUDES(mu_);
  Result<std::vector<int64_t>> ApplyRetentionLocked(const std::string& job, uint32_t keep);
  // Steps of the job's directories, complete ones newest first, incomplete ones oldest first.
  struct JobSteps {
    std::vector<int64_t> complete, incomplete;
  };
  Result<JobSteps> ScanSteps(const std::string& job) const;
  // Whether checkpoint directory `dir` holds the saved_signal of every rank below `world_size`,
  // by one listing (and a lookup by name of each rank it misses, up to the first really missing):
  // a completion check that reads no signal before all are there, so the checks of a step cost
  // the file system about one listing each, not one read per rank already signalled.
  // `parts` (optional): receives the node parts (NodePartFileName) the listing shows.
  Result<bool> AllSignalsPresent(const std::string& dir, uint32_t world_size,
                                 std::vector<std::string>* parts = nullptr) const;
  // MaybeComplete's signals of `ranks` (read on the loop's threads when there is one), by rank.
  std::vector<Result<Signal>> ReadSignals(const std::string& dir, const std::vector<uint32_t>& ranks,
                                          ParallelLoop* loop) const;
  // MaybeComplete's ranks whose files are rendered already: those this daemon holds and those of
  // the other daemons' parts among `part_names`, each only while its signal is the file the part
  // was made from. Parts that cannot be read are logged and left out.
  std::map<uint32_t, std::shared_ptr<const RankPart>> GatherParts(const std::string& dir, const std::string& job,
                                                                  int64_t step, uint32_t world_size,
                                                                  const Attempt& attempt,
                                                                  const std::vector<std::string>& part_names,
                                                                  ParallelLoop* loop) const;
  // The sweep's first look at an incomplete step directory holding `names`: true when it has no
  // signal, or fewer than the world size its first signal records (one read).
  bool FewerSignalsThanRanks(const std::string& dir, const std::vector<std::string>& names) const;
  // Retention's victims for `keep` >= 1: complete checkpoints older than the newest `keep`
  // complete ones, incomplete directories older than the oldest kept complete one. Oldest first.
  static std::vector<int64_t> RetentionVictims(const JobSteps& steps, uint32_t keep);
  // The one deletion path: deletes `victims` (oldest first) except the steps in use (Use or
  // `busy`), which are listed as skipped, then makes LATEST name the newest complete checkpoint
  // left (or removes it). `reason` goes to the log. Requires JobMutex(job).
  Result<DeletionOutcome> DeleteStepsLocked(const std::string& job, const std::vector<int64_t>& victims,
                                            const std::set<int64_t>& busy, bool dry_run, const char* reason);
  // DeleteStepsLocked's dry run of one step: lists it in `out` as skipped (in use here, or leased by
  // any daemon) or deleted; returns the error of reading its lease. Requires JobMutex(job).
  Status PlanStepDeletionLocked(const std::string& job, int64_t step, const std::set<int64_t>& busy,
                                DeletionOutcome* out) EXCLUDES(use_mu_);
  // DeleteStepsLocked's deletion of one step: hides and removes its directory unless it is in use,
  // listing it in `out` as deleted or skipped; returns (and logs) a failed removal. Requires
  // JobMutex(job).
  Status DeleteStepLocked(const std::string& job, int64_t step, const std::set<int64_t>& busy, const char* reason,
                          DeletionOutcome* out) EXCLUDES(use_mu_);
  // Makes LATEST name `latest_step`, or removes it when there is none, then fsyncs the job
  // directory; returns the first error. Requires JobMutex(job).
  Status SetLatestLocked(const std::string& job, std::optional<int64_t> latest_step);
  // Whether `step` is in use (Use) or in `busy`. Requires use_mu_.
  bool InUseLocked(const std::string& job, int64_t step, const std::set<int64_t>& busy) const REQUIRES(use_mu_);
  // Renames the directory of `step` away unless it is in use: on this daemon (Use, `busy`), or on
  // any daemon (a live lease, checked before the rename and again after it, when the directory is
  // renamed back if one has appeared); false when it is in use or gone.
  Result<bool> HideUnlessInUse(const std::string& job, int64_t step, const std::set<int64_t>& busy,
                               const std::string& hidden) EXCLUDES(use_mu_);
  void Release(const std::string& job, int64_t step, const std::string& lease) EXCLUDES(use_mu_);

  std::string root_;
  const uint32_t keep_;
  IoEnv* const io_;
  // The parsed metadata of the last checkpoints read (Metadata, MetadataFor): heads (a few, without
  // pieces) and the piece sets restores hold (freed when none holds them; a node's ranks of several
  // pipeline stages ask for several).
  static constexpr size_t kMetadataKept = 16;
  mutable MetadataCache metadata_;
  NodeParts parts_;
  CatalogListener listener_;
  Leases* leases_ = nullptr;
  Mutex mu_;
  std::map<std::string, std::unique_ptr<Mutex>> job_mu_ GUARDED_BY(mu_);  // JobMutex
  // Steps in use per job (a multiset: two readers may share a step). Held across the rename that
  // hides a directory, so a step is either registered before the rename or sees no checkpoint.
  mutable Mutex use_mu_;
  std::map<std::string, std::multiset<int64_t>> in_use_ GUARDED_BY(use_mu_);
  struct Known {
    std::optional<int64_t> step;
    bool read = false;  // false until the first read of the root has finished
    std::chrono::steady_clock::time_point read_at;
    uint64_t notes = 0;  // completions noted: tells a refresh that one came while it read
  };
  // IsCompleteShared's last look per job and step: when, and whether it was complete. At most
  // kMaxLooks entries (the oldest go).
  static constexpr size_t kMaxLooks = 1024;
  struct Look {
    std::chrono::steady_clock::time_point at;
    bool complete = false;
  };
  // Records a look at whether `step` is complete (IsCompleteShared) unless a newer one is there.
  void NoteLook(const std::string& job, int64_t step, std::chrono::steady_clock::time_point at, bool complete) const
      EXCLUDES(looked_mu_);
  mutable Mutex looked_mu_;
  mutable std::map<std::pair<std::string, int64_t>, Look> looked_ GUARDED_BY(looked_mu_);
  mutable Mutex known_mu_;
  mutable std::map<std::string, Known> known_ GUARDED_BY(known_mu_);  // a cache (KnownLatest)
  void NoteCompleted(const std::string& job, int64_t step) EXCLUDES(known_mu_);
  // Whether LATEST names a complete checkpoint newer than `step`.
  Result<bool> LatestNamesNewer(const std::string& job, int64_t step) const;
  // The step LATEST names; nullopt when it is missing or does not begin with a step number (torn).
  Result<std::optional<int64_t>> LatestNamed(const std::string& job) const;
  // Two daemons completing steps at the same moment each read LATEST, then each replace it: the
  // older step's rename may land last. LATEST is set to `complete` (a complete step) when it names
  // an older step or none; a newer step, complete or not (a file system that shows it late), stays.
  Status MoveLatestForward(const std::string& job, int64_t complete);
  void ForgetKnown(const std::string& job) EXCLUDES(known_mu_);
};

}  // namespace flashckpt

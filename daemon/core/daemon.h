// The daemon's core: sessions, registered ranks and their segments, the save and restore paths.
// The gRPC service (daemon/edge/service.*) is a thin translation layer on top of this class.
//
// Daemon is a facade: it starts and stops the workers (the writer, the EMA stage, the replica
// sender, the housekeeper) and hands each call to the unit that owns its concern (core.h lists
// them, with the lock they share and why). Every method is thread-safe; gRPC handler threads call
// in concurrently.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/io/io_env.h"
#include "daemon/core/core.h"
#include "daemon/core/daemon_config.h"
#include "daemon/core/housekeeper.h"
#include "daemon/core/lineage.h"
#include "daemon/core/memory_tier.h"
#include "daemon/core/outcomes.h"
#include "daemon/core/recovery.h"
#include "daemon/core/registrar.h"
#include "daemon/core/registration.h"
#include "daemon/core/releaser.h"
#include "daemon/core/restorer.h"
#include "daemon/core/save_path.h"
#include "daemon/observe/events.h"

namespace flashckpt {

class Daemon {
 public:
  explicit Daemon(DaemonConfig config);
  ~Daemon();

  // Creates the root directory, starts the writer, and adopts the slot segments a predecessor
  // left behind (daemon/core/recovery.cc): their committed snapshots are persisted again.
  Status Start() EXCLUDES(c_.mu_);
  // Memory outside the slot segments (the replicas held for peers, daemon/replica/replica_store.h),
  // counted in --max-host-memory with them: Reserve fails with RESOURCE_EXHAUSTED, saying `what`
  // needed the bytes, when they do not fit; Release gives back what Reserve took.
  Status ReserveHostMemory(uint64_t bytes, const std::string& what) EXCLUDES(c_.mu_);
  void ReleaseHostMemory(uint64_t bytes);
  // With --ec-group: one of this node's ranks' memory checkpoints as its parity blocks were cut
  // from it (Parity.FetchBlock; MemoryTier::OwnImageLocked).
  Result<OwnImage> OwnParityImage(const std::string& job, uint32_t rank, int64_t step, const std::string& run_id,
                                  int64_t resumed_from) EXCLUDES(c_.mu_);
  // With --ec-group: another member's block of `job` at `step` was added here. When none of this
  // node's ranks of the job holds a segment, the holders of this member's stripes are told it has
  // no ranks of the job (ParitySender::OfferNoRanks), so their shares of the step do not wait for it.
  void ParityHeardOf(const std::string& job, int64_t step) EXCLUDES(c_.mu_);
  // The parity sender (--ec-group), or null.
  const ParitySender* parity() const { return c_.parity_.get(); }

  // Refuses new work (UNAVAILABLE, saying the daemon is stopping), wakes every waiter, and lets
  // the EMA stage and the writer finish what was committed until `deadline`. What is not written
  // by then is abandoned: the writes stop at their next piece and remove their temporaries and
  // partial files, never writing a signal or metadata.json for it; its commit record and slot
  // segment stay, so the next daemon adopts and writes it, as after a crash. Logs what was
  // finished and what was abandoned. Idempotent.
  void Stop(std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max()) EXCLUDES(c_.mu_);

  // `reattach`: the trainer process of the rank's last session carrying on (SessionRequest.reattach).
  Result<std::string> OpenSession(const std::string& job, uint32_t rank, bool reattach = false) EXCLUDES(c_.mu_);
  void CloseSession(const std::string& session_id) EXCLUDES(c_.mu_);

  // fatal_persist_errors (in the request): once a persist of this session fails, its BeginSnapshot
  // and Commit fail with that error (code and message) until the trainer starts a new session; off,
  // a failed persist is reported by WaitPersisted and status only and snapshots go on.
  // `registration`: checked by ParseRegistration (the edge's job); its layout is checked here.
  Result<RegisterReply> Register(const std::string& session_id, const Registration& registration) EXCLUDES(c_.mu_);
  // tier kMemory: a memory checkpoint, kept in its slot once committed and never written
  // (FAILED_PRECONDITION with fewer than 2 slots, or for a rank with EMA tensors).
  Result<SlotTicket> BeginSnapshot(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout,
                                   SlotTier tier = SlotTier::kDisk) EXCLUDES(c_.mu_);
  Status Commit(const std::string& session_id, const SlotTicket& ticket, int64_t step, bool persist,
                std::optional<double> loss, std::string extra) EXCLUDES(c_.mu_);
  Status AbortSnapshot(const std::string& session_id, const SlotTicket& ticket) EXCLUDES(c_.mu_);
  Result<WaitResult> WaitPersisted(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  // Waits for this rank's files of `step` (WaitPersisted), then until checkpoint `step` is complete,
  // whoever completes it. Fails with the rank's persist error; FAILED_PRECONDITION when the step can
  // never complete because its ranks saved it in different attempts (seen at commit among this
  // daemon's sessions, or in the signals once `timeout` is up), naming the ranks and attempts; or
  // DEADLINE_EXCEEDED naming the ranks whose signals are missing.
  Status WaitComplete(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  // step 0 means the latest complete checkpoint; found=false when there is none.
  // Fills a slot with checkpoint `step` (0: the latest complete one) in the rank's layout, as `want`
  // says (RestoreWant). The rank's own memory checkpoint of that step (0: its newest, for a job of
  // one rank and when it is not older than the latest complete checkpoint) is handed over instead,
  // in its own slot, once its checksums verify; one that fails them is dropped with every other
  // memory checkpoint of the rank, logged, and the files are read.
  Result<RestoreOutcome> Restore(const std::string& session_id, int64_t step, const RestoreWant& want,
                                 std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  // The rank's candidates for the step its job restores: the memory checkpoints it holds here
  // (after the checksums still queued for them are computed, waiting until `timeout`), each
  // verified, and the job's newest complete checkpoint on disk. One that fails its checksums is
  // dropped with the rank's others (MEMORY_FALLBACK) and not listed. Needs no registration.
  // `extra_of` > 0: only that memory step is looked at, and its extra state is answered too.
  // verify=false: the steps held are listed without reading their bytes (the caller's restore
  // verifies the one it restores).
  Result<RestoreCandidates> Restorable(const std::string& session_id, std::chrono::milliseconds timeout,
                                       int64_t extra_of = 0, bool verify = true) EXCLUDES(c_.mu_);
  // The extra state of the rank's part of complete checkpoint `step` on disk (0: the newest), read
  // from its files, in `extra`, and that step in `disk_step` (0: none complete); `extra` is empty when
  // the checkpoint holds no part of the rank. Needs no registration and reads no tensor.
  Result<RestoreCandidates> DiskExtra(const std::string& session_id, int64_t step) EXCLUDES(c_.mu_);
  // Copies the current EMA into a slot (RESTORING until ReleaseSlot). initialized=false: no update yet.
  Result<EmaCopy> GetEma(const std::string& session_id, std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  // `corrupt` non-empty: the client found a chunk of the memory checkpoint handed over in the slot
  // not matching its checksum (what it found); the rank's memory checkpoints are dropped as when the
  // daemon's own verification fails, and a resume plan on that step is lost.
  Status ReleaseSlot(const std::string& session_id, const SlotTicket& ticket, const std::string& corrupt = "")
      EXCLUDES(c_.mu_);

  Result<std::vector<CheckpointInfo>> List(const std::string& job) const;
  // `flashckpt delete` (step > 0: that checkpoint; force allows the newest complete one) or
  // `flashckpt gc` (step 0, keep >= 1: retention's rule) through the catalog (Catalog::
  // DeleteCheckpoint, CollectGarbage). Besides the catalog's steps in use (restores, writers), a
  // step that a slot of this daemon is filling, has committed or is persisting is never deleted.
  Result<DeletionOutcome> DeleteCheckpoints(const std::string& job, int64_t step, uint32_t keep, bool force,
                                            bool dry_run) EXCLUDES(c_.mu_);
  // Forgets a job none of whose ranks is connected, once nothing of it is waiting to be written:
  // unlinks its slot segments (with their records) and its EMA segments, which the checkpoints
  // hold. `reason` is the event's ("release": an operator; "idle": --idle-release). NOT_FOUND for
  // a job the daemon does not hold; FAILED_PRECONDITION, naming why, while a rank is connected or
  // a snapshot of it is still on its way to disk.
  // A job's memory checkpoint newer than its newest complete one on disk is written first (the call
  // waits up to `timeout` for it), and the job is kept if it cannot be; `force` drops it instead.
  Result<ReleaseOutcome> ReleaseJob(const std::string& job, const std::string& reason = "release", bool force = false,
                                    std::chrono::milliseconds timeout = std::chrono::seconds(120)) EXCLUDES(c_.mu_);

  // Jobs, ranks and connected ranks, from memory (takes mu_ and nothing else: no file I/O).
  SessionCounts CountSessions() const EXCLUDES(c_.mu_);
  // The daemon's memory, jobs and ranks; each job's last complete step is read from the root
  // without the daemon's lock (a failure to read it is the job's catalog_error).
  DaemonStatus GetStatus() const EXCLUDES(c_.mu_);
  // The name of the EMA segment this daemon keeps for `rank` of `job` (EmaSegmentName with this
  // daemon's scope: a hash of its state directory, or of its root when it has none). Set by Start.
  std::string EmaSegmentName(const std::string& job, uint32_t rank) const;

  const DaemonConfig& config() const { return c_.config_; }
  // What the daemon does to its checkpoint root goes through this (DaemonConfig::io_env, or the OS).
  IoEnv* RootIo() const { return c_.RootIo(); }

  // What happened to snapshots and checkpoints, for WatchEvents; closed at the end of Stop.
  EventHub& events() { return c_.events_; }
  // The Prometheus exposition of the daemon's metrics and current status.
  std::string RenderMetrics() const EXCLUDES(c_.mu_);

 private:
  // The jobs and ranks part of GetStatus, from memory: takes mu_ (and the writer's lock).
  void FillJobsStatus(DaemonStatus* out) const EXCLUDES(c_.mu_);

  Core c_;
  Registrar registrar_{c_};
  Lineage lineage_{c_};
  SavePath save_{c_};
  MemoryTier memory_{c_};
  Restorer restorer_{c_};
  Releaser releaser_{c_};
  Recovery recovery_{c_};
  std::unique_ptr<Housekeeper> housekeeper_;  // set once by Start, stopped by Stop
};

}  // namespace flashckpt

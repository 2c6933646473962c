// The memory tier: memory checkpoints kept in slots, their verification, their replica offers and
// the fetch of a peer's replica, and their writes at stop and before release (memory_tier.cc,
// peer_fetch.cc).
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
#include "daemon/parity/parity_store.h"

namespace flashckpt {

struct ReplicaMeta;  // daemon/replica/replica_layout.h

class MemoryTier {
 public:
  explicit MemoryTier(Core& core) : c_(core) {}
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  // Stop's --persist-on-stop: hands the writer, for each job, its newest memory checkpoint held by
  // every rank of it here, if newer than the job's latest complete checkpoint. Returns how many
  // ranks' snapshots were queued.
  uint32_t PersistMemoryOnStop() EXCLUDES(c_.mu_);
  // Hands the writer memory checkpoint `step` of every rank of `name` here that holds it, each
  // verified against its checksums first (`disk`: the newest complete step, for the log; `why`:
  // "on stop", "before release"). Returns how many ranks' writes were queued; an error when a copy
  // failed its checksums (nothing is written then) or a write could not be queued.
  Result<uint32_t> PersistMemoryStep(const std::string& name, int64_t step, int64_t disk, const char* why)
      EXCLUDES(c_.mu_);
  // Why the job's memory cannot be given back now, or "" when it can: a connected rank, or a
  // snapshot still in a slot on its way through the EMA stage or the writer.
  // The memory steps every rank of `job` here holds, newest first.
  static std::vector<int64_t> CommonMemoryStepsLocked(const Core& c_, const JobState& job) REQUIRES(c_.mu_);
  // Whether every rank of `job` here holding memory step `step` has written it (this process).
  static bool MemoryStepWrittenLocked(const Core& c_, const JobState& job, int64_t step) REQUIRES(c_.mu_);
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
  // beats a step held here, in memory or as the newest complete checkpoint on disk. One fetch per
  // rank runs at a time: a second call (the resume plan's and the rank's own restore) waits for the
  // first, within its deadline, then looks at what the rank holds now.
  void FetchPeerReplica(const std::string& job, uint32_t rank, std::chrono::steady_clock::time_point deadline,
                        int64_t step = 0) EXCLUDES(c_.mu_);
  // The lineage a job is on at this daemon, for FetchPeerReplica: the run of its newest complete
  // checkpoint on disk (and that step), and the runs of the rank's memory checkpoints here.
  struct HeldLineage {
    std::set<std::string> runs;
    std::string disk_run;
    int64_t disk_step = 0;
  };
  // Whether replica `m` continues `lineage`: of one of its runs, or of an attempt that restored a
  // complete checkpoint of the job here (its resumed_from step is complete on disk). Any replica
  // does where nothing is held here. FAILED_PRECONDITION saying why not. Reads the disk.
  Status ContinuesLineage(const std::string& job, const ReplicaMeta& m, const HeldLineage& lineage) EXCLUDES(c_.mu_);
  // The rank's number for its current attempt on the replica channel (ReplicaMeta::attempt):
  // numbered afresh after a restore and in a new process. Requires mu_.
  static uint64_t ReplicaAttemptNumber(Core& c_, RankState& state) REQUIRES(c_.mu_);
  // The rank restored `step` (RankState::Restored); with --replicate-to its peers are told
  // (ReplicaSender::Retract). Requires mu_.
  static void RestoredLocked(Core& c_, const std::string& job, uint32_t rank, RankState& state, int64_t step) REQUIRES(c_.mu_);
  // With --replicate-to: queues the memory checkpoint that `slot` of the rank's segment now holds
  // for the peers (ReplicaSender::Offer). Only one of the rank's current attempt is sent.
  static void OfferReplicaLocked(Core& c_, const std::shared_ptr<RankSegment>& segment, uint32_t slot, const std::string& job,
                          uint32_t rank) REQUIRES(c_.mu_);
  // With --ec-group: the image of (job, rank)'s memory checkpoint of `step` by `attempt` as its
  // parity blocks were cut from it, while a slot holds it (Parity.FetchBlock); NOT_FOUND otherwise.
  static Result<OwnImage> OwnImageLocked(Core& c_, const std::string& job, uint32_t rank, int64_t step,
                                         const Attempt& attempt) REQUIRES(c_.mu_);
  // Whether a rank with a segment of `slots` slots can take memory checkpoints: FAILED_PRECONDITION
  // naming the reason when it cannot (checked at Register when the rank declares them, and at each
  // memory BeginSnapshot). A rank with EMA tensors keeps the EMA of each memory checkpoint's step in
  // the slot's EMA room (ResidentCheckpoint::ema).
  static Status MemoryTierFits(uint32_t slots);
  // Whether a disk snapshot of the segment's rank can double as a memory checkpoint: it has no EMA
  // and holds no replica (a disk snapshot copies only the tensors the rank writes; a replica's bytes
  // in its slot would be of an older step).
  static bool DiskSnapshotsHoldEverything(const RankSegment& segment);
  // Forgets the rank's memory checkpoints of step >= `from`: those kept, and those still queued for
  // their checksums (they are then not kept). Returns how many.
  static uint32_t DropMemoryFrom(Core& c_, RankSegment& segment, int64_t from) REQUIRES(c_.mu_);
  // Memory checkpoint `step` of `job` rank `rank` failed its checksums (`error`): every memory
  // checkpoint of the rank is dropped (memory that failed once is not trusted again), with a
  // warning saying what the restore does `instead` and a MEMORY_FALLBACK event (the metric).
  static void MemoryFailedLocked(Core& c_, RankSegment& segment, const std::string& job, uint32_t rank, int64_t step,
                          const Status& error, const char* instead) REQUIRES(c_.mu_);
  // The bytes of memory checkpoint `resident` in `slot` of the segment against its checksums: the
  // rank's tensors (`tensors_in_client`: only their checksums' fit to the layout, as the client
  // checks the bytes as it copies them) and, for a rank with EMA, the EMA image of its step.
  static Status VerifyResidentBytes(const RankSegment& segment, uint32_t slot, const ResidentCheckpoint& resident,
                                    ParallelLoop* verifiers, bool tensors_in_client = false);
  // Pins memory checkpoint `step` of the segment (RESTORING and loading: nobody else takes it),
  // verifies its checksums without mu_ on `verifiers`, and lets it go again, still kept. kNotFound
  // when the segment no longer holds it; a checksum failure goes through MemoryFailedLocked
  // (`instead`) and is returned. `extra`, when given, receives the checkpoint's extra state.
  Status VerifyResident(const std::string& job, uint32_t rank, const std::shared_ptr<RankSegment>& segment,
                        int64_t step, ParallelLoop* verifiers, const char* instead, std::string* extra = nullptr)
      EXCLUDES(c_.mu_);

 private:
  Core& c_;
  // The ranks whose peer fetch or parity rebuild is under way (FetchPeerReplica). A leaf lock,
  // never held across the fetch.
  Mutex fetching_mu_;
  CondVar fetching_cv_;
  std::set<std::pair<std::string, uint32_t>> fetching_ GUARDED_BY(fetching_mu_);
};

}  // namespace flashckpt

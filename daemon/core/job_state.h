// The core's record of each job and each of its ranks (Core::jobs_, guarded by Core::mu_), and
// of each session.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "common/base/status.h"
#include "daemon/core/core_types.h"
#include "daemon/core/outcomes.h"
#include "daemon/core/registration.h"
#include "daemon/core/segment.h"
#include "daemon/core/slots.h"

namespace flashckpt {

struct RankState {
  std::shared_ptr<RankSegment> segment;
  std::string session_id;  // empty when the trainer is gone
  Topology topology;
  Backpressure policy = Backpressure::kWait;
  int64_t last_begun = -1;   // per session: steps must increase
  int64_t process_last_begun = -1;  // the same for the process, kept when it re-attaches (a resume plan's staleness)
  int64_t resumed_from = 0;  // per session: the step it restored, 0 if none (the attempt)
  // Per session: the memory checkpoint last handed over for the client to verify as it copies
  // (RestoreWant::verify_in_client), until ReleaseSlot gives its slot back: resumed_from becomes
  // its step then, or, with a reported mismatch, it fails as if the daemon had verified it.
  struct ClientVerified {
    SlotTicket ticket;
    int64_t step = 0;
    bool planned = false;  // the job's resume plan chose it
  };
  std::optional<ClientVerified> client_verifying;
  std::string run_id;        // per session: its run, set by Register (the attempt)
  // Per session: the run a registration in progress has chosen, before it is registered (it lets
  // mu_ go while it makes the segment). Ranks that register meanwhile join it, as they would
  // join a registered rank's run, so concurrent registrations without a run id draw one run.
  std::string pending_run;
  // Per session: its run was agreed through the root's launches (the rank named none), and the
  // error when that failed (the session's first snapshot is then refused, naming the fix).
  bool run_agreed = false;
  Status run_unagreed;
  uint64_t agreed_launch = 0;  // the launch it joined, when run_agreed
  bool launch_checked = false;  // per session: its first snapshot found no newer launch
  // Per session: a step this rank saved is split (its job's ranks saved it in different attempts),
  // so no checkpoint of this attempt mix completes: its next snapshot and wait fail with this.
  Status split_error;
  bool overwrite = false;    // per registration: its first snapshot may start a new lineage
  bool lineage_checked = false;  // per process: the first BeginSnapshot's lineage check passed
  // Per session: it re-attached a session of the same trainer process (the client says so after a
  // broken stream or a daemon restart). Only such a session may carry on its run's checkpoints
  // without restoring; a new process reusing a run id is a fresh start (CheckLineage).
  bool reattached = false;
  // The trainer process: counts sessions that were not re-attachments. A persist reports to
  // last_persisted and `failed` only while its process is the rank's (WaitPersisted of a new
  // process is never answered by its predecessor's steps).
  uint64_t process = 0;
  // The same process among every process of every rank this daemon process ever served (its
  // instance id and a count that is never reset, also when the job is released): it names the
  // trainer to the job's other daemons (ResumeAgreement).
  std::string process_token;
  Attempt attempt() const { return Attempt{run_id, resumed_from}; }
  // The number its replicas carry for the attempt (ReplicaHeader.attempt): the wall-clock ms at
  // which this daemon numbered attempt `numbered` in this process (`numbered_process`): at the
  // restore that began it (RestoredLocked, with --replicate-to), else at the first memory
  // checkpoint of it offered to the peers (ReplicaAttemptNumber).
  Attempt numbered;
  uint64_t numbered_process = 0;
  uint64_t attempt_number = 0;  // 0: numbered afresh when next needed
  // The highest attempt number seen for the rank, its own or a peer's replica's (FetchPeerReplica):
  // the next number is above it, whatever the wall clock says.
  uint64_t attempt_floor = 0;
  // A restore of `step` completed: the rank's later checkpoints are of a new timeline, with a new
  // attempt number (also when it restores the same step again in the same process).
  void Restored(int64_t step, int64_t now_ms) {
    resumed_from = step;
    attempt_number = 0;
    attempt_began_ms = now_ms;
  }
  // When the session's current attempt began here (wall clock, ms): its process's session opened,
  // or its last restore. A signal of another attempt committed after it was alive at the same time.
  int64_t attempt_began_ms = 0;
  std::chrono::steady_clock::time_point gone_since{};  // when its last session ended (or was adopted)
  bool registered = false;   // per session: Register succeeded (its topology is current)
  uint64_t registrations = 0;  // Register calls that made a segment: tells a call it was overtaken
  int64_t last_committed = -1;
  int64_t last_persisted = -1;
  std::string last_error;
  // Recent failed persists by step (bounded), so WaitPersisted(step) reports each one's error.
  std::map<int64_t, Status> failed;
  // Committed steps a stop left to the next daemon (not reached by the EMA stage or the writer
  // before its deadline), so WaitPersisted(step) says so instead of waiting for them.
  std::set<int64_t> abandoned;
  // Recent steps this process committed as memory checkpoints (bounded), so WaitPersisted and
  // WaitComplete of one say at once that it is never written.
  std::set<int64_t> memory_steps;
  bool fatal_persist_errors = false;  // per registration (Register)
  // Per registration: the rank takes memory checkpoints and its disk snapshots hold every tensor
  // (DiskSnapshotsHoldEverything), so each of them is also checksummed and kept as its newest
  // memory checkpoint once written.
  bool memory_checkpoints = false;
  // Per registration: the trainer said it takes memory checkpoints (RegisterRequest). A resume of
  // the latest by a job with ranks on other daemons then agrees with them (AgreeWithOtherDaemons).
  bool declares_memory_checkpoints = false;
  Status fatal_error;                 // per session: with fatal_persist_errors, the first failed persist
  uint64_t snapshots = 0, persists = 0, failures = 0, skipped = 0;
  double last_persist_gbps = 0;
};
struct JobState {
  // Idle release: the memory step it last had written first (newer than the disk), and whether a
  // failure to write it was told (the job is kept then, until a trainer comes back or an operator
  // releases it with --force).
  int64_t release_write_step = -1;
  int64_t release_disk_step = -1;  // the disk's newest complete step when it was queued
  bool release_kept_told = false;
  Topology topology;  // degrees and world size of the current registration
  std::map<uint32_t, RankState> ranks;
  // Parity (--ec-group): the order of the job's ranks here by their first memory checkpoint (rank ->
  // a sequence number; ranks without a segment leave it). A rank's place among this member's ranks
  // is its index in that order, so a rank that registers late comes after the others and moves
  // none of them (a step's blocks are coded by place).
  std::map<uint32_t, uint64_t> parity_order;
  uint64_t parity_next = 0;
  // Steps of an earlier layout that may still be in progress when a registration changed the
  // job's layout (world size or degrees), with that layout: the newest step the job's ranks
  // persisted here, and the steps in their slots then. While one of them is still in progress
  // (LayoutHoldLocked, CheckLayoutHold), a session that has not restored a checkpoint may not
  // save: its signals would land beside the other layout's in a checkpoint that never completes.
  std::map<int64_t, Topology> held_steps;
  int64_t newest_persisted = -1;  // the newest step any rank of the job persisted here
  // Split attempts: for recent steps, the attempt in which each rank's session committed it (with
  // the session, so that a gone session's commits never count); the steps found saved in
  // different attempts, with their description; how many; the newest one's description.
  struct Committed {
    std::string session_id;
    Attempt attempt;
  };
  std::map<int64_t, std::map<uint32_t, Committed>> committed_attempts;
  struct Split {
    std::string text;                            // the step, the ranks and their attempts
    std::map<uint32_t, std::string> sessions;  // the sessions that committed it, by rank
  };
  std::map<int64_t, Split> split_steps;
  uint64_t split_attempts = 0;
  std::string split;
  std::set<std::string> overwritten_for;  // runs whose overwrite deleted the other runs' checkpoints
  // The step every rank of the job restores when it asks for the latest (ResumePlanFor): made by
  // the first rank's Restore and taken by each rank; forgotten when it goes stale (a taker's new
  // process, another run or world size, or 10 minutes).
  std::optional<ResumePlan> resume_plan;
  bool planning = false;  // a rank is making the plan (off the lock): the others wait for it
  // The ranks that asked for the latest, with their process then: those a plan made with the job's
  // other daemons is published for (AgreeWithOtherDaemons).
  std::map<uint32_t, uint64_t> plan_asks;
  // The ranks here that asked for the latest holding no memory checkpoints (while other daemons
  // serve ranks of the job), with their process then and their agreement token: the daemon's one
  // view of the job lists them all, not only the last to ask.
  struct AloneAsk {
    uint64_t process = 0;
    std::string token;
    std::chrono::steady_clock::time_point at{};  // an ask older than a view stays fresh is over
  };
  std::map<uint32_t, AloneAsk> alone_asks;
  uint64_t alone_changes = 0;  // counts changes of alone_asks: a view written from an older list is written again
};
struct SessionInfo {
  std::string job;
  uint32_t rank = 0;
};

}  // namespace flashckpt

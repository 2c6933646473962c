// What a flashckptd reports about itself, as plain C++ structs: its status (memory, jobs, ranks,
// slots), its checkpoint directories, the events of snapshots and checkpoints, and what a deletion
// did. The daemon builds them (its GetStatus and events) and the operator side of the client
// library (admin.h) hands the same structs out, so both speak one vocabulary; the wire format in
// between is flashckpt.v1.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flashckpt {

// One slot of a rank's segment.
struct SlotStatus {
  uint32_t index = 0;
  std::string state;  // "free", "memory" (free, holding a memory checkpoint of `step`), "filling", "committed",
                      // "persisting", "restoring"
  int64_t step = 0;   // negative: none
  // "filling": seconds since BeginSnapshot handed it out (a trainer that stops between
  // BeginSnapshot and Commit keeps it filling); 0 in any other state.
  double filling_seconds = 0;
};

// One rank registered with the daemon. Steps that have not happened yet are negative.
struct RankStatus {
  uint32_t rank = 0;
  bool connected = false;  // its session is open
  uint64_t segment_bytes = 0;
  int64_t last_committed_step = 0;
  int64_t last_persisted_step = 0;
  std::string last_error;  // of the last failed save; empty: none
  uint64_t snapshots = 0;
  uint64_t persists = 0;
  uint64_t failures = 0;
  uint64_t skipped = 0;  // snapshots refused for want of a free slot (skip policy)
  std::vector<SlotStatus> slots;
  double oldest_write_seconds = 0;  // how long its oldest persist being written has run; 0: none
  double last_persist_gbps = 0;     // rate of its last persist; 0: none yet
  std::string run_id;               // its session's run; empty: not registered
  int64_t resumed_from = 0;         // the step its process restored; 0: it started fresh
  int64_t memory_step = -1;         // its newest memory checkpoint kept here; negative: none
  uint32_t memory_checkpoints = 0;  // memory checkpoints its slots keep
  uint64_t memory_bytes = 0;        // bytes of the slots that keep them
  // Its EMA (all zero when off).
  bool ema_enabled = false;
  double ema_decay = 0;
  int64_t ema_last_step = 0;  // step of the last update applied; negative: none yet
  uint64_t ema_updates_applied = 0;
  uint64_t ema_updates_skipped = 0;  // refused by the loss threshold
  uint64_t ema_bytes = 0;            // size of the rank's ema.*.safetensors image
};

struct JobStatus {
  std::string job;
  uint32_t world_size = 0;
  int64_t last_complete_step = 0;  // negative: none, or it could not be told (catalog_error)
  std::vector<RankStatus> ranks;   // the ranks registered with this daemon
  std::string catalog_error;       // why the job's checkpoints cannot be read; empty: they can
  // Steps its ranks saved in different attempts (never to complete), and the newest such split:
  // the step, the ranks and their attempts. Empty: none.
  uint64_t split_attempts = 0;
  std::string split;
};

// The daemon, its memory and every job and rank it knows.
// A peer daemon this one sends its ranks' memory checkpoints to (flashckptd --replicate-to).
struct ReplicaPeerStatus {
  std::string target;   // HOST:PORT
  uint64_t pushed = 0;  // replicas the peer acknowledged
  uint64_t failed = 0;  // pushes that failed or were cancelled
  uint64_t bytes = 0;   // bytes of the acknowledged ones
  uint32_t queued = 0;  // checkpoints waiting for this peer now (at most one per rank)
  // The most, over this node's ranks, of the rank's newest memory checkpoint step minus the newest
  // step of its that the peer acknowledged (the whole step while the peer acknowledged none of the
  // rank's current attempt).
  int64_t lag_steps = 0;
  double last_gbps = 0;    // of the last acknowledged push
  std::string last_error;  // of the last failed push; cleared by the next acknowledged one
};

struct DaemonStatus {
  std::string version;
  double uptime_seconds = 0;
  uint64_t host_memory_used = 0;
  uint64_t host_memory_budget = 0;  // --max-host-memory
  std::string root;
  std::string node_name;       // flashckptd --node-name: what its signals record
  bool cuda_compiled = false;  // the daemon's build has CUDA
  int32_t cuda_devices = 0;    // the devices the daemon sees (the trainers' are theirs)
  std::vector<JobStatus> jobs;
  std::vector<ReplicaPeerStatus> replica_peers;  // --replicate-to, in the order given
  // --replica-listen: the ranks of other nodes whose replica this daemon holds, and their bytes.
  bool replica_listening = false;
  uint32_t replicas_held = 0;
  uint64_t replica_held_bytes = 0;
  // --ec-group: this daemon's index in its parity group, the group's size and parity (--ec-parity),
  // the complete parity shares it holds for the other members and their bytes, and its own
  // checkpoints' blocks the other members acknowledged and the pushes to them that failed.
  bool ec_group = false;
  uint32_t ec_member = 0;
  uint32_t ec_members = 0;
  uint32_t ec_parity = 0;
  uint32_t parity_shares_held = 0;
  uint64_t parity_held_bytes = 0;
  int64_t parity_step = 0;  // the oldest step of the complete shares held (0: none)
  uint64_t parity_sent = 0;
  uint64_t parity_failed = 0;
};

// A rank whose saved_signal is in a checkpoint directory, and the node whose daemon wrote it
// (flashckptd --node-name; empty: not recorded, by an older release).
struct SignalledRank {
  uint32_t rank = 0;
  std::string node;
  // The attempt its signal records: the run, and the step its process restored (0: fresh). Ranks of
  // one step in different attempts never complete it (a split).
  std::string run_id;
  int64_t resumed_from = 0;
};

// One checkpoint directory under a root.
struct CheckpointInfo {
  std::string job;
  int64_t step = 0;
  bool complete = false;  // metadata.json exists
  uint32_t signals = 0;   // saved_signal files present
  // From metadata.json when complete, else from the signals (which record it); 0: unknown.
  uint32_t world_size = 0;
  uint64_t bytes = 0;
  std::string path;
  bool latest = false;  // the newest complete checkpoint of its job (what LATEST names)
  std::vector<SignalledRank> signalled;  // the ranks that have signalled, by rank
};

// One thing that happened to a snapshot or a checkpoint, as the daemon saw it. Fields that do not
// apply to a kind are zero or empty.
struct DaemonEvent {
  enum class Kind {
    kUnknown,             // sent by a newer daemon
    kSnapshotCommitted,   // a rank's snapshot is in its slot (bytes: the rank's state; reason: what for)
    kSnapshotSkipped,     // no free slot under the skip policy (reason)
    kEmaUpdated,          // the rank's EMA took the step (seconds: the update's duration)
    kPersisted,           // the rank's files and signal of the step are durable (bytes, seconds)
    kPersistFailed,       // reason: the error; code: its code name (IO_ERROR, RESOURCE_EXHAUSTED, ...)
    kCheckpointComplete,  // metadata.json written: every rank of the step is durable
    kCheckpointDeleted,   // reason: "retention", "delete", "gc" or "overwrite"
    kEventsLost,          // this watcher fell behind; `lost` events were dropped for it
    kPersistAbandoned,    // the daemon stopped before writing it (reason); the next daemon does
    kJobReleased,         // the job's shared memory was given back (bytes); reason: "idle" or "release"
    kSplitAttempt,        // ranks saved `step` in different attempts, so it never completes (reason)
    kMemoryFallback,      // the rank's memory checkpoint of `step` failed its checksums: dropped, the
                          // files are read instead (reason: the error)
    kReplicaSent,         // a peer acknowledged the rank's memory checkpoint of `step` (peer, bytes, seconds)
    kReplicaFailed,       // a push to a peer failed (peer; reason: the error); once per change of the
                          // peer's error, not per retry
    kParitySent,          // a parity group member (peer) holds its share of the blocks of the rank's memory
                          // checkpoint of `step` (bytes, seconds)
    kParityFailed,        // a parity push to a member failed (peer; reason); once per change of its error
    kParityRebuilt,       // the rank's memory checkpoint of `step` was rebuilt from the group's parity (bytes,
                          // seconds; reason: the members it came from)
  };
  Kind kind = Kind::kUnknown;
  double unix_seconds = 0;
  std::string job;
  uint32_t rank = 0;
  int64_t step = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  std::string reason;
  uint64_t lost = 0;
  std::string code;
  std::string peer;  // replica and parity events: the peer daemon (HOST:PORT)
};

struct SkippedCheckpoint {
  int64_t step = 0;
  std::string reason;  // e.g. in use by a restore or a save
};

// What Delete or Gc deleted (or, dry run, would delete).
struct DeleteResult {
  std::vector<int64_t> deleted;  // oldest first
  std::vector<SkippedCheckpoint> skipped;
  int64_t latest = -1;  // the newest complete checkpoint afterwards; negative: none
};

}  // namespace flashckpt

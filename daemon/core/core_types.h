// The daemon core's own vocabulary: what Daemon returns from Register and GetStatus and what it
// publishes as events. The gRPC edge (daemon/edge/service.cc, and tcp_service.cc through it) translates
// them to and from the flashckpt.v1 messages in one place, daemon/edge/wire.*; nothing below the edge
// builds a protobuf message, except the state directory's records, which are a file format.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flashckpt {

// Where one tensor lies in a slot of the rank's segment.
struct TensorLocation {
  std::string name;
  std::string file;  // the image it is saved in ("model_state.tp00_pp00_shard00"); empty when not saved
  uint64_t slot_offset = 0;
  uint64_t bytes = 0;
  bool ema_source = false;  // read by the daemon's EMA: the only tensors an EMA-only snapshot copies
};

// Register's answer: the rank's segment and its slots.
struct RegisterReply {
  std::string segment_name;
  uint64_t segment_bytes = 0;
  uint32_t slot_count = 0;
  uint64_t slot_offset = 0;  // of slot 0 in the segment
  uint64_t slot_stride = 0;
  std::vector<TensorLocation> placements;
  std::vector<TensorLocation> ema_placements;  // the EMA tensors, as GetEma leaves them in a slot
};

// GetStatus: the daemon's memory, jobs and ranks.
struct SlotReport {
  uint32_t index = 0;
  std::string state;  // "free", "filling", ... (SlotStateName)
  int64_t step = -1;
};

struct RankReport {
  uint32_t rank = 0;
  bool connected = false;
  uint64_t segment_bytes = 0;
  int64_t last_committed_step = -1;
  int64_t last_persisted_step = -1;
  std::string last_error;
  uint64_t snapshots = 0, persists = 0, failures = 0, skipped = 0;
  std::vector<SlotReport> slots;
  bool ema_enabled = false;
  uint64_t ema_bytes = 0;
  int64_t ema_last_step = -1;
  uint64_t ema_updates_applied = 0, ema_updates_skipped = 0;
  double ema_decay = 0;
  double oldest_write_seconds = 0;  // the rank's oldest persist being written; 0 when none
  double last_persist_gbps = 0;     // the rank's last successful persist; 0 before one
};

struct JobReport {
  std::string job;
  uint32_t world_size = 0;
  int64_t last_complete_step = -1;  // -1: none, or it could not be told (catalog_error)
  std::vector<RankReport> ranks;
  std::string catalog_error;  // why the job's checkpoints could not be read; empty when they could
};

struct StatusReport {
  std::string version;
  double uptime_seconds = 0;
  uint64_t host_memory_used = 0;
  uint64_t host_memory_budget = 0;
  std::string root;
  std::vector<JobReport> jobs;
  bool cuda_compiled = false;
  int32_t cuda_devices = 0;
};

// One thing that happened to a snapshot or a checkpoint, for watchers and the metrics
// (daemon/observe/events.h). Fields that do not apply to a kind are zero or empty.
struct Event {
  enum class Kind {
    kSnapshotCommitted,   // a rank's snapshot is in its slot (bytes: the rank's state)
    kSnapshotSkipped,     // BeginSnapshot found no free slot under the skip policy
    kEmaUpdated,          // the rank's EMA took the step (seconds: the update's duration)
    kPersisted,           // the rank's files and signal are durable (bytes, seconds)
    kPersistFailed,       // reason: the error, code: its code name
    kCheckpointComplete,  // metadata.json written: every rank of the step is durable
    kCheckpointDeleted,   // reason: "retention", "delete" or "gc"
    kEventsLost,          // this watcher fell behind; `lost` events were dropped for it
    kPersistAbandoned,    // the daemon stopped before writing it (reason); the next daemon does
  };
  Kind kind = Kind::kSnapshotCommitted;
  double unix_seconds = 0;
  std::string job;
  uint32_t rank = 0;
  int64_t step = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  std::string reason;
  uint64_t lost = 0;
  std::string code;
};

}  // namespace flashckpt

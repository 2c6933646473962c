// The daemon core's own vocabulary: what Daemon returns from Register and GetStatus and what it
// publishes as events. The gRPC edge (daemon/edge/service.cc, and tcp_service.cc through it) translates
// them to and from the flashckpt.v1 messages in one place, daemon/edge/wire.*; nothing below the edge
// builds a protobuf message (the state directory's records are encoded by the edge's codec too,
// daemon/edge/state_records.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "flashckpt/daemon_types.h"
#include "flashckpt/tensor.h"

namespace flashckpt {

// Where one tensor lies in a slot of the rank's segment.
struct TensorLocation {
  std::string name;
  std::string file;  // the image it is saved in ("model_state.tp00_pp00_shard00"); empty when not saved
  uint64_t slot_offset = 0;
  uint64_t bytes = 0;
  bool ema_source = false;  // read by the daemon's EMA: the only tensors an EMA-only snapshot copies
  TensorKind kind = TensorKind::kModel;
};

// What a restore reads (RestoreRequest): with convert_dtype, bf16/fp16 tensors may be filled from
// fp32 saved ones; `kinds` (empty: all) limits it to the rank's tensors of those kinds, and then the
// EMA is not loaded; `source_job` (empty: the session's own) reads another job's checkpoint, which
// starts no attempt of the session's job.
struct RestoreWant {
  bool convert_dtype = false;
  std::vector<TensorKind> kinds;
  std::string source_job;
  // The client checks a memory checkpoint's chunks itself while it copies them (RestoreOutcome's
  // chunk sums), so the daemon hands it over without hashing the slot first.
  bool verify_in_client = false;
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
  std::string run_id;                          // the session's run (the request's or the daemon's pick)
};

}  // namespace flashckpt

// A rank's registration as the core decides on it: what the edge parsed and checked from a
// trainer's RegisterRequest (daemon/edge/registration.h), or what a restarted daemon reads back
// from its state directory. The limits every registration is held to by default live here too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/format/layout.h"
#include "daemon/pipeline/ema.h"

namespace flashckpt {

// Default of --max-tensors-per-rank. A rank of a 70B dense model registers about 3,000 tensors
// (weights, two Adam moments, master weights); 65,536 leaves room for unfused MoE experts.
// kMaxTensorsPerRank (common/format/layout.h) is the highest value the flag takes.
inline constexpr uint32_t kDefaultMaxTensorsPerRank = 1u << 16;

enum class Backpressure { kWait, kSkip };

struct Registration {
  Topology topology;
  std::vector<TensorSpec> tensors;
  Backpressure policy = Backpressure::kWait;
  EmaConfig ema;
  int64_t resumed_from = 0;  // the attempt a re-attaching client carries on (0: none)
  std::string run_id;        // the trainer's run id (checked: ValidateRunId); empty: the daemon picks
  bool overwrite = false;    // a fresh start may replace the job's checkpoints of another run
  bool fatal_persist_errors = false;
  bool memory_checkpoints = false;  // the rank takes memory checkpoints: checked against --slots at Register
};

// The bytes of all of a rank's registered tensors (replicas included) against --max-rank-bytes;
// 0 means no cap (only --max-host-memory). kResourceExhausted, naming job, rank and sizes.
Status CheckRankBytes(const RankLayout& layout, uint64_t limit);

}  // namespace flashckpt

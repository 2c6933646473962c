// A rank's registration as the daemon understands it, parsed from the RegisterRequest a trainer
// sends (daemon/edge/service.cc) or that a restarted daemon reads back from its state directory
// (daemon/core/recovery.cc): both go through ParseRegistration, so both are checked the same way.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/format/layout.h"
#include "daemon/pipeline/ema.h"
#include "flashckpt.pb.h"

namespace flashckpt {

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

// Converts and checks the request's fields; the layout itself is checked by BuildRankLayout.
Result<Registration> ParseRegistration(const v1::RegisterRequest& request);

}  // namespace flashckpt

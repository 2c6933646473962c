// saved_signal_<rank>: the marker a rank leaves in a checkpoint directory once its files of the
// step are durable. It lists those files and the attempt (the step the run resumed from), so that a
// checkpoint is only ever assembled from the files of one attempt.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/status.h"
#include "common/io/io_env.h"

namespace flashckpt {

struct Signal {
  uint32_t rank = 0;
  int64_t step = 0;
  int64_t resumed_from = 0;
  std::vector<std::string> files;
};

// The signal as one line of JSON; `bytes` is the size of the rank's files, for operators.
std::string EncodeSignal(const std::string& job, const Signal& signal, uint64_t bytes);
// Parses the contents of a signal file. The input is untrusted: every field is type- and
// range-checked, and each file name must be a plain name inside the checkpoint directory (not empty,
// ".", "..", and without '/' or NUL). Errors are kCorruption.
Result<Signal> ParseSignal(std::string_view text);
// Reads and parses the signal file at `path` (at most 1 MiB); errors name the path.
Result<Signal> ReadSignal(const std::string& path, IoEnv* io = IoEnv::Default());

}  // namespace flashckpt

// The checkpoints under a root as its files show them: what `flashckpt list` prints, served by the
// daemon (ListCheckpoints) and read offline (`flashckpt list --root DIR`) by the same code.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/io/io_env.h"
#include "flashckpt/daemon_types.h"

namespace flashckpt {

// Every checkpoint-<step> directory of `job` under `root` (every job when `job` is empty), sorted
// by job and step, with the ranks that have signalled and the node that wrote each signal. A
// directory that disappears while it is read (retention, perhaps on another node) is left out; a
// job name that is not valid is refused.
Result<std::vector<CheckpointInfo>> ListCheckpoints(const std::string& root, const std::string& job,
                                                    IoEnv* io = IoEnv::Default());

// One checkpoint directory `path`, checkpoint `step` of `job`, as ListCheckpoints shows it (its
// `latest` is false); nullopt when the directory does not exist.
Result<std::optional<CheckpointInfo>> DescribeCheckpointDir(const std::string& job, int64_t step,
                                                            const std::string& path, IoEnv* io = IoEnv::Default());

}  // namespace flashckpt

// Names that become paths or keys: validation and the one place that formats them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/base/status.h"

namespace flashckpt {

inline constexpr size_t kMaxJobNameLength = 128;
inline constexpr size_t kMaxTensorNameLength = 512;
inline constexpr size_t kMaxRunIdLength = 64;
inline constexpr size_t kMaxNodeNameLength = 64;

// Job names are [A-Za-z0-9._-]{1,128} and never "." or "..": they become a directory under --root.
Status ValidateJobName(std::string_view job);
// Run ids (RegisterRequest.run_id: a scheduler's job id, or one the daemon draws) are
// [A-Za-z0-9._:-]{1,64}: they are written into signals, metadata.json and logs.
Status ValidateRunId(std::string_view run_id);
// Node names (flashckptd --node-name, the host name by default, cut to 64) are [A-Za-z0-9._:-]{1,64}:
// they are written into signals and lease file names and shown by status, list and inspect.
Status ValidateNodeName(std::string_view node);
// The host name (gethostname), with any character a node name does not allow replaced by '-'.
std::string DefaultNodeName();
// Tensor names are printable ASCII without quotes, backslashes or '@' (the metadata key separator).
Status ValidateTensorName(std::string_view name);

// "model_state.tp00_pp01_shard00" (two digits at least, more when a degree needs them).
std::string FileStem(std::string_view kind, uint32_t tp, uint32_t pp, uint32_t shard);
// The largest step: ParseCheckpointDirName reads at most 18 digits, so a larger step would be
// saved into a directory that no listing, restore or retention ever finds.
inline constexpr int64_t kMaxStep = 999'999'999'999'999'999;

// The key of the initial metadata WatchEvents sends once the watcher is subscribed: a client tells
// a stream that ended after it was connected (the daemon stopped) from one that never connected.
inline constexpr char kWatchSubscribedKey[] = "flashckpt-watch-subscribed";

// "checkpoint-1200"
std::string CheckpointDirName(int64_t step);
// Parses "checkpoint-<step>"; nullopt for anything else.
std::optional<int64_t> ParseCheckpointDirName(std::string_view name);
// "saved_signal_3"
std::string SignalFileName(uint32_t rank);
// The rank of a SignalFileName; nullopt for any other name (leading zeros, signs, > 2^32-1).
std::optional<uint32_t> ParseSignalFileName(std::string_view name);
// "extra.rank00003.json"
std::string ExtraFileName(uint32_t rank);

// Parses "64GiB", "512MiB", "1.5GiB", "1000000", "4G" (binary units) into bytes.
std::optional<uint64_t> ParseByteSize(std::string_view text);
// "38.2 GiB"
std::string FormatBytes(uint64_t bytes);

// An untrusted string for an error message: at most `max` bytes, marked when cut.
std::string Clip(std::string_view text, size_t max = 64);

}  // namespace flashckpt

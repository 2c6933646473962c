// extra.rankNNNNN.json: the trainer's opaque state of one rank and step (RNG, data position,
// learning rate, ...), as the daemon writes it next to the rank's tensors and gives it back on
// restore. Shared by the writer and the restore path; the file is untrusted when read.
//
//   {"format": "flashckpt-extra", "job": ..., "rank": ..., "step": ...,
//    "encoding": "none" | "json" | "base64", "data": ...}
//
// Bytes that parse as JSON are embedded as JSON (readable with any tool); other bytes as base64.
#pragma once

#include <cstdint>
#include <string>

#include "common/base/status.h"

namespace flashckpt {

// The content of extra.rankNNNNN.json for `extra` (embedded when it is JSON, base64 otherwise).
std::string EncodeExtra(const std::string& job, uint32_t rank, int64_t step, const std::string& extra);
// The trainer's bytes back; kCorruption for a file that is not such an object.
Result<std::string> DecodeExtra(const std::string& file_contents);
// The same, and kCorruption unless the file says it is `job`'s, `rank`'s and `step`'s.
Result<std::string> DecodeExtra(const std::string& file_contents, const std::string& job, uint32_t rank,
                                int64_t step);

}  // namespace flashckpt

#include "daemon/edge/limits.h"

#include "common/base/names.h"

namespace flashckpt {

Status CheckSessionId(std::string_view id) {
  bool ok = id.size() == 16;
  for (char c : id) ok = ok && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
  if (ok) return Status::OK();
  return InvalidArgument("session_id '" + Clip(id, 32) +
                         "' is not a session id (16 hex digits, sent first on the Session stream)");
}

Status CheckStep(int64_t step, std::string_view field) {
  if (step < 0) return InvalidArgument(std::string(field) + " must be non-negative, got " + std::to_string(step));
  if (step > kMaxStep) {
    return InvalidArgument(std::string(field) + " " + std::to_string(step) + " is above the largest step " +
                           std::to_string(kMaxStep) + " (checkpoint directory names have at most 18 digits)");
  }
  return Status::OK();
}

Result<std::chrono::milliseconds> RequestTimeout(uint32_t timeout_ms, uint32_t default_ms) {
  if (timeout_ms > kMaxRequestTimeoutMs) {
    return InvalidArgument("timeout_ms " + std::to_string(timeout_ms) + " is above the limit of " +
                           std::to_string(kMaxRequestTimeoutMs) + " ms (24 h); 0 asks for the default of " +
                           std::to_string(default_ms) + " ms");
  }
  return std::chrono::milliseconds(timeout_ms == 0 ? default_ms : timeout_ms);
}

Status CheckTensorCount(uint64_t count, uint32_t limit) {
  if (count <= limit) return Status::OK();
  return InvalidArgument("tensors: " + std::to_string(count) + " tensors in one registration, above the limit of " +
                         std::to_string(limit) + " per rank (--max-tensors-per-rank)");
}

}  // namespace flashckpt

// Status and Result<T>: the one error type of flashckpt, on both sides of the socket.
//
// A Status is a code plus a message; an ok Status holds no allocation. Result<T> is a value or a
// non-ok Status. Every fallible flashckpt call returns one of these; nothing on the data path throws.
#pragma once

#include <cassert>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "flashckpt/export.h"

namespace flashckpt {

// Every error code flashckpt uses. The gRPC mapping lives in daemon/edge/service and client/src only.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,     // a request or a flag is malformed; fix the caller
  kNotFound,            // job, checkpoint, tensor or file does not exist
  kAlreadyExists,       // e.g. a step that is already a complete checkpoint
  kFailedPrecondition,  // the call is valid but not in this state (slot not handed out, ...)
  kResourceExhausted,   // budget exceeded, no free slot under the skip policy
  kDeadlineExceeded,    // a wait ran out of time
  kUnavailable,         // the daemon cannot be reached or is shutting down
  kCorruption,          // bytes on disk or in memory fail validation (checksum, header)
  kIOError,             // a system call failed
  kInternal,            // a bug: an invariant did not hold
  kCancelled,           // the session ended or the operation was abandoned
};

FLASHCKPT_API std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] FLASHCKPT_API Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message);

  static Status OK() { return Status(); }

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return ok() ? StatusCode::kOk : state_->code; }
  // Empty for an ok Status.
  const std::string& message() const;
  // "NOT_FOUND: no checkpoint for job 'llama'" or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>" (ok stays ok).
  Status WithContext(std::string_view context) const;

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

 private:
  struct State {
    StatusCode code;
    std::string message;
  };
  std::unique_ptr<State> state_;
};

inline Status InvalidArgument(std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); }
inline Status NotFound(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
inline Status AlreadyExists(std::string m) { return Status(StatusCode::kAlreadyExists, std::move(m)); }
inline Status FailedPrecondition(std::string m) {
  return Status(StatusCode::kFailedPrecondition, std::move(m));
}
inline Status ResourceExhausted(std::string m) {
  return Status(StatusCode::kResourceExhausted, std::move(m));
}
inline Status DeadlineExceeded(std::string m) { return Status(StatusCode::kDeadlineExceeded, std::move(m)); }
inline Status Unavailable(std::string m) { return Status(StatusCode::kUnavailable, std::move(m)); }
inline Status Corruption(std::string m) { return Status(StatusCode::kCorruption, std::move(m)); }
inline Status IOError(std::string m) { return Status(StatusCode::kIOError, std::move(m)); }
inline Status Internal(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }
inline Status Cancelled(std::string m) { return Status(StatusCode::kCancelled, std::move(m)); }

// A value of type T or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    assert(!std::get<Status>(v_).ok() && "Result<T> built from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace flashckpt

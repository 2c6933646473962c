#include "flashckpt/status.h"

namespace flashckpt {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kCorruption: return "CORRUPTION";
    case StatusCode::kIOError: return "IO_ERROR";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kCancelled: return "CANCELLED";
  }
  return "UNKNOWN";
}

Status::Status(StatusCode code, std::string message) {
  if (code != StatusCode::kOk) state_ = std::make_unique<State>(State{code, std::move(message)});
}

Status::Status(const Status& other)
    : state_(other.state_ ? std::make_unique<State>(*other.state_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) state_ = other.state_ ? std::make_unique<State>(*other.state_) : nullptr;
  return *this;
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return ok() ? kEmpty : state_->message;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(StatusCodeName(state_->code));
  s += ": ";
  s += state_->message;
  return s;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Status(state_->code, std::string(context) + ": " + state_->message);
}

}  // namespace flashckpt

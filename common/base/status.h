// Internal helpers around the public Status type: propagation macros and errno conversion.
#pragma once

#include <cerrno>
#include <string>
#include <string_view>

#include "flashckpt/status.h"

namespace flashckpt {

// A failed system call as a Status: "open /x/y.tmp: No space left on device (errno 28)".
// ENOSPC and EDQUOT map to kResourceExhausted so callers can tell a full disk from other I/O errors,
// ENOENT to kNotFound, ECANCELED (a CancellableIo after Cancel) to kCancelled.
Status ErrnoStatus(std::string_view what, std::string_view path, int err = errno);

}  // namespace flashckpt

#define FC_CONCAT_INNER(a, b) a##b
#define FC_CONCAT(a, b) FC_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function when it is not ok.
#define RETURN_IF_ERROR(expr)                          \
  do {                                                 \
    ::flashckpt::Status _fc_status = (expr);           \
    if (!_fc_status.ok()) return _fc_status;           \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, ResultExpr())`: binds the value or returns the Status.
#define ASSIGN_OR_RETURN(lhs, rexpr) ASSIGN_OR_RETURN_IMPL(FC_CONCAT(_fc_result_, __LINE__), lhs, rexpr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                          \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(tmp).value()

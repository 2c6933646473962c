// Bounds on what one request may ask of the daemon. Every number and string in a request comes from
// a peer the daemon does not trust to be well-formed: these limits keep its arithmetic far from
// overflow and its memory and waits finite. Each refusal names the request field, and the flag
// where a flag sets the limit. The gRPC edge (daemon/edge/service.cc) checks them before it converts a
// request; the per-rank byte cap needs the built layout and is checked by Daemon::Register
// (CheckRankBytes, daemon/core/registration.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/base/status.h"
#include "common/format/layout.h"
#include "daemon/core/registration.h"  // kDefaultMaxTensorsPerRank, CheckRankBytes

namespace flashckpt {

// The longest wait a request may ask for (timeout_ms): a day. 0 asks for the RPC's default.
inline constexpr uint32_t kMaxRequestTimeoutMs = 24u * 3600 * 1000;

// The largest request message the daemon accepts, on every listener. Above gRPC's 4 MiB default
// so that Commit's 4 MiB extra-state limit is the one that refuses (naming the field) rather than
// the transport, whose RESOURCE_EXHAUSTED names nothing.
inline constexpr int kMaxRequestMessageBytes = 16 << 20;
// The largest request the read-only TCP listener accepts (it serves status and list requests).
inline constexpr int kMaxReadOnlyRequestBytes = 64 << 10;

// Session ids are RandomToken()s (16 lowercase hex digits); anything else is malformed, not unknown.
Status CheckSessionId(std::string_view id);
// Steps are 0..kMaxStep (common/base/names.h). `field` names the request field in the message.
Status CheckStep(int64_t step, std::string_view field = "step");
// timeout_ms of a request: 0 gives `default_ms`; above kMaxRequestTimeoutMs is refused.
Result<std::chrono::milliseconds> RequestTimeout(uint32_t timeout_ms, uint32_t default_ms);
// The number of tensors of a registration against --max-tensors-per-rank.
Status CheckTensorCount(uint64_t count, uint32_t limit);

}  // namespace flashckpt

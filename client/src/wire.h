// The client library's side of the wire: conversions between its public types (client.h,
// admin.h) and the flashckpt.v1 protobuf messages. The mapping from gRPC status codes to flashckpt's
// is proto/convert.h's (FromGrpc), and so is the daemon's side of it (ToGrpc): IO_ERROR,
// which gRPC has no code for, travels as INTERNAL with "IO_ERROR" in the status details.
#pragma once

#include <grpcpp/support/status.h>

#include <string>
#include <string_view>
#include <vector>

#include "flashckpt.pb.h"
#include "flashckpt/admin.h"
#include "flashckpt/client.h"
#include "flashckpt/status.h"
#include "proto/convert.h"

namespace flashckpt {

// --- trainer client ---
// Register's request (without the session id and resumed_from, which each attempt sets).
v1::RegisterRequest RegisterRequestOf(const Topology& topology, const std::vector<TensorSpec>& tensors,
                                      const EmaOptions& ema, const ClientOptions& options);
// GetStatus's answer in protobuf's JSON mapping with the proto field names (Client::StatusJson).
Result<std::string> StatusResponseJson(const v1::StatusResponse& status);

// --- operator client (admin.h) ---
DaemonStatus DaemonStatusFromProto(const v1::StatusResponse& status);
std::vector<CheckpointInfo> CheckpointsFromProto(const v1::ListCheckpointsResponse& list);
DaemonEvent EventFromProto(const v1::Event& event);
DeleteResult DeleteResultFromProto(const v1::DeleteCheckpointsResponse& resp);

}  // namespace flashckpt

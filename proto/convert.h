// The public types (flashckpt/tensor.h) as flashckpt.v1 messages: what the client library sends in
// Register and what the daemon keeps of a registration in its state directory, converted the same
// way on both sides. The other direction is the daemon's ParseRegistration (daemon/edge/registration.h),
// which also checks what it reads.
#pragma once

#include <grpcpp/support/status.h>

#include <cstdint>
#include <optional>
#include <string_view>

#include "flashckpt.pb.h"
#include "flashckpt/status.h"
#include "flashckpt/tensor.h"

namespace flashckpt {

v1::TensorKind TensorKindToProto(TensorKind kind);  // kEma (the daemon's own) has no message kind
void TopologyToProto(const Topology& topology, v1::Topology* out);
void TensorSpecToProto(const TensorSpec& spec, v1::TensorSpec* out);
// An enabled EMA as RegisterRequest.ema carries it, from the fields that the client's EmaOptions
// (client.h) and the daemon's EmaConfig (daemon/pipeline/ema.h) share: what the client asks for
// and what the daemon records of a registration are encoded alike.
void EmaToProto(double decay, uint32_t interval, bool init_zeros, bool all_float_params,
                std::optional<double> loss_threshold, v1::EmaOptions* out);
// gRPC's name of a code: "FAILED_PRECONDITION", "PERMISSION_DENIED", ...; "UNRECOGNIZED" for a
// value outside the enum.
const char* GrpcCodeName(grpc::StatusCode code);

// The flashckpt code of a gRPC status (kOk for an ok one), for every gRPC client of a daemon (the
// trainer client, and a daemon calling its replica peers). gRPC codes without a flashckpt code
// (PERMISSION_DENIED, UNIMPLEMENTED, UNKNOWN, ...) are kInternal.
StatusCode CodeFromGrpc(const grpc::Status& s);
// A failed call as a client reports it: "<rpc>: <the daemon's message>".
Status FromGrpc(const grpc::Status& s, std::string_view rpc);
// The gRPC status a daemon's service answers with for `s` (IO_ERROR travels as INTERNAL with
// "IO_ERROR" in its details; CORRUPTION as DATA_LOSS).
grpc::Status ToGrpc(const Status& s);

}  // namespace flashckpt

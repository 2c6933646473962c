#include "proto/convert.h"

#include <string>

#include "common/base/dtype.h"

namespace flashckpt {

v1::TensorKind TensorKindToProto(TensorKind kind) {
  switch (kind) {
    case TensorKind::kModel: return v1::TENSOR_KIND_MODEL;
    case TensorKind::kOptimizer: return v1::TENSOR_KIND_OPTIMIZER;
    case TensorKind::kMasterWeight: return v1::TENSOR_KIND_MASTER_WEIGHT;
    case TensorKind::kEma: break;  // the daemon's own kind: refused at registration
  }
  return v1::TENSOR_KIND_UNSPECIFIED;
}

void TopologyToProto(const Topology& topology, v1::Topology* out) {
  out->set_world_size(topology.world_size);
  out->set_tp_rank(topology.tp_rank);
  out->set_tp_degree(topology.tp_degree);
  out->set_pp_rank(topology.pp_rank);
  out->set_pp_degree(topology.pp_degree);
  out->set_shard_rank(topology.shard_rank);
  out->set_shard_degree(topology.shard_degree);
}

void TensorSpecToProto(const TensorSpec& spec, v1::TensorSpec* out) {
  out->set_name(spec.name);
  out->set_kind(TensorKindToProto(spec.kind));
  out->set_dtype(std::string(DTypeName(spec.dtype)));
  for (uint64_t d : spec.shape) out->add_shape(d);
  for (uint64_t d : spec.global_shape) out->add_global_shape(d);
  for (uint64_t d : spec.box_offset) out->add_box_offset(d);
  for (uint64_t d : spec.box_shape) out->add_box_shape(d);
  if (spec.flat_range) {
    out->set_has_flat_range(true);
    out->set_flat_begin(spec.flat_range->begin);
    out->set_flat_end(spec.flat_range->end);
  }
  out->set_replica(spec.replica);
  out->set_param(spec.param);
}

void EmaToProto(double decay, uint32_t interval, bool init_zeros, bool all_float_params,
                std::optional<double> loss_threshold, v1::EmaOptions* out) {
  out->set_enabled(true);
  out->set_decay(decay);
  out->set_interval(interval);
  out->set_init(init_zeros ? "zeros" : "first");
  out->set_model_params(all_float_params ? "all" : "fp32");
  if (loss_threshold) {
    out->set_has_loss_threshold(true);
    out->set_loss_threshold(*loss_threshold);
  }
}

const char* GrpcCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    default: return "UNRECOGNIZED";
  }
}

StatusCode CodeFromGrpc(const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::OK: return StatusCode::kOk;
    case grpc::StatusCode::INVALID_ARGUMENT: return StatusCode::kInvalidArgument;
    case grpc::StatusCode::NOT_FOUND: return StatusCode::kNotFound;
    case grpc::StatusCode::ALREADY_EXISTS: return StatusCode::kAlreadyExists;
    case grpc::StatusCode::FAILED_PRECONDITION: return StatusCode::kFailedPrecondition;
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return StatusCode::kResourceExhausted;
    case grpc::StatusCode::DEADLINE_EXCEEDED: return StatusCode::kDeadlineExceeded;
    case grpc::StatusCode::UNAVAILABLE: return StatusCode::kUnavailable;
    case grpc::StatusCode::DATA_LOSS: return StatusCode::kCorruption;
    case grpc::StatusCode::CANCELLED: return StatusCode::kCancelled;
    // The daemon sends IO_ERROR (a failed system call: a failing disk) as INTERNAL named in the details.
    case grpc::StatusCode::INTERNAL:
      return s.error_details() == "IO_ERROR" ? StatusCode::kIOError : StatusCode::kInternal;
    default: return StatusCode::kInternal;
  }
}

Status FromGrpc(const grpc::Status& s, std::string_view rpc) {
  if (s.ok()) return Status::OK();
  return Status(CodeFromGrpc(s), std::string(rpc) + ": " + s.error_message());
}

grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  // gRPC has no code for a failed system call: IO_ERROR travels as INTERNAL with its own name in the
  // status details, so the client can tell a failing disk from a bug in the daemon.
  if (s.code() == StatusCode::kIOError) return grpc::Status(grpc::StatusCode::INTERNAL, s.message(), "IO_ERROR");
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  switch (s.code()) {
    case StatusCode::kOk: code = grpc::StatusCode::OK; break;
    case StatusCode::kInvalidArgument: code = grpc::StatusCode::INVALID_ARGUMENT; break;
    case StatusCode::kNotFound: code = grpc::StatusCode::NOT_FOUND; break;
    case StatusCode::kAlreadyExists: code = grpc::StatusCode::ALREADY_EXISTS; break;
    case StatusCode::kFailedPrecondition: code = grpc::StatusCode::FAILED_PRECONDITION; break;
    case StatusCode::kResourceExhausted: code = grpc::StatusCode::RESOURCE_EXHAUSTED; break;
    case StatusCode::kDeadlineExceeded: code = grpc::StatusCode::DEADLINE_EXCEEDED; break;
    case StatusCode::kUnavailable: code = grpc::StatusCode::UNAVAILABLE; break;
    case StatusCode::kCorruption: code = grpc::StatusCode::DATA_LOSS; break;
    case StatusCode::kIOError: code = grpc::StatusCode::INTERNAL; break;
    case StatusCode::kInternal: code = grpc::StatusCode::INTERNAL; break;
    case StatusCode::kCancelled: code = grpc::StatusCode::CANCELLED; break;
  }
  return grpc::Status(code, s.message());
}

}  // namespace flashckpt

#include "client/src/wire.h"

#include <google/protobuf/util/json_util.h>

#include "common/dtype.h"

namespace flashckpt {

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

v1::TensorKind KindToProto(TensorKind k) {
  switch (k) {
    case TensorKind::kModel: return v1::TENSOR_KIND_MODEL;
    case TensorKind::kOptimizer: return v1::TENSOR_KIND_OPTIMIZER;
    case TensorKind::kMasterWeight: return v1::TENSOR_KIND_MASTER_WEIGHT;
    case TensorKind::kEma: break;  // the daemon's own kind: refused at registration
  }
  return v1::TENSOR_KIND_UNSPECIFIED;
}

v1::RegisterRequest RegisterRequestOf(const Topology& topology, const std::vector<TensorSpec>& tensors,
                                      const EmaOptions& ema, const ClientOptions& options) {
  v1::RegisterRequest req;
  auto* t = req.mutable_topology();
  t->set_world_size(topology.world_size);
  t->set_tp_rank(topology.tp_rank);
  t->set_tp_degree(topology.tp_degree);
  t->set_pp_rank(topology.pp_rank);
  t->set_pp_degree(topology.pp_degree);
  t->set_shard_rank(topology.shard_rank);
  t->set_shard_degree(topology.shard_degree);
  req.set_backpressure(options.skip_when_busy ? v1::BACKPRESSURE_SKIP : v1::BACKPRESSURE_WAIT);
  req.set_fatal_persist_errors(options.fatal_persist_errors);
  if (ema.decay) {
    auto* e = req.mutable_ema();
    e->set_enabled(true);
    e->set_decay(*ema.decay);
    e->set_interval(ema.interval);
    e->set_init(ema.init_zeros ? "zeros" : "first");
    e->set_model_params(ema.all_float_params ? "all" : "fp32");
    if (ema.loss_threshold) {
      e->set_has_loss_threshold(true);
      e->set_loss_threshold(*ema.loss_threshold);
    }
  }
  for (const auto& spec : tensors) {
    auto* p = req.add_tensors();
    p->set_name(spec.name);
    p->set_kind(KindToProto(spec.kind));
    p->set_dtype(std::string(DTypeName(spec.dtype)));
    for (auto d : spec.shape) p->add_shape(d);
    for (auto d : spec.global_shape) p->add_global_shape(d);
    for (auto d : spec.box_offset) p->add_box_offset(d);
    for (auto d : spec.box_shape) p->add_box_shape(d);
    if (spec.flat_range) {
      p->set_has_flat_range(true);
      p->set_flat_begin(spec.flat_range->begin);
      p->set_flat_end(spec.flat_range->end);
    }
    p->set_replica(spec.replica);
    p->set_param(spec.param);
  }
  return req;
}

Result<std::string> StatusResponseJson(const v1::StatusResponse& status) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  auto converted = google::protobuf::util::MessageToJsonString(status, &json, options);
  if (!converted.ok()) return Internal("cannot render the daemon status as JSON: " + converted.ToString());
  return json;
}

}  // namespace flashckpt

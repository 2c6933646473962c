#include "daemon/edge/registration.h"

#include "common/base/dtype.h"
#include "common/base/names.h"
#include "daemon/edge/limits.h"

namespace flashckpt {
namespace {

Result<TensorSpec> TensorFromProto(const v1::TensorSpec& p) {
  TensorSpec t;
  RETURN_IF_ERROR(ValidateTensorName(p.name()));  // before the name is quoted in any message
  t.name = p.name();
  switch (p.kind()) {
    case v1::TENSOR_KIND_MODEL: t.kind = TensorKind::kModel; break;
    case v1::TENSOR_KIND_OPTIMIZER: t.kind = TensorKind::kOptimizer; break;
    case v1::TENSOR_KIND_MASTER_WEIGHT: t.kind = TensorKind::kMasterWeight; break;
    default:
      return InvalidArgument("tensor '" + p.name() + "': kind " + std::to_string(p.kind()) +
                             " is not TENSOR_KIND_MODEL, _OPTIMIZER or _MASTER_WEIGHT");
  }
  auto dtype = ParseDType(p.dtype());
  if (!dtype) {
    return InvalidArgument("tensor '" + p.name() + "': dtype '" + Clip(p.dtype()) +
                           "' is not one of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL");
  }
  t.dtype = *dtype;
  t.shape.assign(p.shape().begin(), p.shape().end());
  t.global_shape.assign(p.global_shape().begin(), p.global_shape().end());
  t.box_offset.assign(p.box_offset().begin(), p.box_offset().end());
  t.box_shape.assign(p.box_shape().begin(), p.box_shape().end());
  if (p.has_flat_range()) t.flat_range = FlatRange{p.flat_begin(), p.flat_end()};
  t.replica = p.replica();
  t.param = p.param();
  return t;
}

Result<EmaConfig> EmaFromProto(const v1::EmaOptions& p) {
  EmaConfig c;
  c.enabled = p.enabled();
  if (!c.enabled) return c;
  c.decay = p.decay();
  c.interval = p.interval();
  if (p.init() == "zeros") {
    c.init_zeros = true;
  } else if (!p.init().empty() && p.init() != "first") {
    return InvalidArgument("ema_init must be 'first' or 'zeros', got '" + Clip(p.init()) + "'");
  }
  if (p.model_params() == "all") {
    c.all_float_params = true;
  } else if (!p.model_params().empty() && p.model_params() != "fp32") {
    return InvalidArgument("ema_model_params must be 'fp32' or 'all', got '" + Clip(p.model_params()) + "'");
  }
  if (p.has_loss_threshold()) c.loss_threshold = p.loss_threshold();
  RETURN_IF_ERROR(ValidateEmaConfig(c));
  return c;
}

}  // namespace

Result<Registration> ParseRegistration(const v1::RegisterRequest& req) {
  Registration r;
  const auto& t = req.topology();
  r.topology = Topology{t.world_size(), t.tp_rank(),    t.tp_degree(),   t.pp_rank(),
                        t.pp_degree(),  t.shard_rank(), t.shard_degree()};
  // The count is bounded by the caller (the service's --max-tensors-per-rank, a record's size) and
  // again by BuildRankLayout.
  r.tensors.reserve(static_cast<size_t>(req.tensors_size()));
  for (const auto& p : req.tensors()) {
    ASSIGN_OR_RETURN(TensorSpec spec, TensorFromProto(p));
    r.tensors.push_back(std::move(spec));
  }
  r.policy = req.backpressure() == v1::BACKPRESSURE_SKIP ? Backpressure::kSkip : Backpressure::kWait;
  ASSIGN_OR_RETURN(r.ema, EmaFromProto(req.ema()));
  if (req.resumed_from() < 0) {
    return InvalidArgument("resumed_from must be non-negative, got " + std::to_string(req.resumed_from()));
  }
  r.resumed_from = req.resumed_from();
  if (!req.run_id().empty()) RETURN_IF_ERROR(ValidateRunId(req.run_id()));
  r.run_id = req.run_id();
  r.overwrite = req.overwrite();
  r.fatal_persist_errors = req.fatal_persist_errors();
  r.memory_checkpoints = req.memory_checkpoints();
  return r;
}

}  // namespace flashckpt

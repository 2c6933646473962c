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

}  // namespace flashckpt

// How a trainer rank describes the tensors it checkpoints.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace flashckpt {

// Element types, named as safetensors names them (F32, BF16, ...).
enum class DType : uint8_t { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// model -> model_state file; optimizer and master_weight -> optimizer file. kEma names the
// daemon's own EMA tensors (ema file); trainers never register it.
enum class TensorKind : uint8_t { kModel, kOptimizer, kMasterWeight, kEma };

// [begin, end) in the row-major flattening of a box: how a distributed optimizer shards a state.
struct FlatRange {
  uint64_t begin = 0;
  uint64_t end = 0;
};

// One tensor of a rank. Its bytes are the box `box_offset` + `box_shape` of the global tensor
// `global_shape`, or, with `flat_range`, that range of the box's flattening (then `shape` is the
// local shape of the range, usually 1-D). Leave `box_shape` empty when it equals `shape`, and
// `global_shape`/`box_offset` empty for an unsharded tensor.
struct TensorSpec {
  std::string name;
  TensorKind kind = TensorKind::kModel;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> global_shape;
  std::vector<uint64_t> box_offset;
  std::vector<uint64_t> box_shape;
  std::optional<FlatRange> flat_range;
  // Held by this rank but written by another (model weights of shard ranks > 0): never persisted
  // from this rank, restored into it.
  bool replica = false;
  // For a master_weight: the model parameter it is the fp32 master copy of (the EMA tensor is
  // named after it). Empty: the master weight's own name.
  std::string param;
};

// The rank's coordinates in the job's parallel layout. rank = tp + tp_degree*(pp + pp_degree*shard)
// is the usual mapping but not required; world_size = tp_degree * pp_degree * shard_degree is.
struct Topology {
  uint32_t world_size = 1;
  uint32_t tp_rank = 0, tp_degree = 1;
  uint32_t pp_rank = 0, pp_degree = 1;
  uint32_t shard_rank = 0, shard_degree = 1;
};

}  // namespace flashckpt

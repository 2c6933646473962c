#include "common/dtype.h"

#include <array>

namespace flashckpt {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DTypeInfo, 10> kDTypes = {{
    {DType::kF64, "F64", 8},
    {DType::kF32, "F32", 4},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kI64, "I64", 8},
    {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},
    {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
}};

}  // namespace

std::string_view DTypeName(DType dtype) { return kDTypes[static_cast<size_t>(dtype)].name; }

size_t DTypeSize(DType dtype) { return kDTypes[static_cast<size_t>(dtype)].size; }

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

}  // namespace flashckpt

namespace flashckpt {

std::string_view TensorKindName(TensorKind kind) {
  switch (kind) {
    case TensorKind::kModel: return "model";
    case TensorKind::kOptimizer: return "optimizer";
    case TensorKind::kMasterWeight: return "master_weight";
    case TensorKind::kEma: return "ema";
  }
  return "unknown";
}

std::optional<TensorKind> ParseTensorKind(std::string_view name) {
  if (name == "model") return TensorKind::kModel;
  if (name == "optimizer") return TensorKind::kOptimizer;
  if (name == "master_weight") return TensorKind::kMasterWeight;
  if (name == "ema") return TensorKind::kEma;
  return std::nullopt;
}

}  // namespace flashckpt

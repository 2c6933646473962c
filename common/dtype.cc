#include "common/dtype.h"

#include <array>
#include <cstring>

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

bool CanNarrowF32(DType to) { return to == DType::kBF16 || to == DType::kF16; }

void NarrowF32(const float* in, uint64_t n, DType to, void* out) {
  auto* o = static_cast<uint16_t*>(out);
  if (to == DType::kF16) {
    for (uint64_t i = 0; i < n; ++i) {
      const _Float16 h = static_cast<_Float16>(in[i]);  // IEEE conversion: round to nearest even
      std::memcpy(&o[i], &h, sizeof h);
    }
    return;
  }
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &in[i], sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
      o[i] = static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN: keep it a (quiet) NaN
    } else {
      // bf16 is the top half of an fp32: add half an ulp of the top half (less one when its last
      // bit is even) and truncate. Overflow rounds to the infinity bit pattern.
      bits += 0x7fffu + ((bits >> 16) & 1u);
      o[i] = static_cast<uint16_t>(bits >> 16);
    }
  }
}

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

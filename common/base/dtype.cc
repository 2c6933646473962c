#include "common/base/dtype.h"

#include <array>
#include <cstring>

namespace flashckpt {
namespace {

// An IEEE half (its bits) as fp32, exactly.
float F16BitsToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // +-0
  } else {        // subnormal: normalise
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

void WidenToF32(const char* in, DType from, uint64_t n, float* out) {
  for (uint64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, 2);
    if (from == DType::kBF16) {
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      std::memcpy(&out[i], &bits, sizeof(float));
    } else {
      out[i] = F16BitsToF32(h);
    }
  }
}

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

// fp32 -> IEEE binary16, rounded to nearest even as a hardware conversion does (F. Giesen's
// float_to_half_fast3_rtne). Written out rather than through _Float16, which clang before 15 does not
// support on x86-64. NaN stays a quiet NaN with the top of its payload.
uint16_t F32ToF16Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x1ffu));
  if (abs >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // 2^16 and above, and infinity
  if (abs < 0x38800000u) {
    // Below 2^-14 the half is subnormal (or zero): adding 0.5f puts its 10 mantissa bits at the
    // bottom of the float, rounded to nearest even by the addition itself.
    float f;
    std::memcpy(&f, &abs, sizeof f);
    f += 0.5f;
    uint32_t rounded;
    std::memcpy(&rounded, &f, sizeof rounded);
    return static_cast<uint16_t>(sign | (rounded - 0x3f000000u));
  }
  // Normal: rebias the exponent and round the 13 dropped bits to nearest even; a carry out of the
  // mantissa bumps the exponent, up to infinity for [65520, 65536).
  abs += 0xc8000fffu + ((abs >> 13) & 1u);  // (15 - 127) << 23, plus half an ulp less one
  return static_cast<uint16_t>(sign | (abs >> 13));
}

}  // namespace

std::string_view DTypeName(DType dtype) { return kDTypes[static_cast<size_t>(dtype)].name; }

size_t DTypeSize(DType dtype) { return kDTypes[static_cast<size_t>(dtype)].size; }

bool CanNarrowF32(DType to) { return to == DType::kBF16 || to == DType::kF16; }

void NarrowF32(const float* in, uint64_t n, DType to, void* out) {
  auto* o = static_cast<uint16_t*>(out);
  if (to == DType::kF16) {
    for (uint64_t i = 0; i < n; ++i) o[i] = F32ToF16Bits(in[i]);
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

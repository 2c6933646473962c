// Names and sizes of the element types declared in flashckpt/tensor.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "flashckpt/tensor.h"

namespace flashckpt {

// "F32", "BF16", ...
std::string_view DTypeName(DType dtype);
// nullopt for a name safetensors does not define or flashckpt does not support.
std::optional<DType> ParseDType(std::string_view name);
size_t DTypeSize(DType dtype);

// Whether fp32 values can be narrowed to `to` by NarrowF32: bf16 and fp16.
bool CanNarrowF32(DType to);
// Rounds n fp32 values to `to` (bf16 or fp16): round to nearest, ties to even; NaN stays NaN,
// values beyond the target's range become infinities. `out` holds n 2-byte elements.
void NarrowF32(const float* in, uint64_t n, DType to, void* out);
// `n` values of bf16 or fp16 to fp32 (exact).
void WidenToF32(const char* in, DType from, uint64_t n, float* out);

std::string_view TensorKindName(TensorKind kind);  // "model", "optimizer", "master_weight"
std::optional<TensorKind> ParseTensorKind(std::string_view name);

}  // namespace flashckpt

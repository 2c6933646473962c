// Names and sizes of the element types declared in flashckpt/tensor.h.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

#include "flashckpt/tensor.h"

namespace flashckpt {

// "F32", "BF16", ...
std::string_view DTypeName(DType dtype);
// nullopt for a name safetensors does not define or flashckpt does not support.
std::optional<DType> ParseDType(std::string_view name);
size_t DTypeSize(DType dtype);

std::string_view TensorKindName(TensorKind kind);  // "model", "optimizer", "master_weight"
std::optional<TensorKind> ParseTensorKind(std::string_view name);

}  // namespace flashckpt

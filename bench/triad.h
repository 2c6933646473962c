// A memory-bound kernel for cuda_copy_bench (bench/triad.cu): the trainer's compute that a snapshot's
// device-to-host copies run beside.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace flashckpt::bench {

// a[i] = b[i] + s * c[i] for i < n, on `stream` (a grid-stride loop over the whole device).
cudaError_t Triad(float* a, const float* b, const float* c, float s, size_t n, cudaStream_t stream);

}  // namespace flashckpt::bench

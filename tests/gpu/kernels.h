// Small kernels the GPU tests run on the caller's compute stream (tests/gpu/kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace flashckpt::testing {

// The 32-bit word `i` of the pattern `seed`: what FillPattern writes, computed on the host.
inline uint32_t PatternWord(uint64_t i, uint32_t seed) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t{seed} << 32 | seed);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<uint32_t>(x);
}

// Writes PatternWord(i, seed) to words[i] for i < n, after spinning for `spin_cycles` GPU clock
// cycles (0: none), so that the write is still pending when the host moves on.
cudaError_t FillPattern(uint32_t* words, size_t n, uint32_t seed, long long spin_cycles, cudaStream_t stream);

// Spins for `spin_cycles` GPU clock cycles: work that keeps the compute stream busy.
cudaError_t Spin(long long spin_cycles, cudaStream_t stream);

// GPU clock cycles in `ms` milliseconds on the current device.
long long CyclesPerMs();

}  // namespace flashckpt::testing

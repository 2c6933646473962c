#include "kernels.h"

namespace flashckpt::testing {
namespace {

__device__ void SpinFor(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void FillPatternKernel(uint32_t* words, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t{seed} << 32 | seed);
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    words[i] = static_cast<uint32_t>(x);
  }
}

__global__ void SpinKernel(long long cycles) { SpinFor(cycles); }

}  // namespace

cudaError_t FillPattern(uint32_t* words, size_t n, uint32_t seed, long long spin_cycles, cudaStream_t stream) {
  if (spin_cycles > 0) {
    SpinKernel<<<1, 1, 0, stream>>>(spin_cycles);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  FillPatternKernel<<<256, 256, 0, stream>>>(words, n, seed);
  return cudaGetLastError();
}

cudaError_t Spin(long long spin_cycles, cudaStream_t stream) {
  SpinKernel<<<1, 1, 0, stream>>>(spin_cycles);
  return cudaGetLastError();
}

long long CyclesPerMs() {
  int device = 0, khz = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1000000;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device) != cudaSuccess || khz <= 0) return 2000000;
  return khz;  // kHz = cycles per millisecond
}

}  // namespace flashckpt::testing

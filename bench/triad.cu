#include "triad.h"

namespace flashckpt::bench {
namespace {

__global__ void TriadKernel(float* a, const float* b, const float* c, float s, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    a[i] = b[i] + s * c[i];
  }
}

}  // namespace

cudaError_t Triad(float* a, const float* b, const float* c, float s, size_t n, cudaStream_t stream) {
  int device = 0, sms = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); err != cudaSuccess) {
    return err;
  }
  TriadKernel<<<sms * 8, 256, 0, stream>>>(a, b, c, s, n);
  return cudaGetLastError();
}

}  // namespace flashckpt::bench

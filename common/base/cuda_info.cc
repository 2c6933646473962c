#include "common/base/cuda_info.h"

#if FLASHCKPT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace flashckpt {
namespace {

CudaInfo Query() {
  CudaInfo info;
  info.compiled = CudaCompiledIn();
#if FLASHCKPT_HAVE_CUDA
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    info.error = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    (void)cudaGetLastError();  // not sticky: clear it so later calls do not report it again
  } else {
    info.devices = count;
    if (count == 0) info.error = "cudaGetDeviceCount: 0 devices";
  }
#endif
  return info;
}

}  // namespace

bool CudaCompiledIn() { return FLASHCKPT_HAVE_CUDA != 0; }

const CudaInfo& GetCudaInfo() {
  static const CudaInfo info = Query();
  return info;
}

std::string CudaInfoText(const CudaInfo& info) {
  if (!info.compiled) return "CUDA not compiled in";
  if (info.devices > 0) {
    return "CUDA compiled in, " + std::to_string(info.devices) + (info.devices == 1 ? " device" : " devices");
  }
  return "CUDA compiled in, no CUDA device or driver (" + info.error + ")";
}

}  // namespace flashckpt

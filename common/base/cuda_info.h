// Whether this build has the CUDA path and whether the process can use a device: for --version,
// status, and the client's choice between the host and the device copy path. Compiled in every
// build; without CUDA it reports "not compiled in".
#pragma once

#include <string>

namespace flashckpt {

struct CudaInfo {
  bool compiled = false;  // built with FLASHCKPT_WITH_CUDA
  int devices = 0;        // devices cudaGetDeviceCount reports; 0 when it fails
  std::string error;      // why there is no device: cudaGetDeviceCount's error, or empty
};

// Whether this build has the CUDA path (FLASHCKPT_WITH_CUDA): the compile-time fact behind
// CudaInfo::compiled, without asking the runtime (no driver is initialised).
bool CudaCompiledIn();

// Asks the CUDA runtime once per process (the first call initialises the driver) and returns the
// cached answer afterwards. Thread-safe.
const CudaInfo& GetCudaInfo();

// "CUDA compiled in, 2 devices", "CUDA compiled in, no CUDA device or driver (cudaGetDeviceCount:
// <the runtime's own error text>)" or "CUDA not compiled in". Without a GPU the runtime answers
// "CUDA driver version is insufficient for CUDA runtime version" (no driver library at all) or "no
// CUDA-capable device is detected"; the words before the parentheses say what that means on a
// machine without a GPU, and the runtime's text stays for the case where an old driver is the cause.
std::string CudaInfoText(const CudaInfo& info);

}  // namespace flashckpt

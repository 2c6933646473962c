// What this build of libflashckpt is: its version and whether it has the CUDA copy path. For
// programs and bindings that link the installed library (the Python extension reports both).
#pragma once

#include <string>

#include "flashckpt/export.h"

namespace flashckpt {

// The library's version, "MAJOR.MINOR.PATCH" (the CMake project version it was built from).
FLASHCKPT_API std::string LibraryVersion();

// Whether the library was built with the CUDA copy path (FLASHCKPT_CUDA): the compile-time fact,
// asking no driver.
FLASHCKPT_API bool LibraryHasCuda();

// One line on CUDA in this process: "CUDA compiled in, 2 devices", "CUDA compiled in, no CUDA
// device or driver (cudaGetDeviceCount: ...)" or "CUDA not compiled in". The first call asks the
// CUDA runtime (initialising the driver); later calls return the same answer.
FLASHCKPT_API std::string LibraryCudaInfo();

}  // namespace flashckpt

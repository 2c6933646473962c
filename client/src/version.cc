#include "flashckpt/version.h"

#include "common/base/cuda_info.h"
#include "common/base/version.h"

namespace flashckpt {

std::string LibraryVersion() { return kVersion; }

bool LibraryHasCuda() { return CudaCompiledIn(); }

std::string LibraryCudaInfo() { return CudaInfoText(GetCudaInfo()); }

}  // namespace flashckpt

#include "common/base/cuda_info.h"

#include <string>
#include <utility>

#include "testing.h"

namespace flashckpt {
namespace {

CudaInfo CompiledIn(int devices, std::string error) {
  CudaInfo info;
  info.compiled = true;
  info.devices = devices;
  info.error = std::move(error);
  return info;
}

TEST(CudaInfoText, SaysNoDeviceOrDriverAndKeepsTheRuntimesText) {
  // What cudaGetDeviceCount says on a machine without a GPU (no libcuda at all).
  const std::string runtime = "cudaGetDeviceCount: CUDA driver version is insufficient for CUDA runtime version";
  const std::string text = CudaInfoText(CompiledIn(0, runtime));
  EXPECT_EQ(text, "CUDA compiled in, no CUDA device or driver (" + runtime + ")");
  const std::string before_parenthesis = text.substr(0, text.find('('));
  EXPECT_EQ(before_parenthesis.find("insufficient"), std::string::npos)
      << "the summary must not read as a driver that is too old: " << text;

  EXPECT_EQ(CudaInfoText(CompiledIn(0, "cudaGetDeviceCount: no CUDA-capable device is detected")),
            "CUDA compiled in, no CUDA device or driver (cudaGetDeviceCount: no CUDA-capable device is detected)");
}

TEST(CudaInfoText, CountsDevicesAndSaysWhenCudaIsNotCompiledIn) {
  EXPECT_EQ(CudaInfoText(CompiledIn(1, "")), "CUDA compiled in, 1 device");
  EXPECT_EQ(CudaInfoText(CompiledIn(8, "")), "CUDA compiled in, 8 devices");
  EXPECT_EQ(CudaInfoText(CudaInfo{}), "CUDA not compiled in");
}

TEST(CudaCompiledIn, IsWhatTheRuntimeQueryReports) { EXPECT_EQ(CudaCompiledIn(), GetCudaInfo().compiled); }

}  // namespace
}  // namespace flashckpt

#include "common/base/cuda.h"

#include <string>
#include <utility>

namespace flashckpt {

Status CudaStatus(cudaError_t err, const char* call, const char* file, int line) {
  // Reading the error clears it unless it is sticky (the context is then unusable anyway).
  (void)cudaGetLastError();
  return Internal(std::string(call) + " failed: " + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ") at " +
                  file + ":" + std::to_string(line));
}

Result<CudaStream> CudaStream::Create() {
  cudaStream_t s = nullptr;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return CudaStream(s);
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

Result<CudaEvent> CudaEvent::Create(bool blocking_sync) {
  cudaEvent_t e = nullptr;
  unsigned flags = cudaEventDisableTiming | (blocking_sync ? cudaEventBlockingSync : 0u);
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, flags));
  return CudaEvent(e);
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

Status CudaEvent::Record(cudaStream_t stream) const {
  CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, stream));
  return Status::OK();
}

Status CudaEvent::Synchronize() const {
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
  return Status::OK();
}

Result<bool> CudaEvent::Done() const {
  cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) return false;
  CUDA_RETURN_IF_ERROR(err);
  return true;
}

Result<HostRegistration> HostRegistration::Create(void* ptr, uint64_t bytes) {
  CUDA_RETURN_IF_ERROR(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable));
  return HostRegistration(ptr);
}

HostRegistration::~HostRegistration() {
  if (ptr_ != nullptr) (void)cudaHostUnregister(ptr_);
}

HostRegistration& HostRegistration::operator=(HostRegistration&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) (void)cudaHostUnregister(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
  }
  return *this;
}

Result<MemorySpace> PointerSpace(const void* ptr) {
  cudaPointerAttributes attr{};
  CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, ptr));
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged ? MemorySpace::kDevice
                                                                                 : MemorySpace::kHost;
}

}  // namespace flashckpt

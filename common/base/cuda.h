// CUDA runtime calls the flashckpt way: one checking macro and RAII owners for streams, events and
// host registrations. Compiled only in CUDA builds (FLASHCKPT_HAVE_CUDA); include it from code
// that is compiled only there, or under #if FLASHCKPT_HAVE_CUDA.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/base/status.h"

namespace flashckpt {

// A failed CUDA call as a Status (kInternal): "cudaMemcpyAsync(dst, src, n, kind, stream) failed:
// invalid argument (cudaErrorInvalidValue) at client/src/cuda_copy.cc:42". Clears the error when
// it is not sticky, so that a later call does not report it again.
Status CudaStatus(cudaError_t err, const char* call, const char* file, int line);

// Creates a non-blocking stream (no implicit synchronisation with the legacy default stream) on the
// current device. Move-only; destroys the stream (after its work completes) on destruction.
class CudaStream {
 public:
  static Result<CudaStream> Create();
  CudaStream() = default;
  ~CudaStream();
  CudaStream(CudaStream&& other) noexcept : stream_(other.stream_) { other.stream_ = nullptr; }
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }

 private:
  explicit CudaStream(cudaStream_t s) : stream_(s) {}
  cudaStream_t stream_ = nullptr;
};

// An event without timing. With `blocking_sync`, Synchronize() sleeps instead of spinning (the
// commit thread waits on it while the trainer computes). Move-only.
class CudaEvent {
 public:
  static Result<CudaEvent> Create(bool blocking_sync = false);
  CudaEvent() = default;
  ~CudaEvent();
  CudaEvent(CudaEvent&& other) noexcept : event_(other.event_) { other.event_ = nullptr; }
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }
  // Records the work queued on `stream` so far.
  Status Record(cudaStream_t stream) const;
  // Blocks until the recorded work is complete; returns the error of that work, if any.
  Status Synchronize() const;
  // True when the recorded work is complete; an error of that work is returned as the Status.
  Result<bool> Done() const;

 private:
  explicit CudaEvent(cudaEvent_t e) : event_(e) {}
  cudaEvent_t event_ = nullptr;
};

// Page-locks host memory for DMA (cudaHostRegister with cudaHostRegisterPortable, so every device
// context can use it) and unregisters it on destruction. The memory must stay mapped for the life
// of the registration. Move-only.
class HostRegistration {
 public:
  static Result<HostRegistration> Create(void* ptr, uint64_t bytes);
  HostRegistration() = default;
  ~HostRegistration();
  HostRegistration(HostRegistration&& other) noexcept : ptr_(other.ptr_) { other.ptr_ = nullptr; }
  HostRegistration& operator=(HostRegistration&& other) noexcept;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

 private:
  explicit HostRegistration(void* p) : ptr_(p) {}
  void* ptr_ = nullptr;
};

// Where a pointer lives, as cudaPointerGetAttributes tells: kHost for plain or pinned host memory,
// kDevice for device and managed memory (copied with cudaMemcpyAsync).
enum class MemorySpace { kHost, kDevice };
Result<MemorySpace> PointerSpace(const void* ptr);

}  // namespace flashckpt

// Returns a Status naming the call, the CUDA error and file:line when `call` does not return cudaSuccess.
#define CUDA_RETURN_IF_ERROR(call)                                                                            \
  do {                                                                                                        \
    const cudaError_t _fc_cuda_err = (call);                                                                  \
    if (_fc_cuda_err != cudaSuccess) return ::flashckpt::CudaStatus(_fc_cuda_err, #call, __FILE__, __LINE__); \
  } while (0)

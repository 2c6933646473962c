// The client's device copies (CUDA builds only): one non-blocking copy stream per Client on the
// caller's current device, the slots of the mapped segment pinned with cudaHostRegister, and copies
// ordered after the caller's compute stream through an event recorded on it.
//
//   caller stream:  ... forward/backward ... [record ready] ... optimizer (after WaitCopied) ...
//   copy stream:    [wait ready] [memcpy D2H tensor 0] [memcpy D2H tensor 1] ... [record done]
//   commit thread:                                                              [sync done] -> Commit
//
// A snapshot splits the two halves: OrderAfter() on the caller's thread records the ready event
// (microseconds), and Queue() on the client's commit thread pins the slots and queues the copies
// (milliseconds for many chunks; seconds for the first pin), so the trainer does not wait for them.
//
// Not thread-safe: one thread at a time (the owning Client's calls, or its commit thread while the
// Client's next call waits for it).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "common/base/cuda.h"
#include "common/base/status.h"

namespace flashckpt {

struct DeviceCopy {
  void* dst;
  const void* src;
  uint64_t bytes;
};

class DeviceCopier {
 public:
  // Pins each of `count` slots of `stride` bytes from `first` (once: later calls with the same
  // mapping do nothing). The pins are dropped by Unpin(), which must run before the memory is
  // unmapped, and by the destructor.
  Status PinSlots(char* first, uint64_t stride, uint32_t count);
  void Unpin();
  bool pinned() const { return !pinned_.empty(); }

  // Queues `copies` (either direction; cudaMemcpyDefault), in order, on the copy stream of the
  // current device, after the work queued on `caller` so far. Returns the events recorded after
  // them: one after each copy with `event_each`, else one after the last. Their Synchronize()
  // sleeps rather than spins.
  Result<std::vector<CudaEvent>> CopyAfter(cudaStream_t caller, const std::vector<DeviceCopy>& copies,
                                           bool event_each = false);

  // CopyAfter in two halves. OrderAfter marks the point of `caller`'s work (on the current device)
  // that the copies of the next Queue() wait for; Queue, on any thread, queues them on that device.
  // Each OrderAfter is followed by one Queue before the next OrderAfter.
  Status OrderAfter(cudaStream_t caller);
  Result<std::vector<CudaEvent>> Queue(const std::vector<DeviceCopy>& copies, bool event_each);

 private:
  // The stream and the ready event belong to one device: made again when the current one changes.
  Status UseCurrentDevice();

  int device_ = -1;
  CudaStream stream_;
  CudaEvent caller_ready_;
  char* pinned_first_ = nullptr;
  std::vector<HostRegistration> pinned_;
};

}  // namespace flashckpt

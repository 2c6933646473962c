#include "client/src/cuda_copy.h"

#include <string>

namespace flashckpt {

Status DeviceCopier::PinSlots(char* first, uint64_t stride, uint32_t count) {
  if (!pinned_.empty() && pinned_first_ == first) return Status::OK();
  Unpin();
  pinned_.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    auto pin = HostRegistration::Create(first + stride * i, stride);
    if (!pin.ok()) {
      Unpin();
      return pin.status().WithContext("pinning slot " + std::to_string(i) + " of the shared-memory segment (" +
                                      std::to_string(stride) + " bytes) for device copies");
    }
    pinned_.push_back(std::move(pin).value());
  }
  pinned_first_ = first;
  return Status::OK();
}

void DeviceCopier::Unpin() {
  pinned_.clear();
  pinned_first_ = nullptr;
}

Status DeviceCopier::UseCurrentDevice() {
  int device = -1;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (device == device_ && stream_.get() != nullptr) return Status::OK();
  ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  ASSIGN_OR_RETURN(CudaEvent ready, CudaEvent::Create());
  stream_ = std::move(stream);
  caller_ready_ = std::move(ready);
  device_ = device;
  return Status::OK();
}

Result<std::vector<CudaEvent>> DeviceCopier::CopyAfter(cudaStream_t caller, const std::vector<DeviceCopy>& copies,
                                                       bool event_each) {
  RETURN_IF_ERROR(OrderAfter(caller));
  return Queue(copies, event_each);
}

Status DeviceCopier::OrderAfter(cudaStream_t caller) {
  RETURN_IF_ERROR(UseCurrentDevice());
  // The copies see the tensors as the caller's stream leaves them at this point, not later work.
  return caller_ready_.Record(caller);
}

Result<std::vector<CudaEvent>> DeviceCopier::Queue(const std::vector<DeviceCopy>& copies, bool event_each) {
  if (stream_.get() == nullptr) return Internal("device copies queued before OrderAfter");
  // This thread may have another current device (or none yet): the stream's is the one used.
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  // Reusing the ready event is safe: cudaStreamWaitEvent takes the recording of the moment, and
  // the next OrderAfter comes after this call.
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_.get(), caller_ready_.get(), 0));
  std::vector<CudaEvent> events;
  for (size_t i = 0; i < copies.size(); ++i) {
    const DeviceCopy& c = copies[i];
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream_.get()));
    if (event_each || i + 1 == copies.size()) {
      ASSIGN_OR_RETURN(CudaEvent done, CudaEvent::Create(/*blocking_sync=*/true));
      RETURN_IF_ERROR(done.Record(stream_.get()));
      events.push_back(std::move(done));
    }
  }
  return events;
}

}  // namespace flashckpt

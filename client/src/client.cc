// The trainer client's data path (client.h): Snapshot() into a slot and its commit (streaming
// from a client thread for device tensors), WaitPersisted(), Restore() and Ema() out of a slot the
// daemon lends, and StatusJson(). The session and re-attach are session.cc.
#include "flashckpt/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <thread>

#include "client/src/client_impl.h"
#include "client/src/host_copy.h"
#include "client/src/wire.h"
#include "proto/convert.h"
#include "common/base/cuda_info.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace flashckpt {
namespace {

double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

#if FLASHCKPT_HAVE_CUDA
// Device tensors are copied in pieces of this size, each with its own event: the daemon may write
// a piece while the next ones are still in flight.
constexpr uint64_t kDeviceCopyChunk = 64u << 20;
#endif

// Which buffers are CUDA device memory (true) and which host memory, in the order of `buffers`.
// Device memory this process cannot copy is refused here, before a slot is taken: in a build
// without CUDA only a buffer marked on_device can be recognised; without a usable device a device
// pointer cannot exist unless the caller marked it so.
Result<std::vector<bool>> DeviceMask(const std::vector<const TensorBuffer*>& buffers) {
  std::vector<bool> device(buffers.size(), false);
  const CudaInfo& cuda = GetCudaInfo();
  for (size_t i = 0; i < buffers.size(); ++i) {
    const TensorBuffer& b = *buffers[i];
    if (!cuda.compiled || cuda.devices == 0) {
      if (!b.on_device) continue;
      if (!cuda.compiled) {
        return FailedPrecondition("tensor '" + b.name +
                                  "' is marked as CUDA device memory but this libflashckpt was built without CUDA "
                                  "(FLASHCKPT_WITH_CUDA=OFF); rebuild it with CUDA or pass host memory");
      }
      return FailedPrecondition("tensor '" + b.name +
                                "' is marked as CUDA device memory but this process has no usable CUDA device (" +
                                cuda.error + "); pass host memory or run where a device is visible");
    }
#if FLASHCKPT_HAVE_CUDA
    if (b.data == nullptr) continue;
    auto space = PointerSpace(b.data);
    if (!space.ok()) return space.status().WithContext("telling where tensor '" + b.name + "' lives");
    device[i] = *space == MemorySpace::kDevice;
    if (b.on_device && !device[i]) {
      return InvalidArgument("tensor '" + b.name +
                             "' is marked as CUDA device memory but cudaPointerGetAttributes says it is host memory");
    }
#endif
  }
  return device;
}

std::vector<const TensorBuffer*> BuffersOf(const Matched& matched) {
  std::vector<const TensorBuffer*> out;
  out.reserve(matched.size());
  for (const auto& m : matched) out.push_back(m.first);
  return out;
}

}  // namespace

namespace detail {

void SnapshotProgress::SetCopied(const Status& s) {
  MutexLock lock(&mu_);
  copied_ = true;
  copy_status_ = s;
  cv_.NotifyAll();
}

void SnapshotProgress::SetCommitted(const Status& s) {
  MutexLock lock(&mu_);
  committed_ = true;
  commit_status_ = s;
  cv_.NotifyAll();
}

Status SnapshotProgress::WaitCopied() {
  MutexLock lock(&mu_);
  while (!copied_) cv_.Wait(&lock);
  return copy_status_;
}

Status SnapshotProgress::WaitCommitted() {
  MutexLock lock(&mu_);
  while (!committed_) cv_.Wait(&lock);
  return commit_status_;
}

}  // namespace detail

Status SnapshotHandle::WaitCopied() const {
  if (!progress_) return Status::OK();
  return progress_->WaitCopied();
}

Status SnapshotHandle::WaitCommitted() const {
  if (!progress_) return Status::OK();
  return progress_->WaitCommitted();
}

Status Client::Impl::ReleaseSlot(const SlotLoan& slot, const std::string& corrupt) const {
  v1::ReleaseSlotResponse resp;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  return FromGrpc(stub->ReleaseSlot(&ctx, ReleaseSlotRequestOf(session_id, slot, corrupt), &resp), "ReleaseSlot");
}

Status Client::Impl::SendCommit(const SlotCommit& commit) const {
  v1::CommitResponse committed;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  // Not retried: the slot belongs to the session that began the snapshot.
  Status status = FromGrpc(stub->Commit(&ctx, CommitRequestOf(commit), &committed), "Commit");
  if (!status.ok()) AbortSlot(commit.session_id, commit.slot);
  return status;
}

void Client::Impl::AbortSlot(const std::string& session_of_slot, const SlotLoan& slot) const {
  v1::AbortSnapshotResponse aborted;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  (void)stub->AbortSnapshot(&ctx, AbortSnapshotRequestOf(session_of_slot, slot), &aborted);
}

Status Client::Impl::CopyOut(const std::vector<CopyTask>& tasks, const std::vector<bool>& on_device,
                             void* cuda_stream) {
  std::vector<CopyTask> host;
#if FLASHCKPT_HAVE_CUDA
  std::vector<DeviceCopy> to_device;
#endif
  for (size_t i = 0; i < tasks.size(); ++i) {
#if FLASHCKPT_HAVE_CUDA
    if (on_device[i]) {
      to_device.push_back({tasks[i].dst, tasks[i].src, tasks[i].bytes});
      continue;
    }
#endif
    host.push_back(tasks[i]);
  }
  ParallelCopy(copier.get(), host);
#if FLASHCKPT_HAVE_CUDA
  if (to_device.empty()) return Status::OK();
  RETURN_IF_ERROR(device.PinSlots(Slot(0), slot_stride, slot_count));
  auto stream = static_cast<cudaStream_t>(cuda_stream);
  ASSIGN_OR_RETURN(std::vector<CudaEvent> done, device.CopyAfter(stream, to_device));
  // Work the caller queues next sees the restored bytes; the slot is released only once they are
  // copied.
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, done.back().get(), 0));
  RETURN_IF_ERROR(done.back().Synchronize());
#endif
  return Status::OK();
}

Status Client::Impl::CopyOutVerified(const Matched& matched, const char* base, const RestoreHandover& restored) {
  // The daemon's checksums per tensor, by where the tensor lies in the slot.
  // (Keyed by both: an empty tensor lies at the offset of the tensor after it.)
  std::map<std::pair<uint64_t, uint64_t>, const TensorChunkSums*> by_offset;
  for (const TensorChunkSums& t : restored.chunk_sums) by_offset[{t.slot_offset, t.bytes}] = &t;
  std::vector<VerifiedCopyTask> tasks;
  tasks.reserve(matched.size());
  for (const auto& [buffer, mapped] : matched) {
    auto it = by_offset.find({mapped->slot_offset, buffer->bytes});
    if (it == by_offset.end()) {
      return Internal("the daemon handed over a memory checkpoint without checksums for tensor '" + buffer->name + "'");
    }
    tasks.push_back({{buffer->data, base + mapped->slot_offset, buffer->bytes},
                     it->second->sums.data(),
                     it->second->sums.size(),
                     buffer->name});
  }
  return ParallelVerifiedCopy(copier.get(), tasks, restored.chunk_bytes);
}

Status Client::Impl::CopyRestored(const Matched& matched, const RestoreHandover& restored,
                                  const RestoreOptions& restore, uint64_t* bytes) {
  auto wanted = [&](const MappedTensor& t) {
    const auto& kinds = restore.kinds;
    return kinds.empty() || std::find(kinds.begin(), kinds.end(), t.kind) != kinds.end();
  };
  auto on_device = DeviceMask(BuffersOf(matched));
  const char* base = Slot(restored.slot.slot);
  std::vector<CopyTask> tasks;
  std::vector<bool> task_on_device;  // one flag per task, as CopyOut reads them
  for (size_t i = 0; i < matched.size(); ++i) {
    const auto& [buffer, mapped] = matched[i];
    if (!wanted(*mapped)) continue;  // not read by the daemon: left as it is
    tasks.push_back({buffer->data, base + mapped->slot_offset, buffer->bytes});
    task_on_device.push_back(on_device.ok() && (*on_device)[i]);
    *bytes += buffer->bytes;
  }
  return !on_device.ok()             ? on_device.status()
         : restored.verify_in_client ? CopyOutVerified(matched, base, restored)
                                     : CopyOut(tasks, task_on_device, restore.cuda_stream);
}

Result<Matched> Client::Impl::Match(const std::vector<TensorBuffer>& buffers, Selection selection) const {
  auto wanted = [selection](const MappedTensor& t) {
    switch (selection) {
      case Selection::kSaved: return !t.replica;
      case Selection::kEmaSources: return t.ema_source;
      case Selection::kAll: return true;
    }
    return true;
  };
  if (!segment) return FailedPrecondition("register the rank's tensors before saving or restoring");
  Matched out;
  std::map<std::string, bool> seen;
  for (const auto& b : buffers) {
    auto it = tensors.find(b.name);
    if (it == tensors.end()) return InvalidArgument("tensor '" + b.name + "' was not registered");
    if (!seen.emplace(b.name, true).second) return InvalidArgument("tensor '" + b.name + "' is given twice");
    if (b.bytes != it->second.bytes) {
      return InvalidArgument("tensor '" + b.name + "' has " + std::to_string(b.bytes) + " bytes, registered with " +
                             std::to_string(it->second.bytes));
    }
    if (b.data == nullptr && b.bytes > 0) return InvalidArgument("tensor '" + b.name + "' has no data pointer");
    if (!wanted(it->second)) continue;  // e.g. replicas, which this rank does not save
    out.emplace_back(&b, &it->second);
  }
  for (const auto& [name, t] : tensors) {
    if (wanted(t) && !seen.count(name)) {
      return InvalidArgument("tensor '" + name + "' is registered but no buffer was given for it");
    }
  }
  return out;
}

std::vector<std::string> Client::EmaTensorNames() const {
  std::vector<std::string> names;
  for (const auto& [name, t] : impl_->ema_tensors) names.push_back(name);
  return names;
}

Result<EmaResult> Client::Ema(const std::vector<TensorBuffer>& buffers, std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(impl_->Usable());
  if (!impl_->segment) return FailedPrecondition("register the rank's tensors first");
  if (impl_->ema_tensors.empty()) return FailedPrecondition("this rank has no EMA tensors");
  std::vector<CopyTask> tasks;
  std::map<std::string, bool> seen;
  for (const auto& b : buffers) {
    auto it = impl_->ema_tensors.find(b.name);
    if (it == impl_->ema_tensors.end()) return InvalidArgument("'" + b.name + "' is not an EMA tensor of this rank");
    if (!seen.emplace(b.name, true).second) return InvalidArgument("EMA tensor '" + b.name + "' is given twice");
    // An empty tensor may have no address (torch gives it none): nothing is copied there.
    if (b.bytes != it->second.bytes || (b.data == nullptr && b.bytes > 0)) {
      return InvalidArgument("EMA tensor '" + b.name + "' needs a buffer of " + std::to_string(it->second.bytes) +
                             " bytes");
    }
  }
  if (seen.size() != impl_->ema_tensors.size()) return InvalidArgument("give a buffer for every EMA tensor");
  std::vector<const TensorBuffer*> pointers;
  for (const auto& b : buffers) pointers.push_back(&b);
  ASSIGN_OR_RETURN(std::vector<bool> on_device, DeviceMask(pointers));
  v1::GetEmaResponse resp;
  RETURN_IF_ERROR(impl_->WithSession([&] {
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx, timeout);
    return FromGrpc(impl_->stub->GetEma(&ctx, GetEmaRequestOf(impl_->session_id, timeout), &resp), "GetEma");
  }));
  const EmaHandover ema = EmaHandoverOf(resp);
  if (ema.slot.slot >= impl_->slot_count) return Internal("the daemon copied the EMA into a slot that does not exist");
  EmaResult result;
  result.initialized = ema.initialized;
  result.step = ema.step;
  const char* base = impl_->Slot(ema.slot.slot);
  Status copied;
  if (result.initialized) {
    std::vector<bool> task_on_device;
    for (size_t i = 0; i < buffers.size(); ++i) {
      const TensorBuffer& b = buffers[i];
      if (b.bytes == 0) continue;  // nothing to copy, and perhaps no address
      tasks.push_back({b.data, base + impl_->ema_tensors[b.name].slot_offset, b.bytes});
      task_on_device.push_back(on_device[i]);
    }
    copied = impl_->CopyOut(tasks, task_on_device, nullptr);
  }
  Status released = impl_->Note(impl_->ReleaseSlot(ema.slot));
  RETURN_IF_ERROR(copied.WithContext("copying the EMA into the caller's buffers"));
  RETURN_IF_ERROR(released);
  return result;
}

Result<SlotLoan> Client::Impl::BeginSlot(int64_t step, Tier tier) {
  v1::BeginSnapshotResponse begun;
  RETURN_IF_ERROR(WithSession([&] {
    grpc::ClientContext ctx;
    Deadline(&ctx, options.slot_timeout);
    const auto begin = BeginSnapshotRequestOf(session_id, step, options.slot_timeout, tier);
    return FromGrpc(stub->BeginSnapshot(&ctx, begin, &begun), "BeginSnapshot");
  }));
  const SlotLoan slot = SlotLoanOf(begun);
  if (slot.slot >= slot_count) return Internal("the daemon handed out a slot that does not exist");
  return slot;
}

Result<Client::Impl::SlotCopies> Client::Impl::CopiesInto(char* base, const std::vector<TensorBuffer>& buffers,
                                                          Selection selection) const {
  ASSIGN_OR_RETURN(const Matched matched, Match(buffers, selection));
  ASSIGN_OR_RETURN(const std::vector<bool> on_device, DeviceMask(BuffersOf(matched)));
  SlotCopies copies;
  copies.from_host.reserve(matched.size());
  for (size_t i = 0; i < matched.size(); ++i) {
    const auto& [buffer, mapped] = matched[i];
#if FLASHCKPT_HAVE_CUDA
    if (on_device[i]) {
      if (buffer->bytes > 0) copies.from_device.push_back({base + mapped->slot_offset, buffer->data, buffer->bytes});
      continue;
    }
#endif
    copies.from_host.push_back({base + mapped->slot_offset, buffer->data, buffer->bytes});
  }
  return copies;
}

#if FLASHCKPT_HAVE_CUDA
void Client::Impl::CopyAndCommit(detail::SnapshotProgress* progress, const SlotCommit& commit, char* base,
                                 std::vector<DeviceCopy> from_device) {
  // A streaming commit. The device-to-host copies are queued in slot order, in chunks, behind the
  // point of the caller's stream that OrderAfter marked; the commit goes once they are queued, and
  // the slot header's copied_until tells the daemon how far they have come, so that it hashes and
  // writes the first chunks while the next are in flight.
  std::sort(from_device.begin(), from_device.end(),
            [](const DeviceCopy& a, const DeviceCopy& b) { return a.dst < b.dst; });
  std::vector<DeviceCopy> chunks;
  for (const DeviceCopy& c : from_device) {
    for (uint64_t off = 0; off < c.bytes; off += kDeviceCopyChunk) {
      chunks.push_back({static_cast<char*>(c.dst) + off, static_cast<const char*>(c.src) + off,
                        std::min<uint64_t>(kDeviceCopyChunk, c.bytes - off)});
    }
  }
  std::vector<uint64_t> until(chunks.size(), 0);  // copied_until once chunk k is done; 0: all
  for (size_t k = 0; k + 1 < chunks.size(); ++k) until[k] = static_cast<char*>(chunks[k + 1].dst) - base;
  auto* header = reinterpret_cast<SlotHeader*>(base);
  // The host tensors are in place; the device ones from the first chunk on are not.
  header->copied_until.store(static_cast<uint64_t>(static_cast<char*>(chunks.front().dst) - base),
                             std::memory_order_release);
  const auto started = std::chrono::steady_clock::now();
  Status pinned = device.PinSlots(Slot(0), slot_stride, slot_count);
  const double pin_ms = MsSince(started);
  Result<std::vector<CudaEvent>> events =
      pinned.ok() ? device.Queue(chunks, /*event_each=*/true) : Result<std::vector<CudaEvent>>(pinned);
  Logger("client")->debug("device copies queued step={} chunks={} pin_ms={:.3f} queue_ms={:.3f}", commit.step,
                          chunks.size(), pin_ms, MsSince(started) - pin_ms);
  if (!events.ok()) {
    // Nothing was committed: the slot goes back, and both waits report why.
    AbortSlot(commit.session_id, commit.slot);
    const Status failed =
        events.status().WithContext("copying the device tensors of step " + std::to_string(commit.step));
    progress->SetCommitted(failed);
    progress->SetCopied(failed);
    return;
  }
  progress->SetCommitted(SendCommit(commit));
  // Every chunk is waited for, also after a failed commit: the slot must not be reused while the
  // device still writes into it.
  Status copied;
  for (size_t k = 0; k < events->size(); ++k) {
    copied = (*events)[k].Synchronize();
    if (!copied.ok()) {
      header->copied_until.store(kSlotCopyFailed, std::memory_order_release);
      copied = copied.WithContext("copying the device tensors of step " + std::to_string(commit.step));
      break;
    }
    header->copied_until.store(until[k], std::memory_order_release);
  }
  progress->SetCopied(copied);
}

Result<std::shared_ptr<detail::SnapshotProgress>> Client::Impl::CommitWhileCopying(SlotCommit commit, char* base,
                                                                                   std::vector<DeviceCopy> from_device,
                                                                                   void* cuda_stream) {
  if (Status ordered = device.OrderAfter(static_cast<cudaStream_t>(cuda_stream)); !ordered.ok()) {
    AbortSlot(commit.session_id, commit.slot);
    return ordered.WithContext("copying the device tensors of step " + std::to_string(commit.step));
  }
  auto progress = std::make_shared<detail::SnapshotProgress>();
  pending = progress;
  committer = std::thread([impl = this, progress, commit = std::move(commit), base,
                           from_device = std::move(from_device)]() mutable {
    impl->CopyAndCommit(progress.get(), commit, base, std::move(from_device));
  });
  return progress;
}

Result<std::shared_ptr<detail::SnapshotProgress>> Client::Impl::BeginWhileCopying(int64_t step,
                                                                                  std::vector<TensorBuffer> buffers,
                                                                                  Selection selection,
                                                                                  SnapshotOptions snapshot) {
  RETURN_IF_ERROR(device.OrderAfter(static_cast<cudaStream_t>(snapshot.cuda_stream))
                      .WithContext("copying the device tensors of step " + std::to_string(step)));
  auto progress = std::make_shared<detail::SnapshotProgress>();
  pending = progress;
  committer = std::thread([impl = this, progress, step, buffers = std::move(buffers), selection,
                           snapshot = std::move(snapshot)]() mutable {
    const auto started = std::chrono::steady_clock::now();
    const bool memory = snapshot.tier == Tier::kMemory;
    // A refusal leaves the tensors free (nothing is copied) and is the commit's answer.
    auto refused = [&](const Status& s) {
      progress->SetCopied(Status::OK());
      progress->SetCommitted(s);
    };
    Result<SlotLoan> slot = impl->BeginSlot(step, snapshot.tier);
    if (!slot.ok()) return refused(slot.status());
    char* base = impl->Slot(slot->slot);
    Result<SlotCopies> copies = impl->CopiesInto(base, buffers, selection);
    Status usable = copies.status();
    for (size_t i = 0; usable.ok() && i < copies->from_host.size(); ++i) {
      if (copies->from_host[i].bytes > 0) {
        usable = Internal("a tensor was device memory when the snapshot began and is not now");
      }
    }
    if (usable.ok() && copies->from_device.empty()) {
      usable = Internal("the snapshot has no device tensors left after a re-attach");
    }
    if (!usable.ok()) {
      impl->AbortSlot(impl->session_id, *slot);
      return refused(usable);
    }
    impl->PopulateInBackground();
    Logger("client")->debug("device snapshot begun on the commit thread step={} begin_ms={:.3f}", step,
                            MsSince(started));
    const SlotCommit commit{impl->session_id,     *slot, step, snapshot.persist && !memory, snapshot.loss,
                            std::move(snapshot.extra)};
    impl->CopyAndCommit(progress.get(), commit, base, std::move(copies->from_device));
  });
  return progress;
}
#endif

Result<SnapshotHandle> Client::Snapshot(int64_t step, const std::vector<TensorBuffer>& buffers,
                                        const SnapshotOptions& options) {
  RETURN_IF_ERROR(impl_->Usable());
  // Where the caller's time goes, at debug level: checks, the BeginSnapshot call, host copies,
  // queueing the device copies.
  const auto started = std::chrono::steady_clock::now();
  const bool memory = options.tier == Tier::kMemory;
  if (memory && !options.persist) {
    return InvalidArgument("a memory checkpoint (tier kMemory) holds every tensor: persist=false is for EMA-only "
                           "snapshots");
  }
  // An EMA-only snapshot needs only the tensors the EMA reads; the rest of the slot is not used. A
  // memory checkpoint holds every tensor, replicas included, as a restore hands them all back.
  const Selection selection = memory ? Selection::kAll : options.persist ? Selection::kSaved : Selection::kEmaSources;
  ASSIGN_OR_RETURN(auto matched, impl_->Match(buffers, selection));
  // Device memory this process cannot copy is refused before a slot is taken.
  ASSIGN_OR_RETURN(const std::vector<bool> device_mask, DeviceMask(BuffersOf(matched)));
  const double checks_ms = MsSince(started);
#if FLASHCKPT_HAVE_CUDA
  // Device tensors only: this thread marks the point of the caller's stream the copies wait for and
  // returns; the commit thread takes the slot, queues the copies and commits. With skip_when_busy a
  // busy daemon's refusal is wanted from this call: the slot is taken here.
  bool device_only = !impl_->options.skip_when_busy;
  bool any_device = false;
  for (size_t i = 0; i < matched.size(); ++i) {
    if (matched[i].first->bytes == 0) continue;
    any_device = any_device || device_mask[i];
    device_only = device_only && device_mask[i];
  }
  if (device_only && any_device) {
    SnapshotHandle handle;
    handle.step_ = step;
    ASSIGN_OR_RETURN(handle.progress_, impl_->BeginWhileCopying(step, buffers, selection, options));
    Logger("client")->debug("snapshot step={} checks_ms={:.3f} order_ms={:.3f} (begun on the commit thread)", step,
                            checks_ms, MsSince(started) - checks_ms);
    return handle;
  }
#else
  (void)device_mask;
#endif

  ASSIGN_OR_RETURN(const SlotLoan slot, impl_->BeginSlot(step, options.tier));
  const double begin_ms = MsSince(started) - checks_ms;
  char* base = impl_->Slot(slot.slot);
  Result<Impl::SlotCopies> copies = impl_->CopiesInto(base, buffers, selection);
  if (!copies.ok()) {
    impl_->AbortSlot(impl_->session_id, slot);
    return copies.status();
  }
  SlotCommit commit{impl_->session_id, slot, step, options.persist && !memory, options.loss, options.extra};
  const double before_copy_ms = MsSince(started);
  ParallelCopy(impl_->copier.get(), copies->from_host);
  impl_->PopulateInBackground();
  const double host_copy_ms = MsSince(started) - before_copy_ms;

  auto trace = [&](const char* last) {
    Logger("client")->debug("snapshot step={} checks_ms={:.3f} begin_ms={:.3f} host_copy_ms={:.3f} {}_ms={:.3f}", step,
                            checks_ms, begin_ms, host_copy_ms, last, MsSince(started) - before_copy_ms - host_copy_ms);
  };

  SnapshotHandle handle;
  handle.step_ = step;
#if FLASHCKPT_HAVE_CUDA
  if (!copies->from_device.empty()) {
    ASSIGN_OR_RETURN(handle.progress_, impl_->CommitWhileCopying(std::move(commit), base,
                                                                 std::move(copies->from_device), options.cuda_stream));
    trace("device_queue");
    return handle;
  }
#endif
  RETURN_IF_ERROR(impl_->Note(impl_->SendCommit(commit)));
  trace("commit");
  return handle;
}

Status Client::WaitPersisted(int64_t step, std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(impl_->Usable());
  v1::WaitPersistedResponse resp;
  return impl_->WithSession([&] {
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx, timeout);
    const auto req = WaitPersistedRequestOf(impl_->session_id, step, timeout);
    return FromGrpc(impl_->stub->WaitPersisted(&ctx, req, &resp), "WaitPersisted");
  });
}

Result<RestorableSteps> Client::Restorable(std::chrono::milliseconds timeout, std::optional<int64_t> extra_of,
                                           bool verify) {
  RETURN_IF_ERROR(impl_->Usable());
  if (extra_of && *extra_of <= 0) return InvalidArgument("Restorable: extra_of must be a step (> 0)");
  v1::RestorableResponse resp;
  RETURN_IF_ERROR(impl_->WithSession([&] {
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx, timeout);
    const auto req = RestorableRequestOf(impl_->session_id, extra_of, timeout, verify);
    return FromGrpc(impl_->stub->Restorable(&ctx, req, &resp), "Restorable");
  }));
  return RestorableStepsOf(resp);
}

Result<RestorableSteps> Client::DiskExtra(std::optional<int64_t> step, std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(impl_->Usable());
  if (step && *step <= 0) return InvalidArgument("DiskExtra: the step must be positive (or nullopt for the latest)");
  v1::RestorableResponse resp;
  RETURN_IF_ERROR(impl_->WithSession([&] {
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx, timeout);
    v1::RestorableRequest req = RestorableRequestOf(impl_->session_id, step, timeout, /*verify=*/false);
    req.set_disk_extra(true);
    return FromGrpc(impl_->stub->Restorable(&ctx, req, &resp), "Restorable");
  }));
  if (!resp.disk_extra()) {
    return FailedPrecondition("flashckptd does not answer the extra state of a checkpoint on disk: it is older than "
                              "this client; upgrade it");
  }
  RestorableSteps out = RestorableStepsOf(resp);
  out.memory_steps.clear();
  return out;
}

Status Client::WaitComplete(int64_t step, std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(impl_->Usable());
  v1::WaitCompleteResponse resp;
  return impl_->WithSession([&] {
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx, timeout);
    const auto req = WaitCompleteRequestOf(impl_->session_id, step, timeout);
    return FromGrpc(impl_->stub->WaitComplete(&ctx, req, &resp), "WaitComplete");
  });
}

Result<RestoreResult> Client::Restore(std::optional<int64_t> step, const std::vector<TensorBuffer>& buffers,
                                      std::chrono::milliseconds timeout, const RestoreOptions& options) {
  RETURN_IF_ERROR(impl_->Usable());
  if (step && *step <= 0) return InvalidArgument("restore step must be positive (or nullopt for the latest)");
  ASSIGN_OR_RETURN(auto matched, impl_->Match(buffers, Selection::kAll));
  RETURN_IF_ERROR(DeviceMask(BuffersOf(matched)).status());  // before the daemon reads anything
  if (!options.source_job.empty() && options.kinds.empty()) {
    return InvalidArgument("a restore from another job (source_job '" + options.source_job +
                           "') must name the tensor kinds it wants");
  }
  for (TensorKind kind : options.kinds) {
    if (kind == TensorKind::kEma) return InvalidArgument("restore kinds are model, optimizer and master_weight");
  }
  // Host buffers: a memory checkpoint comes with its checksums, checked here as each chunk is copied.
  const auto mask = DeviceMask(BuffersOf(matched));
  const bool verify_in_client = mask.ok() && std::none_of(mask->begin(), mask->end(), [](bool d) { return d; });
  // While the daemon fills the slot (reading files takes a while), a thread maps the host buffers'
  // pages for writing, so that fresh ones (a new optimizer's moments) are not first touched during
  // the copy; it stops once the daemon answers (a memory restore answers at once) and is joined
  // before anything is copied.
  std::vector<CopyTask> destinations;
  for (size_t i = 0; mask.ok() && i < matched.size(); ++i) {
    if (!(*mask)[i] && matched[i].first->bytes > 0) {
      destinations.push_back({matched[i].first->data, nullptr, matched[i].first->bytes});
    }
  }
  std::atomic<bool> answered{false};
  std::thread prefault;
  if (!destinations.empty()) prefault = std::thread([&] { PrefaultDestinations(destinations, &answered); });
  struct Join {
    std::atomic<bool>* answered;
    std::thread* thread;
    void operator()() const {
      answered->store(true);
      if (thread->joinable()) thread->join();
    }
    ~Join() { (*this)(); }
  } end_prefault{&answered, &prefault};
  // A memory checkpoint that fails the client's verification is reported, and the restore asked
  // again: the daemon has dropped it, and reads the files (or fails the job's plan on that step).
  std::string failed;  // what the first attempt's verification found: the buffers hold part of it
  for (int attempt = 0;; ++attempt) {
    v1::RestoreResponse resp;
    Status asked = impl_->WithSession([&] {
      grpc::ClientContext ctx;
      impl_->Deadline(&ctx, timeout);
      const auto req = RestoreRequestOf(impl_->session_id, step, options, timeout, verify_in_client);
      return FromGrpc(impl_->stub->Restore(&ctx, req, &resp), "Restore");
    });
    end_prefault();
    RestoreHandover restored = RestoreHandoverOf(resp);
    if (!failed.empty() && (!asked.ok() || !restored.found)) {
      // Nothing to fall back to: never found=false (a fresh start) over buffers that changed.
      return Corruption(failed + "; the buffers hold part of that memory checkpoint and " +
                        (asked.ok() ? std::string("no checkpoint on disk replaces it")
                                    : "restoring again failed: " + asked.ToString()) +
                        ": set them again before training");
    }
    RETURN_IF_ERROR(asked);
    RestoreResult result;
    if (!restored.found) return result;
    if (restored.slot.slot >= impl_->slot_count) return Internal("the daemon restored into a slot that does not exist");
    ASSIGN_OR_RETURN(matched, impl_->Match(buffers, Selection::kAll));  // a re-attach rebuilt the tensor table
    Status copied = impl_->CopyRestored(matched, restored, options, &result.bytes);
    const bool corrupt = restored.verify_in_client && copied.code() == StatusCode::kCorruption;
    Status released = impl_->Note(impl_->ReleaseSlot(restored.slot, corrupt ? copied.message() : std::string()));
    if (corrupt && released.ok() && attempt == 0) {
      failed = copied.message();
      continue;
    }
    RETURN_IF_ERROR(copied.WithContext("copying the restored tensors into the caller's buffers"));
    RETURN_IF_ERROR(released);
    result.found = true;
    result.step = restored.step;
    // The attempt this process's later saves belong to (weights of another job start none).
    if (options.source_job.empty()) impl_->resumed_from = restored.step;
    result.extra = std::move(restored.extra);
    result.tier = restored.tier;
    return result;
  }
}

Result<std::string> Client::StatusJson() {
  RETURN_IF_ERROR(impl_->Usable());
  v1::StatusResponse resp;
  {
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx);
    RETURN_IF_ERROR(FromGrpc(impl_->stub->GetStatus(&ctx, v1::StatusRequest{}, &resp), "GetStatus"));
  }
  return StatusResponseJson(resp);
}

}  // namespace flashckpt

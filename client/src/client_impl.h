// The state behind flashckpt::Client (client.h), shared by the files of the trainer client:
// session.cc (connect, the session stream, registration and re-attach after a daemon restart),
// client.cc (snapshot, restore, EMA), wire.cc (protobuf), host_copy.cc and cuda_copy.cc (copies).
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client/src/host_copy.h"
#include "client/src/wire.h"
#include "common/base/mutex.h"
#include "common/base/thread_pool.h"
#include "common/io/shm.h"
#include "flashckpt.grpc.pb.h"
#include "flashckpt/client.h"

#if FLASHCKPT_HAVE_CUDA
#include "client/src/cuda_copy.h"
#endif

namespace flashckpt {

struct MappedTensor {
  uint64_t slot_offset = 0;
  uint64_t bytes = 0;
  bool replica = false;
  bool ema_source = false;  // read by the daemon's EMA: the only tensors an EMA-only snapshot copies
  TensorKind kind = TensorKind::kModel;
};

// Which registered tensors a call moves.
enum class Selection { kSaved, kEmaSources, kAll };

using Matched = std::vector<std::pair<const TensorBuffer*, const MappedTensor*>>;

namespace detail {

// What a device snapshot's commit thread tells the handles: the copies, then the commit.
struct SnapshotProgress {
 public:
  void SetCopied(const Status& s) EXCLUDES(mu_);
  void SetCommitted(const Status& s) EXCLUDES(mu_);
  // Block until the copies (the commit) are done and return their outcome.
  Status WaitCopied() EXCLUDES(mu_);
  Status WaitCommitted() EXCLUDES(mu_);

 private:
  Mutex mu_;
  CondVar cv_;
  bool copied_ GUARDED_BY(mu_) = false;
  bool committed_ GUARDED_BY(mu_) = false;
  Status copy_status_ GUARDED_BY(mu_);
  Status commit_status_ GUARDED_BY(mu_);
};

}  // namespace detail

// Used by one thread at a time (the Client's contract). The commit thread of a device snapshot
// uses `stub`, `options`, `device` and the slot geometry while the caller trains; every other call
// joins it first (FinishPending). The handles share only the SnapshotProgress.
struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Checkpoint::Stub> stub;
  // The session stream: open for the client's lifetime.
  std::unique_ptr<grpc::ClientContext> session_ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionEvent>> session;
  std::string session_id;
  bool closed = false;
  // Re-attaching after the daemon restarted: the last registration (without a session id), the
  // step this process restored (its signals name that attempt), and whether the session is lost.
  std::optional<v1::RegisterRequest> registration;
  int64_t resumed_from = 0;
  std::string run_id;  // the session's run, from the first registration's reply
  bool broken = false;

  // Mapped lazily: a restarted trainer's restore touches the one slot it reads. Once a snapshot has
  // filled a slot, or when Populate() asks, `populator` maps the pages of all of them in the
  // background, so no later snapshot into another slot takes page faults; Unmap() stops it first.
  std::unique_ptr<SharedSegment> segment;
  std::thread populator;
  std::atomic<bool> stop_populating{false};
  uint32_t slot_count = 0;
  uint64_t slot_offset = 0, slot_stride = 0;
  std::map<std::string, MappedTensor> tensors;
  std::map<std::string, MappedTensor> ema_tensors;
  std::unique_ptr<ParallelLoop> copier;  // copies large host tensors on several threads
#if FLASHCKPT_HAVE_CUDA
  // Device copies; holds the pins of the slots, so it is declared after (destroyed before) `segment`.
  DeviceCopier device;
#endif
  // The device snapshot whose commit thread is running, if any: every call but EmaTensorNames()
  // joins it first (FinishPending), so the thread never runs beside another call of this client;
  // the handles' waits touch only the progress it shares with them.
  std::thread committer;
  std::shared_ptr<detail::SnapshotProgress> pending;

  void Deadline(grpc::ClientContext* ctx, std::chrono::milliseconds extra = std::chrono::milliseconds(0)) const {
    ctx->set_deadline(std::chrono::system_clock::now() + options.rpc_timeout + extra);
  }
  char* Slot(uint32_t i) const { return segment->data() + slot_offset + slot_stride * i; }
  // Gives a slot the daemon lent for reading (restore, EMA) back.
  // `corrupt`: what the client's verification of a memory checkpoint handed over in the slot found.
  Status ReleaseSlot(const SlotLoan& slot, const std::string& corrupt = "") const;
  Status Usable() {
    if (closed) return Cancelled("the client is closed");
    FinishPending();
    return Status::OK();
  }
  // Waits for the commit thread of the last device snapshot; its outcome is the handle's.
  void FinishPending() {
    if (committer.joinable()) committer.join();
    if (pending) (void)Note(pending->WaitCommitted());
    pending.reset();
  }
  // Starts `populator` unless it has run for this mapping.
  void PopulateInBackground() {
    if (populator.joinable() || !segment) return;
    populator = std::thread([seg = segment.get(), begin = slot_offset, bytes = slot_stride * slot_count,
                             stop = &stop_populating] { (void)seg->Populate(begin, bytes, stop); });
  }
  // Unpins and unmaps the segment.
  void Unmap() {
    if (populator.joinable()) {
      stop_populating = true;
      populator.join();
      stop_populating = false;
    }
#if FLASHCKPT_HAVE_CUDA
    device.Unpin();
#endif
    segment.reset();
  }
  // Sends the commit of a filled slot; on failure gives the slot back. Reads only `stub` and
  // `options`, so the commit thread may call it.
  Status SendCommit(const SlotCommit& commit) const;
  // Gives a slot being filled back, so a failed snapshot does not hold it until the session ends.
  void AbortSlot(const std::string& session_of_slot, const SlotLoan& slot) const;
  // The slot of snapshot `step` in `tier`, from the daemon (BeginSnapshot, re-attaching if need be);
  // its refusal (busy, a step that does not increase) is the error.
  Result<SlotLoan> BeginSlot(int64_t step, Tier tier);
  // Where the tensors of a snapshot go in the slot at `base`: `buffers` matched again after BeginSlot
  // (a re-attach there rebuilds the tensor table), host tensors as copy tasks and, in CUDA builds,
  // device tensors with bytes as device copies.
  struct SlotCopies {
    std::vector<CopyTask> from_host;
#if FLASHCKPT_HAVE_CUDA
    std::vector<DeviceCopy> from_device;
#endif
  };
  Result<SlotCopies> CopiesInto(char* base, const std::vector<TensorBuffer>& buffers, Selection selection) const;
#if FLASHCKPT_HAVE_CUDA
  // A device snapshot whose slot is taken (mixed host and device tensors; `from_device` are the
  // device ones, into the slot at `base`): on this thread only an event is recorded on
  // `cuda_stream`; the commit thread (`committer`) runs CopyAndCommit. When the event cannot be
  // recorded the slot is given back.
  Result<std::shared_ptr<detail::SnapshotProgress>> CommitWhileCopying(SlotCommit commit, char* base,
                                                                       std::vector<DeviceCopy> from_device,
                                                                       void* cuda_stream);
  // A snapshot of device tensors only: on this thread only an event is recorded on
  // snapshot.cuda_stream; the commit thread takes a slot (BeginSnapshot, re-attaching if need be),
  // then runs CopyAndCommit. A refusal of the slot (or a re-attach that changed the tensors) leaves
  // the tensors free and is the handle's commit answer.
  Result<std::shared_ptr<detail::SnapshotProgress>> BeginWhileCopying(int64_t step, std::vector<TensorBuffer> buffers,
                                                                      Selection selection, SnapshotOptions snapshot);
  // On the commit thread: pins the slots (the first time), queues the chunked copies behind the
  // recorded event, sends the commit, and moves the slot header's copied_until on as each chunk
  // lands; tells `progress` the outcomes. When the copies cannot be queued nothing is committed and
  // the slot is given back.
  void CopyAndCommit(detail::SnapshotProgress* progress, const SlotCommit& commit, char* base,
                     std::vector<DeviceCopy> from_device);
#endif
  // Copies the slot's bytes into the caller's buffers (restore, EMA): memcpy for host buffers,
  // cudaMemcpyAsync for device ones, ordered after `cuda_stream` and before its later work.
  // Returns once every byte is in place.
  Status CopyOut(const std::vector<CopyTask>& tasks, const std::vector<bool>& on_device, void* cuda_stream);
  // Copies a memory checkpoint handed over with its checksums (host buffers) into the caller's
  // buffers, each chunk checked as it is copied (ParallelVerifiedCopy): CORRUPTION when one differs.
  Status CopyOutVerified(const Matched& matched, const char* base, const RestoreHandover& restored);
  // Copies the tensors of `matched` that a restore with the options `restore` reads out of the slot
  // it handed over (CopyOutVerified when the client verifies it, else CopyOut); `bytes` grows by
  // their size.
  Status CopyRestored(const Matched& matched, const RestoreHandover& restored, const RestoreOptions& restore,
                      uint64_t* bytes);
  // Opens the session stream and reads the session id, within the rpc timeout. `reattach`: this
  // process carrying on after its session broke (SessionRequest.reattach).
  Status OpenSession(bool reattach = false);
  // Maps the segment the registration reply names (keeping the mapping when it is the same one)
  // and records the tensors' places.
  Status ApplyRegistration(const v1::RegisterResponse& resp);
  // A new session and the same registration, after the daemon restarted (UNAVAILABLE). Waits up
  // to `wait` for the daemon's socket to accept.
  Status Reattach(std::chrono::milliseconds wait);
  // Runs `rpc`, a unary call that reads `session_id` when it runs; on UNAVAILABLE it re-attaches
  // once and runs it again. A lost session is re-attached before the call.
  Status WithSession(const std::function<Status()>& rpc);
  // As WithSession, but while the daemon is unavailable (down, restarting, or killed in the middle
  // of the call) it keeps re-attaching and retrying until `patience` has passed: for the calls that
  // start a rank's life (Register), which a trainer cannot go on without.
  Status WithSessionPatiently(const std::function<Status()>& rpc, std::chrono::milliseconds patience);
  // Remembers that the session is lost when `s` is UNAVAILABLE; returns `s`.
  Status Note(Status s) {
    if (s.code() == StatusCode::kUnavailable) broken = true;
    return s;
  }
  // Checks that `buffers` names registered tensors with matching sizes, each at most once, and
  // covers every tensor `required` selects.
  Result<Matched> Match(const std::vector<TensorBuffer>& buffers, Selection selection) const;
};

}  // namespace flashckpt

#include "flashckpt/client.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "common/base/cuda_info.h"
#include "common/base/dtype.h"
#include "common/base/status.h"
#include "common/base/thread_pool.h"
#include "common/io/shm.h"
#include "flashckpt.grpc.pb.h"

#if FLASHCKPT_HAVE_CUDA
#include "client/src/cuda_copy.h"
#endif

namespace flashckpt {
namespace {

Status FromGrpc(const grpc::Status& s, const char* rpc) {
  if (s.ok()) return Status::OK();
  StatusCode code = StatusCode::kInternal;
  switch (s.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT: code = StatusCode::kInvalidArgument; break;
    case grpc::StatusCode::NOT_FOUND: code = StatusCode::kNotFound; break;
    case grpc::StatusCode::ALREADY_EXISTS: code = StatusCode::kAlreadyExists; break;
    case grpc::StatusCode::FAILED_PRECONDITION: code = StatusCode::kFailedPrecondition; break;
    case grpc::StatusCode::RESOURCE_EXHAUSTED: code = StatusCode::kResourceExhausted; break;
    case grpc::StatusCode::DEADLINE_EXCEEDED: code = StatusCode::kDeadlineExceeded; break;
    case grpc::StatusCode::UNAVAILABLE: code = StatusCode::kUnavailable; break;
    case grpc::StatusCode::DATA_LOSS: code = StatusCode::kCorruption; break;
    case grpc::StatusCode::CANCELLED: code = StatusCode::kCancelled; break;
    // The daemon sends IO_ERROR (a failed system call: a failing disk) as INTERNAL named in the details.
    case grpc::StatusCode::INTERNAL:
      code = s.error_details() == "IO_ERROR" ? StatusCode::kIOError : StatusCode::kInternal;
      break;
    default: code = StatusCode::kInternal; break;
  }
  return Status(code, std::string(rpc) + ": " + s.error_message());
}

v1::TensorKind KindToProto(TensorKind k) {
  switch (k) {
    case TensorKind::kModel: return v1::TENSOR_KIND_MODEL;
    case TensorKind::kOptimizer: return v1::TENSOR_KIND_OPTIMIZER;
    case TensorKind::kMasterWeight: return v1::TENSOR_KIND_MASTER_WEIGHT;
    case TensorKind::kEma: break;  // the daemon's own kind: refused at registration
  }
  return v1::TENSOR_KIND_UNSPECIFIED;
}

struct CopyTask {
  void* dst;
  const void* src;
  size_t bytes;
};

// Copies the tasks, splitting large ones into 16 MiB chunks spread over the loop's threads.
void ParallelCopy(ParallelLoop* loop, const std::vector<CopyTask>& tasks) {
  constexpr size_t kChunk = 16u << 20;
  size_t total = 0;
  for (const auto& t : tasks) total += t.bytes;
  if (loop->threads() == 1 || total < 2 * kChunk) {
    for (const auto& t : tasks) std::memcpy(t.dst, t.src, t.bytes);
    return;
  }
  std::vector<size_t> first_chunk(tasks.size() + 1, 0);  // prefix sums of chunks per task
  for (size_t i = 0; i < tasks.size(); ++i) first_chunk[i + 1] = first_chunk[i] + (tasks[i].bytes + kChunk - 1) / kChunk;
  loop->Run(first_chunk.back(), [&](size_t c) {
    size_t i = static_cast<size_t>(std::upper_bound(first_chunk.begin(), first_chunk.end(), c) - first_chunk.begin()) - 1;
    size_t offset = (c - first_chunk[i]) * kChunk;
    size_t n = std::min(kChunk, tasks[i].bytes - offset);
    std::memcpy(static_cast<char*>(tasks[i].dst) + offset, static_cast<const char*>(tasks[i].src) + offset, n);
  });
}

struct MappedTensor {
  uint64_t slot_offset = 0;
  uint64_t bytes = 0;
  bool replica = false;
  bool ema_source = false;  // read by the daemon's EMA: the only tensors an EMA-only snapshot copies
};

// Which registered tensors a call moves.
enum class Selection { kSaved, kEmaSources, kAll };

using Matched = std::vector<std::pair<const TensorBuffer*, const MappedTensor*>>;

// Device tensors are copied in pieces of this size, each with its own event: the daemon may write
// a piece while the next ones are still in flight.
[[maybe_unused]] constexpr uint64_t kDeviceCopyChunk = 64u << 20;  // used by the CUDA build only

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

// What a device snapshot's commit thread tells the handles: the copies, then the commit.
struct SnapshotProgress {
  std::mutex mu;
  std::condition_variable cv;
  bool copied = false;     // guarded by mu
  bool committed = false;  // guarded by mu
  Status copy_status;      // guarded by mu
  Status commit_status;    // guarded by mu

  void SetCopied(const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    copied = true;
    copy_status = s;
    cv.notify_all();
  }
  void SetCommitted(const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    committed = true;
    commit_status = s;
    cv.notify_all();
  }
};

}  // namespace detail

Status SnapshotHandle::WaitCopied() const {
  if (!progress_) return Status::OK();
  std::unique_lock<std::mutex> lock(progress_->mu);
  progress_->cv.wait(lock, [&] { return progress_->copied; });
  return progress_->copy_status;
}

Status SnapshotHandle::WaitCommitted() const {
  if (!progress_) return Status::OK();
  std::unique_lock<std::mutex> lock(progress_->mu);
  progress_->cv.wait(lock, [&] { return progress_->committed; });
  return progress_->commit_status;
}

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
  bool broken = false;

  std::unique_ptr<SharedSegment> segment;
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
  Status ReleaseSlot(uint32_t slot, uint64_t generation) const {
    v1::ReleaseSlotRequest req;
    req.set_session_id(session_id);
    req.set_slot(slot);
    req.set_generation(generation);
    v1::ReleaseSlotResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    return FromGrpc(stub->ReleaseSlot(&ctx, req, &resp), "ReleaseSlot");
  }
  Status Usable() {
    if (closed) return Cancelled("the client is closed");
    FinishPending();
    return Status::OK();
  }
  // Waits for the commit thread of the last device snapshot; its outcome is the handle's.
  void FinishPending() {
    if (committer.joinable()) committer.join();
    if (pending) {
      std::lock_guard<std::mutex> lock(pending->mu);
      (void)Note(pending->commit_status);
    }
    pending.reset();
  }
  // Unpins and unmaps the segment.
  void Unmap() {
#if FLASHCKPT_HAVE_CUDA
    device.Unpin();
#endif
    segment.reset();
  }
  // Sends the commit of a filled slot; on failure gives the slot back. Reads only `stub` and
  // `options`, so the commit thread may call it.
  Status SendCommit(const v1::CommitRequest& commit) const {
    v1::CommitResponse committed;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    // Not retried: the slot belongs to the session that began the snapshot.
    Status status = FromGrpc(stub->Commit(&ctx, commit, &committed), "Commit");
    if (!status.ok()) AbortSlot(commit.session_id(), commit.slot(), commit.generation());
    return status;
  }
  // Gives a slot being filled back, so a failed snapshot does not hold it until the session ends.
  void AbortSlot(const std::string& session_of_slot, uint32_t slot, uint64_t generation) const {
    v1::AbortSnapshotRequest abort;
    abort.set_session_id(session_of_slot);
    abort.set_slot(slot);
    abort.set_generation(generation);
    v1::AbortSnapshotResponse aborted;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    (void)stub->AbortSnapshot(&ctx, abort, &aborted);
  }
  // Copies the slot's bytes into the caller's buffers (restore, EMA): memcpy for host buffers,
  // cudaMemcpyAsync for device ones, ordered after `cuda_stream` and before its later work.
  // Returns once every byte is in place.
  Status CopyOut(const std::vector<CopyTask>& tasks, const std::vector<bool>& on_device, void* cuda_stream);
  // Opens the session stream and reads the session id, within the rpc timeout.
  Status OpenSession();
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

Status Client::Impl::OpenSession() {
  if (session) {  // the old stream, broken or not: finished exactly once
    session_ctx->TryCancel();
    (void)session->Finish();
    session.reset();
    session_ctx.reset();
  }
  auto ctx = std::make_unique<grpc::ClientContext>();
  auto stream = stub->Session(ctx.get());
  v1::SessionRequest hello;
  hello.set_job(options.job);
  hello.set_rank(options.rank);
  if (!stream->Write(hello)) return FromGrpc(stream->Finish(), "Session");
  // The first event carries the session id; bound the wait for it.
  v1::SessionEvent event;
  auto* raw = stream.get();
  auto reply = std::async(std::launch::async, [raw, &event] { return raw->Read(&event); });
  if (reply.wait_for(options.rpc_timeout) != std::future_status::ready) {
    ctx->TryCancel();
    reply.wait();
    (void)stream->Finish();
    return DeadlineExceeded("flashckptd did not open the session within " +
                            std::to_string(options.rpc_timeout.count()) + " ms");
  }
  if (!reply.get()) return FromGrpc(stream->Finish(), "Session");
  session_ctx = std::move(ctx);
  session = std::move(stream);
  session_id = event.session_id();
  return Status::OK();
}

Status Client::Impl::ApplyRegistration(const v1::RegisterResponse& resp) {
  if (!segment || segment->name() != resp.segment_name() || segment->size() != resp.segment_bytes()) {
    Unmap();
    ASSIGN_OR_RETURN(segment, SharedSegment::Open(resp.segment_name(), resp.segment_bytes()));
  }
  uint64_t end = resp.slot_offset() + resp.slot_stride() * resp.slot_count();
  if (resp.slot_count() == 0 || end > resp.segment_bytes()) {
    Unmap();
    return Internal("the daemon described slots that do not fit its segment");
  }
  slot_count = resp.slot_count();
  slot_offset = resp.slot_offset();
  slot_stride = resp.slot_stride();
  tensors.clear();
  for (const auto& p : resp.placements()) {
    if (p.slot_offset() + p.bytes() > resp.slot_stride()) {
      Unmap();
      return Internal("the daemon placed tensor '" + p.name() + "' outside its slot");
    }
    tensors[p.name()] = MappedTensor{p.slot_offset(), p.bytes(), p.file().empty(), p.ema_source()};
  }
  ema_tensors.clear();
  for (const auto& p : resp.ema_placements()) {
    if (p.slot_offset() + p.bytes() > resp.slot_stride()) {
      Unmap();
      return Internal("the daemon placed EMA tensor '" + p.name() + "' outside its slot");
    }
    ema_tensors[p.name()] = MappedTensor{p.slot_offset(), p.bytes(), false, false};
  }
  return Status::OK();
}

// A short wait: while the daemon is down every save fails fast and training goes on.
std::chrono::milliseconds ReattachWait(const ClientOptions& options) {
  return std::min<std::chrono::milliseconds>(options.rpc_timeout, std::chrono::milliseconds(250));
}

Status Client::Impl::Reattach(std::chrono::milliseconds wait) {
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + wait)) {
    return Unavailable("flashckptd is not reachable at " + options.socket_path + " (waited " +
                       std::to_string(wait.count()) + " ms to re-attach); the next call tries again");
  }
  RETURN_IF_ERROR(OpenSession());
  if (registration) {
    v1::RegisterRequest req = *registration;
    req.set_session_id(session_id);
    req.set_resumed_from(resumed_from);
    v1::RegisterResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    RETURN_IF_ERROR(FromGrpc(stub->Register(&ctx, req, &resp), "Register"));
    RETURN_IF_ERROR(ApplyRegistration(resp));
  }
  broken = false;
  return Status::OK();
}

Status Client::Impl::WithSession(const std::function<Status()>& rpc) {
  if (broken) RETURN_IF_ERROR(Note(Reattach(ReattachWait(options))));
  Status s = rpc();
  if (s.code() != StatusCode::kUnavailable) return s;
  broken = true;
  if (!Reattach(ReattachWait(options)).ok()) return s;
  return Note(rpc());
}

Status Client::Impl::WithSessionPatiently(const std::function<Status()>& rpc, std::chrono::milliseconds patience) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  auto left = [&] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  };
  Status s = broken ? Unavailable("the session was lost") : rpc();
  while (s.code() == StatusCode::kUnavailable && left().count() > 0) {
    broken = true;
    Status attached = Reattach(left());
    if (!attached.ok()) {
      s = attached;
      if (attached.code() != StatusCode::kUnavailable) return attached;
      std::this_thread::sleep_for(std::min(left(), std::chrono::milliseconds(20)));
      continue;
    }
    s = rpc();
  }
  if (s.code() == StatusCode::kUnavailable) {
    return Note(s.WithContext("flashckptd at " + options.socket_path + " stayed unavailable for " +
                              std::to_string(patience.count()) + " ms (ClientOptions::connect_timeout)"));
  }
  return Note(s);
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Client::~Client() { Close(); }

Result<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  grpc::ChannelArguments args;
  // A trainer often starts before the daemon's socket exists: retry quickly instead of backing off to seconds.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  impl->channel = grpc::CreateCustomChannel("unix:" + options.socket_path, grpc::InsecureChannelCredentials(), args);
  impl->stub = v1::Checkpoint::NewStub(impl->channel);
  // The daemon may be starting, or restarting (killed while this process starts, or between the
  // socket accepting and the session opening): until connect_timeout, each of those is waited out.
  const auto deadline = std::chrono::system_clock::now() + options.connect_timeout;
  Status opened = Unavailable("no attempt was made");
  int attempts = 0;
  for (;;) {
    if (!impl->channel->WaitForConnected(deadline)) {
      return Unavailable("flashckptd is not reachable at " + options.socket_path + " (waited " +
                         std::to_string(options.connect_timeout.count()) + " ms" +
                         (attempts > 0 ? "; the last session attempt failed: " + opened.ToString() : "") + ")");
    }
    opened = impl->OpenSession();
    ++attempts;
    if (opened.code() != StatusCode::kUnavailable) break;
    if (std::chrono::system_clock::now() >= deadline) {
      return opened.WithContext("flashckptd at " + options.socket_path + " stayed unavailable for " +
                                std::to_string(options.connect_timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  RETURN_IF_ERROR(opened);
  unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  unsigned threads = options.copy_threads != 0 ? options.copy_threads : std::min(hw, 8u);
  impl->copier = std::make_unique<ParallelLoop>(threads - 1);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

void Client::Close() {
  if (!impl_ || impl_->closed) return;
  impl_->FinishPending();  // the last device snapshot's commit, before the session ends
  impl_->closed = true;
  if (impl_->session) {
    impl_->session->WritesDone();
    impl_->session_ctx->TryCancel();
    (void)impl_->session->Finish();
  }
  impl_->Unmap();
}

Status Client::Register(const Topology& topology, const std::vector<TensorSpec>& tensors, const EmaOptions& ema) {
  RETURN_IF_ERROR(impl_->Usable());
  v1::RegisterRequest req;
  auto* t = req.mutable_topology();
  t->set_world_size(topology.world_size);
  t->set_tp_rank(topology.tp_rank);
  t->set_tp_degree(topology.tp_degree);
  t->set_pp_rank(topology.pp_rank);
  t->set_pp_degree(topology.pp_degree);
  t->set_shard_rank(topology.shard_rank);
  t->set_shard_degree(topology.shard_degree);
  req.set_backpressure(impl_->options.skip_when_busy ? v1::BACKPRESSURE_SKIP : v1::BACKPRESSURE_WAIT);
  req.set_fatal_persist_errors(impl_->options.fatal_persist_errors);
  if (ema.decay) {
    auto* e = req.mutable_ema();
    e->set_enabled(true);
    e->set_decay(*ema.decay);
    e->set_interval(ema.interval);
    e->set_init(ema.init_zeros ? "zeros" : "first");
    e->set_model_params(ema.all_float_params ? "all" : "fp32");
    if (ema.loss_threshold) {
      e->set_has_loss_threshold(true);
      e->set_loss_threshold(*ema.loss_threshold);
    }
  }
  for (const auto& spec : tensors) {
    auto* p = req.add_tensors();
    p->set_name(spec.name);
    p->set_kind(KindToProto(spec.kind));
    p->set_dtype(std::string(DTypeName(spec.dtype)));
    for (auto d : spec.shape) p->add_shape(d);
    for (auto d : spec.global_shape) p->add_global_shape(d);
    for (auto d : spec.box_offset) p->add_box_offset(d);
    for (auto d : spec.box_shape) p->add_box_shape(d);
    if (spec.flat_range) {
      p->set_has_flat_range(true);
      p->set_flat_begin(spec.flat_range->begin);
      p->set_flat_end(spec.flat_range->end);
    }
    p->set_replica(spec.replica);
    p->set_param(spec.param);
  }
  v1::RegisterResponse resp;
  // A rank cannot train on without its registration: a daemon restart (or one that is killed while
  // it registers) is waited out for connect_timeout, as in Connect().
  RETURN_IF_ERROR(impl_->WithSessionPatiently(
      [&] {
        req.set_session_id(impl_->session_id);
        req.set_resumed_from(impl_->resumed_from);
        grpc::ClientContext ctx;
        impl_->Deadline(&ctx);
        return FromGrpc(impl_->stub->Register(&ctx, req, &resp), "Register");
      },
      impl_->options.connect_timeout));
  RETURN_IF_ERROR(impl_->ApplyRegistration(resp));
  req.clear_session_id();
  impl_->registration = std::move(req);
  return Status::OK();
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
    if (b.bytes != it->second.bytes || b.data == nullptr) {
      return InvalidArgument("EMA tensor '" + b.name + "' needs a buffer of " + std::to_string(it->second.bytes) +
                             " bytes");
    }
  }
  if (seen.size() != impl_->ema_tensors.size()) return InvalidArgument("give a buffer for every EMA tensor");
  std::vector<const TensorBuffer*> pointers;
  for (const auto& b : buffers) pointers.push_back(&b);
  ASSIGN_OR_RETURN(std::vector<bool> on_device, DeviceMask(pointers));
  v1::GetEmaRequest req;
  req.set_timeout_ms(static_cast<uint32_t>(std::max<int64_t>(1, timeout.count())));
  v1::GetEmaResponse resp;
  RETURN_IF_ERROR(impl_->WithSession([&] {
    req.set_session_id(impl_->session_id);
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx, timeout);
    return FromGrpc(impl_->stub->GetEma(&ctx, req, &resp), "GetEma");
  }));
  if (resp.slot() >= impl_->slot_count) return Internal("the daemon copied the EMA into a slot that does not exist");
  EmaResult result;
  result.initialized = resp.initialized();
  result.step = resp.step();
  const char* base = impl_->Slot(resp.slot());
  Status copied;
  if (result.initialized) {
    for (const auto& b : buffers) tasks.push_back({b.data, base + impl_->ema_tensors[b.name].slot_offset, b.bytes});
    copied = impl_->CopyOut(tasks, on_device, nullptr);
  }
  Status released = impl_->Note(impl_->ReleaseSlot(resp.slot(), resp.generation()));
  RETURN_IF_ERROR(copied.WithContext("copying the EMA into the caller's buffers"));
  RETURN_IF_ERROR(released);
  return result;
}

Result<SnapshotHandle> Client::Snapshot(int64_t step, const std::vector<TensorBuffer>& buffers,
                                        const SnapshotOptions& options) {
  RETURN_IF_ERROR(impl_->Usable());
  // An EMA-only snapshot needs only the tensors the EMA reads; the rest of the slot is not used.
  const Selection selection = options.persist ? Selection::kSaved : Selection::kEmaSources;
  ASSIGN_OR_RETURN(auto matched, impl_->Match(buffers, selection));
  // Device memory this process cannot copy is refused before a slot is taken.
  RETURN_IF_ERROR(DeviceMask(BuffersOf(matched)).status());

  v1::BeginSnapshotRequest begin;
  begin.set_step(step);
  begin.set_timeout_ms(static_cast<uint32_t>(impl_->options.slot_timeout.count()));
  v1::BeginSnapshotResponse slot;
  RETURN_IF_ERROR(impl_->WithSession([&] {
    begin.set_session_id(impl_->session_id);
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx, impl_->options.slot_timeout);
    return FromGrpc(impl_->stub->BeginSnapshot(&ctx, begin, &slot), "BeginSnapshot");
  }));
  if (slot.slot() >= impl_->slot_count) return Internal("the daemon handed out a slot that does not exist");
  // Matched again: a re-attach inside BeginSnapshot rebuilt the tensor table.
  ASSIGN_OR_RETURN(matched, impl_->Match(buffers, selection));
  Result<std::vector<bool>> on_device = DeviceMask(BuffersOf(matched));
  if (!on_device.ok()) {
    impl_->AbortSlot(impl_->session_id, slot.slot(), slot.generation());
    return on_device.status();
  }

  v1::CommitRequest commit;
  commit.set_session_id(impl_->session_id);
  commit.set_slot(slot.slot());
  commit.set_generation(slot.generation());
  commit.set_step(step);
  commit.set_persist(options.persist);
  if (options.loss) {
    commit.set_has_loss(true);
    commit.set_loss(*options.loss);
  }
  commit.set_extra(options.extra);

  char* base = impl_->Slot(slot.slot());
  std::vector<CopyTask> tasks;
  tasks.reserve(matched.size());
#if FLASHCKPT_HAVE_CUDA
  std::vector<DeviceCopy> from_device;
#endif
  for (size_t i = 0; i < matched.size(); ++i) {
    const auto& [buffer, mapped] = matched[i];
#if FLASHCKPT_HAVE_CUDA
    if ((*on_device)[i]) {
      if (buffer->bytes > 0) from_device.push_back({base + mapped->slot_offset, buffer->data, buffer->bytes});
      continue;
    }
#endif
    tasks.push_back({base + mapped->slot_offset, buffer->data, buffer->bytes});
  }
  ParallelCopy(impl_->copier.get(), tasks);

  SnapshotHandle handle;
  handle.step_ = step;
#if FLASHCKPT_HAVE_CUDA
  if (!from_device.empty()) {
    // A streaming commit. The device-to-host copies are queued behind the caller's stream in slot
    // order, in chunks; the commit goes at once (from this client's thread), and the slot header's
    // copied_until tells the daemon how far the copies have come, so that it hashes and writes the
    // first chunks while the next are in flight.
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
    Status pinned = impl_->device.PinSlots(impl_->Slot(0), impl_->slot_stride, impl_->slot_count);
    Result<std::vector<CudaEvent>> events =
        pinned.ok() ? impl_->device.CopyAfter(static_cast<cudaStream_t>(options.cuda_stream), chunks,
                                              /*event_each=*/true)
                    : Result<std::vector<CudaEvent>>(pinned);
    if (!events.ok()) {
      impl_->AbortSlot(commit.session_id(), commit.slot(), commit.generation());
      return events.status().WithContext("copying the device tensors of step " + std::to_string(step));
    }
    auto progress = std::make_shared<detail::SnapshotProgress>();
    impl_->pending = progress;
    impl_->committer = std::thread([impl = impl_.get(), progress, header, until = std::move(until),
                                    events = std::move(events).value(), commit = std::move(commit)] {
      progress->SetCommitted(impl->SendCommit(commit));
      // Every chunk is waited for, also after a failed commit: the slot must not be reused while
      // the device still writes into it.
      Status copied;
      for (size_t k = 0; k < events.size(); ++k) {
        copied = events[k].Synchronize();
        if (!copied.ok()) {
          header->copied_until.store(kSlotCopyFailed, std::memory_order_release);
          copied = copied.WithContext("copying the device tensors of step " + std::to_string(commit.step()));
          break;
        }
        header->copied_until.store(until[k], std::memory_order_release);
      }
      progress->SetCopied(copied);
    });
    handle.progress_ = std::move(progress);
    return handle;
  }
#endif
  RETURN_IF_ERROR(impl_->Note(impl_->SendCommit(commit)));
  return handle;
}

Status Client::WaitPersisted(int64_t step, std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(impl_->Usable());
  v1::WaitPersistedRequest req;
  req.set_step(step);
  req.set_timeout_ms(static_cast<uint32_t>(std::max<int64_t>(1, timeout.count())));
  v1::WaitPersistedResponse resp;
  return impl_->WithSession([&] {
    req.set_session_id(impl_->session_id);
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx, timeout);
    return FromGrpc(impl_->stub->WaitPersisted(&ctx, req, &resp), "WaitPersisted");
  });
}

Result<RestoreResult> Client::Restore(std::optional<int64_t> step, const std::vector<TensorBuffer>& buffers,
                                      std::chrono::milliseconds timeout, const RestoreOptions& options) {
  RETURN_IF_ERROR(impl_->Usable());
  if (step && *step <= 0) return InvalidArgument("restore step must be positive (or nullopt for the latest)");
  ASSIGN_OR_RETURN(auto matched, impl_->Match(buffers, Selection::kAll));
  RETURN_IF_ERROR(DeviceMask(BuffersOf(matched)).status());  // before the daemon reads anything
  v1::RestoreRequest req;
  req.set_step(step.value_or(0));
  req.set_convert_dtype(options.convert_dtype);
  req.set_timeout_ms(static_cast<uint32_t>(std::max<int64_t>(1, timeout.count())));
  v1::RestoreResponse resp;
  RETURN_IF_ERROR(impl_->WithSession([&] {
    req.set_session_id(impl_->session_id);
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx, timeout);
    return FromGrpc(impl_->stub->Restore(&ctx, req, &resp), "Restore");
  }));
  RestoreResult result;
  if (!resp.found()) return result;
  if (resp.slot() >= impl_->slot_count) return Internal("the daemon restored into a slot that does not exist");
  ASSIGN_OR_RETURN(matched, impl_->Match(buffers, Selection::kAll));  // a re-attach rebuilt the tensor table
  auto on_device = DeviceMask(BuffersOf(matched));
  const char* base = impl_->Slot(resp.slot());
  std::vector<CopyTask> tasks;
  for (const auto& [buffer, mapped] : matched) {
    tasks.push_back({buffer->data, base + mapped->slot_offset, buffer->bytes});
    result.bytes += buffer->bytes;
  }
  Status copied = on_device.ok() ? impl_->CopyOut(tasks, *on_device, options.cuda_stream) : on_device.status();
  Status released = impl_->Note(impl_->ReleaseSlot(resp.slot(), resp.generation()));
  RETURN_IF_ERROR(copied.WithContext("copying the restored tensors into the caller's buffers"));
  RETURN_IF_ERROR(released);
  result.found = true;
  result.step = resp.step();
  impl_->resumed_from = resp.step();  // the attempt this process's later saves belong to
  result.extra = resp.extra();
  return result;
}

Result<std::string> Client::StatusJson() {
  RETURN_IF_ERROR(impl_->Usable());
  v1::StatusResponse resp;
  {
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx);
    RETURN_IF_ERROR(FromGrpc(impl_->stub->GetStatus(&ctx, v1::StatusRequest{}, &resp), "GetStatus"));
  }
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  auto converted = google::protobuf::util::MessageToJsonString(resp, &json, options);
  if (!converted.ok()) return Internal("cannot render the daemon status as JSON: " + converted.ToString());
  return json;
}

}  // namespace flashckpt

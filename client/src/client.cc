#include "flashckpt/client.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <thread>

#include "common/dtype.h"
#include "common/shm.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "flashckpt.grpc.pb.h"

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

}  // namespace

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
  Status Usable() const {
    if (closed) return Cancelled("the client is closed");
    return Status::OK();
  }
  // Opens the session stream and reads the session id, within the rpc timeout.
  Status OpenSession();
  // Maps the segment the registration reply names (keeping the mapping when it is the same one)
  // and records the tensors' places.
  Status ApplyRegistration(const v1::RegisterResponse& resp);
  // A new session and the same registration, after the daemon restarted (UNAVAILABLE).
  Status Reattach();
  // Runs `rpc`, a unary call that reads `session_id` when it runs; on UNAVAILABLE it re-attaches
  // once and runs it again. A lost session is re-attached before the call.
  Status WithSession(const std::function<Status()>& rpc);
  // Remembers that the session is lost when `s` is UNAVAILABLE; returns `s`.
  Status Note(Status s) {
    if (s.code() == StatusCode::kUnavailable) broken = true;
    return s;
  }
  // Checks that `buffers` names registered tensors with matching sizes, each at most once, and
  // covers every tensor `required` selects.
  Result<std::vector<std::pair<const TensorBuffer*, const MappedTensor*>>> Match(
      const std::vector<TensorBuffer>& buffers, Selection selection) const;
};

Result<std::vector<std::pair<const TensorBuffer*, const MappedTensor*>>> Client::Impl::Match(
    const std::vector<TensorBuffer>& buffers, Selection selection) const {
  auto wanted = [selection](const MappedTensor& t) {
    switch (selection) {
      case Selection::kSaved: return !t.replica;
      case Selection::kEmaSources: return t.ema_source;
      case Selection::kAll: return true;
    }
    return true;
  };
  if (!segment) return FailedPrecondition("register the rank's tensors before saving or restoring");
  std::vector<std::pair<const TensorBuffer*, const MappedTensor*>> out;
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
    segment.reset();
    ASSIGN_OR_RETURN(segment, SharedSegment::Open(resp.segment_name(), resp.segment_bytes()));
  }
  uint64_t end = resp.slot_offset() + resp.slot_stride() * resp.slot_count();
  if (resp.slot_count() == 0 || end > resp.segment_bytes()) {
    segment.reset();
    return Internal("the daemon described slots that do not fit its segment");
  }
  slot_count = resp.slot_count();
  slot_offset = resp.slot_offset();
  slot_stride = resp.slot_stride();
  tensors.clear();
  for (const auto& p : resp.placements()) {
    if (p.slot_offset() + p.bytes() > resp.slot_stride()) {
      segment.reset();
      return Internal("the daemon placed tensor '" + p.name() + "' outside its slot");
    }
    tensors[p.name()] = MappedTensor{p.slot_offset(), p.bytes(), p.file().empty(), p.ema_source()};
  }
  ema_tensors.clear();
  for (const auto& p : resp.ema_placements()) {
    if (p.slot_offset() + p.bytes() > resp.slot_stride()) {
      segment.reset();
      return Internal("the daemon placed EMA tensor '" + p.name() + "' outside its slot");
    }
    ema_tensors[p.name()] = MappedTensor{p.slot_offset(), p.bytes(), false, false};
  }
  return Status::OK();
}

Status Client::Impl::Reattach() {
  // A short wait: while the daemon is down every save fails fast and training goes on.
  const auto wait = std::min<std::chrono::milliseconds>(options.rpc_timeout, std::chrono::milliseconds(250));
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
  if (broken) RETURN_IF_ERROR(Note(Reattach()));
  Status s = rpc();
  if (s.code() != StatusCode::kUnavailable) return s;
  broken = true;
  if (!Reattach().ok()) return s;
  return Note(rpc());
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
  if (!impl->channel->WaitForConnected(std::chrono::system_clock::now() + options.connect_timeout)) {
    return Unavailable("flashckptd is not reachable at " + options.socket_path + " (waited " +
                       std::to_string(options.connect_timeout.count()) + " ms)");
  }
  impl->stub = v1::Checkpoint::NewStub(impl->channel);
  RETURN_IF_ERROR(impl->OpenSession());
  unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  unsigned threads = options.copy_threads != 0 ? options.copy_threads : std::min(hw, 8u);
  impl->copier = std::make_unique<ParallelLoop>(threads - 1);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

void Client::Close() {
  if (!impl_ || impl_->closed) return;
  impl_->closed = true;
  if (impl_->session) {
    impl_->session->WritesDone();
    impl_->session_ctx->TryCancel();
    (void)impl_->session->Finish();
  }
  impl_->segment.reset();
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
  RETURN_IF_ERROR(impl_->WithSession([&] {
    req.set_session_id(impl_->session_id);
    req.set_resumed_from(impl_->resumed_from);
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx);
    return FromGrpc(impl_->stub->Register(&ctx, req, &resp), "Register");
  }));
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
  if (result.initialized) {
    for (const auto& b : buffers) tasks.push_back({b.data, base + impl_->ema_tensors[b.name].slot_offset, b.bytes});
    ParallelCopy(impl_->copier.get(), tasks);
  }
  RETURN_IF_ERROR(impl_->Note(impl_->ReleaseSlot(resp.slot(), resp.generation())));
  return result;
}

Result<SnapshotHandle> Client::Snapshot(int64_t step, const std::vector<TensorBuffer>& buffers,
                                        const SnapshotOptions& options) {
  RETURN_IF_ERROR(impl_->Usable());
  // An EMA-only snapshot needs only the tensors the EMA reads; the rest of the slot is not used.
  ASSIGN_OR_RETURN(auto matched, impl_->Match(buffers, options.persist ? Selection::kSaved : Selection::kEmaSources));

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
  ASSIGN_OR_RETURN(matched, impl_->Match(buffers, options.persist ? Selection::kSaved : Selection::kEmaSources));

  char* base = impl_->Slot(slot.slot());
  std::vector<CopyTask> tasks;
  tasks.reserve(matched.size());
  for (const auto& [buffer, mapped] : matched) tasks.push_back({base + mapped->slot_offset, buffer->data, buffer->bytes});
  ParallelCopy(impl_->copier.get(), tasks);

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
  v1::CommitResponse committed;
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx);
  // Not retried: the slot belongs to the session that began the snapshot.
  Status status = impl_->Note(FromGrpc(impl_->stub->Commit(&ctx, commit, &committed), "Commit"));
  if (!status.ok()) {
    // Give the slot back so a failed commit does not hold it until the session ends.
    v1::AbortSnapshotRequest abort;
    abort.set_session_id(impl_->session_id);
    abort.set_slot(slot.slot());
    abort.set_generation(slot.generation());
    v1::AbortSnapshotResponse aborted;
    grpc::ClientContext abort_ctx;
    impl_->Deadline(&abort_ctx);
    (void)impl_->stub->AbortSnapshot(&abort_ctx, abort, &aborted);
    return status;
  }
  SnapshotHandle handle;
  handle.step_ = step;
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
  const char* base = impl_->Slot(resp.slot());
  std::vector<CopyTask> tasks;
  for (const auto& [buffer, mapped] : matched) {
    tasks.push_back({buffer->data, base + mapped->slot_offset, buffer->bytes});
    result.bytes += buffer->bytes;
  }
  ParallelCopy(impl_->copier.get(), tasks);
  RETURN_IF_ERROR(impl_->Note(impl_->ReleaseSlot(resp.slot(), resp.generation())));
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

// The trainer client's session (client.h): Connect() and the session stream that tells the daemon
// this rank is alive, Register() and the mapping of the segment it names, and the re-attach after
// a daemon restart (a new session and the same registration) that every later call may do.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <future>
#include <string>
#include <thread>

#include "client/src/client_impl.h"
#include "client/src/wire.h"
#include "common/base/status.h"

namespace flashckpt {
namespace {

// A short wait: while the daemon is down every save fails fast and training goes on.
std::chrono::milliseconds ReattachWait(const ClientOptions& options) {
  return std::min<std::chrono::milliseconds>(options.rpc_timeout, std::chrono::milliseconds(250));
}

// Why a session stream ended before it opened. CANCELLED here is never this client's doing (its
// own cancel is the timeout, DEADLINE_EXCEEDED): a daemon whose server shuts down (a restart)
// cancels the streams it has; that is UNAVAILABLE, waited out like a daemon not yet listening.
Status SessionRefused(const grpc::Status& s) {
  if (s.error_code() == grpc::StatusCode::CANCELLED) {
    return Unavailable("Session: the daemon ended the stream while it shut down (" + s.error_message() + ")");
  }
  return FromGrpc(s, "Session");
}

// A segment the daemon named in its reply but that is gone when the client maps it: the daemon
// gave it back between the two, which only a stop does (it unlinks the segments no abandoned
// snapshot is left in). That is the daemon going away, UNAVAILABLE, so the caller re-attaches to
// the next daemon and registers again instead of failing the trainer.
// The run id the environment gives every rank of one attempt alike, for a client that names none,
// first found of: FLASHCKPT_RUN_ID; torchrun's TORCHELASTIC_RUN_ID (unless "none", its default) and
// restart count; Slurm's SLURM_JOB_ID and restart count; PMIx's PMIX_NAMESPACE (Open MPI 5, PRRTE:
// one per launch); Open MPI 4's job id (OMPI_MCA_orte_ess_jobid, OMPI_MCA_ess_base_jobid); a
// Kubernetes JobSet's JOBSET_NAME and JOBSET_RESTART_ATTEMPT (from the pod's labels through the
// downward API). Characters outside [A-Za-z0-9._:-] become '-'; cut to 64. Empty when none is set:
// the daemon picks (the run of the job's live ranks on it, or one agreed through the shared root).
std::string RunIdFromEnvironment() {
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v != nullptr ? v : "");
  };
  std::string id = env("FLASHCKPT_RUN_ID");
  if (id.empty() && !env("TORCHELASTIC_RUN_ID").empty() && env("TORCHELASTIC_RUN_ID") != "none") {
    const std::string restarts = env("TORCHELASTIC_RESTART_COUNT");
    id = "torchelastic-" + env("TORCHELASTIC_RUN_ID") + "." + (restarts.empty() ? "0" : restarts);
  }
  if (id.empty() && !env("SLURM_JOB_ID").empty()) {
    const std::string restarts = env("SLURM_RESTART_COUNT");
    id = "slurm-" + env("SLURM_JOB_ID") + "." + (restarts.empty() ? "0" : restarts);
  }
  if (id.empty() && !env("PMIX_NAMESPACE").empty()) id = "pmix-" + env("PMIX_NAMESPACE");
  for (const char* name : {"OMPI_MCA_orte_ess_jobid", "OMPI_MCA_ess_base_jobid"}) {
    if (id.empty() && !env(name).empty()) id = "ompi-" + env(name);
  }
  if (id.empty() && !env("JOBSET_NAME").empty()) {
    const std::string restarts = env("JOBSET_RESTART_ATTEMPT");
    id = "jobset-" + env("JOBSET_NAME") + "." + (restarts.empty() ? "0" : restarts);
  }
  for (char& c : id) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == '-' || c == ':';
    if (!ok) c = '-';
  }
  return id.substr(0, 64);
}

Status SegmentGone(Status mapped) {
  if (mapped.code() != StatusCode::kNotFound) return mapped;
  return Unavailable("the segment flashckptd named for this rank was gone when it was mapped (the daemon stopped "
                     "meanwhile, or it does not share this process's /dev/shm): " + mapped.message());
}

}  // namespace

Status Client::Impl::OpenSession(bool reattach) {
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
  hello.set_reattach(reattach);
  if (!stream->Write(hello)) return SessionRefused(stream->Finish());
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
  if (!reply.get()) return SessionRefused(stream->Finish());
  session_ctx = std::move(ctx);
  session = std::move(stream);
  session_id = event.session_id();
  return Status::OK();
}

Status Client::Impl::ApplyRegistration(const v1::RegisterResponse& resp) {
  if (!segment || segment->name() != resp.segment_name() || segment->size() != resp.segment_bytes()) {
    Unmap();
    ASSIGN_OR_RETURN(segment,
                     SharedSegment::Open(resp.segment_name(), resp.segment_bytes(), SharedSegment::Mapping::kLazy));
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
    TensorKind kind = TensorKind::kModel;
    if (p.kind() == v1::TENSOR_KIND_OPTIMIZER) kind = TensorKind::kOptimizer;
    if (p.kind() == v1::TENSOR_KIND_MASTER_WEIGHT) kind = TensorKind::kMasterWeight;
    tensors[p.name()] = MappedTensor{p.slot_offset(), p.bytes(), p.file().empty(), p.ema_source(), kind};
  }
  ema_tensors.clear();
  for (const auto& p : resp.ema_placements()) {
    if (p.slot_offset() + p.bytes() > resp.slot_stride()) {
      Unmap();
      return Internal("the daemon placed EMA tensor '" + p.name() + "' outside its slot");
    }
    ema_tensors[p.name()] = MappedTensor{p.slot_offset(), p.bytes(), false, false, TensorKind::kEma};
  }
  return Status::OK();
}


Status Client::Impl::Reattach(std::chrono::milliseconds wait) {
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + wait)) {
    return Unavailable("flashckptd is not reachable at " + options.socket_path + " (waited " +
                       std::to_string(wait.count()) + " ms to re-attach); the next call tries again");
  }
  RETURN_IF_ERROR(OpenSession(/*reattach=*/true));
  if (registration) {
    v1::RegisterRequest req = *registration;
    req.set_session_id(session_id);
    req.set_resumed_from(resumed_from);
    v1::RegisterResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    RETURN_IF_ERROR(FromGrpc(stub->Register(&ctx, req, &resp), "Register"));
    RETURN_IF_ERROR(SegmentGone(ApplyRegistration(resp)));
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
  if (impl->options.run_id.empty()) impl->options.run_id = RunIdFromEnvironment();
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
  v1::RegisterRequest req = RegisterRequestOf(topology, tensors, ema, impl_->options);
  v1::RegisterResponse resp;
  // A rank cannot train on without its registration: a daemon restart (or one that is killed while
  // it registers) is waited out for connect_timeout, as in Connect().
  RETURN_IF_ERROR(impl_->WithSessionPatiently(
      [&] {
        req.set_session_id(impl_->session_id);
        req.set_resumed_from(impl_->resumed_from);
        if (req.run_id().empty()) req.set_run_id(impl_->run_id);  // a later registration keeps the run
        grpc::ClientContext ctx;
        impl_->Deadline(&ctx);
        Status registered = FromGrpc(impl_->stub->Register(&ctx, req, &resp), "Register");
        if (!registered.ok()) return registered;
        return SegmentGone(impl_->ApplyRegistration(resp));
      },
      impl_->options.connect_timeout));
  req.clear_session_id();
  impl_->run_id = resp.run_id();
  req.set_run_id(impl_->run_id);  // a re-attach carries on the same run
  impl_->registration = std::move(req);
  return Status::OK();
}

Status Client::Populate() {
  RETURN_IF_ERROR(impl_->Usable());
  if (!impl_->segment) return FailedPrecondition("Populate() before Register(): the rank has no slots yet");
  impl_->PopulateInBackground();
  return Status::OK();
}

const std::string& Client::RunId() const { return impl_->run_id; }

}  // namespace flashckpt

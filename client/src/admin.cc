// The operator client (admin.h): one gRPC channel to the daemon's socket or TCP listener, a
// deadline on every unary call, and each failure told the way an operator can act on it.
#include "flashckpt/admin.h"

#include <grpcpp/grpcpp.h>

#include <utility>

#include "client/src/wire.h"
#include "common/base/names.h"
#include "common/base/status.h"
#include "common/io/fs.h"
#include "flashckpt.grpc.pb.h"
#include "health.grpc.pb.h"
#include "proto/convert.h"

namespace flashckpt {
namespace {

// "10 s", or "1500 ms" for a deadline that is not whole seconds.
std::string DeadlineText(std::chrono::milliseconds deadline) {
  if (deadline.count() % 1000 == 0) return std::to_string(deadline.count() / 1000) + " s";
  return std::to_string(deadline.count()) + " ms";
}

std::string Describe(const AdminOptions& options) {
  if (options.address.empty()) return options.socket_path;
  return options.address + (options.tls_ca_file.empty() ? " (plain TCP)" : " (TLS)");
}

HealthState HealthFromProto(grpc::health::v1::HealthCheckResponse::ServingStatus status) {
  switch (status) {
    case grpc::health::v1::HealthCheckResponse::SERVING: return HealthState::kServing;
    case grpc::health::v1::HealthCheckResponse::NOT_SERVING: return HealthState::kNotServing;
    case grpc::health::v1::HealthCheckResponse::SERVICE_UNKNOWN: return HealthState::kServiceUnknown;
    default: return HealthState::kUnknown;
  }
}

}  // namespace

std::string_view HealthStateName(HealthState state) {
  switch (state) {
    case HealthState::kUnknown: return "UNKNOWN";
    case HealthState::kServing: return "SERVING";
    case HealthState::kNotServing: return "NOT_SERVING";
    case HealthState::kServiceUnknown: return "SERVICE_UNKNOWN";
  }
  return "UNKNOWN";
}

// Immutable after Open(): the stubs are thread-safe, so the calls need no lock.
struct AdminClient::Impl {
  AdminOptions options;
  std::string endpoint;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Checkpoint::Stub> stub;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;

  static void SetDeadline(grpc::ClientContext* ctx, std::chrono::milliseconds deadline) {
    ctx->set_deadline(std::chrono::system_clock::now() + deadline);
  }

  // A failed call: an unreachable daemon first, then one that did not answer in time, else the
  // code and the daemon's reason. The code is mapped as for the trainer client (wire.h).
  flashckpt::Status Failed(const grpc::Status& s, const char* rpc, std::chrono::milliseconds deadline) const {
    std::string message;
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
      message = "daemon not reachable at " + endpoint + " (UNAVAILABLE: " + s.error_message() + ")";
    } else if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      message = std::string(rpc) + " got no answer from " + endpoint + " within " + DeadlineText(deadline) +
                " (DEADLINE_EXCEEDED)";
    } else {
      message = std::string(rpc) + " failed: " + GrpcCodeName(s.error_code()) + " (gRPC code " +
                std::to_string(static_cast<int>(s.error_code())) + "): " + s.error_message();
    }
    return flashckpt::Status(CodeFromGrpc(s), std::move(message));
  }

  Result<DeleteResult> Delete(const v1::DeleteCheckpointsRequest& req) const {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, options.delete_timeout);
    v1::DeleteCheckpointsResponse resp;
    grpc::Status s = stub->DeleteCheckpoints(&ctx, req, &resp);
    if (!s.ok()) return Failed(s, "DeleteCheckpoints", options.delete_timeout);
    return DeleteResultFromProto(resp);
  }
};

AdminClient::AdminClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

AdminClient::~AdminClient() = default;

Result<std::unique_ptr<AdminClient>> AdminClient::Open(const AdminOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->endpoint = Describe(options);
  if (options.address.empty()) {
    impl->channel = grpc::CreateChannel("unix:" + options.socket_path, grpc::InsecureChannelCredentials());
  } else {
    // The CA file is read here, not by gRPC, so that a missing file is reported as such rather
    // than as an unreachable daemon.
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
    if (!options.tls_ca_file.empty()) {
      auto ca = ReadSmallFile(options.tls_ca_file, 1u << 20);
      if (!ca.ok()) return ca.status().WithContext("TLS CA file (AdminOptions::tls_ca_file)");
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = std::move(ca).value();
      credentials = grpc::SslCredentials(ssl);
    }
    impl->channel = grpc::CreateChannel(options.address, credentials);
  }
  impl->stub = v1::Checkpoint::NewStub(impl->channel);
  impl->health = grpc::health::v1::Health::NewStub(impl->channel);
  return std::unique_ptr<AdminClient>(new AdminClient(std::move(impl)));
}

const std::string& AdminClient::endpoint() const { return impl_->endpoint; }

Result<DaemonStatus> AdminClient::Status() {
  grpc::ClientContext ctx;
  Impl::SetDeadline(&ctx, impl_->options.rpc_timeout);
  v1::StatusResponse resp;
  grpc::Status s = impl_->stub->GetStatus(&ctx, v1::StatusRequest{}, &resp);
  if (!s.ok()) return impl_->Failed(s, "GetStatus", impl_->options.rpc_timeout);
  return DaemonStatusFromProto(resp);
}

Result<std::vector<CheckpointInfo>> AdminClient::List(const std::string& job) {
  grpc::ClientContext ctx;
  Impl::SetDeadline(&ctx, impl_->options.rpc_timeout);
  v1::ListCheckpointsRequest req;
  req.set_job(job);
  v1::ListCheckpointsResponse resp;
  grpc::Status s = impl_->stub->ListCheckpoints(&ctx, req, &resp);
  if (!s.ok()) return impl_->Failed(s, "ListCheckpoints", impl_->options.rpc_timeout);
  return CheckpointsFromProto(resp);
}

flashckpt::Status AdminClient::Watch(const WatchOptions& options,
                                     const std::function<bool(const DaemonEvent&)>& on_event) {
  grpc::ClientContext ctx;
  const bool limited = options.duration.count() > 0;
  if (limited) Impl::SetDeadline(&ctx, options.duration);
  v1::WatchEventsRequest req;
  req.set_job(options.job);
  auto reader = impl_->stub->WatchEvents(&ctx, req);
  // The daemon sends its initial metadata once the watcher is subscribed: every event from here on
  // is seen. A call that failed returns here too, and Finish below reports it.
  reader->WaitForInitialMetadata();
  const auto& initial = ctx.GetServerInitialMetadata();
  const bool subscribed = initial.find(kWatchSubscribedKey) != initial.end();
  if (options.on_subscribed) options.on_subscribed(subscribed);
  v1::Event event;
  uint64_t seen = 0;
  bool stopped = false;  // by the handler or max_events
  while (reader->Read(&event)) {
    ++seen;
    const bool more = on_event(EventFromProto(event));
    if (!more || (options.max_events > 0 && seen >= options.max_events)) {
      stopped = true;
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status s = reader->Finish();
  if (s.ok() || stopped) return flashckpt::Status::OK();
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && limited) return flashckpt::Status::OK();
  if (subscribed && s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    // The stream was up: the daemon stopped (or was killed), it was not a wrong address.
    return Unavailable("the daemon at " + impl_->endpoint + " stopped (UNAVAILABLE: " + s.error_message() + ")");
  }
  return impl_->Failed(s, "WatchEvents", impl_->options.rpc_timeout);
}

Result<DeleteResult> AdminClient::Delete(const std::string& job, int64_t step, bool force, bool dry_run) {
  v1::DeleteCheckpointsRequest req;
  req.set_job(job);
  req.set_step(step);
  req.set_force(force);
  req.set_dry_run(dry_run);
  return impl_->Delete(req);
}

Result<DeleteResult> AdminClient::Gc(const std::string& job, uint32_t keep, bool dry_run) {
  v1::DeleteCheckpointsRequest req;
  req.set_job(job);
  req.set_keep(keep);
  req.set_dry_run(dry_run);
  return impl_->Delete(req);
}

Result<ReleaseResult> AdminClient::Release(const std::string& job, bool force) {
  grpc::ClientContext ctx;
  Impl::SetDeadline(&ctx, impl_->options.delete_timeout);
  v1::ReleaseJobRequest req;
  req.set_job(job);
  req.set_force(force);
  v1::ReleaseJobResponse resp;
  grpc::Status s = impl_->stub->ReleaseJob(&ctx, req, &resp);
  if (!s.ok()) return impl_->Failed(s, "ReleaseJob", impl_->options.delete_timeout);
  ReleaseResult out;
  out.ranks = resp.ranks();
  out.bytes = resp.bytes();
  out.disk_step = resp.disk_step();
  out.written_step = resp.written_step();
  out.dropped_steps.assign(resp.dropped_steps().begin(), resp.dropped_steps().end());
  return out;
}

Result<HealthState> AdminClient::Health() {
  grpc::ClientContext ctx;
  Impl::SetDeadline(&ctx, impl_->options.rpc_timeout);
  grpc::health::v1::HealthCheckRequest req;  // service "": the daemon as a whole
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = impl_->health->Check(&ctx, req, &resp);
  if (!s.ok()) return impl_->Failed(s, "Health.Check", impl_->options.rpc_timeout);
  return HealthFromProto(resp.status());
}

}  // namespace flashckpt

#include "daemon/edge/service.h"

#include <algorithm>

#include "common/base/dtype.h"
#include "common/base/log.h"
#include "common/base/names.h"
#include "common/io/fs.h"
#include "daemon/edge/limits.h"
#include "daemon/edge/registration.h"
#include "daemon/edge/wire.h"

// Returns the gRPC form of `expr`'s Status from a handler when it is not ok.
#define RETURN_GRPC_IF_ERROR(expr)                             \
  do {                                                         \
    ::flashckpt::Status _fc_grpc_status = (expr);              \
    if (!_fc_grpc_status.ok()) return ToGrpc(_fc_grpc_status); \
  } while (0)

namespace flashckpt {
namespace {

// Request timeouts may not outlive the client's own deadline.
std::chrono::milliseconds Bounded(grpc::ServerContext* ctx, std::chrono::milliseconds wanted) {
  auto remaining =
      std::chrono::duration_cast<std::chrono::milliseconds>(ctx->deadline() - std::chrono::system_clock::now());
  if (remaining.count() < 0) remaining = std::chrono::milliseconds(0);
  return std::min(wanted, remaining);
}

}  // namespace

grpc::Status CheckpointService::Session(grpc::ServerContext* ctx,
                                        grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream) {
  v1::SessionRequest hello;
  if (!stream->Read(&hello)) return grpc::Status(grpc::StatusCode::CANCELLED, "session closed before its request");
  auto id = daemon_->OpenSession(hello.job(), hello.rank(), hello.reattach());
  if (!id.ok()) return ToGrpc(id.status());
  v1::SessionEvent event;
  event.set_session_id(*id);
  if (stream->Write(event)) {
    v1::SessionRequest ignored;
    while (stream->Read(&ignored)) {
    }  // returns false when the trainer closes the stream or its process dies
  }
  daemon_->CloseSession(*id);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Register(grpc::ServerContext*, const v1::RegisterRequest* req,
                                         v1::RegisterResponse* resp) {
  RETURN_GRPC_IF_ERROR(CheckSessionId(req->session_id()));
  // Before the specs are converted: a huge list is refused without being walked.
  RETURN_GRPC_IF_ERROR(
      CheckTensorCount(static_cast<uint64_t>(req->tensors_size()), daemon_->config().max_tensors_per_rank));
  if (!v1::BackpressurePolicy_IsValid(req->backpressure())) {
    return ToGrpc(InvalidArgument("backpressure " + std::to_string(req->backpressure()) +
                                  " is not BACKPRESSURE_WAIT (0) or BACKPRESSURE_SKIP (1)"));
  }
  auto registration = ParseRegistration(*req);
  if (!registration.ok()) return ToGrpc(registration.status());
  auto result = daemon_->Register(req->session_id(), *registration);
  if (!result.ok()) return ToGrpc(result.status());
  *resp = ToProto(*result);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::BeginSnapshot(grpc::ServerContext* ctx, const v1::BeginSnapshotRequest* req,
                                              v1::BeginSnapshotResponse* resp) {
  RETURN_GRPC_IF_ERROR(CheckSessionId(req->session_id()));
  RETURN_GRPC_IF_ERROR(CheckStep(req->step()));
  auto timeout = RequestTimeout(req->timeout_ms(), 60000);
  if (!timeout.ok()) return ToGrpc(timeout.status());
  if (!v1::Tier_IsValid(req->tier()) || req->tier() == v1::TIER_PEER || req->tier() == v1::TIER_PARITY) {
    return ToGrpc(InvalidArgument("tier " + std::to_string(req->tier()) + " is not TIER_DISK (0) or TIER_MEMORY (1)"));
  }
  auto ticket = daemon_->BeginSnapshot(req->session_id(), req->step(), Bounded(ctx, *timeout),
                                       req->tier() == v1::TIER_MEMORY ? SlotTier::kMemory : SlotTier::kDisk);
  if (!ticket.ok()) return ToGrpc(ticket.status());
  resp->set_slot(ticket->slot);
  resp->set_generation(ticket->generation);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Commit(grpc::ServerContext*, const v1::CommitRequest* req, v1::CommitResponse*) {
  RETURN_GRPC_IF_ERROR(CheckSessionId(req->session_id()));
  RETURN_GRPC_IF_ERROR(CheckStep(req->step()));
  // A NaN or infinite loss is accepted: the snapshot is still the trainer's state. With an EMA loss
  // threshold it skips the EMA update (RankEma::Apply).
  std::optional<double> loss;
  if (req->has_loss()) loss = req->loss();
  return ToGrpc(daemon_->Commit(req->session_id(), SlotTicket{req->slot(), req->generation()}, req->step(),
                                req->persist(), loss, req->extra()));
}

grpc::Status CheckpointService::AbortSnapshot(grpc::ServerContext*, const v1::AbortSnapshotRequest* req,
                                              v1::AbortSnapshotResponse*) {
  RETURN_GRPC_IF_ERROR(CheckSessionId(req->session_id()));
  return ToGrpc(daemon_->AbortSnapshot(req->session_id(), SlotTicket{req->slot(), req->generation()}));
}

grpc::Status CheckpointService::WaitPersisted(grpc::ServerContext* ctx, const v1::WaitPersistedRequest* req,
                                              v1::WaitPersistedResponse* resp) {
  RETURN_GRPC_IF_ERROR(CheckSessionId(req->session_id()));
  RETURN_GRPC_IF_ERROR(CheckStep(req->step()));
  auto timeout = RequestTimeout(req->timeout_ms(), 60000);
  if (!timeout.ok()) return ToGrpc(timeout.status());
  auto r = daemon_->WaitPersisted(req->session_id(), req->step(), Bounded(ctx, *timeout));
  if (!r.ok()) return ToGrpc(r.status());
  resp->set_persisted_step(r->persisted_step);
  resp->set_checkpoint_complete(r->checkpoint_complete);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::WaitComplete(grpc::ServerContext* ctx, const v1::WaitCompleteRequest* req,
                                             v1::WaitCompleteResponse*) {
  RETURN_GRPC_IF_ERROR(CheckSessionId(req->session_id()));
  RETURN_GRPC_IF_ERROR(CheckStep(req->step()));
  auto timeout = RequestTimeout(req->timeout_ms(), 60000);
  if (!timeout.ok()) return ToGrpc(timeout.status());
  return ToGrpc(daemon_->WaitComplete(req->session_id(), req->step(), Bounded(ctx, *timeout)));
}

grpc::Status CheckpointService::Restore(grpc::ServerContext* ctx, const v1::RestoreRequest* req,
                                        v1::RestoreResponse* resp) {
  RETURN_GRPC_IF_ERROR(CheckSessionId(req->session_id()));
  RETURN_GRPC_IF_ERROR(CheckStep(req->step()));  // 0: the latest
  auto timeout = RequestTimeout(req->timeout_ms(), 600000);
  if (!timeout.ok()) return ToGrpc(timeout.status());
  RestoreWant want;
  want.convert_dtype = req->convert_dtype();
  for (int k : req->kinds()) {
    switch (k) {
      case v1::TENSOR_KIND_MODEL: want.kinds.push_back(TensorKind::kModel); break;
      case v1::TENSOR_KIND_OPTIMIZER: want.kinds.push_back(TensorKind::kOptimizer); break;
      case v1::TENSOR_KIND_MASTER_WEIGHT: want.kinds.push_back(TensorKind::kMasterWeight); break;
      default:
        return ToGrpc(InvalidArgument("restore kind " + std::to_string(k) +
                                      " is not TENSOR_KIND_MODEL, _OPTIMIZER or _MASTER_WEIGHT"));
    }
  }
  if (!req->source_job().empty()) {
    if (Status bad = ValidateJobName(req->source_job()); !bad.ok()) {
      return ToGrpc(bad.WithContext("restore source_job"));
    }
    if (want.kinds.empty()) return ToGrpc(InvalidArgument("a restore from another job (source_job) must name its kinds"));
  }
  want.source_job = req->source_job();
  want.verify_in_client = req->verify_in_client();
  auto r = daemon_->Restore(req->session_id(), req->step(), want, Bounded(ctx, *timeout));
  if (!r.ok()) return ToGrpc(r.status());
  resp->set_found(r->found);
  resp->set_step(r->step);
  resp->set_slot(r->ticket.slot);
  resp->set_generation(r->ticket.generation);
  resp->set_extra(r->extra);
  resp->set_bytes_read(r->bytes_read);
  resp->set_tier(r->tier == SlotTier::kDisk      ? v1::TIER_DISK
                 : r->from_parity       ? v1::TIER_PARITY
                 : r->from_peer.empty() ? v1::TIER_MEMORY
                                        : v1::TIER_PEER);
  resp->set_chunk_bytes(r->chunk_bytes);
  for (const RestoreOutcome::TensorSums& t : r->tensor_sums) {
    v1::TensorChunkSums* sums = resp->add_chunk_sums();
    sums->set_slot_offset(t.slot_offset);
    sums->set_bytes(t.bytes);
    sums->mutable_sums()->Add(t.sums.begin(), t.sums.end());
  }
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Restorable(grpc::ServerContext* ctx, const v1::RestorableRequest* req,
                                           v1::RestorableResponse* resp) {
  RETURN_GRPC_IF_ERROR(CheckSessionId(req->session_id()));
  auto timeout = RequestTimeout(req->timeout_ms(), 60000);
  if (!timeout.ok()) return ToGrpc(timeout.status());
  if (req->extra_of() < 0) return ToGrpc(InvalidArgument("Restorable extra_of must be a step (> 0) or 0"));
  auto r = req->disk_extra()
               ? daemon_->DiskExtra(req->session_id(), req->extra_of())
               : daemon_->Restorable(req->session_id(), Bounded(ctx, *timeout), req->extra_of(), !req->unverified());
  if (!r.ok()) return ToGrpc(r.status());
  for (int64_t step : r->memory_steps) resp->add_memory_steps(step);
  resp->set_disk_step(r->disk_step);
  resp->set_extra(r->extra);
  resp->set_disk_extra(req->disk_extra());
  return grpc::Status::OK;
}

grpc::Status CheckpointService::GetEma(grpc::ServerContext* ctx, const v1::GetEmaRequest* req,
                                       v1::GetEmaResponse* resp) {
  RETURN_GRPC_IF_ERROR(CheckSessionId(req->session_id()));
  auto timeout = RequestTimeout(req->timeout_ms(), 60000);
  if (!timeout.ok()) return ToGrpc(timeout.status());
  auto r = daemon_->GetEma(req->session_id(), Bounded(ctx, *timeout));
  if (!r.ok()) return ToGrpc(r.status());
  resp->set_initialized(r->initialized);
  resp->set_step(r->step);
  resp->set_slot(r->ticket.slot);
  resp->set_generation(r->ticket.generation);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::ReleaseSlot(grpc::ServerContext*, const v1::ReleaseSlotRequest* req,
                                            v1::ReleaseSlotResponse*) {
  RETURN_GRPC_IF_ERROR(CheckSessionId(req->session_id()));
  // A client's report goes into the daemon's log and events: its first 1024 bytes, anything but
  // printable ASCII (and the quote and backslash that delimit logged values) made '?'. The slot is
  // released either way.
  std::string corrupt = req->corrupt().substr(0, 1024);
  std::replace_if(
      corrupt.begin(), corrupt.end(), [](char c) { return c < 0x20 || c > 0x7e || c == '"' || c == '\\'; }, '?');
  return ToGrpc(daemon_->ReleaseSlot(req->session_id(), SlotTicket{req->slot(), req->generation()}, corrupt));
}

grpc::Status CheckpointService::ListCheckpoints(grpc::ServerContext*, const v1::ListCheckpointsRequest* req,
                                                v1::ListCheckpointsResponse* resp) {
  auto list = daemon_->List(req->job());
  if (!list.ok()) return ToGrpc(list.status());
  for (const auto& e : *list) {
    auto* c = resp->add_checkpoints();
    c->set_job(e.job);
    c->set_step(e.step);
    c->set_complete(e.complete);
    c->set_signals(e.signals);
    c->set_world_size(e.world_size);
    c->set_bytes(e.bytes);
    c->set_path(e.path);
    c->set_latest(e.latest);
    for (const SignalledRank& r : e.signalled) {
      auto* out = c->add_signalled();
      out->set_rank(r.rank);
      out->set_node(r.node);
      out->set_run_id(r.run_id);
      out->set_resumed_from(r.resumed_from);
    }
  }
  return grpc::Status::OK;
}

grpc::Status CheckpointService::GetStatus(grpc::ServerContext*, const v1::StatusRequest*, v1::StatusResponse* resp) {
  DaemonStatus status = daemon_->GetStatus();
  if (replicas_ != nullptr) {
    status.replica_listening = true;
    status.replicas_held = static_cast<uint32_t>(replicas_->count());
    status.replica_held_bytes = replicas_->held_bytes();
  }
  if (parity_ != nullptr) {
    status.parity_shares_held = static_cast<uint32_t>(parity_->complete_count());
    status.parity_held_bytes = parity_->held_bytes();
    status.parity_step = parity_->oldest_complete_step();
  }
  *resp = ToProto(status);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::WatchEvents(grpc::ServerContext* ctx, const v1::WatchEventsRequest* req,
                                            grpc::ServerWriter<v1::Event>* writer) {
  if (!req->job().empty()) RETURN_GRPC_IF_ERROR(ValidateJobName(req->job()));
  auto subscription = daemon_->events().Subscribe(req->job());
  if (!subscription.ok()) return ToGrpc(subscription.status());
  ctx->AddInitialMetadata(kWatchSubscribedKey, "1");
  writer->SendInitialMetadata();
  DaemonEvent event;
  while (!ctx->IsCancelled()) {
    // A bounded wait, so that a caller that went away is noticed without an event to send.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    switch (subscription->Next(&event, deadline)) {
      case EventHub::Wait::kClosed: return ToGrpc(Unavailable("the daemon is stopping"));
      case EventHub::Wait::kTimeout: break;
      case EventHub::Wait::kEvent:
        if (!writer->Write(ToProto(event))) return grpc::Status::OK;  // the caller is gone
        break;
    }
  }
  return grpc::Status::OK;
}

grpc::Status CheckpointService::DeleteCheckpoints(grpc::ServerContext*, const v1::DeleteCheckpointsRequest* req,
                                                  v1::DeleteCheckpointsResponse* resp) {
  RETURN_GRPC_IF_ERROR(ValidateJobName(req->job()));
  RETURN_GRPC_IF_ERROR(CheckStep(req->step()));  // 0: gc (keep)
  auto outcome = daemon_->DeleteCheckpoints(req->job(), req->step(), req->keep(), req->force(), req->dry_run());
  if (!outcome.ok()) return ToGrpc(outcome.status());
  for (int64_t step : outcome->deleted) resp->add_deleted(step);
  for (const auto& s : outcome->skipped) {
    auto* k = resp->add_skipped();
    k->set_step(s.step);
    k->set_reason(s.reason);
  }
  resp->set_latest(outcome->latest ? *outcome->latest : -1);
  Logger("rpc")->info("delete checkpoints job={} step={} keep={} force={} dry_run={} deleted={} skipped={}", req->job(),
                      req->step(), req->keep(), req->force(), req->dry_run(), outcome->deleted.size(),
                      outcome->skipped.size());
  return grpc::Status::OK;
}

grpc::Status CheckpointService::ReleaseJob(grpc::ServerContext*, const v1::ReleaseJobRequest* req,
                                           v1::ReleaseJobResponse* resp) {
  RETURN_GRPC_IF_ERROR(ValidateJobName(req->job()));
  auto outcome = daemon_->ReleaseJob(req->job(), "release", req->force());
  if (!outcome.ok()) return ToGrpc(outcome.status());
  resp->set_ranks(outcome->ranks);
  resp->set_bytes(outcome->bytes);
  resp->set_disk_step(outcome->disk_step);
  resp->set_written_step(outcome->written_step);
  for (int64_t step : outcome->dropped_steps) resp->add_dropped_steps(step);
  return grpc::Status::OK;
}

}  // namespace flashckpt

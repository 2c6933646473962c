#include "daemon/edge/tcp_service.h"

#include <string>

#include "common/base/log.h"

namespace flashckpt {

grpc::Status TcpCheckpointService::Denied(grpc::ServerContext* ctx, const char* rpc) {
  denied_ += 1;
  Logger("rpc")->warn("refused tcp call rpc={} peer={} (read-only listener; --tcp-allow-writes)", rpc, ctx->peer());
  return grpc::Status(
      grpc::StatusCode::PERMISSION_DENIED,
      std::string(rpc) +
          " is not served over TCP: the --listen listener serves only GetStatus, ListCheckpoints and WatchEvents "
          "unless flashckptd runs with --tcp-allow-writes; trainers use the UNIX socket (--socket)");
}

grpc::Status TcpCheckpointService::ListCheckpoints(grpc::ServerContext* ctx, const v1::ListCheckpointsRequest* req,
                                                   v1::ListCheckpointsResponse* resp) {
  return local_->ListCheckpoints(ctx, req, resp);
}

grpc::Status TcpCheckpointService::WatchEvents(grpc::ServerContext* ctx, const v1::WatchEventsRequest* req,
                                               grpc::ServerWriter<v1::Event>* writer) {
  return local_->WatchEvents(ctx, req, writer);
}

grpc::Status TcpCheckpointService::GetStatus(grpc::ServerContext* ctx, const v1::StatusRequest* req,
                                             v1::StatusResponse* resp) {
  return local_->GetStatus(ctx, req, resp);
}

grpc::Status TcpCheckpointService::Session(grpc::ServerContext* ctx,
                                           grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream) {
  if (!allow_writes_) return Denied(ctx, "Session");
  return local_->Session(ctx, stream);
}

grpc::Status TcpCheckpointService::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                                            v1::RegisterResponse* resp) {
  if (!allow_writes_) return Denied(ctx, "Register");
  return local_->Register(ctx, req, resp);
}

grpc::Status TcpCheckpointService::BeginSnapshot(grpc::ServerContext* ctx, const v1::BeginSnapshotRequest* req,
                                                 v1::BeginSnapshotResponse* resp) {
  if (!allow_writes_) return Denied(ctx, "BeginSnapshot");
  return local_->BeginSnapshot(ctx, req, resp);
}

grpc::Status TcpCheckpointService::Commit(grpc::ServerContext* ctx, const v1::CommitRequest* req,
                                          v1::CommitResponse* resp) {
  if (!allow_writes_) return Denied(ctx, "Commit");
  return local_->Commit(ctx, req, resp);
}

grpc::Status TcpCheckpointService::AbortSnapshot(grpc::ServerContext* ctx, const v1::AbortSnapshotRequest* req,
                                                 v1::AbortSnapshotResponse* resp) {
  if (!allow_writes_) return Denied(ctx, "AbortSnapshot");
  return local_->AbortSnapshot(ctx, req, resp);
}

grpc::Status TcpCheckpointService::WaitPersisted(grpc::ServerContext* ctx, const v1::WaitPersistedRequest* req,
                                                 v1::WaitPersistedResponse* resp) {
  if (!allow_writes_) return Denied(ctx, "WaitPersisted");
  return local_->WaitPersisted(ctx, req, resp);
}

grpc::Status TcpCheckpointService::WaitComplete(grpc::ServerContext* ctx, const v1::WaitCompleteRequest* req,
                                                v1::WaitCompleteResponse* resp) {
  if (!allow_writes_) return Denied(ctx, "WaitComplete");
  return local_->WaitComplete(ctx, req, resp);
}

grpc::Status TcpCheckpointService::Restore(grpc::ServerContext* ctx, const v1::RestoreRequest* req,
                                           v1::RestoreResponse* resp) {
  if (!allow_writes_) return Denied(ctx, "Restore");
  return local_->Restore(ctx, req, resp);
}

grpc::Status TcpCheckpointService::Restorable(grpc::ServerContext* ctx, const v1::RestorableRequest* req,
                                              v1::RestorableResponse* resp) {
  // It verifies memory checkpoints, and drops those that fail: a session's business, as Restore is.
  if (!allow_writes_) return Denied(ctx, "Restorable");
  return local_->Restorable(ctx, req, resp);
}

grpc::Status TcpCheckpointService::GetEma(grpc::ServerContext* ctx, const v1::GetEmaRequest* req,
                                          v1::GetEmaResponse* resp) {
  if (!allow_writes_) return Denied(ctx, "GetEma");
  return local_->GetEma(ctx, req, resp);
}

grpc::Status TcpCheckpointService::ReleaseSlot(grpc::ServerContext* ctx, const v1::ReleaseSlotRequest* req,
                                               v1::ReleaseSlotResponse* resp) {
  if (!allow_writes_) return Denied(ctx, "ReleaseSlot");
  return local_->ReleaseSlot(ctx, req, resp);
}

grpc::Status TcpCheckpointService::DeleteCheckpoints(grpc::ServerContext* ctx, const v1::DeleteCheckpointsRequest* req,
                                                     v1::DeleteCheckpointsResponse* resp) {
  if (!allow_writes_) return Denied(ctx, "DeleteCheckpoints");
  return local_->DeleteCheckpoints(ctx, req, resp);
}

grpc::Status TcpCheckpointService::ReleaseJob(grpc::ServerContext* ctx, const v1::ReleaseJobRequest* req,
                                              v1::ReleaseJobResponse* resp) {
  if (!allow_writes_) return Denied(ctx, "ReleaseJob");
  return local_->ReleaseJob(ctx, req, resp);
}

}  // namespace flashckpt

// The gRPC edge of the daemon: translates flashckpt.v1 messages to Daemon calls and Status codes
// to gRPC codes. Nothing else in the daemon knows about gRPC.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "daemon/core/daemon.h"
#include "daemon/parity/parity_store.h"
#include "daemon/replica/replica_store.h"
#include "proto/convert.h"
#include "flashckpt.grpc.pb.h"

namespace flashckpt {

class CheckpointService final : public v1::Checkpoint::Service {
 public:
  explicit CheckpointService(Daemon* daemon) : daemon_(daemon) {}
  // With --replica-listen: the replicas held for peers, which GetStatus reports (set before serving).
  void set_replica_store(const ReplicaStore* store) { replicas_ = store; }
  void set_parity_store(const ParityStore* store) { parity_ = store; }

  grpc::Status Session(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream) override;
  grpc::Status Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req, v1::RegisterResponse* resp) override;
  grpc::Status BeginSnapshot(grpc::ServerContext* ctx, const v1::BeginSnapshotRequest* req,
                             v1::BeginSnapshotResponse* resp) override;
  grpc::Status Commit(grpc::ServerContext* ctx, const v1::CommitRequest* req, v1::CommitResponse* resp) override;
  grpc::Status AbortSnapshot(grpc::ServerContext* ctx, const v1::AbortSnapshotRequest* req,
                             v1::AbortSnapshotResponse* resp) override;
  grpc::Status WaitPersisted(grpc::ServerContext* ctx, const v1::WaitPersistedRequest* req,
                             v1::WaitPersistedResponse* resp) override;
  grpc::Status WaitComplete(grpc::ServerContext* ctx, const v1::WaitCompleteRequest* req,
                            v1::WaitCompleteResponse* resp) override;
  grpc::Status Restore(grpc::ServerContext* ctx, const v1::RestoreRequest* req, v1::RestoreResponse* resp) override;
  grpc::Status Restorable(grpc::ServerContext* ctx, const v1::RestorableRequest* req,
                          v1::RestorableResponse* resp) override;
  grpc::Status GetEma(grpc::ServerContext* ctx, const v1::GetEmaRequest* req, v1::GetEmaResponse* resp) override;
  grpc::Status ReleaseSlot(grpc::ServerContext* ctx, const v1::ReleaseSlotRequest* req,
                           v1::ReleaseSlotResponse* resp) override;
  grpc::Status ListCheckpoints(grpc::ServerContext* ctx, const v1::ListCheckpointsRequest* req,
                               v1::ListCheckpointsResponse* resp) override;
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::StatusRequest* req, v1::StatusResponse* resp) override;
  // Sends the initial metadata once subscribed (a caller that waits for it misses nothing after),
  // then every event until the caller cancels (OK) or the daemon stops (UNAVAILABLE).
  grpc::Status WatchEvents(grpc::ServerContext* ctx, const v1::WatchEventsRequest* req,
                           grpc::ServerWriter<v1::Event>* writer) override;
  grpc::Status DeleteCheckpoints(grpc::ServerContext* ctx, const v1::DeleteCheckpointsRequest* req,
                                 v1::DeleteCheckpointsResponse* resp) override;
  grpc::Status ReleaseJob(grpc::ServerContext* ctx, const v1::ReleaseJobRequest* req,
                          v1::ReleaseJobResponse* resp) override;

 private:
  Daemon* daemon_;
  const ReplicaStore* replicas_ = nullptr;
  const ParityStore* parity_ = nullptr;
};

}  // namespace flashckpt

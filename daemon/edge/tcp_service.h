// What a call that came in over the TCP listener (--listen) may do: GetStatus, ListCheckpoints and WatchEvents
// are forwarded to the daemon's CheckpointService; every other RPC is refused with
// PERMISSION_DENIED, naming --tcp-allow-writes, unless the daemon runs with that flag.
//
// Why a service object of its own, registered on a grpc::Server of its own (daemon/edge/tcp_listener.h),
// instead of one service that asks each call where it came from: a TCP connection can then only
// ever reach this class, whatever gRPC reports about the connection. ServerContext::peer() is a
// string gRPC formats per transport ("ipv4:...", "ipv6:...", "unix:..."), and the UNIX socket's
// connections, which the daemon accepts itself and hands to gRPC as fds
// (AddInsecureChannelFromFd), get whatever peer string gRPC chooses for such fds: a policy keyed on
// a prefix would rest on a formatting detail and fail open when it changes. The split also fails
// closed for RPCs added to the proto later: until someone forwards one here, the generated base
// class answers it UNIMPLEMENTED on TCP.
//
// Thread-safe: gRPC handler threads call in concurrently; the wrapped service is stateless.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>

#include "daemon/edge/service.h"

namespace flashckpt {

class TcpCheckpointService final : public v1::Checkpoint::Service {
 public:
  // `local` must outlive this object. It is called directly, not registered here (a gRPC service
  // object can be registered with one server only).
  TcpCheckpointService(CheckpointService* local, bool allow_writes) : local_(local), allow_writes_(allow_writes) {}

  // Read-only: always served.
  grpc::Status ListCheckpoints(grpc::ServerContext* ctx, const v1::ListCheckpointsRequest* req,
                               v1::ListCheckpointsResponse* resp) override;
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::StatusRequest* req, v1::StatusResponse* resp) override;
  grpc::Status WatchEvents(grpc::ServerContext* ctx, const v1::WatchEventsRequest* req,
                           grpc::ServerWriter<v1::Event>* writer) override;

  // Everything else changes the daemon's state: only with --tcp-allow-writes.
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
  grpc::Status DeleteCheckpoints(grpc::ServerContext* ctx, const v1::DeleteCheckpointsRequest* req,
                                 v1::DeleteCheckpointsResponse* resp) override;
  grpc::Status ReleaseJob(grpc::ServerContext* ctx, const v1::ReleaseJobRequest* req,
                          v1::ReleaseJobResponse* resp) override;

  // Calls refused for want of --tcp-allow-writes since the start.
  uint64_t denied_calls() const { return denied_.load(); }

 private:
  grpc::Status Denied(grpc::ServerContext* ctx, const char* rpc);

  CheckpointService* const local_;
  const bool allow_writes_;
  std::atomic<uint64_t> denied_{0};
};

}  // namespace flashckpt

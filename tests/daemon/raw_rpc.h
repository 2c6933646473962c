// Raw gRPC for tests that must reach the daemon's own checks: the generated stub, not the client
// library, whose checks would refuse many malformed requests before they are sent.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "flashckpt.grpc.pb.h"

namespace flashckpt {

// Every unary call of these tests answers within this (the daemon waits no longer than asked).
inline void RawDeadline(grpc::ClientContext* ctx, std::chrono::seconds s = std::chrono::seconds(10)) {
  ctx->set_deadline(std::chrono::system_clock::now() + s);
}

// A Session stream opened by hand. id() is empty when the daemon refused it; status() then says
// why. The stream ends (as if the trainer died) when the object is destroyed.
class RawSession {
 public:
  RawSession(v1::Checkpoint::Stub* stub, const std::string& job, uint32_t rank) {
    stream_ = stub->Session(&ctx_);
    v1::SessionRequest hello;
    hello.set_job(job);
    hello.set_rank(rank);
    stream_->Write(hello);
    v1::SessionEvent ev;
    if (stream_->Read(&ev)) {
      id_ = ev.session_id();
    } else {
      status_ = stream_->Finish();
      finished_ = true;
    }
  }
  ~RawSession() {
    if (finished_) return;
    ctx_.TryCancel();
    (void)stream_->Finish();
  }
  RawSession(const RawSession&) = delete;
  RawSession& operator=(const RawSession&) = delete;

  const std::string& id() const { return id_; }
  const grpc::Status& status() const { return status_; }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionEvent>> stream_;
  std::string id_;
  grpc::Status status_;
  bool finished_ = false;
};

// One F32 model tensor "w" of 16 elements, world size 1.
inline v1::RegisterRequest SmallRegistration(const std::string& session) {
  v1::RegisterRequest req;
  req.set_session_id(session);
  auto* t = req.mutable_topology();
  t->set_world_size(1);
  t->set_tp_degree(1);
  t->set_pp_degree(1);
  t->set_shard_degree(1);
  auto* p = req.add_tensors();
  p->set_name("w");
  p->set_kind(v1::TENSOR_KIND_MODEL);
  p->set_dtype("F32");
  p->add_shape(16);
  return req;
}

}  // namespace flashckpt

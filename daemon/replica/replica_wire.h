// The bulk path of flashckpt.v1.Replica: ReplicaPart messages sent and received as gRPC byte
// buffers, so that a part's data goes from the sender's memory to the socket, and from the received
// slices to the replica's memory, without passing through a protobuf message on either side.
//
// On the wire nothing changes: a data part is the protobuf encoding of ReplicaPart {data = 2,
// xxh3 = 3}. DataPartBuffer writes it as three slices (the data field's tag and length, the data in
// place, the checksum field); ParseReplicaPart reads one without copying the data out of the
// received slices. A buffer in any other encoding (a header, fields in another order or repeated,
// unknown fields) is parsed by protobuf itself, so a peer that encodes with protobuf is read alike.
//
// The generated stub and service take messages only, so the calls that carry these buffers are
// bound by hand (OpenRawPush here, ReplicaService's constructor), with grpc::internal as the
// generated code binds them.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "common/base/mutex.h"
#include "common/base/status.h"
#include "daemon/replica/replica_store.h"
#include "replica.grpc.pb.h"

namespace flashckpt {

// A received ReplicaPart. A data part's bytes are spans of the received slices, which it keeps
// alive; anything else is the message protobuf parsed. Read in place, never copied or moved (the
// spans point into what it holds).
class ReceivedPart {
 public:
  ReceivedPart() = default;
  ReceivedPart(const ReceivedPart&) = delete;
  ReceivedPart& operator=(const ReceivedPart&) = delete;

  // Takes the buffer's slices, in place of what this held. INVALID_ARGUMENT when it is not a
  // ReplicaPart (protobuf refuses it).
  Status Read(grpc::ByteBuffer* buffer);

  bool has_header() const { return message_.has_header(); }
  const v1::ReplicaHeader& header() const { return message_.header(); }
  // The data's bytes, in order (none for a header), their count and the checksum sent with them.
  const std::vector<ByteSpan>& data() const { return spans_; }
  uint64_t data_bytes() const { return data_bytes_; }
  uint64_t xxh3() const { return xxh3_; }
  // Whether the data was read in place (not through protobuf): what tests look for.
  bool in_place() const { return in_place_; }

 private:
  std::vector<grpc::Slice> slices_;
  v1::ReplicaPart message_;  // the parsed message, when not read in place
  std::vector<ByteSpan> spans_;
  uint64_t data_bytes_ = 0;
  uint64_t xxh3_ = 0;
  bool in_place_ = false;
};

// Counts the data slices gRPC still holds of a sender's memory, so that the sender returns only
// once none is left (the memory may be reused or unmapped after that). Shared: each slice lent
// keeps it alive, so a slice gRPC gives back after the sender stopped waiting finds it, and with it
// `owner`, what keeps the memory mapped (a slot segment's mapping, not the segment: its end runs on
// whichever thread lets go last): memory gRPC still holds when the sender gives up waiting is not
// unmapped under it.
class SliceLoans : public std::enable_shared_from_this<SliceLoans> {
 public:
  static std::shared_ptr<SliceLoans> Make(std::shared_ptr<const void> owner = nullptr) {
    return std::shared_ptr<SliceLoans>(new SliceLoans(std::move(owner)));
  }
  SliceLoans(const SliceLoans&) = delete;
  SliceLoans& operator=(const SliceLoans&) = delete;
  // Waits until every slice is given back, or `deadline`; false on the deadline.
  bool WaitReturned(std::chrono::steady_clock::time_point deadline) EXCLUDES(mu_);
  // A slice of `n` bytes at `data` that gRPC sends without copying it; counted until gRPC drops it.
  grpc::Slice Lend(const char* data, size_t n) EXCLUDES(mu_);
  uint64_t outstanding() const EXCLUDES(mu_);

 private:
  explicit SliceLoans(std::shared_ptr<const void> owner) : owner_(std::move(owner)) {}
  void Returned() EXCLUDES(mu_);
  const std::shared_ptr<const void> owner_;
  mutable Mutex mu_;
  CondVar cv_;
  uint64_t outstanding_ GUARDED_BY(mu_) = 0;
};

// Waits in its destructor, at most 10 s, for every slice of `loans` to come back, and logs under
// `logger` ("<what>: gRPC still holds N parts ...") when some did not. Declared before a call's
// context, the wait comes after the call is released (a failed call's unsent parts go with it).
class LoansReturned {
 public:
  LoansReturned(SliceLoans& loans, const char* logger, const char* what)
      : loans_(loans), logger_(logger), what_(what) {}
  ~LoansReturned();
  LoansReturned(const LoansReturned&) = delete;
  LoansReturned& operator=(const LoansReturned&) = delete;

 private:
  SliceLoans& loans_;
  const char* logger_;
  const char* what_;
};

// A slice of `n` bytes at `data` that gRPC sends without copying, keeping `owner` (what holds the
// memory) alive until gRPC lets go of it.
grpc::Slice SliceOwnedBy(const char* data, size_t n, std::shared_ptr<const void> owner);

// A ReplicaPart {data, xxh3} whose data is the slice `data` (SliceLoans::Lend, SliceOwnedBy).
grpc::ByteBuffer DataPartBuffer(grpc::Slice data, uint64_t xxh3);
// Any ReplicaPart (a header), serialized by protobuf.
grpc::ByteBuffer MessageBuffer(const google::protobuf::Message& message);

// The client's side of Push with byte buffers (the generated stub's, with ByteBuffer for ReplicaPart).
std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> OpenRawPush(grpc::Channel* channel, grpc::ClientContext* ctx,
                                                                  v1::PushReplicaResponse* response);

// The client's side of Fetch, reading the parts as byte buffers.
std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> OpenRawFetch(grpc::Channel* channel, grpc::ClientContext* ctx,
                                                                   const v1::FetchReplicaRequest& request);

}  // namespace flashckpt

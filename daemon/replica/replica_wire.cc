#include "daemon/replica/replica_wire.h"

#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/sync_stream.h>

#include <cstring>
#include <string>

#include "common/base/log.h"

namespace flashckpt {

namespace {

// The tags of ReplicaPart's fields as protobuf writes them: (field << 3) | wire type.
constexpr uint8_t kDataTag = (2 << 3) | 2;  // data: length-delimited
constexpr uint8_t kSumTag = (3 << 3) | 1;   // xxh3: fixed64

// Reads the bytes of a list of slices in order.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { SkipEmpty(); }
  bool done() const { return slice_ == slices_.size(); }

  std::optional<uint8_t> Byte() {
    if (done()) return std::nullopt;
    const uint8_t b = slices_[slice_].begin()[at_];
    Advance(1);
    return b;
  }
  // A varint of at most 10 bytes.
  std::optional<uint64_t> Varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      auto b = Byte();
      if (!b) return std::nullopt;
      v |= static_cast<uint64_t>(*b & 0x7f) << shift;
      if ((*b & 0x80) == 0) return v;
    }
    return std::nullopt;
  }
  std::optional<uint64_t> Fixed64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) {
      auto b = Byte();
      if (!b) return std::nullopt;
      v |= static_cast<uint64_t>(*b) << (8 * i);
    }
    return v;
  }
  // The next n bytes as spans of the slices; false when fewer are left.
  bool Take(uint64_t n, std::vector<ByteSpan>* spans) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& s = slices_[slice_];
      const size_t k = static_cast<size_t>(std::min<uint64_t>(n, s.size() - at_));
      spans->push_back({reinterpret_cast<const char*>(s.begin()) + at_, k});
      Advance(k);
      n -= k;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    at_ += n;
    if (at_ == slices_[slice_].size()) {
      ++slice_;
      at_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (slice_ < slices_.size() && slices_[slice_].size() == 0) ++slice_;
  }
  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t at_ = 0;
};

}  // namespace

Status ReceivedPart::Read(grpc::ByteBuffer* buffer) {
  ReceivedPart& part = *this;
  part.slices_.clear();
  part.message_.Clear();
  part.spans_.clear();
  part.data_bytes_ = 0;
  part.xxh3_ = 0;
  part.in_place_ = false;
  if (!buffer->Dump(&part.slices_).ok()) return InvalidArgument("a replica part could not be read");
  buffer->Clear();
  // In place: exactly the data field, then the checksum, each once, as DataPartBuffer and protobuf
  // itself write a data part.
  SliceCursor cursor(part.slices_);
  if (cursor.Byte() == std::optional<uint8_t>(kDataTag)) {
    auto n = cursor.Varint();
    std::vector<ByteSpan> spans;
    if (n && cursor.Take(*n, &spans) && cursor.Byte() == std::optional<uint8_t>(kSumTag)) {
      auto sum = cursor.Fixed64();
      if (sum && cursor.done()) {
        part.spans_ = std::move(spans);
        part.data_bytes_ = *n;
        part.xxh3_ = *sum;
        part.in_place_ = true;
        return Status::OK();
      }
    }
  }
  // Anything else, through protobuf.
  std::string text;
  for (const grpc::Slice& s : part.slices_) text.append(reinterpret_cast<const char*>(s.begin()), s.size());
  part.slices_.clear();
  if (!part.message_.ParseFromString(text)) return InvalidArgument("a replica part is not a ReplicaPart");
  if (part.message_.part_case() == v1::ReplicaPart::kData) {
    const std::string& data = part.message_.data();
    part.spans_.push_back({data.data(), data.size()});
    part.data_bytes_ = data.size();
  }
  part.xxh3_ = part.message_.xxh3();
  return Status::OK();
}

bool SliceLoans::WaitReturned(std::chrono::steady_clock::time_point deadline) {
  MutexLock lock(&mu_);
  while (outstanding_ > 0) {
    if (!cv_.WaitUntil(&lock, deadline) && outstanding_ > 0) return false;
  }
  return true;
}

grpc::Slice SliceLoans::Lend(const char* data, size_t n) {
  {
    MutexLock lock(&mu_);
    ++outstanding_;
  }
  auto* self = new std::shared_ptr<SliceLoans>(shared_from_this());
  return grpc::Slice(
      const_cast<char*>(data), n,
      [](void* p) {
        auto* loans = static_cast<std::shared_ptr<SliceLoans>*>(p);
        (*loans)->Returned();
        delete loans;
      },
      self);
}

uint64_t SliceLoans::outstanding() const {
  MutexLock lock(&mu_);
  return outstanding_;
}

void SliceLoans::Returned() {
  MutexLock lock(&mu_);
  --outstanding_;
  cv_.NotifyAll();
}

grpc::Slice SliceOwnedBy(const char* data, size_t n, std::shared_ptr<const void> owner) {
  auto* held = new std::shared_ptr<const void>(std::move(owner));
  return grpc::Slice(
      const_cast<char*>(data), n, [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, held);
}

LoansReturned::~LoansReturned() {
  if (!loans_.WaitReturned(std::chrono::steady_clock::now() + std::chrono::seconds(10))) {
    Logger(logger_)->error("{}: gRPC still holds {} parts of the sender's memory after the call", what_,
                           loans_.outstanding());
  }
}

grpc::ByteBuffer DataPartBuffer(grpc::Slice data, uint64_t xxh3) {
  char head[11];
  size_t h = 0;
  head[h++] = static_cast<char>(kDataTag);
  for (uint64_t v = data.size();; v >>= 7) {
    head[h++] = static_cast<char>((v & 0x7f) | (v >= 0x80 ? 0x80 : 0));
    if (v < 0x80) break;
  }
  char tail[9];
  tail[0] = static_cast<char>(kSumTag);
  for (int i = 0; i < 8; ++i) tail[1 + i] = static_cast<char>((xxh3 >> (8 * i)) & 0xff);
  grpc::Slice slices[3] = {grpc::Slice(head, h), std::move(data), grpc::Slice(tail, sizeof tail)};
  return grpc::ByteBuffer(slices, 3);
}

grpc::ByteBuffer MessageBuffer(const google::protobuf::Message& message) {
  const std::string text = message.SerializeAsString();
  grpc::Slice slice(text.data(), text.size());
  return grpc::ByteBuffer(&slice, 1);
}

std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> OpenRawPush(grpc::Channel* channel, grpc::ClientContext* ctx,
                                                                  v1::PushReplicaResponse* response) {
  // The method as the generated stub names it (Replica::Stub's rpcmethod_Push_).
  static const grpc::internal::RpcMethod method("/flashckpt.v1.Replica/Push",
                                                grpc::internal::RpcMethod::CLIENT_STREAMING);
  return std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>>(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel, method, ctx, response));
}

std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> OpenRawFetch(grpc::Channel* channel, grpc::ClientContext* ctx,
                                                                   const v1::FetchReplicaRequest& request) {
  static const grpc::internal::RpcMethod method("/flashckpt.v1.Replica/Fetch",
                                                grpc::internal::RpcMethod::SERVER_STREAMING);
  return std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>>(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel, method, ctx, request));
}

}  // namespace flashckpt

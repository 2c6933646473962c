#include "daemon/parity/parity_client.h"

#include <algorithm>
#include <cstring>

#include "common/format/checksum.h"
#include "daemon/replica/replica_client.h"
#include "daemon/replica/replica_server.h"
#include "daemon/replica/replica_wire.h"
#include "replica.grpc.pb.h"

namespace flashckpt {
namespace {

// The parity calls that carry parts, bound by hand with byte buffers for the parts (as the generated
// stub binds them with messages): a part's data goes between the caller's memory and gRPC's slices
// without passing through a protobuf message (daemon/replica/replica_wire.h). The wire is unchanged.
const grpc::internal::RpcMethod kPush("/flashckpt.v1.Parity/Push", grpc::internal::RpcMethod::CLIENT_STREAMING);
const grpc::internal::RpcMethod kFetchShare("/flashckpt.v1.Parity/FetchShare",
                                            grpc::internal::RpcMethod::SERVER_STREAMING);
const grpc::internal::RpcMethod kFetchBlock("/flashckpt.v1.Parity/FetchBlock",
                                            grpc::internal::RpcMethod::SERVER_STREAMING);

// Reads data parts of the call `method` with `request` until the stream ends: exactly `bytes`
// bytes, each part copied once from the received slices to where `sink` places it, and checked
// there.
template <typename Request>
Status ReadParts(grpc::Channel* channel, const grpc::internal::RpcMethod& method, const Request& request,
                 PartSink* sink, uint64_t bytes, std::chrono::system_clock::time_point deadline,
                 const std::string& what) {
  grpc::ClientContext ctx;
  // Within the bound a member's service puts on a fetch (kMaxReplicaCall), whatever the caller's.
  ctx.set_deadline(std::min(deadline, std::chrono::system_clock::now() + kMaxReplicaCall - std::chrono::seconds(10)));
  // The sink may cancel the call until it is told that the call is over (before ctx goes).
  sink->Calling(&ctx);
  struct Unbind {
    PartSink* sink;
    ~Unbind() { sink->Calling(nullptr); }
  } unbind{sink};
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel, method, &ctx, request));
  auto fail = [&](Status why) {
    ctx.TryCancel();
    (void)reader->Finish();
    return why;
  };
  uint64_t got = 0;
  grpc::ByteBuffer buffer;
  ReceivedPart part;
  while (reader->Read(&buffer)) {
    // A ParityPart's data and checksum are a ReplicaPart's fields (the same numbers): only data
    // parts come back, and a header (or anything else) fails here.
    if (!part.Read(&buffer).ok() || part.has_header() || part.data_bytes() > bytes - got) {
      return fail(Corruption(what + ": more bytes, or other parts, than the " + std::to_string(bytes) + " listed"));
    }
    Result<char*> to = sink->Place(got, part.data_bytes());
    if (!to.ok()) return fail(to.status());
    if (CopyHashed(part.data(), *to) != part.xxh3()) {
      return fail(Corruption(what + ": the part at offset " + std::to_string(got) + " fails its checksum"));
    }
    got += part.data_bytes();
    sink->Arrived(got);
  }
  grpc::Status finished = reader->Finish();
  if (!finished.ok()) return PeerStatus(finished, what);
  if (got != bytes) {
    return Corruption(what + ": " + std::to_string(got) + " bytes arrived, " + std::to_string(bytes) + " were listed");
  }
  return Status::OK();
}

}  // namespace

Status PushParityBlock(grpc::Channel* channel, const ShareBlock& block, const char* data, uint64_t block_bytes,
                       std::chrono::system_clock::time_point deadline,
                       const std::function<void(grpc::ClientContext*)>& context,
                       const std::function<bool()>& still_held, std::shared_ptr<const void> owner) {
  // The parts are lent to gRPC, not copied: as PushReplica, this returns only once gRPC has let go
  // of every one (declared before the call, the wait comes after the call is released).
  auto loans = SliceLoans::Make(std::move(owner));
  LoansReturned returned(*loans, "parity", "parity push");
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  if (context) context(&ctx);
  struct Untold {
    const std::function<void(grpc::ClientContext*)>& context;
    ~Untold() {
      if (context) context(nullptr);
    }
  } untold{context};
  v1::ParityPushResponse response;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel, kPush, &ctx, &response));
  v1::ParityPart header;
  v1::ParityHeader* h = header.mutable_header();
  ReplicaHeaderOf(block.meta, h->mutable_replica());
  h->set_member(block.member);
  h->set_stripe(block.stripe);
  h->set_position(block.position);
  h->set_member_ranks(block.member_ranks);
  h->set_released(block.released);
  bool open = writer->Write(MessageBuffer(header));
  for (uint64_t at = 0; open && at < block_bytes; at += block.meta.part_bytes) {
    const uint64_t n = std::min(block.meta.part_bytes, block_bytes - at);
    open = writer->Write(DataPartBuffer(loans->Lend(data + at, n), Xxh3(data + at, n)));
  }
  if (open && still_held && !still_held()) {
    ctx.TryCancel();
    (void)writer->Finish();
    return Cancelled("the block's checkpoint was replaced as it was sent");
  }
  if (open) writer->WritesDone();
  grpc::Status finished = writer->Finish();
  if (!finished.ok()) return PeerStatus(finished, "Parity.Push");
  return Status::OK();
}

Result<std::vector<ListedShare>> ListParityShares(grpc::Channel* channel, const ParityGroup& group,
                                                  const std::string& job, uint32_t member,
                                                  std::chrono::system_clock::time_point deadline) {
  v1::Parity::Stub stub(std::shared_ptr<grpc::Channel>(channel, [](grpc::Channel*) {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  v1::ListSharesRequest request;
  request.set_job(job);
  request.set_member(member);
  v1::ListSharesResponse response;
  grpc::Status s = stub.List(&ctx, request, &response);
  if (!s.ok()) return PeerStatus(s, "Parity.List");
  std::vector<ListedShare> out;
  for (const v1::ShareInfo& info : response.shares()) {
    ListedShare share{info.step(), info.position(), info.stripe(), info.row(), info.bytes(), {}};
    if (share.stripe >= group.members() || share.row >= group.parity() || !group.DataIndexOf(share.stripe, member)) {
      return Corruption("Parity.List: a share of stripe " + std::to_string(share.stripe) + " row " +
                        std::to_string(share.row) + " does not fit a group of " + group.ToString());
    }
    for (const v1::ShareInfo::Contribution& c : info.contributions()) {
      if (c.data_index() >= group.data_blocks() || c.member() != group.DataMember(share.stripe, c.data_index()) ||
          c.block_bytes() > share.bytes) {
        return Corruption("Parity.List: a contribution of member " + std::to_string(c.member()) + " at data index " +
                          std::to_string(c.data_index()) + " does not fit its share of stripe " +
                          std::to_string(share.stripe));
      }
      share.contributions.push_back({c.data_index(), {c.member(), c.block_bytes(), ReplicaMetaOf(c.replica())}});
    }
    out.push_back(std::move(share));
  }
  return out;
}

Status FetchParityShare(grpc::Channel* channel, const std::string& job, uint32_t position, uint32_t stripe,
                        int64_t step, PartSink* sink, uint64_t bytes, std::chrono::system_clock::time_point deadline) {
  v1::FetchShareRequest request;
  request.set_job(job);
  request.set_position(position);
  request.set_stripe(stripe);
  request.set_step(step);
  return ReadParts(channel, kFetchShare, request, sink, bytes, deadline, "Parity.FetchShare");
}

Status FetchParityBlock(grpc::Channel* channel, const std::string& job, uint32_t rank, int64_t step, uint32_t stripe,
                        const std::string& run_id, int64_t resumed_from, PartSink* sink, uint64_t bytes,
                        std::chrono::system_clock::time_point deadline) {
  v1::FetchBlockRequest request;
  request.set_job(job);
  request.set_rank(rank);
  request.set_step(step);
  request.set_stripe(stripe);
  request.set_run_id(run_id);
  request.set_resumed_from(resumed_from);
  return ReadParts(channel, kFetchBlock, request, sink, bytes, deadline, "Parity.FetchBlock");
}

}  // namespace flashckpt

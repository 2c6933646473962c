#include "daemon/parity/parity_client.h"

#include <algorithm>
#include <cstring>

#include "common/format/checksum.h"
#include "daemon/replica/replica_client.h"
#include "replica.grpc.pb.h"

namespace flashckpt {
namespace {

// Reads data parts into `into` until the stream ends: exactly `bytes` bytes, each part checked.
Status ReadParts(grpc::ClientReader<v1::ParityPart>* reader, char* into, uint64_t bytes, const std::string& what) {
  uint64_t got = 0;
  v1::ParityPart part;
  while (reader->Read(&part)) {
    const std::string& data = part.data();
    if (!part.has_data() || data.size() > bytes - got) {
      return Corruption(what + ": more bytes, or other parts, than the " + std::to_string(bytes) + " listed");
    }
    if (Xxh3(data.data(), data.size()) != part.xxh3()) {
      return Corruption(what + ": the part at offset " + std::to_string(got) + " fails its checksum");
    }
    std::memcpy(into + got, data.data(), data.size());
    got += data.size();
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
                       const std::function<bool()>& still_held) {
  v1::Parity::Stub stub(std::shared_ptr<grpc::Channel>(channel, [](grpc::Channel*) {}));
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
  std::unique_ptr<grpc::ClientWriter<v1::ParityPart>> writer = stub.Push(&ctx, &response);
  v1::ParityPart part;
  v1::ParityHeader* h = part.mutable_header();
  ReplicaHeaderOf(block.meta, h->mutable_replica());
  h->set_member(block.member);
  h->set_stripe(block.stripe);
  h->set_position(block.position);
  h->set_member_ranks(block.member_ranks);
  bool open = writer->Write(part);
  for (uint64_t at = 0; open && at < block_bytes; at += block.meta.part_bytes) {
    const uint64_t n = std::min(block.meta.part_bytes, block_bytes - at);
    part.Clear();
    part.set_data(data + at, n);
    part.set_xxh3(Xxh3(data + at, n));
    open = writer->Write(part);
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
                        int64_t step, char* into, uint64_t bytes, std::chrono::system_clock::time_point deadline) {
  v1::Parity::Stub stub(std::shared_ptr<grpc::Channel>(channel, [](grpc::Channel*) {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  v1::FetchShareRequest request;
  request.set_job(job);
  request.set_position(position);
  request.set_stripe(stripe);
  request.set_step(step);
  auto reader = stub.FetchShare(&ctx, request);
  return ReadParts(reader.get(), into, bytes, "Parity.FetchShare");
}

Status FetchParityBlock(grpc::Channel* channel, const std::string& job, uint32_t rank, int64_t step, uint32_t stripe,
                        const std::string& run_id, int64_t resumed_from, char* into, uint64_t bytes,
                        std::chrono::system_clock::time_point deadline) {
  v1::Parity::Stub stub(std::shared_ptr<grpc::Channel>(channel, [](grpc::Channel*) {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  v1::FetchBlockRequest request;
  request.set_job(job);
  request.set_rank(rank);
  request.set_step(step);
  request.set_stripe(stripe);
  request.set_run_id(run_id);
  request.set_resumed_from(resumed_from);
  auto reader = stub.FetchBlock(&ctx, request);
  return ReadParts(reader.get(), into, bytes, "Parity.FetchBlock");
}

}  // namespace flashckpt

#include "daemon/parity/parity_service.h"

#include <algorithm>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/format/checksum.h"
#include "daemon/observe/metrics.h"
#include "daemon/parity/parity_sender.h"
#include "daemon/replica/replica_client.h"
#include "daemon/replica/replica_server.h"
#include "daemon/replica/replica_wire.h"
#include "proto/convert.h"

namespace flashckpt {
namespace {

constexpr uint64_t kServePartBytes = 1u << 20;

grpc::Status Refused(grpc::StatusCode code, const std::string& message) { return grpc::Status(code, message); }

// Streams `bytes` bytes at `data` as data parts with their checksums, each sent from that memory in
// place (`owner` keeps it alive until gRPC lets go); false when the reader left.
bool StreamParts(const ParityService::PartWriter& write, const char* data, uint64_t bytes,
                 const std::shared_ptr<const void>& owner) {
  for (uint64_t at = 0; at < bytes; at += kServePartBytes) {
    const uint64_t n = std::min(kServePartBytes, bytes - at);
    if (!write(DataPartBuffer(SliceOwnedBy(data + at, n, owner), Xxh3(data + at, n)))) return false;
  }
  return true;
}

// The handler of a fetch bound by hand: its request read first, then `fetch` writes the parts.
template <typename Request>
grpc::internal::MethodHandler* FetchHandler(ParityService* service,
                                            grpc::Status (ParityService::*fetch)(grpc::ServerContext*, const Request&,
                                                                                 const ParityService::PartWriter&)) {
  return new grpc::internal::SplitServerStreamingHandler<Request, grpc::ByteBuffer>(
      [service, fetch](grpc::ServerContext* ctx, grpc::ServerSplitStreamer<Request, grpc::ByteBuffer>* stream) {
        // A fetch keeps a share, or the rank's segment, and their memory for as long as it runs.
        if (ctx->deadline() > std::chrono::system_clock::now() + kMaxReplicaCall) {
          return Refused(grpc::StatusCode::INVALID_ARGUMENT, "a parity fetch must carry a deadline, at most " +
                                                                 std::to_string(kMaxReplicaCall.count()) +
                                                                 " minutes away");
        }
        Request request;
        if (!stream->Read(&request)) {
          return Refused(grpc::StatusCode::INVALID_ARGUMENT, "a fetch begins with its request");
        }
        return (service->*fetch)(ctx, request,
                                 [stream](grpc::ByteBuffer part) { return stream->Write(std::move(part)); });
      });
}

}  // namespace

ParityService::ParityService(ParityStore* store, std::vector<std::string> allow_names,
                             std::vector<std::string> member_hosts, OwnImageSource own,
                             std::chrono::milliseconds stall_timeout)
    : store_(store),
      allow_names_(std::move(allow_names)),
      member_hosts_(std::move(member_hosts)),
      own_(std::move(own)),
      watchdog_("parity", "parity push", stall_timeout) {
  // Push (method 0 of flashckpt.v1.Parity, the order of replica.proto) reads its parts as byte
  // buffers, bound by hand as ReplicaService binds its Push. FetchShare and FetchBlock (methods 2
  // and 3) write theirs as byte buffers, bound as ReplicaService binds Fetch: one request read
  // first, then the parts written.
  MarkMethodStreamed(0, new grpc::internal::ClientStreamingHandler<ParityService, grpc::ByteBuffer,
                                                                   v1::ParityPushResponse>(
                            [](ParityService* service, grpc::ServerContext* ctx,
                               grpc::ServerReader<grpc::ByteBuffer>* reader, v1::ParityPushResponse* response) {
                              return service->RawPush(ctx, reader, response);
                            },
                            this));
  MarkMethodStreamed(2, FetchHandler(this, &ParityService::RawFetchShare));
  MarkMethodStreamed(3, FetchHandler(this, &ParityService::RawFetchBlock));
}

grpc::Status ParityService::ActsAs(grpc::ServerContext* ctx, uint32_t member) const {
  if (allow_names_.empty()) return grpc::Status::OK;  // loopback without TLS: one host, no names to tell apart
  if (member >= member_hosts_.size()) {
    return Refused(grpc::StatusCode::INVALID_ARGUMENT,
                   "member " + std::to_string(member) + " of a group of " + std::to_string(member_hosts_.size()));
  }
  const std::string& host = member_hosts_[member];
  const std::vector<std::string> presented = PresentedNames(ctx);
  if (std::find(presented.begin(), presented.end(), host) != presented.end()) return grpc::Status::OK;
  const std::string shown = NamesText(presented);
  Logger("parity")->warn("parity call refused peer={} names=[{}]: not member {}'s host {}", ctx->peer(), shown, member,
                         host);
  return Refused(grpc::StatusCode::PERMISSION_DENIED, "the peer's certificate names [" + shown + "], not " + host +
                                                          ", the host of member " + std::to_string(member) +
                                                          " of --ec-group");
}

grpc::Status ParityService::RawPush(grpc::ServerContext* ctx, grpc::ServerReader<grpc::ByteBuffer>* reader,
                                    v1::ParityPushResponse*) {
  std::string peer;
  if (grpc::Status allowed = AllowedPeer(ctx, allow_names_, &peer); !allowed.ok()) return allowed;
  struct InFlight {
    std::atomic<int>* n;
    ~InFlight() { n->fetch_sub(1); }
  } in_flight{&pushes_};
  if (pushes_.fetch_add(1) >= kMaxParityPushesInFlight) {
    return Refused(grpc::StatusCode::RESOURCE_EXHAUSTED,
                   std::to_string(kMaxParityPushesInFlight) + " parity pushes are in flight here; try again");
  }
  if (ctx->deadline() > std::chrono::system_clock::now() + kMaxReplicaCall) {
    refused_.fetch_add(1);
    return Refused(grpc::StatusCode::INVALID_ARGUMENT,
                   "a parity push needs a deadline within " + std::to_string(kMaxReplicaCall.count()) + " minutes");
  }
  // Watched from here to the return: a push that stops sending is cancelled (watchdog_).
  StallWatchdog::Watched watched(&watchdog_, ctx);
  const auto stalled = [&] {
    refused_.fetch_add(1);
    return Refused(grpc::StatusCode::DEADLINE_EXCEEDED, "the parity push was cancelled: nothing arrived for " +
                                                            std::to_string(watchdog_.timeout().count()) + " ms");
  };
  // The header through protobuf (a ParityPart's header is not a ReplicaPart's); the data parts read
  // in place (their fields are a ReplicaPart's: ReceivedPart).
  grpc::ByteBuffer buffer;
  v1::ParityPart first;
  if (!reader->Read(&buffer) ||
      !grpc::SerializationTraits<v1::ParityPart>::Deserialize(&buffer, &first).ok() || !first.has_header()) {
    if (watched.Stalled()) return stalled();
    refused_.fetch_add(1);
    return Refused(grpc::StatusCode::INVALID_ARGUMENT, "a parity push starts with its header");
  }
  watched.Progress();
  const v1::ParityHeader& h = first.header();
  if (grpc::Status as = ActsAs(ctx, h.member()); !as.ok()) {
    refused_.fetch_add(1);
    return as;
  }
  ShareBlock block{h.member(), h.stripe(), h.position(), h.member_ranks(), ReplicaMetaOf(h.replica())};
  block.meta.from_peer = peer;
  if (h.released()) {
    // The member gave the job's memory back: the header alone.
    if (block.member_ranks != 0 || reader->Read(&buffer)) {
      refused_.fetch_add(1);
      return Refused(grpc::StatusCode::INVALID_ARGUMENT, "a parity push of a release has no ranks and no parts");
    }
    Result<size_t> dropped = store_->Released(block.meta.job, block.member);
    if (!dropped.ok()) {
      refused_.fetch_add(1);
      Logger("parity")->warn("parity release from={} refused: {}", ctx->peer(), dropped.status().ToString());
      return ToGrpc(dropped.status());
    }
    Logger("parity")->info("parity release job={} member={} shares_dropped={}", block.meta.job, block.member,
                           *dropped);
    return grpc::Status::OK;
  }
  if (block.member_ranks == 0) {
    // No ranks of the job at the step: the header alone.
    if (reader->Read(&buffer)) {
      refused_.fetch_add(1);
      return Refused(grpc::StatusCode::INVALID_ARGUMENT, "a parity push of no ranks (member_ranks 0) has no parts");
    }
    if (Status told = store_->Tell(block); !told.ok()) {
      refused_.fetch_add(1);
      Logger("parity")->warn("parity count from={} refused: {}", ctx->peer(), told.ToString());
      return ToGrpc(told);
    }
    Logger("parity")->debug("parity count added job={} step={} stripe={} member={} of_ranks=0", block.meta.job,
                            block.meta.step, block.stripe, block.member);
    return grpc::Status::OK;
  }
  auto incoming = store_->Begin(std::move(block));
  if (!incoming.ok()) {
    refused_.fetch_add(1);
    if (incoming.status().code() != StatusCode::kAlreadyExists) {
      Logger("parity")->warn("parity block from={} refused: {}", ctx->peer(), incoming.status().ToString());
    } else {
      Logger("parity")->debug("parity block from={} not needed: {}", ctx->peer(), incoming.status().ToString());
    }
    return ToGrpc(incoming.status());
  }
  ReceivedPart part;
  while (reader->Read(&buffer)) {
    watched.Progress();
    if (!part.Read(&buffer).ok() || part.has_header() || part.data().empty()) {
      refused_.fetch_add(1);
      return Refused(grpc::StatusCode::INVALID_ARGUMENT, "a parity push has one header, then data parts");
    }
    if (Status added = (*incoming)->Append(part.data(), part.xxh3()); !added.ok()) {
      refused_.fetch_add(1);
      Logger("parity")->warn("parity block from={} refused: {}", ctx->peer(), added.ToString());
      return ToGrpc(added);
    }
  }
  if (watched.Stalled()) return stalled();
  if (ctx->IsCancelled()) return Refused(grpc::StatusCode::CANCELLED, "the parity push was cancelled");
  const ShareBlock& added = (*incoming)->block();
  Logger("parity")->debug("parity block added job={} step={} stripe={} position={} member={} of_ranks={}",
                          added.meta.job, added.meta.step, added.stripe, added.position, added.member,
                          added.member_ranks);
  const std::string job = added.meta.job;
  const int64_t step = added.meta.step;
  if (Status done = store_->Finish(std::move(*incoming)); !done.ok()) {
    refused_.fetch_add(1);
    return ToGrpc(done);
  }
  received_.fetch_add(1);
  if (heard_) heard_(job, step);
  return grpc::Status::OK;
}

grpc::Status ParityService::List(grpc::ServerContext* ctx, const v1::ListSharesRequest* request,
                                 v1::ListSharesResponse* response) {
  std::string peer;
  if (grpc::Status allowed = AllowedPeer(ctx, allow_names_, &peer); !allowed.ok()) return allowed;
  if (Status valid = ValidateJobName(request->job()); !valid.ok()) return ToGrpc(valid);
  if (grpc::Status as = ActsAs(ctx, request->member()); !as.ok()) return as;
  for (const std::shared_ptr<const ParityShare>& share : store_->SharesFor(request->job(), request->member())) {
    v1::ShareInfo* info = response->add_shares();
    info->set_step(share->step());
    info->set_position(share->position());
    info->set_stripe(share->stripe());
    info->set_row(share->row());
    info->set_bytes(share->bytes());
    for (const auto& [index, c] : share->contributions()) {
      v1::ShareInfo::Contribution* out = info->add_contributions();
      out->set_data_index(index);
      out->set_member(c.member);
      out->set_block_bytes(c.block_bytes);
      ReplicaHeaderOf(c.meta, out->mutable_replica());
      if (c.member != request->member()) {
        // The others' layouts and extra state are of no use to the rebuild, and may be large.
        out->mutable_replica()->clear_layout();
        out->mutable_replica()->clear_extra();
      }
    }
  }
  return grpc::Status::OK;
}

grpc::Status ParityService::RawFetchShare(grpc::ServerContext* ctx, const v1::FetchShareRequest& request,
                                          const PartWriter& writer) {
  std::string peer;
  if (grpc::Status allowed = AllowedPeer(ctx, allow_names_, &peer); !allowed.ok()) return allowed;
  auto share = store_->Find(request.job(), request.position(), request.stripe(), request.step());
  if (!share.ok()) return ToGrpc(share.status());
  if (!StreamParts(writer, reinterpret_cast<const char*>((*share)->data()), (*share)->bytes(), *share)) {
    return Refused(grpc::StatusCode::CANCELLED, "the fetching peer left");
  }
  served_.fetch_add(1);
  return grpc::Status::OK;
}

grpc::Status ParityService::RawFetchBlock(grpc::ServerContext* ctx, const v1::FetchBlockRequest& request,
                                          const PartWriter& writer) {
  std::string peer;
  if (grpc::Status allowed = AllowedPeer(ctx, allow_names_, &peer); !allowed.ok()) return allowed;
  const ParityGroup& group = store_->group();
  if (request.stripe() >= group.members()) {
    return Refused(grpc::StatusCode::INVALID_ARGUMENT,
                   "stripe " + std::to_string(request.stripe()) + " of a group of " + std::to_string(group.members()));
  }
  std::optional<uint32_t> block = group.BlockOfStripe(store_->self(), request.stripe());
  if (!block) {
    return Refused(grpc::StatusCode::INVALID_ARGUMENT,
                   "this member holds parity of stripe " + std::to_string(request.stripe()) + ", not data");
  }
  auto image = own_(request.job(), request.rank(), request.step(), request.run_id(), request.resumed_from());
  if (!image.ok()) return ToGrpc(image.status());
  const ParityGroup::Range range = group.Block(image->bytes, *block);
  if (!StreamParts(writer, image->data + range.offset, range.bytes, image->keep)) {
    return Refused(grpc::StatusCode::CANCELLED, "the fetching peer left");
  }
  // Sent while the rank went on: only if the memory checkpoint stayed in place are they its bytes.
  if (image->still_held && !image->still_held()) {
    return Refused(grpc::StatusCode::ABORTED, "the memory checkpoint of job '" + request.job() + "' rank " +
                                                  std::to_string(request.rank()) + " step " +
                                                  std::to_string(request.step()) + " was replaced as it was sent");
  }
  served_.fetch_add(1);
  return grpc::Status::OK;
}

std::string RenderParityMetrics(const ParityStore& store, const ParityService& service, const ParitySender& sender) {
  std::string out;
  MetricHeader(&out, "flashckpt_parity_shares_held", "gauge",
               "Complete parity shares this member holds for the others of its group (--ec-group).");
  MetricSample(&out, "flashckpt_parity_shares_held", "", static_cast<double>(store.complete_count()));
  MetricHeader(&out, "flashckpt_parity_held_bytes", "gauge", "Bytes of the complete parity shares held.");
  MetricSample(&out, "flashckpt_parity_held_bytes", "", static_cast<double>(store.held_bytes()));
  MetricHeader(&out, "flashckpt_parity_kept_bytes", "gauge",
               "Memory of replaced parity shares kept for the next share of their place (MADV_FREE, outside the "
               "budget).");
  MetricSample(&out, "flashckpt_parity_kept_bytes", "", static_cast<double>(store.kept_bytes()));
  MetricHeader(&out, "flashckpt_parity_building_bytes", "gauge",
               "Bytes of the parity shares still being built from the members' blocks.");
  MetricSample(&out, "flashckpt_parity_building_bytes", "", static_cast<double>(store.building_bytes()));
  MetricHeader(&out, "flashckpt_parity_blocks_received_total", "counter",
               "Blocks of the members' checkpoints received whole and added into a share.");
  MetricSample(&out, "flashckpt_parity_blocks_received_total", "", static_cast<double>(service.blocks_received()));
  MetricHeader(&out, "flashckpt_parity_blocks_refused_total", "counter",
               "Parity pushes refused (bad header, no memory, bad part, a block held already) or broken off.");
  MetricSample(&out, "flashckpt_parity_blocks_refused_total", "", static_cast<double>(service.blocks_refused()));
  MetricHeader(&out, "flashckpt_parity_pushes_stalled_total", "counter",
               "Parity pushes cancelled because nothing arrived for 10 s (counted as refused too).");
  MetricSample(&out, "flashckpt_parity_pushes_stalled_total", "", static_cast<double>(service.blocks_stalled()));
  MetricHeader(&out, "flashckpt_parity_pieces_served_total", "counter",
               "Shares and own blocks sent to a member that rebuilt a lost member's rank.");
  MetricSample(&out, "flashckpt_parity_pieces_served_total", "", static_cast<double>(service.blocks_served()));
  MetricHeader(&out, "flashckpt_parity_sent_total", "counter",
               "Memory checkpoints of this node's ranks whose blocks a member acknowledged, per member.");
  MetricHeader(&out, "flashckpt_parity_sent_bytes_total", "counter", "Bytes of blocks sent to each member.");
  MetricHeader(&out, "flashckpt_parity_failed_total", "counter", "Pushes of blocks to each member that failed.");
  for (const ParityMemberStatus& m : sender.MemberStatus()) {
    const std::string label = "member=\"" + m.target + "\"";
    MetricSample(&out, "flashckpt_parity_sent_total", label, static_cast<double>(m.blocks_sent));
    MetricSample(&out, "flashckpt_parity_sent_bytes_total", label, static_cast<double>(m.bytes_sent));
    MetricSample(&out, "flashckpt_parity_failed_total", label, static_cast<double>(m.pushes_failed));
  }
  return out;
}

}  // namespace flashckpt

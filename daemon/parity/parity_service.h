// flashckpt.v1.Parity (proto/flashckpt/v1/replica.proto), served on the replica listener
// (ReplicaServer::AddService) with its TLS and allowed names: the holders' side of erasure-coded
// peer memory (--ec-group) over a ParityStore, and the data members' side, each member's own
// blocks read from its memory checkpoints (OwnImageSource).
//
// What a peer sends is checked as a replica's is: the caller's certificate against the member it
// pushes as, the header against the group's shape and the bounds (ParityStore::Begin), every part
// against its XXH3-64. A block's rank image is the
// sender's; a share is only as good as the blocks added into it, so whoever rebuilds from it checks
// every chunk of the result against the origin's checksums before anything uses it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "daemon/parity/parity_store.h"
#include "daemon/replica/replica_server.h"
#include "daemon/replica/stall_watchdog.h"
#include "replica.grpc.pb.h"

namespace flashckpt {

// At most this many parity pushes are received at once.
constexpr int kMaxParityPushesInFlight = 16;

class ParityService final : public v1::Parity::Service {
 public:
  // `member_hosts`: every member's host by index (ParityGroupConfig::hosts). With TLS (`allow_names`
  // not empty) a peer pushes a block only as the member whose host its certificate names, and lists
  // only that member's shares: an allowed member cannot add into another member's place in a share.
  // A push that sends nothing for `stall_timeout` is cancelled, the share it was adding into given
  // back as for any push that does not finish (parity_blocks_stalled counts them).
  ParityService(ParityStore* store, std::vector<std::string> allow_names, std::vector<std::string> member_hosts,
                OwnImageSource own, std::chrono::milliseconds stall_timeout = kReplicaStallTimeout);

  // Told of each block of another member added here (its job and step), after it was added: the
  // daemon tells the holders of its own stripes when it has no ranks of that job (ParitySender::
  // OfferNoRanks), so that their shares of the step do not wait for it.
  using HeardOf = std::function<void(const std::string& job, int64_t step)>;
  void set_heard_of(HeardOf heard) { heard_ = std::move(heard); }

  // Push is bound by hand (the constructor) with byte buffers: a block (a header, then its parts,
  // each read in place from the received slices and added into the share from there), or a
  // member's word that it has no ranks of the job at the step (a header with member_ranks 0 and no
  // parts: ParityStore::Tell).
  grpc::Status RawPush(grpc::ServerContext* ctx, grpc::ServerReader<grpc::ByteBuffer>* reader,
                       v1::ParityPushResponse* response);
  grpc::Status List(grpc::ServerContext* ctx, const v1::ListSharesRequest* request,
                    v1::ListSharesResponse* response) override;
  // FetchShare and FetchBlock are bound by hand (the constructor): their parts are written as byte
  // buffers whose data is the share's or the image's memory in place (daemon/replica/replica_wire.h).
  using PartWriter = std::function<bool(grpc::ByteBuffer)>;
  grpc::Status RawFetchShare(grpc::ServerContext* ctx, const v1::FetchShareRequest& request, const PartWriter& writer);
  grpc::Status RawFetchBlock(grpc::ServerContext* ctx, const v1::FetchBlockRequest& request, const PartWriter& writer);

  uint64_t blocks_received() const { return received_.load(); }
  uint64_t blocks_refused() const { return refused_.load(); }
  uint64_t blocks_served() const { return served_.load(); }
  uint64_t blocks_stalled() const { return watchdog_.stalled(); }

 private:
  ParityStore* store_;
  // PERMISSION_DENIED unless the caller may act as `member` (see the constructor); OK without TLS.
  grpc::Status ActsAs(grpc::ServerContext* ctx, uint32_t member) const;

  const std::vector<std::string> allow_names_;
  const std::vector<std::string> member_hosts_;
  const OwnImageSource own_;
  HeardOf heard_;  // set before the service is served
  std::atomic<int> pushes_{0};
  std::atomic<uint64_t> received_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> served_{0};
  StallWatchdog watchdog_;  // the pushes under way
};

// The parity metrics, in the text exposition format, for the daemon's /metrics: what this member
// holds and serves (flashckpt_parity_shares_held, flashckpt_parity_held_bytes,
// flashckpt_parity_building_bytes, flashckpt_parity_blocks_received_total,
// flashckpt_parity_blocks_refused_total, flashckpt_parity_pushes_stalled_total,
// flashckpt_parity_pieces_served_total) and, per other
// member, what it sent there (flashckpt_parity_sent_total, flashckpt_parity_sent_bytes_total,
// flashckpt_parity_failed_total).
class ParitySender;
std::string RenderParityMetrics(const ParityStore& store, const ParityService& service, const ParitySender& sender);

}  // namespace flashckpt

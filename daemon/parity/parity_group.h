// The shape of a parity group (flashckptd --ec-group, --ec-parity): which member holds which parity
// share of which stripe, and which block of whose memory checkpoint each stripe codes.
//
// G members, M parity shares per stripe, K = G - M data blocks per stripe. There are G stripes, one
// per member index s. Stripe s's parity is held by members s, s+1, .., s+M-1 (mod G), share `row`
// by member s+row; its data blocks come from the other K members, s+M, .., s+G-1 (mod G), data
// index d from member s+M+d. So each member is a data member of K stripes and a parity holder of M:
// member i cuts its image (one rank's memory checkpoint, as a replica carries it) into K blocks of
// ceil(bytes / K) bytes (the last one shorter, or empty), block j into stripe i+1+j (mod G), and it
// holds M shares, each as long as the longest block of its stripe: M/K of what it checkpoints,
// where a full replica would be 1. Any M lost members leave each stripe at least K of its G pieces,
// which is what a Reed-Solomon code with K data and M parity pieces needs (parity_code.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/base/status.h"

namespace flashckpt {

class ParityGroup {
 public:
  // 2 <= members <= 255 (GF(2^8)), 1 <= parity < members.
  static Result<ParityGroup> Make(uint32_t members, uint32_t parity);

  uint32_t members() const { return members_; }
  uint32_t parity() const { return parity_; }
  uint32_t data_blocks() const { return members_ - parity_; }  // K: data blocks per stripe, blocks per image

  // The member that holds parity share `row` (< parity()) of `stripe`.
  uint32_t Holder(uint32_t stripe, uint32_t row) const { return (stripe + row) % members_; }
  // The member whose block is data index `index` (< data_blocks()) of `stripe`.
  uint32_t DataMember(uint32_t stripe, uint32_t index) const { return (stripe + parity_ + index) % members_; }
  // Which share of `stripe` `member` holds; nullopt when it is one of the stripe's data members.
  std::optional<uint32_t> RowOf(uint32_t stripe, uint32_t member) const;
  // Which data index of `stripe` `member`'s block is; nullopt when `member` holds a share of it.
  std::optional<uint32_t> DataIndexOf(uint32_t stripe, uint32_t member) const;
  // The stripe that codes block `block` (< data_blocks()) of `member`'s image, and back.
  uint32_t StripeOfBlock(uint32_t member, uint32_t block) const { return (member + 1 + block) % members_; }
  std::optional<uint32_t> BlockOfStripe(uint32_t member, uint32_t stripe) const;

  // Where block `block` of an image of `image_bytes` lies in it; blocks past the image's end are empty.
  struct Range {
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  uint64_t BlockBytes(uint64_t image_bytes) const;  // the first block's length: ceil(image_bytes / K)
  Range Block(uint64_t image_bytes, uint32_t block) const;

  std::string ToString() const;  // "4 members, 1 parity"

 private:
  ParityGroup(uint32_t members, uint32_t parity) : members_(members), parity_(parity) {}
  uint32_t members_;
  uint32_t parity_;
};

// --ec-group and --ec-parity as a daemon takes them: the group, this member's index (the place of
// its own --replica-listen in the list, which every member gives in the same order) and the other
// members' addresses (HOST:PORT, as gRPC takes them).
struct ParityGroupConfig {
  ParityGroup group;
  uint32_t self = 0;
  std::vector<std::pair<uint32_t, std::string>> others;
  // Every member's host (its address without the port), by index: what its certificate names when
  // the group speaks TLS, since the others reach it there and check its certificate for that host.
  std::vector<std::string> hosts;
};
// INVALID_ARGUMENT, saying what to change, for a list with a malformed or repeated address, one
// without this daemon's --replica-listen (with its port) or with it twice, a parity the group cannot
// code, or an address off loopback without the replica channel's TLS (`tls`).
Result<ParityGroupConfig> ParseParityGroup(const std::vector<std::string>& members, uint32_t parity,
                                           const std::string& replica_listen, bool tls);

}  // namespace flashckpt

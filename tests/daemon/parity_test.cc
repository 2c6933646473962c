// The parity group's shape and its Reed-Solomon code (daemon/parity): every stripe is coded so
// that any `parity` lost members are rebuilt bit for bit from the others, whatever the images' sizes.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <cstdint>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "daemon/parity/parity_code.h"
#include "daemon/parity/parity_group.h"
#include "daemon/parity/parity_store.h"
#include "daemon/parity/parity_rebuild.h"
#include "daemon/parity/parity_sender.h"
#include "daemon/parity/parity_service.h"
#include "daemon/replica/replica_client.h"
#include "daemon/replica/replica_server.h"
#include "bench/parity_member.h"
#include "common/format/checksum.h"
#include "certificates.h"
#include "testing.h"
#include "replica.grpc.pb.h"

// Binds the value of a Result or fails the test with its Status.
#define ASSERT_OK_AND_ASSIGN(lhs, rexpr) ASSERT_OK_AND_ASSIGN_IMPL(FC_CONCAT(_fc_r_, __LINE__), lhs, rexpr)
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                              \
  ASSERT_OK(tmp.status());                         \
  lhs = std::move(tmp).value()

namespace flashckpt {
namespace {

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// Every set of `count` members out of `members`.
std::vector<std::vector<uint32_t>> Subsets(uint32_t members, uint32_t count) {
  std::vector<std::vector<uint32_t>> out;
  for (uint32_t mask = 0; mask < (1u << members); ++mask) {
    if (static_cast<uint32_t>(__builtin_popcount(mask)) != count) continue;
    std::vector<uint32_t> set;
    for (uint32_t i = 0; i < members; ++i) {
      if (mask & (1u << i)) set.push_back(i);
    }
    out.push_back(set);
  }
  return out;
}

TEST(ParityGroupTest, RefusesShapesThatCannotCode) {
  EXPECT_EQ(ParityGroup::Make(1, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParityGroup::Make(4, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParityGroup::Make(4, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParityGroup::Make(256, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParityCode::Make(0, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParityCode::Make(200, 56).status().code(), StatusCode::kInvalidArgument);
  ASSERT_OK(ParityGroup::Make(2, 1).status());
}

TEST(ParityGroupTest, EveryMemberCodesKBlocksAndHoldsMSharesAndNoStripeHoldsTwoPiecesOfOneMember) {
  for (auto [g, m] : std::vector<std::pair<uint32_t, uint32_t>>{{2, 1}, {4, 1}, {6, 2}, {5, 3}, {9, 4}}) {
    SCOPED_TRACE(std::to_string(g) + " members, " + std::to_string(m) + " parity");
    ASSERT_OK_AND_ASSIGN(ParityGroup group, ParityGroup::Make(g, m));
    const uint32_t k = group.data_blocks();
    std::vector<uint32_t> holds(g, 0), codes(g, 0);
    for (uint32_t s = 0; s < g; ++s) {
      std::set<uint32_t> members;
      for (uint32_t r = 0; r < m; ++r) {
        uint32_t holder = group.Holder(s, r);
        EXPECT_EQ(group.RowOf(s, holder), r);
        EXPECT_FALSE(group.DataIndexOf(s, holder).has_value());
        EXPECT_FALSE(group.BlockOfStripe(holder, s).has_value());
        members.insert(holder);
        ++holds[holder];
      }
      for (uint32_t d = 0; d < k; ++d) {
        uint32_t member = group.DataMember(s, d);
        EXPECT_EQ(group.DataIndexOf(s, member), d);
        EXPECT_FALSE(group.RowOf(s, member).has_value());
        std::optional<uint32_t> block = group.BlockOfStripe(member, s);
        ASSERT_TRUE(block.has_value());
        EXPECT_EQ(group.StripeOfBlock(member, *block), s);
        members.insert(member);
        ++codes[member];
      }
      EXPECT_EQ(members.size(), g) << "stripe " << s << " must have one piece of every member";
    }
    for (uint32_t i = 0; i < g; ++i) {
      EXPECT_EQ(holds[i], m);
      EXPECT_EQ(codes[i], k);
    }
  }
}

TEST(ParityGroupTest, BlocksTileTheImageWhateverItsSize) {
  ASSERT_OK_AND_ASSIGN(ParityGroup group, ParityGroup::Make(6, 2));
  for (uint64_t bytes : {0ull, 1ull, 3ull, 4ull, 5ull, 4096ull, 1000003ull}) {
    uint64_t next = 0;
    for (uint32_t b = 0; b < group.data_blocks(); ++b) {
      ParityGroup::Range range = group.Block(bytes, b);
      EXPECT_EQ(range.offset, next);
      EXPECT_LE(range.bytes, group.BlockBytes(bytes));
      next += range.bytes;
    }
    EXPECT_EQ(next, bytes);
  }
}

TEST(ParityCodeTest, SharesBuiltOnePieceAtATimeInAnyOrderEqualTheEncodingOfZeroPaddedPieces) {
  std::mt19937_64 rng(7);
  ASSERT_OK_AND_ASSIGN(ParityCode code, ParityCode::Make(4, 2));
  const size_t stripe = 100003;  // odd: not a multiple of any SIMD width
  std::vector<std::vector<uint8_t>> pieces;
  for (size_t len : {stripe, stripe - 1, size_t{17}, size_t{0}}) pieces.push_back(RandomBytes(rng, len));

  std::vector<std::vector<uint8_t>> padded(4, std::vector<uint8_t>(stripe, 0));
  for (size_t i = 0; i < 4; ++i) std::copy(pieces[i].begin(), pieces[i].end(), padded[i].begin());
  std::vector<std::vector<uint8_t>> encoded(2, std::vector<uint8_t>(stripe));
  code.Encode({padded[0].data(), padded[1].data(), padded[2].data(), padded[3].data()}, stripe,
              {encoded[0].data(), encoded[1].data()});

  std::vector<std::vector<uint8_t>> shares(2, std::vector<uint8_t>(stripe, 0));
  for (uint32_t index : {2u, 0u, 3u, 1u}) {
    for (uint32_t row = 0; row < 2; ++row) {
      code.Accumulate(index, row, pieces[index].data(), pieces[index].size(), shares[row].data());
    }
  }
  EXPECT_EQ(shares[0], encoded[0]);
  EXPECT_EQ(shares[1], encoded[1]);
  EXPECT_NE(shares[0], shares[1]) << "the two shares must be independent";

  // Over memory that holds anything: the first piece written (Assign) where the share has nothing
  // yet, the others added, as a holder does with kept memory.
  std::vector<std::vector<uint8_t>> reused = {RandomBytes(rng, stripe), RandomBytes(rng, stripe)};
  for (uint32_t row = 0; row < 2; ++row) {
    code.Assign(1, row, pieces[1].data(), pieces[1].size(), reused[row].data());          // stripe - 1 bytes
    code.Assign(0, row, pieces[0].data() + stripe - 1, 1, reused[row].data() + stripe - 1);  // the last byte
    code.Accumulate(0, row, pieces[0].data(), stripe - 1, reused[row].data());
    for (uint32_t index : {2u, 3u}) {
      code.Accumulate(index, row, pieces[index].data(), pieces[index].size(), reused[row].data());
    }
  }
  EXPECT_EQ(reused[0], encoded[0]);
  EXPECT_EQ(reused[1], encoded[1]);
}

TEST(ParityCodeTest, AnyMLostPiecesAreRebuiltAndMoreThanMAreRefused) {
  std::mt19937_64 rng(11);
  for (auto [k, m] : std::vector<std::pair<uint32_t, uint32_t>>{{3, 1}, {4, 2}, {2, 3}}) {
    SCOPED_TRACE(std::to_string(k) + "+" + std::to_string(m));
    ASSERT_OK_AND_ASSIGN(ParityCode code, ParityCode::Make(k, m));
    // Longer than one rebuild chunk (256 KiB), and pieces that end inside and before its last chunk.
    const size_t stripe = 600001;
    std::vector<std::vector<uint8_t>> data;
    for (uint32_t i = 0; i < k; ++i) data.push_back(RandomBytes(rng, i == 0 ? stripe : stripe - 300000 - 7 * i));
    std::vector<std::vector<uint8_t>> shares(m, std::vector<uint8_t>(stripe, 0));
    for (uint32_t i = 0; i < k; ++i) {
      for (uint32_t r = 0; r < m; ++r) code.Accumulate(i, r, data[i].data(), data[i].size(), shares[r].data());
    }
    for (uint32_t lost_count = 1; lost_count <= m + 1; ++lost_count) {
      for (const std::vector<uint32_t>& lost : Subsets(k + m, lost_count)) {
        std::vector<ParityCode::Piece> pieces(k + m);
        for (uint32_t i = 0; i < k + m; ++i) {
          if (std::find(lost.begin(), lost.end(), i) != lost.end()) continue;
          pieces[i] = i < k ? ParityCode::Piece{data[i].data(), data[i].size()}
                            : ParityCode::Piece{shares[i - k].data(), stripe};
        }
        std::vector<uint32_t> lost_data;
        for (uint32_t i : lost) {
          if (i < k) lost_data.push_back(i);
        }
        std::vector<std::vector<uint8_t>> rebuilt;
        for (uint32_t i : lost_data) rebuilt.emplace_back(data[i].size(), 0xEE);
        std::vector<ParityCode::Wanted> wanted;
        for (size_t w = 0; w < lost_data.size(); ++w) wanted.push_back({lost_data[w], rebuilt[w].data(), rebuilt[w].size()});
        Status status = code.Rebuild(pieces, stripe, wanted);
        if (lost_count > m) {
          EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
          continue;
        }
        ASSERT_OK(status);
        for (size_t w = 0; w < lost_data.size(); ++w) {
          EXPECT_TRUE(rebuilt[w] == data[lost_data[w]]) << "piece " << lost_data[w] << " rebuilt wrong";
        }
      }
    }
  }
}

// A whole group as the daemons run it: each member's image cut into blocks, each block added into
// the shares of its stripe's holders, then any `parity` members lost and their images rebuilt from
// the others' blocks and shares. Memory held for parity is at most parity / data of the largest image.
TEST(ParityCodeTest, AGroupRebuildsAnyMLostMembersImagesFromTheOthers) {
  std::mt19937_64 rng(5);
  for (auto [g, m] : std::vector<std::pair<uint32_t, uint32_t>>{{4, 1}, {6, 2}}) {
    SCOPED_TRACE(std::to_string(g) + " members, " + std::to_string(m) + " parity");
    ASSERT_OK_AND_ASSIGN(ParityGroup group, ParityGroup::Make(g, m));
    ASSERT_OK_AND_ASSIGN(ParityCode code, ParityCode::Make(group.data_blocks(), m));
    const uint32_t k = group.data_blocks();
    std::vector<std::vector<uint8_t>> images;
    for (uint32_t i = 0; i < g; ++i) images.push_back(RandomBytes(rng, 200000 + 4099 * i));

    // shares[s][r]: share r of stripe s, as long as the stripe's longest block.
    std::vector<std::vector<std::vector<uint8_t>>> shares(g);
    for (uint32_t s = 0; s < g; ++s) {
      uint64_t longest = 0;
      for (uint32_t d = 0; d < k; ++d) {
        uint32_t member = group.DataMember(s, d);
        longest = std::max(longest, group.Block(images[member].size(), *group.BlockOfStripe(member, s)).bytes);
      }
      shares[s].assign(m, std::vector<uint8_t>(longest, 0));
      for (uint32_t d = 0; d < k; ++d) {
        uint32_t member = group.DataMember(s, d);
        ParityGroup::Range block = group.Block(images[member].size(), *group.BlockOfStripe(member, s));
        for (uint32_t r = 0; r < m; ++r) {
          code.Accumulate(d, r, images[member].data() + block.offset, block.bytes, shares[s][r].data());
        }
      }
    }
    for (uint32_t i = 0; i < g; ++i) {
      uint64_t held = 0;
      for (uint32_t s = 0; s < g; ++s) {
        if (group.RowOf(s, i)) held += shares[s][*group.RowOf(s, i)].size();
      }
      EXPECT_LE(held, m * group.BlockBytes(images.back().size())) << "member " << i;
    }

    for (const std::vector<uint32_t>& lost : Subsets(g, m)) {
      auto is_lost = [&](uint32_t member) { return std::find(lost.begin(), lost.end(), member) != lost.end(); };
      for (uint32_t victim : lost) {
        std::vector<uint8_t> rebuilt(images[victim].size(), 0);
        for (uint32_t b = 0; b < k; ++b) {
          uint32_t s = group.StripeOfBlock(victim, b);
          std::vector<ParityCode::Piece> pieces(g);
          for (uint32_t d = 0; d < k; ++d) {
            uint32_t member = group.DataMember(s, d);
            if (is_lost(member)) continue;
            ParityGroup::Range block = group.Block(images[member].size(), *group.BlockOfStripe(member, s));
            pieces[d] = {images[member].data() + block.offset, block.bytes};
          }
          for (uint32_t r = 0; r < m; ++r) {
            if (!is_lost(group.Holder(s, r))) pieces[k + r] = {shares[s][r].data(), shares[s][r].size()};
          }
          ParityGroup::Range mine = group.Block(rebuilt.size(), b);
          ASSERT_OK(code.Rebuild(pieces, shares[s][0].size(),
                                 {{*group.DataIndexOf(s, victim), rebuilt.data() + mine.offset, mine.bytes}}));
        }
        EXPECT_TRUE(rebuilt == images[victim]) << "member " << victim << " rebuilt wrong";
      }
    }
  }
}


// A group of ParityStores as the members' daemons hold them: every member's ranks' images cut into
// blocks and sent, part by part, to their stripes' holders.
class ParityStoreGroup {
 public:
  ParityStoreGroup(uint32_t members, uint32_t parity, uint64_t budget_per_member = ~0ull)
      : group_(ParityGroup::Make(members, parity).value()), used_(members, 0) {
    for (uint32_t i = 0; i < members; ++i) {
      HostMemory memory;
      memory.reserve = [this, i, budget_per_member](uint64_t bytes, const std::string& what) {
        if (used_[i] + bytes > budget_per_member) return ResourceExhausted(what + " is over the budget");
        used_[i] += bytes;
        return Status::OK();
      };
      memory.release = [this, i](uint64_t bytes) { used_[i] -= bytes; };
      stores_.push_back(std::make_unique<ParityStore>(group_, i, memory));
    }
  }
  static constexpr uint64_t kPart = 64 * 1024;
  static ReplicaMeta Meta(const std::string& job, uint32_t rank, int64_t step, uint64_t bytes) {
    ReplicaMeta m;
    m.job = job;
    m.rank = rank;
    m.step = step;
    m.bytes = bytes;
    m.part_bytes = kPart;
    m.layout = "layout of rank " + std::to_string(rank);
    return m;
  }
  // Sends block `block` of `image` (rank `rank`, at `position` of the member's `ranks`) to every holder.
  // `attempt`: the rank's attempt number (ReplicaMeta::attempt; each rank numbers its own).
  Status Send(const std::string& job, int64_t step, uint32_t member, uint32_t rank, uint32_t position,
              uint32_t ranks, const std::vector<uint8_t>& image, uint32_t block, uint64_t attempt = 0) {
    uint32_t stripe = group_.StripeOfBlock(member, block);
    ParityGroup::Range range = group_.Block(image.size(), block);
    for (uint32_t r = 0; r < group_.parity(); ++r) {
      ShareBlock header{member, stripe, position, ranks, Meta(job, rank, step, image.size())};
      header.meta.attempt = attempt;
      auto incoming = stores_[group_.Holder(stripe, r)]->Begin(header);
      if (!incoming.ok()) return incoming.status();
      for (uint64_t off = 0; off < range.bytes; off += kPart) {
        const char* p = reinterpret_cast<const char*>(image.data() + range.offset + off);
        size_t n = std::min<uint64_t>(kPart, range.bytes - off);
        RETURN_IF_ERROR((*incoming)->Append({{p, n / 2}, {p + n / 2, n - n / 2}}, Xxh3(p, n)));
      }
      RETURN_IF_ERROR(stores_[group_.Holder(stripe, r)]->Finish(std::move(*incoming)));
    }
    return Status::OK();
  }
  // Rebuilds `member`'s image of `rank` at `position` from the shares held and the images of the
  // members not in `lost`.
  Result<std::vector<uint8_t>> Rebuild(const std::string& job, uint32_t member, uint32_t position,
                                       const std::vector<uint32_t>& lost,
                                       const std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>>& images) {
    auto is_lost = [&](uint32_t m) { return std::find(lost.begin(), lost.end(), m) != lost.end(); };
    const ParityCode code = ParityCode::Make(group_.data_blocks(), group_.parity()).value();
    std::vector<uint8_t> out;
    for (uint32_t b = 0; b < group_.data_blocks(); ++b) {
      uint32_t s = group_.StripeOfBlock(member, b);
      std::vector<ParityCode::Piece> pieces(group_.members());
      std::shared_ptr<const ParityShare> any;
      for (uint32_t r = 0; r < group_.parity(); ++r) {
        if (is_lost(group_.Holder(s, r))) continue;
        auto share = stores_[group_.Holder(s, r)]->Find(job, position, s);
        if (!share.ok()) return share.status();
        pieces[group_.data_blocks() + r] = {(*share)->data(), (*share)->bytes()};
        any = *share;
      }
      if (!any) return NotFound("every holder of the stripe is lost");
      auto mine = any->contributions().find(*group_.DataIndexOf(s, member));
      if (mine == any->contributions().end()) return NotFound("the member has no rank at that position");
      if (out.empty()) out.resize(mine->second.meta.bytes);
      for (const auto& [d, c] : any->contributions()) {
        if (is_lost(c.member)) continue;
        const std::vector<uint8_t>& image = images.at({c.member, position});
        ParityGroup::Range range = group_.Block(image.size(), *group_.BlockOfStripe(c.member, s));
        pieces[d] = {image.data() + range.offset, range.bytes};
      }
      // Members with no rank at the position count as zeros.
      for (uint32_t d = 0; d < group_.data_blocks(); ++d) {
        uint32_t m = group_.DataMember(s, d);
        if (!any->contributions().count(d) && !is_lost(m)) pieces[d] = {out.data(), 0};
      }
      ParityGroup::Range range = group_.Block(out.size(), b);
      RETURN_IF_ERROR(code.Rebuild(pieces, any->bytes(), {{*group_.DataIndexOf(s, member), out.data() + range.offset, range.bytes}}));
    }
    return out;
  }
  // Every loss of parity() members: each lost member's ranks (every position `images` holds of it)
  // come back bit for bit.
  void ExpectEveryLossRebuilt(const std::string& job,
                              const std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>>& images) {
    for (const std::vector<uint32_t>& lost : Subsets(group_.members(), group_.parity())) {
      for (uint32_t victim : lost) {
        for (auto it = images.lower_bound({victim, 0}); it != images.end() && it->first.first == victim; ++it) {
          const uint32_t p = it->first.second;
          auto rebuilt = Rebuild(job, victim, p, lost, images);
          ASSERT_OK(rebuilt.status());
          EXPECT_TRUE(*rebuilt == it->second) << "member " << victim << " position " << p;
        }
      }
    }
  }
  ParityStore& store(uint32_t i) { return *stores_[i]; }
  uint64_t used(uint32_t i) const { return used_[i]; }
  const ParityGroup& group() const { return group_; }

 private:
  ParityGroup group_;
  std::vector<uint64_t> used_;
  std::vector<std::unique_ptr<ParityStore>> stores_;
};

// Members with two ranks each but the last, which has one: each holder completes its shares once
// every data member of the stripe has sent its block of each position it has, holds M/K of the
// images (not a copy), and any M lost members' ranks come back bit for bit.
TEST(ParityStoreTest, HoldersCompleteSharesFromEveryMembersBlocksAndALostMembersRanksAreRebuilt) {
  std::mt19937_64 rng(3);
  for (auto [g, m] : std::vector<std::pair<uint32_t, uint32_t>>{{4, 1}, {6, 2}}) {
    SCOPED_TRACE(std::to_string(g) + " members, " + std::to_string(m) + " parity");
    ParityStoreGroup members(g, m);
    std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>> images;  // (member, position)
    uint64_t largest = 0;
    for (uint32_t i = 0; i < g; ++i) {
      uint32_t ranks = i + 1 == g ? 1 : 2;
      for (uint32_t p = 0; p < ranks; ++p) {
        images[{i, p}] = RandomBytes(rng, 300000 + 70001 * p + 1000 * i);
        largest = std::max<uint64_t>(largest, images[{i, p}].size());
      }
    }
    for (const auto& [where, image] : images) {
      auto [i, p] = where;
      uint32_t ranks = i + 1 == g ? 1 : 2;
      for (uint32_t b = 0; b < members.group().data_blocks(); ++b) {
        ASSERT_OK(members.Send("job", 17, i, 10 * i + p, p, ranks, image, b));
      }
    }
    for (uint32_t i = 0; i < g; ++i) {
      // M stripes held, two positions each.
      EXPECT_EQ(members.store(i).complete_count(), 2 * m) << "member " << i;
      EXPECT_EQ(members.store(i).building_bytes(), 0u);
      EXPECT_LE(members.store(i).held_bytes(), 2 * m * members.group().BlockBytes(largest));
      EXPECT_EQ(members.used(i), members.store(i).held_bytes());
    }
    members.ExpectEveryLossRebuilt("job", images);
  }
}

// A member whose second rank registered late: its first rank's blocks of step 17 said one rank, so
// the holders completed the shares of position 1 without it; the late rank's blocks (two ranks) go
// into copies of those shares, which replace them, and every rank comes back.
TEST(ParityStoreTest, ALateRanksBlockGoesIntoACopyOfTheShareCompletedWithoutIt) {
  std::mt19937_64 rng(5);
  for (auto [g, m] : std::vector<std::pair<uint32_t, uint32_t>>{{4, 1}, {6, 2}}) {
    SCOPED_TRACE(std::to_string(g) + " members, " + std::to_string(m) + " parity");
    ParityStoreGroup members(g, m);
    const uint32_t late_member = 1;
    std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>> images;  // (member, position)
    for (uint32_t i = 0; i < g; ++i) {
      for (uint32_t p = 0; p < 2; ++p) images[{i, p}] = RandomBytes(rng, 200000 + 1000 * i + 333 * p);
    }
    // Each rank's attempt number is its own (the clock when it first offered): the late rank's is the largest.
    auto send = [&](uint32_t i, uint32_t p, uint32_t ranks) {
      for (uint32_t b = 0; b < members.group().data_blocks(); ++b) {
        ASSERT_OK(members.Send("job", 17, i, 10 * i + p, p, ranks, images.at({i, p}), b, 1000 + 10 * i + p));
      }
    };
    for (uint32_t i = 0; i < g; ++i) {
      if (i != late_member) {
        send(i, 0, 2);
        send(i, 1, 2);
      }
    }
    send(late_member, 0, 1);  // before its other rank registered
    for (uint32_t i = 0; i < g; ++i) EXPECT_EQ(members.store(i).complete_count(), 2 * m) << "member " << i;
    for (uint32_t s = 0; s < g; ++s) {
      if (!members.group().DataIndexOf(s, late_member)) continue;
      auto held = members.store(members.group().Holder(s, 0)).Find("job", 1, s, 17);
      ASSERT_OK(held.status());
      EXPECT_EQ((*held)->contributions().count(*members.group().DataIndexOf(s, late_member)), 0u);
    }
    send(late_member, 1, 2);  // the late rank
    for (uint32_t i = 0; i < g; ++i) {
      EXPECT_EQ(members.store(i).complete_count(), 2 * m) << "member " << i;
      EXPECT_EQ(members.store(i).building_bytes(), 0u) << "member " << i;
    }
    members.ExpectEveryLossRebuilt("job", images);
  }
}

// A member with no ranks of the job sends no blocks: the shares of its stripes wait for it until it
// tells their holders it has none at the step (Tell), then complete, and a lost member's ranks come
// back with the idle member's pieces counted as zeros.
TEST(ParityStoreTest, AMembersWordThatItHasNoRanksOfTheJobCompletesTheSharesWithoutIt) {
  std::mt19937_64 rng(11);
  for (auto [g, m] : std::vector<std::pair<uint32_t, uint32_t>>{{4, 1}, {6, 2}}) {
    SCOPED_TRACE(std::to_string(g) + " members, " + std::to_string(m) + " parity");
    ParityStoreGroup members(g, m);
    const uint32_t idle = g - 1;
    std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>> images;  // (member, position)
    for (uint32_t i = 0; i < idle; ++i) {
      for (uint32_t p = 0; p < 2; ++p) {
        images[{i, p}] = RandomBytes(rng, 150000 + 999 * i + 77 * p);
        for (uint32_t b = 0; b < members.group().data_blocks(); ++b) {
          ASSERT_OK(members.Send("job", 17, i, 10 * i + p, p, 2, images.at({i, p}), b));
        }
      }
    }
    auto waiting = [&] {
      uint32_t n = 0;
      for (uint32_t b = 0; b < members.group().data_blocks(); ++b) {
        const uint32_t s = members.group().StripeOfBlock(idle, b);
        for (uint32_t r = 0; r < m; ++r) n += members.store(members.group().Holder(s, r)).Find("job", 0, s).ok() ? 0 : 1;
      }
      return n;
    };
    EXPECT_EQ(waiting(), members.group().data_blocks() * m) << "every share of the idle member's stripes waits for it";

    // Told wrongly: a count above 0 without a block, or to a member that holds no share of the stripe.
    const uint32_t first = members.group().StripeOfBlock(idle, 0);
    const uint32_t holder = members.group().Holder(first, 0);
    EXPECT_EQ(members.store(holder).Tell({idle, first, 0, 1, ParityStoreGroup::Meta("job", 0, 17, 0)}).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(members.store(idle).Tell({idle, first, 0, 0, ParityStoreGroup::Meta("job", 0, 17, 0)}).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(waiting(), members.group().data_blocks() * m);

    for (uint32_t b = 0; b < members.group().data_blocks(); ++b) {
      const uint32_t s = members.group().StripeOfBlock(idle, b);
      for (uint32_t r = 0; r < m; ++r) {
        ASSERT_OK(members.store(members.group().Holder(s, r)).Tell({idle, s, 0, 0, ParityStoreGroup::Meta("job", 0, 17, 0)}));
      }
    }
    EXPECT_EQ(waiting(), 0u);
    for (uint32_t i = 0; i < g; ++i) EXPECT_EQ(members.store(i).complete_count(), 2 * m) << "member " << i;
    members.ExpectEveryLossRebuilt("job", images);  // the idle member has no ranks: none of its own to rebuild
  }
}

TEST(ParityStoreTest, ABlockThatDoesNotArriveWholeSpoilsOnlyItsStepsShare) {
  std::mt19937_64 rng(9);
  ParityStoreGroup members(4, 1);
  std::vector<std::vector<uint8_t>> images;
  for (uint32_t i = 0; i < 4; ++i) images.push_back(RandomBytes(rng, 400000));
  auto send_all = [&](int64_t step, uint32_t skip_member) {
    for (uint32_t i = 0; i < 4; ++i) {
      if (i == skip_member) continue;
      for (uint32_t b = 0; b < 3; ++b) ASSERT_OK(members.Send("job", step, i, i, 0, 1, images[i], b));
    }
  };
  send_all(17, 4);
  auto held = members.store(0).Find("job", 0, 0);
  ASSERT_OK(held.status());
  EXPECT_EQ((*held)->step(), 17);

  // Step 18: member 1's block for stripe 0 (held by member 0) arrives with a bad checksum, then is dropped.
  send_all(18, 1);
  uint32_t block = *members.group().BlockOfStripe(1, 0);
  ParityGroup::Range range = members.group().Block(images[1].size(), block);
  {
    auto incoming = members.store(0).Begin({1, 0, 0, 1, ParityStoreGroup::Meta("job", 1, 18, images[1].size())});
    ASSERT_OK(incoming.status());
    const char* p = reinterpret_cast<const char*>(images[1].data() + range.offset);
    EXPECT_EQ((*incoming)->Append({{p, ParityStoreGroup::kPart}}, 42).code(), StatusCode::kCorruption);
  }
  auto still = members.store(0).Find("job", 0, 0);
  ASSERT_OK(still.status());
  EXPECT_EQ((*still)->step(), 17) << "the complete share must stay while the next one fails";
  {
    // A second push of a block still arriving (the sender's retry while the first push's handler
    // runs) is not told that the block is held: the first may yet fail, as it does here.
    auto first = members.store(0).Begin({1, 0, 0, 1, ParityStoreGroup::Meta("job", 1, 19, images[1].size())});
    ASSERT_OK(first.status());
    auto again = members.store(0).Begin({1, 0, 0, 1, ParityStoreGroup::Meta("job", 1, 19, images[1].size())});
    EXPECT_EQ(again.status().code(), StatusCode::kUnavailable) << again.status().ToString();
  }
  EXPECT_EQ(members.store(0).building_bytes(), 0u) << "the spoiled share must be dropped";

  // A block for a stripe the member holds nothing of, or from a member that holds its parity, is refused.
  EXPECT_EQ(members.store(0).Begin({2, 1, 0, 1, ParityStoreGroup::Meta("job", 2, 18, 400000)}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(members.store(0).Begin({0, 0, 0, 1, ParityStoreGroup::Meta("job", 0, 18, 400000)}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(members.store(0).Begin({1, 0, 1, 1, ParityStoreGroup::Meta("job", 1, 18, 400000)}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(ParityStoreTest, AShareOverTheBudgetIsRefusedBeforeItsData) {
  ParityStoreGroup members(4, 1, /*budget_per_member=*/100000);
  auto incoming = members.store(0).Begin({1, 0, 0, 1, ParityStoreGroup::Meta("job", 1, 5, 3 * 200000)});
  EXPECT_EQ(incoming.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(members.used(0), 0u);
  EXPECT_EQ(members.store(0).building_bytes(), 0u);
  EXPECT_EQ(members.store(0).share_count(), 0u);  // no empty share left behind for the refused block
}


// A member of a parity group as its daemon serves it: a ParityStore and its service on a replica
// listener (loopback, real gRPC), its own ranks' images for FetchBlock.
// A member (bench/parity_member.h) whose own memory checkpoints are `images`, of run "run-a".
struct ServedMember : bench::ParityMember {
  ServedMember(const ParityGroup& group, uint32_t index, std::vector<std::string> allow = {},
               std::vector<std::string> hosts = {}, std::chrono::milliseconds stall = kReplicaStallTimeout)
      : ParityMember(
            group, index,
            [this](const std::string& job, uint32_t rank, int64_t step, const std::string& run_id,
                   int64_t) -> Result<OwnImage> {
              auto it = images.find({job, rank, step});
              if (it == images.end() || run_id != "run-a") return NotFound("not held");
              return OwnImage{nullptr, reinterpret_cast<const char*>(it->second.data()), it->second.size(), {}};
            },
            std::move(allow), std::move(hosts), stall) {}
  std::map<std::tuple<std::string, uint32_t, int64_t>, std::vector<uint8_t>> images;
};

// A member at each place of `group`, served on loopback.
Result<std::vector<std::unique_ptr<ServedMember>>> ServeGroup(const ParityGroup& group) {
  std::vector<std::unique_ptr<ServedMember>> members;
  for (uint32_t i = 0; i < group.members(); ++i) {
    members.push_back(std::make_unique<ServedMember>(group, i));
    RETURN_IF_ERROR(members.back()->Start());
  }
  return members;
}

// Pushes member `from`'s image of `step` (rank 10 + from, run "run-a") over gRPC to the holders of
// the stripes its blocks go into: all of them, or only member `only_holder`.
Status PushImage(const ParityGroup& group, const std::vector<std::unique_ptr<ServedMember>>& members, uint32_t from,
                 int64_t step, const std::vector<uint8_t>& image, std::chrono::system_clock::time_point deadline,
                 std::optional<uint32_t> only_holder = std::nullopt) {
  ReplicaMeta meta = ParityStoreGroup::Meta("job", 10 + from, step, image.size());
  meta.run_id = "run-a";
  for (uint32_t b = 0; b < group.data_blocks(); ++b) {
    const uint32_t stripe = group.StripeOfBlock(from, b);
    const ParityGroup::Range range = group.Block(image.size(), b);
    for (uint32_t r = 0; r < group.parity(); ++r) {
      const uint32_t holder = group.Holder(stripe, r);
      if (only_holder && holder != *only_holder) continue;
      RETURN_IF_ERROR(PushParityBlock(members[holder]->channel.get(), {from, stripe, 0, 1, meta},
                                      reinterpret_cast<const char*>(image.data() + range.offset), range.bytes,
                                      deadline));
    }
  }
  return Status::OK();
}

// Every member pushes its rank's blocks to their holders over gRPC; any `parity` members are then
// lost (their servers shut down), and each lost member's rank is found in the survivors' listings
// and rebuilt bit for bit from the survivors' own blocks and shares; one member more than the code
// covers is refused.
TEST(ParityServiceTest, LostMembersRanksAreRebuiltOverGrpcFromTheSurvivorsBlocksAndShares) {
  std::mt19937_64 rng(21);
  for (auto [g, m, lost] : std::vector<std::tuple<uint32_t, uint32_t, std::vector<uint32_t>>>{
           {4, 1, {2}}, {6, 2, {1, 4}}, {4, 1, {0, 3}}}) {
    SCOPED_TRACE(std::to_string(g) + " members, " + std::to_string(m) + " parity");
    ParityGroup group = ParityGroup::Make(g, m).value();
    ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<ServedMember>> members, ServeGroup(group));
    const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(30);
    for (uint32_t i = 0; i < g; ++i) {
      std::vector<uint8_t> image = RandomBytes(rng, 1000000 + 4097 * i);
      ASSERT_OK(PushImage(group, members, i, 17, image, deadline));
      members[i]->images[{"job", 10 + i, 17}] = std::move(image);
    }
    for (uint32_t i = 0; i < g; ++i) EXPECT_EQ(members[i]->service.blocks_received(), m * group.data_blocks());

    for (uint32_t i : lost) members[i]->server->Shutdown(std::chrono::system_clock::now());
    std::vector<ParityMember> survivors;
    for (uint32_t i = 0; i < g; ++i) {
      if (std::find(lost.begin(), lost.end(), i) == lost.end()) {
        survivors.push_back({i, "member " + std::to_string(i), members[i]->channel});
      }
    }
    for (uint32_t victim : lost) {
      auto candidate = FindParityCandidate(group, survivors, "job", victim, 10 + victim, deadline, {});
      if (lost.size() > m) {
        // A candidate may still be listed (some stripes keep their shares), but it cannot be rebuilt.
        if (!candidate.ok()) continue;
        std::vector<char> out(candidate->meta.bytes);
        EXPECT_EQ(RebuildFromParity(group, survivors, *candidate, victim, out.data(), deadline).code(),
                  StatusCode::kFailedPrecondition);
        continue;
      }
      ASSERT_OK(candidate.status());
      EXPECT_EQ(candidate->meta.step, 17);
      EXPECT_EQ(candidate->meta.rank, 10 + victim);
      std::vector<char> out(candidate->meta.bytes, 0);
      ASSERT_OK(RebuildFromParity(group, survivors, *candidate, victim, out.data(), deadline));
      const std::vector<uint8_t>& want = members[victim]->images[{"job", 10 + victim, 17}];
      ASSERT_EQ(out.size(), want.size());
      EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size()), 0) << "member " << victim << " rebuilt wrong";
    }
    for (auto& member : members) member->server->Shutdown(std::chrono::system_clock::now());
  }
}


// A member whose Parity.FetchShare serves a share's first `good_bytes` bytes and then a part whose
// checksum fails, or (`stall`) then sends nothing more until the call is cancelled (a member that
// hangs; 50 s at most); its Parity.FetchBlock serves its own blocks (from `real`'s images) whole,
// or (`stall`) hangs after `good_bytes` as well.
class ShareBreakingOff final : public v1::Parity::Service {
 public:
  ShareBreakingOff(const ParityGroup& group, const ServedMember* real, uint32_t index, uint64_t good_bytes,
                   bool stall = false)
      : group_(group), real_(real), index_(index), good_bytes_(good_bytes), stall_(stall) {}
  grpc::Status FetchShare(grpc::ServerContext* ctx, const v1::FetchShareRequest* request,
                          grpc::ServerWriter<v1::ParityPart>* writer) override {
    auto share = real_->parity.Find(request->job(), request->position(), request->stripe(), request->step());
    if (!share.ok()) return grpc::Status(grpc::StatusCode::NOT_FOUND, share.status().ToString());
    const char* data = reinterpret_cast<const char*>((*share)->data());
    for (uint64_t at = 0; at < (*share)->bytes(); at += kPart) {
      const uint64_t n = std::min(kPart, (*share)->bytes() - at);
      const bool bad = at >= good_bytes_;
      if (bad && stall_) return Stall(ctx);
      if (!writer->Write(Part(data + at, n, bad))) break;
      if (bad) {
        broken_.fetch_add(1);
        break;
      }
    }
    return grpc::Status::OK;
  }
  grpc::Status FetchBlock(grpc::ServerContext* ctx, const v1::FetchBlockRequest* request,
                          grpc::ServerWriter<v1::ParityPart>* writer) override {
    auto image = real_->images.find({request->job(), request->rank(), request->step()});
    const std::optional<uint32_t> block = group_.BlockOfStripe(index_, request->stripe());
    if (image == real_->images.end() || !block) return grpc::Status(grpc::StatusCode::NOT_FOUND, "not held");
    const ParityGroup::Range range = group_.Block(image->second.size(), *block);
    const char* data = reinterpret_cast<const char*>(image->second.data()) + range.offset;
    for (uint64_t at = 0; at < range.bytes; at += kPart) {
      if (stall_ && at >= good_bytes_) return Stall(ctx);
      if (!writer->Write(Part(data + at, std::min(kPart, range.bytes - at), false))) break;
    }
    return grpc::Status::OK;
  }
  uint64_t broken() const { return broken_.load(); }

 private:
  static constexpr uint64_t kPart = 1u << 20;
  grpc::Status Stall(grpc::ServerContext* ctx) {
    broken_.fetch_add(1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(50);
    while (!ctx->IsCancelled() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "stalled");
  }
  static v1::ParityPart Part(const char* data, uint64_t n, bool bad) {
    v1::ParityPart part;
    part.set_data(data, n);
    part.set_xxh3(Xxh3(data, n) + (bad ? 1 : 0));
    return part;
  }
  const ParityGroup group_;
  const ServedMember* real_;
  uint32_t index_;
  uint64_t good_bytes_;
  bool stall_;
  std::atomic<uint64_t> broken_{0};
};

// A rebuild decodes a block behind the fetches of its pieces, a window at a time, through rings
// (here 2 MiB rings and 256 KiB windows, so 6-8 MB pieces wrap their rings and wait for the decode).
// 6 members, 2 parity; member 0 (24 MB image, 6 MB blocks; the others' 32 MB) is lost.
// - A share that breaks off after 5 MiB (a part that fails its checksum), after the decode used
//   its first windows: the other share of the stripe takes its place, and the block is fetched and
//   decoded again.
// - Both shares of a stripe break off at 7 MiB, past member 0's block: the block is decoded before
//   that, and the failure of bytes it does not need neither fails the rebuild nor redoes it.
// - The same two with members that stop sending instead, shares and blocks alike (a member that
//   hangs; the rebuild's stall time is 300 ms): the hung share is cancelled and replaced, and the
//   hung member's pieces of the later stripes are asked for last (not at all here: it hangs once);
//   the hung fetches past the block are cancelled once it is decoded. Either way the rebuild ends in
//   seconds, not at its deadline (40 s) or when the hung member gives up (50 s).
// Each time member 0's image comes back bit for bit.
TEST(ParityServiceTest, AShareThatBreaksOffMidwayIsReplacedAndOneThatBreaksPastTheBlockIsNotBlamed) {
  std::mt19937_64 rng(33);
  const ParityGroup group = ParityGroup::Make(6, 2).value();
  ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<ServedMember>> members, ServeGroup(group));
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(60);
  for (uint32_t i = 0; i < group.members(); ++i) {
    std::vector<uint8_t> image = RandomBytes(rng, i == 0 ? 24000000 : 32000000 + 4097 * i);
    ASSERT_OK(PushImage(group, members, i, 17, image, deadline));
    members[i]->images[{"job", 10 + i, 17}] = std::move(image);
  }
  members[0]->server->Shutdown(std::chrono::system_clock::now());
  std::vector<ParityMember> survivors;
  for (uint32_t i = 1; i < group.members(); ++i) {
    survivors.push_back({i, "member " + std::to_string(i), members[i]->channel});
  }
  ASSERT_OK_AND_ASSIGN(ParityCandidate candidate, FindParityCandidate(group, survivors, "job", 0, 10, deadline, {}));
  ASSERT_EQ(candidate.blocks[0].size(), 2u);  // both shares of block 0's stripe are listed
  const std::vector<uint8_t>& want = members[0]->images[{"job", 10, 17}];
  const RebuildStreaming small{256u << 10, 2u << 20};
  {
    // Members send 1 MiB parts: a ring of 1 MiB with 256 KiB windows takes none, and says so; a ring
    // that is not a whole number of pages is refused before anything is fetched.
    std::vector<char> out(candidate.meta.bytes, 0);
    const Status refused =
        RebuildFromParity(group, survivors, candidate, 0, out.data(), deadline, {256u << 10, 1u << 20});
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
    EXPECT_NE(refused.message().find("a part of 1048576 bytes, more than a rebuild takes at once (786432)"),
              std::string::npos)
        << refused.ToString();
    EXPECT_EQ(RebuildFromParity(group, survivors, candidate, 0, out.data(), deadline, {256u << 10, 1000000}).code(),
              StatusCode::kInvalidArgument);
  }

  struct Case {
    std::string what;
    std::vector<uint32_t> liars;  // the holders of block 0's stripe whose shares break off
    uint64_t good_bytes;
    bool stall;  // they stop sending instead of sending a bad part
  };
  const uint32_t first = candidate.blocks[0][0].holder->index, second = candidate.blocks[0][1].holder->index;
  for (const Case& c : std::vector<Case>{{"midway", {first}, 5u << 20, false},
                                         {"past the block", {first, second}, 7u << 20, false},
                                         {"stalls midway", {first}, 5u << 20, true},
                                         {"stalls past the block", {first, second}, 7u << 20, true}}) {
    SCOPED_TRACE(c.what);
    std::vector<std::unique_ptr<ShareBreakingOff>> liars;
    std::vector<std::unique_ptr<grpc::Server>> servers;
    for (ParityMember& m : survivors) {
      m.channel = members[m.index]->channel;
      if (std::find(c.liars.begin(), c.liars.end(), m.index) == c.liars.end()) continue;
      liars.push_back(
          std::make_unique<ShareBreakingOff>(group, members[m.index].get(), m.index, c.good_bytes, c.stall));
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      builder.RegisterService(liars.back().get());
      servers.push_back(builder.BuildAndStart());
      ASSERT_NE(servers.back(), nullptr);
      m.channel = ReplicaChannel({"127.0.0.1:" + std::to_string(port), "", "", "", ""}).value();
    }
    std::vector<char> out(candidate.meta.bytes, 0);
    RebuildStreaming streaming = small;
    streaming.stall = std::chrono::milliseconds(300);
    const auto started = std::chrono::steady_clock::now();
    ASSERT_OK(RebuildFromParity(group, survivors, candidate, 0, out.data(),
                                std::chrono::system_clock::now() + std::chrono::seconds(40), streaming));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    EXPECT_LT(seconds, 20.0) << "the rebuild waited on a hung member";
    if (c.liars.size() == 1) {
      EXPECT_GE(liars[0]->broken(), 1u);  // it did break off (or hang), within the block
      if (c.stall) {
        EXPECT_EQ(liars[0]->broken(), 1u) << "a member that hung was asked again";
      }
    }
    ASSERT_EQ(out.size(), want.size());
    EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size()), 0) << "member 0 rebuilt wrong";
    for (auto& server : servers) server->Shutdown(std::chrono::system_clock::now());
  }
  for (auto& member : members) member->server->Shutdown(std::chrono::system_clock::now());
}

// A holder that refuses release words while `refuse_words` is set (as a member that cannot be
// reached for a moment) and takes blocks, read and dropped; it counts both.
class WordCounter final : public v1::Parity::Service {
 public:
  grpc::Status Push(grpc::ServerContext*, grpc::ServerReader<v1::ParityPart>* reader,
                    v1::ParityPushResponse*) override {
    v1::ParityPart part;
    if (!reader->Read(&part) || !part.has_header()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "header");
    const bool word = part.header().released();
    while (reader->Read(&part)) {
    }
    if (!word) {
      blocks.fetch_add(1);
    } else if (refuse_words.load()) {
      refused.fetch_add(1);
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "not now");
    } else {
      words.fetch_add(1);
    }
    return grpc::Status::OK;
  }
  std::atomic<bool> refuse_words{true};
  std::atomic<int> refused{0}, words{0}, blocks{0};
};

// A loopback port that listens and never accepts: connections complete in the kernel's accept
// queue, and a call waits for an answer that never comes.
class SilentPort {
 public:
  SilentPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof address;
    ok_ = fd_ >= 0 && ::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
          ::listen(fd_, 16) == 0 && ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length) == 0;
    port_ = ntohs(address.sin_port);
  }
  ~SilentPort() {
    if (fd_ >= 0) ::close(fd_);
  }
  SilentPort(const SilentPort&) = delete;
  SilentPort& operator=(const SilentPort&) = delete;
  bool ok() const { return ok_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  // Connections waiting in the accept queue (a listening socket's TCP_INFO counts them in tcpi_unacked).
  uint32_t queued() const {
    tcp_info info{};
    socklen_t n = sizeof info;
    return ::getsockopt(fd_, IPPROTO_TCP, TCP_INFO, &info, &n) == 0 ? info.tcpi_unacked : 0u;
  }

 private:
  int fd_ = -1;
  bool ok_ = false;
  uint16_t port_ = 0;
};

// A release word that could not be sent waits for its retry (1 s) in the member's queue; the job's
// blocks offered meanwhile (it runs here again) drop it, so it never reaches a holder after them,
// where it would count against them. 4 members, parity 1: member 0's blocks go to the three others.
TEST(ParitySenderTest, AReleaseWordStillQueuedIsDroppedWhenTheJobsBlocksAreOfferedAgain) {
  const ParityGroup group = ParityGroup::Make(4, 1).value();
  WordCounter counter;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&counter);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ParitySender::Options options{group, 0, {}, 64 * 1024, {}, {}, {}};
  for (uint32_t j = 1; j < group.members(); ++j) {
    options.members.emplace_back(j, ReplicaPeer{"127.0.0.1:" + std::to_string(port), "", "", "", ""});
  }
  ParitySender sender(std::move(options));
  ASSERT_OK(sender.Start());
  auto wait_until = [](const std::function<bool()>& done) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!done() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return done();
  };
  sender.OfferReleased("job");
  ASSERT_TRUE(wait_until([&] { return counter.refused.load() >= 3; })) << counter.refused.load();
  counter.refuse_words = false;  // the retry, a second from now, would be taken

  auto image = std::make_shared<std::vector<char>>(300000, 7);
  auto replica = std::make_shared<OutgoingReplica>();
  replica->meta = ParityStoreGroup::Meta("job", 10, 18, image->size());
  replica->data = image->data();
  replica->keep = image;
  sender.Offer({replica, 0, 1});
  ASSERT_TRUE(wait_until([&] { return counter.blocks.load() >= 3; })) << counter.blocks.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // past the word's retry
  EXPECT_EQ(counter.blocks.load(), 3);
  EXPECT_EQ(counter.words.load(), 0) << "a release word reached a holder after the job's blocks";
  sender.Stop();
  server->Shutdown(std::chrono::system_clock::now());
}

// Every member's image of step 17 (300000 + 4097 x member bytes of `rng`) pushed as blocks into
// its stripes' shares over gRPC, as the members' senders would.
Status PushEveryMembersImage(const ParityGroup& group, std::vector<std::unique_ptr<ServedMember>>& members,
                             std::mt19937_64& rng) {
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(30);
  for (uint32_t i = 0; i < group.members(); ++i) {
    RETURN_IF_ERROR(PushImage(group, members, i, 17, RandomBytes(rng, 300000 + 4097 * i), deadline));
  }
  return Status::OK();
}

size_t SharesHeld(const std::vector<std::unique_ptr<ServedMember>>& members) {
  size_t n = 0;
  for (const auto& member : members) n += member->parity.share_count();
  return n;
}

// Over gRPC, with each member's own ParitySender (as a daemon wires it to a job's release): once a
// member has said that it gave the job's memory back, no holder holds a share its block is in (4
// members, parity 1); once the others have too, none holds any.
TEST(ParityServiceTest, ReleasedJobsSharesAreDroppedByTheirHoldersOverGrpc) {
  std::mt19937_64 rng(43);
  const ParityGroup group = ParityGroup::Make(4, 1).value();
  ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<ServedMember>> members, ServeGroup(group));
  ASSERT_OK(PushEveryMembersImage(group, members, rng));
  std::vector<std::unique_ptr<ParitySender>> senders;
  for (uint32_t i = 0; i < group.members(); ++i) {
    ParitySender::Options options{group, i, {}, 64 * 1024, {}, {}, {}};
    for (uint32_t j = 0; j < group.members(); ++j) {
      if (j == i) continue;
      options.members.emplace_back(
          j, ReplicaPeer{"127.0.0.1:" + std::to_string(members[j]->server->port()), "", "", "", ""});
    }
    senders.push_back(std::make_unique<ParitySender>(std::move(options)));
    ASSERT_OK(senders.back()->Start());
  }
  auto shares = [&] { return SharesHeld(members); };
  auto wait_for = [&](size_t want) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (shares() != want && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return shares();
  };
  ASSERT_EQ(shares(), 4u);
  senders[0]->OfferReleased("job");
  EXPECT_EQ(wait_for(1), 1u);  // member 0's own share, coded from members 1, 2 and 3 alone
  EXPECT_EQ(members[0]->parity.share_count(), 1u);
  senders[3]->OfferReleased("job");
  EXPECT_EQ(wait_for(0), 0u);
  for (auto& member : members) EXPECT_EQ(member->parity.held_bytes(), 0u);
  for (auto& sender : senders) {
    for (const ParityMemberStatus& status : sender->MemberStatus()) {
      EXPECT_EQ(status.pushes_failed, 0u) << status.last_error;
      EXPECT_EQ(status.blocks_sent, 0u) << "a release is not a checkpoint's blocks";
    }
    sender->Stop();
  }
  for (auto& member : members) member->server->Shutdown(std::chrono::system_clock::now());
}


// A released job's blocks being pushed (to members that take connections and never answer) are
// cancelled by Forget: the push lets go of the rank's memory at once, not at its 5-minute deadline.
TEST(ParitySenderTest, ForgettingAJobCancelsThePushOfItsBlocksUnderWay) {
  const ParityGroup group = ParityGroup::Make(4, 1).value();
  SilentPort silent;
  ASSERT_TRUE(silent.ok());
  ParitySender::Options options{group, 0, {}, 64 * 1024, {}, {}, {}};
  for (uint32_t j = 1; j < group.members(); ++j) {
    options.members.emplace_back(j, ReplicaPeer{silent.target(), "", "", "", ""});
  }
  ParitySender sender(std::move(options));
  ASSERT_OK(sender.Start());
  auto image = std::make_shared<std::vector<char>>(300000, 7);
  std::weak_ptr<std::vector<char>> held = image;
  auto replica = std::make_shared<OutgoingReplica>();
  replica->meta = ParityStoreGroup::Meta("job", 10, 18, image->size());
  replica->data = image->data();
  replica->keep = std::move(image);
  sender.Offer({std::move(replica), 0, 1});
  // The pushes are under way once their connections wait in the port's accept queue (a listening
  // socket's TCP_INFO counts them in tcpi_unacked).
  const auto until_queued = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (silent.queued() == 0 && std::chrono::steady_clock::now() < until_queued) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GT(silent.queued(), 0u) << "no push reached the member";
  ASSERT_FALSE(held.expired());
  sender.Forget("job");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!held.expired() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(held.expired()) << "the forgotten job's blocks were still being pushed 10 s later";
  sender.Stop();
}

// A release word that no holder heard before its sender stopped stays kept (Options::keep_word, which
// the daemon turns into a state record): the holders' address takes connections and never answers,
// so the stop cancels the words in flight. The next sender, offered it again as the daemon does at
// start, gets it to the holders: they drop the shares as they would have the first time, and the
// record goes once every holder has it.
TEST(ParityServiceTest, AReleaseWordNoHolderHeardBeforeAStopIsKeptForTheNextSender) {
  std::mt19937_64 rng(44);
  const ParityGroup group = ParityGroup::Make(4, 1).value();
  ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<ServedMember>> members, ServeGroup(group));
  ASSERT_OK(PushEveryMembersImage(group, members, rng));
  auto shares = [&] { return SharesHeld(members); };
  ASSERT_EQ(shares(), 4u);
  SilentPort silent;
  ASSERT_TRUE(silent.ok());
  const std::string unanswered = silent.target();

  std::mutex mu;
  std::map<std::string, int> kept;  // the record: job -> 1 while kept; its calls, counted
  int calls = 0;
  auto sender_of_member_0 = [&](bool reachable) {
    ParitySender::Options options{group, 0, {}, 64 * 1024, {}, {}, {}};
    for (uint32_t j = 1; j < group.members(); ++j) {
      const std::string target = reachable ? "127.0.0.1:" + std::to_string(members[j]->server->port()) : unanswered;
      options.members.emplace_back(j, ReplicaPeer{target, "", "", "", ""});
    }
    options.keep_word = [&](const std::string& job, bool pending) {
      std::lock_guard<std::mutex> lock(mu);
      ++calls;
      if (pending) kept[job] = 1;
      else kept.erase(job);
    };
    return std::make_unique<ParitySender>(std::move(options));
  };
  auto kept_jobs = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return kept.size();
  };

  std::unique_ptr<ParitySender> first = sender_of_member_0(false);
  ASSERT_OK(first->Start());
  first->OfferReleased("job");
  EXPECT_EQ(kept_jobs(), 1u);  // kept when queued
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // each member's thread is in its push
  first->Stop();  // cancels the pushes in flight: nothing was delivered
  EXPECT_EQ(kept_jobs(), 1u) << "the word a stop cancelled must stay kept";
  EXPECT_EQ(shares(), 4u);

  std::unique_ptr<ParitySender> next = sender_of_member_0(true);
  ASSERT_OK(next->Start());
  next->OfferReleased("job");  // what the daemon does with each record when it starts
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((shares() != 1 || kept_jobs() != 0) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(shares(), 1u);  // member 0's own share, coded from members 1, 2 and 3 alone
  EXPECT_EQ(kept_jobs(), 0u) << "every holder heard it: the record goes";
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_GE(calls, 3);
  }
  next->Stop();
  for (auto& member : members) member->server->Shutdown(std::chrono::system_clock::now());
}

// With TLS a peer's certificate says which member it is: member 1 pushes its own block to the
// holder of stripe 0, but the block it pushes as member 2 is refused before a byte is kept, and so
// is its listing of member 2's shares; member 2, whose certificate names its host by DNS, completes
// the share itself.
// Over gRPC, with the idle member's own ParitySender: a member with no ranks of the job hears of it
// from the first block added into its shares (the service's heard_of, as the daemon wires it), tells
// the holders of its stripes, and every share completes; a lost member's rank is then rebuilt.
TEST(ParityServiceTest, AMemberWithNoRanksOfTheJobTellsItsHoldersOverGrpc) {
  std::mt19937_64 rng(23);
  ParityGroup group = ParityGroup::Make(4, 1).value();
  const uint32_t idle = 3;
  std::vector<std::unique_ptr<ServedMember>> members;
  for (uint32_t i = 0; i < 4; ++i) {
    members.push_back(std::make_unique<ServedMember>(group, i));
    ASSERT_OK(members.back()->Start());
  }
  ParitySender::Options options{group, idle, {}, 64 * 1024, {}, {}, {}};
  for (uint32_t i = 0; i < idle; ++i) {
    options.members.emplace_back(i, ReplicaPeer{"127.0.0.1:" + std::to_string(members[i]->server->port()), "", "", "", ""});
  }
  ParitySender sender(std::move(options));
  ASSERT_OK(sender.Start());
  members[idle]->service.set_heard_of([&](const std::string& job, int64_t step) { sender.OfferNoRanks(job, step); });

  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(30);
  for (uint32_t i = 0; i < idle; ++i) {
    std::vector<uint8_t> image = RandomBytes(rng, 300000 + 4097 * i);
    ReplicaMeta meta = ParityStoreGroup::Meta("job", 10 + i, 17, image.size());
    meta.run_id = "run-a";
    for (uint32_t b = 0; b < group.data_blocks(); ++b) {
      uint32_t stripe = group.StripeOfBlock(i, b);
      ParityGroup::Range range = group.Block(image.size(), b);
      ASSERT_OK(PushParityBlock(members[group.Holder(stripe, 0)]->channel.get(), {i, stripe, 0, 1, meta},
                                reinterpret_cast<const char*>(image.data() + range.offset), range.bytes, deadline));
    }
    members[i]->images[{"job", 10 + i, 17}] = std::move(image);
  }
  // Each member holds one stripe's share; the idle member's word completes those of its stripes.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  auto complete = [&] {
    for (auto& member : members) {
      if (member->parity.complete_count() != 1) return false;
    }
    return true;
  };
  while (!complete() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (uint32_t i = 0; i < 4; ++i) EXPECT_EQ(members[i]->parity.complete_count(), 1u) << "member " << i;
  for (const ParityMemberStatus& status : sender.MemberStatus()) {
    EXPECT_EQ(status.blocks_sent, 0u) << "a word of no ranks is not a checkpoint's blocks";
    EXPECT_EQ(status.pushes_failed, 0u) << status.last_error;
  }

  members[1]->server->Shutdown(std::chrono::system_clock::now());
  std::vector<ParityMember> survivors;
  for (uint32_t i : {0u, 2u, 3u}) survivors.push_back({i, "member " + std::to_string(i), members[i]->channel});
  auto candidate = FindParityCandidate(group, survivors, "job", 1, 11, deadline, {});
  ASSERT_OK(candidate.status());
  std::vector<char> out(candidate->meta.bytes, 0);
  ASSERT_OK(RebuildFromParity(group, survivors, *candidate, 1, out.data(), deadline));
  const std::vector<uint8_t>& want = members[1]->images[{"job", 11, 17}];
  ASSERT_EQ(out.size(), want.size());
  EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size()), 0);
  sender.Stop();
  for (auto& member : members) member->server->Shutdown(std::chrono::system_clock::now());
}

TEST(ParityServiceTest, WithTlsAPeerPushesAndListsOnlyAsTheMemberItsCertificateNames) {
  if (::access("/usr/bin/openssl", X_OK) != 0) GTEST_SKIP() << "openssl is not installed: no certificates to test with";
  Certificates certs;
  ASSERT_TRUE(certs.Add("member0", "subjectAltName=IP:127.0.0.1") &&
              certs.Add("member1", "subjectAltName=IP:127.0.0.2") &&
              certs.Add("member2", "subjectAltName=DNS:member2.example"))
      << "openssl could not make the test certificates";
  const ParityGroup group = ParityGroup::Make(3, 1).value();
  const std::vector<std::string> allow = {"member0", "member1", "member2"};
  ServedMember holder(group, 0, allow, {"127.0.0.1", "127.0.0.2", "member2.example"});
  ReplicaListenConfig tls;
  tls.tls_cert = certs.cert("member0");
  tls.tls_key = certs.key("member0");
  tls.tls_ca = certs.cert("ca");
  tls.allow_names = allow;
  ASSERT_OK(holder.Start(tls));
  const std::string target = "127.0.0.1:" + std::to_string(holder.server->port());
  auto as = [&](const std::string& who) {
    return ReplicaChannel({target, certs.cert(who), certs.key(who), certs.cert("ca"), ""}).value();
  };
  std::shared_ptr<grpc::Channel> member1 = as("member1");
  std::shared_ptr<grpc::Channel> member2 = as("member2");
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(30);
  std::mt19937_64 rng(5);
  // Stripe 0 is held by member 0 and codes member 1's block 1 and member 2's block 0.
  ASSERT_EQ(group.StripeOfBlock(1, 1), 0u);
  ASSERT_EQ(group.StripeOfBlock(2, 0), 0u);
  auto push = [&](grpc::Channel* channel, uint32_t member, uint32_t block) {
    std::vector<uint8_t> image = RandomBytes(rng, 300000);
    ReplicaMeta meta = ParityStoreGroup::Meta("job", member, 17, image.size());
    meta.run_id = "run-a";
    const ParityGroup::Range range = group.Block(image.size(), block);
    return PushParityBlock(channel, {member, 0, 0, 1, meta}, reinterpret_cast<const char*>(image.data()) + range.offset,
                           range.bytes, deadline);
  };
  ASSERT_OK(push(member1.get(), 1, 1));
  const Status forged = push(member1.get(), 2, 0);
  EXPECT_NE(forged.message().find("PERMISSION_DENIED"), std::string::npos) << forged.ToString();
  EXPECT_NE(forged.message().find("member2.example, the host of member 2"), std::string::npos) << forged.ToString();
  EXPECT_EQ(holder.service.blocks_refused(), 1u);
  EXPECT_EQ(holder.parity.complete_count(), 0u);  // member 2's place in the share is still open

  auto theirs = ListParityShares(member1.get(), group, "job", 2, deadline);
  EXPECT_FALSE(theirs.ok());
  EXPECT_NE(theirs.status().message().find("PERMISSION_DENIED"), std::string::npos) << theirs.status().ToString();

  ASSERT_OK(push(member2.get(), 2, 0));
  EXPECT_EQ(holder.service.blocks_received(), 2u);
  EXPECT_EQ(holder.parity.complete_count(), 1u);
  ASSERT_OK_AND_ASSIGN(std::vector<ListedShare> own, ListParityShares(member1.get(), group, "job", 1, deadline));
  ASSERT_EQ(own.size(), 1u);
  EXPECT_EQ(own[0].stripe, 0u);
  holder.server->Shutdown(std::chrono::system_clock::now());
}


// A holder cannot hand a rebuild a step of its own making. With 4 members and 2 parity, member 2
// holds a share of both stripes member 0's blocks go into, so alone it can list a complete, newer
// step 18 of member 0's rank (here: blocks it added into its own shares under the others' names).
// Members 1 and 3 answer too and list only the real step 17: the lone step 18 is not taken, step 17
// is, and it is rebuilt bit for bit.
TEST(ParityServiceTest, AStepOnlyOneHolderListsIsNotTakenWhenOthersAnswer) {
  std::mt19937_64 rng(29);
  const ParityGroup group = ParityGroup::Make(4, 2).value();
  ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<ServedMember>> members, ServeGroup(group));
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(30);
  for (uint32_t i = 0; i < group.members(); ++i) {
    std::vector<uint8_t> image = RandomBytes(rng, 200000);
    ASSERT_OK(PushImage(group, members, i, 17, image, deadline));
    members[i]->images[{"job", 10 + i, 17}] = std::move(image);
  }
  ASSERT_TRUE(group.RowOf(group.StripeOfBlock(0, 0), 2) && group.RowOf(group.StripeOfBlock(0, 1), 2));
  for (uint32_t i = 0; i < group.members(); ++i) {
    // Member 2's own making: step 18 of every other member, added into its own shares only.
    if (i != 2) ASSERT_OK(PushImage(group, members, i, 18, std::vector<uint8_t>(200000, 0x77), deadline, 2));
  }

  members[0]->server->Shutdown(std::chrono::system_clock::now());
  std::vector<ParityMember> survivors;
  for (uint32_t i = 1; i < group.members(); ++i) {
    survivors.push_back({i, "member " + std::to_string(i), members[i]->channel});
  }
  ASSERT_OK_AND_ASSIGN(ParityCandidate candidate,
                       FindParityCandidate(group, survivors, "job", 0, 10, deadline, {}));
  EXPECT_EQ(candidate.meta.step, 17);
  std::vector<char> out(candidate.meta.bytes);
  ASSERT_OK(RebuildFromParity(group, survivors, candidate, 0, out.data(), deadline));
  const std::vector<uint8_t>& want = members[0]->images[{"job", 10, 17}];
  EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size()), 0);

  // Member 2 is all that answers: its word is all there is (as a replica holder's would be).
  std::vector<ParityMember> only_two = {survivors[1]};
  ASSERT_OK_AND_ASSIGN(ParityCandidate alone, FindParityCandidate(group, only_two, "job", 0, 10, deadline, {}));
  EXPECT_EQ(alone.meta.step, 18);
  for (uint32_t i = 1; i < group.members(); ++i) members[i]->server->Shutdown(std::chrono::system_clock::now());
}


// A member whose List never answers (a lost node whose address still takes packets): it holds the
// call until the caller's deadline.
class HangingList final : public v1::Parity::Service {
 public:
  grpc::Status List(grpc::ServerContext* ctx, const v1::ListSharesRequest*, v1::ListSharesResponse*) override {
    while (!ctx->IsCancelled() && std::chrono::system_clock::now() < ctx->deadline()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "hung");
  }
};

// The members are asked at once: one that hangs until the deadline keeps none of the others from
// answering (before, they were asked one after the other within one deadline, and every member
// after the hanging one failed at once: no candidate, though the group could rebuild).
TEST(ParityServiceTest, AMemberThatHangsDoesNotKeepTheOthersFromBeingListed) {
  std::mt19937_64 rng(31);
  const ParityGroup group = ParityGroup::Make(4, 2).value();
  ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<ServedMember>> members, ServeGroup(group));
  const auto far = std::chrono::system_clock::now() + std::chrono::seconds(30);
  for (uint32_t i = 0; i < group.members(); ++i) {
    std::vector<uint8_t> image = RandomBytes(rng, 200000);
    ASSERT_OK(PushImage(group, members, i, 17, image, far));
    members[i]->images[{"job", 10 + i, 17}] = std::move(image);
  }
  HangingList hanging;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&hanging);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto hung = ReplicaChannel({"127.0.0.1:" + std::to_string(port), "", "", "", ""});
  ASSERT_OK(hung.status());
  // Member 0 is lost; member 1 hangs, listed first.
  std::vector<ParityMember> survivors = {{1, "member 1 (hangs)", *hung}};
  for (uint32_t i = 2; i < group.members(); ++i) {
    survivors.push_back({i, "member " + std::to_string(i), members[i]->channel});
  }
  std::vector<uint32_t> unreachable;
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(2);
  auto candidate = FindParityCandidate(group, survivors, "job", 0, 10, deadline,
                                       [&](const ParityMember& m, const Status&) { unreachable.push_back(m.index); });
  ASSERT_OK(candidate.status());
  EXPECT_EQ(candidate->meta.step, 17);
  EXPECT_EQ(unreachable, std::vector<uint32_t>{1});
  server->Shutdown(std::chrono::system_clock::now());
  for (const auto& m : members) m->server->Shutdown(std::chrono::system_clock::now());
}

// A fetch holds a share or a rank's memory for as long as it runs: one with no deadline (or one
// further than the bound) is refused before anything is sent, as a replica fetch is.
TEST(ParityServiceTest, AFetchWithoutADeadlineIsRefused) {
  const ParityGroup group = ParityGroup::Make(4, 1).value();
  ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<ServedMember>> members, ServeGroup(group));
  v1::Parity::Stub stub(members[1]->channel);
  v1::ParityPart part;
  {
    grpc::ClientContext ctx;  // no deadline
    v1::FetchShareRequest request;
    request.set_job("job");
    request.set_step(17);
    auto reader = stub.FetchShare(&ctx, request);
    EXPECT_FALSE(reader->Read(&part));
    grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kMaxReplicaCall + std::chrono::minutes(5));
    v1::FetchBlockRequest request;
    request.set_job("job");
    request.set_step(17);
    auto reader = stub.FetchBlock(&ctx, request);
    EXPECT_FALSE(reader->Read(&part));
    grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  for (const auto& m : members) m->server->Shutdown(std::chrono::system_clock::now());
}

// A rollback that saves a step again (a later attempt) codes it afresh, and the later attempt's share
// replaces the earlier one even at a lower step; a straggler of an older step never replaces a newer one.
TEST(ParityServiceTest, APushThatStopsSendingIsCancelledAndItsShareGivenBack) {
  // Member 0 holds stripe 0's parity; member 1 opens a push of its block there, sends the header and
  // one part, then nothing: within the stall time the holder cancels the call, counts it, and drops
  // the share it had begun (its memory back), so the 16 push slots cannot be held by a silent peer.
  auto group = ParityGroup::Make(4, 1);
  ASSERT_OK(group.status());
  ServedMember holder(*group, 0, {}, {}, std::chrono::milliseconds(300));
  ASSERT_OK(holder.Start());
  std::mt19937_64 rng(5);
  std::vector<uint8_t> image = RandomBytes(rng, 400000);
  const ParityGroup::Range range = group->Block(image.size(), *group->BlockOfStripe(1, 0));

  v1::Parity::Stub stub(holder.channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::ParityPushResponse response;
  auto writer = stub.Push(&ctx, &response);
  v1::ParityPart part;
  v1::ParityHeader* h = part.mutable_header();
  ReplicaHeaderOf(ParityStoreGroup::Meta("job", 1, 18, image.size()), h->mutable_replica());
  h->set_member(1);
  h->set_stripe(0);
  h->set_position(0);
  h->set_member_ranks(1);
  ASSERT_TRUE(writer->Write(part));
  part.Clear();
  part.set_data(image.data() + range.offset, ParityStoreGroup::kPart);
  part.set_xxh3(Xxh3(image.data() + range.offset, ParityStoreGroup::kPart));
  ASSERT_TRUE(writer->Write(part));
  // The header and the part have arrived once the share is being built.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (holder.parity.building_bytes() == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GT(holder.parity.building_bytes(), 0u);

  const auto started = std::chrono::steady_clock::now();
  grpc::Status finished = writer->Finish();  // waits for the holder to end the call
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_FALSE(finished.ok());
  EXPECT_LT(waited, 10.0) << "the stalled push was not cancelled";
  EXPECT_EQ(holder.service.blocks_stalled(), 1u);
  EXPECT_EQ(holder.service.blocks_received(), 0u);
  // The caller hears of the cancel as the holder's call is still returning: the share goes with it.
  const auto returned_by = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (holder.parity.building_bytes() != 0 && std::chrono::steady_clock::now() < returned_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(holder.parity.building_bytes(), 0u) << "the share the stalled push began must be given back";
  ParitySender unstarted{ParitySender::Options{}};
  EXPECT_NE(RenderParityMetrics(holder.parity, holder.service, unstarted).find("flashckpt_parity_pushes_stalled_total 1"),
            std::string::npos);
}

// Steady state: each step's share of a place replaces the last one, whose memory is kept for the
// next step's (it was faulted in and zeroed once); the share coded into that memory, which holds an
// older step's bytes, is bit-exact: a shorter block first, then a longer one, and the other way.
TEST(ParityStoreTest, AReplacedSharesMemoryIsKeptForTheNextStepWhichCodesOverItExactly) {
  std::mt19937_64 rng(17);
  ParityStoreGroup members(4, 1);
  const ParityGroup& group = members.group();
  std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>> images;  // (member, position 0)
  auto send_step = [&](int64_t step, bool longest_last) {
    for (uint32_t i = 0; i < 4; ++i) {
      // Sizes differ by member, so a stripe's blocks differ in length; which is longest changes.
      const size_t bytes = 300000 + 40000 * (longest_last ? i : 3 - i);
      images[{i, 0}] = RandomBytes(rng, bytes);
    }
    for (uint32_t i = 0; i < 4; ++i) {
      for (uint32_t b = 0; b < group.data_blocks(); ++b) {
        ASSERT_OK(members.Send("job", step, i, i, 0, 1, images.at({i, 0}), b));
      }
    }
  };
  auto data_of = [&](uint32_t holder) {
    std::set<const uint8_t*> at;
    for (uint32_t s = 0; s < 4; ++s) {
      auto share = members.store(holder).Find("job", 0, s);
      if (share.ok()) at.insert((*share)->data());
    }
    return at;
  };
  send_step(1, true);
  for (uint32_t i = 0; i < 4; ++i) EXPECT_EQ(members.store(i).kept_bytes(), 0u);
  std::vector<std::set<const uint8_t*>> first;
  for (uint32_t i = 0; i < 4; ++i) first.push_back(data_of(i));
  send_step(2, false);
  for (uint32_t i = 0; i < 4; ++i) {
    EXPECT_GT(members.store(i).kept_bytes(), 0u) << "member " << i << ": step 1's share is not kept";
    EXPECT_EQ(members.used(i), members.store(i).held_bytes()) << "kept memory is not in the budget";
  }
  for (int64_t step : {3, 4}) {
    send_step(step, step == 3);
    for (uint32_t i = 0; i < 4; ++i) {
      EXPECT_EQ(members.used(i), members.store(i).held_bytes());
      if (step == 3) {
        EXPECT_EQ(data_of(i), first[i]) << "member " << i << ": step 3 is not in step 1's memory";
      }
    }
    SCOPED_TRACE("step " + std::to_string(step));
    members.ExpectEveryLossRebuilt("job", images);
  }
  // A job forgotten lets its kept memory go.
  for (uint32_t i = 0; i < 4; ++i) {
    members.store(i).Forget("job");
    EXPECT_EQ(members.store(i).kept_bytes(), 0u);
  }
}

// A member's word that it gave a job's memory back (Released) drops a holder's share of the job
// once M of the members whose blocks are in it have said so (a rebuild of any other block of the
// stripe needs K pieces, and fewer are then held anywhere), and the share's memory goes back to the
// budget. The last member is lost and never says so: it holds nothing up. With 4 members and parity
// 1, and 6 and parity 2, the members but the last say so one by one, and after each every holder
// holds exactly the shares with fewer than M given-back blocks in them. Then (4 and 1) a later block
// of the job from a member takes its word back.
TEST(ParityStoreTest, AShareGoesOnceParityManyOfTheMembersWhoseBlocksAreInItReleasedTheJob) {
  std::mt19937_64 rng(41);
  for (const auto& [g, m] : std::vector<std::pair<uint32_t, uint32_t>>{{4, 1}, {6, 2}}) {
    SCOPED_TRACE(std::to_string(g) + " members, parity " + std::to_string(m));
    ParityStoreGroup members(g, m);
    const ParityGroup& group = members.group();
    std::vector<std::vector<uint8_t>> images;
    for (uint32_t i = 0; i < g; ++i) {
      images.push_back(RandomBytes(rng, 200000 + 1000 * i));
      for (uint32_t b = 0; b < group.data_blocks(); ++b) {
        ASSERT_OK(members.Send("job", 17, i, 10 + i, 0, 1, images[i], b));
      }
    }
    for (uint32_t h = 0; h < g; ++h) ASSERT_EQ(members.store(h).complete_count(), m) << "member " << h;
    EXPECT_EQ(members.store(0).Released("other", 1).value(), 0u);  // no share of it here
    EXPECT_EQ(members.store(0).Released("job", g).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(members.store(0).Released("../job", 1).status().code(), StatusCode::kInvalidArgument);

    std::set<uint32_t> said;
    for (uint32_t r = 0; r + 1 < g; ++r) {
      for (uint32_t h = 0; h < g; ++h) ASSERT_OK(members.store(h).Released("job", r).status());
      said.insert(r);
      for (uint32_t stripe = 0; stripe < g; ++stripe) {
        uint32_t given_back = 0;
        for (uint32_t d = 0; d < group.data_blocks(); ++d) given_back += said.count(group.DataMember(stripe, d));
        for (uint32_t row = 0; row < m; ++row) {
          EXPECT_EQ(members.store(group.Holder(stripe, row)).Find("job", 0, stripe).ok(), given_back < m)
              << "stripe " << stripe << " row " << row << " with " << given_back << " blocks given back, after member "
              << r;
        }
      }
    }
    // Every member but the lost one said so: nothing of the job is held anywhere.
    for (uint32_t h = 0; h < g; ++h) {
      EXPECT_EQ(members.store(h).share_count(), 0u) << "member " << h;
      EXPECT_EQ(members.store(h).held_bytes(), 0u) << "member " << h;
      EXPECT_EQ(members.used(h), 0u) << "member " << h;
    }
    if (m != 1) continue;

    // Member 0 runs the job again (step 18): its blocks take its word back, and the shares they
    // are in (building: no other member's block of step 18 came) outlive member 3's word.
    for (uint32_t b = 0; b < group.data_blocks(); ++b) {
      ASSERT_OK(members.Send("job", 18, 0, 10, 0, 1, images[0], b));
    }
    for (uint32_t h = 0; h < g; ++h) ASSERT_OK(members.store(h).Released("job", 3).status());
    for (uint32_t b = 0; b < group.data_blocks(); ++b) {
      const uint32_t holder = group.Holder(group.StripeOfBlock(0, b), 0);
      EXPECT_GT(members.store(holder).share_count(), 0u) << "member " << holder;
    }
    // Member 0 gives it back again: nothing of the job is held anywhere.
    for (uint32_t h = 0; h < g; ++h) ASSERT_OK(members.store(h).Released("job", 0).status());
    for (uint32_t h = 0; h < g; ++h) {
      EXPECT_EQ(members.store(h).share_count(), 0u) << "member " << h;
      EXPECT_EQ(members.used(h), 0u) << "member " << h;
    }
  }
}

TEST(ParityStoreTest, TheLaterAttemptThenTheLaterStepIsTheShareKept) {
  std::mt19937_64 rng(13);
  ParityStoreGroup members(4, 1);
  std::vector<std::vector<uint8_t>> images;
  for (uint32_t i = 0; i < 4; ++i) images.push_back(RandomBytes(rng, 200000));
  auto send_all = [&](int64_t step, uint64_t attempt) {
    for (uint32_t i = 0; i < 4; ++i) {
      for (uint32_t b = 0; b < 3; ++b) {
        uint32_t stripe = members.group().StripeOfBlock(i, b);
        ParityGroup::Range range = members.group().Block(images[i].size(), b);
        ReplicaMeta meta = ParityStoreGroup::Meta("job", i, step, images[i].size());
        meta.attempt = attempt;
        auto incoming = members.store(members.group().Holder(stripe, 0)).Begin({i, stripe, 0, 1, meta});
        if (!incoming.ok()) {
          ASSERT_EQ(incoming.status().code(), StatusCode::kAlreadyExists) << incoming.status().ToString();
          continue;
        }
        for (uint64_t off = 0; off < range.bytes; off += ParityStoreGroup::kPart) {
          const char* p = reinterpret_cast<const char*>(images[i].data() + range.offset + off);
          size_t n = std::min<uint64_t>(ParityStoreGroup::kPart, range.bytes - off);
          ASSERT_OK((*incoming)->Append({{p, n}}, Xxh3(p, n)));
        }
        ASSERT_OK(members.store(members.group().Holder(stripe, 0)).Finish(std::move(*incoming)));
      }
    }
  };
  auto held = [&]() { return (*members.store(0).Find("job", 0, 0))->step(); };
  send_all(17, 100);
  EXPECT_EQ(held(), 17);
  send_all(12, 100);  // a straggler of an older step of the same attempt
  EXPECT_EQ(held(), 17);
  send_all(17, 100);  // the same blocks again: held already
  EXPECT_EQ((*members.store(0).Find("job", 0, 0))->attempt(), 100u);
  send_all(11, 200);  // restored to 10 and saved on: a later attempt
  EXPECT_EQ(held(), 11);
  send_all(17, 300);  // step 17 saved again by yet another attempt: coded afresh
  EXPECT_EQ(held(), 17);
  EXPECT_EQ((*members.store(0).Find("job", 0, 0))->attempt(), 300u);
}

}  // namespace
}  // namespace flashckpt

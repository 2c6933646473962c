// The parity group's shape and its Reed-Solomon code (daemon/parity): every stripe is coded so
// that any `parity` lost members are rebuilt bit for bit from the others, whatever the images' sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "daemon/parity/parity_code.h"
#include "daemon/parity/parity_group.h"
#include "testing.h"

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

}  // namespace
}  // namespace flashckpt

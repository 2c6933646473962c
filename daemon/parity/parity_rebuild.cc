#include "daemon/parity/parity_rebuild.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "daemon/parity/parity_code.h"

namespace flashckpt {

Result<ParityCandidate> FindParityCandidate(const ParityGroup& group, const std::vector<ParityMember>& members,
                                            const std::string& job, uint32_t self, uint32_t rank,
                                            std::chrono::system_clock::time_point deadline,
                                            const std::function<void(const ParityMember&, const Status&)>& unreachable,
                                            std::vector<ParityCandidate>* all) {
  // Candidates by (step, attempt, run): the blocks of one image agree on all three.
  using Version = std::tuple<int64_t, uint64_t, std::string>;
  struct Found {
    ParityCandidate candidate;
    std::set<uint32_t> vouchers;  // the members whose listings carry the candidate's header
    std::string conflict;         // set when two listings of the version disagree on the header
  };
  std::map<Version, Found> found;
  std::set<uint32_t> holders;  // the members that answered and hold shares of the rank's stripes
  for (const ParityMember& member : members) {
    auto listed = ListParityShares(member.channel.get(), group, job, self, deadline);
    if (!listed.ok()) {
      if (unreachable) unreachable(member, listed.status());
      continue;
    }
    for (uint32_t block = 0; block < group.data_blocks(); ++block) {
      if (group.RowOf(group.StripeOfBlock(self, block), member.index)) holders.insert(member.index);
    }
    for (ListedShare& share : *listed) {
      // Only what the holder could hold: a share of a stripe it is a holder of, in its row.
      if (group.RowOf(share.stripe, member.index) != share.row) continue;
      const uint32_t index = *group.DataIndexOf(share.stripe, self);
      auto mine = std::find_if(share.contributions.begin(), share.contributions.end(),
                               [&](const auto& c) { return c.first == index; });
      if (mine == share.contributions.end()) continue;
      const ReplicaMeta& meta = mine->second.meta;
      if (meta.job != job || meta.rank != rank || meta.step != share.step) continue;
      const uint32_t block = *group.BlockOfStripe(self, share.stripe);
      if (mine->second.block_bytes != group.Block(meta.bytes, block).bytes) continue;
      Found& f = found[{meta.step, meta.attempt, meta.run_id}];
      ParityCandidate& c = f.candidate;
      if (c.blocks.empty()) {
        c.meta = meta;
        c.position = share.position;
        c.blocks.resize(group.data_blocks());
      }
      // Every block must come from one image: the same header and place, whoever lists it. Holders
      // that disagree cannot all be right, and which one is cannot be told here: none is used.
      if (meta.bytes != c.meta.bytes || meta.layout != c.meta.layout || meta.extra != c.meta.extra ||
          meta.world_size != c.meta.world_size || meta.resumed_from != c.meta.resumed_from ||
          share.position != c.position) {
        f.conflict = "member " + std::to_string(member.index) + " (" + member.target +
                     ") lists another header or place for it than another member does";
        continue;
      }
      f.vouchers.insert(member.index);
      c.blocks[block].push_back({&member, std::move(share)});
    }
  }
  // A header only one member vouches for, where two or more could, is not taken: a lone holder could
  // list a step of its own making with bytes and checksums to match.
  const size_t needed_vouchers = std::min<size_t>(2, holders.size());
  std::vector<ParityCandidate> complete;
  std::string refused;
  for (auto it = found.rbegin(); it != found.rend(); ++it) {
    Found& f = it->second;
    const std::string what = "step " + std::to_string(f.candidate.meta.step);
    if (!f.conflict.empty()) {
      refused += "; " + what + ": " + f.conflict;
      continue;
    }
    bool every_block = std::all_of(f.candidate.blocks.begin(), f.candidate.blocks.end(),
                                   [](const auto& shares) { return !shares.empty(); });
    if (!every_block) continue;
    if (f.vouchers.size() < needed_vouchers) {
      refused += "; " + what + ": listed by member " + std::to_string(*f.vouchers.begin()) + " alone of the " +
                 std::to_string(holders.size()) + " holders that answered";
      continue;
    }
    complete.push_back(std::move(f.candidate));
  }
  if (complete.empty()) {
    return NotFound("no member holds parity of every block of job '" + job + "' rank " + std::to_string(rank) +
                    " of member " + std::to_string(self) + refused);
  }
  ParityCandidate newest = complete.front();
  if (all) *all = std::move(complete);
  return newest;
}

Status RebuildFromParity(const ParityGroup& group, const std::vector<ParityMember>& members,
                         const ParityCandidate& candidate, uint32_t self, char* into,
                         std::chrono::system_clock::time_point deadline) {
  ASSIGN_OR_RETURN(const ParityCode code, ParityCode::Make(group.data_blocks(), group.parity()));
  const ReplicaMeta& meta = candidate.meta;
  auto member_channel = [&](uint32_t index) -> const ParityMember* {
    for (const ParityMember& m : members) {
      if (m.index == index) return &m;
    }
    return nullptr;
  };
  for (uint32_t block = 0; block < group.data_blocks(); ++block) {
    const uint32_t stripe = group.StripeOfBlock(self, block);
    const std::vector<ParityCandidate::Held>& held = candidate.blocks[block];
    const ListedShare& listing = held.front().share;
    const uint64_t stripe_bytes = listing.bytes;
    const ParityGroup::Range mine = group.Block(meta.bytes, block);
    if (mine.bytes == 0) continue;

    // The pieces, cheapest first: data members with no rank at the position (zeros), the other
    // data members' own blocks, then the holders' shares; fetched until the code has enough.
    std::vector<ParityCode::Piece> pieces(group.members());
    std::vector<std::vector<uint8_t>> buffers;
    buffers.reserve(group.members());
    uint32_t have = 0;
    std::string failures;
    static const uint8_t kNothing = 0;
    for (uint32_t d = 0; d < group.data_blocks() && have < group.data_blocks(); ++d) {
      const uint32_t member = group.DataMember(stripe, d);
      if (member == self) continue;
      auto c = std::find_if(listing.contributions.begin(), listing.contributions.end(),
                            [&](const auto& x) { return x.first == d; });
      if (c == listing.contributions.end()) {
        pieces[d] = {&kNothing, 0};
        ++have;
      }
    }
    for (uint32_t d = 0; d < group.data_blocks() && have < group.data_blocks(); ++d) {
      const uint32_t member = group.DataMember(stripe, d);
      auto c = std::find_if(listing.contributions.begin(), listing.contributions.end(),
                            [&](const auto& x) { return x.first == d; });
      if (member == self || c == listing.contributions.end()) continue;
      const ParityMember* from = member_channel(member);
      if (from == nullptr) continue;
      const ParityShare::Contribution& theirs = c->second;
      std::vector<uint8_t>& buffer = buffers.emplace_back(theirs.block_bytes);
      Status fetched = FetchParityBlock(from->channel.get(), meta.job, theirs.meta.rank, meta.step, stripe,
                                        theirs.meta.run_id, theirs.meta.resumed_from,
                                        reinterpret_cast<char*>(buffer.data()), buffer.size(),
                                        deadline);
      if (!fetched.ok()) {
        failures += "; block of member " + std::to_string(member) + " (" + from->target + "): " + fetched.ToString();
        continue;
      }
      pieces[d] = {buffer.data(), buffer.size()};
      ++have;
    }
    for (const ParityCandidate::Held& h : held) {
      if (have >= group.data_blocks()) break;
      if (h.share.bytes != stripe_bytes) {
        failures += "; share " + std::to_string(h.share.row) + " of member " + std::to_string(h.holder->index) +
                    " is listed with another length than its stripe's";
        continue;
      }
      std::vector<uint8_t>& buffer = buffers.emplace_back(h.share.bytes);
      Status fetched = FetchParityShare(h.holder->channel.get(), meta.job, h.share.position, stripe, meta.step,
                                        reinterpret_cast<char*>(buffer.data()), buffer.size(), deadline);
      if (!fetched.ok()) {
        failures += "; share " + std::to_string(h.share.row) + " of member " + std::to_string(h.holder->index) + " (" +
                    h.holder->target + "): " + fetched.ToString();
        continue;
      }
      pieces[group.data_blocks() + h.share.row] = {buffer.data(), buffer.size()};
      ++have;
    }
    if (have < group.data_blocks()) {
      return FailedPrecondition("stripe " + std::to_string(stripe) + " of job '" + meta.job + "' step " +
                                std::to_string(meta.step) + " has " + std::to_string(have) + " of the " +
                                std::to_string(group.data_blocks()) + " pieces a rebuild needs" + failures);
    }
    RETURN_IF_ERROR(code.Rebuild(pieces, stripe_bytes,
                                 {{*group.DataIndexOf(stripe, self), reinterpret_cast<uint8_t*>(into + mine.offset),
                                   mine.bytes}}));
  }
  return Status::OK();
}

}  // namespace flashckpt

#include "daemon/parity/parity_rebuild.h"

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <thread>
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
  // The fetched pieces' buffers, by place among a stripe's sources (at most one per member), reused
  // from stripe to stripe: fresh memory for each would be faulted in and zeroed page by page again.
  std::vector<std::unique_ptr<uint8_t[]>> buffers(group.members());
  std::vector<uint64_t> capacity(group.members(), 0);
  for (uint32_t block = 0; block < group.data_blocks(); ++block) {
    const uint32_t stripe = group.StripeOfBlock(self, block);
    const std::vector<ParityCandidate::Held>& held = candidate.blocks[block];
    const ListedShare& listing = held.front().share;
    const uint64_t stripe_bytes = listing.bytes;
    const ParityGroup::Range mine = group.Block(meta.bytes, block);
    if (mine.bytes == 0) continue;

    // The pieces, cheapest first: data members with no rank at the position (zeros), the other
    // data members' own blocks, then the holders' shares. As many as the code still needs are
    // fetched at once, each into its own buffer; a piece that fails makes way for the next ones.
    std::vector<ParityCode::Piece> pieces(group.members());
    uint32_t have = 0;
    std::string failures;
    static const uint8_t kNothing = 0;
    struct Source {
      uint32_t piece = 0;  // its index among the stripe's pieces
      uint64_t bytes = 0;
      std::string what;
      std::function<Status(char*)> fetch;
    };
    std::vector<Source> sources;
    for (uint32_t d = 0; d < group.data_blocks(); ++d) {
      const uint32_t member = group.DataMember(stripe, d);
      if (member == self) continue;
      auto c = std::find_if(listing.contributions.begin(), listing.contributions.end(),
                            [&](const auto& x) { return x.first == d; });
      if (c == listing.contributions.end()) {
        if (have < group.data_blocks()) {
          pieces[d] = {&kNothing, 0};
          ++have;
        }
        continue;
      }
      const ParityMember* from = member_channel(member);
      if (from == nullptr) continue;
      const ParityShare::Contribution& theirs = c->second;
      sources.push_back({d, theirs.block_bytes,
                         "block of member " + std::to_string(member) + " (" + from->target + ")",
                         [&meta, &theirs, from, stripe, deadline, bytes = theirs.block_bytes](char* to) {
                           return FetchParityBlock(from->channel.get(), meta.job, theirs.meta.rank, meta.step, stripe,
                                                   theirs.meta.run_id, theirs.meta.resumed_from, to, bytes,
                                                   deadline);
                         }});
    }
    for (const ParityCandidate::Held& h : held) {
      const std::string what = "share " + std::to_string(h.share.row) + " of member " +
                               std::to_string(h.holder->index) + " (" + h.holder->target + ")";
      if (h.share.bytes != stripe_bytes) {
        failures += "; " + what + " is listed with another length than its stripe's";
        continue;
      }
      sources.push_back({group.data_blocks() + h.share.row, h.share.bytes, what,
                         [&meta, &h, stripe, deadline](char* to) {
                           return FetchParityShare(h.holder->channel.get(), meta.job, h.share.position, stripe,
                                                   meta.step, to, h.share.bytes, deadline);
                         }});
    }
    if (sources.size() > buffers.size()) {
      return Internal("stripe " + std::to_string(stripe) + " has more sources than the group has members");
    }
    size_t next = 0;
    while (have < group.data_blocks() && next < sources.size()) {
      const size_t batch = std::min<size_t>(group.data_blocks() - have, sources.size() - next);
      std::vector<Status> fetched(batch);
      std::vector<std::thread> fetchers;
      for (size_t i = 0; i < batch; ++i) {
        if (capacity[next + i] < std::max<uint64_t>(sources[next + i].bytes, 1)) {
          capacity[next + i] = std::max<uint64_t>(sources[next + i].bytes, 1);
          buffers[next + i].reset(new uint8_t[capacity[next + i]]);
        }
        auto run = [&, i] { fetched[i] = sources[next + i].fetch(reinterpret_cast<char*>(buffers[next + i].get())); };
        if (i + 1 == batch) {
          run();  // the last on this thread
        } else {
          fetchers.emplace_back(run);
        }
      }
      for (std::thread& t : fetchers) t.join();
      for (size_t i = 0; i < batch; ++i) {
        const Source& source = sources[next + i];
        if (!fetched[i].ok()) {
          failures += "; " + source.what + ": " + fetched[i].ToString();
          continue;
        }
        pieces[source.piece] = {buffers[next + i].get(), source.bytes};
        ++have;
      }
      next += batch;
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

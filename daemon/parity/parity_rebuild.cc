#include "daemon/parity/parity_rebuild.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "common/base/mutex.h"
#include "daemon/parity/parity_code.h"

namespace flashckpt {
namespace {

// The memory a piece passes through on its way from the fetch to the decode: `bytes` of shared
// memory mapped twice in a row, so that any `bytes` or fewer from any offset are contiguous (a part
// or a window never wraps). The same pages serve the whole rebuild: they are faulted in once.
class MirroredRing {
 public:
  static Result<std::unique_ptr<MirroredRing>> Make(uint64_t bytes) {
    const int fd = ::memfd_create("flashckpt-rebuild", MFD_CLOEXEC);
    if (fd < 0) return ErrnoStatus("memfd_create", "a rebuild's ring");
    std::unique_ptr<MirroredRing> ring(new MirroredRing(bytes));
    Status made = ring->Map(fd);
    ::close(fd);
    if (!made.ok()) return made;
    return ring;
  }
  ~MirroredRing() {
    if (base_ != nullptr) ::munmap(base_, 2 * bytes_);
  }
  MirroredRing(const MirroredRing&) = delete;
  MirroredRing& operator=(const MirroredRing&) = delete;
  // Where byte `offset` of the piece is (and the ring's length after it, contiguous).
  char* at(uint64_t offset) const { return base_ + offset % bytes_; }

 private:
  explicit MirroredRing(uint64_t bytes) : bytes_(bytes) {}
  Status Map(int fd) {
    if (::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) return ErrnoStatus("ftruncate", "a rebuild's ring");
    void* base = ::mmap(nullptr, 2 * bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return ErrnoStatus("mmap", "a rebuild's ring");
    base_ = static_cast<char*>(base);
    for (uint64_t copy = 0; copy < 2; ++copy) {
      if (::mmap(base_ + copy * bytes_, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        return ErrnoStatus("mmap", "a rebuild's ring");
      }
    }
    return Status::OK();
  }
  const uint64_t bytes_;
  char* base_ = nullptr;
};

// The fetches of one decode of a block, each into its ring: how far each has come, and how far the
// decode has used their bytes (a fetch waits for room until the decode has used what it would
// overwrite). Once the decode stops (done, or given up), each fetch still running is cancelled (a
// fetch waiting in gRPC for a part ends at once) and is not to blame for it. A fetch the decode
// waits on that brings no part for `streaming.stall` is cancelled and is to blame: a member that
// hangs costs the rebuild that long, not its deadline.
class Fetches {
 public:
  using Steady = std::chrono::steady_clock;
  Fetches(const std::vector<MirroredRing*>& rings, const RebuildStreaming& streaming, Steady::time_point until)
      : streaming_(streaming), until_(until) {
    for (size_t i = 0; i < rings.size(); ++i) sinks_.push_back(std::make_unique<Sink>(this, i, rings[i]));
    got_.assign(rings.size(), 0);
    progress_.assign(rings.size(), Steady::now());
    calls_.assign(rings.size(), nullptr);
    ended_.assign(rings.size(), false);
    stopped_them_.assign(rings.size(), false);
    stalled_.assign(rings.size(), false);
  }
  PartSink* sink(size_t i) { return sinks_[i].get(); }
  void Ended(size_t i) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    ended_[i] = true;
    cv_.NotifyAll();
  }
  // True once fetch i has `bytes` bytes in place; false when it ended short of them (its status
  // says why), the deadline passed, or it brought no part for the stall time since this wait began
  // or its last part, whichever is later (then it is cancelled, and Stalled).
  bool WaitFor(size_t i, uint64_t bytes) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    const Steady::time_point entered = Steady::now();
    while (got_[i] < bytes) {
      if (ended_[i]) return false;
      const Steady::time_point stall_at = std::max(entered, progress_[i]) + streaming_.stall;
      if (cv_.WaitUntil(&lock, std::min(until_, stall_at))) continue;
      if (got_[i] >= bytes) return true;
      if (Steady::now() >= until_) return false;
      if (Steady::now() >= std::max(entered, progress_[i]) + streaming_.stall) {
        stalled_[i] = true;
        if (calls_[i] != nullptr) calls_[i]->TryCancel();
        return false;
      }
    }
    return true;
  }
  // The decode has used every byte before `offset` of every piece.
  void Used(uint64_t offset) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    used_ = offset;
    cv_.NotifyAll();
  }
  // The decode needs nothing more of any piece: the fetches still running are cancelled.
  void Stop() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    stopped_ = true;
    for (size_t i = 0; i < calls_.size(); ++i) {
      if (ended_[i]) continue;
      stopped_them_[i] = true;
      if (calls_[i] != nullptr) calls_[i]->TryCancel();
    }
    cv_.NotifyAll();
  }
  // Whether fetch i ended because the decode stopped, or the deadline passed while it waited for
  // the decode: no failure of its source.
  bool EndedByTheDecode(size_t i) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return stopped_them_[i] && !stalled_[i];
  }
  // Whether fetch i was cancelled for bringing no part for the stall time.
  bool Stalled(size_t i) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return stalled_[i];
  }

 private:
  class Sink final : public PartSink {
   public:
    Sink(Fetches* fetches, size_t i, MirroredRing* ring) : fetches_(fetches), i_(i), ring_(ring) {}
    Result<char*> Place(uint64_t at, uint64_t n) override { return fetches_->Place(i_, ring_, at, n); }
    void Arrived(uint64_t end) override { fetches_->Arrived(i_, end); }
    void Calling(grpc::ClientContext* call) override { fetches_->Calling(i_, call); }

   private:
    Fetches* fetches_;
    size_t i_;
    MirroredRing* ring_;
  };

  Result<char*> Place(size_t i, MirroredRing* ring, uint64_t at, uint64_t n) EXCLUDES(mu_) {
    // A part longer than the ring less the window being decoded could never find room.
    const uint64_t longest = streaming_.ring_bytes - streaming_.window_bytes;
    if (n > longest) {
      return Corruption("a part of " + std::to_string(n) + " bytes, more than a rebuild takes at once (" +
                        std::to_string(longest) + ")");
    }
    MutexLock lock(&mu_);
    while (!stopped_ && at + n > used_ + streaming_.ring_bytes) {
      if (!cv_.WaitUntil(&lock, until_)) break;
    }
    if (stopped_ || at + n > used_ + streaming_.ring_bytes) {
      stopped_them_[i] = true;
      return stopped_ ? Cancelled("the rebuild stopped using this piece")
                      : DeadlineExceeded("the rebuild's decode did not reach this piece's bytes by the deadline");
    }
    return ring->at(at);
  }
  void Arrived(size_t i, uint64_t end) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    got_[i] = end;
    progress_[i] = Steady::now();
    cv_.NotifyAll();
  }
  // A call that starts after the decode stopped (or fetch i stalled) is cancelled as it starts.
  void Calling(size_t i, grpc::ClientContext* call) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    calls_[i] = call;
    if (call != nullptr && (stopped_ || stalled_[i])) call->TryCancel();
  }

  const RebuildStreaming streaming_;
  const Steady::time_point until_;
  std::vector<std::unique_ptr<Sink>> sinks_;
  Mutex mu_;
  CondVar cv_;
  std::vector<uint64_t> got_ GUARDED_BY(mu_);
  std::vector<Steady::time_point> progress_ GUARDED_BY(mu_);  // when fetch i's last part arrived
  // Fetch i's call while it runs (cancelled from here: TryCancel may be called from any thread).
  std::vector<grpc::ClientContext*> calls_ GUARDED_BY(mu_);
  std::vector<bool> ended_ GUARDED_BY(mu_);
  std::vector<bool> stopped_them_ GUARDED_BY(mu_);
  std::vector<bool> stalled_ GUARDED_BY(mu_);
  uint64_t used_ GUARDED_BY(mu_) = 0;
  bool stopped_ GUARDED_BY(mu_) = false;
};

}  // namespace

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
  // Every member is asked at once, each until the deadline: one that hangs (a lost node whose
  // address still takes packets) costs the others none of their time.
  std::vector<Result<std::vector<ListedShare>>> listings(members.size(), Unavailable("not asked"));
  {
    std::vector<std::thread> askers;
    askers.reserve(members.size());
    for (size_t i = 0; i < members.size(); ++i) {
      askers.emplace_back([&, i] { listings[i] = ListParityShares(members[i].channel.get(), group, job, self, deadline); });
    }
    for (std::thread& t : askers) t.join();
  }
  for (size_t i = 0; i < members.size(); ++i) {
    const ParityMember& member = members[i];
    auto& listed = listings[i];
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
                         std::chrono::system_clock::time_point deadline, const RebuildStreaming& streaming) {
  ASSIGN_OR_RETURN(const ParityCode code, ParityCode::Make(group.data_blocks(), group.parity()));
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  if (streaming.window_bytes == 0 || streaming.ring_bytes <= streaming.window_bytes ||
      streaming.ring_bytes % page != 0) {
    return InvalidArgument("a rebuild's ring must be a whole number of pages, longer than its window");
  }
  if (streaming.stall.count() <= 0) return InvalidArgument("a rebuild's stall time must be positive");
  const ReplicaMeta& meta = candidate.meta;
  // The deadline on the steady clock (a year at most, so that the sum cannot overflow).
  const auto until =
      std::chrono::steady_clock::now() + std::min<std::chrono::system_clock::duration>(
                                             deadline - std::chrono::system_clock::now(), std::chrono::hours(24 * 365));
  auto member_channel = [&](uint32_t index) -> const ParityMember* {
    for (const ParityMember& m : members) {
      if (m.index == index) return &m;
    }
    return nullptr;
  };
  // One ring per piece being fetched (at most one per member), made when first needed and reused
  // from stripe to stripe: the rebuild holds rings, not its pieces whole.
  std::vector<std::unique_ptr<MirroredRing>> rings(group.members());
  // Members whose piece failed in a stripe (an error, a bad part, no part for the stall time): in
  // the later stripes their pieces come after the others', so a member that hangs costs the rebuild
  // its stall time once, not once per stripe.
  std::set<uint32_t> failed_members;
  for (uint32_t block = 0; block < group.data_blocks(); ++block) {
    const uint32_t stripe = group.StripeOfBlock(self, block);
    const std::vector<ParityCandidate::Held>& held = candidate.blocks[block];
    const ListedShare& listing = held.front().share;
    const uint64_t stripe_bytes = listing.bytes;
    const ParityGroup::Range mine = group.Block(meta.bytes, block);
    if (mine.bytes == 0) continue;
    const uint32_t index = *group.DataIndexOf(stripe, self);  // the block's place among the stripe's pieces
    if (mine.bytes > stripe_bytes) {
      return InvalidArgument("stripe " + std::to_string(stripe) + " is listed shorter than the block rebuilt into it");
    }

    // The pieces, cheapest first: data members with no rank at the position (zeros), the other
    // data members' own blocks, then the holders' shares.
    static const uint8_t kNothing = 0;
    std::vector<uint32_t> zeros;
    std::string failures;
    struct Source {
      uint32_t piece = 0;  // its index among the stripe's pieces
      uint32_t member = 0;  // whose piece it is
      uint64_t bytes = 0;
      std::string what;
      std::function<Status(PartSink*)> fetch;
      bool failed = false;
    };
    std::vector<Source> sources;
    for (uint32_t d = 0; d < group.data_blocks(); ++d) {
      const uint32_t member = group.DataMember(stripe, d);
      if (member == self) continue;
      auto c = std::find_if(listing.contributions.begin(), listing.contributions.end(),
                            [&](const auto& x) { return x.first == d; });
      if (c == listing.contributions.end()) {
        zeros.push_back(d);  // at most K - 1: this member is a data member of the stripe too
        continue;
      }
      const ParityMember* from = member_channel(member);
      if (from == nullptr) continue;
      const ParityShare::Contribution& theirs = c->second;
      if (theirs.block_bytes > stripe_bytes) {
        failures += "; the block of member " + std::to_string(member) + " is listed longer than its stripe";
        continue;
      }
      sources.push_back({d, member, theirs.block_bytes,
                         "block of member " + std::to_string(member) + " (" + from->target + ")",
                         [&meta, &theirs, from, stripe, deadline, bytes = theirs.block_bytes](PartSink* sink) {
                           return FetchParityBlock(from->channel.get(), meta.job, theirs.meta.rank, meta.step, stripe,
                                                   theirs.meta.run_id, theirs.meta.resumed_from, sink, bytes, deadline);
                         }});
    }
    for (const ParityCandidate::Held& h : held) {
      const std::string what = "share " + std::to_string(h.share.row) + " of member " +
                               std::to_string(h.holder->index) + " (" + h.holder->target + ")";
      if (h.share.bytes != stripe_bytes) {
        failures += "; " + what + " is listed with another length than its stripe's";
        continue;
      }
      sources.push_back(
          {group.data_blocks() + h.share.row, h.holder->index, h.share.bytes, what,
           [&meta, &h, stripe, deadline](PartSink* sink) {
             return FetchParityShare(h.holder->channel.get(), meta.job, h.share.position, stripe, meta.step, sink,
                                     h.share.bytes, deadline);
           }});
    }
    std::stable_partition(sources.begin(), sources.end(),
                          [&](const Source& source) { return failed_members.count(source.member) == 0; });
    if (sources.size() > rings.size()) {
      return Internal("stripe " + std::to_string(stripe) + " has more sources than the group has members");
    }

    // As many pieces as the code needs are fetched at once, and the block is decoded behind them a
    // window at a time as their parts arrive; the fetches stop once it is. A piece that fails before
    // makes way for the next source, and the block is fetched and decoded again from its start (the
    // rings keep only what the decode has not used yet).
    const size_t wanted = group.data_blocks() - zeros.size();
    while (true) {
      std::vector<size_t> chosen;  // indexes into `sources`
      for (size_t i = 0; i < sources.size() && chosen.size() < wanted; ++i) {
        if (!sources[i].failed) chosen.push_back(i);
      }
      if (chosen.size() < wanted) {
        return FailedPrecondition("stripe " + std::to_string(stripe) + " of job '" + meta.job + "' step " +
                                  std::to_string(meta.step) + " has " + std::to_string(zeros.size() + chosen.size()) +
                                  " of the " + std::to_string(group.data_blocks()) + " pieces a rebuild needs" +
                                  failures);
      }
      std::vector<MirroredRing*> chosen_rings;
      for (size_t c = 0; c < chosen.size(); ++c) {
        if (rings[c] == nullptr) {
          ASSIGN_OR_RETURN(rings[c], MirroredRing::Make(streaming.ring_bytes));
        }
        chosen_rings.push_back(rings[c].get());
      }
      Fetches fetches(chosen_rings, streaming, until);
      std::vector<Status> fetched(chosen.size());
      std::vector<std::thread> fetchers;
      for (size_t c = 0; c < chosen.size(); ++c) {
        fetchers.emplace_back([&, c] {
          fetched[c] = sources[chosen[c]].fetch(fetches.sink(c));
          fetches.Ended(c);
        });
      }
      uint8_t* out = reinterpret_cast<uint8_t*>(into + mine.offset);
      bool complete = true;
      Status decode = Status::OK();
      for (uint64_t at = 0; complete && at < mine.bytes; at += streaming.window_bytes) {
        const uint64_t end = std::min<uint64_t>(at + streaming.window_bytes, mine.bytes);
        for (size_t c = 0; complete && c < chosen.size(); ++c) {
          complete = fetches.WaitFor(c, std::min(end, sources[chosen[c]].bytes));
        }
        if (!complete) break;
        std::vector<ParityCode::Piece> window(group.members());
        for (uint32_t d : zeros) window[d] = {&kNothing, 0};
        for (size_t c = 0; c < chosen.size(); ++c) {
          const uint64_t size = sources[chosen[c]].bytes;
          const uint64_t n = size > at ? std::min(size - at, end - at) : 0;
          window[sources[chosen[c]].piece] = {reinterpret_cast<const uint8_t*>(chosen_rings[c]->at(at)), n};
        }
        decode = code.Rebuild(window, end - at, {{index, out + at, end - at}});
        complete = decode.ok();
        fetches.Used(end);
      }
      // Decoded or given up: the pieces' bytes past the block (or past a failure) are not needed.
      fetches.Stop();
      for (std::thread& t : fetchers) t.join();
      RETURN_IF_ERROR(decode);
      if (complete) break;  // every byte used arrived and passed its checksum
      bool blamed = false;
      for (size_t c = 0; c < chosen.size(); ++c) {
        Source& source = sources[chosen[c]];
        if (fetches.Stalled(c)) {
          failures += "; " + source.what + ": no part arrived for " + std::to_string(streaming.stall.count()) + " ms";
        } else if (fetched[c].ok() || fetches.EndedByTheDecode(c)) {
          continue;
        } else {
          failures += "; " + source.what + ": " + fetched[c].ToString();
        }
        source.failed = blamed = true;
        failed_members.insert(source.member);
      }
      if (!blamed || std::chrono::steady_clock::now() >= until) {
        return DeadlineExceeded("the rebuild of stripe " + std::to_string(stripe) + " of job '" + meta.job + "' step " +
                                std::to_string(meta.step) + " did not finish by its deadline" + failures);
      }
    }
  }
  return Status::OK();
}

}  // namespace flashckpt

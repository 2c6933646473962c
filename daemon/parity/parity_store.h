// The parity shares a member of a parity group holds for the others (flashckptd --ec-group,
// --ec-parity; the group's shape is parity_group.h). A share is coded from one block of each of its
// stripe's data members, the blocks of one step of one job, and of ranks in the same place among
// their members' ranks of the job (`position`: the rank's index when the member's ranks of the job
// are sorted; members need not run the same ranks, nor as many). A rank's image is what a replica
// of its memory checkpoint carries (replica_layout.h); with it each block brings the rank's
// ReplicaMeta, so that whoever rebuilds a lost member's rank knows what it rebuilds and can check
// every chunk of it against the origin's checksums.
//
// A block arrives as parts, each checked against its XXH3-64 and coded into the share as it comes
// (ParityCode::Assign where no block reached yet, Accumulate where one did): the block itself is
// never stored. A share is complete once every data
// member of its stripe that has a rank at `position` has added its block: each block says how many
// ranks of the job its member has, so the share knows which members to wait for once each has sent
// one block of the step for any position. The newest complete share of (job, position, stripe) (the
// later attempt of the job, then the later step) is what a rebuild uses: it is immutable from then
// on, and a reader keeps it alive while a newer one replaces it. A block of a step already coded by
// another attempt (a rollback that saved the step again) starts a share of its own. Shares being built are kept for at most kBuildingSteps steps
// per (job, position, stripe); a block that does not arrive whole spoils its step's share (its
// parts are in it), which is then dropped. A member's count of ranks may grow between the blocks
// of a step (a rank that registered late): the largest told counts, and a block that comes after
// its share was completed without it goes into a copy of the share, which then replaces it.
//
// Memory: a share's bytes (as long as the longest block added) come from the daemon's
// --max-host-memory (HostMemory) from the first block's header on; a block that would not fit is
// refused before any of its data. At most kMaxSharesHeld complete and building shares in all. The
// memory of a share that a newer one replaced (or that was dropped) is kept for the next share of
// its (job, position, stripe), when no reader holds it: fresh memory is faulted in and zeroed by
// the kernel page by page as the blocks arrive, which is most of a holder's cost after the socket.
// Kept memory is not counted in the budget: it is the kernel's to take back whenever it needs it
// (MADV_FREE, as a replica's kept memory), and the share that takes it reserves it again; so
// between two steps the memory resident for parity can be up to twice what is counted, until the
// kernel needs it. At most one kept mapping per (job, position, stripe), of the length of the share
// it held; one whose place no longer holds a share goes at the next keep or take, or when the job
// is forgotten. A share's first block to reach a byte writes it (ParityCode::Assign) and later
// ones add into it, so reused memory is never zeroed first.
//
// Thread safety: every method may be called from any thread; blocks of one share are added one
// at a time (the share's own lock), never under the store's lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/base/mutex.h"
#include "common/base/status.h"
#include "daemon/parity/parity_code.h"
#include "daemon/parity/parity_group.h"
#include "daemon/replica/replica_store.h"

namespace flashckpt {

constexpr size_t kMaxSharesHeld = 4096;
constexpr uint32_t kMaxRanksPerMember = 4096;
constexpr size_t kBuildingSteps = 2;
constexpr size_t kMaxToldCounts = 4 * kMaxSharesHeld;  // (job, step, stripe) rank counts held

// One block on its way to a holder of a share of its stripe.
struct ShareBlock {
  uint32_t member = 0;        // the sender's index in the group
  uint32_t stripe = 0;
  uint32_t position = 0;      // the rank's place among the member's ranks of the job
  uint32_t member_ranks = 0;  // how many ranks of the job the member has at this step
  ReplicaMeta meta;           // the rank's image: job, rank, step, bytes, layout, ...; part_bytes of the block's parts
  bool released = false;      // no block: the member's word that it gave meta.job's memory back
};

// A complete share and what it was coded from.
class ParityShare {
 public:
  struct Contribution {
    uint32_t member = 0;
    uint64_t block_bytes = 0;
    ReplicaMeta meta;
  };
  const std::string& job() const { return job_; }
  int64_t step() const { return step_; }
  uint32_t position() const { return position_; }
  uint32_t stripe() const { return stripe_; }
  uint32_t row() const { return row_; }
  // The share's bytes: as long as the longest block of its stripe (a shorter block counts as padded with zeros).
  const uint8_t* data() const;
  uint64_t bytes() const { return bytes_.load(); }
  // The latest attempt (ReplicaMeta::attempt) of the blocks it was coded from: of two complete
  // shares of one (job, position, stripe), the later attempt, then the later step, is kept.
  uint64_t attempt() const { return attempt_; }
  // By data index (ParityGroup::DataIndexOf); members without a rank at `position` are absent.
  const std::map<uint32_t, Contribution>& contributions() const { return contributions_; }

  ~ParityShare();
  ParityShare(const ParityShare&) = delete;
  ParityShare& operator=(const ParityShare&) = delete;

 private:
  friend class ParityStore;
  ParityShare(std::string job, int64_t step, uint32_t position, uint32_t stripe, uint32_t row)
      : job_(std::move(job)), step_(step), position_(position), stripe_(stripe), row_(row) {}
  std::string job_;
  int64_t step_ = 0;
  uint32_t position_ = 0;
  uint32_t stripe_ = 0;
  uint32_t row_ = 0;
  Mutex mu_;  // one block added at a time; guards the bytes while the share is built
  std::unique_ptr<ReplicaMapping> mapping_;
  std::atomic<uint64_t> bytes_{0};  // written under mu_, read under the store's lock too
  // [0, written_) holds the sum of the parts added so far; past it the memory holds anything (a
  // kept mapping's old bytes). Every block's parts come in order from its start, so a part begins
  // at or below written_.
  uint64_t written_ GUARDED_BY(mu_) = 0;
  uint64_t attempt_ = 0;            // under the store's lock
  std::map<uint32_t, Contribution> contributions_;  // written under the store's lock, until complete
  std::map<uint32_t, uint32_t> arriving_;           // data index -> member, while its block arrives
  bool spoiled_ = false;
};

// A rank's image (what its replica carries) in this daemon's memory, for FetchBlock.
struct OwnImage {
  std::shared_ptr<const void> keep;  // keeps `data` mapped
  const char* data = nullptr;
  uint64_t bytes = 0;
  // Whether the memory still holds that checkpoint (a slot is reused once a newer one is kept).
  std::function<bool()> still_held;
};
// The image of (job, rank)'s memory checkpoint of `step` taken by the attempt (`run_id`,
// `resumed_from`), while it is held here; NOT_FOUND otherwise.
using OwnImageSource = std::function<Result<OwnImage>(const std::string& job, uint32_t rank, int64_t step,
                                                      const std::string& run_id, int64_t resumed_from)>;

class ParityStore {
 public:
  // `self`: this member's index in `group`.
  ParityStore(ParityGroup group, uint32_t self, HostMemory memory);

  // A block on its way in: Begin checks its header and reserves the room it needs; Append adds its
  // parts in order into the share; Finish records it and completes the share when it was the last
  // one missing. An Incoming dropped without Finish spoils its step's share.
  class Incoming {
   public:
    ~Incoming();
    Incoming(const Incoming&) = delete;
    Incoming& operator=(const Incoming&) = delete;
    // The next part (ParityStore::Begin's part_bytes each but the last), `xxh3` its checksum as sent.
    Status Append(const std::vector<ByteSpan>& spans, uint64_t xxh3);
    const ShareBlock& block() const { return block_; }

   private:
    friend class ParityStore;
    Incoming(ParityStore* store, std::shared_ptr<ParityShare> share, uint32_t index, ShareBlock block,
             uint64_t block_bytes)
        : store_(store), share_(std::move(share)), index_(index), block_(std::move(block)), block_bytes_(block_bytes) {}
    ParityStore* store_;
    std::shared_ptr<ParityShare> share_;
    uint32_t index_;
    ShareBlock block_;
    uint64_t block_bytes_;
    uint64_t received_ = 0;
    bool finished_ = false;
  };
  // INVALID_ARGUMENT for a header that does not fit the group (a member or stripe out of range, a
  // member that is not a data member of the stripe, a stripe this member holds no share of, a
  // position not below member_ranks) or the bounds of a replica's header; ALREADY_EXISTS when the
  // share has this block already or is complete; RESOURCE_EXHAUSTED when its room is not in the budget.
  Result<std::unique_ptr<Incoming>> Begin(ShareBlock block);
  // All parts arrived: FAILED_PRECONDITION when bytes are missing.
  Status Finish(std::unique_ptr<Incoming> incoming);
  // A member's word that it has no ranks of `notice.meta.job` at step `notice.meta.step`
  // (member_ranks 0, no block): the shares of that step of `notice.stripe` no longer wait for it.
  // INVALID_ARGUMENT as Begin for a header that does not fit the group; RESOURCE_EXHAUSTED when
  // kMaxToldCounts steps' counts are held.
  Status Tell(const ShareBlock& notice);

  // The complete share of (job, position, stripe), at `step` or the newest when `step` is 0; NOT_FOUND otherwise.
  Result<std::shared_ptr<const ParityShare>> Find(const std::string& job, uint32_t position, uint32_t stripe,
                                                  int64_t step = 0) const;
  // The complete shares of `job` whose stripes have `member` as a data member (what a rebuild of it can use).
  std::vector<std::shared_ptr<const ParityShare>> SharesFor(const std::string& job, uint32_t member) const;
  // Forgets a job's shares.
  void Forget(const std::string& job);
  // Member `member`'s word that it gave `job`'s memory back (flashckpt release, --idle-release). A
  // share of the job goes once M of the members whose blocks are in it (or arriving), or all of them,
  // have said so: a rebuild of any other block of its stripe needs K pieces, and fewer are then held
  // anywhere. A member that never says so (a lost one) does not keep the job's shares. A block of
  // the job from the member takes its word back. Returns how many shares went; INVALID_ARGUMENT for
  // a job name or member that does not fit.
  Result<size_t> Released(const std::string& job, uint32_t member);

  uint64_t held_bytes() const;  // of complete shares
  uint64_t kept_bytes() const;  // memory of replaced shares kept for the next share of their place
  uint64_t building_bytes() const;
  size_t complete_count() const;
  size_t share_count() const;  // complete and being built (at most kMaxSharesHeld)
  int64_t oldest_complete_step() const;  // of the complete shares; 0 when none is held

  const ParityGroup& group() const { return group_; }
  uint32_t self() const { return self_; }

 private:
  using Key = std::tuple<std::string, uint32_t, uint32_t>;  // (job, position, stripe)
  struct Slot {
    std::shared_ptr<ParityShare> complete;
    std::map<int64_t, std::shared_ptr<ParityShare>> building;  // by step
  };
  // The data index of the block's member in its stripe and this member's row there; INVALID_ARGUMENT
  // when the header does not fit the group.
  Result<std::pair<uint32_t, uint32_t>> PlaceOf(const ShareBlock& block) const;
  // Records that `member` has `ranks` ranks of the job at the step (the most it told). At most
  // kMaxToldCounts (job, step, stripe) counts: when full, those of jobs without shares here go, and
  // then RESOURCE_EXHAUSTED.
  Status TellLocked(const std::string& job, int64_t step, uint32_t stripe, uint32_t member, uint32_t ranks)
      REQUIRES(mu_);
  // Completes the shares of (job, step, stripe), at any position, that have every block they wait for.
  void CompleteStepLocked(const std::string& job, int64_t step, uint32_t stripe,
                          std::vector<std::shared_ptr<ParityShare>>* replaced) REQUIRES(mu_);
  // Whether every data member of the share's stripe with a rank at its position has added its block.
  bool CompleteLocked(const ParityShare& share) const REQUIRES(mu_);
  void SpoilLocked(const std::shared_ptr<ParityShare>& share, std::vector<std::shared_ptr<ParityShare>>* dropped)
      REQUIRES(mu_);
  size_t CountLocked() const REQUIRES(mu_);
  // Whether any share of `job` (complete or being built) is held here.
  bool HoldsJobLocked(const std::string& job) const REQUIRES(mu_);
  // A share being built that starts as `held`, a complete share (its bytes, by then immutable, are
  // copied): for a block that comes after `held` was completed without it.
  Result<std::shared_ptr<ParityShare>> CopyOf(const ParityShare& held, const std::string& what);
  // Drops the entry of (job, position, stripe) when it holds no share.
  void PruneLocked(const std::string& job, uint32_t position, uint32_t stripe) REQUIRES(mu_);
  // Keeps the memory of the shares in `gone` that nothing else holds for the next share of their
  // (job, position, stripe) (see Memory above), and lets go of the rest; empties `gone`.
  void Keep(std::vector<std::shared_ptr<ParityShare>>* gone) EXCLUDES(mu_);
  // The kept memory of (job, position, stripe), if any; kept mappings of places that hold no share go to `freed`.
  std::unique_ptr<ReplicaMapping> TakeKeptLocked(const Key& key, std::vector<std::unique_ptr<ReplicaMapping>>* freed)
      REQUIRES(mu_);
  void PruneKeptLocked(std::vector<std::unique_ptr<ReplicaMapping>>* freed) REQUIRES(mu_);

  const ParityGroup group_;
  const uint32_t self_;
  const ParityCode code_;
  HostMemory memory_;
  mutable Mutex mu_;
  std::map<Key, Slot> slots_ GUARDED_BY(mu_);
  // (job, step, stripe) -> member -> how many ranks of the job it said it has.
  std::map<std::tuple<std::string, int64_t, uint32_t>, std::map<uint32_t, uint32_t>> told_ GUARDED_BY(mu_);
  std::map<Key, std::unique_ptr<ReplicaMapping>> kept_ GUARDED_BY(mu_);  // released (ReplicaMapping::Release)
  // job -> the members that said they gave its memory back (Released), for jobs with shares here.
  std::map<std::string, std::set<uint32_t>> released_ GUARDED_BY(mu_);
};

}  // namespace flashckpt

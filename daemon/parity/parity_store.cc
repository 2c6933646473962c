#include "daemon/parity/parity_store.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/format/checksum.h"

namespace flashckpt {
namespace {

std::string Who(const ShareBlock& b) {
  return "parity block of job '" + b.meta.job + "' rank " + std::to_string(b.meta.rank) + " step " +
         std::to_string(b.meta.step) + " from member " + std::to_string(b.member) + " for stripe " +
         std::to_string(b.stripe);
}

// The told counts of this many steps are kept per (job, stripe).
constexpr size_t kToldSteps = kBuildingSteps + 1;

}  // namespace

const uint8_t* ParityShare::data() const {
  return mapping_ ? reinterpret_cast<const uint8_t*>(mapping_->data()) : nullptr;
}

ParityShare::~ParityShare() = default;

ParityStore::ParityStore(ParityGroup group, uint32_t self, HostMemory memory)
    : group_(group),
      self_(self),
      code_(ParityCode::Make(group.data_blocks(), group.parity()).value()),
      memory_(std::move(memory)) {}

Result<std::pair<uint32_t, uint32_t>> ParityStore::PlaceOf(const ShareBlock& block) const {
  RETURN_IF_ERROR(ValidateJobName(block.meta.job));
  if (block.member >= group_.members() || block.stripe >= group_.members()) {
    return InvalidArgument(Who(block) + ": the group has " + std::to_string(group_.members()) + " members");
  }
  std::optional<uint32_t> index = group_.DataIndexOf(block.stripe, block.member);
  if (!index) return InvalidArgument(Who(block) + ": that member holds parity of the stripe, it sends it no data");
  std::optional<uint32_t> row = group_.RowOf(block.stripe, self_);
  if (!row) {
    return InvalidArgument(Who(block) + ": member " + std::to_string(self_) + " holds no share of that stripe");
  }
  return std::make_pair(*index, *row);
}

Status ParityStore::TellLocked(const std::string& job, int64_t step, uint32_t stripe, uint32_t member,
                               uint32_t ranks) {
  const auto key = std::make_tuple(job, step, stripe);
  if (!told_.count(key) && told_.size() >= kMaxToldCounts) {
    // The counts of jobs that hold no share here go first (jobs that ended).
    for (auto t = told_.begin(); t != told_.end();) {
      auto held = slots_.lower_bound({std::get<0>(t->first), 0, 0});
      const bool holds = held != slots_.end() && std::get<0>(held->first) == std::get<0>(t->first);
      t = holds ? std::next(t) : told_.erase(t);
    }
    if (told_.size() >= kMaxToldCounts) {
      return ResourceExhausted("parity rank counts of " + std::to_string(kMaxToldCounts) + " steps are held");
    }
  }
  auto& told = told_[key];
  // The most it said for the step: its ranks' blocks may be sent before and after another of its
  // ranks registered.
  told[member] = std::max(told[member], ranks);
  // Only the newest steps' counts are kept per (job, stripe).
  std::vector<int64_t> steps;
  for (auto t = told_.lower_bound({job, 0, 0}); t != told_.end() && std::get<0>(t->first) == job; ++t) {
    if (std::get<2>(t->first) == stripe) steps.push_back(std::get<1>(t->first));
  }
  for (size_t i = 0; i + kToldSteps < steps.size(); ++i) told_.erase({job, steps[i], stripe});
  return Status::OK();
}

Status ParityStore::Tell(const ShareBlock& notice) {
  RETURN_IF_ERROR(PlaceOf(notice).status());
  if (notice.member_ranks != 0 || notice.position != 0 || notice.meta.step <= 0) {
    return InvalidArgument(Who(notice) + ": a count without a block says the member has no ranks of a step (>= 1)");
  }
  std::vector<std::shared_ptr<ParityShare>> replaced;  // kept or freed after the lock
  {
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(TellLocked(notice.meta.job, notice.meta.step, notice.stripe, notice.member, 0));
    CompleteStepLocked(notice.meta.job, notice.meta.step, notice.stripe, &replaced);
  }
  Keep(&replaced);
  return Status::OK();
}

Result<std::unique_ptr<ParityStore::Incoming>> ParityStore::Begin(ShareBlock block) {
  const ReplicaMeta& m = block.meta;
  ASSIGN_OR_RETURN(const auto place, PlaceOf(block));
  const uint32_t index = place.first;  // the member's data index in the stripe
  const uint32_t row = place.second;   // this member's share of the stripe
  if (block.member_ranks == 0 || block.member_ranks > kMaxRanksPerMember || block.position >= block.member_ranks) {
    return InvalidArgument(Who(block) + ": position " + std::to_string(block.position) + " of " +
                           std::to_string(block.member_ranks) + " ranks (at most " +
                           std::to_string(kMaxRanksPerMember) + ")");
  }
  if (m.step <= 0 || m.layout.size() > kMaxReplicaMetaBytes || m.extra.size() > kMaxReplicaMetaBytes) {
    return InvalidArgument(Who(block) + ": a step of at least 1 and a layout and extra state of at most " +
                           std::to_string(kMaxReplicaMetaBytes) + " bytes each are needed");
  }
  const uint64_t block_bytes = group_.Block(m.bytes, *group_.BlockOfStripe(block.member, block.stripe)).bytes;
  if (block_bytes > 0 && (m.part_bytes < kMinReplicaPartBytes || m.part_bytes > kMaxReplicaPartBytes)) {
    return InvalidArgument(Who(block) + ": parts of " + std::to_string(m.part_bytes) + " bytes; they must be " +
                           std::to_string(kMinReplicaPartBytes) + " to " + std::to_string(kMaxReplicaPartBytes));
  }

  // A late block: the share of its step was completed without its member, whose count of ranks was
  // told lower then (a rank that registered after its member's other ranks had coded the step). A
  // copy of the complete share, made off the lock (a complete share does not change), takes it in
  // and replaces the share once complete.
  std::shared_ptr<const ParityShare> late_of;
  {
    MutexLock lock(&mu_);
    if (auto r = released_.find(m.job); r != released_.end()) r->second.erase(block.member);  // back again
    auto s = slots_.find({m.job, block.position, block.stripe});
    if (s != slots_.end() && s->second.complete && s->second.complete->step_ == m.step &&
        !s->second.complete->contributions_.count(index) && !s->second.building.count(m.step)) {
      // Of the same run and restored step (attempt numbers are per rank: a late rank's is later).
      const ReplicaMeta& first = s->second.complete->contributions_.begin()->second.meta;
      if (first.run_id == m.run_id && first.resumed_from == m.resumed_from) late_of = s->second.complete;
    }
  }
  std::shared_ptr<ParityShare> late;
  if (late_of) {
    ASSIGN_OR_RETURN(late, CopyOf(*late_of, Who(block)));
  }

  std::shared_ptr<ParityShare> share;
  std::vector<std::shared_ptr<ParityShare>> dropped;  // kept or freed after the lock
  std::unique_ptr<ReplicaMapping> reuse;              // the place's kept memory, for a share begun here
  std::vector<std::unique_ptr<ReplicaMapping>> freed;  // unmapped after the lock
  bool began = false;                                  // this block begins its share
  {
    MutexLock lock(&mu_);
    Slot& slot = slots_[{m.job, block.position, block.stripe}];
    auto same_attempt = [&](const ParityShare& s) {
      auto c = s.contributions_.find(index);
      return c != s.contributions_.end() && c->second.meta.attempt == m.attempt && c->second.meta.run_id == m.run_id;
    };
    if (slot.complete && slot.complete->step_ == m.step && same_attempt(*slot.complete)) {
      return AlreadyExists(Who(block) + ": the share of that step is complete");
    }
    auto it = slot.building.find(m.step);
    if (it != slot.building.end() && it->second->contributions_.count(index) && !same_attempt(*it->second)) {
      // Another attempt's block of the step: the share it went into is of a timeline the job left.
      SpoilLocked(it->second, &dropped);  // leaves `slot` in place (PruneLocked would drop it)
      it = slot.building.end();
    }
    if (it == slot.building.end()) {
      if (CountLocked() >= kMaxSharesHeld) {
        PruneLocked(m.job, block.position, block.stripe);
        return ResourceExhausted(Who(block) + ": " + std::to_string(kMaxSharesHeld) + " parity shares are held");
      }
      std::shared_ptr<ParityShare> fresh;
      if (late && slot.complete == late_of) {
        fresh = std::move(late);  // still the share the copy was made of
      } else {
        fresh = std::shared_ptr<ParityShare>(new ParityShare(m.job, m.step, block.position, block.stripe, row));
        began = true;
      }
      it = slot.building.emplace(m.step, std::move(fresh)).first;
      // The oldest step being built gives way to a newer one.
      while (slot.building.size() > kBuildingSteps) SpoilLocked(slot.building.begin()->second, &dropped);
      it = slot.building.find(m.step);
      if (it == slot.building.end()) {
        PruneLocked(m.job, block.position, block.stripe);
        return AlreadyExists(Who(block) + ": a newer step's share is being built");
      }
    }
    share = it->second;
    if (share->contributions_.count(index)) {
      return AlreadyExists(Who(block) + ": the share has that member's block already");
    }
    if (share->arriving_.count(index)) {
      // An earlier try's push still runs, and may yet fail: not counted as held (the sender tries
      // again, and then finds the block in, or the share spoiled and begun again).
      return Unavailable(Who(block) + ": that member's block is still arriving from an earlier push; try again");
    }
    if (Status told = TellLocked(m.job, m.step, block.stripe, block.member, block.member_ranks); !told.ok()) {
      if (share->contributions_.empty() && share->arriving_.empty()) {
        SpoilLocked(share, &dropped);
        PruneLocked(m.job, block.position, block.stripe);
      }
      return told;
    }
    share->arriving_[index] = block.member;
    if (began && block_bytes > 0) reuse = TakeKeptLocked({m.job, block.position, block.stripe}, &freed);
  }
  Keep(&dropped);
  freed.clear();

  // The share grows to the longest block: a longer one than seen so far maps more (or takes the
  // kept memory of its place), off the store's lock.
  std::unique_ptr<ReplicaMapping> outgrown;  // unmapped after the share's lock
  if (block_bytes > 0) {
    MutexLock apply(&share->mu_);
    if (block_bytes > share->bytes_.load() && share->mapping_ && share->mapping_->bytes() >= block_bytes) {
      share->bytes_.store(block_bytes);  // a kept mapping longer than the blocks so far
    } else if (block_bytes > share->bytes_.load()) {
      const bool reused =
          reuse && !share->mapping_ && reuse->bytes() >= block_bytes && reuse->Reserve(Who(block)).ok();
      Result<std::unique_ptr<ReplicaMapping>> grown =
          reused ? std::move(reuse) : ReplicaMapping::Make(block_bytes, &memory_, Who(block));
      if (!grown.ok()) {
        std::vector<std::shared_ptr<ParityShare>> unused;  // freed after the lock
        MutexLock lock(&mu_);
        share->arriving_.erase(index);
        if (share->contributions_.empty() && share->arriving_.empty()) {
          // Made for this block alone: it goes, and does not count against the shares held.
          SpoilLocked(share, &unused);
          PruneLocked(share->job_, share->position_, share->stripe_);
        }
        return grown.status();
      }
      if (share->mapping_) std::memcpy((*grown)->data(), share->mapping_->data(), share->written_);
      outgrown = std::exchange(share->mapping_, std::move(*grown));
      share->bytes_.store(block_bytes);
    }
  }
  return std::unique_ptr<Incoming>(new Incoming(this, std::move(share), index, std::move(block), block_bytes));
}

Result<std::shared_ptr<ParityShare>> ParityStore::CopyOf(const ParityShare& held, const std::string& what) {
  auto copy = std::shared_ptr<ParityShare>(
      new ParityShare(held.job_, held.step_, held.position_, held.stripe_, held.row_));
  copy->attempt_ = held.attempt_;
  copy->contributions_ = held.contributions_;
  const uint64_t bytes = held.bytes_.load();
  if (bytes > 0) {
    ASSIGN_OR_RETURN(copy->mapping_, ReplicaMapping::Make(bytes, &memory_, what));
    std::memcpy(copy->mapping_->data(), held.mapping_->data(), bytes);
    copy->bytes_.store(bytes);
    MutexLock written(&copy->mu_);
    copy->written_ = bytes;
  }
  return copy;
}

Status ParityStore::Incoming::Append(const std::vector<ByteSpan>& spans, uint64_t xxh3) {
  uint64_t bytes = 0;
  for (const ByteSpan& s : spans) bytes += s.size;
  const uint64_t left = block_bytes_ - received_;
  const uint64_t want = std::min(block_.meta.part_bytes, left);
  if (left == 0 || bytes != want) {
    return InvalidArgument(Who(block_) + ": a part of " + std::to_string(bytes) + " bytes, expected " +
                           std::to_string(want));
  }
  Xxh3Stream sum;
  for (const ByteSpan& s : spans) sum.Update(s.data, s.size);
  if (sum.Digest() != xxh3) {
    return Corruption(Who(block_) + ": a part at offset " + std::to_string(received_) + " arrived with checksum " +
                      ChecksumHex(xxh3) + " but its bytes have " + ChecksumHex(sum.Digest()));
  }
  MutexLock apply(&share_->mu_);
  uint8_t* base = reinterpret_cast<uint8_t*>(share_->mapping_->data());
  uint64_t at = received_;
  for (const ByteSpan& s : spans) {
    // Added into what earlier blocks wrote; written as the first term past it.
    const auto* piece = reinterpret_cast<const uint8_t*>(s.data);
    const uint64_t added = at < share_->written_ ? std::min<uint64_t>(s.size, share_->written_ - at) : 0;
    store_->code_.Accumulate(index_, share_->row_, piece, added, base + at);
    store_->code_.Assign(index_, share_->row_, piece + added, s.size - added, base + at + added);
    at += s.size;
  }
  share_->written_ = std::max(share_->written_, at);
  received_ = at;
  return Status::OK();
}

ParityStore::Incoming::~Incoming() {
  if (finished_) return;
  // Its parts are in the share: the step's share can no longer be completed.
  std::vector<std::shared_ptr<ParityShare>> dropped;
  MutexLock lock(&store_->mu_);
  store_->SpoilLocked(share_, &dropped);
  store_->PruneLocked(share_->job_, share_->position_, share_->stripe_);
}

Status ParityStore::Finish(std::unique_ptr<Incoming> incoming) {
  if (incoming->received_ != incoming->block_bytes_) {
    return FailedPrecondition(Who(incoming->block_) + ": " + std::to_string(incoming->received_) + " of " +
                              std::to_string(incoming->block_bytes_) + " bytes arrived");
  }
  std::vector<std::shared_ptr<ParityShare>> replaced;  // kept or freed after the lock
  {
    MutexLock lock(&mu_);
    incoming->finished_ = true;
    ParityShare& share = *incoming->share_;
    if (share.spoiled_) return Cancelled(Who(incoming->block_) + ": a newer step's share took its place");
    share.arriving_.erase(incoming->index_);
    share.attempt_ = std::max(share.attempt_, incoming->block_.meta.attempt);
    share.contributions_[incoming->index_] = {incoming->block_.member, incoming->block_bytes_,
                                              std::move(incoming->block_.meta)};
    // This block may complete its own share, and its member's count may complete the shares of the
    // step at positions it has no rank at.
    CompleteStepLocked(share.job_, share.step_, share.stripe_, &replaced);
  }
  incoming.reset();  // its share, if replaced as a straggler, is then held by `replaced` alone
  Keep(&replaced);
  return Status::OK();
}

void ParityStore::Keep(std::vector<std::shared_ptr<ParityShare>>* gone) {
  std::vector<std::unique_ptr<ReplicaMapping>> freed;  // unmapped after the lock
  for (std::shared_ptr<ParityShare>& share : *gone) {
    // Held elsewhere (a rebuild reading it, a block still arriving): its memory goes with it. Only
    // a mapping of the share's own length is kept, so that a place whose blocks shrank does not
    // keep charging the budget for the longer ones.
    if (share.use_count() != 1 || !share->mapping_ || share->mapping_->bytes() != share->bytes()) continue;
    // The last other holder's reads of the bytes happen before the next share's writes into them.
    std::atomic_thread_fence(std::memory_order_acquire);
    std::unique_ptr<ReplicaMapping> mapping = std::move(share->mapping_);
    mapping->Release();  // off the lock: a madvise over the whole mapping
    MutexLock lock(&mu_);
    const Key key{share->job_, share->position_, share->stripe_};
    if (slots_.count(key) == 0) {
      freed.push_back(std::move(mapping));
      continue;
    }
    std::unique_ptr<ReplicaMapping>& kept = kept_[key];
    if (kept) freed.push_back(std::move(kept));
    kept = std::move(mapping);
    PruneKeptLocked(&freed);
  }
  gone->clear();
}

std::unique_ptr<ReplicaMapping> ParityStore::TakeKeptLocked(const Key& key,
                                                            std::vector<std::unique_ptr<ReplicaMapping>>* freed) {
  std::unique_ptr<ReplicaMapping> taken;
  if (auto it = kept_.find(key); it != kept_.end()) {
    taken = std::move(it->second);
    kept_.erase(it);
  }
  PruneKeptLocked(freed);
  return taken;
}

void ParityStore::PruneKeptLocked(std::vector<std::unique_ptr<ReplicaMapping>>* freed) {
  for (auto it = kept_.begin(); it != kept_.end();) {
    if (slots_.count(it->first) != 0) {
      ++it;
      continue;
    }
    freed->push_back(std::move(it->second));
    it = kept_.erase(it);
  }
}

void ParityStore::CompleteStepLocked(const std::string& job, int64_t step, uint32_t stripe,
                                     std::vector<std::shared_ptr<ParityShare>>* replaced) {
  for (auto it = slots_.lower_bound({job, 0, 0}); it != slots_.end() && std::get<0>(it->first) == job; ++it) {
    if (std::get<2>(it->first) != stripe) continue;
    auto b = it->second.building.find(step);
    if (b == it->second.building.end() || !CompleteLocked(*b->second)) continue;
    std::shared_ptr<ParityShare> done = std::move(b->second);
    it->second.building.erase(b);
    // Older steps being built would complete after this one: the newest complete share is what
    // the members hold now.
    while (!it->second.building.empty() && it->second.building.begin()->first < done->step_) {
      SpoilLocked(it->second.building.begin()->second, replaced);
    }
    const std::shared_ptr<ParityShare>& held = it->second.complete;
    if (held && std::make_pair(held->attempt_, held->step_) > std::make_pair(done->attempt_, done->step_)) {
      replaced->push_back(std::move(done));  // a straggler of an older step or attempt
      continue;
    }
    if (held) replaced->push_back(std::move(it->second.complete));
    Logger("parity")->debug("parity share complete job={} step={} stripe={} position={} blocks={}", job, done->step_,
                            done->stripe_, done->position_, done->contributions_.size());
    it->second.complete = std::move(done);
  }
}

bool ParityStore::CompleteLocked(const ParityShare& share) const {
  if (!share.arriving_.empty() || share.spoiled_) return false;
  auto told = told_.find({share.job_, share.step_, share.stripe_});
  if (told == told_.end()) return false;
  for (uint32_t d = 0; d < group_.data_blocks(); ++d) {
    auto count = told->second.find(group_.DataMember(share.stripe_, d));
    if (count == told->second.end()) return false;  // not heard of yet
    if (count->second > share.position_ && !share.contributions_.count(d)) return false;
  }
  return !share.contributions_.empty();
}

void ParityStore::SpoilLocked(const std::shared_ptr<ParityShare>& share,
                              std::vector<std::shared_ptr<ParityShare>>* dropped) {
  share->spoiled_ = true;
  auto it = slots_.find({share->job_, share->position_, share->stripe_});
  if (it == slots_.end()) return;
  auto b = it->second.building.find(share->step_);
  if (b != it->second.building.end() && b->second == share) {
    dropped->push_back(std::move(b->second));
    it->second.building.erase(b);
  }
}

void ParityStore::PruneLocked(const std::string& job, uint32_t position, uint32_t stripe) {
  auto it = slots_.find({job, position, stripe});
  if (it == slots_.end() || it->second.complete || !it->second.building.empty()) return;
  slots_.erase(it);
  if (!HoldsJobLocked(job)) released_.erase(job);  // release words are kept only for jobs with shares here
}

bool ParityStore::HoldsJobLocked(const std::string& job) const {
  auto it = slots_.lower_bound({job, 0, 0});
  return it != slots_.end() && std::get<0>(it->first) == job;
}

size_t ParityStore::CountLocked() const {
  size_t n = 0;
  for (const auto& [key, slot] : slots_) n += (slot.complete ? 1 : 0) + slot.building.size();
  return n;
}

Result<std::shared_ptr<const ParityShare>> ParityStore::Find(const std::string& job, uint32_t position,
                                                             uint32_t stripe, int64_t step) const {
  MutexLock lock(&mu_);
  auto it = slots_.find({job, position, stripe});
  if (it == slots_.end() || !it->second.complete || (step != 0 && it->second.complete->step_ != step)) {
    return NotFound("no complete parity share of job '" + job + "' position " + std::to_string(position) +
                    " stripe " + std::to_string(stripe) + (step != 0 ? " step " + std::to_string(step) : "") +
                    " is held");
  }
  return std::shared_ptr<const ParityShare>(it->second.complete);
}

std::vector<std::shared_ptr<const ParityShare>> ParityStore::SharesFor(const std::string& job, uint32_t member) const {
  std::vector<std::shared_ptr<const ParityShare>> out;
  MutexLock lock(&mu_);
  for (auto it = slots_.lower_bound({job, 0, 0}); it != slots_.end() && std::get<0>(it->first) == job; ++it) {
    if (it->second.complete && group_.DataIndexOf(std::get<2>(it->first), member)) out.push_back(it->second.complete);
  }
  return out;
}

void ParityStore::Forget(const std::string& job) {
  std::vector<Slot> gone;                              // freed after the lock
  std::vector<std::unique_ptr<ReplicaMapping>> freed;  // as well
  MutexLock lock(&mu_);
  released_.erase(job);
  for (auto it = slots_.lower_bound({job, 0, 0}); it != slots_.end() && std::get<0>(it->first) == job;) {
    for (auto& [step, share] : it->second.building) share->spoiled_ = true;
    gone.push_back(std::move(it->second));
    it = slots_.erase(it);
  }
  for (auto it = told_.lower_bound({job, 0, 0}); it != told_.end() && std::get<0>(it->first) == job;) {
    it = told_.erase(it);
  }
  PruneKeptLocked(&freed);
}

Result<size_t> ParityStore::Released(const std::string& job, uint32_t member) {
  RETURN_IF_ERROR(ValidateJobName(job));
  if (member >= group_.members()) {
    return InvalidArgument("member " + std::to_string(member) + " of a group of " + group_.ToString());
  }
  std::vector<std::shared_ptr<ParityShare>> gone;      // freed after the lock
  std::vector<std::unique_ptr<ReplicaMapping>> freed;  // as well
  MutexLock lock(&mu_);
  if (!HoldsJobLocked(job)) return size_t{0};  // none held here
  std::set<uint32_t>& said = released_[job];
  said.insert(member);
  // A rebuild of one of a stripe's blocks needs K of the stripe's other pieces: with M of the
  // blocks in a share given back, fewer than K are held anywhere, so the share can rebuild nothing
  // and goes (as it does once every member whose block is in it has said so: none is left to
  // rebuild). A member that never says so, one that was lost, holds nothing up.
  const size_t enough = group_.parity();
  auto useless = [&said, enough](const ParityShare& share) {
    std::set<uint32_t> in;  // the members whose blocks are in it, or arriving
    for (const auto& [index, c] : share.contributions_) in.insert(c.member);
    for (const auto& [index, from] : share.arriving_) in.insert(from);
    size_t given_back = 0;
    for (uint32_t m : in) given_back += said.count(m);
    return given_back >= enough || given_back == in.size();
  };
  for (auto it = slots_.lower_bound({job, 0, 0}); it != slots_.end() && std::get<0>(it->first) == job;) {
    Slot& slot = it->second;
    if (slot.complete && useless(*slot.complete)) gone.push_back(std::move(slot.complete));
    for (auto b = slot.building.begin(); b != slot.building.end();) {
      if (!useless(*b->second)) {
        ++b;
        continue;
      }
      b->second->spoiled_ = true;
      gone.push_back(std::move(b->second));
      b = slot.building.erase(b);
    }
    it = slot.complete || !slot.building.empty() ? std::next(it) : slots_.erase(it);
  }
  if (!HoldsJobLocked(job)) released_.erase(job);  // none left
  PruneKeptLocked(&freed);
  return gone.size();
}

uint64_t ParityStore::held_bytes() const {
  MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [key, slot] : slots_) n += slot.complete ? slot.complete->bytes_.load() : 0;
  return n;
}

uint64_t ParityStore::kept_bytes() const {
  MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [key, mapping] : kept_) n += mapping->bytes();
  return n;
}

uint64_t ParityStore::building_bytes() const {
  MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [key, slot] : slots_) {
    for (const auto& [step, share] : slot.building) n += share->bytes_.load();
  }
  return n;
}

int64_t ParityStore::oldest_complete_step() const {
  MutexLock lock(&mu_);
  int64_t oldest = 0;
  for (const auto& [key, slot] : slots_) {
    if (slot.complete && (oldest == 0 || slot.complete->step_ < oldest)) oldest = slot.complete->step_;
  }
  return oldest;
}

size_t ParityStore::share_count() const {
  MutexLock lock(&mu_);
  return CountLocked();
}

size_t ParityStore::complete_count() const {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [key, slot] : slots_) n += slot.complete ? 1 : 0;
  return n;
}

}  // namespace flashckpt

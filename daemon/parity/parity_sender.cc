#include "daemon/parity/parity_sender.h"

#include <algorithm>

#include "common/base/log.h"
#include "common/base/names.h"
#include "daemon/parity/parity_client.h"

namespace flashckpt {
namespace {

constexpr std::chrono::milliseconds kFirstRetry{1000};
constexpr std::chrono::milliseconds kLongestRetry{30000};
// The longest one block's push may take.
constexpr std::chrono::minutes kBlockPushTimeout{5};

}  // namespace

ParitySender::ParitySender(Options options) : options_(std::move(options)) {}

ParitySender::~ParitySender() { Stop(); }

Status ParitySender::Start() {
  for (const auto& [index, address] : options_.members) {
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, ReplicaChannel(address));
    auto member = std::make_unique<Member>();
    member->where = ParityMember{index, address.target, channel};
    member->address = address;
    member->status.index = index;
    member->status.target = address.target;
    channels_.push_back(member->where);
    members_.push_back(std::move(member));
  }
  for (auto& member : members_) member->thread = std::thread([this, m = member.get()] { Run(m); });
  return Status::OK();
}

void ParitySender::OfferNoRanks(const std::string& job, int64_t step) {
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    auto told = told_no_ranks_.find(job);
    if (told != told_no_ranks_.end() && told->second == step) return;  // the step's blocks come together
    if (told == told_no_ranks_.end() && told_no_ranks_.size() >= kMaxJobsToldNoRanks) told_no_ranks_.clear();
    told_no_ranks_[job] = step;
  }
  auto notice = std::make_shared<OutgoingReplica>();
  notice->meta.job = job;
  notice->meta.step = step;  // bytes 0: each block is empty
  Offer({std::move(notice), 0, 0});
}

void ParitySender::OfferReleased(const std::string& job) {
  auto notice = std::make_shared<OutgoingReplica>();
  notice->meta.job = job;  // bytes 0: each block is empty
  Offer({std::move(notice), 0, 0, true});
  KeepWord(job);  // on the caller's thread: it holds no lock of the daemon's
}

bool ParitySender::WordQueuedLocked(const std::string& job) const {
  for (const auto& member : members_) {
    if (member->queue.count({job, kReleased}) > 0) return true;
  }
  return false;
}

void ParitySender::KeepWord(const std::string& job) {
  if (!options_.keep_word) return;
  MutexLock lock(&mu_);
  for (;;) {
    const uint64_t seen = word_changes_;
    // A stopping sender delivers nothing more and empties its queues: every word is kept then (Stop
    // settles the jobs whose word their blocks dropped).
    const bool pending = stopping_ || WordQueuedLocked(job);
    lock.Unlock();
    options_.keep_word(job, pending);  // file I/O in the daemon: off the lock
    lock.Lock();
    if (word_changes_ == seen) return;  // what it kept is still so
  }
}

void ParitySender::Offer(Offered offered) {
  const uint32_t what = offered.released            ? kReleased
                        : offered.member_ranks == 0 ? kNoRanks
                                                    : offered.replica->meta.rank;
  const Key key{offered.replica->meta.job, what};
  MutexLock lock(&mu_);
  if (stopping_) {
    if (offered.released) released_while_stopping_.insert(key.first);  // kept by OfferReleased's KeepWord
    return;
  }
  bool words_changed = offered.released;
  for (auto& member : members_) {
    // Only members that hold a share of one of its blocks' stripes.
    bool holds = false;
    for (uint32_t b = 0; b < options_.group.data_blocks() && !holds; ++b) {
      holds = options_.group.RowOf(options_.group.StripeOfBlock(options_.self, b), member->where.index).has_value();
    }
    if (!holds) continue;
    if (!offered.released) {
      // The job runs here again: a release word not sent yet would reach the holder after these
      // blocks and count against them. (One sent already arrives first: one thread sends in order.)
      auto word = member->queue.find({key.first, kReleased});
      if (word != member->queue.end()) {
        member->released.push_back(std::move(word->second.offered.replica));
        member->queue.erase(word);
        words_changed = true;
      }
    }
    Member::Queued& q = member->queue[key];
    if (q.offered.replica) member->released.push_back(std::move(q.offered.replica));  // the newest wins
    q = Member::Queued{offered, member->next_turn++, {}};
  }
  if (words_changed) {
    word_changes_ += 1;
    // Blocks are offered under the daemon's lock: a member's thread updates the job's record.
    if (!offered.released) words_dirty_.insert(key.first);
  }
  cv_.NotifyAll();
}

void ParitySender::Forget(const std::string& job) {
  MutexLock lock(&mu_);
  told_no_ranks_.erase(job);
  for (auto& member : members_) {
    for (auto it = member->queue.begin(); it != member->queue.end();) {
      if (it->first.first != job) {
        ++it;
        continue;
      }
      member->released.push_back(std::move(it->second.offered.replica));
      it = member->queue.erase(it);
    }
    if (member->in_flight_job == job) {
      member->in_flight_forgotten = true;  // the next block's call, too, is cancelled as it starts
      if (member->in_flight != nullptr) member->in_flight->TryCancel();
    }
  }
  cv_.NotifyAll();
}

void ParitySender::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& member : members_) {
      if (member->in_flight) member->in_flight->TryCancel();
    }
    cv_.NotifyAll();
  }
  for (auto& member : members_) {
    if (member->thread.joinable()) member->thread.join();
  }
  std::vector<std::shared_ptr<const OutgoingReplica>> going;  // released here, after the lock
  std::vector<std::pair<std::string, bool>> settle;  // the records of the jobs whose word their blocks dropped
  {
    MutexLock lock(&mu_);
    for (const std::string& job : words_dirty_) {
      settle.emplace_back(job, WordQueuedLocked(job) || released_while_stopping_.count(job) > 0);
    }
    words_dirty_.clear();
    for (auto& member : members_) {
      for (auto& [key, q] : member->queue) going.push_back(std::move(q.offered.replica));
      member->queue.clear();
      for (auto& r : member->released) going.push_back(std::move(r));
      member->released.clear();
    }
  }
  if (options_.keep_word) {
    for (const auto& [job, pending] : settle) options_.keep_word(job, pending);
  }
}

std::vector<ParityMemberStatus> ParitySender::MemberStatus() const {
  std::vector<ParityMemberStatus> out;
  MutexLock lock(&mu_);
  for (const auto& member : members_) out.push_back(member->status);
  return out;
}

Status ParitySender::PushBlocks(Member* member, const Offered& offered, uint64_t* bytes) {
  const OutgoingReplica& replica = *offered.replica;
  const ParityGroup& group = options_.group;
  for (uint32_t b = 0; b < group.data_blocks(); ++b) {
    const uint32_t stripe = group.StripeOfBlock(options_.self, b);
    if (!group.RowOf(stripe, member->where.index)) continue;
    ShareBlock block{options_.self, stripe, offered.position, offered.member_ranks, replica.meta, offered.released};
    block.meta.part_bytes = options_.part_bytes;
    const ParityGroup::Range range = group.Block(replica.meta.bytes, b);
    if (replica.still_held && !replica.still_held()) {
      return Cancelled("the rank reused the slot of step " + std::to_string(replica.meta.step) + " before it was sent");
    }
    Status pushed = PushParityBlock(
        member->where.channel.get(), block, replica.data + range.offset, range.bytes,
        std::chrono::system_clock::now() + kBlockPushTimeout,
        [this, member](grpc::ClientContext* ctx) {
          MutexLock lock(&mu_);
          member->in_flight = ctx;
          if (ctx && (stopping_ || member->in_flight_forgotten)) ctx->TryCancel();
        },
        replica.still_held, replica.mapping);
    if (pushed.code() == StatusCode::kAlreadyExists) continue;  // held from an earlier try
    if (!pushed.ok()) return pushed;
    *bytes += range.bytes;
  }
  return Status::OK();
}

void ParitySender::Run(Member* member) {
  MutexLock lock(&mu_);
  while (true) {
    // What the queue let go of goes here, off the lock.
    if (!member->released.empty()) {
      std::vector<std::shared_ptr<const OutgoingReplica>> going;
      going.swap(member->released);
      lock.Unlock();
      going.clear();
      lock.Lock();
      continue;
    }
    if (stopping_) return;
    if (!words_dirty_.empty()) {  // a job's word that its blocks dropped: its record, off the lock
      const std::string job = *words_dirty_.begin();
      lock.Unlock();
      KeepWord(job);
      lock.Lock();
      if (!stopping_) words_dirty_.erase(job);  // else Stop settles it
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    auto next = member->queue.end();
    auto first_due = std::chrono::steady_clock::time_point::max();
    for (auto it = member->queue.begin(); it != member->queue.end(); ++it) {
      if (it->second.due > now) {
        first_due = std::min(first_due, it->second.due);
        continue;
      }
      if (next == member->queue.end() || it->second.turn < next->second.turn) next = it;
    }
    if (next == member->queue.end()) {
      if (first_due == std::chrono::steady_clock::time_point::max()) {
        cv_.Wait(&lock);
      } else {
        cv_.WaitFor(&lock, std::chrono::duration_cast<std::chrono::milliseconds>(first_due - now) +
                               std::chrono::milliseconds(1));
      }
      continue;
    }
    const Key key = next->first;
    Offered offered = next->second.offered;
    const uint64_t turn = next->second.turn;
    member->in_flight_job = offered.released ? std::string() : key.first;  // Forget cancels blocks, not a word
    member->in_flight_forgotten = false;
    lock.Unlock();

    const auto started = std::chrono::steady_clock::now();
    uint64_t bytes = 0;
    Status pushed = PushBlocks(member, offered, &bytes);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    const bool held = !offered.replica->still_held || offered.replica->still_held();

    lock.Lock();
    member->in_flight_job.clear();
    DaemonEvent event;
    auto it = member->queue.find(key);
    const bool replaced = it == member->queue.end() || it->second.turn != turn;
    const ReplicaMeta& meta = offered.replica->meta;
    if (pushed.ok()) {
      member->status.last_error.clear();
      member->last_error_code = StatusCode::kOk;
      member->retry_wait = std::chrono::milliseconds(0);
      if (!replaced) member->queue.erase(it);
      if (offered.released) {  // a word that the job's memory was given back
        Logger("parity")->debug("parity release sent job={} member={}", meta.job, member->where.target);
      } else if (offered.member_ranks == 0) {  // a word of no ranks: not a checkpoint's blocks
        Logger("parity")->debug("parity count sent job={} step={} of_ranks=0 member={}", meta.job, meta.step,
                                member->where.target);
      } else {
        member->status.blocks_sent += 1;
        member->status.bytes_sent += bytes;
        event.kind = DaemonEvent::Kind::kParitySent;
        event.bytes = bytes;
        event.seconds = secs;
        Logger("parity")->debug("parity blocks sent job={} rank={} step={} member={} bytes={} secs={:.3f}",
                                meta.job, meta.rank, meta.step, member->where.target, FormatBytes(bytes), secs);
      }
    } else if (pushed.code() == StatusCode::kCancelled && (!offered.released || stopping_)) {
      // A newer checkpoint of the rank took the slot (or the daemon stops): nothing failed. (A word
      // has no slot: cancelled by the holder, it is retried as a failure is.)
      if (!replaced) member->queue.erase(it);
    } else {
      member->status.pushes_failed += 1;
      member->status.last_error = pushed.ToString();
      const bool passing = pushed.code() != StatusCode::kFailedPrecondition &&
                           pushed.code() != StatusCode::kInvalidArgument &&
                           (pushed.code() != StatusCode::kCancelled || offered.released);
      if (!replaced) {
        if (passing && held && !stopping_) {
          member->retry_wait = std::clamp(member->retry_wait * 2, kFirstRetry, kLongestRetry);
          it->second.due = std::chrono::steady_clock::now() + member->retry_wait;
        } else {
          member->queue.erase(it);
        }
      }
      if (pushed.code() != member->last_error_code && pushed.code() != StatusCode::kCancelled) {
        member->last_error_code = pushed.code();
        if (offered.released) {
          Logger("parity")->warn("parity release not sent job={} member={}: {}", meta.job, member->where.target,
                                 pushed.ToString());
        } else {
          event.kind = DaemonEvent::Kind::kParityFailed;
          event.reason = pushed.ToString();
          Logger("parity")->warn("parity blocks not sent job={} rank={} step={} member={}: {}", meta.job, meta.rank,
                                 meta.step, member->where.target, pushed.ToString());
        }
      }
    }
    // A word that left the queue (sent, or refused for good) may leave the job's record; one that a
    // stop cancelled in flight was not delivered, and its record stays for the next daemon.
    const bool word_left = offered.released && !replaced && !stopping_ && member->queue.count(key) == 0;
    if (word_left) word_changes_ += 1;
    if (event.kind != DaemonEvent::Kind::kUnknown && options_.on_event) {
      event.job = meta.job;
      event.rank = meta.rank;
      event.step = meta.step;
      event.peer = member->where.target;
      lock.Unlock();
      options_.on_event(std::move(event));
      if (word_left) KeepWord(key.first);
      offered = {};
      lock.Lock();
    } else {
      lock.Unlock();
      if (word_left) KeepWord(key.first);
      offered = {};  // the last reference may unmap the segment: off the lock
      lock.Lock();
    }
  }
}

}  // namespace flashckpt

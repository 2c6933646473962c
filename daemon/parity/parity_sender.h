// The sending side of erasure-coded peer memory (flashckptd --ec-group, --ec-parity): each memory
// checkpoint a local rank keeps is cut into the group's K blocks (ParityGroup::Block) and each block
// is pushed to the members that hold its stripe's parity (flashckpt.v1.Parity Push), off the
// trainers' path; the holders code it into their shares as it arrives (parity_store.h).
//
// One thread per other member. Each has its own queue of at most one checkpoint per (job, rank): a
// newer one offered while an older one waits takes its place, so a slow or down member holds up
// neither the others nor a save, and the queue is bounded by the node's ranks. Blocks are read
// straight from the slot; before a push is finished the slot is asked whether it still holds that
// checkpoint, and the push is cancelled when it does not (the holder then drops the share of that
// step, which could not be completed anyway). A push that fails for a passing reason is tried again
// after 1 s, then twice as long each time up to 30 s, while the slot holds the checkpoint and no
// newer one is queued.
//
// Offer never blocks and takes only the sender's own lock, so the daemon calls it under its lock;
// what a queue lets go of is released by the member's thread (the last reference to a slot segment
// unmaps it, which must not happen under the daemon's lock).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/base/mutex.h"
#include "common/base/status.h"
#include "daemon/parity/parity_group.h"
#include "daemon/parity/parity_rebuild.h"
#include "daemon/replica/replica_client.h"
#include "daemon/replica/replica_sender.h"
#include "flashckpt/daemon_types.h"

namespace flashckpt {

// A member's status as its sender sees it (flashckpt status).
struct ParityMemberStatus {
  uint32_t index = 0;
  std::string target;
  uint64_t blocks_sent = 0;
  uint64_t bytes_sent = 0;
  uint64_t pushes_failed = 0;
  std::string last_error;  // empty after a push that succeeded
};

class ParitySender {
 public:
  struct Options {
    ParityGroup group = ParityGroup::Make(2, 1).value();
    uint32_t self = 0;
    // The other members: their index in the group and how to reach them.
    std::vector<std::pair<uint32_t, ReplicaPeer>> members;
    uint64_t part_bytes = 1u << 20;
    // Told of each checkpoint whose blocks a member holds (PARITY_SENT) and of each new error of a
    // member (PARITY_FAILED), from the member's thread without the sender's lock. May be empty.
    std::function<void(DaemonEvent)> on_event;
    // Every member's host, by index (ParityGroupConfig::hosts): whom the holders' service lets push
    // and list as which member.
    std::vector<std::string> hosts;
    // Keeps the release words (OfferReleased) across a stop: called with (job, true) while a word of
    // the job waits for some member, and with (job, false) once none does (delivered to each, refused
    // for good, or dropped by the job's next blocks); a word that a stop keeps from being delivered
    // stays kept. The daemon keeps a state record and offers the word again when it starts. Called
    // without the sender's lock, from OfferReleased's caller, a member's thread or Stop(), perhaps
    // from two threads at once for one job: the calls may come in any order, but the last one of a
    // job gives its state as it is then. May be empty.
    std::function<void(const std::string& job, bool pending)> keep_word;
  };
  explicit ParitySender(Options options);
  // Makes each member's channel and starts its thread.
  Status Start();
  ~ParitySender();
  ParitySender(const ParitySender&) = delete;
  ParitySender& operator=(const ParitySender&) = delete;

  // A rank's kept memory checkpoint, at `position` of the member's `member_ranks` ranks of the job.
  struct Offered {
    std::shared_ptr<const OutgoingReplica> replica;
    uint32_t position = 0;
    uint32_t member_ranks = 0;
    bool released = false;  // OfferReleased's word (member_ranks 0, no block)
  };
  // Queues it for every member that holds a share of one of its blocks. Never blocks. With
  // member_ranks 0 it is a word that this member has no ranks of the job (OfferNoRanks).
  void Offer(Offered offered) EXCLUDES(mu_);
  // Tells the holders of this member's stripes that it has no ranks of `job` at `step`, so that
  // their shares of the step do not wait for its blocks (the service heard of the job from another
  // member's block). Once per step as long as the job's blocks come step by step (a job rolled back
  // to an earlier step is told again). Never blocks.
  void OfferNoRanks(const std::string& job, int64_t step) EXCLUDES(mu_);
  // Forgets a job's queued checkpoints (a released job), and cancels a push of its blocks under way
  // (it holds the rank's segment until it ends).
  void Forget(const std::string& job) EXCLUDES(mu_);
  // Tells the holders of this member's stripes that it gave `job`'s memory back, so that they drop
  // the job's shares once every member whose block is in them has (ParityStore::Released). After
  // Forget(job). Calls Options::keep_word on the caller's thread (file I/O in the daemon): never
  // under a lock that I/O must not be held under.
  void OfferReleased(const std::string& job) EXCLUDES(mu_);
  // Cancels the pushes in flight, stops the threads, lets go of every queued checkpoint. Idempotent.
  void Stop() EXCLUDES(mu_);

  std::vector<ParityMemberStatus> MemberStatus() const EXCLUDES(mu_);
  // The other members' channels (set by Start), for a rebuild.
  const std::vector<ParityMember>& members() const { return channels_; }
  const ParityGroup& group() const { return options_.group; }
  uint32_t self() const { return options_.self; }
  const std::vector<std::string>& hosts() const { return options_.hosts; }

 private:
  // (job, rank); (job, kNoRanks) for OfferNoRanks, (job, kReleased) for OfferReleased.
  using Key = std::pair<std::string, uint32_t>;
  static constexpr uint32_t kNoRanks = ~0u;
  static constexpr uint32_t kReleased = ~0u - 1;
  static constexpr size_t kMaxJobsToldNoRanks = 4096;
  struct Member {
    ParityMember where;
    ReplicaPeer address;
    struct Queued {
      Offered offered;
      uint64_t turn = 0;
      std::chrono::steady_clock::time_point due{};
    };
    std::map<Key, Queued> queue;
    uint64_t next_turn = 0;
    std::chrono::milliseconds retry_wait{0};
    StatusCode last_error_code = StatusCode::kOk;
    ParityMemberStatus status;
    grpc::ClientContext* in_flight = nullptr;
    std::string in_flight_job;  // the job whose blocks are being pushed ("": none)
    bool in_flight_forgotten = false;  // that job was forgotten meanwhile: its calls are cancelled
    std::vector<std::shared_ptr<const OutgoingReplica>> released;
    std::thread thread;
  };
  void Run(Member* member) EXCLUDES(mu_);
  // Pushes the blocks of `offered` whose stripes `member` holds a share of; OK when it holds them all.
  Status PushBlocks(Member* member, const Offered& offered, uint64_t* bytes) EXCLUDES(mu_);
  // Whether a release word of `job` waits for some member.
  bool WordQueuedLocked(const std::string& job) const REQUIRES(mu_);
  // Tells options_.keep_word whether a word of `job` waits, after a word was queued or left a queue
  // (word_changes_ counted up). Should another change come while it calls, it calls again.
  void KeepWord(const std::string& job) EXCLUDES(mu_);

  const Options options_;
  mutable Mutex mu_;
  CondVar cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::map<std::string, int64_t> told_no_ranks_ GUARDED_BY(mu_);  // job -> the step last offered
  uint64_t word_changes_ GUARDED_BY(mu_) = 0;  // release words queued or gone from a queue, any job
  std::set<std::string> words_dirty_ GUARDED_BY(mu_);  // jobs whose queued word their blocks dropped
  std::set<std::string> released_while_stopping_ GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Member>> members_;  // their queues and status guarded by mu_
  std::vector<ParityMember> channels_;            // set by Start
};

}  // namespace flashckpt

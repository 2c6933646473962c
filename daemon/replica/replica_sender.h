// The sending side of peer replication (flashckptd --replicate-to): each memory checkpoint that a
// local rank keeps is streamed to every peer daemon (flashckpt.v1.Replica Push), off the trainers'
// path, so that a rank whose node is lost can get it back from a peer.
//
// One thread per peer. Each peer has its own queue holding at most one checkpoint per (job, rank):
// a newer one offered while an older one still waits takes its place (the newest wins when a peer
// is slow or down), so the queue is bounded by the ranks of the node. A push streams the slot image
// straight from shared memory; after every part and before it finishes it asks whether the slot
// still holds that checkpoint (the rank may reuse it once a newer one is kept), and cancels the
// push when it does not: the peer then keeps the replica it held before. A push that fails for a
// passing reason (the peer down or short of room) is tried again, after 1 s, then twice as long
// each time up to 30 s, unless a newer checkpoint of the rank has been queued meanwhile or its slot
// no longer holds it; a push the peer acknowledges resets the wait. An offer older than one offered
// before for the same rank is ignored. --replicate-max-rate caps each peer's stream.
//
// Offer never blocks and takes only the sender's own lock, so the daemon calls it under its lock;
// what a queue lets go of is released by the peer's thread, never by Offer (the last reference to
// a slot segment unmaps it, which must not happen under the daemon's lock).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/base/clock.h"
#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/format/layout.h"
#include "flashckpt/daemon_types.h"
#include "daemon/replica/replica_client.h"
#include "daemon/replica/replica_store.h"

namespace flashckpt {

// Where a replica's bytes start in a slot: after the slot's header page (daemon bookkeeping that
// the trainer and the daemon write: never sent).
inline constexpr uint64_t kSlotImageOffset = kPageSize;

// XXH3-64 of what makes a rank's layout (its topology, slot size, file images and every tensor's
// spec and place): a replica restores only into a rank whose layout has the same.
uint64_t ReplicaLayoutFingerprint(const RankLayout& layout);

// One rank's kept memory checkpoint, on its way to the peers.
struct OutgoingReplica {
  ReplicaMeta meta;                  // its header: meta.bytes bytes at `data`
  std::shared_ptr<const void> keep;  // keeps `data` mapped while this is queued or sent
  // The mapping `data` lies in, alone: held by the parts lent to gRPC until it lets go of them, which
  // may be after the push (SliceLoans); not the slot's segment, whose end is the daemon's to run.
  std::shared_ptr<const void> mapping;
  const char* data = nullptr;
  // Whether the slot still holds this checkpoint. Called by the peers' threads without the
  // sender's lock; false cancels the push.
  std::function<bool()> still_held;
};

class ReplicaSender {
 public:
  struct Options {
    std::vector<ReplicaPeer> peers;
    uint64_t max_rate = 0;  // bytes per second to each peer; 0: no cap
    uint64_t part_bytes = 1u << 20;
    std::string node_name;  // --node-name: who retracts, for a peer without TLS (RetractReplica)
    // Told of each acknowledged push and of each new error of a peer (REPLICA_SENT, REPLICA_FAILED),
    // from the peer's thread without the sender's lock. May be empty.
    std::function<void(DaemonEvent)> on_event;
    const Clock* clock = &Clock::Real();  // retries, rate and timings
  };
  explicit ReplicaSender(Options options);
  // Makes each peer's channel (reading the TLS files) and starts its thread. Offers and retractions
  // before Start reach no peer.
  Status Start();
  ~ReplicaSender();
  ReplicaSender(const ReplicaSender&) = delete;
  ReplicaSender& operator=(const ReplicaSender&) = delete;

  // Queues `replica` for every peer, in place of a queued one of the same (job, rank). Never blocks.
  void Offer(std::shared_ptr<const OutgoingReplica> replica) EXCLUDES(mu_);
  // The rank was restored to `step` and its new attempt numbered `attempt` (a rollback, or a
  // restart): every peer is told (Replica.Retract), so that none keeps a replica of a later step of
  // the attempt the rank left, for a replacement node to fetch. One per (job, rank) and peer, the
  // latest; sent ahead of the peer's pushes when due, tried again (1 s doubling to 30 s) after a
  // passing failure, cancelled by Stop and Forget. Never blocks.
  void Retract(const std::string& job, uint32_t rank, int64_t step, uint64_t attempt) EXCLUDES(mu_);
  // Forgets a job's queued checkpoints and retractions and its steps (a released job).
  void Forget(const std::string& job) EXCLUDES(mu_);
  // Cancels the pushes in flight at once, whatever `deadline` (replicas are a bonus; a stop does not
  // wait for them), stops the threads and lets go of every queued checkpoint. Idempotent.
  void Stop(Clock::TimePoint deadline = Clock::TimePoint::max()) EXCLUDES(mu_);

  std::vector<ReplicaPeerStatus> PeerStatus() const EXCLUDES(mu_);

  // The peers' channels, in the order given, also for fetching replicas back (set by Start).
  struct PeerChannel {
    std::string target;
    std::shared_ptr<grpc::Channel> channel;
  };
  const std::vector<PeerChannel>& channels() const { return channels_; }

 private:
  using Key = std::pair<std::string, uint32_t>;  // (job, rank)
  using Version = std::pair<uint64_t, int64_t>;   // (attempt, step) of a checkpoint
  struct Peer {
    ReplicaPeer address;
    std::shared_ptr<grpc::Channel> channel;
    struct Queued {
      std::shared_ptr<const OutgoingReplica> replica;
      uint64_t turn = 0;  // served oldest offer first, among those due
      std::chrono::steady_clock::time_point due{};  // a retry waits until then
    };
    std::map<Key, Queued> queue;
    struct Retraction {
      int64_t step = 0;
      uint64_t attempt = 0;
      std::chrono::steady_clock::time_point due{};
    };
    std::map<Key, Retraction> retracts;  // sent first when due
    std::chrono::milliseconds retract_wait{0};  // before the next retraction retry; 0 after one answered
    StatusCode last_retract_code = StatusCode::kOk;  // retraction failures are logged once per change
    uint64_t next_turn = 0;
    std::chrono::milliseconds retry_wait{0};  // before the next retry; 0 after an acknowledged push
    StatusCode last_error_code = StatusCode::kOk;  // of the last push; failures are told once per change
    std::map<Key, Version> acked;  // the last checkpoint acknowledged, per rank
    ReplicaPeerStatus status;
    grpc::ClientContext* in_flight = nullptr;  // the push or retraction under way (Stop cancels it)
    std::string in_flight_job;                 // its job (Forget cancels it)
    // What the queue let go of, for the peer's thread to release off the lock.
    std::vector<std::shared_ptr<const OutgoingReplica>> released;
    std::thread thread;
  };
  // A Peer's fields other than `address`, `channel` and `thread` are guarded by mu_.
  void Run(Peer* peer) EXCLUDES(mu_);
  // The oldest queued offer that is due (queue.end(): none), lowering `first_due` to the first due time.
  std::map<Key, Peer::Queued>::iterator NextDueLocked(Peer* peer, Clock::TimePoint now, Clock::TimePoint* first_due)
      REQUIRES(mu_);
  // Tells the peer the rank was restored (Replica.Retract), logs what it dropped (`what`: the log's words).
  Result<int64_t> SendRetraction(Peer* peer, const Key& key, const Peer::Retraction& told, const std::string& what)
      EXCLUDES(mu_);
  // Logs a failed retraction and schedules its retry, or drops it once answered (unless replaced meanwhile).
  void RecordRetractionLocked(Peer* peer, const Key& key, const Peer::Retraction& told, const std::string& what,
                              const Result<int64_t>& dropped) REQUIRES(mu_);
  // How a push ended, as SendReplica saw it off the lock.
  struct PushOutcome {
    Status pushed;
    double seconds = 0;
    bool held = false;   // the peer holds it, or one as new
    bool retry = false;  // a passing failure, and the slot still holds it
  };
  // Pushes one checkpoint (Push), timing it, and logs an acknowledged one.
  PushOutcome SendReplica(Peer* peer, const OutgoingReplica& replica) EXCLUDES(mu_);
  // Records a push in the peer's status, requeues `replica` to retry; returns the event to tell (kUnknown: none).
  DaemonEvent RecordPushLocked(Peer* peer, const Key& key, std::shared_ptr<const OutgoingReplica>& replica,
                               const PushOutcome& outcome) REQUIRES(mu_);
  // At the stop: moves the queued checkpoints into `released` and drops the retractions not sent.
  void DropQueueLocked(Peer* peer, std::vector<std::shared_ptr<const OutgoingReplica>>* released) REQUIRES(mu_);
  // Streams one checkpoint to the peer: OK once the peer holds it.
  Status Push(Peer* peer, const OutgoingReplica& replica) EXCLUDES(mu_);

  const Options options_;
  const Clock& clock_;  // options_.clock
  mutable Mutex mu_;
  CondVar cv_;  // an offer, or the stop
  bool stopping_ GUARDED_BY(mu_) = false;
  std::map<Key, Version> offered_ GUARDED_BY(mu_);  // the last checkpoint offered, per rank
  std::vector<std::shared_ptr<const OutgoingReplica>> after_stop_ GUARDED_BY(mu_);  // released by the destructor
  // Set up by Start before the threads run; their queues and status are guarded by mu_.
  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<PeerChannel> channels_;  // set by Start
};

}  // namespace flashckpt

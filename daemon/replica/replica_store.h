// The replicas a daemon holds for its peers (flashckptd --replica-listen): copies of other nodes'
// ranks' memory checkpoints, the newest complete one per (job, rank, origin), so that a rank whose
// node was lost can fetch it from here. Copies of different origins (two unrelated jobs of one name
// on two nodes, or a peer that pushes a rank it does not run) are kept apart: a push replaces only
// its own origin's copy, and the fetching daemon chooses among them by its job's lineage. The bytes are the peer's (opaque: its slot image, layout and extra
// state); what the store checks is that they arrived whole and unchanged: every part carries its
// XXH3-64, checked on arrival and again whenever the replica is read.
//
// Memory: each replica takes its bytes, layout and extra state from the daemon's --max-host-memory
// (HostMemory), from the moment its header arrives (a push that would not fit is refused then,
// before any data) until the replica is replaced, dropped or evicted. A push in progress never
// disturbs the replica it will replace: both are held until the new one has fully arrived and
// verified. The memory of a replaced replica's bytes is kept for the next push of its (job, rank,
// origin) when the two have the same size (fresh memory would be zeroed by the kernel page by page
// as the parts arrive: on a push that is the largest cost after the copy). Kept memory is not
// counted in the budget: it is handed to the kernel to take back whenever it needs the memory
// (MADV_FREE), and the next push reserves its bytes as for fresh memory. At most one such mapping
// per replica held; it is unmapped when its replica is no longer held.
//
// Bounds, so that no peer can take the room of the others: each origin (the name its certificate
// proves, or the node name it gives without TLS) holds at most ReplicaLimits::max_per_origin
// replicas and max_bytes_per_origin bytes; a push over either evicts that origin's oldest replica
// (the one that arrived first). At most kMaxReplicasHeld are held in all; a push beyond that evicts
// the oldest replica of the origin that holds the most. Steps are at most kMaxStep, attempts at most
// kMaxAttemptAhead ahead of this host's clock (attempts are numbered in wall-clock ms).
//
// Which one is newer, within an origin's copies: the later attempt of the job (a job restarted from
// an older step starts a new attempt, whose replicas replace the old run's), then the later step.
//
// Who may act on a rank's copies: a run's replicas of a rank belong to the origin that first pushed
// one here; another origin's push of that run is refused (FAILED_PRECONDITION), so an allowed peer
// cannot put a copy of its own making under a run of another node's. A retraction (a rank restored
// to an earlier step) drops the retracting origin's own copies, and another origin's only when the
// retracting one fetched that origin's copy of the rank here (it restored the rank from here).
// Nothing a peer says about itself is believed beyond that: a replica's bytes are the origin's.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/base/mutex.h"
#include "common/base/status.h"

namespace flashckpt {

// Bytes in memory the caller owns (a part as it arrived: one span per received slice).
struct ByteSpan {
  const char* data = nullptr;
  size_t size = 0;
};
// Copies `spans` in order to `dest` and returns the XXH3-64 of the bytes copied, each span hashed
// where it landed while it is still in the cache: for a destination that is read again soon (a
// fetched slot, verified whole at once; a rebuild's rings).
uint64_t CopyHashed(const std::vector<ByteSpan>& spans, char* dest);
// The same for a destination that is not read again soon (a replica held for a peer): each span is
// hashed where it arrived (the received slice, still in the cache) and written with non-temporal
// stores (StreamCopy), so the destination's lines are not read in only to be overwritten. What a
// held replica holds is checked again whenever it is read out (Replica::VerifiedPart).
uint64_t StreamHashed(const std::vector<ByteSpan>& spans, char* dest);

// Where the store's bytes come from: Reserve(bytes, what) fails (RESOURCE_EXHAUSTED, saying `what`
// needed them) when they do not fit the budget; Release gives back what Reserve took.
struct HostMemory {
  std::function<Status(uint64_t bytes, const std::string& what)> reserve;
  std::function<void(uint64_t bytes)> release;
};

struct ReplicaMeta {
  std::string job;
  uint32_t rank = 0;
  int64_t step = 0;
  uint64_t attempt = 0;
  uint32_t world_size = 0;
  uint64_t bytes = 0;       // of the replica's image
  uint64_t part_bytes = 0;  // every part but the last has this many bytes
  std::string layout;       // the origin's description of the rank's layout (opaque here)
  std::string extra;        // the checkpoint's extra state (opaque here)
  std::string origin_node;  // the daemon that took it
  std::string from_peer;    // the name in the pushing peer's certificate ("" without TLS)
  std::string run_id;       // the attempt that took it (empty: a sender that did not say)
  int64_t resumed_from = 0;
};

// The limits of what a peer may send.
constexpr uint64_t kMinReplicaPartBytes = 64u << 10;
constexpr uint64_t kMaxReplicaPartBytes = 4u << 20;
constexpr uint64_t kMaxReplicaMetaBytes = 16u << 20;  // layout and extra, each
constexpr size_t kMaxReplicasHeld = 4096;             // (job, rank, origin) copies, of every origin
constexpr size_t kMaxReplicasPerOrigin = 1024;        // the default of ReplicaLimits::max_per_origin
constexpr std::chrono::minutes kMaxAttemptAhead{10};  // clock skew between nodes, and then some

struct ReplicaLimits {
  size_t max_per_origin = kMaxReplicasPerOrigin;
  uint64_t max_bytes_per_origin = 0;  // bytes, layout and extra state; 0: only the memory budget bounds it
};

// Who made a replica, for the bounds: the certificate name of the peer that pushed it, or without
// TLS the node name its header gives.
const std::string& OriginOf(const ReplicaMeta& meta);

// A complete, verified replica. Immutable once held; a reader keeps it (and its memory) alive while
// the store replaces it.
// The memory of a replica's bytes: an anonymous private mapping, its bytes reserved from the budget
// while it holds a replica.
class ReplicaMapping {
 public:
  // A fresh mapping, reserved.
  static Result<std::unique_ptr<ReplicaMapping>> Make(uint64_t bytes, HostMemory* memory, const std::string& who);
  ~ReplicaMapping();
  ReplicaMapping(const ReplicaMapping&) = delete;
  ReplicaMapping& operator=(const ReplicaMapping&) = delete;
  char* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  // Kept for a later replica: its reservation given back and its pages the kernel's to take back
  // (MADV_FREE; whatever it takes reads as zeros, and a replica writes every byte before reading).
  void Release();
  // Holds a replica again: its bytes reserved.
  Status Reserve(const std::string& who);

 private:
  ReplicaMapping(char* data, uint64_t bytes, HostMemory* memory) : data_(data), bytes_(bytes), memory_(memory) {}
  char* data_;
  uint64_t bytes_;
  HostMemory* memory_;
  bool reserved_ = true;
};

class Replica {
 public:
  ~Replica();
  Replica(const Replica&) = delete;
  Replica& operator=(const Replica&) = delete;

  const ReplicaMeta& meta() const { return meta_; }
  uint64_t parts() const { return sums_.size(); }
  // Part `i` (its bytes and where they start), checked against the XXH3-64 it arrived with:
  // CORRUPTION naming the part when the memory no longer holds what arrived.
  Result<std::pair<const char*, uint64_t>> VerifiedPart(uint64_t i) const;
  uint64_t part_sum(uint64_t i) const { return sums_[i]; }

 private:
  friend class ReplicaStore;
  Replica(ReplicaMeta meta, HostMemory* memory);
  // Takes `mapping` (a kept one of meta_.bytes), or maps fresh memory.
  Status Map(std::unique_ptr<ReplicaMapping> mapping);

  ReplicaMeta meta_;
  uint64_t accounted() const { return meta_.bytes + meta_.layout.size() + meta_.extra.size(); }
  uint64_t arrival_ = 0;  // the store's count of replicas held when this one was (the oldest: lowest)

  HostMemory* memory_;   // the layout's and extra state's bytes released by the destructor, when reserved_
  bool reserved_ = false;
  std::unique_ptr<ReplicaMapping> mapping_;  // meta_.bytes bytes
  char* data_ = nullptr;                     // mapping_'s
  std::vector<uint64_t> sums_;
  uint64_t received_ = 0;  // bytes written, while it arrives
};

class ReplicaStore {
 public:
  // `max_replica_bytes`: the most one replica may have (0: only the budget bounds it).
  ReplicaStore(HostMemory memory, uint64_t max_replica_bytes, ReplicaLimits limits = {});

  // A replica on its way in: Begin checks the header and reserves its bytes; Append takes the parts
  // in order; Finish holds it, in place of an older one of the same (job, rank). Dropping an
  // Incoming without Finish gives its memory back.
  class Incoming {
   public:
    // The next part: `spans` in order (as it arrived in the received slices), `xxh3` the checksum the
    // sender gave it, checked while the bytes are copied in.
    Status Append(const std::vector<ByteSpan>& spans, uint64_t xxh3);
    Status Append(const char* data, uint64_t bytes, uint64_t xxh3) { return Append({{data, bytes}}, xxh3); }
    const ReplicaMeta& meta() const { return replica_->meta(); }

   private:
    friend class ReplicaStore;
    explicit Incoming(std::unique_ptr<Replica> replica) : replica_(std::move(replica)) {}
    std::unique_ptr<Replica> replica_;
  };
  Result<std::unique_ptr<Incoming>> Begin(ReplicaMeta meta);
  // Holds the replica when it is newer (attempt, then step) than its origin's copy of its (job,
  // rank), or when the origin holds none; FAILED_PRECONDITION when bytes are missing, or it is not
  // newer and the held copy is of another run (naming it); ALREADY_EXISTS (and nothing changes)
  // when it is not newer than the origin's copy of the same run. FAILED_PRECONDITION too when its
  // run of the rank is another origin's here (Begin says so already, before any data). Evicts what
  // the bounds above ask for.
  Status Finish(std::unique_ptr<Incoming> incoming);

  // `node` (the name its certificate proves, or without TLS the node name it gives) was sent the
  // whole of `origin`'s replica of (job, rank): it may retract that origin's copies of the rank from
  // now on. The newest kMaxReplicasHeld such records are kept.
  void NoteFetched(const std::string& job, uint32_t rank, const std::string& node, const std::string& origin);
  // The replica of (job, rank) of `origin` (OriginOf; empty: of any origin, the newest by attempt,
  // then step): at `step`, or the newest held when step is 0; NOT_FOUND otherwise.
  Result<std::shared_ptr<const Replica>> Find(const std::string& job, uint32_t rank, int64_t step,
                                              const std::string& origin = "") const;
  // Drops `replica` if it is still the one held of its (job, rank, origin) (one that failed its checksums).
  void Drop(const Replica* replica);
  // `node` (as NoteFetched) restored the rank to `step` in a new attempt numbered `attempt`: drops
  // the held replicas of (job, rank) that are of an older attempt and a later step, of `node`'s own
  // origin and of the origins whose copy of the rank `node` fetched here, and from then on refuses
  // such a push of `node` (FAILED_PRECONDITION: one of the old attempt still on its way) until one
  // of `attempt` or a later one is held. Returns the step dropped, or 0 when none was (the newest
  // of them when several were); INVALID_ARGUMENT for a bad job name, a step outside 0..kMaxStep or
  // an attempt of 0 or more than kMaxAttemptAhead ahead of this host's clock.
  Result<int64_t> Retract(const std::string& job, uint32_t rank, int64_t step, uint64_t attempt,
                          const std::string& node);
  // What is held, of `job` ("" for every job), ordered by job and rank.
  std::vector<ReplicaMeta> List(const std::string& job) const;
  size_t count() const;       // copies held (one per job, rank and origin)
  uint64_t held_bytes() const;  // their bytes (not their layout and extra state)
  uint64_t evicted() const { return evicted_.load(); }  // replicas evicted by the bounds, so far
  uint64_t kept_bytes() const;  // memory of replaced replicas kept for the next push of their rank

 private:
  using Key = std::tuple<std::string, uint32_t, std::string>;  // (job, rank, origin)
  static Key KeyOf(const ReplicaMeta& m) { return {m.job, m.rank, OriginOf(m)}; }
  // Evicts replicas (into `evicted`, freed by the caller after the lock is let go) until `origin`
  // may hold one more (unless it holds `key` already, which the new one replaces) of `bytes`, and
  // the store one more: `origin`'s own oldest first, then, when the store is full, the oldest of
  // the origin that holds the most. RESOURCE_EXHAUSTED when `bytes` alone are over the origin's
  // bytes, or nothing is left to evict.
  Status MakeRoomLocked(const std::string& origin, const Key& key, uint64_t bytes,
                        std::vector<std::shared_ptr<const Replica>>* evicted) REQUIRES(mu_);
  // FAILED_PRECONDITION when `m`'s run of its rank belongs here to another origin than `m`'s.
  Status CheckRunOwnerLocked(const ReplicaMeta& m) const REQUIRES(mu_);
  // Evicts the oldest replica of `origin` other than `spare`'s into `evicted`; false when none is.
  bool EvictOldestLocked(const std::string& origin, const Key& spare, const char* why,
                         std::vector<std::shared_ptr<const Replica>>* evicted) REQUIRES(mu_);

  // Takes the mapping kept for `key` when it has `bytes` (nullptr when none has); kept mappings of
  // keys no longer held go to `freed`, to be unmapped after the lock is let go.
  std::unique_ptr<ReplicaMapping> TakeKeptLocked(const Key& key, uint64_t bytes,
                                                 std::vector<std::unique_ptr<ReplicaMapping>>* freed) REQUIRES(mu_);
  void PruneKeptLocked(std::vector<std::unique_ptr<ReplicaMapping>>* freed) REQUIRES(mu_);

  HostMemory memory_;
  const uint64_t max_replica_bytes_;
  const ReplicaLimits limits_;
  std::atomic<uint64_t> arrivals_{0};
  std::atomic<uint64_t> evicted_{0};
  mutable Mutex mu_;
  std::map<Key, std::shared_ptr<const Replica>> held_ GUARDED_BY(mu_);
  // Per (job, rank, origin) held, the memory of the replica its held one replaced.
  std::map<Key, std::unique_ptr<ReplicaMapping>> kept_ GUARDED_BY(mu_);
  // Per (job, rank, origin), the origin's latest retraction not yet followed by a replica of its
  // attempt: (attempt, restored step). At most kMaxReplicasHeld.
  std::map<Key, std::pair<uint64_t, int64_t>> retracted_ GUARDED_BY(mu_);
  // Per (job, rank, run), the origin whose replicas of the run are held here (the first to push
  // one); the oldest record is forgotten beyond kMaxRunOwners.
  using RunKey = std::tuple<std::string, uint32_t, std::string>;
  static constexpr size_t kMaxRunOwners = 4 * kMaxReplicasHeld;
  std::map<RunKey, std::string> run_owner_ GUARDED_BY(mu_);
  std::deque<RunKey> run_owner_order_ GUARDED_BY(mu_);
  // (job, rank, node, origin): `node` fetched `origin`'s copy of the rank (NoteFetched), oldest first.
  using FetchKey = std::tuple<std::string, uint32_t, std::string, std::string>;
  std::set<FetchKey> fetched_ GUARDED_BY(mu_);
  std::deque<FetchKey> fetched_order_ GUARDED_BY(mu_);
};

}  // namespace flashckpt

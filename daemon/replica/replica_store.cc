#include "daemon/replica/replica_store.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/base/stream_copy.h"
#include "common/format/checksum.h"

namespace flashckpt {
namespace {

std::string Who(const ReplicaMeta& m) {
  return "replica of job '" + m.job + "' rank " + std::to_string(m.rank) + " step " + std::to_string(m.step);
}

uint64_t PartsOf(const ReplicaMeta& m) { return m.bytes == 0 ? 0 : (m.bytes - 1) / m.part_bytes + 1; }

// Attempts are numbered in wall-clock ms by the daemon that numbers them (ReplicaHeader.attempt).
Status CheckAttempt(uint64_t attempt, const char* what) {
  const auto now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch()).count();
  const uint64_t most = static_cast<uint64_t>(now_ms) +
                        static_cast<uint64_t>(std::chrono::milliseconds(kMaxAttemptAhead).count());
  if (attempt > most) {
    return InvalidArgument(std::string(what) + ": attempt " + std::to_string(attempt) + " is more than " +
                           std::to_string(kMaxAttemptAhead.count()) + " minutes ahead of this host's clock (" +
                           std::to_string(now_ms) + " ms; attempts are numbered in wall-clock ms)");
  }
  return Status::OK();
}

}  // namespace

const std::string& OriginOf(const ReplicaMeta& meta) {
  return meta.from_peer.empty() ? meta.origin_node : meta.from_peer;
}

Result<std::unique_ptr<ReplicaMapping>> ReplicaMapping::Make(uint64_t bytes, HostMemory* memory,
                                                             const std::string& who) {
  RETURN_IF_ERROR(memory->reserve(bytes, who));
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    Status failed = ErrnoStatus("mmap", who);
    memory->release(bytes);
    return failed;
  }
  // Huge pages where the kernel offers them (transparent_hugepage "madvise" or "always"): fresh
  // memory is faulted in and zeroed 2 MiB at a time rather than 4 KiB (a first push of 1 GiB took
  // 2.5 s instead of 3.5 s in bench/replica_bench). It is the receiver's background work: a
  // compaction the kernel does for it delays the push, not a trainer. Without them, small pages.
  (void)::madvise(p, bytes, MADV_HUGEPAGE);
  return std::unique_ptr<ReplicaMapping>(new ReplicaMapping(static_cast<char*>(p), bytes, memory));
}

ReplicaMapping::~ReplicaMapping() {
  ::munmap(data_, bytes_);
  if (reserved_) memory_->release(bytes_);
}

void ReplicaMapping::Release() {
  if (!reserved_) return;
  (void)::madvise(data_, bytes_, MADV_FREE);  // without it (EINVAL before Linux 4.5) the pages stay
  memory_->release(bytes_);
  reserved_ = false;
}

Status ReplicaMapping::Reserve(const std::string& who) {
  if (reserved_) return Status::OK();
  RETURN_IF_ERROR(memory_->reserve(bytes_, who));
  reserved_ = true;
  return Status::OK();
}

Replica::Replica(ReplicaMeta meta, HostMemory* memory) : meta_(std::move(meta)), memory_(memory) {}

Replica::~Replica() {
  mapping_.reset();
  if (reserved_) memory_->release(accounted() - meta_.bytes);
}

Status Replica::Map(std::unique_ptr<ReplicaMapping> mapping) {
  if (mapping == nullptr) {
    ASSIGN_OR_RETURN(mapping, ReplicaMapping::Make(meta_.bytes, memory_, Who(meta_)));
  }
  mapping_ = std::move(mapping);
  data_ = mapping_->data();
  return Status::OK();
}

Result<std::pair<const char*, uint64_t>> Replica::VerifiedPart(uint64_t i) const {
  if (i >= sums_.size()) return InvalidArgument(Who(meta_) + " has no part " + std::to_string(i));
  const uint64_t from = i * meta_.part_bytes;
  const uint64_t n = std::min(meta_.part_bytes, meta_.bytes - from);
  const uint64_t got = Xxh3(data_ + from, n);
  if (got != sums_[i]) {
    return Corruption(Who(meta_) + ": part " + std::to_string(i) + " (bytes " + std::to_string(from) + "-" +
                      std::to_string(from + n) + ") has checksum " + ChecksumHex(got) + ", it arrived with " +
                      ChecksumHex(sums_[i]));
  }
  return std::make_pair(static_cast<const char*>(data_ + from), n);
}

ReplicaStore::ReplicaStore(HostMemory memory, uint64_t max_replica_bytes, ReplicaLimits limits)
    : memory_(std::move(memory)), max_replica_bytes_(max_replica_bytes), limits_(limits) {}

bool ReplicaStore::EvictOldestLocked(const std::string& origin, const Key& spare, const char* why,
                                     std::vector<std::shared_ptr<const Replica>>* evicted) {
  auto oldest = held_.end();
  for (auto it = held_.begin(); it != held_.end(); ++it) {
    if (it->first == spare || OriginOf(it->second->meta()) != origin) continue;
    if (oldest == held_.end() || it->second->arrival_ < oldest->second->arrival_) oldest = it;
  }
  if (oldest == held_.end()) return false;
  const ReplicaMeta& m = oldest->second->meta();
  Logger("replica")->warn("replica evicted job={} rank={} step={} origin={} bytes={}: {}", m.job, m.rank, m.step,
                          OriginOf(m), m.bytes, why);
  evicted->push_back(std::move(oldest->second));
  held_.erase(oldest);
  evicted_.fetch_add(1);
  return true;
}

Status ReplicaStore::MakeRoomLocked(const std::string& origin, const Key& key, uint64_t bytes,
                                    std::vector<std::shared_ptr<const Replica>>* evicted) {
  if (limits_.max_bytes_per_origin > 0 && bytes > limits_.max_bytes_per_origin) {
    return ResourceExhausted("a replica of " + FormatBytes(bytes) + " is over the " +
                             FormatBytes(limits_.max_bytes_per_origin) + " one peer's replicas may take here");
  }
  for (;;) {
    size_t count = 0;
    uint64_t taken = 0;
    for (const auto& [k, replica] : held_) {
      if (k == key || OriginOf(replica->meta()) != origin) continue;
      ++count;
      taken += replica->accounted();
    }
    if (count + 1 > limits_.max_per_origin) {
      if (EvictOldestLocked(origin, key, "its origin holds as many replicas as one peer may", evicted)) continue;
    } else if (limits_.max_bytes_per_origin > 0 && taken + bytes > limits_.max_bytes_per_origin) {
      if (EvictOldestLocked(origin, key, "its origin holds as many bytes as one peer may", evicted)) continue;
    } else if (held_.size() >= kMaxReplicasHeld && held_.find(key) == held_.end()) {
      std::map<std::string, size_t> per_origin;
      for (const auto& [k, replica] : held_) ++per_origin[OriginOf(replica->meta())];
      std::string largest;
      size_t most = 0;
      for (const auto& [o, n] : per_origin) {
        if (n > most) most = n, largest = o;
      }
      if (most > 0 && EvictOldestLocked(largest, key, "the store is full and its origin holds the most", evicted)) continue;
      return ResourceExhausted(std::to_string(kMaxReplicasHeld) + " ranks' replicas are held here");
    } else {
      return Status::OK();
    }
    return ResourceExhausted("peer '" + origin + "' holds as many replicas here as one peer may (" +
                             std::to_string(limits_.max_per_origin) + ", " +
                             FormatBytes(limits_.max_bytes_per_origin) + ")");
  }
}

Result<std::unique_ptr<ReplicaStore::Incoming>> ReplicaStore::Begin(ReplicaMeta meta) {
  RETURN_IF_ERROR(ValidateJobName(meta.job));
  if (meta.world_size == 0 || meta.rank >= meta.world_size) {
    return InvalidArgument("replica header: rank " + std::to_string(meta.rank) + " is not below world size " +
                           std::to_string(meta.world_size));
  }
  if (meta.step <= 0 || meta.step > kMaxStep) {
    return InvalidArgument("replica header: step must be from 1 to " + std::to_string(kMaxStep) + ", got " +
                           std::to_string(meta.step));
  }
  RETURN_IF_ERROR(CheckAttempt(meta.attempt, "replica header"));
  if (meta.bytes == 0) return InvalidArgument("replica header: a replica has bytes");
  if (meta.part_bytes < kMinReplicaPartBytes || meta.part_bytes > kMaxReplicaPartBytes) {
    return InvalidArgument("replica header: parts of " + std::to_string(meta.part_bytes) + " bytes (from " +
                           FormatBytes(kMinReplicaPartBytes) + " to " + FormatBytes(kMaxReplicaPartBytes) + ")");
  }
  if (meta.layout.size() > kMaxReplicaMetaBytes || meta.extra.size() > kMaxReplicaMetaBytes) {
    return InvalidArgument("replica header: layout or extra state over " + FormatBytes(kMaxReplicaMetaBytes));
  }
  if (!meta.origin_node.empty()) RETURN_IF_ERROR(ValidateNodeName(meta.origin_node));
  if (!meta.run_id.empty()) RETURN_IF_ERROR(ValidateRunId(meta.run_id));
  if (meta.resumed_from < 0 || meta.resumed_from > kMaxStep) {
    return InvalidArgument("replica resumed_from " + std::to_string(meta.resumed_from) + " is outside 0.." +
                           std::to_string(kMaxStep));
  }
  if (max_replica_bytes_ > 0 && meta.bytes > max_replica_bytes_) {
    return ResourceExhausted(Who(meta) + " has " + FormatBytes(meta.bytes) + ", over the " +
                             FormatBytes(max_replica_bytes_) + " a rank may have here (--max-rank-bytes)");
  }
  auto replica = std::unique_ptr<Replica>(new Replica(std::move(meta), &memory_));
  std::unique_ptr<ReplicaMapping> kept;
  {
    std::vector<std::shared_ptr<const Replica>> evicted;  // freed (their memory given back) before the reservation
    std::vector<std::unique_ptr<ReplicaMapping>> freed;   // as well
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckRunOwnerLocked(replica->meta_));
    RETURN_IF_ERROR(MakeRoomLocked(OriginOf(replica->meta_), KeyOf(replica->meta_), replica->accounted(), &evicted));
    kept = TakeKeptLocked(KeyOf(replica->meta_), replica->meta_.bytes, &freed);
  }
  // The layout and extra state, then the bytes, in a kept mapping or a fresh one.
  RETURN_IF_ERROR(memory_.reserve(replica->accounted() - replica->meta_.bytes, Who(replica->meta_)));
  replica->reserved_ = true;
  if (kept) RETURN_IF_ERROR(kept->Reserve(Who(replica->meta_)));
  RETURN_IF_ERROR(replica->Map(std::move(kept)));
  replica->sums_.reserve(PartsOf(replica->meta_));
  return std::unique_ptr<Incoming>(new Incoming(std::move(replica)));
}

uint64_t CopyHashed(const std::vector<ByteSpan>& spans, char* dest) {
  if (spans.size() == 1) {
    std::memcpy(dest, spans[0].data, spans[0].size);
    return Xxh3(dest, spans[0].size);
  }
  Xxh3Stream sum;
  for (const ByteSpan& s : spans) {
    std::memcpy(dest, s.data, s.size);
    sum.Update(dest, s.size);
    dest += s.size;
  }
  return sum.Digest();
}

uint64_t StreamHashed(const std::vector<ByteSpan>& spans, char* dest) {
  Xxh3Stream sum;
  for (const ByteSpan& s : spans) {
    sum.Update(s.data, s.size);
    StreamCopy(dest, s.data, s.size);
    dest += s.size;
  }
  StreamFence();
  return sum.Digest();
}

Status ReplicaStore::Incoming::Append(const std::vector<ByteSpan>& spans, uint64_t xxh3) {
  Replica& r = *replica_;
  uint64_t bytes = 0;
  for (const ByteSpan& s : spans) bytes += s.size;
  const uint64_t left = r.meta_.bytes - r.received_;
  const uint64_t want = std::min(r.meta_.part_bytes, left);
  if (left == 0) return InvalidArgument(Who(r.meta_) + ": more bytes than its header says (" +
                                        std::to_string(r.meta_.bytes) + ")");
  if (bytes != want) {
    return InvalidArgument(Who(r.meta_) + ": part " + std::to_string(r.sums_.size()) + " has " +
                           std::to_string(bytes) + " bytes, expected " + std::to_string(want));
  }
  // The bytes are the store's from here on: a part that fails its checksum fails the push, which
  // drops the whole replica.
  const uint64_t got = StreamHashed(spans, r.data_ + r.received_);
  if (got != xxh3) {
    return Corruption(Who(r.meta_) + ": part " + std::to_string(r.sums_.size()) + " arrived with checksum " +
                      ChecksumHex(got) + ", the sender's is " + ChecksumHex(xxh3));
  }
  r.received_ += bytes;
  r.sums_.push_back(xxh3);
  return Status::OK();
}

Status ReplicaStore::Finish(std::unique_ptr<Incoming> incoming) {
  incoming->replica_->arrival_ = arrivals_.fetch_add(1) + 1;
  std::shared_ptr<const Replica> replica(std::move(incoming->replica_));
  const ReplicaMeta& m = replica->meta();
  if (replica->received_ != m.bytes) {
    return FailedPrecondition(Who(m) + ": " + std::to_string(replica->received_) + " of its " +
                              std::to_string(m.bytes) + " bytes arrived");
  }
  std::shared_ptr<const Replica> replaced;  // freed after the lock is let go
  std::vector<std::shared_ptr<const Replica>> evicted;  // as well
  std::vector<std::unique_ptr<ReplicaMapping>> freed;   // as well
  std::unique_ptr<ReplicaMapping> to_keep;              // released from the budget before it is kept
  {
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckRunOwnerLocked(m));
    auto retracted = retracted_.find(KeyOf(m));
    if (retracted != retracted_.end() && m.attempt < retracted->second.first && m.step > retracted->second.second) {
      return FailedPrecondition(Who(m) + " (attempt " + std::to_string(m.attempt) + ") is of a timeline the rank left: it was restored to step " +
                                std::to_string(retracted->second.second) + " in attempt " +
                                std::to_string(retracted->second.first));
    }
    // Only the origin's own copy is compared with (and replaced): another origin's is kept apart.
    auto it = held_.find(KeyOf(m));
    if (it == held_.end()) {
      // Pushes that began together may have passed Begin's bounds together: they are kept here,
      // this replica's own bytes counted.
      if (Status room = MakeRoomLocked(OriginOf(m), KeyOf(m), replica->accounted(), &evicted); !room.ok()) {
        return Status(room.code(), Who(m) + ": " + room.message());
      }
      it = held_.emplace(KeyOf(m), nullptr).first;
    } else {
      const ReplicaMeta& old = it->second->meta();
      if (std::make_pair(old.attempt, old.step) >= std::make_pair(m.attempt, m.step) && old.run_id != m.run_id) {
        // Not the copy of this run: the sender must not count it as held (ALREADY_EXISTS would).
        return FailedPrecondition(Who(m) + " of '" + OriginOf(m) + "' (run " + m.run_id + ", attempt " +
                                  std::to_string(m.attempt) + "): its copy held here is of run " + old.run_id +
                                  " (step " + std::to_string(old.step) + ", attempt " + std::to_string(old.attempt) +
                                  ", not older)");
      }
      if (std::make_pair(old.attempt, old.step) >= std::make_pair(m.attempt, m.step)) {
        return AlreadyExists(Who(m) + " (attempt " + std::to_string(m.attempt) + "): step " +
                             std::to_string(old.step) + " of attempt " + std::to_string(old.attempt) +
                             " is held already");
      }
    }
    replaced = std::exchange(it->second, replica);
    // The replaced copy's memory is kept for the rank's next push, when nothing else reads it (a
    // fetch holds its own reference; this store hands out none once it is not held).
    if (replaced && replaced.use_count() == 1 && replaced->meta_.bytes == m.bytes && replaced->mapping_) {
      to_keep = std::move(const_cast<Replica&>(*replaced).mapping_);
    }
    PruneKeptLocked(&freed);
    // Held from the restored attempt on: the order of attempts refuses the old one's from now on.
    if (retracted != retracted_.end() && m.attempt >= retracted->second.first) retracted_.erase(retracted);
    if (!m.run_id.empty() && run_owner_.emplace(RunKey{m.job, m.rank, m.run_id}, OriginOf(m)).second) {
      run_owner_order_.emplace_back(m.job, m.rank, m.run_id);
      if (run_owner_order_.size() > kMaxRunOwners) {
        run_owner_.erase(run_owner_order_.front());
        run_owner_order_.pop_front();
      }
    }
  }
  if (to_keep) {
    to_keep->Release();
    MutexLock lock(&mu_);
    if (held_.count(KeyOf(m)) != 0) {  // not dropped meanwhile
      std::unique_ptr<ReplicaMapping>& slot = kept_[KeyOf(m)];
      if (slot) freed.push_back(std::move(slot));
      slot = std::move(to_keep);
    }
  }
  Logger("replica")->info("replica held job={} rank={} step={} bytes={} from={} replaced_step={}", m.job, m.rank,
                          m.step, m.bytes, m.from_peer.empty() ? m.origin_node : m.from_peer,
                          replaced ? replaced->meta().step : 0);
  return Status::OK();
}

Result<std::shared_ptr<const Replica>> ReplicaStore::Find(const std::string& job, uint32_t rank, int64_t step,
                                                          const std::string& origin) const {
  const std::string whose = origin.empty() ? std::string() : " of '" + origin + "'";
  MutexLock lock(&mu_);
  std::shared_ptr<const Replica> best;
  int64_t other_step = 0;
  for (auto it = held_.lower_bound(Key{job, rank, origin}); it != held_.end(); ++it) {
    if (std::get<0>(it->first) != job || std::get<1>(it->first) != rank) break;
    if (!origin.empty() && std::get<2>(it->first) != origin) break;
    const ReplicaMeta& m = it->second->meta();
    if (step != 0 && m.step != step) {
      other_step = m.step;
      continue;
    }
    if (!best || std::make_pair(m.attempt, m.step) > std::make_pair(best->meta().attempt, best->meta().step)) {
      best = it->second;
    }
  }
  if (best) return best;
  if (other_step != 0) {
    return NotFound("the replica of job '" + job + "' rank " + std::to_string(rank) + whose +
                    " held here is of step " + std::to_string(other_step) + ", not " + std::to_string(step));
  }
  return NotFound("no replica of job '" + job + "' rank " + std::to_string(rank) + whose + " is held here");
}

Status ReplicaStore::CheckRunOwnerLocked(const ReplicaMeta& m) const {
  if (m.run_id.empty()) return Status::OK();  // a sender of an older release: kept apart by origin alone
  auto owner = run_owner_.find(RunKey{m.job, m.rank, m.run_id});
  if (owner == run_owner_.end() || owner->second == OriginOf(m)) return Status::OK();
  return FailedPrecondition(Who(m) + " from '" + OriginOf(m) + "': run " + m.run_id +
                            " of the rank is replicated here by '" + owner->second +
                            "'; only that node pushes the run's replicas (a relaunch on another "
                            "node takes a new run id, as the launchers' restart counts give)");
}

void ReplicaStore::NoteFetched(const std::string& job, uint32_t rank, const std::string& node,
                               const std::string& origin) {
  if (node == origin) return;  // its own copies it may retract anyway
  MutexLock lock(&mu_);
  FetchKey key{job, rank, node, origin};
  if (!fetched_.insert(key).second) return;
  fetched_order_.push_back(std::move(key));
  if (fetched_order_.size() > kMaxReplicasHeld) {
    fetched_.erase(fetched_order_.front());
    fetched_order_.pop_front();
  }
}

void ReplicaStore::Drop(const Replica* replica) {
  std::shared_ptr<const Replica> dropped;  // destroyed (unmapped) after the lock is let go
  std::vector<std::unique_ptr<ReplicaMapping>> freed;  // as well
  MutexLock lock(&mu_);
  auto it = held_.find(KeyOf(replica->meta()));
  if (it != held_.end() && it->second.get() == replica) {
    dropped = std::move(it->second);
    held_.erase(it);
  }
  PruneKeptLocked(&freed);
}

Result<int64_t> ReplicaStore::Retract(const std::string& job, uint32_t rank, int64_t step, uint64_t attempt,
                                      const std::string& node) {
  RETURN_IF_ERROR(ValidateJobName(job));
  if (step < 0 || step > kMaxStep || attempt == 0) {
    return InvalidArgument("replica retraction: the step must be from 0 to " + std::to_string(kMaxStep) +
                           " and the attempt positive, got step " + std::to_string(step) + " attempt " +
                           std::to_string(attempt));
  }
  RETURN_IF_ERROR(CheckAttempt(attempt, "replica retraction"));
  std::vector<std::shared_ptr<const Replica>> dropped;  // destroyed (unmapped) after the lock is let go
  std::vector<std::unique_ptr<ReplicaMapping>> freed;   // as well
  MutexLock lock(&mu_);
  auto told = retracted_.find(Key{job, rank, node});
  if (told == retracted_.end()) {
    if (retracted_.size() >= kMaxReplicasHeld) retracted_.erase(retracted_.begin());
    retracted_[Key{job, rank, node}] = {attempt, step};
  } else if (attempt >= told->second.first) {
    told->second = {attempt, step};
  }
  int64_t gone = 0;
  for (auto it = held_.lower_bound(Key{job, rank, ""}); it != held_.end();) {
    if (std::get<0>(it->first) != job || std::get<1>(it->first) != rank) break;
    const ReplicaMeta& held = it->second->meta();
    const std::string& origin = std::get<2>(it->first);
    const bool may = origin == node || fetched_.count(FetchKey{job, rank, node, origin}) != 0;
    if (!may || held.attempt >= attempt || held.step <= step) {
      ++it;
      continue;
    }
    gone = std::max(gone, held.step);
    dropped.push_back(std::move(it->second));
    it = held_.erase(it);
  }
  PruneKeptLocked(&freed);
  return gone;
}

std::vector<ReplicaMeta> ReplicaStore::List(const std::string& job) const {
  std::vector<ReplicaMeta> out;
  MutexLock lock(&mu_);
  for (const auto& [key, replica] : held_) {
    if (job.empty() || std::get<0>(key) == job) out.push_back(replica->meta());
  }
  return out;
}

size_t ReplicaStore::count() const {
  MutexLock lock(&mu_);
  return held_.size();
}

std::unique_ptr<ReplicaMapping> ReplicaStore::TakeKeptLocked(const Key& key, uint64_t bytes,
                                                             std::vector<std::unique_ptr<ReplicaMapping>>* freed) {
  std::unique_ptr<ReplicaMapping> taken;
  auto it = kept_.find(key);
  if (it != kept_.end()) {
    if (it->second->bytes() == bytes) {
      taken = std::move(it->second);
    } else {
      freed->push_back(std::move(it->second));
    }
    kept_.erase(it);
  }
  PruneKeptLocked(freed);
  return taken;
}

void ReplicaStore::PruneKeptLocked(std::vector<std::unique_ptr<ReplicaMapping>>* freed) {
  for (auto it = kept_.begin(); it != kept_.end();) {
    if (held_.count(it->first) != 0) {
      ++it;
      continue;
    }
    freed->push_back(std::move(it->second));
    it = kept_.erase(it);
  }
}

uint64_t ReplicaStore::kept_bytes() const {
  uint64_t bytes = 0;
  MutexLock lock(&mu_);
  for (const auto& [key, mapping] : kept_) bytes += mapping->bytes();
  return bytes;
}

uint64_t ReplicaStore::held_bytes() const {
  uint64_t bytes = 0;
  MutexLock lock(&mu_);
  for (const auto& [key, replica] : held_) bytes += replica->meta().bytes;
  return bytes;
}

}  // namespace flashckpt

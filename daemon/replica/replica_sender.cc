#include "daemon/replica/replica_sender.h"

#include <algorithm>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/format/checksum.h"
#include "daemon/replica/replica_server.h"

namespace flashckpt {
namespace {

// A push's deadline: a minute, plus its bytes at the cap (or at 10 MB/s without one), within what a
// peer accepts (kMaxReplicaCall).
std::chrono::system_clock::time_point PushDeadline(uint64_t bytes, uint64_t max_rate) {
  const double rate = max_rate > 0 ? static_cast<double>(max_rate) : 10e6;
  const auto transfer = std::chrono::seconds(60 + static_cast<int64_t>(static_cast<double>(bytes) / rate));
  const auto most = std::chrono::duration_cast<std::chrono::seconds>(kMaxReplicaCall) - std::chrono::seconds(60);
  return std::chrono::system_clock::now() + std::min<std::chrono::seconds>(transfer, most);
}

// A retraction is one small call: a peer that does not answer in this time is tried again later.
constexpr std::chrono::seconds kRetractTimeout{10};

// Failures worth another try: the peer down, slow, short of room, or a part damaged on the way. Not:
// a refusal of what was sent (bad header, another peer's rank), or a push cancelled on purpose.
bool Retryable(StatusCode code) {
  switch (code) {
    case StatusCode::kUnavailable:
    case StatusCode::kDeadlineExceeded:
    case StatusCode::kResourceExhausted:
    case StatusCode::kCorruption:
    case StatusCode::kInternal:
    case StatusCode::kIOError:
      return true;
    default:
      return false;
  }
}

std::string Describe(const ReplicaMeta& meta) {
  return "job=" + meta.job + " rank=" + std::to_string(meta.rank) + " step=" + std::to_string(meta.step);
}

// A retraction as the log lines name it.
std::string RetractionText(const std::string& job, uint32_t rank, int64_t step) {
  return "job=" + job + " rank=" + std::to_string(rank) + " restored to step=" + std::to_string(step);
}

}  // namespace

uint64_t ReplicaLayoutFingerprint(const RankLayout& layout) {
  std::string text;
  auto add = [&](uint64_t v) { text.append(reinterpret_cast<const char*>(&v), sizeof v); };
  auto add_text = [&](const std::string& s) {
    add(s.size());
    text += s;
  };
  auto add_list = [&](const std::vector<uint64_t>& v) {
    add(v.size());
    for (uint64_t x : v) add(x);
  };
  const Topology& t = layout.topology;
  for (uint64_t v : {uint64_t{t.world_size}, uint64_t{t.tp_rank}, uint64_t{t.tp_degree}, uint64_t{t.pp_rank},
                     uint64_t{t.pp_degree}, uint64_t{t.shard_rank}, uint64_t{t.shard_degree}, layout.slot_bytes,
                     layout.checksum_chunk}) {
    add(v);
  }
  add(layout.files.size());
  for (const FileImage& f : layout.files) {
    add_text(f.stem);
    add(f.slot_offset);
    add_text(f.header);
  }
  add(layout.tensors.size());
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const TensorSpec& s = layout.tensors[i];
    add_text(s.name);
    add_text(s.param);
    add(static_cast<uint64_t>(s.kind));
    add(static_cast<uint64_t>(s.dtype));
    add_list(s.shape);
    add_list(s.global_shape);
    add_list(s.box_offset);
    add_list(s.box_shape);
    add(s.flat_range ? 1 : 0);
    add(s.flat_range ? s.flat_range->begin : 0);
    add(s.flat_range ? s.flat_range->end : 0);
    add(s.replica ? 1 : 0);
    add(layout.placements[i].slot_offset);
    add(layout.placements[i].bytes);
  }
  return Xxh3(text.data(), text.size());
}

ReplicaSender::ReplicaSender(Options options)
    : options_(std::move(options)), clock_(options_.clock != nullptr ? *options_.clock : Clock::Real()) {}

Status ReplicaSender::Start() {
  if (options_.peers.empty()) return InvalidArgument("replication needs a peer (--replicate-to)");
  if (options_.part_bytes < kMinReplicaPartBytes || options_.part_bytes > kMaxReplicaPartBytes) {
    return InvalidArgument("replica parts of " + std::to_string(options_.part_bytes) + " bytes");
  }
  if (!peers_.empty()) return Status::OK();
  std::vector<std::unique_ptr<Peer>> peers;
  for (const ReplicaPeer& address : options_.peers) {
    auto peer = std::make_unique<Peer>();
    peer->address = address;
    ASSIGN_OR_RETURN(peer->channel, ReplicaChannel(address));
    peer->status.target = address.target;
    peers.push_back(std::move(peer));
  }
  MutexLock lock(&mu_);
  for (auto& peer : peers) {
    channels_.push_back({peer->address.target, peer->channel});
    peers_.push_back(std::move(peer));
  }
  for (auto& peer : peers_) {
    Peer* p = peer.get();
    p->thread = std::thread([this, p] { Run(p); });
  }
  return Status::OK();
}

ReplicaSender::~ReplicaSender() {
  Stop();
  // What was offered after the stop is let go of here, off every lock of the daemon.
  std::vector<std::shared_ptr<const OutgoingReplica>> late;
  {
    MutexLock lock(&mu_);
    late.swap(after_stop_);
  }
}

void ReplicaSender::Offer(std::shared_ptr<const OutgoingReplica> replica) {
  MutexLock lock(&mu_);
  if (stopping_) {
    after_stop_.push_back(std::move(replica));
    return;
  }
  const Key key{replica->meta.job, replica->meta.rank};
  const Version version{replica->meta.attempt, replica->meta.step};
  auto offered = offered_.find(key);
  if (offered != offered_.end() && version <= offered->second) {
    // Older than one offered already (a disk snapshot kept once written after later memory ones):
    // let go of by a peer's thread.
    peers_.front()->released.push_back(std::move(replica));
    cv_.NotifyAll();
    return;
  }
  offered_[key] = version;
  for (auto& peer : peers_) {
    auto& queued = peer->queue[key];
    if (queued.replica) peer->released.push_back(std::move(queued.replica));  // the newest wins
    queued = Peer::Queued{replica, peer->next_turn++, {}};
    peer->status.queued = static_cast<uint32_t>(peer->queue.size());
  }
  cv_.NotifyAll();
}

void ReplicaSender::Retract(const std::string& job, uint32_t rank, int64_t step, uint64_t attempt) {
  MutexLock lock(&mu_);
  if (stopping_) return;
  for (auto& peer : peers_) peer->retracts[{job, rank}] = Peer::Retraction{step, attempt, {}};
  cv_.NotifyAll();
}

void ReplicaSender::Forget(const std::string& job) {
  std::vector<std::shared_ptr<const OutgoingReplica>> going;  // released here, after the lock
  MutexLock lock(&mu_);
  auto of_job = [&](const auto& entry) { return entry.first.first == job; };
  std::erase_if(offered_, of_job);
  for (auto& peer : peers_) {
    for (auto it = peer->queue.begin(); it != peer->queue.end();) {
      if (it->first.first != job) {
        ++it;
        continue;
      }
      going.push_back(std::move(it->second.replica));
      it = peer->queue.erase(it);
    }
    std::erase_if(peer->acked, of_job);
    std::erase_if(peer->retracts, of_job);
    peer->status.queued = static_cast<uint32_t>(peer->queue.size());
    // A push of the job under way holds its segment until it ends: it ends now.
    if (peer->in_flight != nullptr && peer->in_flight_job == job) peer->in_flight->TryCancel();
  }
  cv_.NotifyAll();
  lock.Unlock();
  going.clear();  // Forget is called without the daemon's lock: the segments may go here
}

void ReplicaSender::Stop(Clock::TimePoint /*deadline*/) {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& peer : peers_) {
      if (peer->in_flight != nullptr) peer->in_flight->TryCancel();
    }
    cv_.NotifyAll();
  }
  for (auto& peer : peers_) {
    if (peer->thread.joinable()) peer->thread.join();
  }
}

std::vector<ReplicaPeerStatus> ReplicaSender::PeerStatus() const {
  MutexLock lock(&mu_);
  std::vector<ReplicaPeerStatus> out;
  for (const auto& peer : peers_) {
    ReplicaPeerStatus status = peer->status;
    status.lag_steps = 0;
    for (const auto& [key, offered] : offered_) {
      // Behind by the steps since the last one acknowledged; by all of them while the peer has
      // acknowledged none of this attempt (a rank that resumed from an older step starts one).
      auto acked = peer->acked.find(key);
      const bool same = acked != peer->acked.end() && acked->second.first == offered.first;
      status.lag_steps = std::max(status.lag_steps, offered.second - (same ? acked->second.second : 0));
    }
    out.push_back(std::move(status));
  }
  return out;
}

void ReplicaSender::Run(Peer* peer) {
  std::vector<std::shared_ptr<const OutgoingReplica>> released;
  MutexLock lock(&mu_);
  for (;;) {
    for (auto& r : peer->released) released.push_back(std::move(r));
    peer->released.clear();
    if (!released.empty()) {
      lock.Unlock();
      released.clear();  // the last reference to a slot segment unmaps it: off the lock
      lock.Lock();
      continue;
    }
    if (stopping_) break;
    if (peer->queue.empty() && peer->retracts.empty()) {
      cv_.Wait(&lock);
      continue;
    }
    const auto now = clock_.Now();
    auto first_due = std::chrono::steady_clock::time_point::max();
    // A retraction first: the peer must let go of an abandoned timeline's replica before anything else.
    auto retract = std::find_if(peer->retracts.begin(), peer->retracts.end(),
                                [&](const auto& entry) { return entry.second.due <= now; });
    if (retract != peer->retracts.end()) {
      const Key key = retract->first;
      const Peer::Retraction told = retract->second;
      lock.Unlock();
      const std::string what = RetractionText(key.first, key.second, told.step);
      auto dropped = SendRetraction(peer, key, told, what);
      lock.Lock();
      RecordRetractionLocked(peer, key, told, what, dropped);
      continue;
    }
    for (const auto& [key, r] : peer->retracts) first_due = std::min(first_due, r.due);
    if (peer->queue.empty()) {
      clock_.WaitUntil(&cv_, &lock, first_due);
      continue;
    }
    // The oldest offer among those due; else wait for the first to become due (or an offer).
    auto next = NextDueLocked(peer, now, &first_due);
    if (next == peer->queue.end()) {
      clock_.WaitUntil(&cv_, &lock, first_due);
      continue;
    }
    const Key key = next->first;
    std::shared_ptr<const OutgoingReplica> replica = std::move(next->second.replica);
    peer->queue.erase(next);
    peer->status.queued = static_cast<uint32_t>(peer->queue.size());
    lock.Unlock();

    // A checkpoint its slot no longer holds (a newer one is kept, or the rank's memory checkpoints
    // were dropped) is of no use to the peer: let go of, not sent.
    if (!replica->still_held()) {
      lock.Lock();
      released.push_back(std::move(replica));
      continue;
    }
    const PushOutcome outcome = SendReplica(peer, *replica);
    lock.Lock();
    DaemonEvent event = RecordPushLocked(peer, key, replica, outcome);
    if (replica) released.push_back(std::move(replica));
    if (event.kind != DaemonEvent::Kind::kUnknown && options_.on_event) {
      lock.Unlock();
      options_.on_event(std::move(event));
      lock.Lock();
    }
  }
  // Stopping: the queue is let go of off the lock (retractions not sent are dropped).
  DropQueueLocked(peer, &released);
  lock.Unlock();
  released.clear();
}

std::map<ReplicaSender::Key, ReplicaSender::Peer::Queued>::iterator ReplicaSender::NextDueLocked(
    Peer* peer, Clock::TimePoint now, Clock::TimePoint* first_due) {
  auto next = peer->queue.end();
  for (auto it = peer->queue.begin(); it != peer->queue.end(); ++it) {
    *first_due = std::min(*first_due, it->second.due);
    if (it->second.due <= now && (next == peer->queue.end() || it->second.turn < next->second.turn)) next = it;
  }
  return next;
}

Result<int64_t> ReplicaSender::SendRetraction(Peer* peer, const Key& key, const Peer::Retraction& told,
                                              const std::string& what) {
  auto dropped = RetractReplica(peer->channel.get(), options_.node_name, key.first, key.second, told.step,
                                told.attempt,
                                std::chrono::system_clock::now() + kRetractTimeout,
                                [&](grpc::ClientContext* ctx) {
                                  MutexLock in(&mu_);
                                  peer->in_flight = ctx;
                                  peer->in_flight_job = ctx != nullptr ? key.first : std::string();
                                  if (ctx != nullptr && stopping_) ctx->TryCancel();
                                });
  if (dropped.ok() && *dropped > 0) {
    Logger("replica")->info("replica retracted at={} {}: the peer dropped step={}", peer->address.target, what,
                            *dropped);
  }
  return dropped;
}

void ReplicaSender::RecordRetractionLocked(Peer* peer, const Key& key, const Peer::Retraction& told,
                                           const std::string& what, const Result<int64_t>& dropped) {
  auto now_there = peer->retracts.find(key);
  const bool same = now_there != peer->retracts.end() && now_there->second.attempt == told.attempt &&
                    now_there->second.step == told.step;
  const bool retry = !dropped.ok() && Retryable(dropped.status().code());
  // Its own error and wait: a push's failures are told apart from it (REPLICA_FAILED, status).
  if (!dropped.ok() && dropped.status().code() != peer->last_retract_code && !stopping_) {
    Logger("replica")->warn("replica retraction not sent to={} {} error=\"{}{}\"{}", peer->address.target, what,
                            dropped.status().ToString(), ConnectionHint(peer->address, dropped.status()),
                            retry ? " (tried again later)" : "");
  }
  peer->last_retract_code = dropped.status().code();
  if (dropped.ok()) peer->retract_wait = std::chrono::milliseconds(0);
  if (same && retry && !stopping_) {
    peer->retract_wait = std::clamp(peer->retract_wait * 2, std::chrono::milliseconds(1000),
                                    std::chrono::milliseconds(30000));
    now_there->second.due = clock_.Now() + peer->retract_wait;
  } else if (same) {
    peer->retracts.erase(now_there);
  }
}

ReplicaSender::PushOutcome ReplicaSender::SendReplica(Peer* peer, const OutgoingReplica& replica) {
  const auto started = clock_.Now();
  Status pushed = Push(peer, replica);
  const double seconds = std::chrono::duration<double>(clock_.Now() - started).count();
  // The peer holds one as new or newer already (its acknowledgement of this one was lost, say).
  const bool held = pushed.ok() || pushed.code() == StatusCode::kAlreadyExists;
  // Off the sender's lock: still_held takes the daemon's, which is taken before this one.
  const bool retry = !held && Retryable(pushed.code()) && replica.still_held();
  if (held) {
    Logger("replica")->debug("replica sent to={} {} bytes={} seconds={:.3f}{}", peer->address.target,
                             Describe(replica.meta), replica.meta.bytes, seconds,
                             pushed.ok() ? "" : " (the peer held it already)");
  }
  return {std::move(pushed), seconds, held, retry};
}

DaemonEvent ReplicaSender::RecordPushLocked(Peer* peer, const Key& key, std::shared_ptr<const OutgoingReplica>& replica,
                                            const PushOutcome& outcome) {
  const Status& pushed = outcome.pushed;
  const double seconds = outcome.seconds;
  const bool held = outcome.held;
  const bool retry = outcome.retry;
  // Its job released meanwhile (Forget): nothing of it is recorded or queued again.
  const bool forgotten = offered_.count(key) == 0;
  DaemonEvent event;
  event.job = replica->meta.job;
  event.rank = replica->meta.rank;
  event.step = replica->meta.step;
  event.peer = peer->address.target;
  if (held) {
    event.kind = DaemonEvent::Kind::kReplicaSent;
    event.bytes = replica->meta.bytes;
    event.seconds = seconds;
    if (!forgotten) peer->acked[key] = {replica->meta.attempt, replica->meta.step};  // in offer order: the newest
    peer->status.pushed += 1;
    peer->status.bytes += replica->meta.bytes;
    peer->status.last_gbps = seconds > 0 ? static_cast<double>(replica->meta.bytes) / seconds / 1e9 : 0;
    peer->status.last_error.clear();
    peer->last_error_code = StatusCode::kOk;
    peer->retry_wait = std::chrono::milliseconds(0);
  } else {
    peer->status.failed += 1;
    const std::string error = pushed.ToString() + ConnectionHint(peer->address, pushed);
    // One line and event per change of the error's code, not per step or retry (the messages
    // name the step).
    if (pushed.code() != peer->last_error_code && !stopping_) {
      Logger("replica")->warn("replica not sent to={} {} error=\"{}\"{}", peer->address.target,
                              Describe(replica->meta), error, retry ? " (tried again later)" : "");
      event.kind = DaemonEvent::Kind::kReplicaFailed;
      event.reason = error;
    }
    peer->status.last_error = error;
    peer->last_error_code = pushed.code();
    // Tried again later unless the daemon stops, its job was released or a newer one of the rank waits.
    if (retry && !stopping_ && !forgotten && peer->queue.count(key) == 0) {
      peer->retry_wait = std::clamp(peer->retry_wait * 2, std::chrono::milliseconds(1000),
                                    std::chrono::milliseconds(30000));
      peer->queue[key] = Peer::Queued{std::move(replica), peer->next_turn++,
                                      clock_.Now() + peer->retry_wait};
      peer->status.queued = static_cast<uint32_t>(peer->queue.size());
    }
  }
  return event;
}

void ReplicaSender::DropQueueLocked(Peer* peer, std::vector<std::shared_ptr<const OutgoingReplica>>* released) {
  for (auto& [key, queued] : peer->queue) released->push_back(std::move(queued.replica));
  peer->queue.clear();
  peer->retracts.clear();
  peer->status.queued = 0;
}

Status ReplicaSender::Push(Peer* peer, const OutgoingReplica& replica) {
  ReplicaMeta meta = replica.meta;
  meta.part_bytes = options_.part_bytes;
  if (options_.max_rate > 0) {
    // At the cap the push must end within the longest call a peer accepts (PushDeadline's bound,
    // less its minute for the rest): one that cannot is refused here, not tried again forever.
    const double seconds = static_cast<double>(meta.bytes) / static_cast<double>(options_.max_rate);
    const auto most = std::chrono::duration_cast<std::chrono::seconds>(kMaxReplicaCall) - std::chrono::seconds(120);
    if (seconds > static_cast<double>(most.count())) {
      return FailedPrecondition(Describe(meta) + " (" + FormatBytes(meta.bytes) + ") would take " +
                                std::to_string(static_cast<int64_t>(seconds)) + " s at --replicate-max-rate " +
                                FormatBytes(options_.max_rate) + "/s, longer than a replica call may last (" +
                                std::to_string(most.count()) + " s): raise the rate");
    }
  }
  const auto started = clock_.Now();
  auto held = [&]() -> Status {
    if (replica.still_held()) return Status::OK();
    return Cancelled("the rank reused the slot of " + Describe(meta) + " before it was sent");
  };
  PushHooks hooks;
  hooks.after_part = [&](uint64_t sent) -> Status {
    RETURN_IF_ERROR(held());
    MutexLock lock(&mu_);
    if (options_.max_rate > 0) {  // the cap: no faster than max_rate since the push began
      const auto due = started + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                     std::chrono::duration<double>(static_cast<double>(sent) /
                                                                   static_cast<double>(options_.max_rate)));
      while (!stopping_ && clock_.Now() < due) clock_.WaitUntil(&cv_, &lock, due);
    }
    if (stopping_) return Cancelled("the daemon is stopping");
    return Status::OK();
  };
  hooks.before_done = held;
  hooks.context = [&](grpc::ClientContext* ctx) {
    MutexLock lock(&mu_);
    peer->in_flight = ctx;
    peer->in_flight_job = ctx != nullptr ? meta.job : std::string();
    if (ctx != nullptr && stopping_) ctx->TryCancel();
  };
  hooks.owner = replica.mapping;
  return PushReplica(peer->channel.get(), meta, replica.data, PushDeadline(meta.bytes, options_.max_rate), hooks);
}

}  // namespace flashckpt

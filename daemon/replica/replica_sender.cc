#include "daemon/replica/replica_sender.h"

#include <algorithm>

#include "common/base/log.h"
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

std::string Describe(const ReplicaMeta& meta) {
  return "job=" + meta.job + " rank=" + std::to_string(meta.rank) + " step=" + std::to_string(meta.step);
}

}  // namespace

Result<std::unique_ptr<ReplicaSender>> ReplicaSender::Start(Options options) {
  if (options.peers.empty()) return InvalidArgument("replication needs a peer (--replicate-to)");
  if (options.part_bytes < kMinReplicaPartBytes || options.part_bytes > kMaxReplicaPartBytes) {
    return InvalidArgument("replica parts of " + std::to_string(options.part_bytes) + " bytes");
  }
  std::unique_ptr<ReplicaSender> sender(new ReplicaSender(std::move(options)));
  for (const ReplicaPeer& address : sender->options_.peers) {
    auto peer = std::make_unique<Peer>();
    peer->address = address;
    ASSIGN_OR_RETURN(peer->channel, ReplicaChannel(address));
    peer->status.target = address.target;
    sender->channels_.push_back({address.target, peer->channel});
    sender->peers_.push_back(std::move(peer));
  }
  for (auto& peer : sender->peers_) {
    Peer* p = peer.get();
    p->thread = std::thread([s = sender.get(), p] { s->Run(p); });
  }
  return sender;
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
  offered_[key] = {replica->meta.attempt, replica->meta.step};  // the newest, also of a new attempt
  for (auto& peer : peers_) {
    auto& queued = peer->queue[key];
    if (queued.replica) peer->released.push_back(std::move(queued.replica));  // the newest wins
    queued = Peer::Queued{replica, peer->next_turn++, {}};
    peer->status.queued = static_cast<uint32_t>(peer->queue.size());
  }
  cv_.NotifyAll();
}

void ReplicaSender::Forget(const std::string& job) {
  MutexLock lock(&mu_);
  auto of_job = [&](const auto& entry) { return entry.first.first == job; };
  std::erase_if(offered_, of_job);
  for (auto& peer : peers_) {
    for (auto it = peer->queue.begin(); it != peer->queue.end();) {
      if (it->first.first != job) {
        ++it;
        continue;
      }
      peer->released.push_back(std::move(it->second.replica));
      it = peer->queue.erase(it);
    }
    std::erase_if(peer->acked, of_job);
    peer->status.queued = static_cast<uint32_t>(peer->queue.size());
  }
  cv_.NotifyAll();
}

void ReplicaSender::Stop() {
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
    released.swap(peer->released);
    if (!released.empty()) {
      lock.Unlock();
      released.clear();  // the last reference to a slot segment unmaps it: off the lock
      lock.Lock();
      continue;
    }
    if (stopping_) break;
    if (peer->queue.empty()) {
      cv_.Wait(&lock);
      continue;
    }
    // The oldest offer among those due; else wait for the first to become due (or an offer).
    const auto now = std::chrono::steady_clock::now();
    auto next = peer->queue.end();
    auto first_due = std::chrono::steady_clock::time_point::max();
    for (auto it = peer->queue.begin(); it != peer->queue.end(); ++it) {
      first_due = std::min(first_due, it->second.due);
      if (it->second.due <= now && (next == peer->queue.end() || it->second.turn < next->second.turn)) next = it;
    }
    if (next == peer->queue.end()) {
      cv_.WaitUntil(&lock, first_due);
      continue;
    }
    const Key key = next->first;
    std::shared_ptr<const OutgoingReplica> replica = std::move(next->second.replica);
    peer->queue.erase(next);
    peer->status.queued = static_cast<uint32_t>(peer->queue.size());
    lock.Unlock();

    const auto started = std::chrono::steady_clock::now();
    Status pushed = Push(peer, *replica);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (pushed.ok()) {
      Logger("replica")->debug("replica sent to={} {} bytes={} seconds={:.3f}", peer->address.target,
                               Describe(replica->meta), replica->meta.bytes, seconds);
    }
    lock.Lock();
    if (pushed.ok()) {
      peer->acked[key] = {replica->meta.attempt, replica->meta.step};  // pushed in offer order: the newest
      peer->status.pushed += 1;
      peer->status.bytes += replica->meta.bytes;
      peer->status.last_gbps = seconds > 0 ? static_cast<double>(replica->meta.bytes) / seconds / 1e9 : 0;
      peer->status.last_error.clear();
      peer->retry_wait = std::chrono::milliseconds(0);
    } else {
      peer->status.failed += 1;
      const std::string error = pushed.ToString();
      if (error != peer->status.last_error && !stopping_) {  // one line per change, not per step of a down peer
        Logger("replica")->warn("replica not sent to={} {} error=\"{}\"", peer->address.target,
                                Describe(replica->meta), error);
      }
      peer->status.last_error = error;
      // Tried again later unless it is gone from its slot, the daemon stops, or a newer one waits.
      if (pushed.code() != StatusCode::kCancelled && !stopping_ && peer->queue.count(key) == 0) {
        peer->retry_wait = std::clamp(peer->retry_wait * 2, std::chrono::milliseconds(1000),
                                      std::chrono::milliseconds(30000));
        peer->queue[key] = Peer::Queued{std::move(replica), peer->next_turn++,
                                        std::chrono::steady_clock::now() + peer->retry_wait};
        peer->status.queued = static_cast<uint32_t>(peer->queue.size());
      }
    }
    if (replica) released.push_back(std::move(replica));
  }
  // Stopping: the queue is let go of off the lock.
  for (auto& [key, queued] : peer->queue) released.push_back(std::move(queued.replica));
  peer->queue.clear();
  peer->status.queued = 0;
  lock.Unlock();
  released.clear();
}

Status ReplicaSender::Push(Peer* peer, const OutgoingReplica& replica) {
  ReplicaMeta meta = replica.meta;
  meta.part_bytes = options_.part_bytes;
  const auto started = std::chrono::steady_clock::now();
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
      while (!stopping_ && std::chrono::steady_clock::now() < due) cv_.WaitUntil(&lock, due);
    }
    if (stopping_) return Cancelled("the daemon is stopping");
    return Status::OK();
  };
  hooks.before_done = held;
  hooks.context = [&](grpc::ClientContext* ctx) {
    MutexLock lock(&mu_);
    peer->in_flight = ctx;
    if (ctx != nullptr && stopping_) ctx->TryCancel();
  };
  return PushReplica(peer->channel.get(), meta, replica.data, PushDeadline(meta.bytes, options_.max_rate), hooks);
}

}  // namespace flashckpt

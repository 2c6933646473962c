// The state the core's units share (core.h): the rank lookups and the slot accessors.
#include "daemon/core/core.h"

#include "common/base/log.h"
#include "daemon/core/texts.h"
#include "daemon/parity/parity_sender.h"
#include "daemon/replica/replica_sender.h"

namespace flashckpt {

Core::Core(DaemonConfig config)
    : config_(std::move(config)),
      clock_(config_.clock != nullptr ? *config_.clock : Clock::Real()),
      started_(clock_.Now()),
      root_io_(config_.io_env != nullptr ? config_.io_env : IoEnv::Default()),
      catalog_(config_.root, config_.keep, RootIo()),
      launches_(config_.root, config_.launch_join_window),
      leases_(config_.root, config_.node_name, config_.lease_ttl) {
  catalog_.SetLeases(&leases_);
  catalog_.SetListener([this](CatalogChange change, const std::string& job, int64_t step, std::string_view reason) {
    DaemonEvent event;
    event.kind = change == CatalogChange::kCompleted ? DaemonEvent::Kind::kCheckpointComplete
                                                     : DaemonEvent::Kind::kCheckpointDeleted;
    event.job = job;
    event.step = step;
    event.reason = std::string(reason);
    Emit(std::move(event));
  });
}


void Core::Emit(DaemonEvent event) {
  event.unix_seconds = UnixSeconds();
  metrics_.Observe(event);
  events_.Publish(std::move(event));
}

void Core::NoteAbandonedLocked(const std::string& job, uint32_t rank, int64_t step) {
  auto jit = jobs_.find(job);
  if (jit == jobs_.end()) return;
  auto rit = jit->second.ranks.find(rank);
  if (rit == jit->second.ranks.end()) return;
  rit->second.abandoned.insert(step);
  cv_.NotifyAll();
}

std::set<int64_t> Core::BusyStepsLocked(const std::string& job) const {
  std::set<int64_t> busy;
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return busy;
  for (const auto& [r, rank] : it->second.ranks) {
    if (!rank.segment) continue;
    for (uint32_t i = 0; i < Slots(*rank.segment).size(); ++i) {
      const SlotInfo& slot = Slots(*rank.segment).at(i);
      if (slot.state == SlotState::kFilling || slot.state == SlotState::kCommitted ||
          slot.state == SlotState::kPersisting) {
        busy.insert(slot.step);
      }
    }
  }
  return busy;
}

bool Core::HoldsEveryRankLocked(const std::string& job, uint32_t world_size) const {
  auto it = jobs_.find(job);
  if (it == jobs_.end() || world_size == 0) return false;
  // The ranks are kept in order: those below world_size are the first ones.
  uint32_t held = 0;
  for (const auto& [rank, state] : it->second.ranks) {
    if (rank >= world_size) break;
    ++held;
  }
  return held == world_size;
}

Result<RankState*> Core::RankOf(const std::string& session_id, bool need_segment) {
  if (stopping_) return Unavailable(kStoppingMessage);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    // UNAVAILABLE, not an argument error: after a daemon restart every session id is unknown, and
    // the client library re-attaches (a new session, the same registration) on this code.
    return Unavailable("session_id names no open session (it ended, or the daemon restarted); open a new Session");
  }
  RankState& rank = jobs_[it->second.job].ranks[it->second.rank];
  if (need_segment && !rank.segment) {
    return FailedPrecondition("rank " + std::to_string(it->second.rank) + " of job '" + it->second.job +
                              "' has not registered its tensors");
  }
  return &rank;
}

Result<const RankState*> Core::WaitedRank(const std::string& session_id, bool* final) const {
  *final = false;
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    if (stopping_) return Unavailable(kStoppingMessage);
    return Unavailable("session_id names no open session (it ended, or the daemon restarted); open a new Session");
  }
  if (stopping_) {
    if (auto kept = stopped_ranks_.find(session_id); kept != stopped_ranks_.end()) {
      *final = true;
      return &kept->second;
    }
  }
  const RankState* rank = nullptr;
  if (auto jit = jobs_.find(it->second.job); jit != jobs_.end()) {
    if (auto rit = jit->second.ranks.find(it->second.rank); rit != jit->second.ranks.end()) rank = &rit->second;
  }
  if (rank == nullptr || !rank->segment) {
    if (stopping_) return Unavailable(kStoppingMessage);
    return FailedPrecondition("rank " + std::to_string(it->second.rank) + " of job '" + it->second.job +
                              "' has not registered its tensors");
  }
  return rank;
}

uint64_t Core::DisconnectedBytesLocked() const {
  uint64_t bytes = 0;
  for (const auto& [name, job] : jobs_) {
    const bool connected = std::any_of(job.ranks.begin(), job.ranks.end(),
                                       [](const auto& entry) { return !entry.second.session_id.empty(); });
    if (connected) continue;
    for (const auto& [r, rank] : job.ranks) bytes += rank.segment ? rank.segment->accounted() : 0;
  }
  return bytes;
}

}  // namespace flashckpt

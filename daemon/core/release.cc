// Giving memory back: a job whose ranks have all gone keeps its slot segments (and EMA segments)
// only until nothing of it is left to write and it has been idle for --idle-release, or until an
// operator runs `flashckpt release --job J`. Then the daemon forgets the job: its segments and
// their records are removed, the EMA segments too (the checkpoints hold the EMA), and status no
// longer lists it. A trainer of the job that comes back later registers afresh.
//
// Nothing newer than the disk is dropped in silence: a memory checkpoint held by every rank of the
// job here, newer than the newest complete checkpoint, is written first (as --persist-on-stop does
// at a stop); if it cannot be, the job is kept. `flashckpt release --force` drops it, and says which
// steps went. The event, the log line and the metrics name the step written or dropped.
//
// The unlinking happens outside mu_. Meanwhile the job's name is in releasing_, and OpenSession
// of that job waits for it, so no new registration can map a segment name about to disappear.
#include <limits>
#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>

#include "common/base/log.h"
#include "common/base/names.h"
#include "daemon/core/daemon.h"
#include "daemon/replica/replica_sender.h"

namespace flashckpt {
namespace {

const char* SlotStateText(SlotState state) {
  switch (state) {
    case SlotState::kFilling: return "being filled";
    case SlotState::kCommitted: return "committed, not yet written";
    case SlotState::kPersisting: return "being written";
    case SlotState::kRestoring: return "being restored";
    default: return "in use";
  }
}

}  // namespace

std::string Daemon::ReleaseBlocker(const JobState& job) const {
  for (const auto& [r, rank] : job.ranks) {
    if (!rank.session_id.empty()) return "rank " + std::to_string(r) + " is connected (a trainer holds a session)";
    if (!rank.segment) continue;
    const SlotTable& slots = Slots(*rank.segment);
    for (uint32_t i = 0; i < slots.size(); ++i) {
      const SlotInfo& slot = slots.at(i);
      if (slot.state == SlotState::kFree) continue;
      return "rank " + std::to_string(r) + " has step " + std::to_string(slot.step) + " in slot " + std::to_string(i) +
             ", " + SlotStateText(slot.state);
    }
    if (EmaPending(*rank.segment) > 0) return "rank " + std::to_string(r) + " has snapshots queued for the EMA stage (EMA updates or memory checkpoint checksums)";
  }
  return "";
}

std::vector<std::shared_ptr<RankSegment>> Daemon::DetachJobLocked(const std::string& name,
                                                                  ReleaseOutcome* outcome) {
  std::vector<std::shared_ptr<RankSegment>> segments;
  auto it = jobs_.find(name);
  if (it == jobs_.end()) return segments;
  for (auto& [r, rank] : it->second.ranks) {
    outcome->ranks += 1;
    if (!rank.segment) continue;
    outcome->bytes += rank.segment->accounted();
    // Its memory checkpoints go with the segment: a trainer that comes back later restores from disk.
    if (const auto held = Slots(*rank.segment).ResidentSteps(); !held.empty()) {
      Logger("rpc")->warn("releasing job={} rank={} drops its memory checkpoints count={} newest_step={}", name, r,
                          held.size(), held.front());
    }
    DropMemoryFrom(*rank.segment, std::numeric_limits<int64_t>::min());  // and its mirror says so
    segments.push_back(std::move(rank.segment));
  }
  jobs_.erase(it);
  releasing_.insert(name);
  return segments;
}

std::vector<int64_t> Daemon::CommonMemoryStepsLocked(const JobState& job) const {
  bool first = true;
  std::vector<int64_t> steps;
  for (const auto& [r, rank] : job.ranks) {
    if (!rank.segment) continue;
    std::vector<int64_t> held = Slots(*rank.segment).ResidentSteps();  // newest first
    steps = first ? std::move(held) : StepsAlsoIn(steps, held);
    first = false;
  }
  return steps;
}

bool Daemon::MemoryStepWrittenLocked(const JobState& job, int64_t step) const {
  for (const auto& [r, rank] : job.ranks) {
    if (!rank.segment) continue;
    const std::vector<int64_t> held = Slots(*rank.segment).ResidentSteps();
    if (std::find(held.begin(), held.end(), step) == held.end()) continue;
    if (rank.last_persisted < step) return false;
  }
  return true;
}

Status Daemon::ReleasableLocked(const std::string& name) const {
  if (stopping_) return Unavailable("the daemon is stopping; its segments are left for the next daemon");
  auto it = jobs_.find(name);
  if (it == jobs_.end()) {
    return NotFound("flashckptd holds no job '" + name + "'" +
                    (releasing_.count(name) != 0 ? " (it is being released)" : " (see flashckpt status)"));
  }
  const std::string blocker = ReleaseBlocker(it->second);
  if (!blocker.empty()) {
    Logger("rpc")->warn("release refused job={}: {}", name, blocker);
    return FailedPrecondition("job '" + name + "' is not released: " + blocker +
                              "; a job is released once all its ranks have gone and its snapshots are written");
  }
  return Status::OK();
}

Status Daemon::WriteMemoryBeforeRelease(const std::string& name, int64_t step, int64_t disk,
                                        std::chrono::steady_clock::time_point deadline) {
  const std::string what = "memory checkpoint step " + std::to_string(step) + " of job '" + name +
                           "' (newer than the disk's " + (disk < 0 ? std::string("none") : "step " + std::to_string(disk)) +
                           ")";
  auto kept = [&](const Status& why) {
    return FailedPrecondition("job '" + name + "' is kept: its " + what + " could not be written (" + why.ToString() +
                              "); release it with --force to drop it");
  };
  Result<uint32_t> queued = PersistMemoryStep(name, step, disk, "before release");
  if (!queued.ok()) return kept(queued.status());
  MutexLock lock(&mu_);
  for (;;) {
    auto it = jobs_.find(name);
    if (it == jobs_.end()) return NotFound("job '" + name + "' went while its " + what + " was written");
    bool writing = false;
    for (const auto& [r, rank] : it->second.ranks) {
      if (auto failed = rank.failed.find(step); failed != rank.failed.end()) return kept(failed->second);
      if (rank.segment && Slots(*rank.segment).CountIn(SlotState::kPersisting) > 0) writing = true;
    }
    if (!writing) {
      if (!MemoryStepWrittenLocked(it->second, step)) return kept(Internal("a rank's copy was not written"));
      return Status::OK();
    }
    if (!clock_.WaitUntil(&cv_, &lock, deadline)) {
      return DeadlineExceeded("job '" + name + "' is kept: its " + what + " is still being written; release again "
                              "once it is");
    }
  }
}

void Daemon::DropReleased(const std::string& name, std::vector<std::shared_ptr<RankSegment>> segments,
                          const ReleaseOutcome& outcome, const std::string& reason) {
  if (sender_) sender_->Forget(name);  // its queued replicas hold the segments too
  std::vector<std::weak_ptr<RankSegment>> going;
  for (std::shared_ptr<RankSegment>& segment : segments) {
    // The EMA segment outlives daemons by design (a restarted daemon adopts it); a released
    // job's EMA is in its checkpoints, so its name goes now.
    if (segment->ema) segment->ema->Unlink();
    going.push_back(segment);
    segment.reset();  // the last reference unmaps it, unlinks its name and removes its records
  }
  // A writer thread may still hold a segment for a moment after its last persist reported (the
  // request that kept it alive is destroyed after its callback): the release is done, and said to
  // be, once the memory is really given back.
  const auto deadline = clock_.Now() + std::chrono::seconds(10);
  for (const auto& segment : going) {
    while (!segment.expired() && clock_.Now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (!segment.expired()) {
      Logger("rpc")->warn("released job={}: a segment is still in use after 10 s; it goes when its user lets go", name);
    }
  }
  std::string memory = "memory_newer_than_disk=none";
  if (outcome.written_step >= 0) memory = "written_step=" + std::to_string(outcome.written_step);
  if (!outcome.dropped_steps.empty()) {
    memory = "dropped_steps=";
    for (size_t i = 0; i < outcome.dropped_steps.size(); ++i) {
      memory += (i ? "," : "") + std::to_string(outcome.dropped_steps[i]);
    }
  }
  auto level = outcome.dropped_steps.empty() ? spdlog::level::info : spdlog::level::warn;
  Logger("rpc")->log(level, "released job={} ranks={} bytes={} reason={} {} disk_step={}", name, outcome.ranks,
                     FormatBytes(outcome.bytes), reason, memory, outcome.disk_step);
  DaemonEvent event;
  event.kind = DaemonEvent::Kind::kJobReleased;
  event.job = name;
  event.bytes = outcome.bytes;
  event.reason = reason;
  // The step written first, or the newest dropped (code says which); -1: nothing newer than disk.
  event.step = outcome.written_step >= 0 ? outcome.written_step
                                         : outcome.dropped_steps.empty() ? -1 : outcome.dropped_steps.front();
  event.code = outcome.written_step >= 0 ? "written" : outcome.dropped_steps.empty() ? "" : "dropped";
  Emit(std::move(event));
  MutexLock lock(&mu_);
  releasing_.erase(name);
  cv_.NotifyAll();
}

Result<ReleaseOutcome> Daemon::ReleaseJob(const std::string& job, const std::string& reason, bool force,
                                          std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(ValidateJobName(job));
  const auto deadline = clock_.Now() + timeout;
  ReleaseOutcome outcome;
  std::vector<int64_t> memory;
  {
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(ReleasableLocked(job));
    memory = CommonMemoryStepsLocked(jobs_.at(job));
  }
  if (!memory.empty()) {
    // Read without the lock. A root that cannot be read keeps the job: what is newer is unknown.
    Result<std::optional<int64_t>> latest = catalog_.LatestComplete(job);
    if (!latest.ok()) {
      return FailedPrecondition("job '" + job + "' is kept: the newest complete checkpoint on disk cannot be read (" +
                                latest.status().ToString() + ") to tell whether its memory checkpoints are newer" +
                                (force ? "" : "; release it with --force to drop them"));
    }
    outcome.disk_step = latest->value_or(-1);
    if (memory.front() > outcome.disk_step) {
      if (force) {
        for (int64_t step : memory) {
          if (step > outcome.disk_step) outcome.dropped_steps.push_back(step);
        }
      } else {
        RETURN_IF_ERROR(WriteMemoryBeforeRelease(job, memory.front(), outcome.disk_step, deadline));
        outcome.written_step = memory.front();
      }
    }
  }
  std::vector<std::shared_ptr<RankSegment>> segments;
  {
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(ReleasableLocked(job));  // again: a trainer may have come back meanwhile
    segments = DetachJobLocked(job, &outcome);
  }
  DropReleased(job, std::move(segments), outcome, reason);
  return outcome;
}

uint64_t Daemon::DisconnectedBytesLocked() const {
  uint64_t bytes = 0;
  for (const auto& [name, job] : jobs_) {
    const bool connected = std::any_of(job.ranks.begin(), job.ranks.end(),
                                       [](const auto& entry) { return !entry.second.session_id.empty(); });
    if (connected) continue;
    for (const auto& [r, rank] : job.ranks) bytes += rank.segment ? rank.segment->accounted() : 0;
  }
  return bytes;
}

bool Daemon::IdleDueLocked(const JobState& job) const {
  if (!ReleaseBlocker(job).empty()) return false;
  std::chrono::steady_clock::time_point last_gone{};
  for (const auto& [r, rank] : job.ranks) last_gone = std::max(last_gone, rank.gone_since);
  return clock_.Now() - last_gone >= config_.idle_release;
}

std::vector<std::pair<std::string, std::string>> Daemon::TakeIdleKeptEmasLocked() {
  const auto now = clock_.Now();
  std::vector<std::pair<std::string, std::string>> due;  // segment, job
  for (auto& [segment, kept] : kept_emas_) {
    if (jobs_.count(kept.job) != 0 || releasing_.count(kept.job) != 0) {
      kept.since = now;  // the job is back: its rank adopts the segment when it registers
      continue;
    }
    if (now - kept.since >= config_.idle_release) due.emplace_back(segment, kept.job);
  }
  for (const auto& [segment, job] : due) {
    kept_emas_.erase(segment);
    releasing_.insert(job);  // OpenSession of the job waits until the name is gone
  }
  return due;
}

void Daemon::DropKeptEmas(const std::vector<std::pair<std::string, std::string>>& due) {
  for (const auto& [segment, job] : due) {
    SharedSegment::Unlink(segment);
    state_.RemoveKeptEma(segment);
    Logger("shm")->info("released kept EMA segment={} job={}: its job did not come back within --idle-release",
                        segment, job);
  }
  MutexLock lock(&mu_);
  for (const auto& [segment, job] : due) releasing_.erase(job);
  cv_.NotifyAll();
}

void Daemon::ReleaseIdleJobs() {
  std::vector<std::pair<std::string, std::string>> kept;
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    kept = TakeIdleKeptEmasLocked();
  }
  if (!kept.empty()) DropKeptEmas(kept);
  MutexLock lock(&mu_);
  if (stopping_) return;
  std::vector<std::string> names;
  for (const auto& [name, job] : jobs_) {
    if (IdleDueLocked(job)) names.push_back(name);
  }
  for (const std::string& name : names) {
    // mu_ was let go for the previous job: a trainer may have come back since.
    auto it = jobs_.find(name);
    if (it == jobs_.end() || !IdleDueLocked(it->second)) continue;
    ReleaseOutcome outcome;
    // A memory checkpoint newer than the disk is written first, on one pass, and the job released
    // on a later one once it is; a job whose memory step cannot be written is kept.
    const std::vector<int64_t> memory = CommonMemoryStepsLocked(it->second);
    if (!memory.empty()) {
      const int64_t step = memory.front();
      lock.Unlock();
      Result<std::optional<int64_t>> latest = catalog_.LatestComplete(name);
      lock.Lock();
      if (stopping_) return;
      it = jobs_.find(name);
      if (it == jobs_.end() || !IdleDueLocked(it->second)) continue;
      JobState& job = it->second;
      outcome.disk_step = latest.ok() ? latest->value_or(-1) : -1;
      if (job.release_write_step == step && MemoryStepWrittenLocked(job, step)) {
        outcome.written_step = step;  // written on an earlier pass (its checkpoint may be complete now)
        outcome.disk_step = job.release_disk_step;
      } else if (step > outcome.disk_step || !latest.ok()) {
        if (job.release_write_step == step) {
          if (!job.release_kept_told) {
            job.release_kept_told = true;
            Logger("rpc")->error("idle release kept job={}: its memory checkpoint step={} (newer than the disk's "
                                 "step={}) could not be written; `flashckpt release --job {} --force` drops it",
                                 name, step, outcome.disk_step, name);
          }
          continue;
        } else {
          job.release_write_step = step;
          job.release_disk_step = outcome.disk_step;
          job.release_kept_told = false;
          lock.Unlock();
          Result<uint32_t> queued = PersistMemoryStep(name, step, outcome.disk_step, "before idle release");
          if (!queued.ok()) {
            Logger("rpc")->error("idle release job={}: memory step={} not written: {}", name, step,
                                 queued.status().ToString());
          }
          lock.Lock();
          if (stopping_) return;
          continue;  // released on a later pass, once written
        }
      }
    }
    std::vector<std::shared_ptr<RankSegment>> segments = DetachJobLocked(name, &outcome);
    lock.Unlock();
    DropReleased(name, std::move(segments), outcome, "idle");
    lock.Lock();
    if (stopping_) return;
  }
}

}  // namespace flashckpt

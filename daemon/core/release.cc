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
#include "daemon/core/memory_tier.h"
#include "daemon/core/releaser.h"
#include "daemon/parity/parity_sender.h"
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

std::string Releaser::ReleaseBlocker(const Core& c_, const JobState& job) {
  for (const auto& [r, rank] : job.ranks) {
    if (!rank.session_id.empty()) return "rank " + std::to_string(r) + " is connected (a trainer holds a session)";
    if (!rank.segment) continue;
    const SlotTable& slots = c_.Slots(*rank.segment);
    for (uint32_t i = 0; i < slots.size(); ++i) {
      const SlotInfo& slot = slots.at(i);
      if (slot.state == SlotState::kFree) continue;
      return "rank " + std::to_string(r) + " has step " + std::to_string(slot.step) + " in slot " + std::to_string(i) +
             ", " + SlotStateText(slot.state);
    }
  }
  return "";
}

std::vector<std::shared_ptr<RankSegment>> Releaser::DetachJobLocked(Core& c_, const std::string& name,
                                                                  ReleaseOutcome* outcome) {
  std::vector<std::shared_ptr<RankSegment>> segments;
  auto it = c_.jobs_.find(name);
  if (it == c_.jobs_.end()) return segments;
  for (auto& [r, rank] : it->second.ranks) {
    outcome->ranks += 1;
    if (!rank.segment) continue;
    outcome->bytes += rank.segment->accounted();
    // Its memory checkpoints go with the segment: a trainer that comes back later restores from disk.
    if (const auto held = c_.Slots(*rank.segment).ResidentSteps(); !held.empty()) {
      Logger("rpc")->warn("releasing job={} rank={} drops its memory checkpoints count={} newest_step={}", name, r,
                          held.size(), held.front());
    }
    MemoryTier::DropMemoryFrom(c_, *rank.segment, std::numeric_limits<int64_t>::min());  // and its mirror says so
    segments.push_back(std::move(rank.segment));
  }
  c_.jobs_.erase(it);
  c_.releasing_.insert(name);
  return segments;
}

Status Releaser::ReleasableLocked(const Core& c_, const std::string& name) {
  if (c_.stopping_) return Unavailable("the daemon is stopping; its segments are left for the next daemon");
  auto it = c_.jobs_.find(name);
  if (it == c_.jobs_.end()) {
    return NotFound("flashckptd holds no job '" + name + "'" +
                    (c_.releasing_.count(name) != 0 ? " (it is being released)" : " (see flashckpt status)"));
  }
  const std::string blocker = ReleaseBlocker(c_, it->second);
  if (!blocker.empty()) {
    Logger("rpc")->warn("release refused job={}: {}", name, blocker);
    return FailedPrecondition("job '" + name + "' is not released: " + blocker +
                              "; a job is released once all its ranks have gone and its snapshots are written");
  }
  return Status::OK();
}

Status Releaser::WriteMemoryBeforeRelease(const std::string& name, int64_t step, int64_t disk,
                                        std::chrono::steady_clock::time_point deadline) {
  const std::string what = "memory checkpoint step " + std::to_string(step) + " of job '" + name +
                           "' (newer than the disk's " + (disk < 0 ? std::string("none") : "step " + std::to_string(disk)) +
                           ")";
  auto kept = [&](const Status& why) {
    return FailedPrecondition("job '" + name + "' is kept: its " + what + " could not be written (" + why.ToString() +
                              "); release it with --force to drop it");
  };
  Result<uint32_t> queued = c_.memory->PersistMemoryStep(name, step, disk, "before release");
  if (!queued.ok()) return kept(queued.status());
  MutexLock lock(&c_.mu_);
  for (;;) {
    auto it = c_.jobs_.find(name);
    if (it == c_.jobs_.end()) return NotFound("job '" + name + "' went while its " + what + " was written");
    bool writing = false;
    for (const auto& [r, rank] : it->second.ranks) {
      if (auto failed = rank.failed.find(step); failed != rank.failed.end()) return kept(failed->second);
      if (rank.segment && c_.Slots(*rank.segment).CountIn(SlotState::kPersisting) > 0) writing = true;
    }
    if (!writing) {
      if (!MemoryTier::MemoryStepWrittenLocked(c_, it->second, step)) return kept(Internal("a rank's copy was not written"));
      return Status::OK();
    }
    if (!c_.clock_.WaitUntil(&c_.cv_, &lock, deadline)) {
      return DeadlineExceeded("job '" + name + "' is kept: its " + what + " is still being written; release again "
                              "once it is");
    }
  }
}

void Releaser::DropReleased(const std::string& name, std::vector<std::shared_ptr<RankSegment>> segments,
                          const ReleaseOutcome& outcome, const std::string& reason) {
  if (c_.sender_) c_.sender_->Forget(name);  // its queued replicas hold the segments too
  if (c_.parity_) {
    c_.parity_->Forget(name);
    c_.parity_->OfferReleased(name);  // the holders may drop its shares
  }
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
  const auto deadline = c_.clock_.Now() + std::chrono::seconds(10);
  for (const auto& segment : going) {
    while (!segment.expired() && c_.clock_.Now() < deadline) {
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
  c_.Emit(std::move(event));
  MutexLock lock(&c_.mu_);
  c_.releasing_.erase(name);
  c_.cv_.NotifyAll();
}

Result<ReleaseOutcome> Releaser::ReleaseJob(const std::string& job, const std::string& reason, bool force,
                                          std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(ValidateJobName(job));
  const auto deadline = c_.clock_.Now() + timeout;
  ReleaseOutcome outcome;
  std::vector<int64_t> memory;
  {
    MutexLock lock(&c_.mu_);
    RETURN_IF_ERROR(ReleasableLocked(c_, job));
    memory = MemoryTier::CommonMemoryStepsLocked(c_, c_.jobs_.at(job));
  }
  if (!memory.empty()) {
    // Read without the lock. A root that cannot be read keeps the job: what is newer is unknown.
    Result<std::optional<int64_t>> latest = c_.catalog_.LatestComplete(job);
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
    MutexLock lock(&c_.mu_);
    RETURN_IF_ERROR(ReleasableLocked(c_, job));  // again: a trainer may have come back meanwhile
    segments = DetachJobLocked(c_, job, &outcome);
  }
  DropReleased(job, std::move(segments), outcome, reason);
  return outcome;
}

bool Releaser::IdleDueLocked(const Core& c_, const JobState& job) {
  if (!ReleaseBlocker(c_, job).empty()) return false;
  std::chrono::steady_clock::time_point last_gone{};
  for (const auto& [r, rank] : job.ranks) last_gone = std::max(last_gone, rank.gone_since);
  return c_.clock_.Now() - last_gone >= c_.config_.idle_release;
}

std::vector<std::pair<std::string, std::string>> Releaser::TakeIdleKeptEmasLocked(Core& c_) {
  const auto now = c_.clock_.Now();
  std::vector<std::pair<std::string, std::string>> due;  // segment, job
  for (auto& [segment, kept] : c_.kept_emas_) {
    if (c_.jobs_.count(kept.job) != 0 || c_.releasing_.count(kept.job) != 0) {
      kept.since = now;  // the job is back: its rank adopts the segment when it registers
      continue;
    }
    if (now - kept.since >= c_.config_.idle_release) due.emplace_back(segment, kept.job);
  }
  for (const auto& [segment, job] : due) {
    c_.kept_emas_.erase(segment);
    c_.releasing_.insert(job);  // OpenSession of the job waits until the name is gone
  }
  return due;
}

void Releaser::DropKeptEmas(const std::vector<std::pair<std::string, std::string>>& due) {
  for (const auto& [segment, job] : due) {
    SharedSegment::Unlink(segment);
    c_.state_.RemoveKeptEma(segment);
    Logger("shm")->info("released kept EMA segment={} job={}: its job did not come back within --idle-release",
                        segment, job);
  }
  MutexLock lock(&c_.mu_);
  for (const auto& [segment, job] : due) c_.releasing_.erase(job);
  c_.cv_.NotifyAll();
}

void Releaser::ReleaseIdleJobs() {
  std::vector<std::pair<std::string, std::string>> kept;
  {
    MutexLock lock(&c_.mu_);
    if (c_.stopping_) return;
    kept = TakeIdleKeptEmasLocked(c_);
  }
  if (!kept.empty()) DropKeptEmas(kept);
  MutexLock lock(&c_.mu_);
  if (c_.stopping_) return;
  std::vector<std::string> names;
  for (const auto& [name, job] : c_.jobs_) {
    if (IdleDueLocked(c_, job)) names.push_back(name);
  }
  for (const std::string& name : names) {
    // c_.mu_ was let go for the previous job: a trainer may have come back since.
    auto it = c_.jobs_.find(name);
    if (it == c_.jobs_.end() || !IdleDueLocked(c_, it->second)) continue;
    ReleaseOutcome outcome;
    // A memory checkpoint newer than the disk is written first, on one pass, and the job released
    // on a later one once it is; a job whose memory step cannot be written is kept.
    const std::vector<int64_t> memory = MemoryTier::CommonMemoryStepsLocked(c_, it->second);
    if (!memory.empty()) {
      const int64_t step = memory.front();
      lock.Unlock();
      Result<std::optional<int64_t>> latest = c_.catalog_.LatestComplete(name);
      lock.Lock();
      if (c_.stopping_) return;
      it = c_.jobs_.find(name);
      if (it == c_.jobs_.end() || !IdleDueLocked(c_, it->second)) continue;
      JobState& job = it->second;
      outcome.disk_step = latest.ok() ? latest->value_or(-1) : -1;
      if (job.release_write_step == step && MemoryTier::MemoryStepWrittenLocked(c_, job, step)) {
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
          Result<uint32_t> queued = c_.memory->PersistMemoryStep(name, step, outcome.disk_step, "before idle release");
          if (!queued.ok()) {
            Logger("rpc")->error("idle release job={}: memory step={} not written: {}", name, step,
                                 queued.status().ToString());
          }
          lock.Lock();
          if (c_.stopping_) return;
          continue;  // released on a later pass, once written
        }
      }
    }
    std::vector<std::shared_ptr<RankSegment>> segments = DetachJobLocked(c_, name, &outcome);
    lock.Unlock();
    DropReleased(name, std::move(segments), outcome, "idle");
    lock.Lock();
    if (c_.stopping_) return;
  }
}

void Releaser::SweepSignalledSteps() {
  // The newest step directories of a job each sweep looks at: one listing of the job directory and
  // at most this many stats (and signal reads of incomplete ones), however long the run.
  constexpr size_t kSweepSteps = 16;
  // Each job with its ranks' current attempts (also of ranks that have exited since their last
  // save): only their steps are completed, never one of an attempt that a rank has left.
  std::vector<std::pair<std::string, std::vector<Attempt>>> jobs;
  {
    MutexLock lock(&c_.mu_);
    if (c_.stopping_) return;
    for (const auto& [name, job] : c_.jobs_) {
      std::vector<Attempt> attempts;
      for (const auto& [r, rank] : job.ranks) {
        if (!rank.run_id.empty() && std::find(attempts.begin(), attempts.end(), rank.attempt()) == attempts.end()) {
          attempts.push_back(rank.attempt());
        }
      }
      if (!attempts.empty()) jobs.emplace_back(name, std::move(attempts));
    }
  }
  for (const auto& [job, attempts] : jobs) {
    {
      MutexLock check(&c_.mu_);  // a stop does not wait for the rest of a sweep of a slow root
      if (c_.stopping_) break;
    }
    auto completed = c_.catalog_.CompleteSignalledSteps(job, attempts, kSweepSteps);
    if (!completed.ok()) {
      Logger("catalog")->warn("sweep job={} error=\"{}\"", job, completed.status().ToString());
      continue;
    }
    for (int64_t step : *completed) {
      Logger("catalog")->info("sweep found job={} step={} complete: its signals were all there (written by more "
                              "than one daemon, or seen late)", job, step);
    }
  }
}

}  // namespace flashckpt

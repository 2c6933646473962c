// The Catalog's deletions: retention (--keep), gc, an operator's delete, and the overwrite of
// other runs' checkpoints, all through DeleteStepsLocked (hide, then remove, then LATEST).

#include <unistd.h>

#include <algorithm>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/format/metadata.h"
#include "common/io/fs.h"
#include "daemon/pipeline/catalog.h"

namespace flashckpt {

Result<DeletionOutcome> Catalog::DeleteOtherRuns(const std::string& job, const std::string& run_id,
                                                 const std::set<int64_t>& busy) {
  RETURN_IF_ERROR(ValidateJobName(job));
  MutexLock lock(&JobMutex(job));
  ASSIGN_OR_RETURN(JobSteps steps, ScanSteps(job));
  std::vector<int64_t> victims;
  for (int64_t step : steps.complete) {
    // Read past the cache: one look at each of the job's checkpoints must not push out the
    // metadata the job's restores share.
    ASSIGN_OR_RETURN(CheckpointMetadata meta, ReadMetadataFile(CheckpointDir(job, step), io_));
    if (meta.run_id != run_id) victims.push_back(step);
  }
  // An incomplete directory goes only when it holds another run's signals and none of this run's:
  // one without signals may be this run's own step that another daemon is writing. A signal that
  // cannot be parsed is not this run's (its signals are written whole, by rename): it counts as
  // another run's, so a damaged leftover never blocks a new lineage.
  for (int64_t step : steps.incomplete) {
    auto names = ListDir(CheckpointDir(job, step), io_);
    if (!names.ok()) {
      if (names.status().code() == StatusCode::kNotFound) continue;  // gone meanwhile
      return names.status();
    }
    bool ours = false, others = false;
    for (const auto& name : *names) {
      if (name.rfind("saved_signal_", 0) != 0) continue;
      auto signal = ReadSignal(CheckpointDir(job, step) + "/" + name, io_);
      if (!signal.ok()) {
        if (signal.status().code() == StatusCode::kNotFound) continue;
        if (signal.status().code() != StatusCode::kCorruption) return signal.status();
        Logger("catalog")->warn("overwrite job={} run={}: {}: counted as another run's", job, run_id,
                                signal.status().ToString());
        others = true;
        continue;
      }
      (signal->run_id == run_id ? ours : others) = true;
    }
    if (others && !ours) victims.push_back(step);
  }
  std::sort(victims.begin(), victims.end());
  return DeleteStepsLocked(job, victims, busy, /*dry_run=*/false, "overwrite");
}

Result<std::vector<int64_t>> Catalog::ApplyRetention(const std::string& job, uint32_t keep) {
  MutexLock lock(&JobMutex(job));
  return ApplyRetentionLocked(job, keep);
}

Result<std::vector<int64_t>> Catalog::ApplyRetentionLocked(const std::string& job, uint32_t keep) {
  if (keep == 0) return std::vector<int64_t>{};
  ASSIGN_OR_RETURN(JobSteps steps, ScanSteps(job));
  ASSIGN_OR_RETURN(DeletionOutcome outcome,
                   DeleteStepsLocked(job, RetentionVictims(steps, keep), {}, /*dry_run=*/false, "retention"));
  return std::move(outcome.deleted);
}

Result<DeletionOutcome> Catalog::CollectGarbage(const std::string& job, uint32_t keep, const std::set<int64_t>& busy,
                                                bool dry_run) {
  RETURN_IF_ERROR(ValidateJobName(job));
  if (keep == 0) return InvalidArgument("gc needs keep >= 1: the newest complete checkpoint is always kept");
  MutexLock lock(&JobMutex(job));
  ASSIGN_OR_RETURN(JobSteps steps, ScanSteps(job));
  return DeleteStepsLocked(job, RetentionVictims(steps, keep), busy, dry_run, "gc");
}

Result<DeletionOutcome> Catalog::DeleteCheckpoint(const std::string& job, int64_t step, bool force,
                                                  const std::set<int64_t>& busy, bool dry_run) {
  RETURN_IF_ERROR(ValidateJobName(job));
  if (step <= 0) return InvalidArgument("delete needs a step >= 1, got " + std::to_string(step));
  MutexLock lock(&JobMutex(job));
  ASSIGN_OR_RETURN(JobSteps steps, ScanSteps(job));
  const std::string dir = CheckpointDir(job, step);
  const bool complete = std::find(steps.complete.begin(), steps.complete.end(), step) != steps.complete.end();
  if (!complete && std::find(steps.incomplete.begin(), steps.incomplete.end(), step) == steps.incomplete.end()) {
    return NotFound("no checkpoint directory " + dir);
  }
  if (complete && steps.complete.front() == step && !force) {
    std::string then = steps.complete.size() > 1 ? "LATEST would move back to step " + std::to_string(steps.complete[1])
                                                 : "the job would have no complete checkpoint left";
    return FailedPrecondition("checkpoint-" + std::to_string(step) + " is the newest complete checkpoint of job '" +
                              job + "'; deleting it needs --force (" + then + ")");
  }
  {
    MutexLock use(&use_mu_);
    if (InUseLocked(job, step, busy)) {
      return FailedPrecondition("checkpoint-" + std::to_string(step) + " of job '" + job +
                                "' is in use (a restore reading it or a save writing it); it is never deleted "
                                "while in use: try again when that has finished");
    }
  }
  ASSIGN_OR_RETURN(DeletionOutcome outcome, DeleteStepsLocked(job, {step}, busy, dry_run, "delete"));
  if (!outcome.skipped.empty()) {  // came into use, or vanished, since the check above
    return FailedPrecondition("checkpoint-" + std::to_string(step) + " of job '" + job +
                              "' was not deleted: " + outcome.skipped.front().reason);
  }
  return outcome;
}

std::vector<int64_t> Catalog::RetentionVictims(const JobSteps& steps, uint32_t keep) {
  std::vector<int64_t> victims;
  // Nothing is safe to delete before a checkpoint is complete, and the newest one always stays.
  if (keep == 0 || steps.complete.empty()) return victims;
  const size_t kept = std::min<size_t>(keep, steps.complete.size());
  const int64_t oldest_kept = steps.complete[kept - 1];
  victims.assign(steps.complete.begin() + static_cast<std::ptrdiff_t>(kept), steps.complete.end());
  for (int64_t step : steps.incomplete) {
    if (step < oldest_kept) victims.push_back(step);
  }
  std::sort(victims.begin(), victims.end());
  return victims;
}

bool Catalog::InUseLocked(const std::string& job, int64_t step, const std::set<int64_t>& busy) const {
  if (busy.count(step) != 0) return true;
  auto it = in_use_.find(job);
  return it != in_use_.end() && it->second.count(step) != 0;
}

Result<bool> Catalog::HideUnlessInUse(const std::string& job, int64_t step, const std::set<int64_t>& busy,
                                      const std::string& hidden) {
  std::string dir = CheckpointDir(job, step);
  // A live lease of any daemon (read without use_mu_: it is I/O on the shared root).
  auto leased = [&]() -> Result<bool> {
    if (leases_ == nullptr) return false;
    ASSIGN_OR_RETURN(std::optional<std::string> holder, leases_->LiveHolder(job, step));
    if (holder) Logger("catalog")->info("deletion skipped job={} step={}: leased by {}", job, step, *holder);
    return holder.has_value();
  };
  ASSIGN_OR_RETURN(bool before, leased());
  if (before) return false;
  {
    MutexLock lock(&use_mu_);
    if (InUseLocked(job, step, busy)) return false;
    if (io_->Rename(dir, hidden) != 0) {
      if (errno == ENOENT) return false;  // already gone (another daemon sharing the root)
      return ErrnoStatus("rename " + dir + " to", hidden);
    }
  }
  // A lease taken between the first look and the rename: its holder may be about to read the
  // directory. It goes back under its name (the holder retries a directory it did not find).
  auto after = leased();
  if (after.ok() && !*after) return true;
  if (io_->Rename(hidden, dir) != 0) {
    return ErrnoStatus("rename back " + hidden + " to", dir + " (a lease appeared while it was deleted)");
  }
  if (!after.ok()) return after.status();
  return false;
}

Status Catalog::PlanStepDeletionLocked(const std::string& job, int64_t step, const std::set<int64_t>& busy,
                                       DeletionOutcome* out) {
  // What the deletion would skip: a step in use here, or leased by any daemon on the root (the
  // lease read without use_mu_: it is I/O on the shared root; expired leases it finds are
  // removed, as by a deletion: they protect nothing).
  std::optional<std::string> holder;
  if (leases_ != nullptr) {
    auto leased = leases_->LiveHolder(job, step);
    if (!leased.ok()) return leased.status();
    holder = std::move(leased).value();
  }
  MutexLock use(&use_mu_);
  if (InUseLocked(job, step, busy)) {
    out->skipped.push_back({step, "in use (a restore reading it or a save writing it)"});
  } else if (holder) {
    out->skipped.push_back({step, "leased by " + *holder});
  } else {
    out->deleted.push_back(step);
  }
  return Status::OK();
}

Status Catalog::DeleteStepLocked(const std::string& job, int64_t step, const std::set<int64_t>& busy,
                                 const char* reason, DeletionOutcome* out) {
  // Crash-safe order: the directory is renamed to a hidden name in one step (no reader sees half
  // a checkpoint under its own name), then metadata.json goes first (a leftover of a crash here is
  // never complete, even if renamed back), then the rest.
  // Named after this process and its place (TemporaryPlace): daemons of other nodes sharing the root
  // may have the same pid, and one's clearing below must not remove another's deletion in progress.
  std::string hidden = JobDir(job) + "/.deleting-" + CheckpointDirName(step) + "." + std::to_string(::getpid()) +
                       "." + TemporaryPlace();
  Status cleared = RemoveTree(hidden);  // a leftover of an interrupted deletion would block the rename
  auto hid = cleared.ok() ? HideUnlessInUse(job, step, busy, hidden) : Result<bool>(cleared);
  if (hid.ok() && !*hid) {
    const bool gone = !PathExists(CheckpointDir(job, step));
    Logger("catalog")->info("{} skipped job={} step={} reason={}", reason, job, step, gone ? "gone" : "in_use");
    out->skipped.push_back(
        {step, gone ? "already gone (deleted meanwhile)" : "in use (a restore reading it or a save writing it)"});
    return Status::OK();
  }
  Status removed = hid.ok() ? Status::OK() : hid.status();
  if (removed.ok() && io_->Unlink(hidden + "/metadata.json") != 0 && errno != ENOENT) {
    removed = ErrnoStatus("unlink", hidden + "/metadata.json");
  }
  if (removed.ok()) removed = RemoveTree(hidden);
  if (!removed.ok()) {
    Logger("catalog")->error("delete failed job={} step={} error=\"{}\"", job, step, removed.ToString());
    return removed;
  }
  Logger("catalog")->info("deleted job={} step={} reason={}", job, step, reason);
  out->deleted.push_back(step);
  ForgetKnown(job);
  metadata_.Forget(CheckpointDir(job, step));
  if (listener_) listener_(CatalogChange::kDeleted, job, step, reason);
  return Status::OK();
}

Status Catalog::SetLatestLocked(const std::string& job, std::optional<int64_t> latest_step) {
  // LATEST names the newest complete checkpoint left, or goes when none is left.
  Status latest;
  if (latest_step) {
    auto current = ReadSmallFile(JobDir(job) + "/LATEST", 64, io_);
    if (!current.ok() || *current != std::to_string(*latest_step) + "\n") {
      latest = WriteFileDurably(JobDir(job), "LATEST", std::to_string(*latest_step) + "\n", nullptr, io_);
    }
  } else if (io_->Unlink(JobDir(job) + "/LATEST") != 0 && errno != ENOENT) {
    latest = ErrnoStatus("unlink", JobDir(job) + "/LATEST");
  }
  Status synced = FsyncDir(JobDir(job), io_);
  return latest.ok() ? synced : latest;
}

Result<DeletionOutcome> Catalog::DeleteStepsLocked(const std::string& job, const std::vector<int64_t>& victims,
                                                   const std::set<int64_t>& busy, bool dry_run, const char* reason) {
  DeletionOutcome out;
  Status first_error;
  for (int64_t step : victims) {
    Status s =
        dry_run ? PlanStepDeletionLocked(job, step, busy, &out) : DeleteStepLocked(job, step, busy, reason, &out);
    if (!s.ok() && first_error.ok()) first_error = s;
  }
  if (dry_run) {  // the newest complete checkpoint that the deletion would leave
    ASSIGN_OR_RETURN(JobSteps steps, ScanSteps(job));
    for (int64_t step : steps.complete) {
      if (std::find(out.deleted.begin(), out.deleted.end(), step) == out.deleted.end()) {
        out.latest = step;
        break;
      }
    }
    if (!first_error.ok()) return first_error;
    return out;
  }
  ASSIGN_OR_RETURN(out.latest, LatestComplete(job));
  if (!out.deleted.empty()) {
    Status latest = SetLatestLocked(job, out.latest);
    if (!latest.ok() && first_error.ok()) first_error = latest;
  }
  if (!first_error.ok()) return first_error;
  return out;
}

}  // namespace flashckpt

#include "daemon/pipeline/catalog.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/format/metadata.h"
#include "common/io/fs.h"

namespace flashckpt {

StepInUse::StepInUse(StepInUse&& o) noexcept
    : catalog_(o.catalog_), job_(std::move(o.job_)), step_(o.step_), lease_(std::move(o.lease_)) {
  o.catalog_ = nullptr;
}

StepInUse& StepInUse::operator=(StepInUse&& o) noexcept {
  if (this != &o) {
    Reset();
    catalog_ = o.catalog_;
    job_ = std::move(o.job_);
    step_ = o.step_;
    lease_ = std::move(o.lease_);
    o.catalog_ = nullptr;
  }
  return *this;
}

void StepInUse::Reset() {
  if (catalog_ != nullptr) catalog_->Release(job_, step_, lease_);
  catalog_ = nullptr;
  lease_.clear();
}

StepInUse Catalog::Use(const std::string& job, int64_t step) {
  {
    MutexLock lock(&use_mu_);
    in_use_[job].insert(step);
  }
  // The lease is written after the step is marked here: this daemon never deletes it from now on,
  // and another daemon's deletion sees the lease, or renames the directory back when it finds the
  // lease after its rename (HideUnlessInUse).
  std::string lease = leases_ != nullptr ? leases_->Take(job, step) : "";
  return StepInUse(this, job, step, std::move(lease));
}

void Catalog::Release(const std::string& job, int64_t step, const std::string& lease) {
  {
    MutexLock lock(&use_mu_);
    auto it = in_use_.find(job);
    if (it != in_use_.end()) {
      auto s = it->second.find(step);
      if (s != it->second.end()) it->second.erase(s);
      if (it->second.empty()) in_use_.erase(it);
    }
  }
  if (leases_ != nullptr) leases_->Drop(lease);
}

std::string Catalog::CheckpointDir(const std::string& job, int64_t step) const {
  return JobDir(job) + "/" + CheckpointDirName(step);
}

Mutex& Catalog::JobMutex(const std::string& job) {
  MutexLock lock(&mu_);
  auto& m = job_mu_[job];
  if (!m) m = std::make_unique<Mutex>();
  return *m;
}

Result<bool> Catalog::IsComplete(const std::string& job, int64_t step) const {
  return Exists(CheckpointDir(job, step) + "/metadata.json", io_);
}

Result<bool> Catalog::HasSignal(const std::string& job, uint32_t rank, int64_t step, const Attempt& attempt) const {
  auto signal = ReadSignal(CheckpointDir(job, step) + "/" + SignalFileName(rank), io_);
  if (!signal.ok()) {
    if (signal.status().code() == StatusCode::kNotFound) return false;
    return signal.status();
  }
  return signal->rank == rank && signal->step == step && signal->attempt() == attempt;
}

Result<std::map<uint32_t, Attempt>> Catalog::SignalAttempts(const std::string& job, int64_t step,
                                                            uint32_t world_size) const {
  std::map<uint32_t, Attempt> out;
  const std::string dir = CheckpointDir(job, step);
  for (uint32_t r = 0; r < world_size; ++r) {
    auto signal = ReadSignal(dir + "/" + SignalFileName(r), io_);
    if (!signal.ok()) {
      if (signal.status().code() == StatusCode::kNotFound) continue;
      return signal.status();
    }
    if (signal->rank == r && signal->step == step) out[r] = signal->attempt();
  }
  return out;
}

Result<std::optional<Catalog::RunCheckpoint>> Catalog::LatestRun(const std::string& job) const {
  std::optional<RunCheckpoint> none;
  ASSIGN_OR_RETURN(std::optional<int64_t> named, LatestNamed(job));
  if (!named) return none;  // missing or torn: the next completion rewrites it
  const int64_t step = *named;
  auto meta = ReadMetadataFile(CheckpointDir(job, step), io_);
  if (!meta.ok()) {
    if (meta.status().code() == StatusCode::kNotFound) return none;
    return meta.status();
  }
  return std::optional<RunCheckpoint>{RunCheckpoint{step, meta->run_id}};
}

Result<std::optional<Catalog::RunCheckpoint>> Catalog::NewestComplete(const std::string& job,
                                                                      const std::string& skip_run) const {
  RETURN_IF_ERROR(ValidateJobName(job));
  ASSIGN_OR_RETURN(JobSteps steps, ScanSteps(job));
  for (int64_t step : steps.complete) {  // newest first
    const std::string dir = CheckpointDir(job, step);
    std::string run;
    auto signal = ReadSignal(dir + "/" + SignalFileName(0), io_);
    if (signal.ok() && signal->step == step) {
      run = signal->run_id;
    } else {
      auto meta = ReadMetadataFile(dir, io_);
      if (!meta.ok()) {
        if (meta.status().code() == StatusCode::kNotFound) continue;  // deleted meanwhile
        return meta.status();
      }
      run = meta->run_id;
    }
    if (skip_run.empty() || run != skip_run) return std::optional<RunCheckpoint>{RunCheckpoint{step, run}};
  }
  return std::optional<RunCheckpoint>();
}

Result<DeletionOutcome> Catalog::DeleteOtherRuns(const std::string& job, const std::string& run_id,
                                                 const std::set<int64_t>& busy) {
  RETURN_IF_ERROR(ValidateJobName(job));
  MutexLock lock(&JobMutex(job));
  ASSIGN_OR_RETURN(JobSteps steps, ScanSteps(job));
  std::vector<int64_t> victims;
  for (int64_t step : steps.complete) {
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

Result<bool> Catalog::MaybeComplete(const std::string& job, int64_t step, uint32_t world_size, const Attempt& attempt,
                                    std::map<uint32_t, Signal>* mixed) {
  MutexLock lock(&JobMutex(job));
  std::string dir = CheckpointDir(job, step);
  ASSIGN_OR_RETURN(bool complete, IsComplete(job, step));
  if (complete) return true;
  std::vector<std::string> files;
  std::map<uint32_t, Signal> all;
  bool one_attempt = true;
  for (uint32_t r = 0; r < world_size; ++r) {
    auto signal = ReadSignal(dir + "/" + SignalFileName(r), io_);
    if (!signal.ok()) {
      if (signal.status().code() == StatusCode::kNotFound) return false;  // not yet written
      return signal.status();  // unreadable or torn: an error, never "not complete"
    }
    if (signal->step != step || signal->rank != r) return false;
    if (signal->attempt() != attempt) {
      // Another attempt's: the rest are still read, for `mixed` (no more reads than a completion).
      if (mixed == nullptr) return false;
      one_attempt = false;
    }
    for (auto& f : signal->files) files.push_back(std::move(f));
    signal->files.clear();
    if (mixed != nullptr) all.emplace(r, std::move(*signal));  // its file list is in `files`
  }
  if (!one_attempt) {
    *mixed = std::move(all);
    return false;
  }
  ASSIGN_OR_RETURN(CheckpointMetadata meta, BuildMetadataFromFiles(dir, std::move(files), io_));
  meta.run_id = attempt.run_id;
  meta.resumed_from = attempt.resumed_from;
  if (meta.step != step || meta.job != job || meta.topology.world_size != world_size) {
    return Corruption(dir + ": files describe job '" + meta.job + "' step " + std::to_string(meta.step) +
                      " world size " + std::to_string(meta.topology.world_size) + ", expected '" + job + "' step " +
                      std::to_string(step) + " world size " + std::to_string(world_size));
  }
  RETURN_IF_ERROR(WriteFileDurably(dir, "metadata.json", MetadataToJson(meta), nullptr, io_));
  // LATEST moves forward unless it names a newer complete checkpoint. Only LATEST and that one
  // directory are read: a completion must not cost a listing of every step of a long run.
  ASSIGN_OR_RETURN(bool newer, LatestNamesNewer(job, step));
  if (!newer) RETURN_IF_ERROR(WriteFileDurably(JobDir(job), "LATEST", std::to_string(step) + "\n", nullptr, io_));
  Logger("catalog")->info("complete job={} step={} files={} tensors={}", job, step, meta.files.size(),
                          meta.pieces.size());
  NoteCompleted(job, step);
  if (listener_) listener_(CatalogChange::kCompleted, job, step, "");
  if (keep_ > 0) {
    auto deleted = ApplyRetentionLocked(job, keep_);
    if (!deleted.ok()) {
      Logger("catalog")->error("retention failed job={} keep={} error=\"{}\"", job, keep_, deleted.status().ToString());
    }
  }
  return true;
}

Result<std::vector<int64_t>> Catalog::CompleteSignalledSteps(const std::string& job,
                                                             const std::vector<Attempt>& attempts, size_t max_steps) {
  RETURN_IF_ERROR(ValidateJobName(job));
  std::vector<int64_t> completed;
  ASSIGN_OR_RETURN(auto names, ListDirIfExists(JobDir(job), io_));
  if (!names) return completed;
  std::vector<int64_t> steps;
  for (const auto& n : *names) {
    if (auto step = ParseCheckpointDirName(n)) steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end(), std::greater<>());
  if (steps.size() > max_steps) steps.resize(max_steps);
  std::optional<int64_t> newest_complete;
  Status first_error;  // a step that cannot be read does not stop the others, nor LATEST's check
  for (int64_t step : steps) {
    auto complete = IsComplete(job, step);
    if (!complete.ok()) {
      if (first_error.ok()) first_error = complete.status();
      continue;
    }
    if (*complete) {
      newest_complete = std::max(newest_complete.value_or(step), step);
      continue;
    }
    const std::string dir = CheckpointDir(job, step);
    auto files = ListDir(dir, io_);
    if (!files.ok()) {
      if (files.status().code() != StatusCode::kNotFound && first_error.ok()) first_error = files.status();
      continue;  // NOT_FOUND: deleted meanwhile
    }
    // The signals there must all be of one attempt and say how many ranks the step has (signals
    // of releases that did not record it never complete here: their own daemon completes them).
    std::optional<Attempt> attempt;
    uint32_t world_size = 0, signals = 0;
    bool usable = true;
    for (const auto& f : *files) {
      if (f.rfind("saved_signal_", 0) != 0) continue;
      auto signal = ReadSignal(dir + "/" + f, io_);
      if (!signal.ok()) {
        if (signal.status().code() == StatusCode::kNotFound) continue;
        usable = false;  // damaged or unreadable: MaybeComplete would refuse it too
        break;
      }
      if (signal->step != step || SignalFileName(signal->rank) != f || signal->world_size == 0 ||
          (world_size != 0 && signal->world_size != world_size) || (attempt && signal->attempt() != *attempt)) {
        usable = false;
        break;
      }
      world_size = signal->world_size;
      attempt = signal->attempt();
      ++signals;
    }
    if (!usable || world_size == 0 || signals != world_size) continue;
    if (std::find(attempts.begin(), attempts.end(), *attempt) == attempts.end()) continue;
    auto done = MaybeComplete(job, step, world_size, *attempt);
    if (!done.ok()) {
      if (first_error.ok()) first_error = done.status();
      continue;
    }
    if (*done) {
      completed.push_back(step);
      newest_complete = std::max(newest_complete.value_or(step), step);
    }
  }
  if (newest_complete) {
    Status moved = MoveLatestForward(job, *newest_complete);
    if (!moved.ok() && first_error.ok()) first_error = moved;
  }
  if (!first_error.ok()) return first_error;
  return completed;
}

Result<std::optional<int64_t>> Catalog::LatestNamed(const std::string& job) const {
  std::optional<int64_t> named;
  auto text = ReadSmallFile(JobDir(job) + "/LATEST", 64, io_);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) return named;
    return text.status();
  }
  int64_t step = 0;
  auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), step);
  (void)end;
  if (ec == std::errc() && step >= 0) named = step;  // else torn: as if missing
  return named;
}

Status Catalog::MoveLatestForward(const std::string& job, int64_t complete) {
  // Read without the job's lock first: nearly every sweep finds LATEST at or past the step.
  ASSIGN_OR_RETURN(std::optional<int64_t> named, LatestNamed(job));
  if (named && *named >= complete) return Status::OK();  // a newer step is never replaced, complete or not yet
  MutexLock lock(&JobMutex(job));
  ASSIGN_OR_RETURN(named, LatestNamed(job));
  if (named && *named >= complete) return Status::OK();
  ASSIGN_OR_RETURN(bool still, IsComplete(job, complete));  // not deleted meanwhile
  if (!still) return Status::OK();
  RETURN_IF_ERROR(WriteFileDurably(JobDir(job), "LATEST", std::to_string(complete) + "\n", nullptr, io_));
  if (named) {
    Logger("catalog")->warn(
        "LATEST of job={} named step {}, older than complete step {}: moved forward (two "
        "daemons completed steps at once, the older one's LATEST last)",
        job, *named, complete);
  } else {
    Logger("catalog")->warn("LATEST of job={} was missing or unreadable with step {} complete: written", job, complete);
  }
  return Status::OK();
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

Result<Catalog::JobSteps> Catalog::ScanSteps(const std::string& job) const {
  JobSteps out;
  ASSIGN_OR_RETURN(auto names, ListDirIfExists(JobDir(job), io_));
  if (!names) return out;
  for (const auto& n : *names) {
    auto step = ParseCheckpointDirName(n);
    if (!step) continue;
    ASSIGN_OR_RETURN(bool complete, IsComplete(job, *step));
    (complete ? out.complete : out.incomplete).push_back(*step);
  }
  std::sort(out.complete.begin(), out.complete.end(), std::greater<>());
  std::sort(out.incomplete.begin(), out.incomplete.end());
  return out;
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

Result<DeletionOutcome> Catalog::DeleteStepsLocked(const std::string& job, const std::vector<int64_t>& victims,
                                                   const std::set<int64_t>& busy, bool dry_run, const char* reason) {
  DeletionOutcome out;
  Status first_error;
  for (int64_t step : victims) {
    if (dry_run) {
      // What the deletion would skip: a step in use here, or leased by any daemon on the root (the
      // lease read without use_mu_: it is I/O on the shared root; expired leases it finds are
      // removed, as by a deletion: they protect nothing).
      std::optional<std::string> holder;
      if (leases_ != nullptr) {
        auto leased = leases_->LiveHolder(job, step);
        if (!leased.ok()) {
          if (first_error.ok()) first_error = leased.status();
          continue;
        }
        holder = std::move(leased).value();
      }
      MutexLock use(&use_mu_);
      if (InUseLocked(job, step, busy)) {
        out.skipped.push_back({step, "in use (a restore reading it or a save writing it)"});
      } else if (holder) {
        out.skipped.push_back({step, "leased by " + *holder});
      } else {
        out.deleted.push_back(step);
      }
      continue;
    }
    // Crash-safe order: the directory is renamed to a hidden name in one step (no reader sees half
    // a checkpoint under its own name), then metadata.json goes first (a leftover of a crash here is
    // never complete, even if renamed back), then the rest.
    std::string hidden = JobDir(job) + "/.deleting-" + CheckpointDirName(step) + "." + std::to_string(::getpid());
    Status cleared = RemoveTree(hidden);  // a leftover of an interrupted deletion would block the rename
    auto hid = cleared.ok() ? HideUnlessInUse(job, step, busy, hidden) : Result<bool>(cleared);
    if (hid.ok() && !*hid) {
      const bool gone = !PathExists(CheckpointDir(job, step));
      Logger("catalog")->info("{} skipped job={} step={} reason={}", reason, job, step, gone ? "gone" : "in_use");
      out.skipped.push_back(
          {step, gone ? "already gone (deleted meanwhile)" : "in use (a restore reading it or a save writing it)"});
      continue;
    }
    Status removed = hid.ok() ? Status::OK() : hid.status();
    if (removed.ok() && io_->Unlink(hidden + "/metadata.json") != 0 && errno != ENOENT) {
      removed = ErrnoStatus("unlink", hidden + "/metadata.json");
    }
    if (removed.ok()) removed = RemoveTree(hidden);
    if (!removed.ok()) {
      Logger("catalog")->error("delete failed job={} step={} error=\"{}\"", job, step, removed.ToString());
      if (first_error.ok()) first_error = removed;
      continue;
    }
    Logger("catalog")->info("deleted job={} step={} reason={}", job, step, reason);
    out.deleted.push_back(step);
    ForgetKnown(job);
    if (listener_) listener_(CatalogChange::kDeleted, job, step, reason);
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
    // LATEST names the newest complete checkpoint left, or goes when none is left.
    Status latest;
    if (out.latest) {
      auto current = ReadSmallFile(JobDir(job) + "/LATEST", 64, io_);
      if (!current.ok() || *current != std::to_string(*out.latest) + "\n") {
        latest = WriteFileDurably(JobDir(job), "LATEST", std::to_string(*out.latest) + "\n", nullptr, io_);
      }
    } else if (io_->Unlink(JobDir(job) + "/LATEST") != 0 && errno != ENOENT) {
      latest = ErrnoStatus("unlink", JobDir(job) + "/LATEST");
    }
    if (!latest.ok() && first_error.ok()) first_error = latest;
    Status synced = FsyncDir(JobDir(job), io_);
    if (!synced.ok() && first_error.ok()) first_error = synced;
  }
  if (!first_error.ok()) return first_error;
  return out;
}

Result<std::optional<int64_t>> Catalog::LatestComplete(const std::string& job) const {
  ASSIGN_OR_RETURN(auto names, ListDirIfExists(JobDir(job), io_));
  std::optional<int64_t> best;
  if (!names) return best;
  // Newest first: the first complete one is the answer, and a newer one that cannot be told
  // complete or not is an error (taking an older step would restart from it and then overwrite
  // the newer checkpoint).
  std::vector<int64_t> steps;
  for (const auto& n : *names) {
    if (auto step = ParseCheckpointDirName(n)) steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end(), std::greater<>());
  for (int64_t step : steps) {
    ASSIGN_OR_RETURN(bool complete, IsComplete(job, step));
    if (complete) return std::optional<int64_t>(step);
  }
  return best;
}

Result<bool> Catalog::LatestNamesNewer(const std::string& job, int64_t step) const {
  ASSIGN_OR_RETURN(std::optional<int64_t> named, LatestNamed(job));
  if (!named || *named <= step) return false;  // missing, torn or older: replaced
  return IsComplete(job, *named);
}

Result<std::optional<int64_t>> Catalog::KnownLatest(const std::string& job,
                                                    std::chrono::steady_clock::duration max_age) const {
  const auto now = std::chrono::steady_clock::now();
  uint64_t notes = 0;
  {
    MutexLock lock(&known_mu_);
    Known& known = known_[job];  // from now on completions are noted, also during the first read
    if (known.read && now - known.read_at < max_age) return known.step;
    notes = known.notes;
  }
  ASSIGN_OR_RETURN(std::optional<int64_t> latest, LatestComplete(job));
  MutexLock lock(&known_mu_);
  Known& known = known_[job];
  // A completion noted while the root was being read may be newer than what the read found.
  const bool noted_meanwhile = known.notes != notes && known.step && (!latest || *known.step > *latest);
  if (!noted_meanwhile) known.step = latest;
  known.read = true;
  known.read_at = now;
  return known.step;
}

void Catalog::NoteCompleted(const std::string& job, int64_t step) {
  MutexLock lock(&known_mu_);
  auto it = known_.find(job);
  if (it == known_.end()) return;  // status has not asked: it reads the root when it first does
  if (!it->second.step || *it->second.step < step) it->second.step = step;
  it->second.notes += 1;
}

void Catalog::ForgetKnown(const std::string& job) {
  MutexLock lock(&known_mu_);
  known_.erase(job);
}

Result<std::vector<CheckpointInfo>> Catalog::List(const std::string& job) const {
  return ListCheckpoints(root_, job, io_);
}

}  // namespace flashckpt

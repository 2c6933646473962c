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

#include "daemon/pipeline/catalog.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
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

Result<bool> Catalog::IsCompleteShared(const std::string& job, int64_t step, std::chrono::milliseconds max_age) const {
  const auto now = std::chrono::steady_clock::now();
  const std::pair<std::string, int64_t> key{job, step};
  {
    MutexLock lock(&looked_mu_);
    auto it = looked_.find(key);
    if (it != looked_.end() && now - it->second.at < max_age) return it->second.complete;
  }
  ASSIGN_OR_RETURN(bool complete, IsComplete(job, step));  // no lock held across the stat
  NoteLook(job, step, now, complete);
  return complete;
}

void Catalog::NoteLook(const std::string& job, int64_t step, std::chrono::steady_clock::time_point at,
                       bool complete) const {
  const std::pair<std::string, int64_t> key{job, step};
  MutexLock lock(&looked_mu_);
  auto it = looked_.find(key);
  if (it != looked_.end()) {
    if (it->second.at <= at) it->second = Look{at, complete};  // never an older look over a newer one
    return;
  }
  if (looked_.size() >= kMaxLooks) {
    auto oldest = std::min_element(looked_.begin(), looked_.end(),
                                   [](const auto& a, const auto& b) { return a.second.at < b.second.at; });
    looked_.erase(oldest);
  }
  looked_.emplace(key, Look{at, complete});
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
  auto meta = Metadata(job, step);
  if (!meta.ok()) {
    if (meta.status().code() == StatusCode::kNotFound) return none;
    return meta.status();
  }
  return std::optional<RunCheckpoint>{RunCheckpoint{step, (*meta)->run_id}};
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
      auto meta = Metadata(job, step);
      if (!meta.ok()) {
        if (meta.status().code() == StatusCode::kNotFound) continue;  // deleted meanwhile
        return meta.status();
      }
      run = (*meta)->run_id;
    }
    if (skip_run.empty() || run != skip_run) return std::optional<RunCheckpoint>{RunCheckpoint{step, run}};
  }
  return std::optional<RunCheckpoint>();
}

Result<bool> Catalog::AllSignalsPresent(const std::string& dir, uint32_t world_size) const {
  auto names = ListDir(dir, io_);
  if (!names.ok()) {
    if (names.status().code() == StatusCode::kNotFound) return false;  // deleted meanwhile: not complete
    return names.status();
  }
  std::vector<uint32_t> listed;  // the ranks below world_size the listing shows, sorted
  for (const std::string& n : *names) {
    std::optional<uint32_t> rank = ParseSignalFileName(n);
    if (rank && *rank < world_size) listed.push_back(*rank);
  }
  std::sort(listed.begin(), listed.end());
  // A listing may lag behind a rename another client made (NFS caches directories): a rank it
  // misses is looked up by name, and the first one that is really not there ends the check.
  size_t next = 0;
  for (uint32_t r = 0; r < world_size; ++r) {
    if (next < listed.size() && listed[next] == r) {
      while (next < listed.size() && listed[next] == r) ++next;
      continue;
    }
    ASSIGN_OR_RETURN(bool there, Exists(dir + "/" + SignalFileName(r), io_));
    if (!there) return false;
  }
  return true;
}

bool Catalog::FewerSignalsThanRanks(const std::string& dir, const std::vector<std::string>& names) const {
  size_t signals = 0;
  const std::string* first = nullptr;
  for (const std::string& n : names) {
    if (!ParseSignalFileName(n)) continue;
    ++signals;
    if (first == nullptr) first = &n;
  }
  if (first == nullptr) return true;
  auto signal = ReadSignal(dir + "/" + *first, io_);
  // One that cannot be read, or does not say, is left to the full look that follows.
  return signal.ok() && signal->world_size != 0 && signals < signal->world_size;
}

Result<bool> Catalog::MaybeComplete(const std::string& job, int64_t step, uint32_t world_size, const Attempt& attempt,
                                    std::map<uint32_t, Signal>* mixed, ParallelLoop* loop) {
  using Steady = std::chrono::steady_clock;
  const Steady::time_point asked = Steady::now();
  MutexLock lock(&JobMutex(job));
  std::string dir = CheckpointDir(job, step);
  ASSIGN_OR_RETURN(bool complete, IsComplete(job, step));
  if (complete) return true;
  ASSIGN_OR_RETURN(bool all_there, AllSignalsPresent(dir, world_size));
  if (!all_there) return false;
  const Steady::time_point checked = Steady::now();
  std::vector<std::string> files;
  std::vector<SignalHeader> headers;
  std::map<uint32_t, Signal> all;
  bool one_attempt = true;
  int64_t last_signal_us = 0;
  // Read on the loop's threads when there is one: a job has thousands of signals, and on a network
  // file system each open and read waits for a round trip.
  std::vector<Result<Signal>> signals(world_size, Result<Signal>(Internal("not read")));
  auto read = [&](size_t r) { signals[r] = ReadSignal(dir + "/" + SignalFileName(static_cast<uint32_t>(r)), io_); };
  if (loop != nullptr) {
    loop->Run(world_size, read);
  } else {
    for (uint32_t r = 0; r < world_size; ++r) read(r);
  }
  for (uint32_t r = 0; r < world_size; ++r) {
    Result<Signal>& signal = signals[r];
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
    last_signal_us = std::max(last_signal_us, signal->written_us);
    for (auto& f : signal->files) files.push_back(std::move(f));
    signal->files.clear();
    for (auto& h : signal->headers) headers.push_back(std::move(h));
    signal->headers.clear();
    if (mixed != nullptr) all.emplace(r, std::move(*signal));  // its files and headers are in `files`, `headers`
  }
  if (!one_attempt) {
    *mixed = std::move(all);
    return false;
  }
  // The headers the signals record, by file: those files are not opened (docs/format.md).
  std::map<std::string, const SignalHeader*> recorded;
  for (const SignalHeader& h : headers) {
    auto [it, added] = recorded.emplace(h.file, &h);
    if (!added && (it->second->json != h.json || it->second->header_bytes != h.header_bytes ||
                   it->second->file_bytes != h.file_bytes)) {
      return Corruption(dir + ": the signals record two different headers of " + h.file);
    }
  }
  const Steady::time_point signals_read = Steady::now();
  ASSIGN_OR_RETURN(CheckpointMetadata meta, BuildMetadataFromFiles(dir, std::move(files), io_, loop, &recorded));
  const Steady::time_point built = Steady::now();
  meta.run_id = attempt.run_id;
  meta.resumed_from = attempt.resumed_from;
  if (meta.step != step || meta.job != job || meta.topology.world_size != world_size) {
    return Corruption(dir + ": files describe job '" + meta.job + "' step " + std::to_string(meta.step) +
                      " world size " + std::to_string(meta.topology.world_size) + ", expected '" + job + "' step " +
                      std::to_string(step) + " world size " + std::to_string(world_size));
  }
  RETURN_IF_ERROR(WriteMetadataFiles(dir, meta, io_));
  // LATEST moves forward unless it names a newer complete checkpoint. Only LATEST and that one
  // directory are read: a completion must not cost a listing of every step of a long run.
  ASSIGN_OR_RETURN(bool newer, LatestNamesNewer(job, step));
  if (!newer) RETURN_IF_ERROR(WriteFileDurably(JobDir(job), "LATEST", std::to_string(step) + "\n", nullptr, io_));
  // commit_ms: from the newest signal's write (by whichever daemon) to here, metadata.json and
  // LATEST durable; -1 when a signal does not record when it was written.
  const int64_t now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  auto ms = [](Steady::time_point a, Steady::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  const Steady::time_point written = Steady::now();
  // The parts of this call: waiting for the job's lock and looking (check_ms), reading the signals,
  // reading the files' headers into metadata, writing metadata.json and LATEST.
  Logger("catalog")->info(
      "complete job={} step={} files={} tensors={} commit_ms={:.3f} check_ms={:.3f} signals_ms={:.3f} "
      "headers_ms={:.3f} write_ms={:.3f}",
      job, step, meta.files.size(), meta.pieces.size(),
      last_signal_us > 0 ? static_cast<double>(now_us - last_signal_us) / 1000.0 : -1.0, ms(asked, checked),
      ms(checked, signals_read), ms(signals_read, built), ms(built, written));
  NoteCompleted(job, step);
  NoteLook(job, step, std::chrono::steady_clock::now(), true);  // waiters here know at once
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
    // A step still being written (or left short by a rank that died) is passed over for the
    // price of one signal read: the one that says how many ranks the step has.
    if (FewerSignalsThanRanks(dir, *files)) continue;
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

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
#include "common/format/node_part.h"
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

Result<bool> Catalog::IsCommitted(const std::string& job, int64_t step) const {
  ASSIGN_OR_RETURN(bool complete, IsComplete(job, step));
  if (!complete) return false;
  ASSIGN_OR_RETURN(std::optional<int64_t> named, LatestNamed(job));
  return named && *named >= step;
}

Result<bool> Catalog::IsCompleteShared(const std::string& job, int64_t step, std::chrono::milliseconds max_age) const {
  const auto now = std::chrono::steady_clock::now();
  const std::pair<std::string, int64_t> key{job, step};
  {
    MutexLock lock(&looked_mu_);
    auto it = looked_.find(key);
    if (it != looked_.end() && now - it->second.at < max_age) return it->second.complete;
  }
  ASSIGN_OR_RETURN(bool complete, IsCommitted(job, step));  // no lock held across the look
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

Result<bool> Catalog::AllSignalsPresent(const std::string& dir, uint32_t world_size,
                                        std::vector<std::string>* parts) const {
  auto names = ListDir(dir, io_);
  if (!names.ok()) {
    if (names.status().code() == StatusCode::kNotFound) return false;  // deleted meanwhile: not complete
    return names.status();
  }
  std::vector<uint32_t> listed;  // the ranks below world_size the listing shows, sorted
  for (const std::string& n : *names) {
    std::optional<uint32_t> rank = ParseSignalFileName(n);
    if (rank && *rank < world_size) listed.push_back(*rank);
    if (parts != nullptr && IsNodePartFileName(n)) parts->push_back(n);
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

std::vector<Result<Signal>> Catalog::ReadSignals(const std::string& dir, const std::vector<uint32_t>& ranks,
                                                 ParallelLoop* loop) const {
  // On the loop's threads when there is one: a job has thousands of signals, and on a network file
  // system each open and read waits for a round trip.
  std::vector<Result<Signal>> signals(ranks.size(), Result<Signal>(Internal("not read")));
  auto read = [&](size_t i) { signals[i] = ReadSignal(dir + "/" + SignalFileName(ranks[i]), io_); };
  if (loop != nullptr) {
    loop->Run(ranks.size(), read);
  } else {
    for (size_t i = 0; i < ranks.size(); ++i) read(i);
  }
  return signals;
}

std::map<uint32_t, std::shared_ptr<const RankPart>> Catalog::GatherParts(
    const std::string& dir, const std::string& job, int64_t step, uint32_t world_size, const Attempt& attempt,
    const std::vector<std::string>& part_names, ParallelLoop* loop) const {
  std::map<uint32_t, std::shared_ptr<const RankPart>> gathered = parts_.Held(job, step, attempt);
  // The other daemons' parts, read and parsed on the loop's threads (one round trip each).
  std::vector<std::string> others;
  for (const std::string& name : part_names) {
    if (name != parts_.file_name()) others.push_back(name);  // this daemon's: held already
  }
  std::vector<Result<NodePart>> read(others.size(), Result<NodePart>(Internal("not read")));
  auto read_one = [&](size_t i) {
    auto text = ReadSmallFile(dir + "/" + others[i], kMaxNodePartBytes, io_);
    read[i] = text.ok() ? ParseNodePart(*text) : Result<NodePart>(text.status());
  };
  if (loop != nullptr) {
    loop->Run(others.size(), read_one);
  } else {
    for (size_t i = 0; i < others.size(); ++i) read_one(i);
  }
  for (size_t i = 0; i < others.size(); ++i) {
    const std::string& name = others[i];
    Result<NodePart>& part = read[i];
    if (!part.ok()) {
      if (part.status().code() != StatusCode::kNotFound) {
        Logger("catalog")->warn("node part {}/{} left out ({}): its ranks' signals are read instead", dir, name,
                                part.status().ToString());
      }
      continue;
    }
    if (part->job != job || part->step != step || part->attempt != attempt) continue;  // another attempt's
    for (RankPart& r : part->ranks) {
      if (r.rank < world_size) gathered.emplace(r.rank, std::make_shared<const RankPart>(std::move(r)));
    }
  }
  // Each only while saved_signal_<rank> is the file it was made from (inode, size, modification and
  // change times): a signal written again since (another attempt, a node that took the rank over)
  // is read instead.
  std::vector<std::pair<uint32_t, const RankPart*>> check;
  check.reserve(gathered.size());
  for (const auto& [rank, part] : gathered) check.emplace_back(rank, part.get());
  std::vector<char> same(check.size(), 0);
  // In blocks of kBlock ranks on the loop's threads: an open is a round trip on a network file
  // system, and a few microseconds here, less than handing one to a thread.
  constexpr size_t kBlock = 64;
  auto look = [&](size_t block) {
    for (size_t i = block * kBlock; i < std::min(check.size(), (block + 1) * kBlock); ++i) {
      auto now = SignalIdentityOf(dir + "/" + SignalFileName(check[i].first), io_);
      same[i] = now.ok() && *now == check[i].second->signal ? 1 : 0;
    }
  };
  const size_t blocks = (check.size() + kBlock - 1) / kBlock;
  if (loop != nullptr) {
    loop->Run(blocks, look);
  } else {
    for (size_t b = 0; b < blocks; ++b) look(b);
  }
  for (size_t i = 0; i < check.size(); ++i) {
    if (!same[i]) gathered.erase(check[i].first);
  }
  return gathered;
}

Result<bool> Catalog::MaybeComplete(const std::string& job, int64_t step, uint32_t world_size, const Attempt& attempt,
                                    std::map<uint32_t, Signal>* mixed, ParallelLoop* loop) {
  using Steady = std::chrono::steady_clock;
  const Steady::time_point asked = Steady::now();
  MutexLock lock(&JobMutex(job));
  std::string dir = CheckpointDir(job, step);
  ASSIGN_OR_RETURN(bool complete, IsComplete(job, step));
  if (complete) return true;
  std::vector<std::string> part_names;
  ASSIGN_OR_RETURN(bool all_there, AllSignalsPresent(dir, world_size, &part_names));
  if (!all_there) return false;
  const Steady::time_point checked = Steady::now();
  // 1. The ranks whose files are rendered already (this daemon's, the other daemons' parts), then
  // the signals of the others.
  const std::map<uint32_t, std::shared_ptr<const RankPart>> gathered =
      GatherParts(dir, job, step, world_size, attempt, part_names, loop);
  const Steady::time_point parts_read = Steady::now();
  std::vector<uint32_t> unread;
  unread.reserve(world_size - std::min<size_t>(world_size, gathered.size()));
  for (uint32_t r = 0; r < world_size; ++r) {
    if (gathered.count(r) == 0) unread.push_back(r);
  }
  std::vector<Result<Signal>> signals = ReadSignals(dir, unread, loop);
  std::vector<std::string> files;
  std::vector<SignalHeader> headers;
  bool one_attempt = true;
  int64_t last_signal_us = 0;
  for (size_t i = 0; i < unread.size(); ++i) {
    Result<Signal>& signal = signals[i];
    if (!signal.ok()) {
      if (signal.status().code() == StatusCode::kNotFound) return false;  // not yet written
      return signal.status();  // unreadable or torn: an error, never "not complete"
    }
    if (signal->step != step || signal->rank != unread[i]) return false;
    if (signal->attempt() != attempt) one_attempt = false;
    last_signal_us = std::max(last_signal_us, signal->written_us);
  }
  if (!one_attempt) {
    if (mixed == nullptr) return false;
    // Every rank's signal, for `mixed`: the gathered ranks' too (no more reads than a completion).
    std::vector<uint32_t> rest;
    for (const auto& [rank, part] : gathered) rest.push_back(rank);
    std::vector<Result<Signal>> more = ReadSignals(dir, rest, loop);
    std::map<uint32_t, Signal> all;
    for (size_t i = 0; i < unread.size(); ++i) all.emplace(unread[i], std::move(*signals[i]));
    for (size_t i = 0; i < rest.size(); ++i) {
      if (!more[i].ok()) {
        if (more[i].status().code() == StatusCode::kNotFound) return false;
        return more[i].status();
      }
      if (more[i]->step != step || more[i]->rank != rest[i]) return false;
      all.emplace(rest[i], std::move(*more[i]));
    }
    *mixed = std::move(all);
    return false;
  }
  for (size_t i = 0; i < unread.size(); ++i) {
    for (auto& f : signals[i]->files) files.push_back(std::move(f));
    for (auto& h : signals[i]->headers) headers.push_back(std::move(h));
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
  ASSIGN_OR_RETURN(std::vector<RenderedFile> rendered, RenderFiles(dir, std::move(files), io_, loop, &recorded));
  std::vector<const RenderedFile*> all_files;
  all_files.reserve(rendered.size() + gathered.size() * 4);
  for (const RenderedFile& f : rendered) all_files.push_back(&f);
  for (const auto& [rank, part] : gathered) {
    last_signal_us = std::max(last_signal_us, part->written_us);
    for (const RenderedFile& f : part->files) all_files.push_back(&f);
  }
  CheckpointMetadata meta;
  meta.run_id = attempt.run_id;
  meta.resumed_from = attempt.resumed_from;
  ASSIGN_OR_RETURN(MetadataText text, MetadataTextOfRendered(dir, std::move(all_files), &meta));
  const Steady::time_point built = Steady::now();
  if (meta.step != step || meta.job != job || meta.topology.world_size != world_size) {
    return Corruption(dir + ": files describe job '" + meta.job + "' step " + std::to_string(meta.step) +
                      " world size " + std::to_string(meta.topology.world_size) + ", expected '" + job + "' step " +
                      std::to_string(step) + " world size " + std::to_string(world_size));
  }
  RETURN_IF_ERROR(WriteMetadataText(dir, text, io_));
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
  // The parts of this call: waiting for the job's lock and looking (check_ms), reading the node
  // parts and the other ranks' signals (signals_ms, of which parts_ms the parts and the stats of
  // their ranks' signals), rendering those ranks' headers and joining every rank's text into
  // metadata (headers_ms), writing metadata.json and LATEST.
  Logger("catalog")->info(
      "complete job={} step={} files={} parts_ranks={} commit_ms={:.3f} check_ms={:.3f} signals_ms={:.3f} "
      "headers_ms={:.3f} write_ms={:.3f} parts_ms={:.3f}",
      job, step, meta.files.size(), gathered.size(),
      last_signal_us > 0 ? static_cast<double>(now_us - last_signal_us) / 1000.0 : -1.0, ms(asked, checked),
      ms(checked, signals_read), ms(signals_read, built), ms(built, written), ms(checked, parts_read));
  parts_.Drop(job, step);
  for (const std::string& name : part_names) (void)io_->Unlink(dir + "/" + name);  // done with: best effort
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

Result<std::optional<size_t>> Catalog::RemoveUnlessComplete(const std::string& job, int64_t step,
                                                            const std::vector<std::string>& names) {
  MutexLock lock(&JobMutex(job));
  ASSIGN_OR_RETURN(bool complete, IsComplete(job, step));
  if (complete) return std::optional<size_t>();
  const std::string dir = CheckpointDir(job, step);
  size_t removed = 0;
  Status failed;
  for (const std::string& name : names) {
    if (io_->Unlink(dir + "/" + name) == 0) {
      ++removed;
    } else if (errno != ENOENT) {
      // The rest stay: a file that is listed by a signal still there must not go before it.
      failed = ErrnoStatus("unlink", dir + "/" + name);
      break;
    }
  }
  (void)FsyncDir(dir, io_);  // best effort: the removals need not be durable to be correct
  RETURN_IF_ERROR(failed);
  return std::optional<size_t>(removed);
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

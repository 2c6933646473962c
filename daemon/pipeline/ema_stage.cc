#include "daemon/pipeline/ema_stage.h"

#include "common/base/log.h"
#include "common/io/shm.h"

namespace flashckpt {

EmaStage::EmaStage(EmaStageOptions options, Done done)
    : threads_(std::max(1u, options.threads)),
      copy_timeout_(options.copy_timeout),
      keep_memory_on_stop_(options.keep_memory_on_stop),
      clock_(options.clock != nullptr ? *options.clock : Clock::Real()),
      writer_(options.writer),
      on_event_(std::move(options.on_event)),
      done_(std::move(done)) {}

EmaStage::~EmaStage() { Stop(); }

Status EmaStage::Start() {
  if (thread_.joinable()) return Status::OK();
  loop_ = std::make_unique<ParallelLoop>(threads_ - 1);
  thread_ = std::thread([this] { Run(); });
  return Status::OK();
}

void EmaStage::Submit(EmaJob job) {
  MutexLock lock(&mu_);
  queued_[job.segment.get()] += 1;
  queue_.push_back(std::move(job));
  cv_.NotifyAll();
}

bool EmaStage::WaitDrained(const RankSegment* segment, std::chrono::steady_clock::time_point deadline,
                           uint32_t* queued) {
  MutexLock lock(&mu_);
  while (queued_.count(segment) != 0 && clock_.WaitUntil(&drained_cv_, &lock, deadline)) {
  }
  auto it = queued_.find(segment);
  if (queued != nullptr) *queued = it == queued_.end() ? 0 : it->second;
  return it == queued_.end();
}

std::vector<EmaJob> EmaStage::Stop(std::chrono::steady_clock::time_point deadline) {
  {
    MutexLock lock(&mu_);
    if (!stopping_) {
      deadline_ = deadline;
      const auto now = clock_.Now();
      if (deadline != std::chrono::steady_clock::time_point::max()) memory_cutoff_ = now + (deadline - now) / 2;
    }
    stopping_ = true;
    cv_.NotifyAll();
  }
  if (thread_.joinable()) thread_.join();
  MutexLock lock(&mu_);
  std::vector<EmaJob> left(std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.end()));
  queue_.clear();
  queued_.clear();
  drained_cv_.NotifyAll();
  return left;
}

bool EmaStage::Stopping() {
  MutexLock lock(&mu_);
  return stopping_;
}

bool EmaStage::PastDeadline() {
  MutexLock lock(&mu_);
  return stopping_ && clock_.Now() >= deadline_;
}

bool EmaStage::PastMemoryCutoff() {
  MutexLock lock(&mu_);
  return stopping_ && clock_.Now() >= memory_cutoff_;
}

void EmaStage::Run() {
  for (;;) {
    EmaJob job;
    {
      MutexLock lock(&mu_);
      while (!stopping_ && queue_.empty()) cv_.Wait(&lock);
      if (queue_.empty()) return;  // stopping, and everything committed has been applied
      if (stopping_ && clock_.Now() >= deadline_) return;  // Stop abandons the rest
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    const RankSegment* segment = job.segment.get();
    if (!Work(job)) {
      MutexLock lock(&mu_);
      queue_.push_front(std::move(job));
      return;
    }
    HandOn(std::move(job));
    MutexLock lock(&mu_);
    if (auto it = queued_.find(segment); it != queued_.end() && --it->second == 0) queued_.erase(it);
    drained_cv_.NotifyAll();
  }
}

bool EmaStage::Work(EmaJob& job) {
  const auto start = clock_.Now();
  // A streaming commit: the EMA reads the whole slot, so it waits for the trainer's copies. If
  // they fail, the update is skipped (and the writer fails the save for the same reason).
  // A memory checkpoint dropped while queued is not waited for nor checksummed; nor is one reached
  // while the daemon stops, unless the stop writes memory checkpoints (keep_memory_on_stop), and
  // then only until the first half of the stop's time has passed: it would not outlive the daemon
  // otherwise, and a stalled trainer must not take the time the stop's writes need.
  // (A disk snapshot that is also to stay in memory, job.persist, is written whatever happens to its
  // checksums.)
  auto skip_sums = [&] {
    if (!job.resident) return false;
    if (job.resident->dropped.load()) return true;
    if (!Stopping()) return false;
    return job.persist || !keep_memory_on_stop_ || PastMemoryCutoff();
  };
  auto skip_memory = [&] { return job.resident && !job.persist && job.ema == nullptr && skip_sums(); };
  auto& header = *reinterpret_cast<SlotHeader*>(job.slot);
  // A disk snapshot whose checksums are no longer wanted (its trainer died mid-copy, or the daemon
  // stops) is handed on at once as well: the writer waits for its copies itself, and one dead
  // trainer must not hold up every rank's snapshots here for the copy timeout.
  Status copied = skip_memory() ? Status::OK()
                                : WaitSlotCopied(header, job.layout->slot_bytes, copy_timeout_,
                                                 [&] { return PastDeadline() || skip_sums(); });
  // The stop deadline passed while the copies were still coming: Stop abandons it with the rest.
  if (copied.code() == StatusCode::kCancelled && PastDeadline()) return false;
  bool applied = false, summed = false;
  if (copied.ok()) {
    if (job.ema != nullptr) {
      applied = job.ema->Apply(*job.layout, job.slot, job.step, job.loss, job.ema_image, loop_.get(), job.replay);
    }
    if (job.resident && !skip_sums()) {
      job.resident->sums = ComputeSlotChecksums(job.slot, *job.layout, loop_.get());
      if (job.ema != nullptr && job.ema_image != nullptr) {
        // The EMA as of this step, stamped into the slot's EMA room by Apply: it stays with the
        // memory checkpoint (this stage is the EMA's only writer, so state() is Apply's).
        job.resident->ema = job.ema->state();
        job.resident->ema_sums = ComputeSlotChecksums(job.ema_image, job.ema->plan().layout, loop_.get());
      }
      summed = true;
    }
  } else if (copied.code() != StatusCode::kCancelled) {  // cancelled: dropped while its copies were coming
    Logger("ema")->error("ema update skipped job={} rank={} step={} error=\"{}\"", job.job, job.rank, job.step,
                         copied.ToString());
  }
  if (job.resident && !summed) job.resident->dropped.store(true);  // not kept: no checksums to verify it by
  // Done with this hand-out: a restarted daemon neither applies it again nor stamps its EMA image anew.
  header.ema_done.store(job.ticket.generation, std::memory_order_release);
  const double secs = std::chrono::duration<double>(clock_.Now() - start).count();
  Logger("ema")->debug("ema job={} rank={} step={} applied={} secs={:.4f}", job.job, job.rank, job.step, applied,
                       secs);
  if (applied && on_event_) {
    DaemonEvent event;
    event.kind = DaemonEvent::Kind::kEmaUpdated;
    event.job = job.job;
    event.rank = job.rank;
    event.step = job.step;
    event.seconds = secs;
    on_event_(std::move(event));
  }
  return true;
}

void EmaStage::HandOn(EmaJob job) {
  if (!job.persist) {
    done_(std::move(job));
    return;
  }
  auto done = job.request.done;
  Status submitted = writer_ != nullptr ? writer_->Submit(std::move(job.request))
                                        : FailedPrecondition("the EMA stage has no writer");
  if (!submitted.ok()) {
    Logger("writer")->error("persist not queued job={} step={} rank={} error=\"{}\"", job.job, job.step, job.rank,
                            submitted.ToString());
    if (done) done(submitted, 0, 0.0);
  }
}

}  // namespace flashckpt

// The EMA stage: one thread that applies committed snapshots to their rank's EMA (daemon/pipeline/ema.h),
// in commit order, with a pool of helper threads for the arithmetic, and computes the checksums of
// memory checkpoints (daemon/core/slots.h) the same way, off the trainer's path. What to do with a
// snapshot once done (hand it to the writer, keep it, free its slot) is the daemon's: the stage
// calls it back.
//
//   SavePath::Commit --Submit--> [queue] --thread: wait for the slot's copies, RankEma::Apply (EMA
//                                        ranks), ComputeSlotChecksums (memory checkpoints)--> done()
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/base/clock.h"
#include "common/base/mutex.h"
#include "common/base/thread_pool.h"
#include "common/format/layout.h"
#include "daemon/pipeline/ema.h"
#include "daemon/pipeline/snapshot.h"
#include "daemon/pipeline/writer.h"

namespace flashckpt {

class RankSegment;  // the core's (daemon/core/segment.h): held for the owner, never read here

// A committed snapshot on its way through the EMA stage (and, when `persist`, to the writer).
struct EmaJob {
  // What the stage reads and writes (set by the owner: PointEmaJobAt, daemon/core/segment.h): the
  // slot, laid out as `layout` (its SlotHeader first); the rank's EMA (null: none); with persist
  // and an EMA, where the step's EMA image goes in the slot.
  const RankLayout* layout = nullptr;
  char* slot = nullptr;
  RankEma* ema = nullptr;
  char* ema_image = nullptr;
  // The owner's: the segment holding the slot (kept alive while the job is queued) and the slot.
  std::shared_ptr<RankSegment> segment;
  SlotTicket ticket;
  int64_t step = 0;
  std::optional<double> loss;
  bool persist = false;
  PersistRequest request;  // when persist
  std::string job;
  uint32_t rank = 0;
  bool replay = false;  // adopted after a restart: the EMA may already have seen the step
  // A memory checkpoint: the stage fills in its checksums and sets `resident_ok` once they are
  // computed over the trainer's finished copies.
  std::shared_ptr<ResidentCheckpoint> resident;
  bool resident_ok = false;
};

// The EMA stage's part of DaemonConfig.
struct EmaStageOptions {
  // Threads in all that work on one update (the stage's thread and threads - 1 helpers).
  unsigned threads = 1;
  // How long a streaming commit's copies may keep the stage waiting.
  std::chrono::milliseconds copy_timeout{120000};
  const Clock* clock = &Clock::Real();  // the stop's deadline is of this clock
};

class EmaStage {
 public:
  // Called on the stage's thread with no lock of the stage held, once per job, in order:
  // `applied` says whether the EMA changed (false: not due, gated by the loss, or the trainer's
  // copies into the slot failed, which is logged), `seconds` how long the job took.
  using Done = std::function<void(EmaJob job, bool applied, double seconds)>;

  EmaStage(EmaStageOptions options, Done done);
  ~EmaStage();  // Stop()
  EmaStage(const EmaStage&) = delete;
  EmaStage& operator=(const EmaStage&) = delete;

  // Starts the stage's thread and its helpers.
  Status Start();
  // Queues a job behind those already committed. Never blocks: the queue is bounded by the slots
  // in COMMITTED. Requires Start; jobs submitted after Stop are returned by no one (callers stop
  // submitting first).
  void Submit(EmaJob job) EXCLUDES(mu_);
  // Applies what is queued until `deadline`, then joins the thread and returns the jobs it did not
  // reach (in order), for the caller to abandon. Idempotent: a second call returns nothing.
  std::vector<EmaJob> Stop(std::chrono::steady_clock::time_point deadline =
                               std::chrono::steady_clock::time_point::max()) EXCLUDES(mu_);

 private:
  void Run() EXCLUDES(mu_);
  bool PastDeadline() EXCLUDES(mu_);
  bool Stopping() EXCLUDES(mu_);

  const unsigned threads_;
  const std::chrono::milliseconds copy_timeout_;
  const Clock& clock_;
  const Done done_;
  std::unique_ptr<ParallelLoop> loop_;  // used by the stage's thread only
  std::thread thread_;

  Mutex mu_;
  CondVar cv_;                       // a job queued, or stopping
  std::deque<EmaJob> queue_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point deadline_ GUARDED_BY(mu_) = std::chrono::steady_clock::time_point::max();
};

}  // namespace flashckpt

// The EMA stage: one thread that applies committed snapshots to their rank's EMA (daemon/pipeline/ema.h),
// in commit order, with a pool of helper threads for the arithmetic, and computes the checksums of
// memory checkpoints (daemon/core/slots.h) the same way, off the trainer's path. A persisted
// snapshot goes on to the writer from here; one that is not (an EMA-only snapshot, a memory
// checkpoint) ends here, and the stage reports it to its owner. Either way the owner hears of each
// snapshot once: from the writer's `done` or from the stage's.
//
//   SavePath::Commit --Submit--> [queue] --thread: wait for the slot's copies, RankEma::Apply (EMA
//       ranks), ComputeSlotChecksums (memory checkpoints), mark the slot's SlotHeader::ema_done-->
//       persisted: Writer::Submit (its `done` reports)   otherwise: done()
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
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
#include "flashckpt/daemon_types.h"

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
  // A memory checkpoint (or, with persist, a disk snapshot to keep as one once written): the stage
  // fills in its checksums over the trainer's finished copies, or, when it cannot (the copies
  // failed, it was dropped, the daemon stops without keep_memory_on_stop), marks it dropped: not to
  // be kept.
  std::shared_ptr<ResidentCheckpoint> resident;
};

// The EMA stage's part of DaemonConfig.
struct EmaStageOptions {
  // Threads in all that work on one update (the stage's thread and threads - 1 helpers).
  unsigned threads = 1;
  // How long a streaming commit's copies may keep the stage waiting.
  std::chrono::milliseconds copy_timeout{120000};
  const Clock* clock = &Clock::Real();  // the stop's deadline is of this clock
  // Where persisted snapshots go next (not owned; outlives the stage, which stops first).
  Writer* writer = nullptr;
  // The daemon writes its newest memory checkpoints at the stop (--persist-on-stop): a memory
  // checkpoint reached while it stops is still checksummed and kept, so that the stop writes it
  // rather than the one before, if its copies come within the first half of the stop's time (the
  // rest is the writes'); past that it is dropped, and the stop writes the step before. Without
  // this option such a checkpoint would not outlive the daemon, and is dropped at once, as a disk
  // snapshot's checksums for staying in memory are at any stop.
  bool keep_memory_on_stop = false;
  // Each EMA update applied (kEmaUpdated, with how long the job took); may be empty.
  std::function<void(DaemonEvent)> on_event;
};

class EmaStage {
 public:
  // Called on the stage's thread with no lock of the stage held, in commit order, once for each job
  // that is not persisted, when the stage is done with it. A persisted job goes to the writer
  // instead; if the writer refuses it (its queue full), its request's `done` runs with that error.
  using Done = std::function<void(EmaJob job)>;

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
  // Waits until no job of `segment` (EmaJob::segment) is queued or being worked on, or until
  // `deadline` (of the options' clock); false when some still are. `queued`: how many.
  bool WaitDrained(const RankSegment* segment, std::chrono::steady_clock::time_point deadline,
                   uint32_t* queued) EXCLUDES(mu_);

 private:
  void Run() EXCLUDES(mu_);
  // The work on one job; false when the stop's deadline passed while its copies were still
  // coming (Stop abandons it).
  bool Work(EmaJob& job) EXCLUDES(mu_);
  // Hands a job the stage is done with to the writer or to `done_`.
  void HandOn(EmaJob job);
  bool PastDeadline() EXCLUDES(mu_);
  // Stopping, and past the first half of the stop's time: a memory checkpoint's copies are no
  // longer waited for (keep_memory_on_stop).
  bool PastMemoryCutoff() EXCLUDES(mu_);
  bool Stopping() EXCLUDES(mu_);

  const unsigned threads_;
  const std::chrono::milliseconds copy_timeout_;
  const bool keep_memory_on_stop_;
  const Clock& clock_;
  Writer* const writer_;
  const std::function<void(DaemonEvent)> on_event_;
  const Done done_;
  std::unique_ptr<ParallelLoop> loop_;  // used by the stage's thread only
  std::thread thread_;

  Mutex mu_;
  CondVar cv_;                       // a job queued, or stopping
  CondVar drained_cv_;               // a job done with
  std::deque<EmaJob> queue_ GUARDED_BY(mu_);
  std::map<const RankSegment*, uint32_t> queued_ GUARDED_BY(mu_);  // jobs submitted, not yet done with
  bool stopping_ GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point deadline_ GUARDED_BY(mu_) = std::chrono::steady_clock::time_point::max();
  std::chrono::steady_clock::time_point memory_cutoff_ GUARDED_BY(mu_) = std::chrono::steady_clock::time_point::max();
};

}  // namespace flashckpt

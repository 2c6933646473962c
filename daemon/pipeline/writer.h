// The background writer: a fixed pool of threads that turns committed slots into durable files.
//
// For each job it writes the slot's file images with several writes in flight (WriteImagesDurably:
// each tensor hashed and written a piece at a time, the headers with the step and checksums last,
// then fdatasync, rename, fsync dir), writes the trainer's extra state and then saved_signal_<rank>,
// and asks the catalog whether the checkpoint is now complete.
// The slot is owned by the writer while PERSISTING; no lock is held during I/O. Every write,
// fdatasync, rename and directory fsync of those files goes through the writer's IoEnv
// (common/io/io_env.h): the real OS, or in tests one that injects faults.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/base/clock.h"
#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/base/thread_pool.h"
#include "common/format/layout.h"
#include "common/io/io_env.h"
#include "common/io/shm.h"
#include "daemon/pipeline/catalog.h"

namespace flashckpt {

struct PersistRequest {
  std::string job;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::string node;  // the daemon's --node-name, recorded in the signal
  int64_t step = 0;
  Attempt attempt;                         // the run and the step this rank's session resumed from
  int64_t committed_ms = 0;                // when the trainer committed it (wall clock; 0: not known)
  const RankLayout* layout = nullptr;      // kept alive by `keep_alive`
  char* slot = nullptr;                    // the slot's first byte
  const RankLayout* ema_layout = nullptr;  // with EMA: its image, already stamped, lies at
  char* ema_base = nullptr;                // ema_base + ema_layout->files[0].slot_offset
  std::string extra;
  std::shared_ptr<void> keep_alive;  // owns the segment while the write runs
  // The slot's header, when the trainer may still be copying into the slot (a streaming commit):
  // each piece is hashed and written once its bytes are in place (SlotHeader::copied_until),
  // waiting at most `copy_timeout` for each. Null: the slot is complete.
  const SlotHeader* header = nullptr;
  std::chrono::milliseconds copy_timeout{120000};
  // Whether this daemon holds every rank of the job (world_size of them registered here): then no
  // other daemon can complete the step, and a failed attempt's files may go even after its signal
  // was put in place (Writer::DisposeAttemptFiles).
  bool sole_writer = false;
  // Called on a writer thread, before `done`, when this rank's signal was the step's last one
  // missing but the signals are of several attempts (Catalog::MaybeComplete's `mixed`).
  std::function<void(const std::map<uint32_t, Signal>& signals)> mixed;
  // Called on a writer thread with the outcome and the bytes written.
  std::function<void(const Status&, uint64_t bytes, double seconds)> done;
};

// A persist a writer thread is working on (not one still queued).
struct WriteInFlight {
  std::string job;
  uint32_t rank = 0;
  int64_t step = 0;
  std::chrono::steady_clock::time_point started;
};

// The writer's part of DaemonConfig.
struct WriterOptions {
  unsigned threads = 2;          // each persists one request at a time
  size_t queue_capacity = 4096;  // requests queued, not yet taken by a thread
  unsigned io_threads = 4;       // writes in flight per thread
  IoEnv* env = IoEnv::Default();  // the file-system calls (not owned; must outlive the writer)
  const Clock* clock = &Clock::Real();  // the stop's deadline is of this clock
};

class Writer {
 public:
  Writer(Catalog* catalog, WriterOptions options);
  ~Writer();  // Stop()
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // Starts the threads. Submit queues before Start; Persist works without it.
  Status Start();
  // Queues a request; kResourceExhausted when the queue is full, kUnavailable once stopped.
  Status Submit(PersistRequest request) EXCLUDES(mu_);
  // Finishes every queued request, then joins the threads. Idempotent.
  void Stop() { Stop(std::chrono::steady_clock::time_point::max()); }
  // The same until `deadline`; then it abandons what is left: the persists being written stop at
  // their next write or rename (CancellableIo), remove their temporaries and the files they had
  // renamed (never their signal once it is in place: a persist whose signal is written is
  // finished), and the queued ones are not started. The `done` of each abandoned request runs with
  // kCancelled (after Stop returns, every `done` has run).
  void Stop(std::chrono::steady_clock::time_point deadline) EXCLUDES(mu_);
  // The persists being written now, each with when its thread took it; it leaves the list before
  // its `done` runs. Thread-safe; takes the writer's lock only, so a caller may hold its own.
  std::vector<WriteInFlight> InFlight() const EXCLUDES(mu_);

  // The work itself, also usable synchronously (tests). Returns bytes written. On failure (a full
  // disk, an I/O error) the files this attempt wrote for the step are removed again (saved_signal
  // first), unless the checkpoint became complete; other steps are never touched. kCancelled: the
  // write was abandoned by Stop(deadline), and cleaned up the same way.
  // `io` (nullptr: the caller's thread only) runs the writes.
  Result<uint64_t> Persist(const PersistRequest& request, ParallelLoop* io = nullptr) {
    return PersistOne(request, io, /*queued=*/false);
  }

 private:
  void Run() EXCLUDES(mu_);
  // Persist; `queued`: the request came through Submit and is counted in pending_.
  Result<uint64_t> PersistOne(const PersistRequest& request, ParallelLoop* io, bool queued) EXCLUDES(mu_);
  // A completion check a persist owes after its signal: of its attempt and world size, with its
  // callback for a step whose signals are of several attempts.
  struct Check {
    Attempt attempt;
    uint32_t world_size = 0;
    std::function<void(const std::map<uint32_t, Signal>& signals)> mixed;
  };
  // Takes a queued request out of pending_ once its signal is written (`wrote`) or its write
  // failed, and returns the completion checks to run now. While another persist of the same job
  // and step is queued or being written here, a written signal's check is deferred to the entry
  // (that persist's signal is needed too); the persist that leaves the entry empty runs every
  // deferred check, whether its own write worked or not, and of whichever attempt. So a daemon's
  // ranks that save a step together cost the catalog one completion check, not one each, and no
  // written signal goes unchecked.
  std::vector<Check> LeavePending(const PersistRequest& request, bool wrote) EXCLUDES(mu_);
  std::vector<Check> LeavePendingLocked(const PersistRequest& request, bool wrote) REQUIRES(mu_);
  // What a failed attempt does with the files it put under their final names (`written`, in the
  // order written, the signal last), and what its error says of them. Before the signal is in
  // place no daemon counts them: they are removed, newest first. Once it is, a daemon writing the
  // step's last signal may be building metadata.json from them: they are removed only when this
  // daemon holds every rank (`sole_writer`; the job's lock keeps its own completion out), and kept
  // otherwise, for another daemon's completion or the sweep. A complete step's files always stay.
  std::string DisposeAttemptFiles(const PersistRequest& request, const std::vector<std::string>& written);
  // Writes the rank's files and then its signal; `written` collects the names now in place, and
  // `signal` receives the signal written.
  Status WriteRankFiles(const PersistRequest& request, const std::string& dir, ParallelLoop* io,
                        std::vector<std::string>* written, uint64_t* bytes, Signal* signal);

  Catalog* catalog_;
  const unsigned threads_count_;
  const size_t capacity_;
  const unsigned io_threads_;
  const Clock& clock_;
  CancellableIo env_;  // the IoEnv given, until the stop timeout cancels it
  mutable Mutex mu_;
  CondVar cv_;                                                 // work queued, or stopping
  CondVar idle_cv_;                                            // a persist finished
  std::deque<PersistRequest> queue_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  std::map<uint64_t, WriteInFlight> in_flight_ GUARDED_BY(mu_);  // by a counter of taken requests
  // Submitted requests whose signal is not written yet, per job and step, and the checks deferred
  // until none is left (LeavePending).
  struct Pending {
    size_t count = 0;
    std::vector<Check> deferred;  // one per attempt
  };
  std::map<std::pair<std::string, int64_t>, Pending> pending_ GUARDED_BY(mu_);
  uint64_t taken_ GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_;
};

}  // namespace flashckpt

// The background writer: a fixed pool of threads that turns committed slots into durable files.
//
// For each job it writes the slot's file images with several writes in flight (WriteImagesDurably:
// each tensor hashed and written a piece at a time, the headers with the step and checksums last,
// then fdatasync, rename, fsync dir), writes the trainer's extra state and then saved_signal_<rank>,
// and asks the catalog whether the checkpoint is now complete.
// The slot is owned by the writer while PERSISTING; no lock is held during I/O.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/layout.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "daemon/catalog.h"

namespace flashckpt {

struct PersistRequest {
  std::string job;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  int64_t step = 0;
  int64_t resumed_from = 0;                // the attempt: step this rank's session resumed from, 0 if fresh
  const RankLayout* layout = nullptr;      // kept alive by `keep_alive`
  char* slot = nullptr;                    // the slot's first byte
  const RankLayout* ema_layout = nullptr;  // with EMA: its image, already stamped, lies at
  char* ema_base = nullptr;                // ema_base + ema_layout->files[0].slot_offset
  std::string extra;
  std::shared_ptr<void> keep_alive;  // owns the segment while the write runs
  // Called on a writer thread with the outcome and the bytes written.
  std::function<void(const Status&, uint64_t bytes, double seconds)> done;
};

class Writer {
 public:
  // Each of `threads` persists one request at a time with `io_threads` writes in flight.
  Writer(Catalog* catalog, unsigned threads, size_t queue_capacity, unsigned io_threads = 4);
  ~Writer();  // Stop()

  // Queues a request; kResourceExhausted when the queue is full, kUnavailable once stopped.
  Status Submit(PersistRequest request);
  // Finishes every queued request, then joins the threads. Idempotent.
  void Stop();

  // The work itself, also usable synchronously (tests). Returns bytes written. On failure (a full
  // disk, an I/O error) the files this attempt wrote for the step are removed again (saved_signal
  // first), unless the checkpoint became complete; other steps are never touched.
  // `io` (nullptr: the caller's thread only) runs the writes.
  Result<uint64_t> Persist(const PersistRequest& request, ParallelLoop* io = nullptr);

 private:
  void Run();
  // Writes the rank's files and then its signal; `written` collects the names now in place.
  Status WriteRankFiles(const PersistRequest& request, const std::string& dir, ParallelLoop* io,
                        std::vector<std::string>* written, uint64_t* bytes);

  Catalog* catalog_;
  size_t capacity_;
  unsigned io_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<PersistRequest> queue_;  // guarded by mu_
  bool stopping_ = false;             // guarded by mu_
  std::vector<std::thread> threads_;
};

// The content of extra.rankNNNNN.json for `extra` (embedded when it is JSON, base64 otherwise),
// and back.
std::string EncodeExtra(const std::string& job, uint32_t rank, int64_t step, const std::string& extra);
Result<std::string> DecodeExtra(const std::string& file_contents);

}  // namespace flashckpt

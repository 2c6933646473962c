// Copies large host buffers with several threads. The threads are started once per client and
// sleep between calls; a copy below the split threshold runs on the calling thread alone.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

namespace flashckpt {

struct CopyTask {
  void* dst;
  const void* src;
  size_t bytes;
};

class CopyPool {
 public:
  // `threads` helpers besides the caller; 0 copies on the caller only.
  explicit CopyPool(unsigned threads);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  // Performs every task; returns when all bytes are copied. Not reentrant: one caller at a time.
  void Run(const std::vector<CopyTask>& tasks);

 private:
  void Worker();
  bool TakeChunk(CopyTask* out);  // requires mu_

  static constexpr size_t kChunk = 16u << 20;

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  const std::vector<CopyTask>* tasks_ = nullptr;  // guarded by mu_
  size_t next_task_ = 0, next_offset_ = 0;        // guarded by mu_: the next chunk to hand out
  size_t active_ = 0;                             // guarded by mu_: chunks being copied
  bool stop_ = false;                             // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace flashckpt

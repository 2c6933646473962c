// A fixed set of threads that run the chunks of one parallel loop at a time. The caller takes
// part, so a pool of N threads runs a loop on N + 1 threads. Threads start once and sleep between
// loops: no thread creation or allocation per loop.
#pragma once

#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

#include "common/base/mutex.h"

namespace flashckpt {

class ParallelLoop {
 public:
  explicit ParallelLoop(unsigned helper_threads);
  ~ParallelLoop();
  ParallelLoop(const ParallelLoop&) = delete;
  ParallelLoop& operator=(const ParallelLoop&) = delete;

  unsigned threads() const { return static_cast<unsigned>(threads_.size()) + 1; }
  // Calls body(i) for every i in [0, count), each exactly once, spread over the threads; returns
  // when all calls have returned. One loop at a time: callers serialize.
  void Run(size_t count, const std::function<void(size_t)>& body) EXCLUDES(mu_);

 private:
  void Worker() EXCLUDES(mu_);

  Mutex mu_;
  CondVar work_cv_, done_cv_;
  const std::function<void(size_t)>* body_ GUARDED_BY(mu_) = nullptr;
  size_t next_ GUARDED_BY(mu_) = 0;
  size_t count_ GUARDED_BY(mu_) = 0;
  size_t active_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace flashckpt

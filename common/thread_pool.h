// A fixed set of threads that run the chunks of one parallel loop at a time. The caller takes
// part, so a pool of N threads runs a loop on N + 1 threads. Threads start once and sleep between
// loops: no thread creation or allocation per loop.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

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
  void Run(size_t count, const std::function<void(size_t)>& body);

 private:
  void Worker();

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  const std::function<void(size_t)>* body_ = nullptr;  // guarded by mu_
  size_t next_ = 0, count_ = 0, active_ = 0;           // guarded by mu_
  bool stop_ = false;                                  // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace flashckpt

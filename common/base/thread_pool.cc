#include "common/base/thread_pool.h"

namespace flashckpt {

ParallelLoop::ParallelLoop(unsigned helper_threads) {
  for (unsigned i = 0; i < helper_threads; ++i) threads_.emplace_back([this] { Worker(); });
}

ParallelLoop::~ParallelLoop() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  work_cv_.NotifyAll();
  for (auto& t : threads_) t.join();
}

void ParallelLoop::Worker() {
  MutexLock lock(&mu_);
  for (;;) {
    while (!stop_ && !(body_ != nullptr && next_ < count_)) work_cv_.Wait(&lock);
    if (stop_) return;
    while (body_ != nullptr && next_ < count_) {
      size_t i = next_++;
      ++active_;
      const auto* body = body_;
      lock.Unlock();
      (*body)(i);
      lock.Lock();
      if (--active_ == 0 && next_ >= count_) done_cv_.NotifyAll();
    }
  }
}

void ParallelLoop::Run(size_t count, const std::function<void(size_t)>& body) {
  if (count == 0) return;
  if (threads_.empty() || count == 1) {
    for (size_t i = 0; i < count; ++i) body(i);
    return;
  }
  MutexLock lock(&mu_);
  body_ = &body;
  next_ = 0;
  count_ = count;
  work_cv_.NotifyAll();
  while (next_ < count_) {
    size_t i = next_++;
    ++active_;
    lock.Unlock();
    body(i);
    lock.Lock();
    --active_;
  }
  while (active_ != 0) done_cv_.Wait(&lock);
  body_ = nullptr;
}

}  // namespace flashckpt

#include "common/thread_pool.h"

namespace flashckpt {

ParallelLoop::ParallelLoop(unsigned helper_threads) {
  for (unsigned i = 0; i < helper_threads; ++i) threads_.emplace_back([this] { Worker(); });
}

ParallelLoop::~ParallelLoop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ParallelLoop::Worker() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || (body_ != nullptr && next_ < count_); });
    if (stop_) return;
    while (body_ != nullptr && next_ < count_) {
      size_t i = next_++;
      ++active_;
      const auto* body = body_;
      lock.unlock();
      (*body)(i);
      lock.lock();
      if (--active_ == 0 && next_ >= count_) done_cv_.notify_all();
    }
  }
}

void ParallelLoop::Run(size_t count, const std::function<void(size_t)>& body) {
  if (count == 0) return;
  if (threads_.empty() || count == 1) {
    for (size_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  body_ = &body;
  next_ = 0;
  count_ = count;
  work_cv_.notify_all();
  while (next_ < count_) {
    size_t i = next_++;
    ++active_;
    lock.unlock();
    body(i);
    lock.lock();
    --active_;
  }
  done_cv_.wait(lock, [&] { return active_ == 0; });
  body_ = nullptr;
}

}  // namespace flashckpt

#include "client/src/copy_pool.h"

#include <cstring>

namespace flashckpt {

CopyPool::CopyPool(unsigned threads) {
  for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this] { Worker(); });
}

CopyPool::~CopyPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

bool CopyPool::TakeChunk(CopyTask* out) {
  while (tasks_ != nullptr && next_task_ < tasks_->size()) {
    const CopyTask& t = (*tasks_)[next_task_];
    if (next_offset_ >= t.bytes) {
      ++next_task_;
      next_offset_ = 0;
      continue;
    }
    size_t n = std::min(kChunk, t.bytes - next_offset_);
    *out = CopyTask{static_cast<char*>(t.dst) + next_offset_, static_cast<const char*>(t.src) + next_offset_, n};
    next_offset_ += n;
    ++active_;
    return true;
  }
  return false;
}

void CopyPool::Worker() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || (tasks_ != nullptr && next_task_ < tasks_->size()); });
    if (stop_) return;
    CopyTask chunk;
    while (TakeChunk(&chunk)) {
      lock.unlock();
      std::memcpy(chunk.dst, chunk.src, chunk.bytes);
      lock.lock();
      if (--active_ == 0) done_cv_.notify_all();
    }
  }
}

void CopyPool::Run(const std::vector<CopyTask>& tasks) {
  size_t total = 0;
  for (const auto& t : tasks) total += t.bytes;
  if (threads_.empty() || total < 2 * kChunk) {
    for (const auto& t : tasks) std::memcpy(t.dst, t.src, t.bytes);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  tasks_ = &tasks;
  next_task_ = 0;
  next_offset_ = 0;
  work_cv_.notify_all();
  CopyTask chunk;
  while (TakeChunk(&chunk)) {  // the caller copies too
    lock.unlock();
    std::memcpy(chunk.dst, chunk.src, chunk.bytes);
    lock.lock();
    --active_;
  }
  done_cv_.wait(lock, [&] { return active_ == 0; });
  tasks_ = nullptr;
}

}  // namespace flashckpt

// The trainer client's host copies: memcpy between the caller's buffers and a slot of the mapped
// segment, large copies split into 16 MiB chunks spread over a ParallelLoop (common/base/thread_pool.h).
// Device copies are client/src/cuda_copy.*.
#pragma once

#include <cstddef>
#include <vector>

#include "common/base/thread_pool.h"

namespace flashckpt {

struct CopyTask {
  void* dst;
  const void* src;
  size_t bytes;
};

// Copies the tasks, splitting large ones into 16 MiB chunks spread over the loop's threads.
void ParallelCopy(ParallelLoop* loop, const std::vector<CopyTask>& tasks);

}  // namespace flashckpt

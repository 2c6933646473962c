// The trainer client's host copies: memcpy between the caller's buffers and a slot of the mapped
// segment, large copies split into 16 MiB chunks spread over a ParallelLoop (common/base/thread_pool.h).
// Device copies are client/src/cuda_copy.*.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/base/thread_pool.h"

namespace flashckpt {

struct CopyTask {
  void* dst;
  const void* src;
  size_t bytes;
};

// Copies the tasks, splitting large ones into 16 MiB chunks spread over the loop's threads.
void ParallelCopy(ParallelLoop* loop, const std::vector<CopyTask>& tasks);
// The same with non-temporal stores where the CPU has them (ParallelVerifiedCopy's copy, without the
// hash): for benchmarks that compare against it.
void ParallelStreamCopy(ParallelLoop* loop, const std::vector<CopyTask>& tasks);

// A copy checked against the checksums recorded when its source was committed: chunk k of `src`
// (chunk_bytes bytes counted from its first byte, the last one shorter) must hash (XXH3-64) to
// sums[k]. `name` is the tensor's, for the error.
struct VerifiedCopyTask {
  CopyTask copy;
  const uint64_t* sums = nullptr;
  size_t sum_count = 0;
  std::string name;
};

// Copies the tasks on the loop's threads, each chunk hashed right before it is copied, so that the
// copy reads it from the CPU cache (one pass over the source from memory instead of two), and written
// with non-temporal stores where the CPU has them. CORRUPTION names the first tensor and chunk that
// does not match (both values); the destination then holds some of the bytes, and must not be used.
// INVALID_ARGUMENT when a task's sums do not cover its bytes in chunks of `chunk_bytes`.
Status ParallelVerifiedCopy(ParallelLoop* loop, const std::vector<VerifiedCopyTask>& tasks, uint64_t chunk_bytes);

// Maps the pages of each task's destination for writing (MADV_POPULATE_WRITE, 64 MiB at a time;
// page contents never change), until `stop` becomes true: a restore runs it while the daemon fills
// the slot, so that a fresh optimizer's moments are first touched then instead of during the copy.
// Best effort: a kernel without it, or memory it cannot populate, is left to the copy.
void PrefaultDestinations(const std::vector<CopyTask>& tasks, const std::atomic<bool>* stop);

}  // namespace flashckpt

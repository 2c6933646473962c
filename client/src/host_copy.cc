#include "client/src/host_copy.h"

#include <algorithm>
#include <cstring>

namespace flashckpt {

void ParallelCopy(ParallelLoop* loop, const std::vector<CopyTask>& tasks) {
  constexpr size_t kChunk = 16u << 20;
  size_t total = 0;
  for (const auto& t : tasks) total += t.bytes;
  if (loop->threads() == 1 || total < 2 * kChunk) {
    for (const auto& t : tasks) std::memcpy(t.dst, t.src, t.bytes);
    return;
  }
  std::vector<size_t> first_chunk(tasks.size() + 1, 0);  // prefix sums of chunks per task
  for (size_t i = 0; i < tasks.size(); ++i) first_chunk[i + 1] = first_chunk[i] + (tasks[i].bytes + kChunk - 1) / kChunk;
  loop->Run(first_chunk.back(), [&](size_t c) {
    size_t i = static_cast<size_t>(std::upper_bound(first_chunk.begin(), first_chunk.end(), c) - first_chunk.begin()) - 1;
    size_t offset = (c - first_chunk[i]) * kChunk;
    size_t n = std::min(kChunk, tasks[i].bytes - offset);
    std::memcpy(static_cast<char*>(tasks[i].dst) + offset, static_cast<const char*>(tasks[i].src) + offset, n);
  });
}

}  // namespace flashckpt

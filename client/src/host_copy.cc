#include "client/src/host_copy.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>

#include "common/base/stream_copy.h"
#include "common/format/checksum.h"
#include "common/format/layout.h"
#include "common/format/slot_checksums.h"

namespace flashckpt {
namespace {

void ParallelCopyWith(ParallelLoop* loop, const std::vector<CopyTask>& tasks, void (*copy)(char*, const char*, size_t)) {
  constexpr size_t kChunk = 16u << 20;
  size_t total = 0;
  for (const auto& t : tasks) total += t.bytes;
  if (loop->threads() == 1 || total < 2 * kChunk) {
    for (const auto& t : tasks) {
      if (t.bytes > 0) copy(static_cast<char*>(t.dst), static_cast<const char*>(t.src), t.bytes);
    }
    return;
  }
  std::vector<size_t> first_chunk(tasks.size() + 1, 0);  // prefix sums of chunks per task
  for (size_t i = 0; i < tasks.size(); ++i) first_chunk[i + 1] = first_chunk[i] + (tasks[i].bytes + kChunk - 1) / kChunk;
  loop->Run(first_chunk.back(), [&](size_t c) {
    size_t i = static_cast<size_t>(std::upper_bound(first_chunk.begin(), first_chunk.end(), c) - first_chunk.begin()) - 1;
    size_t offset = (c - first_chunk[i]) * kChunk;
    size_t n = std::min(kChunk, tasks[i].bytes - offset);
    copy(static_cast<char*>(tasks[i].dst) + offset, static_cast<const char*>(tasks[i].src) + offset, n);
  });
}

}  // namespace

void ParallelCopy(ParallelLoop* loop, const std::vector<CopyTask>& tasks) {
  ParallelCopyWith(loop, tasks, [](char* dst, const char* src, size_t n) { std::memcpy(dst, src, n); });
}

void ParallelStreamCopy(ParallelLoop* loop, const std::vector<CopyTask>& tasks) {
  ParallelCopyWith(loop, tasks, [](char* dst, const char* src, size_t n) {
    StreamCopy(dst, src, n);
    StreamFence();
  });
}

Status ParallelVerifiedCopy(ParallelLoop* loop, const std::vector<VerifiedCopyTask>& tasks, uint64_t chunk_bytes) {
  if (chunk_bytes == 0) return InvalidArgument("the memory checkpoint's checksum chunk size is 0");
  for (const VerifiedCopyTask& t : tasks) {
    if ((t.sums == nullptr && t.sum_count > 0) || t.sum_count != ChunkCount(t.copy.bytes, chunk_bytes)) {
      return InvalidArgument("the memory checkpoint's checksums do not cover tensor '" + t.name + "' (" +
                             std::to_string(t.sum_count) + " for " + std::to_string(t.copy.bytes) + " bytes)");
    }
  }
  // Units of whole chunks, about 16 MiB each, spread over the threads.
  const uint64_t per_unit = std::max<uint64_t>(1, (16u << 20) / chunk_bytes);
  struct Unit {
    size_t task;
    uint64_t first, count;
  };
  std::vector<Unit> units;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const uint64_t chunks = tasks[i].sum_count;
    for (uint64_t c = 0; c < chunks; c += per_unit) units.push_back({i, c, std::min(per_unit, chunks - c)});
  }
  // Each unit notes its first bad chunk (chunk, hash found); the lowest unit's is reported. Once one
  // is found the other units stop: the restore goes elsewhere.
  std::vector<std::optional<std::pair<uint64_t, uint64_t>>> bad(units.size());
  std::atomic<bool> failed{false};
  auto body = [&](size_t u) {
    const Unit& unit = units[u];
    const VerifiedCopyTask& task = tasks[unit.task];
    auto* dst = static_cast<char*>(task.copy.dst);
    const auto* src = static_cast<const char*>(task.copy.src);
    for (uint64_t c = unit.first; c < unit.first + unit.count; ++c) {
      if (failed.load(std::memory_order_relaxed)) break;
      const uint64_t from = c * chunk_bytes;
      const uint64_t n = std::min<uint64_t>(chunk_bytes, task.copy.bytes - from);
      const uint64_t got = Xxh3(src + from, n);
      if (got != task.sums[c]) {
        bad[u] = std::make_pair(c, got);
        failed.store(true, std::memory_order_relaxed);
        break;
      }
      StreamCopy(dst + from, src + from, n);
    }
    StreamFence();
  };
  if (loop->threads() == 1 || units.size() < 2) {
    for (size_t u = 0; u < units.size(); ++u) body(u);
  } else {
    loop->Run(units.size(), body);
  }
  for (size_t u = 0; u < units.size(); ++u) {
    if (!bad[u]) continue;
    const VerifiedCopyTask& task = tasks[units[u].task];
    return ChunkMismatch(task.name, bad[u]->first, chunk_bytes, task.copy.bytes, bad[u]->second,
                         task.sums[bad[u]->first]);
  }
  return Status::OK();
}

void PrefaultDestinations(const std::vector<CopyTask>& tasks, const std::atomic<bool>* stop) {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14
#endif
  constexpr uintptr_t kPiece = 64u << 20;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  for (const CopyTask& t : tasks) {
    if (t.bytes == 0) continue;
    // The pages that hold the destination's bytes (those at its ends hold them too, so they are mapped).
    const uintptr_t begin = reinterpret_cast<uintptr_t>(t.dst) / page * page;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(t.dst) + t.bytes + page - 1) / page * page;
    for (uintptr_t at = begin; at < end; at += kPiece) {
      if (stop->load(std::memory_order_relaxed)) return;
      if (::madvise(reinterpret_cast<void*>(at), std::min(kPiece, end - at), MADV_POPULATE_WRITE) != 0) {
        if (errno == EINVAL) return;  // no MADV_POPULATE_WRITE: the copy takes the faults
        break;                        // memory it cannot populate: the copy reports it, if anything
      }
    }
  }
}

}  // namespace flashckpt

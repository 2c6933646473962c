#include "common/format/slot_checksums.h"

#include <algorithm>
#include <optional>
#include <string>

#include "common/format/checksum.h"
#include "common/format/image.h"

namespace flashckpt {
namespace {

// A run of whole chunks of one tensor, hashed by one thread.
struct Task {
  size_t tensor;
  uint64_t first_chunk, chunks;
};

std::vector<Task> Tasks(const RankLayout& layout, uint64_t chunk) {
  const uint64_t per_task = std::max<uint64_t>(1, kWritePiece / chunk);
  std::vector<Task> tasks;
  for (size_t t = 0; t < layout.placements.size(); ++t) {
    const uint64_t count = ChunkCount(layout.placements[t].bytes, chunk);
    for (uint64_t c = 0; c < count; c += per_task) tasks.push_back({t, c, std::min(per_task, count - c)});
  }
  return tasks;
}

void Run(ParallelLoop* loop, size_t count, const std::function<void(size_t)>& body) {
  if (loop != nullptr) {
    loop->Run(count, body);
  } else {
    for (size_t k = 0; k < count; ++k) body(k);
  }
}

// The hash of chunk `c` of tensor `t`.
uint64_t HashChunk(const char* slot, const RankLayout& layout, uint64_t chunk, size_t t, uint64_t c) {
  const Placement& p = layout.placements[t];
  const uint64_t from = c * chunk;
  return Xxh3(slot + p.slot_offset + from, std::min(chunk, p.bytes - from));
}

}  // namespace

SlotChecksums ComputeSlotChecksums(const char* slot, const RankLayout& layout, ParallelLoop* loop) {
  SlotChecksums out;
  out.chunk_bytes = layout.checksum_chunk;
  out.first.reserve(layout.placements.size());
  uint64_t total = 0;
  for (const Placement& p : layout.placements) {
    out.first.push_back(total);
    total += ChunkCount(p.bytes, out.chunk_bytes);
  }
  out.sums.assign(total, 0);
  const std::vector<Task> tasks = Tasks(layout, out.chunk_bytes);
  Run(loop, tasks.size(), [&](size_t k) {
    const Task& task = tasks[k];
    for (uint64_t c = task.first_chunk; c < task.first_chunk + task.chunks; ++c) {
      out.sums[out.first[task.tensor] + c] = HashChunk(slot, layout, out.chunk_bytes, task.tensor, c);
    }
  });
  return out;
}

Status ChunkMismatch(const std::string& tensor, uint64_t chunk, uint64_t chunk_bytes, uint64_t tensor_bytes,
                     uint64_t found, uint64_t committed) {
  const uint64_t from = chunk * chunk_bytes;
  const uint64_t to = std::min(from + chunk_bytes, tensor_bytes);
  return Corruption("memory checkpoint: chunk " + std::to_string(chunk) + " (bytes " + std::to_string(from) + "-" +
                    std::to_string(to) + ") of tensor '" + tensor + "' has checksum " + ChecksumHex(found) +
                    ", it was " + ChecksumHex(committed) + " when committed");
}

Status CheckSlotChecksumsFit(const RankLayout& layout, const SlotChecksums& sums) {
  if (sums.chunk_bytes != layout.checksum_chunk || sums.first.size() != layout.placements.size()) {
    return Corruption("the memory checkpoint's checksums were not computed for this layout (" +
                      std::to_string(sums.first.size()) + " tensors in chunks of " + std::to_string(sums.chunk_bytes) +
                      " bytes, the layout has " + std::to_string(layout.placements.size()) + " in chunks of " +
                      std::to_string(layout.checksum_chunk) + ")");
  }
  for (size_t t = 0; t < layout.placements.size(); ++t) {
    const uint64_t end = t + 1 < sums.first.size() ? sums.first[t + 1] : sums.sums.size();
    if (end < sums.first[t] || end - sums.first[t] != ChunkCount(layout.placements[t].bytes, sums.chunk_bytes)) {
      return Corruption("the memory checkpoint's checksums do not cover tensor '" + layout.tensors[t].name + "'");
    }
  }
  return Status::OK();
}

Status VerifySlotChecksums(const char* slot, const RankLayout& layout, const SlotChecksums& sums,
                           ParallelLoop* loop) {
  RETURN_IF_ERROR(CheckSlotChecksumsFit(layout, sums));
  const std::vector<Task> tasks = Tasks(layout, sums.chunk_bytes);
  // Each task notes its first bad chunk in its own entry; the lowest task's is reported.
  std::vector<std::optional<std::pair<uint64_t, uint64_t>>> bad(tasks.size());  // (chunk, hash found)
  Run(loop, tasks.size(), [&](size_t k) {
    const Task& task = tasks[k];
    for (uint64_t c = task.first_chunk; c < task.first_chunk + task.chunks; ++c) {
      const uint64_t got = HashChunk(slot, layout, sums.chunk_bytes, task.tensor, c);
      if (got != sums.sums[sums.first[task.tensor] + c]) {
        bad[k] = std::make_pair(c, got);
        return;
      }
    }
  });
  for (size_t k = 0; k < tasks.size(); ++k) {
    if (!bad[k]) continue;
    const size_t t = tasks[k].tensor;
    return ChunkMismatch(layout.tensors[t].name, bad[k]->first, sums.chunk_bytes, layout.placements[t].bytes,
                         bad[k]->second, sums.sums[sums.first[t] + bad[k]->first]);
  }
  return Status::OK();
}

}  // namespace flashckpt

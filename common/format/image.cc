#include "common/format/image.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string_view>
#include <vector>

#include "common/format/checksum.h"

namespace flashckpt {

void InitSlotImages(char* slot, const RankLayout& layout) {
  for (const auto& image : layout.files) {
    std::memcpy(slot + image.slot_offset, image.header.data(), image.header.size());
  }
}

void StampStep(char* slot, const RankLayout& layout, size_t file, int64_t step) {
  const FileImage& image = layout.files[file];
  char digits[kStepFieldWidth + 1];
  std::snprintf(digits, sizeof digits, "%020lld", static_cast<long long>(step));
  std::memcpy(slot + image.slot_offset + image.step_field, digits, kStepFieldWidth);
}

namespace {

void WriteHex(char* field, uint64_t checksum) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(checksum));
  std::memcpy(field, hex, kChecksumFieldWidth);
}

}  // namespace

void StampChunkChecksums(char* slot, const RankLayout& layout, size_t tensor, uint64_t from, uint64_t to) {
  const Placement& p = layout.placements[tensor];
  if (p.chunks_field == 0) return;
  const char* data = slot + p.slot_offset;
  for (uint64_t pos = from; pos < to; pos += p.checksum_chunk) {
    const uint64_t n = std::min(p.checksum_chunk, to - pos);
    WriteHex(slot + p.chunks_field + pos / p.checksum_chunk * kChecksumFieldWidth, Xxh3(data + pos, n));
  }
}

void StampWholeChecksum(char* slot, const RankLayout& layout, size_t tensor) {
  const Placement& p = layout.placements[tensor];
  if (p.chunks_field == 0) {  // one chunk: the whole checksum is the hash of the bytes
    WriteHex(slot + p.checksum_field, Xxh3(slot + p.slot_offset, p.bytes));
    return;
  }
  // Format version 2: a function of the chunk checksums already stamped, not a second pass.
  const uint64_t count = ChunkCount(p.bytes, p.checksum_chunk);
  std::vector<uint64_t> chunks(count);
  for (uint64_t k = 0; k < count; ++k) {
    // The fields were written by WriteHex above: 16 lowercase hex digits each.
    chunks[k] = ParseChecksumHex(std::string_view(slot + p.chunks_field + k * kChecksumFieldWidth,
                                                  kChecksumFieldWidth))
                    .value_or(0);
  }
  WriteHex(slot + p.checksum_field, CombineChunkChecksums(chunks.data(), chunks.size(), p.bytes));
}

void StampPieceChecksums(char* slot, const RankLayout& layout, size_t tensor, uint64_t from, uint64_t to) {
  StampChunkChecksums(slot, layout, tensor, from, to);
  if (layout.placements[tensor].chunks_field == 0) StampWholeChecksum(slot, layout, tensor);  // its one piece
}

void StampDerivedChecksums(char* slot, const RankLayout& layout, size_t file) {
  for (size_t t : layout.files[file].tensors) {
    if (layout.placements[t].chunks_field != 0) StampWholeChecksum(slot, layout, t);
  }
}

void StampChecksum(char* slot, const RankLayout& layout, size_t tensor) {
  StampChunkChecksums(slot, layout, tensor, 0, layout.placements[tensor].bytes);
  StampWholeChecksum(slot, layout, tensor);
}

void StampEmaCounters(char* slot, const RankLayout& layout, size_t file, uint64_t updates_applied,
                      uint64_t updates_skipped, int64_t last_step) {
  const FileImage& image = layout.files[file];
  const uint64_t values[3] = {updates_applied, updates_skipped, static_cast<uint64_t>(std::max<int64_t>(0, last_step))};
  for (size_t k = 0; k < 3 && k < image.extra_fields.size(); ++k) {
    char digits[kStepFieldWidth + 1];
    std::snprintf(digits, sizeof digits, "%020llu", static_cast<unsigned long long>(values[k]));
    std::memcpy(slot + image.slot_offset + image.extra_fields[k], digits, kStepFieldWidth);
  }
}

void StampImage(char* slot, const RankLayout& layout, size_t file, int64_t step) {
  StampStep(slot, layout, file, step);
  for (size_t t : layout.files[file].tensors) StampChecksum(slot, layout, t);
}

}  // namespace flashckpt

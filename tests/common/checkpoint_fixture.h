// Writes a real checkpoint directory the way the daemon does: a rank layout, a filled and stamped
// slot, each image's bytes written durably as "<stem>.safetensors", then metadata.json.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/format/image.h"
#include "common/format/layout.h"
#include "common/format/metadata.h"
#include "common/io/fs.h"
#include "test_util.h"

namespace flashckpt::testing {

// The byte the fixture stores at local byte `i` of the tensor registered `index`-th by a rank.
inline char PatternByte(uint64_t i, size_t index, uint32_t seed) { return static_cast<char>(i * 131 + index * 17 + seed); }

// Writes rank `rank`'s files of step `step` into `dir` (which must exist). Tensor bytes are
// PatternByte(local byte, index, seed).
inline Status WriteRankFiles(const std::string& dir, const std::string& job, uint32_t rank, const Topology& topology,
                             const std::vector<TensorSpec>& specs, int64_t step, uint32_t seed = 1,
                             uint64_t checksum_chunk = kDefaultChecksumChunk) {
  LayoutExtras extras;
  extras.checksum_chunk = checksum_chunk;
  ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout(job, rank, topology, specs, extras));
  SlotBuffer slot(layout.slot_bytes);
  if (slot.data() == nullptr) return Internal("aligned_alloc failed");
  InitSlotImages(slot.data(), layout);
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    const Placement& p = layout.placements[t];
    for (uint64_t i = 0; i < p.bytes; ++i) {
      slot.data()[p.slot_offset + i] = PatternByte(i, t, seed);
    }
  }
  for (size_t f = 0; f < layout.files.size(); ++f) {
    StampImage(slot.data(), layout, f, step);
    const FileImage& image = layout.files[f];
    RETURN_IF_ERROR(WriteFileDurably(dir, image.stem + ".safetensors",
                                     std::string_view(slot.data() + image.slot_offset, image.file_bytes())));
  }
  return Status::OK();
}

// Gathers metadata.json (and its index) from the files' own headers, as the last daemon to see a
// signal does.
inline Status WriteMetadata(const std::string& dir) {
  ASSIGN_OR_RETURN(CheckpointMetadata meta, BuildMetadataFromDir(dir));
  return WriteMetadataFiles(dir, meta);
}

// Swaps, in metadata.json, where the pieces of tensor `key` in files `a` and `b` go (box offset and
// shape, flat range), leaving their byte ranges and checksums as they are: a damaged or edited
// metadata.json whose every checksum still matches the bytes on disk. Its index is left as it was.
inline Status SwapPlacements(const std::string& dir, const std::string& key, const std::string& a,
                             const std::string& b) {
  ASSIGN_OR_RETURN(CheckpointMetadata meta, ReadMetadataFile(dir));
  Piece* first = nullptr;
  Piece* second = nullptr;
  for (Piece& p : meta.pieces) {
    if (p.key == key && p.file == a) first = &p;
    if (p.key == key && p.file == b) second = &p;
  }
  if (first == nullptr || second == nullptr) return NotFound("no piece of '" + key + "' in " + a + " or " + b);
  std::swap(first->box_offset, second->box_offset);
  std::swap(first->box_shape, second->box_shape);
  std::swap(first->flat_range, second->flat_range);
  return WriteFileDurably(dir, "metadata.json", MetadataToJson(meta));
}

}  // namespace flashckpt::testing

// Where every byte of a rank's checkpoint lives: the slot layout derived from its tensor specs.
//
// A slot holds the exact byte image of each file the rank writes, so persisting is a straight write:
//
//   slot:  [slot header page][model_state image][optimizer image][replica area]
//   image: [8-byte length][JSON header padded to 4 KiB][tensor data, contiguous]
//
// Each image and the replica area begin on a 4 KiB boundary. Inside an image, tensors are ordered
// by element size (descending) then name, so each is naturally aligned. Replica tensors (held by the
// rank, persisted by another) live in the replica area: restore fills them, save skips them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/format/safetensors.h"
#include "flashckpt/tensor.h"

namespace flashckpt {

// The version of the file format this release writes, recorded in every file's `__metadata__`
// ("format_version") and in metadata.json. Version 2 derives a chunked tensor's whole checksum from
// its chunk checksums (CombineChunkChecksums); version 1 hashed its bytes a second time. Readers
// accept every version from kOldestFormatVersion on; shared-memory segments carry it too.
inline constexpr int kFormatVersion = 2;
inline constexpr int kOldestFormatVersion = 1;
inline constexpr size_t kMaxTensorsPerRank = 1 << 20;
// The most bytes one slot (a rank's layout) may span: 256 TiB, beyond any host's memory. Bounding
// every offset by it keeps the layout's sums, SegmentBytes() of up to 64 slots and every
// slot-relative address far from 64-bit overflow, whatever sizes a registration asks for.
inline constexpr uint64_t kMaxSlotBytes = 1ull << 48;
inline constexpr size_t kStepFieldWidth = 20;
inline constexpr size_t kChecksumFieldWidth = 16;

// A tensor larger than one checksum chunk also records the xxh3 of each chunk (counted from its
// first byte; the last one may be shorter), so a reader that needs part of it verifies what it
// read without reading the rest. The chunk size is a power of two; files record theirs.
inline constexpr uint64_t kDefaultChecksumChunk = 1u << 20;
inline constexpr uint64_t kMinChecksumChunk = 4096;
inline constexpr uint64_t kMaxChecksumChunk = 1u << 30;
Status ValidateChecksumChunk(uint64_t bytes);
inline uint64_t ChunkCount(uint64_t bytes, uint64_t chunk) { return bytes == 0 ? 0 : (bytes - 1) / chunk + 1; }

// Fills defaults (box_shape = shape, global_shape = box_shape, box_offset = 0) and checks a spec:
// ranks agree, the box lies inside the global tensor, the local element count matches the box or
// the flat range, local element counts and byte sizes do not overflow, the tensor fits in a slot
// (kMaxSlotBytes) and `param` is a valid name. Messages name the tensor and the field.
Result<TensorSpec> NormalizeTensorSpec(const TensorSpec& spec);
Status ValidateTopology(const Topology& t, uint32_t rank);

// One file image inside a slot.
struct FileImage {
  std::string kind;            // "model_state" or "optimizer"
  std::string stem;            // "model_state.tp00_pp00_shard00"
  uint64_t slot_offset = 0;    // where the image starts in the slot
  std::string header;          // header template: 8-byte length + padded JSON
  uint64_t data_bytes = 0;     // tensor bytes after the header
  uint64_t step_field = 0;     // offset of the step digits within the image
  std::vector<size_t> tensors;  // indices into RankLayout::tensors, in data order
  std::vector<uint64_t> extra_fields;  // offsets within the image of LayoutExtras::fixed_fields

  uint64_t file_bytes() const { return header.size() + data_bytes; }
};

struct Placement {
  int file = -1;               // index into RankLayout::files; -1 for a replica
  uint64_t slot_offset = 0;    // where the tensor's bytes start in the slot
  uint64_t bytes = 0;
  uint64_t checksum_field = 0;  // offset of its checksum digits within the slot (file tensors)
  uint64_t chunks_field = 0;    // offset of its per-chunk checksum digits; 0 if it is one chunk
  uint64_t checksum_chunk = 0;  // chunk size of those checksums
};

struct RankLayout {
  std::string job;
  uint32_t rank = 0;
  Topology topology;
  std::vector<TensorSpec> tensors;     // normalized, in registration order
  std::vector<Placement> placements;   // parallel to tensors
  std::vector<FileImage> files;
  uint64_t replica_offset = 0;
  uint64_t slot_bytes = 0;             // including the slot header page; multiple of 4 KiB
  uint64_t checksum_chunk = kDefaultChecksumChunk;  // of the per-chunk checksums in its headers

  // Index of the tensor called `name`, or -1.
  int Find(const std::string& name) const;
};

// Metadata added to every file image of a layout: fixed strings, and fixed-width decimal fields
// (zero-filled) whose offsets land in FileImage::extra_fields, to be written at save time.
struct LayoutExtras {
  std::vector<std::pair<std::string, std::string>> metadata;
  std::vector<std::pair<std::string, size_t>> fixed_fields;
  uint64_t checksum_chunk = kDefaultChecksumChunk;  // see kDefaultChecksumChunk
};

// Builds the layout; fails with a message naming the offending tensor on bad specs, duplicates or
// a global tensor of more than 2^64 bytes, and when the slot would pass kMaxSlotBytes or a file
// header the safetensors bound.
Result<RankLayout> BuildRankLayout(const std::string& job, uint32_t rank, const Topology& topology,
                                   const std::vector<TensorSpec>& specs, const LayoutExtras& extras = {});

// The metadata keys flashckpt writes per tensor into a file's __metadata__: "<name>@<what>".
std::string TensorMetaKey(const std::string& name, const char* what);

// Segment = header page + slot_count slots of slot_bytes each.
inline constexpr uint64_t kSegmentHeaderBytes = kPageSize;
inline uint64_t SegmentBytes(uint64_t slot_bytes, uint32_t slot_count) {
  return kSegmentHeaderBytes + slot_bytes * slot_count;
}
inline uint64_t SlotOffset(uint64_t slot_bytes, uint32_t slot) { return kSegmentHeaderBytes + slot_bytes * slot; }

}  // namespace flashckpt

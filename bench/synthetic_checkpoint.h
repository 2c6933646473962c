// A complete checkpoint written straight from rank layouts, for benchmarks that read one: each
// rank's slot is filled with pseudo-random bytes, stamped (checksums, step) and written as its
// files, then metadata.json.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/format/image.h"
#include "common/format/layout.h"
#include "common/format/metadata.h"
#include "common/io/fs.h"

namespace flashckpt::bench {

struct SyntheticRank {
  Topology topology;
  std::vector<TensorSpec> specs;
};

// Writes the checkpoint of `ranks` (job "bench", step 100) into `dir`, which must exist; returns
// the bytes of its files. `extras` go into every file (e.g. EmaFileExtras for EMA tensors).
inline Result<uint64_t> WriteSyntheticCheckpoint(const std::string& dir, const std::vector<SyntheticRank>& ranks,
                                                 const LayoutExtras& extras = {}) {
  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };
  std::vector<std::string> names;
  uint64_t bytes = 0;
  for (uint32_t r = 0; r < ranks.size(); ++r) {
    ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout("bench", r, ranks[r].topology, ranks[r].specs, extras));
    const uint64_t padded = (layout.slot_bytes + kPageSize - 1) / kPageSize * kPageSize;
    std::unique_ptr<char, FreeDeleter> slot(static_cast<char*>(std::aligned_alloc(kPageSize, padded)));
    if (!slot) return ResourceExhausted("cannot allocate the slot");
    uint64_t x = 0x9e3779b97f4a7c15ull * (r + 1);
    auto* words = reinterpret_cast<uint64_t*>(slot.get());
    for (uint64_t i = 0; i < layout.slot_bytes / 8; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      words[i] = x;
    }
    InitSlotImages(slot.get(), layout);
    for (size_t f = 0; f < layout.files.size(); ++f) {
      StampImage(slot.get(), layout, f, 100);
      const FileImage& image = layout.files[f];
      names.push_back(image.stem + ".safetensors");
      RETURN_IF_ERROR(WriteImageDurably(dir, names.back(), slot.get() + image.slot_offset, image.file_bytes(),
                                        (image.file_bytes() + kPageSize - 1) / kPageSize * kPageSize));
      bytes += image.file_bytes();
    }
  }
  ASSIGN_OR_RETURN(CheckpointMetadata meta, BuildMetadataFromFiles(dir, names));
  RETURN_IF_ERROR(WriteFileDurably(dir, "metadata.json", MetadataToJson(meta)));
  return bytes;
}

}  // namespace flashckpt::bench

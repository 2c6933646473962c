// libFuzzer target: metadata.json is read back from the checkpoint directory (restore, verify,
// list, reshard), so its bytes are untrusted. The input is a whole metadata.json. Properties: the
// parser never crashes, every piece it accepts has a consistent geometry inside its file, and what it
// accepts is written back by MetadataToJson into a file that parses to the same checkpoint.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "common/format/layout.h"
#include "common/format/metadata.h"
#include "fuzz_check.h"

namespace {

using namespace flashckpt;

void CheckPiece(const CheckpointMetadata& meta, const Piece& p) {
  auto file = std::find_if(meta.files.begin(), meta.files.end(), [&](const SavedFile& f) { return f.name == p.file; });
  FUZZ_CHECK(file != meta.files.end());
  FUZZ_CHECK(p.begin <= p.end && p.end <= file->bytes && file->bytes <= kMaxCheckpointFileBytes);
  auto bytes = TensorBytes(p.dtype, p.shape);
  FUZZ_CHECK(bytes.ok() && *bytes == p.end - p.begin);
  FUZZ_CHECK(p.global_shape.size() == p.box_offset.size() && p.global_shape.size() == p.box_shape.size());
  for (size_t d = 0; d < p.global_shape.size(); ++d) {
    FUZZ_CHECK(p.box_offset[d] <= p.global_shape[d] && p.box_shape[d] <= p.global_shape[d] - p.box_offset[d]);
  }
  if (p.flat_range) FUZZ_CHECK(p.flat_range->begin <= p.flat_range->end);
  if (!p.chunk_xxh3.empty()) FUZZ_CHECK(p.chunk_xxh3.size() == ChunkCount(p.end - p.begin, p.chunk_bytes));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto meta = ParseMetadataJson(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!meta.ok()) return 0;
  for (const auto& p : meta->pieces) CheckPiece(*meta, p);
  const std::string written = MetadataToJson(*meta);
  auto again = ParseMetadataJson(written);
  if (!again.ok()) std::fprintf(stderr, "%s\n", again.status().ToString().c_str());
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(MetadataToJson(*again) == written);
  return 0;
}

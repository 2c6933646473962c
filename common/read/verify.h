// Offline verification of a checkpoint directory: every file metadata.json lists is present, has
// the recorded size and header, and every tensor's bytes hash to the recorded xxh3. This is what
// `flashckpt verify` runs; it needs no daemon and only reads.
#pragma once

#include <cstdint>
#include <string>

#include "common/base/status.h"

namespace flashckpt {

// What a verification covered. On failure it holds what was checked before the error.
struct VerifyReport {
  std::string job;
  int64_t step = 0;
  uint64_t files = 0;    // files whose size, header and every checksum were checked
  uint64_t tensors = 0;  // distinct tensors (name and kind, as `flashckpt inspect` counts them) among the pieces
  uint64_t pieces = 0;   // pieces (a tensor's part in one file) whose bytes were hashed and matched
  uint64_t bytes = 0;    // size of the fully checked files, headers included
};

// Verifies the checkpoint in `dir` (a "checkpoint-<step>" directory) against its metadata.json:
//   - metadata.json parses (kNotFound when absent: the checkpoint is not complete);
//   - each listed file exists, is a regular file and has the recorded size;
//   - its safetensors header parses, names the job and step of metadata.json, and declares exactly
//     the pieces metadata.json records for it (same keys, dtypes, shapes, boxes, offsets, checksums);
//   - the xxh3-64 of each piece's bytes on disk, and of each of its checksum chunks, equals the
//     recorded checksum (format version 2: a chunked piece is checked by its chunks, and its whole
//     checksum must be the one they give, docs/format.md "Checksums").
// Cheap checks run on every file before any data is hashed, so a missing or truncated file is
// reported at once. Files are read sequentially in bounded chunks: memory use does not grow with
// file size. Stops at the first problem and returns kCorruption (kNotFound for a missing file,
// kIOError when a read fails) with a message that names the file and, where one is concerned,
// the tensor. `report` may be null. Thread-compatible; blocks for as long as the reads take.
Status VerifyCheckpointDir(const std::string& dir, VerifyReport* report);

}  // namespace flashckpt

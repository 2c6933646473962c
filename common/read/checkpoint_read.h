// Reading a complete checkpoint into a rank's slot image, in the rank's own layout or another one.
//
// Every tensor of the layout is matched to a saved piece with the same key, kind, dtype, global
// shape, box and flat range (replicas are found in whichever rank's file persisted them). Those
// reads are sorted by file and offset and merged when adjacent in both the file and the slot, so
// the usual case is one large sequential read per file, and every piece's xxh3 is verified.
//
// A tensor whose saved pieces have another geometry (different tp/pp/shard degrees) is planned by
// PlanPieceReads (common/read/reshard.h): its box and flat range are intersected with the saved pieces,
// replicas are read once. Of each contributing saved piece only the checksum chunks that hold
// needed bytes are read (the whole piece when it has one checksum), each chunk is verified, and
// the needed bytes are copied out of it.
//
// Before it reads any data of a file, it reads the file's safetensors header and checks that it
// declares exactly the pieces metadata.json records there, with the same job, step, box offset and
// shape, flat range, byte range and checksums (CheckFileHeader, common/read/header_check.h): the
// checksums cover a piece's bytes, not where metadata.json says they go.
//
// Reads run on the threads of a ParallelLoop when one is given. The slot's bytes are trusted only
// when the whole call succeeded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/base/thread_pool.h"
#include "common/format/layout.h"
#include "common/format/metadata.h"
#include "common/io/io_env.h"

namespace flashckpt {

struct FillOptions {
  ParallelLoop* loop = nullptr;  // run the reads on its threads; nullptr: on the caller's thread
  // Fill bf16/fp16 tensors from fp32 saved pieces (rounded to nearest even). Without it a dtype
  // that differs from the checkpoint's is an error that names the tensor.
  bool convert_dtype = false;
  IoEnv* io = IoEnv::Default();  // opens and reads go through it (tests inject faults)
  // The caller has already checked the header of every file of the checkpoint against `meta`
  // (CheckFileHeaders, common/read/header_check.h), as a reader of many layouts from one
  // checkpoint does once: the headers are not read again.
  bool headers_checked = false;
  // Fill only the layout's tensors of these kinds (empty: all); the slot bytes of the others are
  // left untouched.
  std::vector<TensorKind> kinds;
};

struct FillStats {
  uint64_t bytes_needed = 0;  // bytes of the layout's tensors
  uint64_t bytes_read = 0;    // tensor bytes read from disk (the files' headers are not counted)
  uint64_t reads = 0;         // pread calls for those bytes
};

// Fills `slot` (laid out by `layout`) with the tensors of the checkpoint in `checkpoint_dir`,
// described by `meta`. Errors name the tensor and file: kNotFound for a tensor (or part of one)
// the checkpoint does not hold, kFailedPrecondition for a dtype or global shape that differs,
// kCorruption for a checksum mismatch, a short file, or a file whose header disagrees with `meta`.
Result<FillStats> FillSlotFromCheckpoint(const std::string& checkpoint_dir, const CheckpointMetadata& meta,
                                         const RankLayout& layout, char* slot, const FillOptions& options = {});

}  // namespace flashckpt

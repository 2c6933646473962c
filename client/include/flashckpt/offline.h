// Offline work on checkpoint directories, without a daemon: export a checkpoint's weights (or its
// EMA) as a Hugging Face style safetensors directory for evaluation and serving, and import such a
// directory as the first checkpoint of a job (pretrained weights to start from).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "flashckpt/export.h"
#include "flashckpt/status.h"

namespace flashckpt {

struct ExportOptions {
  // "model": the model weights; "ema": the EMA tensors, under their parameters' names; "optimizer":
  // the training state (optimizer moments, step counters), merged like the weights.
  std::string weights = "model";
  // "" keeps each tensor's saved dtype; "fp32", "bf16" or "fp16" converts the floating-point
  // tensors (fp32, bf16, fp16; narrowing rounds to nearest even). Other dtypes are kept.
  std::string dtype;
  // Most bytes of tensor data per output file ("5GB", "500MiB", bytes; K/M/G are powers of 1024
  // as in every flashckpt size). A tensor larger than it gets a file of its own.
  std::string max_shard_size = "5GB";
  // Removed from the start of every tensor name that has it ("model." -> Hugging Face names).
  std::string strip_prefix;
  unsigned threads = 4;  // reader threads
  // Called after each tensor is written: tensor bytes done, and their total.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

struct ExportReport {
  uint32_t tensors = 0;
  uint64_t bytes = 0;                    // tensor bytes written (after conversion)
  std::vector<std::string> files;        // the safetensors files, in order
  bool index = false;                    // model.safetensors.index.json was written
};

// Exports the complete checkpoint `checkpoint_dir` into `out_dir` (absent or empty): every tensor
// of the chosen kind, merged from its tp boxes, pipeline stages and flat ranges into the full
// tensor, every byte read verified against the checkpoint's checksums. Writes model.safetensors,
// or model-0000K-of-0000N.safetensors plus model.safetensors.index.json ("metadata":
// {"total_size"}, "weight_map"), tensors in name order, "format": "pt" in every file's
// __metadata__. The files are written into a new folder beside `out_dir` and renamed onto it once
// every one is complete and synced: a failed export leaves `out_dir` as it found it (absent or
// empty). Memory: one tensor at a time.
// Errors: kNotFound for a missing directory or an incomplete checkpoint (no metadata.json);
// kCorruption for a checksum or header mismatch; kInvalidArgument for a bad option, a checkpoint
// without tensors of that kind, two names that strip_prefix makes equal, or an `out_dir` inside the
// checkpoint, any checkpoint-<step> folder (retention deletes those whole) or the checkpoint's root
// (<root>/<job>/checkpoint-<step> whose <job> holds LATEST); kAlreadyExists for a
// non-empty `out_dir`; I/O errors name the file.
FLASHCKPT_API Status ExportCheckpoint(const std::string& checkpoint_dir, const std::string& out_dir,
                                      const ExportOptions& options, ExportReport* report);

struct ImportOptions {
  std::string root;     // the checkpoint root (flashckptd --root)
  std::string job;      // a new job: it must have no checkpoints yet
  int64_t step = 0;     // the checkpoint's step
  std::string add_prefix;  // put before every tensor name ("model." for a Checkpointer's names)
  // Per-chunk checksum size of the written file (a power of two, 4KiB..1GiB), as flashckptd
  // --checksum-chunk.
  std::string checksum_chunk = "1MiB";
  // Called after each tensor is written: tensor bytes done, and their total.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

struct ImportReport {
  uint32_t tensors = 0;
  uint64_t bytes = 0;
  uint32_t source_files = 0;
  std::string checkpoint_dir;  // <root>/<job>/checkpoint-<step>
};

// Imports the Hugging Face safetensors directory `hf_dir` (model.safetensors, or
// model.safetensors.index.json and the files its weight_map names) as checkpoint `step` of a new job:
// one rank's layout (tp, pp, shard) = (1, 1, 1) holding every tensor as a model weight, with
// checksums, its saved_signal_0, metadata.json (written last: the checkpoint is complete only then)
// and LATEST. Any layout restores from it (the resharding restore cuts each rank's boxes out of the
// full tensors). The input is untrusted: every header is parsed defensively, and a bad header,
// offsets out of range, an index naming a missing file or a tensor its file lacks, a tensor in two
// files, or an unknown dtype is kCorruption naming the file and tensor. kNotFound: `hf_dir` holds
// neither model.safetensors nor the index; kAlreadyExists: the job has checkpoints. Tensors are
// copied piece by piece (16 MiB at a time), never whole in memory.
FLASHCKPT_API Status ImportCheckpoint(const std::string& hf_dir, const ImportOptions& options, ImportReport* report);

}  // namespace flashckpt

// Offline resharding: rewrites a complete checkpoint into another (tp, pp, shard) layout with the
// read path of an online restore (FillSlotFromCheckpoint), for users who want the files themselves.
// (An online restore needs none of this: it reads any complete checkpoint into any layout.)
//
// The new layout follows how the checkpoint holds each tensor:
//  - Tensor parallelism: a tensor whose saved boxes cut a dimension is cut along that dimension
//    again, into blocks of ceil(size / tp_degree) (the last block shorter; a rank past the end
//    holds none of it). A tensor saved whole is written by tp rank 0 only. A checkpoint saved with
//    tp_degree 1 does not say which tensors are split: there, tensors of two or more dimensions are
//    cut along dimension 0.
//  - Pipeline: each tensor keeps its saved stage when the degree is unchanged. With a multiple of
//    the old degree each old stage's tensors (in name order) are cut into that many runs of about
//    equal bytes; with a divisor, consecutive old stages are merged; otherwise all tensors, in
//    (stage, name) order, are cut into pp_degree runs of about equal bytes.
//  - Sharding: with shard_degree > 1, optimizer and master_weight tensors are cut into flat ranges
//    of their tp box, ceil(elements / shard_degree) each (as a distributed optimizer shards them);
//    those saved as flat ranges stay flat ranges (the whole box) at shard_degree 1. Model and EMA
//    tensors are written by shard rank 0 only.
// Rank r has coordinates tp = r % T, pp = (r / T) % P, shard = r / (T * P).
//
// The destination gets the files and saved_signal of every new rank and then metadata.json (so it
// is complete only when everything is durable); job, step and EMA counters are the source's. Per-rank extra state
// (extra.rankNNNNN.json) belongs to ranks that no longer exist and is not carried.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/base/thread_pool.h"
#include "common/format/layout.h"
#include "common/format/metadata.h"

namespace flashckpt {

struct Degrees {
  uint32_t tp = 1, pp = 1, shard = 1;
};

// What one rank of the new layout writes.
struct NewRank {
  uint32_t rank = 0;
  Topology topology;
  std::vector<TensorSpec> tensors;  // model, optimizer and master_weight pieces
  std::vector<TensorSpec> ema;      // EMA pieces (kind kEma)
};

// The new layout of the checkpoint `meta` under `degrees`. Pure; errors: kInvalidArgument for a
// zero degree or more than 65536 ranks.
Result<std::vector<NewRank>> PlanNewLayout(const CheckpointMetadata& meta, const Degrees& degrees);

struct RelayoutReport {
  uint32_t ranks = 0;  // ranks that wrote files
  uint32_t files = 0;
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
};

// Rewrites the complete checkpoint `src_dir` into `dst_dir` (created; it must not exist or be
// empty) under `degrees`, with per-chunk checksums of `checksum_chunk` bytes. `progress`, if set,
// is called after each new rank's files are written. Before `dst_dir` is created, every source
// file's header is checked against metadata.json (CheckFileHeaders, common/read/header_check.h):
// a piece that metadata.json places elsewhere than its file's header does is kCorruption naming
// the file and tensor, and nothing is written. Every byte read is verified against the source's
// checksums; on a later failure `dst_dir` is left without metadata.json.
Status RelayoutCheckpoint(const std::string& src_dir, const std::string& dst_dir, const Degrees& degrees,
                          uint64_t checksum_chunk, ParallelLoop* loop, RelayoutReport* report,
                          const std::function<void(const NewRank&, const RelayoutReport&)>& progress = {});

}  // namespace flashckpt

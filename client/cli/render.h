// How `flashckpt` shows daemon answers: aligned text tables for people, JSON for scripts. Pure
// functions of the answers as the operator client returns them (flashckpt/admin.h), so the output
// does not depend on how they were fetched.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/format/metadata.h"
#include "flashckpt/admin.h"

namespace flashckpt::cli {

// "2h 03m 14s", "45s", "3d 01h 00m".
std::string FormatDuration(double seconds);

// The daemon's status: daemon, memory, root, a table with one line per job (ranks here, newest
// step committed by any rank, newest complete checkpoint, the lag between them in steps, the last
// persist's rate, EMA on/off, failed persists), then per job an EMA summary line, a table of ranks
// (OLDEST WRITE: how long the rank's oldest persist being written has run, "-" when none; in JSON
// oldest_write_seconds, 0 when none) and, when any rank keeps an EMA, a table of its EMA (decay,
// last update step, updates applied and skipped, image size). Steps that have not happened yet
// (negative) show as "-" in text and null in JSON; in JSON every rank has an "ema" object with the
// same keys whether EMA is on or off.
std::string StatusText(const DaemonStatus& status);
nlohmann::ordered_json StatusJson(const DaemonStatus& status);

// One watched event as one line: UTC time, what happened, then key=value fields, e.g.
//   2026-11-23T01:02:03.456Z persisted    job=llama step=1200 rank=3 bytes=12.4GiB secs=3.10 gbps=4.00
std::string EventText(const DaemonEvent& event);
nlohmann::ordered_json EventJson(const DaemonEvent& event);

// The checkpoint list: one row per checkpoint directory.
// The attempts the ranks of one step saved it in: a run and the step its processes restored, with
// the ranks of each (sorted).
struct StepRun {
  std::string run_id;
  int64_t resumed_from = 0;
  std::vector<uint32_t> ranks;
};
std::vector<StepRun> RunsOf(const std::vector<SignalledRank>& signalled);
// Incomplete, though every rank has signalled: in different attempts, so it never completes.
bool IsSplit(const CheckpointInfo& c);
// "a1b2 (fresh)", "a1b2 (resumed from 20)".
std::string StepRunText(const StepRun& run);
// The step's run, or each of its runs with its ranks ("a1 (fresh) ranks 0-1; b2 (fresh) ranks 2-3").
std::string RunsText(const std::vector<SignalledRank>& signalled);
nlohmann::ordered_json RunsJson(const std::vector<SignalledRank>& signalled);
std::string ListText(const std::vector<CheckpointInfo>& list);
nlohmann::ordered_json ListJson(const std::vector<CheckpointInfo>& list);

// `flashckpt inspect`: a complete checkpoint's metadata (read from `dir`): job, step, topology,
// EMA configuration, its files, and one row per tensor (name and kind: an EMA tensor shares its
// parameter's name) with dtype, global shape, pieces and bytes, then totals. JSON: the same, with
// every piece's file, box and flat range.
// `signalled`: the ranks whose saved_signal is in `dir` and the node that wrote each (DescribeCheckpointDir).
std::string InspectText(const std::string& dir, const CheckpointMetadata& meta,
                        const std::vector<SignalledRank>& signalled);
nlohmann::ordered_json InspectJson(const std::string& dir, const CheckpointMetadata& meta,
                                   const std::vector<SignalledRank>& signalled);

// The answer of a delete or gc: what was deleted (or, dry_run, would be), what was skipped and
// why, and the newest complete checkpoint left.
std::string DeleteText(const std::string& job, const DeleteResult& resp, bool dry_run);
nlohmann::ordered_json DeleteJson(const std::string& job, const DeleteResult& resp, bool dry_run);

// One progress line: "1.5 GiB of 6.0 GiB (25%), 1.61 GB/s, ETA 3s" (no rate or ETA before
// anything is done; done is capped at total).
std::string ProgressText(uint64_t done, uint64_t total, double seconds);

}  // namespace flashckpt::cli

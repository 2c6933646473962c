// The checkpoints on disk under --root: where they go, when one is complete, which is the latest.
//
// A checkpoint directory is complete iff it holds metadata.json. Whichever daemon sees the last
// saved_signal_<rank> of a step builds metadata.json from the files' own headers and then moves
// LATEST forward; both are written with the durable rename sequence, so doing it twice is harmless.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace flashckpt {

struct CheckpointEntry {
  std::string job;
  int64_t step = 0;
  bool complete = false;
  uint32_t signals = 0;
  uint32_t world_size = 0;  // from metadata.json; 0 when incomplete
  uint64_t bytes = 0;
  std::string path;
  bool latest = false;
};

// The content of saved_signal_<rank>: which files the rank wrote for the step, and the attempt.
struct Signal {
  uint32_t rank = 0;
  int64_t step = 0;
  int64_t resumed_from = 0;
  std::vector<std::string> files;
};
std::string EncodeSignal(const std::string& job, const Signal& signal, uint64_t bytes);
Result<Signal> ReadSignal(const std::string& path);

class Catalog {
 public:
  explicit Catalog(std::string root) : root_(std::move(root)) {}

  const std::string& root() const { return root_; }
  std::string JobDir(const std::string& job) const { return root_ + "/" + job; }
  std::string CheckpointDir(const std::string& job, int64_t step) const;

  // Called after a rank's signal is durable: when all `world_size` signals of the step are present
  // and come from the same attempt (`resumed_from`, the step the ranks resumed from, 0 for a fresh
  // start), and metadata.json is not there yet, writes metadata.json from the files those signals
  // list and advances LATEST. Signals left by an earlier attempt that crashed are not counted:
  // the ranks of the new attempt overwrite them. Returns whether the checkpoint is complete.
  Result<bool> MaybeComplete(const std::string& job, int64_t step, uint32_t world_size, int64_t resumed_from);

  bool IsComplete(const std::string& job, int64_t step) const;
  // The newest complete checkpoint of the job, or nullopt. Trusts LATEST only when the directory
  // it names is complete and no newer complete one exists.
  std::optional<int64_t> LatestComplete(const std::string& job) const;

  // Every checkpoint directory (complete or not) of `job`, or of every job when empty; by job, step.
  Result<std::vector<CheckpointEntry>> List(const std::string& job) const;

 private:
  std::mutex& JobMutex(const std::string& job);

  std::string root_;
  std::mutex mu_;  // guards job_mu_
  std::map<std::string, std::unique_ptr<std::mutex>> job_mu_;  // serializes completion per job
};

}  // namespace flashckpt

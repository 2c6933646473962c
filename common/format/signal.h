// saved_signal_<rank>: the marker a rank leaves in a checkpoint directory once its files of the
// step are durable. It lists those files and the attempt they belong to (the run id and the step the
// rank's process resumed from), so that a checkpoint is only ever assembled from the files of one
// attempt, and says which node wrote them and how many ranks the step has, so that an operator (and
// `flashckpt list`) sees, for a step that is not complete, which ranks and nodes have not written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/status.h"
#include "common/io/io_env.h"

namespace flashckpt {

// Which attempt of a job a rank's saves belong to: the run (chosen at the session's first
// registration: RegisterRequest.run_id, or drawn by the daemon) and the step its process restored
// (0: it started fresh). Signals of different attempts never complete a checkpoint together.
struct Attempt {
  std::string run_id;  // empty: written before runs had ids
  int64_t resumed_from = 0;
  bool operator==(const Attempt& o) const { return run_id == o.run_id && resumed_from == o.resumed_from; }
  bool operator!=(const Attempt& o) const { return !(*this == o); }
};
// "run 3f2a… resumed from step 200", "run 3f2a… (fresh)": for messages and events.
std::string AttemptText(const Attempt& attempt);

// A .safetensors file's header as the daemon that wrote the file recorded it in the rank's signal,
// so that the completion builds metadata.json without opening the file: the header's JSON without
// its trailing padding, its length in the file (the data starts at 8 + header_bytes) and the file's
// size. Every reader still checks the file it reads against the file's own header (docs/format.md).
struct SignalHeader {
  std::string file;  // one of the signal's files
  uint64_t header_bytes = 0;
  uint64_t file_bytes = 0;
  std::string json;
};
// The most header JSON a signal records, all files together; a rank whose headers are larger
// records none and the completion reads them from the files. Even escaped, a signal stays under
// ReadSignal's 1 MiB.
inline constexpr size_t kSignalHeadersBudget = 384u << 10;

struct Signal {
  uint32_t rank = 0;
  int64_t step = 0;
  int64_t resumed_from = 0;
  std::string run_id;  // optional in the file (signals written before runs had ids): empty
  std::string node;    // the node whose daemon wrote it (--node-name); optional in the file: empty
  uint32_t world_size = 0;  // the ranks of the rank's layout; optional in the file: 0 (unknown)
  // When the writing daemon accepted the trainer's commit of the step (wall clock, ms since the
  // epoch): the rank's process was alive then. Optional in the file: 0 (unknown). A daemon that finds
  // a step's signals of several attempts tells a live split from an old attempt's leftovers by it.
  int64_t committed_ms = 0;
  // When the daemon wrote this signal (wall clock, us since the epoch), for the completion's
  // `commit_ms` (the time from the last signal to metadata.json). Optional in the file: 0.
  int64_t written_us = 0;
  std::vector<std::string> files;
  // Headers of some or all of `files` (optional in the file: empty). Each names a file of `files`,
  // at most once.
  std::vector<SignalHeader> headers;
  Attempt attempt() const { return Attempt{run_id, resumed_from}; }
};

// The signal as one line of JSON; `bytes` is the size of the rank's files, for operators.
std::string EncodeSignal(const std::string& job, const Signal& signal, uint64_t bytes);
// Parses the contents of a signal file. The input is untrusted: every field is type- and
// range-checked, and each file name must be a plain name inside the checkpoint directory (not empty,
// ".", "..", and without '/' or NUL); a recorded header must name one of the files, fit its place
// (json no longer than header_bytes, 8 + header_bytes no more than file_bytes) and is otherwise
// parsed only when used. Errors are kCorruption.
Result<Signal> ParseSignal(std::string_view text);
// Reads and parses the signal file at `path` (at most 1 MiB); errors name the path.
Result<Signal> ReadSignal(const std::string& path, IoEnv* io = IoEnv::Default());

}  // namespace flashckpt

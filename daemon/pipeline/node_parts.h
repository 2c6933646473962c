// What this daemon wrote of each step that is not complete yet, rendered for metadata.json
// (common/format/node_part.h), so that the completion of a step of thousands of ranks does its
// per-rank work before the last signal instead of after it:
//
// - as each rank's signal is written, the rank's files are rendered from the headers the signal
//   records (NoteRank), on the writer's thread;
// - once the daemon's queued persists of a step are done and the step is still not complete, it
//   writes node_part_<token>.json with every rank it holds of the step (Publish): one file per
//   daemon per step;
// - the daemon that completes the step takes the ranks it holds and those of the other daemons'
//   parts, each while its signal is the file the part was made from (one open per rank), and
//   reads only the other ranks' signals and headers (Catalog::MaybeComplete).
//
// A part is a hint, never the only record: a rank it does not cover, or a part that cannot be
// read, is read from its signal as before. Before a rank's files of a step are written again the
// rank is dropped and the daemon's part of the step removed (ForgetRank); a part this daemon no
// longer knows it wrote (a step dropped, a restart, which also draws a new token) is kept out by the
// completion's check of each rank's signal. What is held is bounded: kStepsPerJob steps per job and
// kMaxBytes in all, the steps held longest going first (steps completed by another daemon are never
// dropped here otherwise). Thread-safe; no lock is held across file system calls.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "common/base/mutex.h"
#include "common/format/node_part.h"
#include "common/io/io_env.h"

namespace flashckpt {

// A token for a daemon's part files: random, else the process id and the time.
std::string NewNodePartToken();
// Which file `path` is now: opened and fstat'ed (on NFS an open revalidates what a stat may answer
// from its attribute cache).
Result<SignalIdentity> SignalIdentityOf(const std::string& path, IoEnv* io);

class NodeParts {
 public:
  // `io`: not owned, outlives this. `token` names this daemon's part files (letters and digits).
  NodeParts(IoEnv* io, std::string token);

  // Rank `signal.rank` of `job` has written `signal` into checkpoint directory `dir` (durable):
  // its files are rendered from the headers the signal records and held. A rank whose signal does
  // not record every .safetensors file's header, or whose headers do not render, is not held.
  void NoteRank(const std::string& dir, const std::string& job, const Signal& signal);
  // Before rank `rank`'s files of `step` are written again: drops it, and removes this daemon's
  // part of the step from `dir` if there is one.
  void ForgetRank(const std::string& dir, const std::string& job, int64_t step, uint32_t rank);
  // Writes this daemon's part of (`job`, `step`) of `attempt` into `dir`: every rank held. Nothing
  // when none is held; a failure is logged (the completion reads those ranks' signals instead).
  void Publish(const std::string& dir, const std::string& job, int64_t step, const Attempt& attempt);
  // The ranks held of (`job`, `step`) of `attempt`.
  std::map<uint32_t, std::shared_ptr<const RankPart>> Held(const std::string& job, int64_t step,
                                                           const Attempt& attempt) const;
  // The step is complete: what was held of it goes.
  void Drop(const std::string& job, int64_t step);
  // This daemon's part file name.
  const std::string& file_name() const { return name_; }

  static constexpr size_t kStepsPerJob = 4;
  static constexpr uint64_t kMaxBytes = 256ull << 20;

 private:
  struct Step {
    uint64_t seq = 0;  // when it was first held: the lowest goes first
    Attempt attempt;
    std::map<uint32_t, std::shared_ptr<const RankPart>> ranks;
    uint64_t bytes = 0;       // of the ranks' rendered text, about
    uint64_t generation = 0;  // moved by ForgetRank: a Publish that raced it removes what it wrote
    bool published = false;
  };
  using Key = std::pair<std::string, int64_t>;
  void EraseLocked(std::map<Key, Step>::iterator it) REQUIRES(mu_);

  IoEnv* const io_;
  const std::string name_;
  mutable Mutex mu_;
  std::map<Key, Step> steps_ GUARDED_BY(mu_);
  uint64_t bytes_ GUARDED_BY(mu_) = 0;
  uint64_t next_seq_ GUARDED_BY(mu_) = 0;
};

}  // namespace flashckpt

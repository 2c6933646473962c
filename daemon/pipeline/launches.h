// Which run a rank joins when nothing names one: agreed through the shared root, so that the ranks
// of one launch spread over several daemons (one per node, one root) share a run without any
// setting and without a coordinator.
//
// A job's launches are numbered folders under <root>/<job>/.launches/:
//
//     .launches/<N>/run        the run id and world size of launch N (written once, with the folder)
//     .launches/<N>/rank-<r>   rank r has joined launch N (created with O_EXCL: one process per rank)
//
// A rank that names no run, and finds no live rank of its job on its daemon to join, takes the newest
// launch N if it is of the rank's world size, has no rank-<r> yet and was begun less than
// `join_window` ago (or a rank of its run is live on the same daemon): it claims rank-<r> there. Otherwise it begins launch N+1 (a folder made aside and renamed into place: of daemons
// racing to begin it, exactly one rename succeeds and the others read its run) and claims there. The
// rule needs no clock for the case that matters: a new launch of a job is told from the one before by
// its ranks finding their own claims taken. The window only keeps the ranks of a later launch out of a
// launch some of whose ranks never came (it began long ago), and it is measured on one machine's clock
// (the folder's mtime against now), so modest skew between nodes does not matter.
//
// Every operation is a few small file-system calls on the shared root (a list of .launches, a read
// of the run file, one exclusive create); none holds a lock of the daemon. Launches older than the
// newest few are removed by whichever daemon begins a new one.
#pragma once

#include <chrono>
#include <cstdint>
#include <set>
#include <string>

#include "common/base/status.h"

namespace flashckpt {

struct LaunchChoice {
  uint64_t launch = 0;  // N
  std::string run_id;
  bool began = false;   // this call began launch N (its run is `drawn`)
};

class Launches {
 public:
  // `root`: the checkpoint root (--root). `join_window`: how long after it began a launch takes
  // ranks that are not yet in it.
  Launches(std::string root, std::chrono::seconds join_window);

  // The launch rank `rank` of `job` joins, claiming its place there; `drawn` is the run of a launch
  // this call begins. Errors: the root cannot be read or written (the caller refuses the rank's first
  // snapshot with a message naming the fix: a run id from the launcher or FLASHCKPT_RUN_ID).
  // `live_runs`: runs of the job's ranks live on the caller's daemon; the newest launch takes the rank
  // past its window when its run is one of them (a rank slower to start than the others of its node).
  Result<LaunchChoice> Join(const std::string& job, uint32_t rank, uint32_t world_size, const std::string& drawn,
                            const std::set<std::string>& live_runs = {}) const;

  // The newest launch of `job` (0: none yet): one listing of its launches folder. A rank that joined
  // launch N finds at its first snapshot whether a newer one began since (a relaunch whose ranks
  // found their places in N taken): then it is not in its launch's run.
  Result<uint64_t> Newest(const std::string& job) const;

  // How many launches of a job are kept (the newest); older ones are removed when a new one begins.
  static constexpr uint64_t kKept = 4;
  static constexpr const char* kFolder = ".launches";

 private:
  std::string root_;
  std::chrono::seconds join_window_;
};

}  // namespace flashckpt

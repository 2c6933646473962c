// What the core's calls answer beyond a status: waits, releases, resume plans and restores.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "daemon/core/core_types.h"
#include "daemon/core/slots.h"

namespace flashckpt {

struct WaitResult {
  int64_t persisted_step = -1;
  bool checkpoint_complete = false;
};

// What ReleaseJob gave back.
struct ReleaseOutcome {
  uint32_t ranks = 0;   // ranks the daemon knew of the job
  uint64_t bytes = 0;   // shared memory freed (slot and EMA segments)
  // Memory checkpoints newer than the newest complete checkpoint on disk (`disk_step`, -1: none):
  // the newest one was written first (`written_step`), or with force they went (`dropped_steps`).
  int64_t disk_step = -1;
  int64_t written_step = -1;
  std::vector<int64_t> dropped_steps;  // newest first
};

// How the ranks of a job resume (Restorer::ResumePlanFor).
struct ResumePlan {
  // Made for the job's ranks (here, or agreed with the other daemons). false: no plan was needed,
  // and each rank reads the latest complete checkpoint.
  bool decided = false;
  bool found = false;  // false: the job has no checkpoint to restore
  int64_t step = 0;
  SlotTier tier = SlotTier::kDisk;
  // The ranks that restored by it, with their process (RankState::process): a retry of the same
  // process gets the same plan; a new process of any of them means the job failed again, and the
  // plan is stale.
  std::map<uint32_t, uint64_t> taken;
  // Set when a rank could not hand the planned memory checkpoint over: every later taker gets
  // this error (the ranks that already restored train from a step this one cannot give).
  Status lost;
  uint32_t world_size = 0;  // of the ranks it was made for
  std::string run_id;       // their run: a rank of another run does not take it
  std::chrono::steady_clock::time_point made{};
};

// What a rank can restore (Daemon::Restorable), for its job to agree on a step.
struct RestoreCandidates {
  std::vector<int64_t> memory_steps;  // its memory checkpoints here, verified, newest first
  int64_t disk_step = 0;              // the job's newest complete checkpoint on disk; 0: none
  std::string extra;                  // with extra_of: that memory step's extra state (DiskExtra: the disk one's)
};

struct RestoreOutcome {
  bool found = false;
  int64_t step = 0;
  // With found false: the job's ranks decided that none of them restores anything, and the caller
  // does not look for a checkpoint again (one completed since would be taken by some ranks only).
  bool none_decided = false;
  SlotTicket ticket;
  std::string extra;
  uint64_t bytes_read = 0;
  SlotTier tier = SlotTier::kDisk;  // kMemory: handed over from a memory checkpoint, no file read
  std::string from_peer;            // with kMemory: fetched from this peer's replica (HOST:PORT) first
  bool from_parity = false;         // with kMemory: rebuilt from the parity group first (--ec-group)
  // A memory checkpoint handed over unverified (RestoreWant::verify_in_client): the checksum chunk
  // size and, per tensor of the slot, where it lies and its chunks' checksums. Empty otherwise.
  struct TensorSums {
    uint64_t slot_offset = 0;
    uint64_t bytes = 0;
    std::vector<uint64_t> sums;
  };
  uint64_t chunk_bytes = 0;
  std::vector<TensorSums> tensor_sums;
};

// Daemon::GetEma: the current EMA copied into a slot (RESTORING until ReleaseSlot).
// initialized=false: no update yet.
struct EmaCopy {
  bool initialized = false;
  int64_t step = -1;
  SlotTicket ticket;
};

// Daemon::CountSessions: jobs, ranks and connected ranks.
struct SessionCounts {
  size_t jobs = 0, ranks = 0, connected = 0;
};

}  // namespace flashckpt

// What a committed snapshot carries through the pipeline (daemon/pipeline/ema_stage.h, writer.h)
// besides its bytes: the slot it is in, and for a memory checkpoint what a restore from it hands
// over. The slot table that hands the tickets out is the core's (daemon/core/slots.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "common/format/signal.h"
#include "common/format/slot_checksums.h"
#include "daemon/pipeline/ema.h"

namespace flashckpt {

// A slot of a rank's segment as handed out: its index and the generation of that hand-out.
struct SlotTicket {
  uint32_t slot = 0;
  uint64_t generation = 0;
};

// A memory checkpoint kept in a slot: what a restore from it hands over besides the tensors, and the
// checksums computed after its commit.
struct ResidentCheckpoint {
  int64_t step = -1;
  Attempt attempt;  // of the process that saved it
  uint32_t world_size = 1;
  std::string extra;
  SlotChecksums sums;
  // A rank with EMA: the EMA as of this step, whose image (stamped, as for a persisted step) lies in
  // the slot's EMA room, with the checksums of that image; a restore loads it into the rank's EMA.
  std::optional<EmaState> ema;
  SlotChecksums ema_sums;
  // Fetched from this peer's replica (HOST:PORT, MemoryTier::FetchPeerReplica); empty: taken here.
  std::string from_peer;
  // Rebuilt from the parity group's blocks and shares (--ec-group) rather than fetched whole;
  // from_peer then names the members it came from.
  bool from_parity = false;
  // Set before it is kept, when it must not be kept after all: a later BeginSnapshot or restore
  // left its step behind, its trainer died before its copies finished, or the EMA stage could not
  // compute its checksums. The EMA stage then skips it. Atomic: the stage's thread reads and sets
  // it without the daemon's lock; mutable: set through the slot table's const view as well.
  mutable std::atomic<bool> dropped{false};
};

}  // namespace flashckpt

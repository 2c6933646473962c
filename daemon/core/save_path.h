// The save path: BeginSnapshot hands out a slot, Commit records it and sends it down the pipeline
// (save.cc), which runs one way, commit -> EMA stage -> writer -> catalog, and reports each snapshot
// back once (persist.cc): the writer's completion (OnPersisted) for a persisted one, the EMA stage's
// (OnStageDone) for one that is not.
// A unit of the core (core.h): its state is the Core's, guarded by Core::mu_.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "daemon/core/core.h"
#include "daemon/core/outcomes.h"
#include "daemon/core/registration.h"

namespace flashckpt {

class SavePath {
 public:
  explicit SavePath(Core& core) : c_(core) {}
  SavePath(const SavePath&) = delete;
  SavePath& operator=(const SavePath&) = delete;

  // Daemon's calls of the same names: daemon.h states their contracts.
  Result<SlotTicket> BeginSnapshot(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout,
                                   SlotTier tier = SlotTier::kDisk) EXCLUDES(c_.mu_);
  Status Commit(const std::string& session_id, const SlotTicket& ticket, int64_t step, bool persist,
                std::optional<double> loss, std::string extra) EXCLUDES(c_.mu_);
  Status AbortSnapshot(const std::string& session_id, const SlotTicket& ticket) EXCLUDES(c_.mu_);
  Result<WaitResult> WaitPersisted(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout) EXCLUDES(c_.mu_);
  // The writer's completion of a persisted snapshot. `session_id`: the session that committed the
  // step (a failure counts as fatal for it only). `process`: the rank's process (RankState::process)
  // that committed it. `once_written`: the memory checkpoint it becomes once written, or null.
  void OnPersisted(const std::string& job, uint32_t rank, const std::string& session_id, uint64_t process,
                   const std::shared_ptr<RankSegment>& segment, SlotTicket ticket, int64_t step,
                   const std::shared_ptr<const ResidentCheckpoint>& once_written, const Status& status,
                   uint64_t bytes, double seconds) EXCLUDES(c_.mu_);
  // The EMA stage's completion of a snapshot that is not persisted: an EMA-only snapshot's slot is
  // freed, a memory checkpoint is kept in its slot (or not, when dropped).
  void OnStageDone(EmaJob job) EXCLUDES(c_.mu_);
  // The persist request of a committed slot; `done` reports to OnPersisted.
  // `session_id`: the committing session ("" for a snapshot adopted after a restart).
  PersistRequest MakePersistRequest(const std::string& job, uint32_t rank, const std::string& session_id, uint64_t process,
                                    uint32_t world_size, const Attempt& attempt,
                                    const std::shared_ptr<RankSegment>& segment, const SlotTicket& ticket, int64_t step,
                                    std::string extra,
                                    std::shared_ptr<const ResidentCheckpoint> once_written = nullptr);
  // Sends a COMMITTED slot down the pipeline: a persisted snapshot goes PERSISTING now (keeping
  // `job.resident` once written), then to the EMA stage when it has an EMA (`job.ema`) or checksums
  // (`job.resident`), else straight to the writer; a snapshot with none of these is done at once.
  // Requires mu_.
  static Status SendOnLocked(Core& c_, EmaJob job) REQUIRES(c_.mu_);
  // Gives a FILLING slot to the rank (BeginSnapshot): resets its copy progress, mirrors it. Needs mu_.
  static void HandOut(Core& c_, RankState* rank, const SlotTicket& ticket, int64_t step) REQUIRES(c_.mu_);

 private:
  Core& c_;
};

}  // namespace flashckpt

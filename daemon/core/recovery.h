// Crash recovery: adopting the slot segments a predecessor left, as its state directory describes
// them (recovery.cc).
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

struct AdoptedCommit;  // recovery.cc

class Recovery {
 public:
  explicit Recovery(Core& core) : c_(core) {}
  Recovery(const Recovery&) = delete;
  Recovery& operator=(const Recovery&) = delete;

  // Crash recovery (daemon/core/recovery.cc).
  Status AdoptSegments() EXCLUDES(c_.mu_);
  Status AdoptSegment(const StateDir::Adoptable& record) EXCLUDES(c_.mu_);
  // AdoptSegment's steps, on a segment not yet published: its commit records (the snapshots to
  // replay; those already durable are released), its memory records (the memory-only steps held),
  // then the segment published in the job table with its snapshots queued.
  Result<std::vector<AdoptedCommit>> AdoptCommits(const StateDir::Adoptable& record, const Registration& reg,
                                                  const std::shared_ptr<RankSegment>& segment);
  std::vector<int64_t> AdoptMemoryRecords(const StateDir::Adoptable& record, const Registration& reg,
                                          const std::shared_ptr<RankSegment>& segment);
  void PublishAdopted(const StateDir::Adoptable& record, const Registration& reg,
                      const std::shared_ptr<RankSegment>& segment, std::vector<AdoptedCommit> pending,
                      const std::vector<int64_t>& memory_steps) EXCLUDES(c_.mu_);
  // Removes the temporaries (TemporaryPath) this node's writers left in the job's checkpoint
  // directories and that are gone (a zombie or a pid another program reuses counts as gone:
  // IsTemporaryWriterAlive); another node's are left alone (RemoveStaleTemporaries).
  void RemoveStaleTemporaries(const std::string& job);

 private:
  Core& c_;
};

}  // namespace flashckpt

// The daemons of a job agree on the step its ranks restore when they are not all served by one
// daemon (several nodes, or several daemons on one), through the root they share: no trainer
// collective, no coordinator.
//
// The files, in <root>/<job>/.resume/:
//   view-<daemon>.json   one per daemon taking part: the ranks of the job that asked it for the
//                        latest step, each with its process token and the memory steps the daemon
//                        holds of it (its own and replicas fetched from peers), and the newest
//                        complete step on disk as it sees it. Rewritten while the daemon waits (at
//                        least every kViewRefresh), so a view not rewritten for kViewFresh belongs
//                        to a resume that is over; removed once the daemon has the decision.
//   plan-<hash>.json     the decision: the step, from memory or disk, and the token of every rank
//                        it was made for. <hash> is that of the ranks' tokens, so the daemons that
//                        see the same ranks name one file: the first to create it (O_EXCL) decides,
//                        the others read its decision. A daemon whose asking ranks' tokens are all in
//                        a plan file takes that plan, also after the views it came from are gone.
// The decision, once every rank 0..world-1 is in a fresh view: the newest memory step every rank
// holds, unless the disk has a newer complete one; then the disk's (none: nothing to restore).
//
// What the files say is checked as input from another node: sizes, ranks within the world, steps,
// tokens. A memory step a view claims falsely fails that rank's restore (the daemon verifies the
// checksums of what it hands over), and the job restarts and agrees again.
//
// Wall-clock times in the views are compared with this daemon's clock: nodes' clocks must agree to
// well within kViewFresh (NTP does).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "common/io/io_env.h"

namespace flashckpt {

// One rank of a job as one daemon sees it.
struct RankView {
  uint32_t rank = 0;
  std::string token;           // its trainer process (unique across daemons and their restarts) and
                               // how far it saved: a process that saved since asks anew
  std::vector<int64_t> steps;  // memory checkpoints the daemon holds of it, newest first
};

struct AgreedPlan {
  bool found = false;   // false: neither memory nor disk has a step every rank can restore
  int64_t step = 0;
  bool memory = false;  // false: the disk's complete checkpoint `step`
  std::string file;     // the plan file it was read from or written to
};

class ResumeAgreement {
 public:
  static constexpr std::chrono::milliseconds kViewRefresh{250};
  static constexpr std::chrono::milliseconds kViewFresh{5000};
  static constexpr uint32_t kMaxWorld = 1u << 20;
  static constexpr size_t kMaxFileBytes = 64u << 20;
  static constexpr size_t kMaxSteps = 64;  // per rank in a view: the newest

  // `dir`: <root>/<job>/.resume; `daemon`: this daemon's name among those of the job (unique:
  // a random token per daemon process).
  ResumeAgreement(std::string dir, std::string daemon, IoEnv* io, const Clock& clock);

  // One round: publishes this daemon's view (`mine`: the ranks that asked it, of a job of `world`
  // ranks; `disk`: the newest complete step it sees, 0: none), then looks for the decision.
  // Returns it, or nullopt while some rank of the world has no fresh view yet.
  Result<std::optional<AgreedPlan>> Round(uint32_t world, const std::vector<RankView>& mine, int64_t disk);

  // Removes this daemon's view (done with it), and plan files, other daemons' views and temporaries
  // a writer left (it died writing) older than `keep`.
  void Withdraw(std::chrono::milliseconds keep = std::chrono::minutes(10));

  // The ranks (of 0..world-1) that have no fresh view in the last round: for an error message.
  const std::vector<uint32_t>& missing() const { return missing_; }

 private:
  Result<std::optional<AgreedPlan>> FindPlan(uint32_t world, const std::vector<RankView>& mine);
  Status PublishView(uint32_t world, const std::vector<RankView>& mine, int64_t disk);

  std::string dir_, daemon_;
  IoEnv* io_;
  const Clock& clock_;
  std::string last_view_;  // what PublishView wrote last, and when
  Clock::TimePoint last_written_{};
  std::vector<uint32_t> missing_;
};

}  // namespace flashckpt

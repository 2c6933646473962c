// The daemon's periodic chores, each on a thread of its own: the idle release (--idle-release) and
// the sweep of steps whose signals are all there (--sweep-interval). The housekeeper owns the
// threads and their timing; each chore is one pass of the daemon's (it reads and changes the job
// table under the daemon's lock), given as a function.
#pragma once

#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "common/base/clock.h"
#include "common/base/mutex.h"
#include "common/base/status.h"

namespace flashckpt {

struct HousekeeperOptions {
  struct Chore {
    std::chrono::milliseconds period{0};  // between passes; 0: the chore never runs
    bool at_start = false;                // one pass as soon as Start runs, then every period
    std::function<void()> pass;
  };
  std::vector<Chore> chores;
};

class Housekeeper {
 public:
  explicit Housekeeper(HousekeeperOptions options);
  ~Housekeeper();  // Stop()
  Housekeeper(const Housekeeper&) = delete;
  Housekeeper& operator=(const Housekeeper&) = delete;

  // Starts a thread for each chore with a period.
  Status Start() EXCLUDES(mu_);
  // Wakes the threads and joins them. A pass under way finishes first: the daemon's passes look at
  // its own stopping flag and end early, so `deadline` is not waited for. Idempotent.
  void Stop(Clock::TimePoint deadline = Clock::TimePoint::max()) EXCLUDES(mu_);

 private:
  void Run(const HousekeeperOptions::Chore& chore) EXCLUDES(mu_);

  const HousekeeperOptions options_;
  Mutex mu_;
  CondVar cv_;  // the stop
  bool stopping_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // Start and Stop only
};

}  // namespace flashckpt

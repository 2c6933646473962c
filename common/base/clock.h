// Where the daemon reads the time: one Clock, given in DaemonConfig::clock and passed on to each
// worker, so that tests can move time ahead (tests/support/offset_clock.h) instead of sleeping
// through an idle release or a stale resume plan.
//
// Deadlines are time points of the clock's Now(). A wait turns the deadline into a duration against
// the same clock (WaitUntil), so a clock moved ahead shortens a wait as real time passing would.
#pragma once

#include <chrono>
#include <cstdint>

#include "common/base/mutex.h"

namespace flashckpt {

class Clock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  virtual ~Clock() = default;

  // Monotonic time: ages, timeouts, deadlines.
  virtual TimePoint Now() const = 0;
  // The wall clock in ms since the Unix epoch: times recorded for other nodes and processes.
  virtual int64_t WallMs() const = 0;

  // Waits on `cv` (with `lock` held) until woken or until this clock reads `deadline`
  // (TimePoint::max(): no deadline). False when the deadline has passed. Spurious wake-ups happen.
  bool WaitUntil(CondVar* cv, MutexLock* lock, TimePoint deadline) const;

  // The operating system's clocks (steady_clock and system_clock).
  static const Clock& Real();
};

}  // namespace flashckpt

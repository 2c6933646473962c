// A Clock (common/base/clock.h) that runs with the operating system's clocks but can be moved ahead:
// a test makes an hour pass at once (an idle release, a stale resume plan) instead of sleeping.
#pragma once

#include <atomic>
#include <chrono>

#include "common/base/clock.h"

namespace flashckpt {

class OffsetClock final : public Clock {
 public:
  TimePoint Now() const override { return Clock::Real().Now() + std::chrono::nanoseconds(offset_ns_.load()); }
  int64_t WallMs() const override { return Clock::Real().WallMs() + offset_ns_.load() / 1000000; }
  // Moves both clocks ahead by `by`. Waits under way see it when they next wake.
  void Advance(std::chrono::nanoseconds by) { offset_ns_ += by.count(); }

 private:
  std::atomic<int64_t> offset_ns_{0};
};

}  // namespace flashckpt

#include "common/base/clock.h"

#include <algorithm>

namespace flashckpt {
namespace {

class RealClock final : public Clock {
 public:
  TimePoint Now() const override { return std::chrono::steady_clock::now(); }
  int64_t WallMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

}  // namespace

bool Clock::WaitUntil(CondVar* cv, MutexLock* lock, TimePoint deadline) const {
  if (deadline == TimePoint::max()) {
    cv->Wait(lock);
    return true;
  }
  const TimePoint now = Now();
  if (now >= deadline) return false;
  // Capped so that the library's own now() + duration cannot overflow; the caller's loop waits again.
  cv->WaitFor(lock, std::min<std::chrono::steady_clock::duration>(deadline - now, std::chrono::hours(24)));
  return Now() < deadline;
}

const Clock& Clock::Real() {
  static const RealClock clock;
  return clock;
}

}  // namespace flashckpt

#include "daemon/core/housekeeper.h"

namespace flashckpt {

Housekeeper::Housekeeper(HousekeeperOptions options) : options_(std::move(options)) {}

Housekeeper::~Housekeeper() { Stop(); }

Status Housekeeper::Start() {
  {
    MutexLock lock(&mu_);
    if (stopping_) return Unavailable("the housekeeper has stopped");
  }
  if (!threads_.empty()) return Status::OK();
  for (const HousekeeperOptions::Chore& chore : options_.chores) {
    if (chore.period.count() <= 0 || !chore.pass) continue;
    threads_.emplace_back([this, &chore] { Run(chore); });
  }
  return Status::OK();
}

void Housekeeper::Stop(Clock::TimePoint /*deadline*/) {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.NotifyAll();
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

void Housekeeper::Run(const HousekeeperOptions::Chore& chore) {
  MutexLock lock(&mu_);
  for (bool first = true; !stopping_; first = false) {
    if (!first || !chore.at_start) {
      cv_.WaitFor(&lock, chore.period);
      if (stopping_) break;
    }
    lock.Unlock();
    chore.pass();
    lock.Lock();
  }
}

}  // namespace flashckpt

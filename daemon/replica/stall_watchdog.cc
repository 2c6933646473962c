#include "daemon/replica/stall_watchdog.h"

#include <algorithm>

#include "common/base/log.h"

namespace flashckpt {
namespace {
// progress_'s mark of a call the watchdog cancelled.
constexpr std::chrono::steady_clock::time_point kStalled = std::chrono::steady_clock::time_point::max();
}  // namespace

StallWatchdog::StallWatchdog(std::string logger, std::string what, std::chrono::milliseconds stall_timeout)
    : logger_(std::move(logger)), what_(std::move(what)), stall_timeout_(stall_timeout) {
  thread_ = std::thread([this] { Run(); });
}

StallWatchdog::~StallWatchdog() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.NotifyAll();
  thread_.join();
}

void StallWatchdog::Run() {
  // Looks a few times per stall time: a stalled call is cancelled within 1.25 times of it.
  const auto every = std::max<std::chrono::milliseconds>(stall_timeout_ / 4, std::chrono::milliseconds(10));
  MutexLock lock(&mu_);
  while (!stopping_) {
    cv_.WaitFor(&lock, every);
    const auto now = std::chrono::steady_clock::now();
    for (auto& [ctx, last] : progress_) {
      if (last == kStalled || now - last < stall_timeout_) continue;
      last = kStalled;  // once per call
      stalled_.fetch_add(1);
      Logger(logger_)->warn("{} from={} cancelled: no progress for {} ms; its memory is given back", what_,
                            ctx->peer(), stall_timeout_.count());
      ctx->TryCancel();
    }
  }
}

StallWatchdog::Watched::Watched(StallWatchdog* dog, grpc::ServerContext* ctx) : dog_(dog), ctx_(ctx) { Progress(); }

void StallWatchdog::Watched::Progress() {
  MutexLock lock(&dog_->mu_);
  auto [it, added] = dog_->progress_.try_emplace(ctx_, std::chrono::steady_clock::now());
  if (!added && it->second != kStalled) it->second = std::chrono::steady_clock::now();
}

bool StallWatchdog::Watched::Stalled() const {
  MutexLock lock(&dog_->mu_);
  auto it = dog_->progress_.find(ctx_);
  return it != dog_->progress_.end() && it->second == kStalled;
}

StallWatchdog::Watched::~Watched() {
  MutexLock lock(&dog_->mu_);
  dog_->progress_.erase(ctx_);
}

}  // namespace flashckpt

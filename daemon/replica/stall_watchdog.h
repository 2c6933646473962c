// Cancels server calls that stop making progress: a peer that opens a stream and then sends nothing
// (or, for a fetch, takes nothing) holds no slot, and no memory, for longer than the stall timeout.
// Used by the replica and parity listeners for their pushes, and by the replica listener for its
// fetches.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <thread>

#include "common/base/mutex.h"

namespace flashckpt {

class StallWatchdog {
 public:
  // `what` names the calls in the log line when one is cancelled ("replica push"), under `logger`.
  StallWatchdog(std::string logger, std::string what, std::chrono::milliseconds stall_timeout);
  ~StallWatchdog() EXCLUDES(mu_);  // stops the thread; every Watched is gone by then
  StallWatchdog(const StallWatchdog&) = delete;
  StallWatchdog& operator=(const StallWatchdog&) = delete;

  // A call watched from construction to destruction: Progress() each time something arrives. One
  // that made none for the stall timeout is cancelled (ServerContext::TryCancel) once, and counted.
  class Watched {
   public:
    Watched(StallWatchdog* dog, grpc::ServerContext* ctx);
    ~Watched();
    Watched(const Watched&) = delete;
    Watched& operator=(const Watched&) = delete;
    void Progress();
    // Whether the watchdog cancelled the call: a read that failed then failed for that.
    bool Stalled() const;

   private:
    StallWatchdog* dog_;
    grpc::ServerContext* ctx_;
  };

  std::chrono::milliseconds timeout() const { return stall_timeout_; }
  uint64_t stalled() const { return stalled_.load(); }

 private:
  void Run() EXCLUDES(mu_);

  const std::string logger_, what_;
  const std::chrono::milliseconds stall_timeout_;
  std::atomic<uint64_t> stalled_{0};
  mutable Mutex mu_;
  CondVar cv_;  // the stop
  bool stopping_ GUARDED_BY(mu_) = false;
  // The calls watched and when each last made progress; an entry lives exactly as long as its
  // Watched, so the thread may cancel its context under mu_.
  std::map<grpc::ServerContext*, std::chrono::steady_clock::time_point> progress_ GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace flashckpt

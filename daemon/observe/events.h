// Events: what happened to snapshots and checkpoints, for watchers (the WatchEvents stream,
// `flashckpt watch`) and for the metrics (daemon/observe/metrics.h).
//
// The daemon publishes one DaemonEvent (flashckpt/daemon_types.h) wherever its log says something
// happened to a snapshot or a
// checkpoint: committed, skipped, EMA updated, persisted, failed, complete, deleted. Publish never
// blocks and never waits for a watcher: each watcher has a bounded queue, and one that falls
// behind loses its oldest events and is told how many with a kEventsLost event before the next
// one it reads. The number of watchers is bounded too.
//
// Thread safety: every method may be called from any thread. The hub's mutex is a leaf lock:
// Publish may be called with the daemon's own mutex held and calls nothing outside the hub.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <string>

#include "common/base/mutex.h"
#include "common/base/status.h"
#include "flashckpt/daemon_types.h"

namespace flashckpt {

class EventHub {
  struct Watcher;

 public:
  static constexpr size_t kDefaultQueueCapacity = 1024;
  static constexpr size_t kDefaultMaxWatchers = 32;

  enum class Wait { kEvent, kTimeout, kClosed };

  // A watcher's end. Move-only; unsubscribes in its destructor. Used by one thread at a time.
  class Subscription {
   public:
    Subscription(Subscription&&) noexcept = default;
    Subscription& operator=(Subscription&&) noexcept = default;
    Subscription(const Subscription&) = delete;
    Subscription& operator=(const Subscription&) = delete;
    ~Subscription();

    // Waits until `deadline` for the next event of this watcher's job (or of every job). kClosed
    // once the hub is closed: events still queued are dropped then, as the daemon is stopping.
    Wait Next(DaemonEvent* event, std::chrono::steady_clock::time_point deadline);

   private:
    friend class EventHub;
    Subscription(EventHub* hub, std::shared_ptr<Watcher> watcher) : hub_(hub), watcher_(std::move(watcher)) {}
    EventHub* hub_ = nullptr;
    std::shared_ptr<Watcher> watcher_;
  };

  explicit EventHub(size_t queue_capacity = kDefaultQueueCapacity, size_t max_watchers = kDefaultMaxWatchers);

  // A new watcher of `job`'s events (empty: every job). kResourceExhausted when max_watchers are
  // already watching, kUnavailable once closed.
  Result<Subscription> Subscribe(std::string job) EXCLUDES(mu_);
  // Queues `event` for every watcher of its job; stamps unix_seconds when it is 0.
  void Publish(DaemonEvent event) EXCLUDES(mu_);
  // Wakes every watcher with kClosed and refuses new ones. Idempotent.
  void Close() EXCLUDES(mu_);

  size_t watchers() const EXCLUDES(mu_);
  // Events dropped for watchers that fell behind, since the start.
  uint64_t dropped() const EXCLUDES(mu_);

 private:
  struct Watcher {
    std::string job;
    // Guarded by EventHub::mu_ (which the analysis cannot name from here: only the hub's methods
    // and Subscription::Next, under that lock, touch them).
    std::deque<DaemonEvent> queue;
    uint64_t lost = 0;  // dropped since the watcher last read
    CondVar cv;
  };
  void Unsubscribe(const std::shared_ptr<Watcher>& watcher) EXCLUDES(mu_);

  const size_t capacity_;
  const size_t max_watchers_;
  mutable Mutex mu_;
  std::list<std::shared_ptr<Watcher>> watchers_ GUARDED_BY(mu_);
  bool closed_ GUARDED_BY(mu_) = false;
  uint64_t dropped_ GUARDED_BY(mu_) = 0;
};

// The current time as Event.unix_seconds.
double UnixSeconds();

}  // namespace flashckpt

// Events: what happened to snapshots and checkpoints, for watchers (the WatchEvents stream,
// `flashckpt watch`) and for the metrics (daemon/metrics.h).
//
// The daemon publishes one v1::Event wherever its log says something happened to a snapshot or a
// checkpoint: committed, skipped, EMA updated, persisted, failed, complete, deleted. Publish never
// blocks and never waits for a watcher: each watcher has a bounded queue, and one that falls
// behind loses its oldest events and is told how many with an EVENTS_LOST event before the next
// one it reads. The number of watchers is bounded too.
//
// Thread safety: every method may be called from any thread. The hub's mutex is a leaf lock:
// Publish may be called with the daemon's own mutex held and calls nothing outside the hub.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"
#include "flashckpt.pb.h"

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
    Wait Next(v1::Event* event, std::chrono::steady_clock::time_point deadline);

   private:
    friend class EventHub;
    Subscription(EventHub* hub, std::shared_ptr<Watcher> watcher) : hub_(hub), watcher_(std::move(watcher)) {}
    EventHub* hub_ = nullptr;
    std::shared_ptr<Watcher> watcher_;
  };

  explicit EventHub(size_t queue_capacity = kDefaultQueueCapacity, size_t max_watchers = kDefaultMaxWatchers);

  // A new watcher of `job`'s events (empty: every job). kResourceExhausted when max_watchers are
  // already watching, kUnavailable once closed.
  Result<Subscription> Subscribe(std::string job);
  // Queues `event` for every watcher of its job; stamps unix_seconds when it is 0.
  void Publish(v1::Event event);
  // Wakes every watcher with kClosed and refuses new ones. Idempotent.
  void Close();

  size_t watchers() const;
  // Events dropped for watchers that fell behind, since the start.
  uint64_t dropped() const;

 private:
  struct Watcher {
    std::string job;
    std::deque<v1::Event> queue;  // guarded by EventHub::mu_
    uint64_t lost = 0;            // guarded by EventHub::mu_: dropped since the watcher last read
    std::condition_variable cv;
  };
  void Unsubscribe(const std::shared_ptr<Watcher>& watcher);

  const size_t capacity_;
  const size_t max_watchers_;
  mutable std::mutex mu_;
  std::list<std::shared_ptr<Watcher>> watchers_;  // guarded by mu_
  bool closed_ = false;                           // guarded by mu_
  uint64_t dropped_ = 0;                          // guarded by mu_
};

// The current time as Event.unix_seconds.
double UnixSeconds();

}  // namespace flashckpt

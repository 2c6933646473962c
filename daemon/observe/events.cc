#include "daemon/observe/events.h"

#include <algorithm>

namespace flashckpt {

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

EventHub::EventHub(size_t queue_capacity, size_t max_watchers)
    : capacity_(std::max<size_t>(queue_capacity, 1)), max_watchers_(max_watchers) {}

Result<EventHub::Subscription> EventHub::Subscribe(std::string job) {
  MutexLock lock(&mu_);
  if (closed_) return Unavailable("the daemon is stopping");
  if (watchers_.size() >= max_watchers_) {
    return ResourceExhausted("already " + std::to_string(watchers_.size()) +
                             " event watchers, the most the daemon serves at once; stop one and retry");
  }
  auto watcher = std::make_shared<Watcher>();
  watcher->job = std::move(job);
  watchers_.push_back(watcher);
  return Subscription(this, std::move(watcher));
}

void EventHub::Publish(DaemonEvent event) {
  if (event.unix_seconds == 0) event.unix_seconds = UnixSeconds();
  MutexLock lock(&mu_);
  if (closed_) return;
  for (auto& w : watchers_) {
    if (!w->job.empty() && w->job != event.job) continue;
    if (w->queue.size() >= capacity_) {
      w->queue.pop_front();  // the oldest goes: a watcher wants to know what is happening now
      w->lost += 1;
      dropped_ += 1;
    }
    w->queue.push_back(event);
    w->cv.NotifyOne();
  }
}

void EventHub::Close() {
  MutexLock lock(&mu_);
  closed_ = true;
  for (auto& w : watchers_) w->cv.NotifyAll();
}

size_t EventHub::watchers() const {
  MutexLock lock(&mu_);
  return watchers_.size();
}

uint64_t EventHub::dropped() const {
  MutexLock lock(&mu_);
  return dropped_;
}

void EventHub::Unsubscribe(const std::shared_ptr<Watcher>& watcher) {
  MutexLock lock(&mu_);
  watchers_.remove(watcher);
}

EventHub::Subscription::~Subscription() {
  if (hub_ != nullptr && watcher_) hub_->Unsubscribe(watcher_);
}

EventHub::Wait EventHub::Subscription::Next(DaemonEvent* event, std::chrono::steady_clock::time_point deadline) {
  MutexLock lock(&hub_->mu_);
  Watcher& w = *watcher_;
  while (!hub_->closed_ && w.lost == 0 && w.queue.empty()) {
    if (!w.cv.WaitUntil(&lock, deadline)) break;
  }
  if (hub_->closed_) return Wait::kClosed;
  if (w.lost > 0) {
    // Before the first event after the gap, so the watcher knows where the gap is.
    *event = DaemonEvent{};
    event->kind = DaemonEvent::Kind::kEventsLost;
    event->unix_seconds = UnixSeconds();
    event->job = w.job;
    event->lost = w.lost;
    w.lost = 0;
    return Wait::kEvent;
  }
  if (w.queue.empty()) return Wait::kTimeout;
  *event = std::move(w.queue.front());
  w.queue.pop_front();
  return Wait::kEvent;
}

}  // namespace flashckpt

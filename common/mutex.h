// The mutex, scoped lock and condition variable that flashckpt's classes use: std::mutex and
// std::condition_variable with the annotations clang's thread-safety analysis checks
// (common/thread_annotations.h). A member is declared `T x_ GUARDED_BY(mu_);`, a method that needs
// the lock `void F() REQUIRES(mu_);`, and code takes it with `MutexLock lock(&mu_);`.
//
// Waiting: write the loop out, so that the analysis sees the guarded condition read under the lock
// (a predicate lambda would hide it):
//   while (!ready_) { if (!cv_.WaitUntil(&lock, deadline)) break; }
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "common/thread_annotations.h"

namespace flashckpt {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  // Tells the analysis that the caller holds the lock (where it cannot see it); checks nothing.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class MutexLock;
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` from construction to destruction; Unlock/Lock let a scope drop it for a while (to do
// I/O, to call out) and take it back.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : lock_(mu->mu_) {}
  ~MutexLock() RELEASE() {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() RELEASE() { lock_.unlock(); }
  void Lock() ACQUIRE() { lock_.lock(); }

 private:
  friend class CondVar;
  std::unique_lock<std::mutex> lock_;
};

// A condition variable waited on with a MutexLock held (the lock is released while waiting and held
// again on return). Spurious wake-ups happen: callers re-check their condition in a loop.
class CondVar {
 public:
  void Wait(MutexLock* lock) { cv_.wait(lock->lock_); }
  // False when `deadline` passed.
  bool WaitUntil(MutexLock* lock, std::chrono::steady_clock::time_point deadline) {
    return cv_.wait_until(lock->lock_, deadline) == std::cv_status::no_timeout;
  }
  template <class Rep, class Period>
  bool WaitFor(MutexLock* lock, std::chrono::duration<Rep, Period> timeout) {
    return cv_.wait_for(lock->lock_, timeout) == std::cv_status::no_timeout;
  }
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace flashckpt

// A gate for tests that must hold a daemon in the middle of a file-system call (an IoEnv that waits
// at it): closed, it holds every call that reaches Pass() until it opens again, and says whether one
// is waiting. A call is held at most `limit` (then it goes on, and timed_out() says so), so a test
// that forgot to open the gate, or a daemon that waits for something the held call holds, fails
// instead of hanging. The default limit is longer than any wait of the tests that use it, and shorter
// than ctest's timeout of a test.
#pragma once

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/base/mutex.h"
#include "common/io/io_env.h"

namespace flashckpt {

class IoGate {
 public:
  explicit IoGate(std::chrono::seconds limit = std::chrono::seconds(90)) : limit_(limit) {}

  void Close() {
    MutexLock lock(&mu_);
    closed_ = true;
  }
  void Open() {
    MutexLock lock(&mu_);
    closed_ = false;
    cv_.NotifyAll();
  }
  // Whether a call is held at the gate now.
  bool Holding() {
    MutexLock lock(&mu_);
    return held_ > 0;
  }
  // Whether a call went on because it had waited `limit` at the closed gate.
  bool timed_out() {
    MutexLock lock(&mu_);
    return timed_out_;
  }
  // Waits while the gate is closed, at most `limit`. Keeps errno.
  void Pass() {
    const int saved_errno = errno;
    MutexLock lock(&mu_);
    ++held_;
    const auto deadline = std::chrono::steady_clock::now() + limit_;
    while (closed_) {
      if (!cv_.WaitUntil(&lock, deadline)) {
        timed_out_ = timed_out_ || closed_;
        break;
      }
    }
    --held_;
    errno = saved_errno;
  }

 private:
  const std::chrono::seconds limit_;
  Mutex mu_;
  CondVar cv_;
  bool closed_ GUARDED_BY(mu_) = false;
  bool timed_out_ GUARDED_BY(mu_) = false;
  int held_ GUARDED_BY(mu_) = 0;
};

// Opens `gate` and joins `thread` (one held at the gate) when the test returns, also early through
// a failed assertion: the thread is never left joinable, nor held until the gate's limit.
class OpenAndJoinAtExit {
 public:
  OpenAndJoinAtExit(IoGate* gate, std::thread* thread) : gate_(gate), thread_(thread) {}
  ~OpenAndJoinAtExit() {
    gate_->Open();
    if (thread_->joinable()) thread_->join();
  }
  OpenAndJoinAtExit(const OpenAndJoinAtExit&) = delete;
  OpenAndJoinAtExit& operator=(const OpenAndJoinAtExit&) = delete;

 private:
  IoGate* const gate_;
  std::thread* const thread_;
};

// Holds at `gate` each open(2) of a path that contains `text`; every other call goes straight on.
class GatedOpens final : public ForwardingIoEnv {
 public:
  GatedOpens(IoGate* gate, std::string text) : gate_(gate), text_(std::move(text)) {}
  int Open(const std::string& path, int flags, unsigned mode) override {
    if (path.find(text_) != std::string::npos) gate_->Pass();
    return base()->Open(path, flags, mode);
  }

 private:
  IoGate* const gate_;
  const std::string text_;
};

// Holds at `gate` every listing of one directory (a path that ends with `suffix`), and counts the
// listings of it and the stats made under it: a call that read the root would be seen, however fast
// the disk. Every other call goes straight on.
class GatedListings final : public ForwardingIoEnv {
 public:
  GatedListings(IoGate* gate, std::string suffix) : gate_(gate), suffix_(std::move(suffix)) {}
  uint64_t listings() const { return listings_.load(); }
  uint64_t stats_under() const { return stats_under_.load(); }

  int Stat(const std::string& path, struct stat* st) override {
    if (path.find(suffix_ + "/") != std::string::npos) stats_under_.fetch_add(1);
    return base()->Stat(path, st);
  }
  // The listing is made first and handed back when the gate opens: what is created meanwhile is
  // not in it.
  int ListDir(const std::string& dir, std::vector<std::string>* names) override {
    const int rc = base()->ListDir(dir, names);
    if (dir.size() >= suffix_.size() && dir.compare(dir.size() - suffix_.size(), suffix_.size(), suffix_) == 0) {
      listings_.fetch_add(1);
      gate_->Pass();
    }
    return rc;
  }

 private:
  IoGate* const gate_;
  const std::string suffix_;
  std::atomic<uint64_t> listings_{0}, stats_under_{0};
};

}  // namespace flashckpt

#include "common/fault_injecting_io.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <thread>

namespace flashckpt {

void FaultInjectingIo::FailNth(Op op, uint64_t n, int err) {
  std::lock_guard<std::mutex> lock(mu_);
  Rule& r = rules_[static_cast<size_t>(op)];
  r.fail_at = n == 0 ? 0 : r.calls + n;
  r.fail_at_errno = err;
}

void FaultInjectingIo::FailEvery(Op op, int err) {
  std::lock_guard<std::mutex> lock(mu_);
  rules_[static_cast<size_t>(op)].fail_every_errno = err;
}

void FaultInjectingIo::ShortWrites(size_t max_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  short_writes_on_ = true;
  short_max_bytes_ = max_bytes;
}

void FaultInjectingIo::SlowWrites(std::chrono::milliseconds delay) {
  std::lock_guard<std::mutex> lock(mu_);
  write_delay_ = delay;
}

void FaultInjectingIo::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Rule& r : rules_) {
    r.fail_at = 0;
    r.fail_every_errno = 0;
  }
  short_writes_on_ = false;
  write_delay_ = std::chrono::milliseconds(0);
}

uint64_t FaultInjectingIo::calls(Op op) const {
  std::lock_guard<std::mutex> lock(mu_);
  return rules_[static_cast<size_t>(op)].calls;
}

uint64_t FaultInjectingIo::failures_injected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failures_;
}

uint64_t FaultInjectingIo::short_writes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return shorts_;
}

int FaultInjectingIo::CountAndDecideLocked(Op op) {
  Rule& r = rules_[static_cast<size_t>(op)];
  r.calls += 1;
  int err = 0;
  if (r.fail_at != 0 && r.calls == r.fail_at) {
    err = r.fail_at_errno;
    r.fail_at = 0;
  } else if (r.fail_every_errno != 0) {
    err = r.fail_every_errno;
  }
  if (err != 0) failures_ += 1;
  return err;
}

int FaultInjectingIo::Gate(Op op) {
  int err;
  {
    std::lock_guard<std::mutex> lock(mu_);
    err = CountAndDecideLocked(op);
  }
  if (err == 0) return 0;
  errno = err;
  return -1;
}

ssize_t FaultInjectingIo::Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) {
  int err;
  std::chrono::milliseconds delay;
  bool shorten;
  size_t max_bytes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    err = CountAndDecideLocked(Op::kWrite);
    delay = write_delay_;
    shorten = short_writes_on_;
    max_bytes = short_max_bytes_;
  }
  if (delay.count() > 0) std::this_thread::sleep_for(delay);
  if (err != 0) {
    errno = err;
    return -1;
  }
  if (shorten && bytes > max_bytes) {
    constexpr size_t kPage = 4096;
    const int flags = ::fcntl(fd, F_GETFL);
    if (max_bytes > 0 && flags >= 0 && (flags & O_DIRECT) != 0) max_bytes = std::max(kPage, max_bytes / kPage * kPage);
    if (max_bytes < bytes) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        shorts_ += 1;
      }
      if (max_bytes == 0) return 0;
      bytes = max_bytes;
    }
  }
  return base_->Pwrite(fd, buf, bytes, offset);
}

int FaultInjectingIo::Ftruncate(int fd, uint64_t bytes) {
  if (Gate(Op::kTruncate) != 0) return -1;
  return base_->Ftruncate(fd, bytes);
}

int FaultInjectingIo::Fdatasync(int fd) {
  if (Gate(Op::kDataSync) != 0) return -1;
  return base_->Fdatasync(fd);
}

int FaultInjectingIo::Fsync(int fd) {
  if (Gate(Op::kDirSync) != 0) return -1;
  return base_->Fsync(fd);
}

int FaultInjectingIo::Rename(const std::string& from, const std::string& to) {
  if (Gate(Op::kRename) != 0) return -1;
  return base_->Rename(from, to);
}

}  // namespace flashckpt

#include "support/fault_injecting_io.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <thread>

namespace flashckpt {

void FaultInjectingIo::FailNth(Op op, uint64_t n, int err) {
  MutexLock lock(&mu_);
  Rule& r = rules_[static_cast<size_t>(op)];
  r.fail_at = n == 0 ? 0 : r.calls + n;
  r.fail_at_errno = err;
}

void FaultInjectingIo::FailEvery(Op op, int err, std::string path_contains) {
  MutexLock lock(&mu_);
  rules_[static_cast<size_t>(op)].fail_every_errno = err;
  rules_[static_cast<size_t>(op)].fail_every_path = std::move(path_contains);
}

void FaultInjectingIo::Slow(Op op, std::chrono::milliseconds delay) {
  MutexLock lock(&mu_);
  if (op == Op::kWrite) write_delay_ = delay;
  rules_[static_cast<size_t>(op)].delay = delay;
}

void FaultInjectingIo::ShortWrites(size_t max_bytes) {
  MutexLock lock(&mu_);
  short_writes_on_ = true;
  short_max_bytes_ = max_bytes;
}

void FaultInjectingIo::SlowWrites(std::chrono::milliseconds delay) {
  MutexLock lock(&mu_);
  write_delay_ = delay;
}

void FaultInjectingIo::Clear() {
  MutexLock lock(&mu_);
  for (Rule& r : rules_) {
    r.fail_at = 0;
    r.fail_every_errno = 0;
    r.fail_every_path.clear();
    r.delay = std::chrono::milliseconds(0);
  }
  short_writes_on_ = false;
  write_delay_ = std::chrono::milliseconds(0);
}

uint64_t FaultInjectingIo::calls(Op op) const {
  MutexLock lock(&mu_);
  return rules_[static_cast<size_t>(op)].calls;
}

uint64_t FaultInjectingIo::failures_injected() const {
  MutexLock lock(&mu_);
  return failures_;
}

uint64_t FaultInjectingIo::short_writes() const {
  MutexLock lock(&mu_);
  return shorts_;
}

int FaultInjectingIo::CountAndDecideLocked(Op op, const std::string* path) {
  Rule& r = rules_[static_cast<size_t>(op)];
  r.calls += 1;
  int err = 0;
  if (r.fail_at != 0 && r.calls == r.fail_at) {
    err = r.fail_at_errno;
    r.fail_at = 0;
  } else if (r.fail_every_errno != 0 &&
             (r.fail_every_path.empty() || path == nullptr || path->find(r.fail_every_path) != std::string::npos)) {
    err = r.fail_every_errno;
  }
  if (err != 0) failures_ += 1;
  return err;
}

int FaultInjectingIo::Gate(Op op, const std::string* path) {
  int err;
  std::chrono::milliseconds delay;
  {
    MutexLock lock(&mu_);
    err = CountAndDecideLocked(op, path);
    delay = rules_[static_cast<size_t>(op)].delay;
  }
  if (delay.count() > 0) std::this_thread::sleep_for(delay);
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
    MutexLock lock(&mu_);
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
        MutexLock lock(&mu_);
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
  if (Gate(Op::kRename, &to) != 0) return -1;
  return base_->Rename(from, to);
}

int FaultInjectingIo::Open(const std::string& path, int flags, unsigned mode) {
  if (Gate(Op::kOpen, &path) != 0) return -1;
  return base_->Open(path, flags, mode);
}

ssize_t FaultInjectingIo::Pread(int fd, void* buf, size_t bytes, uint64_t offset) {
  if (Gate(Op::kRead) != 0) return -1;
  return base_->Pread(fd, buf, bytes, offset);
}

int FaultInjectingIo::Stat(const std::string& path, struct stat* st) {
  if (Gate(Op::kStat, &path) != 0) return -1;
  return base_->Stat(path, st);
}

int FaultInjectingIo::ListDir(const std::string& dir, std::vector<std::string>* names) {
  if (Gate(Op::kList, &dir) != 0) return -1;
  return base_->ListDir(dir, names);
}

int FaultInjectingIo::Unlink(const std::string& path) {
  if (Gate(Op::kUnlink, &path) != 0) return -1;
  return base_->Unlink(path);
}

int FaultInjectingIo::Mkdir(const std::string& path, unsigned mode) {
  if (Gate(Op::kMkdir, &path) != 0) return -1;
  return base_->Mkdir(path, mode);
}

}  // namespace flashckpt

#include "common/io/io_env.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace flashckpt {
namespace {

class PosixIoEnv final : public IoEnv {
 public:
  ssize_t Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) override {
    return ::pwrite(fd, buf, bytes, static_cast<off_t>(offset));
  }
  int Ftruncate(int fd, uint64_t bytes) override { return ::ftruncate(fd, static_cast<off_t>(bytes)); }
  int Fdatasync(int fd) override { return ::fdatasync(fd); }
  int Fsync(int fd) override { return ::fsync(fd); }
  int Rename(const std::string& from, const std::string& to) override { return ::rename(from.c_str(), to.c_str()); }
  int Open(const std::string& path, int flags, unsigned mode) override {
    return ::open(path.c_str(), flags, static_cast<mode_t>(mode));
  }
  ssize_t Pread(int fd, void* buf, size_t bytes, uint64_t offset) override {
    return ::pread(fd, buf, bytes, static_cast<off_t>(offset));
  }
  int Stat(const std::string& path, struct stat* st) override { return ::stat(path.c_str(), st); }
  int ListDir(const std::string& dir, std::vector<std::string>* names) override {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return -1;
    errno = 0;
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") names->push_back(std::move(n));
    }
    const int err = errno;
    ::closedir(d);
    if (err != 0) {
      errno = err;
      return -1;
    }
    return 0;
  }
  int Unlink(const std::string& path) override { return ::unlink(path.c_str()); }
  int Mkdir(const std::string& path, unsigned mode) override {
    return ::mkdir(path.c_str(), static_cast<mode_t>(mode));
  }
};

}  // namespace

IoEnv* IoEnv::Default() {
  static PosixIoEnv env;  // stateless: a shared instance is no mutable global
  return &env;
}

namespace {

// errno = ECANCELED and the failure value of the call.
int Refused() {
  errno = ECANCELED;
  return -1;
}

}  // namespace

ssize_t CancellableIo::Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) {
  return cancelled() ? Refused() : base()->Pwrite(fd, buf, bytes, offset);
}
int CancellableIo::Ftruncate(int fd, uint64_t bytes) { return cancelled() ? Refused() : base()->Ftruncate(fd, bytes); }
int CancellableIo::Fdatasync(int fd) { return cancelled() ? Refused() : base()->Fdatasync(fd); }
int CancellableIo::Fsync(int fd) { return cancelled() ? Refused() : base()->Fsync(fd); }
int CancellableIo::Rename(const std::string& from, const std::string& to) {
  return cancelled() ? Refused() : base()->Rename(from, to);
}

IoCounts CountingIo::Counts() const {
  IoCounts c;
  c.opens = opens_.load(std::memory_order_relaxed);
  c.stats = stats_.load(std::memory_order_relaxed);
  c.lists = lists_.load(std::memory_order_relaxed);
  c.reads = reads_.load(std::memory_order_relaxed);
  c.read_bytes = read_bytes_.load(std::memory_order_relaxed);
  c.writes = writes_.load(std::memory_order_relaxed);
  c.written_bytes = written_bytes_.load(std::memory_order_relaxed);
  c.syncs = syncs_.load(std::memory_order_relaxed);
  c.renames = renames_.load(std::memory_order_relaxed);
  c.unlinks = unlinks_.load(std::memory_order_relaxed);
  c.mkdirs = mkdirs_.load(std::memory_order_relaxed);
  c.truncates = truncates_.load(std::memory_order_relaxed);
  return c;
}

ssize_t CountingIo::Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) {
  const ssize_t n = base()->Pwrite(fd, buf, bytes, offset);
  Add(writes_);
  if (n > 0) Add(written_bytes_, static_cast<uint64_t>(n));
  return n;
}

int CountingIo::Ftruncate(int fd, uint64_t bytes) {
  Add(truncates_);
  return base()->Ftruncate(fd, bytes);
}

int CountingIo::Fdatasync(int fd) {
  Add(syncs_);
  return base()->Fdatasync(fd);
}

int CountingIo::Fsync(int fd) {
  Add(syncs_);
  return base()->Fsync(fd);
}

int CountingIo::Rename(const std::string& from, const std::string& to) {
  Add(renames_);
  return base()->Rename(from, to);
}

int CountingIo::Open(const std::string& path, int flags, unsigned mode) {
  Add(opens_);
  return base()->Open(path, flags, mode);
}

ssize_t CountingIo::Pread(int fd, void* buf, size_t bytes, uint64_t offset) {
  const ssize_t n = base()->Pread(fd, buf, bytes, offset);
  Add(reads_);
  if (n > 0) Add(read_bytes_, static_cast<uint64_t>(n));
  return n;
}

int CountingIo::Stat(const std::string& path, struct stat* st) {
  Add(stats_);
  return base()->Stat(path, st);
}

int CountingIo::ListDir(const std::string& dir, std::vector<std::string>* names) {
  Add(lists_);
  return base()->ListDir(dir, names);
}

int CountingIo::Unlink(const std::string& path) {
  Add(unlinks_);
  return base()->Unlink(path);
}

int CountingIo::Mkdir(const std::string& path, unsigned mode) {
  Add(mkdirs_);
  return base()->Mkdir(path, mode);
}

}  // namespace flashckpt

// The system calls a daemon makes on its checkpoint root behind a small interface (LevelDB `Env`), so
// that tests can make a write fail with ENOSPC on the 3rd chunk, a listing fail with ESTALE, a read
// with EIO, or any of them take 200 ms (tests/support/fault_injecting_io.h) while the code under test stays
// the code that runs in production.
//
// The durable write path (pwrite, ftruncate, fdatasync, fsync of a directory, rename) and the read
// and namespace calls of the catalog, the restore path and recovery (open, pread, stat, listing a
// directory, unlink, mkdir) go through it; so do the writes and removals of the records in the
// daemon's private state directory (daemon/core/state_dir.h), through an IoEnv of their own. Shared
// memory and sockets do not.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace flashckpt {

class IoEnv {
 public:
  virtual ~IoEnv() = default;

  // Each call behaves as the system call it is named after: it returns what that returns (-1 on
  // failure) and sets errno. Thread-safe: the writers call in from several threads at once.
  virtual ssize_t Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) = 0;
  virtual int Ftruncate(int fd, uint64_t bytes) = 0;
  virtual int Fdatasync(int fd) = 0;
  // fsync(2) of a directory fd, after a rename into it.
  virtual int Fsync(int fd) = 0;
  virtual int Rename(const std::string& from, const std::string& to) = 0;

  virtual int Open(const std::string& path, int flags, unsigned mode) = 0;
  virtual ssize_t Pread(int fd, void* buf, size_t bytes, uint64_t offset) = 0;
  virtual int Stat(const std::string& path, struct stat* st) = 0;
  // opendir(3) and readdir(3): the names in `dir` but "." and "..", appended to `names`.
  virtual int ListDir(const std::string& dir, std::vector<std::string>* names) = 0;
  virtual int Unlink(const std::string& path) = 0;
  virtual int Mkdir(const std::string& path, unsigned mode) = 0;

  // The real OS. Never null; lives as long as the process; stateless.
  static IoEnv* Default();
};

// Passes every call to `base` (not owned; it must outlive this object): the base of an IoEnv that
// changes only a few calls, overriding those and calling base() for what they pass on.
class ForwardingIoEnv : public IoEnv {
 public:
  explicit ForwardingIoEnv(IoEnv* base = IoEnv::Default()) : base_(base) {}

  ssize_t Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) override {
    return base_->Pwrite(fd, buf, bytes, offset);
  }
  int Ftruncate(int fd, uint64_t bytes) override { return base_->Ftruncate(fd, bytes); }
  int Fdatasync(int fd) override { return base_->Fdatasync(fd); }
  int Fsync(int fd) override { return base_->Fsync(fd); }
  int Rename(const std::string& from, const std::string& to) override { return base_->Rename(from, to); }
  int Open(const std::string& path, int flags, unsigned mode) override { return base_->Open(path, flags, mode); }
  ssize_t Pread(int fd, void* buf, size_t bytes, uint64_t offset) override {
    return base_->Pread(fd, buf, bytes, offset);
  }
  int Stat(const std::string& path, struct stat* st) override { return base_->Stat(path, st); }
  int ListDir(const std::string& dir, std::vector<std::string>* names) override { return base_->ListDir(dir, names); }
  int Unlink(const std::string& path) override { return base_->Unlink(path); }
  int Mkdir(const std::string& path, unsigned mode) override { return base_->Mkdir(path, mode); }

 protected:
  IoEnv* base() const { return base_; }

 private:
  IoEnv* const base_;
};

// Forwards every call to `base` until Cancel(); from then on each call that writes (pwrite, ftruncate,
// fdatasync, fsync, rename) fails with ECANCELED before it starts; reads, listings and unlinks go on.
// A durable write in progress (common/io/fs.h) thus stops at its next piece and takes its failure
// path: its temporaries are removed and nothing more is renamed into place. The writer abandons what
// it has not finished this way when the daemon's stop timeout runs out.
class CancellableIo final : public ForwardingIoEnv {
 public:
  explicit CancellableIo(IoEnv* base) : ForwardingIoEnv(base) {}
  void Cancel() { cancelled_.store(true, std::memory_order_release); }
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  ssize_t Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) override;
  int Ftruncate(int fd, uint64_t bytes) override;
  int Fdatasync(int fd) override;
  int Fsync(int fd) override;
  int Rename(const std::string& from, const std::string& to) override;

 private:
  std::atomic<bool> cancelled_{false};
};

// How many calls of each kind an IoEnv passed on (CountingIo::Counts).
struct IoCounts {
  uint64_t opens = 0, stats = 0, lists = 0, reads = 0, read_bytes = 0, writes = 0, written_bytes = 0;
  uint64_t syncs = 0;    // fdatasync and fsync
  uint64_t renames = 0;  // also the durable write's rename into place
  uint64_t unlinks = 0, mkdirs = 0, truncates = 0;
};

// Forwards every call to `base` and counts it: the daemon's calls on its root, per kind, for its
// metrics (flashckpt_root_io_calls_total) and for the scale bench, which checks that what a
// checkpoint costs the file system grows with the ranks and not with ranks x daemons.
// Thread-safe; the counters are relaxed atomics (a scrape may see one call counted and not the next).
class CountingIo final : public ForwardingIoEnv {
 public:
  explicit CountingIo(IoEnv* base) : ForwardingIoEnv(base) {}
  IoCounts Counts() const;

  ssize_t Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) override;
  int Ftruncate(int fd, uint64_t bytes) override;
  int Fdatasync(int fd) override;
  int Fsync(int fd) override;
  int Rename(const std::string& from, const std::string& to) override;
  int Open(const std::string& path, int flags, unsigned mode) override;
  ssize_t Pread(int fd, void* buf, size_t bytes, uint64_t offset) override;
  int Stat(const std::string& path, struct stat* st) override;
  int ListDir(const std::string& dir, std::vector<std::string>* names) override;
  int Unlink(const std::string& path) override;
  int Mkdir(const std::string& path, unsigned mode) override;

 private:
  static void Add(std::atomic<uint64_t>& counter, uint64_t n = 1) { counter.fetch_add(n, std::memory_order_relaxed); }

  std::atomic<uint64_t> opens_{0}, stats_{0}, lists_{0}, reads_{0}, read_bytes_{0}, writes_{0}, written_bytes_{0};
  std::atomic<uint64_t> syncs_{0}, renames_{0}, unlinks_{0}, mkdirs_{0}, truncates_{0};
};

}  // namespace flashckpt

// The system calls of the durable write path behind a small interface (LevelDB `Env`), so that tests
// can make a write fail with ENOSPC on the 3rd chunk, come back short, or take 200 ms
// (common/fault_injecting_io.h) while the code under test stays the code that runs in production.
//
// Only the calls that put bytes on disk and make them durable go through it: pwrite, ftruncate,
// fdatasync, fsync of a directory and rename. Opening, reading, listing and unlinking stay direct.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

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

  // The real OS. Never null; lives as long as the process; stateless.
  static IoEnv* Default();
};

// Forwards every call to `base` until Cancel(); from then on each call fails with ECANCELED
// before it starts. A durable write in progress (common/fs.h) thus stops at its next piece and
// takes its failure path: its temporaries are removed and nothing more is renamed into place.
// The writer abandons what it has not finished this way when the daemon's stop timeout runs out.
class CancellableIo final : public IoEnv {
 public:
  explicit CancellableIo(IoEnv* base) : base_(base) {}
  void Cancel() { cancelled_.store(true, std::memory_order_release); }
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  ssize_t Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) override;
  int Ftruncate(int fd, uint64_t bytes) override;
  int Fdatasync(int fd) override;
  int Fsync(int fd) override;
  int Rename(const std::string& from, const std::string& to) override;

 private:
  IoEnv* base_;  // not owned
  std::atomic<bool> cancelled_{false};
};

}  // namespace flashckpt

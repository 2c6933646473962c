// An IoEnv for tests (LevelDB `FaultInjectionTestEnv`): passes every call to a base env, the real OS
// by default, and injects the faults a test asks for: the Nth write failing with ENOSPC or EIO,
// writes that come back short, slow writes, a failing fdatasync, fsync of the directory, or rename;
// on the read side a failing or slow open, read, stat or listing (EIO, ESTALE), optionally only for
// paths that contain a given text.
//
//   FaultInjectingIo io;
//   io.FailNth(FaultInjectingIo::Op::kWrite, 3, ENOSPC);   // the 3rd write from now
//   WriteFileDurably(dir, "x", spans, nullptr, &io);          // -> RESOURCE_EXHAUSTED naming x.tmp.*
//
// Thread-safe: faults may be set while writes run on other threads; a sleep holds no lock. It lives
// with the tests (the flashckpt_testing library of every test binary), not in the shipped library.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/base/mutex.h"
#include "common/io/io_env.h"

namespace flashckpt {

class FaultInjectingIo final : public IoEnv {
 public:
  enum class Op { kWrite, kTruncate, kDataSync, kDirSync, kRename, kOpen, kRead, kStat, kList, kUnlink, kMkdir };

  // `base` must outlive this object.
  explicit FaultInjectingIo(IoEnv* base = IoEnv::Default()) : base_(base) {}

  // The `n`th call of `op` from now on (1: the next one) fails with errno `err` and does nothing;
  // later calls pass again. Replaces an earlier FailNth of the same op that has not fired.
  void FailNth(Op op, uint64_t n, int err);
  // Every call of `op` fails with `err` until Clear(). With `path_contains`, only the calls whose
  // path contains it (a call on an fd, kWrite or kRead, has no path and is not filtered).
  void FailEvery(Op op, int err, std::string path_contains = "");
  // Every call of `op` first sleeps `delay` (kWrite: as SlowWrites), until Clear().
  void Slow(Op op, std::chrono::milliseconds delay);
  // Every write hands at most `max_bytes` to the base and returns what it wrote: a short write,
  // which the caller must continue. On an O_DIRECT fd the amount is rounded down to whole 4 KiB
  // pages (at least one), as a real direct write comes back short. 0: every write returns 0.
  void ShortWrites(size_t max_bytes);
  // Every write first sleeps `delay`.
  void SlowWrites(std::chrono::milliseconds delay);
  // Every fault off (a write already asleep finishes its sleep). The counters are kept.
  void Clear();

  uint64_t calls(Op op) const;         // calls of `op` seen, faulted or not
  uint64_t failures_injected() const;  // calls failed on purpose
  uint64_t short_writes() const;       // writes cut short on purpose

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
  static constexpr size_t kOps = 11;
  struct Rule {
    uint64_t calls = 0;    // calls seen
    uint64_t fail_at = 0;  // the call number that fails (0: none)
    int fail_at_errno = 0;
    int fail_every_errno = 0;  // 0: off
    std::string fail_every_path;  // fail_every only for paths that contain it ("" : all)
    std::chrono::milliseconds delay{0};
  };
  // Counts a call of `op` on `path` (null: an fd); returns the errno it must fail with, or 0.
  // Requires mu_.
  int CountAndDecideLocked(Op op, const std::string* path = nullptr) REQUIRES(mu_);
  // Counts a call, sleeps as asked, and fails it (-1, errno set) when a rule says so; 0 when it
  // may go ahead.
  int Gate(Op op, const std::string* path = nullptr) EXCLUDES(mu_);

  IoEnv* const base_;
  mutable Mutex mu_;
  std::array<Rule, kOps> rules_ GUARDED_BY(mu_){};
  bool short_writes_on_ GUARDED_BY(mu_) = false;
  size_t short_max_bytes_ GUARDED_BY(mu_) = 0;
  std::chrono::milliseconds write_delay_ GUARDED_BY(mu_){0};
  uint64_t failures_ GUARDED_BY(mu_) = 0;
  uint64_t shorts_ GUARDED_BY(mu_) = 0;
};

}  // namespace flashckpt

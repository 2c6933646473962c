// File-system primitives with Status errors that name the path: owned fds, full reads and writes,
// and the durable-write sequence every flashckpt file goes through. The writing calls take an IoEnv
// (common/io/io_env.h; the real OS by default) through which their pwrite, ftruncate, fdatasync,
// rename and directory fsync go, so that tests can inject faults (tests/support/fault_injecting_io.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/status.h"
#include "common/base/thread_pool.h"
#include "common/io/io_env.h"

namespace flashckpt {

// Owns a file descriptor; closes it on destruction. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { Reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Reset();
  // Gives up ownership: returns the fd, which the caller must close.
  int Release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// Opens a regular file for reading. Anything else (a FIFO, a device, a socket, a directory) is
// refused with INVALID_ARGUMENT, without blocking: paths read here may come from untrusted input.
Result<UniqueFd> OpenForRead(const std::string& path, IoEnv* io = IoEnv::Default());
Status PreadFull(int fd, void* buf, size_t bytes, uint64_t offset, const std::string& path,
                 IoEnv* io = IoEnv::Default());
// Writes all `bytes`: a short write is continued where it stopped (on an O_DIRECT fd the kernel
// stops on a block boundary, so the rest stays aligned), EINTR is retried, and a write that makes no
// progress (returns 0) is kIOError instead of a loop forever.
Status PwriteFull(int fd, const void* buf, size_t bytes, uint64_t offset, const std::string& path,
                  IoEnv* io = IoEnv::Default());

// mkdir -p with the given mode for directories it creates.
Status MakeDirs(const std::string& path, unsigned mode = 0755, IoEnv* io = IoEnv::Default());
Status FsyncDir(const std::string& dir, IoEnv* io = IoEnv::Default());
bool PathExists(const std::string& path);
// Whether `path` exists: false only when stat says ENOENT; any other failure (EIO, ESTALE, EACCES,
// ENOTDIR, ELOOP) is an error naming the path. For what must not mistake "cannot tell" for "absent".
Result<bool> Exists(const std::string& path, IoEnv* io = IoEnv::Default());
// The names in directory `dir`, or nullopt when it does not exist (ENOENT). A dangling symbolic
// link (a volume that is not mounted) and every other failure are errors naming the path.
Result<std::optional<std::vector<std::string>>> ListDirIfExists(const std::string& dir,
                                                                IoEnv* io = IoEnv::Default());

// A piece of a file to write: `bytes` bytes from `data`.
struct WriteSpan {
  const void* data;
  size_t bytes;
};

// The durable write: <dir>/<name>.tmp.<unique>, all spans in order, fdatasync, rename to
// <dir>/<name>, fsync(dir). On failure the temporary is removed and the old <name> (if any) is
// untouched. `renamed`, when given, is set to whether <dir>/<name> now holds the new contents (true
// also when only the final fsync of the directory failed, so a caller can undo the file). Errors
// name the call, the path and the errno text; ENOSPC/EDQUOT are kResourceExhausted, others kIOError.
Status WriteFileDurably(const std::string& dir, const std::string& name, const std::vector<WriteSpan>& spans,
                        bool* renamed = nullptr, IoEnv* io = IoEnv::Default());
// The durable write of a large file image straight from page-aligned memory: `bytes` from `data`,
// with `data` 4 KiB-aligned and the memory readable up to `padded` (a multiple of 4 KiB). Written
// with O_DIRECT in 16 MiB chunks (the page cache is bypassed: no double copy, no writeback stalls),
// the padded tail cut with ftruncate; where the file system refuses O_DIRECT (tmpfs) it falls back
// to a buffered write. Then fdatasync, rename and fsync(dir) as above.
Status WriteImageDurably(const std::string& dir, const std::string& name, const char* data, uint64_t bytes,
                         uint64_t padded, bool* renamed = nullptr, IoEnv* io = IoEnv::Default());
Status WriteFileDurably(const std::string& dir, const std::string& name, std::string_view contents,
                        bool* renamed = nullptr, IoEnv* io = IoEnv::Default());

// A file image for WriteImagesDurably: `bytes` bytes at 4 KiB-aligned `data` (readable up to the
// next 4 KiB boundary). Its first `head` bytes (a multiple of 4 KiB) are written last; the rest is
// cut at `cuts` (increasing offsets in [head, bytes), the first equal to `head`) into regions, and
// each region into pieces of `piece` bytes counted from its start.
struct ImageWrite {
  std::string name;
  const char* data = nullptr;
  uint64_t bytes = 0;
  uint64_t head = 0;
  std::vector<uint64_t> cuts;
  uint64_t piece = 16u << 20;
};

// Writes images durably with several writes in flight. Every piece of every region is one task of
// `loop` (nullptr: the caller's thread): it calls `prepare(image, region, from, to)` for the piece's
// bytes [from, to), then writes the 4 KiB pages that end within it (O_DIRECT; the page holding the
// next piece's first byte is left to that piece), so nothing is written before `prepare` (e.g. a
// checksum) has seen it. When all are done, `finish(image)` runs and
// the image's head is written, its tail cut to `bytes`, the file fdatasync'ed (one task per image)
// and renamed into place, then the directory fsync'ed once. On a file system without O_DIRECT
// (tmpfs) the same writes are buffered. On failure every temporary is removed; `renamed` (if given)
// lists the names already in place, for the caller to undo.
// Images whose bytes are still arriving (a streaming commit): `wait(image, to)`, when set, runs
// before a piece's `prepare` and returns once the image's bytes before `to` are in place; an error
// it returns fails the write as an I/O error does.
// `max_writes_in_flight` (0: one per thread of the loop) caps the pieces' writes at once: with a
// loop of more threads than that, the threads past the cap run the next pieces' `prepare` while the
// writes are in flight, so a prepare that takes time (a checksum) does not leave the disk with fewer
// writes queued.
struct ImageWriteHooks {
  std::function<Status(size_t image, uint64_t to)> wait;
  std::function<void(size_t image, size_t region, uint64_t from, uint64_t to)> prepare;
  std::function<void(size_t image)> finish;
  unsigned max_writes_in_flight = 0;
};
Status WriteImagesDurably(const std::string& dir, const std::vector<ImageWrite>& images, ParallelLoop* loop,
                          const ImageWriteHooks& hooks, std::vector<std::string>* renamed,
                          IoEnv* io = IoEnv::Default());

// "<path>.tmp.<pid>.<place>.<n>": the temporary a durable write fills and renames over <path>.
// <place> (TemporaryPlace) names the PID namespace and boot the process runs in, so writers on
// different nodes or in different containers that share a checkpoint root, and have the same pid
// there (every daemon is pid 1 of its container), never name the same temporary.
std::string TemporaryPath(const std::string& final_path);
// This process's <place>: 12 hex digits of a hash of the kernel's boot id and this process's PID
// namespace; random (and then this process's own) when they cannot be read. Computed once per
// process (again in a forked child).
std::string TemporaryPlace();
// The writer a temporary's name records: its pid and place ("model_state....safetensors.tmp.1.
// 3fa81c09e2d4.7"); place is empty in a name of the older form "<path>.tmp.<pid>.<n>".
struct TemporaryWriter {
  long pid = 0;
  std::string place;
};
// The writer of `name`; nothing when `name` is not such a temporary.
std::optional<TemporaryWriter> TemporaryOwner(const std::string& name);
// Whether process `pid` may still be filling a temporary it named: it exists, is not a zombie (a
// process that exited and was not yet reaped writes nothing more), and runs a program that writes
// checkpoint files: flashckptd, the flashckpt command (an offline reshard), or this process's own
// program. So a pid that another program got after the writer died does not keep its temporary
// forever. A process that exists but whose /proc entry cannot be read (hidepid) counts as alive.
bool IsTemporaryWriterAlive(long pid);
// Removes those of `names` (entries of `dir`) that are temporaries of a process other than this
// one that is not alive (IsTemporaryWriterAlive); returns the paths it removed. Only a writer of
// this process's place can be judged, and only when /proc shows this PID namespace: a temporary of
// another node or container (another place) is never removed, as its pid means nothing here.
std::vector<std::string> RemoveStaleTemporaries(const std::string& dir, const std::vector<std::string>& names,
                                                IoEnv* io = IoEnv::Default());

// Reads a whole file of at most `max_bytes` bytes.
Result<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes, IoEnv* io = IoEnv::Default());

// Names of the entries of a directory (no "." or "..").
Result<std::vector<std::string>> ListDir(const std::string& dir, IoEnv* io = IoEnv::Default());
// rm -r; ok when the path does not exist.
Status RemoveTree(const std::string& path);

}  // namespace flashckpt

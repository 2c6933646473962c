// The daemon's private state directory (--state-dir, default "<socket>.state", mode 0700): the
// records a restarted daemon needs to adopt the slot segments its predecessor left behind.
//
//   <segment name>.reg        SegmentRecord: who registered the segment and how (its layout is
//                             rebuilt from it and checked against the segment's own header)
//   <segment name>.slot<N>    CommitRecord: slot N holds a committed snapshot that is not yet
//                             persisted (or applied to the EMA); written before the Commit is
//                             acknowledged, removed when the slot is free again
//   <segment name>.mem<N>     MemoryRecord: slot N holds a memory checkpoint (its step, attempt,
//                             extra state and checksums); adopted only while the slot's header
//                             still says it holds that step, overwritten by the slot's next one
//   <EMA segment name>.kept   the job's name: a daemon stopped while the job had no rank connected
//                             left this EMA segment in /dev/shm; the next daemon hands it to the
//                             job if it comes back, else unlinks it after --idle-release
//   daemon.lock               flock()ed by the daemon that owns the directory (StateDirLock); holds
//                             its pid
//
// The records must outlive the daemon process, not the machine (the segments they describe live
// in /dev/shm and do not survive a reboot either): each is written to a temporary name and
// renamed, without fsync. Records are parsed defensively by the reader: the directory is the
// daemon's own, but a record may be torn by a full disk or left by an older version.
// Thread-safe: every method touches only the files it names.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/io/fs.h"
#include "common/io/io_env.h"
#include "daemon_state.pb.h"

namespace flashckpt {

class StateDir {
 public:
  StateDir() = default;  // disabled: every method is a no-op (a daemon without a socket path)
  // Creates the directory 0700 (or checks that an existing one is a directory owned by this uid).
  // Records are written and removed through `io` (not owned; it must outlive the StateDir).
  static Result<StateDir> Open(const std::string& path, IoEnv* io = IoEnv::Default());

  bool enabled() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

  Status SaveSegment(const v1::SegmentRecord& record) const;
  Status SaveCommit(const std::string& segment, const v1::CommitRecord& record) const;
  void RemoveCommit(const std::string& segment, uint32_t slot) const;
  Status SaveMemory(const std::string& segment, const v1::MemoryRecord& record) const;
  void RemoveMemory(const std::string& segment, uint32_t slot) const;
  // Removes the segment's record and every commit and memory record of it.
  void RemoveSegment(const std::string& segment) const;

  // EMA segments a stopped daemon left for the next one, each with its job (see above).
  Status SaveKeptEma(const std::string& ema_segment, const std::string& job) const;
  void RemoveKeptEma(const std::string& ema_segment) const;
  // Whether a record keeps `ema_segment`.
  bool HasKeptEma(const std::string& ema_segment) const;
  struct KeptEma {
    std::string segment, job;
  };
  // Every readable record; one that is unreadable, or whose segment name is not its job's EMA
  // segment name, is logged and removed.
  std::vector<KeptEma> LoadKeptEmas() const;

  struct Adoptable {
    v1::SegmentRecord segment;
    std::vector<v1::CommitRecord> commits;  // sorted by step
    std::vector<v1::MemoryRecord> memory;   // sorted by step
  };
  // Every readable segment record with its commit and memory records. Unreadable records are logged and
  // removed (their segment cannot be adopted without them); stray temporaries are removed.
  std::vector<Adoptable> Load() const;

 private:
  StateDir(std::string path, IoEnv* io) : path_(std::move(path)), io_(io) {}
  Status Write(const std::string& name, const std::string& bytes) const;
  void Remove(const std::string& name) const;
  std::string path_;
  IoEnv* io_ = IoEnv::Default();
};

// One daemon per state directory: an exclusive flock on <dir>/daemon.lock, taken before the daemon
// reads, adopts or deletes anything and held until it exits (the kernel drops it when the process
// dies, SIGKILL included, so a crashed daemon never blocks its successor). The file holds the
// owner's pid, which the refusal of a second daemon names.
class StateDirLock {
 public:
  StateDirLock() = default;  // holds nothing
  // kFailedPrecondition when another process holds it, naming that process.
  static Result<StateDirLock> Acquire(const std::string& dir);
  bool held() const { return fd_.valid(); }

 private:
  explicit StateDirLock(UniqueFd fd) : fd_(std::move(fd)) {}
  UniqueFd fd_;
};

}  // namespace flashckpt

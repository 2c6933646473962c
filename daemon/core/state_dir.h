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
//   <job>.released            the job's name: this daemon gave the job's memory back while a holder
//                             of its parity shares had not heard so yet (ParitySender::Options::
//                             keep_word); the next daemon tells the holders again
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
#include <optional>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/io/fs.h"
#include "common/format/slot_checksums.h"
#include "common/io/io_env.h"
#include "daemon/pipeline/ema.h"
#include "daemon/core/registration.h"

namespace flashckpt {

// The records, in the core's own types. How they are encoded is the StateRecordCodec's (below).
struct SegmentRecord {
  std::string job;
  uint32_t rank = 0;
  std::string segment_name;
  uint64_t segment_bytes = 0;
  uint32_t slot_count = 0;
  uint64_t checksum_chunk = 0;
  // The registration as the trainer sent it, encoded by the codec (EncodeRegistration); read back
  // with DecodeRegistration, which checks it as a trainer's request is checked.
  std::string registration;
};

struct CommitRecord {
  uint32_t slot = 0;
  uint64_t generation = 0;
  int64_t step = 0;
  bool persist = false;
  int64_t resumed_from = 0;
  std::string run_id;  // the attempt's run (with resumed_from): the signal names both
  uint32_t world_size = 0;
  std::optional<double> loss;
  std::string extra;
};

struct MemoryRecord {
  uint32_t slot = 0;
  int64_t step = 0;
  int64_t resumed_from = 0;
  std::string run_id;
  uint32_t world_size = 0;
  std::string extra;
  uint64_t checksum_chunk = 0;        // SlotChecksums::chunk_bytes
  std::vector<uint64_t> first_chunk;  // SlotChecksums::first: per tensor of the layout
  std::vector<uint64_t> sums;         // SlotChecksums::sums
  bool written = false;               // a disk snapshot kept once written
  // A rank with EMA: the EMA of the step (ResidentCheckpoint::ema) and its image's checksums.
  std::optional<EmaState> ema;
  SlotChecksums ema_sums;
};

// The records' encoding in their files. The daemon's is the edge's (daemon/edge/state_records.h:
// protobuf, as the trainer's registration is), given in DaemonConfig::state_records; the core
// never sees the encoded form but as bytes. Decoders return false for bytes that are not a record.
// Implementations are stateless and thread-safe.
class StateRecordCodec {
 public:
  virtual ~StateRecordCodec() = default;
  virtual std::string EncodeSegment(const SegmentRecord& record) const = 0;
  virtual bool DecodeSegment(const std::string& bytes, SegmentRecord* record) const = 0;
  virtual std::string EncodeCommit(const CommitRecord& record) const = 0;
  virtual bool DecodeCommit(const std::string& bytes, CommitRecord* record) const = 0;
  virtual std::string EncodeMemory(const MemoryRecord& record) const = 0;
  virtual bool DecodeMemory(const std::string& bytes, MemoryRecord* record) const = 0;
  virtual std::string EncodeRegistration(const Registration& registration) const = 0;
  virtual Result<Registration> DecodeRegistration(const std::string& bytes) const = 0;
};

class StateDir {
 public:
  StateDir() = default;  // disabled: every method is a no-op (a daemon without a socket path)
  // Creates the directory 0700 (or checks that an existing one is a directory owned by this uid).
  // Records are encoded by `codec` and written and removed through `io` (neither owned; both must
  // outlive the StateDir).
  static Result<StateDir> Open(const std::string& path, const StateRecordCodec* codec, IoEnv* io = IoEnv::Default());

  bool enabled() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

  Status SaveSegment(const SegmentRecord& record) const;
  Status SaveCommit(const std::string& segment, const CommitRecord& record) const;
  void RemoveCommit(const std::string& segment, uint32_t slot) const;
  Status SaveMemory(const std::string& segment, const MemoryRecord& record) const;
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

  // Release words for the parity group's holders not yet delivered to all of them (see above).
  Status SaveParityRelease(const std::string& job) const;
  // True when a record was there and is gone.
  bool RemoveParityRelease(const std::string& job) const;
  // The job of every readable record; one that is unreadable or does not name a valid job as its
  // file name does is logged and removed.
  std::vector<std::string> LoadParityReleases() const;

  struct Adoptable {
    SegmentRecord segment;
    std::vector<CommitRecord> commits;  // sorted by step
    std::vector<MemoryRecord> memory;   // sorted by step
  };
  // Every readable segment record with its commit and memory records. Unreadable records are logged and
  // removed (their segment cannot be adopted without them); stray temporaries are removed.
  std::vector<Adoptable> Load() const;
  // The registration of a segment record, checked (StateRecordCodec::DecodeRegistration).
  Result<Registration> RegistrationOf(const SegmentRecord& record) const;
  // Encodes a registration for SegmentRecord::registration.
  std::string EncodeRegistration(const Registration& registration) const;

 private:
  StateDir(std::string path, const StateRecordCodec* codec, IoEnv* io)
      : path_(std::move(path)), codec_(codec), io_(io) {}
  Status Write(const std::string& name, const std::string& bytes) const;
  void Remove(const std::string& name) const;
  // The names in the directory that end in `suffix`, sorted (none when it cannot be listed).
  std::vector<std::string> NamesEndingIn(const char* suffix) const;
  std::string path_;
  const StateRecordCodec* codec_ = nullptr;
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

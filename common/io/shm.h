// POSIX shared-memory segments (Boost.Interprocess) and the records at the head of each.
//
// The daemon creates a segment per (job, rank, layout) with O_EXCL and a private mode, under a
// name that carries a random token only the registering peer learns. The client maps it by name.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/base/status.h"

namespace flashckpt {

inline constexpr char kSegmentMagic[8] = {'F', 'C', 'K', 'P', 'T', 'S', 'G', '1'};

// Page 0 of a segment; written by the daemon at creation and read-only afterwards (except
// format_version, which a daemon that adopts a segment of an older format version raises once it
// has rewritten the slots' file headers).
struct SegmentHeader {
  char magic[8];
  uint32_t format_version;
  uint32_t slot_count;
  uint64_t slot_bytes;
  uint64_t segment_bytes;
  uint32_t rank;
  char job[132];
};

// Slot states, mirrored into the slot header page by the daemon (the daemon's own table is the
// authority; the mirror is for inspection and for a restarted daemon).
enum class SlotState : uint32_t { kFree = 0, kFilling, kCommitted, kPersisting, kRestoring };
const char* SlotStateName(SlotState s);

// Page 0 of each slot.
struct SlotHeader {
  std::atomic<uint32_t> state;
  // 1: the slot holds a memory checkpoint of step `step` (kept in a FREE slot, or being restored
  // or written from it); 0: none. A restarted daemon adopts the memory checkpoint its state
  // directory records for the slot only while this says so (daemon/core/recovery.cc).
  std::atomic<uint32_t> resident;
  std::atomic<int64_t> step;
  std::atomic<uint64_t> generation;
  // How much of a committed slot is in place: a streaming commit (device copies still in flight)
  // is sent before its bytes are. 0 (the daemon's value at hand-out, and what a host snapshot
  // leaves): the whole slot. P > 0: bytes [0, P) of the slot, counted from this header; the trainer
  // raises it as its copies complete, to 0 when all are. kSlotCopyFailed: the copies failed and the
  // slot must not be persisted. Written by the trainer, read by the daemon's writer and EMA stage.
  std::atomic<uint64_t> copied_until;
  // The generation of the hand-out the daemon's EMA stage is done with (its EMA applied and, for a
  // persisted snapshot, the step's EMA image in the slot), written by the stage; kEmaNotDone from
  // the hand-out until then. A restarted daemon adopting the snapshot passes it through the EMA
  // stage again unless this names its generation. 0: a segment of an older release, whose daemon
  // mirrored the slot PERSISTING only once the stage was done with it.
  std::atomic<uint64_t> ema_done;
};
inline constexpr uint64_t kSlotCopyFailed = ~0ull;
inline constexpr uint64_t kEmaNotDone = ~0ull;

// Waits until the slot's bytes [0, `bytes`) are in place (copied_until is 0 or at least `bytes`),
// polling with short sleeps. kFailedPrecondition when the trainer marked its copies failed,
// kDeadlineExceeded (naming how far they got) when `timeout` passes first, kCancelled as soon as
// `cancelled` (when given) returns true: a daemon that stops does not wait out the copy timeout.
Status WaitSlotCopied(const SlotHeader& header, uint64_t bytes, std::chrono::milliseconds timeout,
                      const std::function<bool()>& cancelled = {});

// A mapped segment. Move-only; unmaps on destruction, and the creator also unlinks the name.
class SharedSegment {
 public:
  // How a segment is mapped: kPopulated fills the page tables now (no page faults on first use);
  // kLazy maps only, and each page is mapped when first touched or by Populate() (a trainer that
  // restores one slot of several touches that one alone).
  enum class Mapping { kPopulated, kLazy };
  // Creates `name` exclusively with `mode` (e.g. 0600) and `bytes` of zeroed memory, every page
  // allocated up front (kResourceExhausted when /dev/shm has no room), mapped as `mapping` says.
  // With `group`, the segment is given to that group (fchown on its fd) before its mode is set, so
  // it is never readable by the group under a wider mode than asked for.
  static Result<std::unique_ptr<SharedSegment>> Create(const std::string& name, uint64_t bytes, unsigned mode,
                                                       std::optional<uint32_t> group = std::nullopt,
                                                       Mapping mapping = Mapping::kPopulated);
  // Maps an existing segment; fails unless its size is `expected_bytes`.
  static Result<std::unique_ptr<SharedSegment>> Open(const std::string& name, uint64_t expected_bytes,
                                                     Mapping mapping = Mapping::kPopulated);
  ~SharedSegment();

  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  // Leaves the name in place when this object is destroyed (segments that outlive the daemon).
  void KeepName() { owner_ = false; }
  // Takes over the name of an opened segment: it is unlinked when this object is destroyed (a
  // restarted daemon adopting a segment its predecessor created).
  void OwnName() { owner_ = true; }
  bool owns_name() const { return owner_; }
  // Removes a segment name; ok when it does not exist.
  static void Unlink(const std::string& name);
  // Gives segment `from` the name `to`, which must not exist (an error when it does); mappings of
  // it stay valid. POSIX shared memory names are files in /dev/shm on Linux, the one system served.
  static Status Rename(const std::string& from, const std::string& to);

  // Fills the page tables of bytes [offset, offset + bytes) for writing, in 64 MiB pieces (the
  // process's memory-map lock is taken per piece), stopping early when `stop` becomes true.
  Status Populate(uint64_t offset, uint64_t bytes, const std::atomic<bool>* stop = nullptr) const;

  char* data() const { return static_cast<char*>(addr_); }
  uint64_t size() const { return bytes_; }
  const std::string& name() const { return name_; }

 private:
  SharedSegment() = default;
  std::string name_;
  void* addr_ = nullptr;
  uint64_t bytes_ = 0;
  bool owner_ = false;
};

// 16 random hex digits from the kernel's CSPRNG.
Result<std::string> RandomToken();

}  // namespace flashckpt

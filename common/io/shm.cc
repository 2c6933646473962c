#include "common/io/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>
#include <cstdio>
#include <thread>

namespace flashckpt {

namespace bip = boost::interprocess;

namespace {

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

// Fills the page tables of [base, base + bytes) for writing, so a copy into it takes no faults. Not
// MAP_POPULATE: that fills gigabytes while holding the process's memory-map lock, and every other
// thread that maps or unmaps memory (an allocator, gRPC) waits for all of it. Here the lock is taken
// per 64 MiB piece. Kernels before 5.14 (no MADV_POPULATE_WRITE) get one read per page instead,
// which maps the same pages (reading never changes a byte another process writes).
Status PopulatePieces(char* base, uint64_t bytes, const std::string& name, const std::atomic<bool>* stop) {
  constexpr uint64_t kPiece = 64u << 20;
  const long page = ::sysconf(_SC_PAGESIZE);
  bool madvise_works = true;
  for (uint64_t off = 0; off < bytes; off += kPiece) {
    if (stop != nullptr && stop->load(std::memory_order_relaxed)) return Status::OK();
    const uint64_t n = std::min(kPiece, bytes - off);
    if (madvise_works && ::madvise(base + off, n, MADV_POPULATE_WRITE) == 0) continue;
    if (madvise_works && errno != EINVAL) return ErrnoStatus("madvise(MADV_POPULATE_WRITE) shared memory", name);
    madvise_works = false;
    for (uint64_t p = off; p < off + n; p += static_cast<uint64_t>(page)) {
      (void)*static_cast<volatile const char*>(base + p);
    }
  }
  return Status::OK();
}

// Maps `bytes` of `fd`, populated (PopulatePieces) unless `mapping` is kLazy.
Result<void*> Map(int fd, uint64_t bytes, const std::string& name, SharedSegment::Mapping mapping) {
  void* addr = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) return ErrnoStatus("mmap shared memory", name);
  if (mapping == SharedSegment::Mapping::kLazy) return addr;
  Status populated = PopulatePieces(static_cast<char*>(addr), bytes, name, nullptr);
  if (!populated.ok()) {
    ::munmap(addr, bytes);
    return populated;
  }
  return addr;
}

}  // namespace

const char* SlotStateName(SlotState s) {
  switch (s) {
    case SlotState::kFree: return "free";
    case SlotState::kFilling: return "filling";
    case SlotState::kCommitted: return "committed";
    case SlotState::kPersisting: return "persisting";
    case SlotState::kRestoring: return "restoring";
  }
  return "unknown";
}

Result<std::string> RandomToken() {
  unsigned char raw[8];
  if (::getrandom(raw, sizeof raw, 0) != sizeof raw) return ErrnoStatus("getrandom", "");
  char hex[17];
  for (int i = 0; i < 8; ++i) std::snprintf(hex + 2 * i, 3, "%02x", raw[i]);
  return std::string(hex, 16);
}

// Boost.Interprocess reports errors by exception; this file is the only place that sees them.
Result<std::unique_ptr<SharedSegment>> SharedSegment::Create(const std::string& name, uint64_t bytes, unsigned mode,
                                                             std::optional<uint32_t> group, Mapping mapping) {
  std::unique_ptr<SharedSegment> seg(new SharedSegment());
  try {
    bip::permissions perm(mode);
    bip::shared_memory_object shm(bip::create_only, name.c_str(), bip::read_write, perm);
    seg->name_ = name;
    seg->owner_ = true;
    int fd = shm.get_mapping_handle().handle;
    if (group && ::fchown(fd, static_cast<uid_t>(-1), static_cast<gid_t>(*group)) != 0) {
      int err = errno;
      return ErrnoStatus("fchown shared memory to gid " + std::to_string(*group), name, err);
    }
    if (::fchmod(fd, mode) != 0) return ErrnoStatus("fchmod shared memory", name);
    shm.truncate(static_cast<bip::offset_t>(bytes));
    // Back every page now: a full /dev/shm is an error here rather than a SIGBUS in a trainer's
    // copy later, and no save pays for first-touch page allocation.
    int err = 0;
    do {
      err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    } while (err == EINTR);  // a signal during a large allocation
    if (err != 0 && err != EOPNOTSUPP) {
      bip::shared_memory_object::remove(name.c_str());
      seg->owner_ = false;
      if (err == ENOSPC) {
        return ResourceExhausted("shared memory " + name + ": /dev/shm has no room for " + std::to_string(bytes) +
                                 " bytes");
      }
      return ErrnoStatus("posix_fallocate shared memory", name, err);
    }
    ASSIGN_OR_RETURN(void* addr, Map(fd, bytes, name, mapping));
    seg->addr_ = addr;
    seg->bytes_ = bytes;
  } catch (const bip::interprocess_exception& e) {
    if (seg->owner_) bip::shared_memory_object::remove(name.c_str());
    seg->owner_ = false;
    return IOError("create shared memory " + name + " of " + std::to_string(bytes) + " bytes: " + e.what());
  }
  return seg;
}

Result<std::unique_ptr<SharedSegment>> SharedSegment::Open(const std::string& name, uint64_t expected_bytes,
                                                           Mapping mapping) {
  std::unique_ptr<SharedSegment> seg(new SharedSegment());
  try {
    bip::shared_memory_object shm(bip::open_only, name.c_str(), bip::read_write);
    bip::offset_t size = 0;
    if (!shm.get_size(size) || static_cast<uint64_t>(size) != expected_bytes) {
      return FailedPrecondition("shared memory " + name + " has " + std::to_string(size) + " bytes, expected " +
                                std::to_string(expected_bytes));
    }
    ASSIGN_OR_RETURN(void* addr, Map(shm.get_mapping_handle().handle, expected_bytes, name, mapping));
    seg->name_ = name;
    seg->addr_ = addr;
    seg->bytes_ = expected_bytes;
  } catch (const bip::interprocess_exception& e) {
    return NotFound("open shared memory " + name + ": " + e.what());
  }
  return seg;
}

Status SharedSegment::Populate(uint64_t offset, uint64_t bytes, const std::atomic<bool>* stop) const {
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return InvalidArgument("populate bytes [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                           ") of shared memory " + name_ + " of " + std::to_string(bytes_) + " bytes");
  }
  return PopulatePieces(data() + offset, bytes, name_, stop);
}

void SharedSegment::Unlink(const std::string& name) { bip::shared_memory_object::remove(name.c_str()); }

Status SharedSegment::Rename(const std::string& from, const std::string& to) {
  const std::string a = "/dev/shm/" + from, b = "/dev/shm/" + to;
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_NOREPLACE) != 0) {
    return ErrnoStatus("rename shared memory " + from + " to", to);
  }
  return Status::OK();
}

SharedSegment::~SharedSegment() {
  if (addr_ != nullptr) ::munmap(addr_, bytes_);
  if (owner_) bip::shared_memory_object::remove(name_.c_str());
}

Status WaitSlotCopied(const SlotHeader& header, uint64_t bytes, std::chrono::milliseconds timeout,
                      const std::function<bool()>& cancelled) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    const uint64_t until = header.copied_until.load(std::memory_order_acquire);
    if (until == kSlotCopyFailed) {
      return FailedPrecondition("the trainer's device-to-host copies into the slot failed (see its error)");
    }
    if (until == 0 || until >= bytes) return Status::OK();
    if (cancelled && cancelled()) {
      return Cancelled("the daemon is stopping while the trainer's copies into the slot had reached byte " +
                       std::to_string(until) + " of " + std::to_string(bytes));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return DeadlineExceeded("the trainer's copies into the slot did not reach byte " + std::to_string(bytes) +
                              " within " + std::to_string(timeout.count()) + " ms (they reached byte " +
                              std::to_string(until) + "); the trainer died or its device stalled");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
  }
}

}  // namespace flashckpt

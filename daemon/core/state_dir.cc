#include "daemon/core/state_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <map>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/io/fs.h"

namespace flashckpt {
namespace {

constexpr char kSegmentSuffix[] = ".reg";
constexpr char kSlotInfix[] = ".slot";
constexpr char kMemoryInfix[] = ".mem";
constexpr char kTempSuffix[] = ".tmp";
constexpr char kLockName[] = "daemon.lock";
constexpr char kKeptEmaSuffix[] = ".kept";
constexpr char kParityReleaseSuffix[] = ".released";
constexpr uint64_t kMaxSegmentRecordBytes = 1ull << 30;  // a million tensor specs fit
constexpr uint64_t kMaxCommitRecordBytes = 8ull << 20;   // extra state is capped at 4 MiB
// Extra state and 8 bytes per checksum chunk (4 MiB chunks by default: 2 KiB per GiB of slot).
constexpr uint64_t kMaxMemoryRecordBytes = 256ull << 20;

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string SlotName(const std::string& segment, uint32_t slot) { return segment + kSlotInfix + std::to_string(slot); }
std::string MemoryName(const std::string& segment, uint32_t slot) {
  return segment + kMemoryInfix + std::to_string(slot);
}

// The segment name of `<segment><infix><digits>`, or "" when `name` is not one.
std::string RecordSegment(const std::string& name, const std::string& infix) {
  const auto pos = name.rfind(infix);
  if (pos == std::string::npos || pos == 0 || pos + infix.size() == name.size()) return "";
  for (size_t i = pos + infix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return "";
  }
  return name.substr(0, pos);
}

}  // namespace

Result<StateDir> StateDir::Open(const std::string& path, const StateRecordCodec* codec, IoEnv* io) {
  if (path.empty()) return InvalidArgument("--state-dir must not be empty");
  if (codec == nullptr) return InvalidArgument("a state directory needs a record codec (DaemonConfig::state_records)");
  if (!PathExists(path)) {
    // Its parent is usually the socket's directory, which the server makes 0750.
    const std::string parent = std::filesystem::path(path).parent_path().string();
    if (!parent.empty() && !PathExists(parent)) RETURN_IF_ERROR(MakeDirs(parent, 0750));
    if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) return ErrnoStatus("mkdir", path);
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return ErrnoStatus("stat", path);
  if (!S_ISDIR(st.st_mode)) return FailedPrecondition("--state-dir " + path + " exists and is not a directory");
  if (st.st_uid != ::geteuid()) {
    return FailedPrecondition("--state-dir " + path + " belongs to uid " + std::to_string(st.st_uid) +
                              ", not to the daemon's uid " + std::to_string(::geteuid()));
  }
  if ((st.st_mode & 077) != 0 && ::chmod(path.c_str(), 0700) != 0) return ErrnoStatus("chmod", path);
  return StateDir(path, codec, io);
}

Status StateDir::Write(const std::string& name, const std::string& bytes) const {
  // A temporary name of its own per write: two threads may write one record at once (a parity
  // release word's, ParitySender::KeepWord), and each rename must find its own file.
  static std::atomic<uint64_t> writes{0};
  const std::string final_path = path_ + "/" + name;
  const std::string tmp = final_path + "." + std::to_string(writes.fetch_add(1)) + kTempSuffix;
  UniqueFd fd(io_->Open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoStatus("open", tmp);
  Status written = PwriteFull(fd.get(), bytes.data(), bytes.size(), 0, tmp, io_);
  if (written.ok() && io_->Rename(tmp, final_path) != 0) written = ErrnoStatus("rename", tmp);
  if (!written.ok()) io_->Unlink(tmp);
  return written;
}

void StateDir::Remove(const std::string& name) const { io_->Unlink(path_ + "/" + name); }

Status StateDir::SaveSegment(const SegmentRecord& record) const {
  if (!enabled()) return Status::OK();
  return Write(record.segment_name + kSegmentSuffix, codec_->EncodeSegment(record));
}

Status StateDir::SaveCommit(const std::string& segment, const CommitRecord& record) const {
  if (!enabled()) return Status::OK();
  return Write(SlotName(segment, record.slot), codec_->EncodeCommit(record));
}

void StateDir::RemoveCommit(const std::string& segment, uint32_t slot) const {
  if (!enabled()) return;
  Remove(SlotName(segment, slot));
}

Status StateDir::SaveMemory(const std::string& segment, const MemoryRecord& record) const {
  if (!enabled()) return Status::OK();
  const std::string bytes = codec_->EncodeMemory(record);
  if (bytes.size() > kMaxMemoryRecordBytes) {  // Load would not read it back
    return ResourceExhausted("the memory record of " + std::to_string(record.sums.size()) + " checksums is larger than " +
                             std::to_string(kMaxMemoryRecordBytes) + " bytes (raise --checksum-chunk)");
  }
  return Write(MemoryName(segment, record.slot), bytes);
}

Result<Registration> StateDir::RegistrationOf(const SegmentRecord& record) const {
  if (codec_ == nullptr) return FailedPrecondition("no state directory");
  return codec_->DecodeRegistration(record.registration);
}

std::string StateDir::EncodeRegistration(const Registration& registration) const {
  return codec_ != nullptr ? codec_->EncodeRegistration(registration) : std::string();
}

void StateDir::RemoveMemory(const std::string& segment, uint32_t slot) const {
  if (!enabled()) return;
  Remove(MemoryName(segment, slot));
}

void StateDir::RemoveSegment(const std::string& segment) const {
  if (!enabled()) return;
  auto names = ListDir(path_);
  if (!names.ok()) return;
  for (const auto& n : *names) {
    if (RecordSegment(n, kSlotInfix) == segment || RecordSegment(n, kMemoryInfix) == segment) Remove(n);
  }
  Remove(segment + kSegmentSuffix);
}

Status StateDir::SaveKeptEma(const std::string& ema_segment, const std::string& job) const {
  if (!enabled()) return Status::OK();
  return Write(ema_segment + kKeptEmaSuffix, job);
}

void StateDir::RemoveKeptEma(const std::string& ema_segment) const {
  if (!enabled()) return;
  Remove(ema_segment + kKeptEmaSuffix);
}

bool StateDir::HasKeptEma(const std::string& ema_segment) const {
  return enabled() && PathExists(path_ + "/" + ema_segment + kKeptEmaSuffix);
}

std::vector<std::string> StateDir::NamesEndingIn(const char* suffix) const {
  std::vector<std::string> out;
  if (!enabled()) return out;
  auto names = ListDir(path_);
  if (!names.ok()) return out;
  for (std::string& n : *names) {
    if (EndsWith(n, suffix)) out.push_back(std::move(n));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<StateDir::KeptEma> StateDir::LoadKeptEmas() const {
  std::vector<KeptEma> out;
  for (const auto& n : NamesEndingIn(kKeptEmaSuffix)) {
    KeptEma kept;
    kept.segment = n.substr(0, n.size() - (sizeof kKeptEmaSuffix - 1));
    auto job = ReadSmallFile(path_ + "/" + n, 1024);
    const std::string prefix = job.ok() ? "flashckpt." + *job + "." : std::string();
    const bool named =
        job.ok() && ValidateJobName(*job).ok() && kept.segment.rfind(prefix, 0) == 0 && EndsWith(kept.segment, ".ema");
    if (!named) {
      Logger("shm")->warn("dropping state record {}/{}: not a kept EMA record of its job", path_, n);
      Remove(n);
      continue;
    }
    kept.job = std::move(job).value();
    out.push_back(std::move(kept));
  }
  return out;
}

Status StateDir::SaveParityRelease(const std::string& job) const {
  if (!enabled()) return Status::OK();
  return Write(job + kParityReleaseSuffix, job);
}

bool StateDir::RemoveParityRelease(const std::string& job) const {
  if (!enabled()) return false;
  return io_->Unlink(path_ + "/" + job + kParityReleaseSuffix) == 0;
}

std::vector<std::string> StateDir::LoadParityReleases() const {
  std::vector<std::string> out;
  for (const auto& n : NamesEndingIn(kParityReleaseSuffix)) {
    auto job = ReadSmallFile(path_ + "/" + n, 1024);
    if (!job.ok() || !ValidateJobName(*job).ok() || *job + kParityReleaseSuffix != n) {
      Logger("shm")->warn("dropping state record {}/{}: not a parity release record of its job", path_, n);
      Remove(n);
      continue;
    }
    out.push_back(std::move(job).value());
  }
  return out;
}

std::vector<StateDir::Adoptable> StateDir::Load() const {
  std::vector<Adoptable> out;
  if (!enabled()) return out;
  auto names = ListDir(path_);
  if (!names.ok()) {
    Logger("shm")->error("cannot list the state directory: {}", names.status().ToString());
    return out;
  }
  std::sort(names->begin(), names->end());
  auto drop = [&](const std::string& name, const std::string& why) {
    Logger("shm")->warn("dropping state record {}/{}: {}", path_, name, why);
    Remove(name);
  };
  std::map<std::string, Adoptable> segments;  // by segment name
  for (const auto& n : *names) {
    if (EndsWith(n, kTempSuffix)) {
      drop(n, "an unfinished write");
      continue;
    }
    if (!EndsWith(n, kSegmentSuffix)) continue;
    auto bytes = ReadSmallFile(path_ + "/" + n, kMaxSegmentRecordBytes);
    Adoptable a;
    if (!bytes.ok() || !codec_->DecodeSegment(*bytes, &a.segment)) {
      drop(n, bytes.ok() ? "not a segment record" : bytes.status().ToString());
      continue;
    }
    const std::string segment = n.substr(0, n.size() - (sizeof kSegmentSuffix - 1));
    if (a.segment.segment_name != segment) {
      drop(n, "it names segment '" + a.segment.segment_name + "'");
      continue;
    }
    segments.emplace(segment, std::move(a));
  }
  for (const auto& n : *names) {
    if (EndsWith(n, kTempSuffix) || EndsWith(n, kSegmentSuffix) || EndsWith(n, kKeptEmaSuffix) ||
        EndsWith(n, kParityReleaseSuffix) || n == kLockName) {
      continue;
    }
    const std::string slot_of = RecordSegment(n, kSlotInfix);
    const std::string memory_of = RecordSegment(n, kMemoryInfix);
    if (slot_of.empty() && memory_of.empty()) continue;
    auto it = segments.find(slot_of.empty() ? memory_of : slot_of);
    if (it == segments.end()) {
      drop(n, "its segment has no record");
      continue;
    }
    if (!slot_of.empty()) {
      auto bytes = ReadSmallFile(path_ + "/" + n, kMaxCommitRecordBytes);
      CommitRecord c;
      if (!bytes.ok() || !codec_->DecodeCommit(*bytes, &c) || n != SlotName(it->first, c.slot)) {
        drop(n, "not a commit record of that slot");
        continue;
      }
      it->second.commits.push_back(std::move(c));
    } else {
      auto bytes = ReadSmallFile(path_ + "/" + n, kMaxMemoryRecordBytes);
      MemoryRecord m;
      if (!bytes.ok() || !codec_->DecodeMemory(*bytes, &m) || n != MemoryName(it->first, m.slot)) {
        drop(n, "not a memory record of that slot");
        continue;
      }
      it->second.memory.push_back(std::move(m));
    }
  }
  for (auto& [name, a] : segments) {
    std::sort(a.commits.begin(), a.commits.end(),
              [](const CommitRecord& x, const CommitRecord& y) { return x.step < y.step; });
    std::sort(a.memory.begin(), a.memory.end(),
              [](const MemoryRecord& x, const MemoryRecord& y) { return x.step < y.step; });
    out.push_back(std::move(a));
  }
  return out;
}

Result<StateDirLock> StateDirLock::Acquire(const std::string& dir) {
  const std::string path = dir + "/" + kLockName;
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd.valid()) return ErrnoStatus("open", path);
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return ErrnoStatus("flock", path);
    auto owner = ReadSmallFile(path, 64);
    std::string pid = owner.ok() ? *owner : "";
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    return FailedPrecondition("another flashckptd" + (pid.empty() ? std::string() : " (pid " + pid + ")") +
                              " owns the state directory " + dir + " (it holds " + path +
                              "); this one has touched nothing: stop that daemon first, or give this one another "
                              "--socket or --state-dir");
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd.get(), 0) != 0) return ErrnoStatus("ftruncate", path);
  RETURN_IF_ERROR(PwriteFull(fd.get(), pid.data(), pid.size(), 0, path));
  return StateDirLock(std::move(fd));
}

}  // namespace flashckpt

#include "common/io/fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>

#include "common/base/mutex.h"

namespace flashckpt {

Status ErrnoStatus(std::string_view what, std::string_view path, int err) {
  std::string msg =
      std::string(what) + " " + std::string(path) + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
  if (err == ENOSPC || err == EDQUOT) return ResourceExhausted(std::move(msg));
  if (err == ENOENT) return NotFound(std::move(msg));
  if (err == ECANCELED) return Cancelled(std::move(msg));  // CancellableIo after Cancel()
  return IOError(std::move(msg));
}

void UniqueFd::Reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Result<UniqueFd> OpenForRead(const std::string& path, IoEnv* io) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever. Anything but a
  // regular file is refused before a byte is read; for a regular file the flag changes nothing.
  int fd = io->Open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK, 0);
  if (fd < 0) return ErrnoStatus("open", path);
  UniqueFd owned(fd);
  struct stat st {};
  if (::fstat(owned.get(), &st) != 0) return ErrnoStatus("fstat", path);
  if (!S_ISREG(st.st_mode)) {
    const char* what = S_ISFIFO(st.st_mode)  ? "a FIFO"
                       : S_ISDIR(st.st_mode) ? "a directory"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                       : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                                                                    : "not a regular file";
    return InvalidArgument(path + " is " + what + ", not a regular file: only regular files are read");
  }
  return owned;
}

Status PreadFull(int fd, void* buf, size_t bytes, uint64_t offset, const std::string& path, IoEnv* io) {
  auto* p = static_cast<char*>(buf);
  while (bytes > 0) {
    ssize_t n = io->Pread(fd, p, bytes, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("read", path);
    }
    if (n == 0) return Corruption("read " + path + ": file ends early (truncated) at offset " + std::to_string(offset));
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::OK();
}

Status PwriteFull(int fd, const void* buf, size_t bytes, uint64_t offset, const std::string& path, IoEnv* io) {
  const auto* p = static_cast<const char*>(buf);
  while (bytes > 0) {
    ssize_t n = io->Pwrite(fd, p, bytes, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("write", path);
    }
    if (n == 0) {  // no error and no progress: retrying would spin forever
      return IOError("write " + path + ": the system wrote 0 of " + std::to_string(bytes) + " bytes at offset " +
                     std::to_string(offset) + " without an error; the file system may be failing (see dmesg)");
    }
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::OK();
}

Status MakeDirs(const std::string& path, unsigned mode, IoEnv* io) {
  struct stat st {};
  // Nearly always there already (every rank's persist of a step asks): one call, not one per component.
  if (io->Stat(path, &st) == 0 && S_ISDIR(st.st_mode)) return Status::OK();
  std::filesystem::path p(path);
  std::filesystem::path cur;
  for (const auto& part : p) {
    cur /= part;
    if (cur.string().empty()) continue;
    if (io->Mkdir(cur.string(), mode) != 0 && errno != EEXIST) return ErrnoStatus("mkdir", cur.string());
  }
  if (io->Stat(path, &st) != 0) return ErrnoStatus("stat", path);
  if (!S_ISDIR(st.st_mode)) return FailedPrecondition(path + " exists and is not a directory");
  return Status::OK();
}

Status FsyncDir(const std::string& dir, IoEnv* io) {
  int fd = io->Open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("open directory", dir);
  UniqueFd owned(fd);
  if (io->Fsync(fd) != 0) return ErrnoStatus("fsync directory", dir);
  return Status::OK();
}

bool PathExists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

Result<bool> Exists(const std::string& path, IoEnv* io) {
  struct stat st {};
  if (io->Stat(path, &st) == 0) return true;
  if (errno == ENOENT) return false;
  return ErrnoStatus("stat", path);
}

Result<std::optional<std::vector<std::string>>> ListDirIfExists(const std::string& dir, IoEnv* io) {
  auto names = ListDir(dir, io);
  if (names.ok()) return std::optional<std::vector<std::string>>(std::move(names).value());
  if (names.status().code() != StatusCode::kNotFound) return names.status();
  struct stat st {};
  if (::lstat(dir.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
    return IOError(dir + " is a symbolic link to a path that does not exist (a volume that is not mounted?)");
  }
  return std::optional<std::vector<std::string>>();
}

namespace {

// FNV-1a, 64 bits: enough to tell places apart in a name (not a checksum, nothing trusts it).
uint64_t Fnv1a(std::string_view text, uint64_t h = 0xcbf29ce484222325ull) {
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

std::string PlaceOf(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%012llx", static_cast<unsigned long long>(h & 0xffffffffffffull));
  return buf;
}

std::string ComputeTemporaryPlace() {
  std::string boot;
  {
    UniqueFd fd(::open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC));
    char buf[64];
    ssize_t n = fd.get() >= 0 ? ::read(fd.get(), buf, sizeof buf) : -1;
    if (n > 0) boot.assign(buf, static_cast<size_t>(n));
  }
  char ns[64];
  ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns);
  if (!boot.empty() && n > 0) return PlaceOf(Fnv1a(std::string_view(ns, static_cast<size_t>(n)), Fnv1a(boot)));
  uint64_t random = 0;
  if (::getrandom(&random, sizeof random, 0) != static_cast<ssize_t>(sizeof random)) {
    random = Fnv1a(std::to_string(::getpid()) + "." + std::to_string(::time(nullptr)));
  }
  return PlaceOf(random);
}

// Whether /proc shows this process's PID namespace (a pid read from a name means the process /proc
// shows under it): not so in a PID namespace entered without mounting its own /proc.
bool ProcShowsThisPidNamespace() {
  char buf[32];
  ssize_t n = ::readlink("/proc/self", buf, sizeof buf - 1);
  if (n <= 0) return false;
  buf[n] = '\0';
  return std::strtol(buf, nullptr, 10) == static_cast<long>(::getpid());
}

bool IsHexPlace(std::string_view s) {
  return s.size() == 12 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

bool IsDecimal(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

std::string TemporaryPlace() {
  // Computed again in a child (another pid): it may have entered another PID namespace.
  struct Cache {
    Mutex mu;
    pid_t computed_for GUARDED_BY(mu) = 0;
    std::string place GUARDED_BY(mu);
  };
  static Cache* cache = new Cache;  // never destroyed: writes may run during exit
  const pid_t self = ::getpid();
  MutexLock lock(&cache->mu);
  if (cache->computed_for != self) {
    cache->place = ComputeTemporaryPlace();
    cache->computed_for = self;
  }
  return cache->place;
}

std::string TemporaryPath(const std::string& final_path) {
  static std::atomic<uint64_t> counter{0};
  return final_path + ".tmp." + std::to_string(::getpid()) + "." + TemporaryPlace() + "." +
         std::to_string(counter++);
}

std::optional<TemporaryWriter> TemporaryOwner(const std::string& name) {
  auto pos = name.rfind(".tmp.");
  if (pos == std::string::npos) return std::nullopt;
  std::string_view rest = std::string_view(name).substr(pos + 5);
  std::vector<std::string_view> fields;
  for (size_t start = 0;;) {
    size_t dot = rest.find('.', start);
    fields.push_back(rest.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  const bool newer = fields.size() == 3 && IsHexPlace(fields[1]);
  if (!(newer || fields.size() == 2) || !IsDecimal(fields.front()) || !IsDecimal(fields.back()) ||
      fields.front().size() > 10) {
    return std::nullopt;
  }
  TemporaryWriter writer;
  writer.pid = std::strtol(std::string(fields.front()).c_str(), nullptr, 10);
  if (writer.pid <= 0) return std::nullopt;
  if (newer) writer.place = std::string(fields[1]);
  return writer;
}

namespace {

// The state letter and program name ("flashckptd", at most 15 characters) of /proc/<pid>/stat
// ("<pid> (<name>) <state> ..."); false when it cannot be read. The name may hold spaces and ')':
// the state follows the last ')'.
bool ReadProcessStat(const std::string& pid, char* state, std::string* program) {
  UniqueFd fd(::open(("/proc/" + pid + "/stat").c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return false;
  char buf[512];
  ssize_t n = ::read(fd.get(), buf, sizeof buf);
  if (n <= 0) return false;
  const std::string_view stat(buf, static_cast<size_t>(n));
  const size_t open = stat.find('('), close = stat.rfind(')');
  if (open == std::string_view::npos || close == std::string_view::npos || close < open || close + 2 >= stat.size()) {
    return false;
  }
  *state = stat[close + 2];
  *program = std::string(stat.substr(open + 1, close - open - 1));
  return true;
}

}  // namespace

bool IsTemporaryWriterAlive(long pid) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;  // no such process
  char state = 0;
  std::string program;
  if (!ReadProcessStat(std::to_string(pid), &state, &program)) return true;  // exists; cannot tell more
  if (state == 'Z' || state == 'X') return false;                            // exited, not yet reaped
  static const std::string own_program = [] {
    char own_state = 0;
    std::string own;
    return ReadProcessStat("self", &own_state, &own) ? own : std::string();
  }();
  return program == "flashckptd" || program == "flashckpt" || program == own_program;
}

std::vector<std::string> RemoveStaleTemporaries(const std::string& dir, const std::vector<std::string>& names,
                                                IoEnv* io) {
  std::vector<std::string> removed;
  for (const auto& name : names) {
    const std::optional<TemporaryWriter> owner = TemporaryOwner(name);
    if (!owner || (!owner->place.empty() && owner->place != TemporaryPlace())) continue;  // another node's
    if (!ProcShowsThisPidNamespace()) continue;  // its pid cannot be looked up here
    if (owner->pid == ::getpid() || IsTemporaryWriterAlive(owner->pid)) continue;
    const std::string path = dir + "/" + name;
    if (io->Unlink(path) == 0) removed.push_back(path);
  }
  return removed;
}

namespace {

// The durable sequence around `write`: create TemporaryPath(<name>) with `flags`, let `write` fill
// it, fdatasync, rename over <name>, fsync(dir); the temporary is removed on failure. `*direct_refused`
// is set (and nothing else done) when `flags` holds O_DIRECT and the file system refuses it.
template <typename Write>
Status DurableWrite(const std::string& dir, const std::string& name, int flags, bool* renamed, bool* direct_refused,
                    IoEnv* io, Write write) {
  if (renamed != nullptr) *renamed = false;
  std::string final_path = dir + "/" + name;
  std::string tmp_path = TemporaryPath(final_path);
  int fd = io->Open(tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | flags, 0644);
  if (fd < 0 && errno == EINVAL && (flags & O_DIRECT) != 0 && direct_refused != nullptr) {
    *direct_refused = true;
    return Status::OK();
  }
  if (fd < 0) return ErrnoStatus("create", tmp_path);
  UniqueFd owned(fd);
  auto fail = [&](Status s) {
    owned.Reset();
    io->Unlink(tmp_path);
    return s;
  };
  Status written = write(fd, tmp_path);
  if (!written.ok()) return fail(written);
  if (io->Fdatasync(fd) != 0) return fail(ErrnoStatus("fdatasync", tmp_path));
  owned.Reset();
  if (io->Rename(tmp_path, final_path) != 0) return fail(ErrnoStatus("rename", tmp_path));
  if (renamed != nullptr) *renamed = true;
  return FsyncDir(dir, io);
}

}  // namespace

Status WriteFileDurably(const std::string& dir, const std::string& name, const std::vector<WriteSpan>& spans,
                        bool* renamed, IoEnv* io) {
  return DurableWrite(dir, name, 0, renamed, nullptr, io, [&](int fd, const std::string& path) {
    uint64_t offset = 0;
    for (const auto& span : spans) {
      RETURN_IF_ERROR(PwriteFull(fd, span.data, span.bytes, offset, path, io));
      offset += span.bytes;
    }
    return Status::OK();
  });
}

Status WriteImageDurably(const std::string& dir, const std::string& name, const char* data, uint64_t bytes,
                         uint64_t padded, bool* renamed, IoEnv* io) {
  constexpr uint64_t kAlign = 4096, kChunk = 16u << 20;
  if (reinterpret_cast<uintptr_t>(data) % kAlign != 0 || padded % kAlign != 0 || padded < bytes) {
    return Internal("WriteImageDurably needs 4 KiB-aligned memory and a padded size");
  }
  bool direct_refused = false;
  Status s = DurableWrite(dir, name, O_DIRECT, renamed, &direct_refused, io, [&](int fd, const std::string& path) {
    for (uint64_t offset = 0; offset < padded; offset += kChunk) {
      RETURN_IF_ERROR(PwriteFull(fd, data + offset, std::min(kChunk, padded - offset), offset, path, io));
    }
    if (padded != bytes && io->Ftruncate(fd, bytes) != 0) return ErrnoStatus("ftruncate", path);
    return Status::OK();
  });
  if (direct_refused) {  // no O_DIRECT on this file system (tmpfs): a buffered write
    return WriteFileDurably(dir, name, std::vector<WriteSpan>{{data, bytes}}, renamed, io);
  }
  return s;
}

namespace {

constexpr uint64_t kAlign = 4096;

// An image's temporary while WriteImagesDurably fills it: its path (empty once renamed or never
// created) and its open descriptor.
struct OpenImage {
  std::string tmp;
  UniqueFd fd;
};

// A piece of one region of one image: the bytes [from, to) that one task prepares and writes.
struct ImagePiece {
  size_t image, region;
  uint64_t from, to;
};

// What the tasks writing a batch of images share: the first error, and the count of writes in
// flight when ImageWriteHooks::max_writes_in_flight caps it.
struct ImageBatchState {
  Mutex error_mu;
  Status first_error;               // guarded by error_mu
  std::atomic<bool> failed{false};  // set with first_error: the remaining pieces skip their writes
  // Writes in flight, when capped: a thread past the cap waits here after its prepare.
  Mutex slots_mu;
  CondVar slot_free;
  unsigned writing = 0;  // guarded by slots_mu

  // Keeps `s` when it is the first error and tells the remaining pieces to skip their writes.
  void Fail(const Status& s) {
    MutexLock lock(&error_mu);
    if (first_error.ok()) first_error = s;
    failed.store(true, std::memory_order_relaxed);
  }
};

// Internal error unless every image is laid out as WriteImagesDurably needs (aligned memory and
// head, cuts increasing from the head and within the image, a nonzero piece size).
Status CheckImageLayouts(const std::vector<ImageWrite>& images) {
  for (const ImageWrite& im : images) {
    if (reinterpret_cast<uintptr_t>(im.data) % kAlign != 0 || im.head % kAlign != 0 || im.head > im.bytes ||
        im.cuts.empty() || im.cuts.front() != im.head || !std::is_sorted(im.cuts.begin(), im.cuts.end()) ||
        im.cuts.back() > im.bytes || im.piece == 0) {
      return Internal("WriteImagesDurably: image " + im.name + " is not laid out for it");
    }
  }
  return Status::OK();
}

// Closes and removes every temporary still named in `files`; returns `s`.
Status RemoveTemporaries(std::vector<OpenImage>* files, Status s, IoEnv* io) {
  for (OpenImage& f : *files) {
    if (!f.tmp.empty()) {
      f.fd.Reset();
      io->Unlink(f.tmp);
    }
  }
  return s;
}

// Creates a temporary for each image in `dir`, with O_DIRECT where the file system takes it. On
// failure the temporaries created so far stay in `files` for the caller to remove.
Status CreateTemporaries(const std::string& dir, const std::vector<ImageWrite>& images, std::vector<OpenImage>* files,
                         IoEnv* io) {
  int flags = O_DIRECT;
  for (size_t i = 0; i < images.size(); ++i) {
    OpenImage& file = (*files)[i];
    file.tmp = TemporaryPath(dir + "/" + images[i].name);
    int fd = io->Open(file.tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | flags, 0644);
    if (fd < 0 && errno == EINVAL && flags != 0) {  // no O_DIRECT here (tmpfs): buffered writes
      flags = 0;
      fd = io->Open(file.tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    }
    if (fd < 0) {
      Status s = ErrnoStatus("create", file.tmp);
      file.tmp.clear();
      return s;
    }
    file.fd = UniqueFd(fd);
  }
  return Status::OK();
}

// Every region of every image cut into pieces of the image's piece size, in order.
std::vector<ImagePiece> CutPieces(const std::vector<ImageWrite>& images) {
  std::vector<ImagePiece> pieces;
  for (size_t i = 0; i < images.size(); ++i) {
    const ImageWrite& im = images[i];
    for (size_t r = 0; r < im.cuts.size(); ++r) {
      const uint64_t lo = im.cuts[r], hi = r + 1 < im.cuts.size() ? im.cuts[r + 1] : im.bytes;
      uint64_t from = lo;
      do {  // an empty region is one empty piece: it may still own pages, and prepare sees it
        const uint64_t to = std::min(hi, from + im.piece);
        pieces.push_back({i, r, from, to});
        from = to;
      } while (from < hi);
    }
  }
  return pieces;
}

// Calls body(k) for every k in [0, count): on `loop`'s threads, or on the caller's when it is null.
void RunEach(ParallelLoop* loop, size_t count, const std::function<void(size_t)>& body) {
  if (loop != nullptr) {
    loop->Run(count, body);
  } else {
    for (size_t k = 0; k < count; ++k) body(k);
  }
}

// One task of WriteImagesDurably: waits for the piece's bytes, prepares them and writes the pages
// that end within the piece, within the cap on writes in flight; an error goes to `state`.
void WriteImagePiece(const ImagePiece& p, const ImageWrite& im, const OpenImage& file, const ImageWriteHooks& hooks,
                     ImageBatchState* state, IoEnv* io) {
  auto down = [](uint64_t v) { return v / kAlign * kAlign; };
  const unsigned cap = hooks.max_writes_in_flight;
  // After a failure (a full disk, the trainer's copies failed) nothing more is written or waited on.
  if (state->failed.load(std::memory_order_relaxed)) return;
  if (hooks.wait) {
    if (Status s = hooks.wait(p.image, p.to); !s.ok()) return state->Fail(s);
  }
  const bool last_region = p.region + 1 == im.cuts.size();
  const uint64_t hi = last_region ? im.bytes : im.cuts[p.region + 1];
  // Pages from the one holding `from` (unless an earlier piece of the image holds its start) up
  // to the one holding `to`, which the next piece writes; the image's last piece writes its tail.
  const uint64_t begin = down(p.from),
                 end = p.to == hi && last_region ? (im.bytes + kAlign - 1) / kAlign * kAlign : down(p.to);
  if (hooks.prepare) hooks.prepare(p.image, p.region, p.from, p.to);
  if (end <= begin) return;
  if (cap > 0) {
    MutexLock lock(&state->slots_mu);
    while (state->writing >= cap) state->slot_free.Wait(&lock);
    ++state->writing;
  }
  Status s = state->failed.load(std::memory_order_relaxed)
                 ? Status::OK()
                 : PwriteFull(file.fd.get(), im.data + begin, end - begin, begin, file.tmp, io);
  if (!s.ok()) state->Fail(s);  // before the slot is freed: the thread that takes it sees the failure
  if (cap > 0) {
    MutexLock lock(&state->slots_mu);
    --state->writing;
    state->slot_free.NotifyOne();
  }
}

// The last task for one image, once all its pieces are written: runs `finish`, writes the head,
// cuts the tail to the image's size and fdatasyncs the temporary.
Status FinishImage(size_t i, const ImageWrite& im, const OpenImage& file, const ImageWriteHooks& hooks, IoEnv* io) {
  const int fd = file.fd.get();
  const std::string& path = file.tmp;
  if (hooks.finish) hooks.finish(i);
  Status s = PwriteFull(fd, im.data, im.head, 0, path, io);
  if (s.ok() && im.bytes % kAlign != 0 && io->Ftruncate(fd, im.bytes) != 0) s = ErrnoStatus("ftruncate", path);
  if (s.ok() && io->Fdatasync(fd) != 0) s = ErrnoStatus("fdatasync", path);
  return s;
}

// Closes each temporary and renames it over its image's name, in order, listing the names in
// place in `renamed`. On failure the temporaries not yet renamed stay in `files`.
Status RenameTemporaries(const std::string& dir, const std::vector<ImageWrite>& images, std::vector<OpenImage>* files,
                         std::vector<std::string>* renamed, IoEnv* io) {
  for (size_t i = 0; i < images.size(); ++i) {
    OpenImage& file = (*files)[i];
    file.fd.Reset();
    const std::string final_path = dir + "/" + images[i].name;
    if (io->Rename(file.tmp, final_path) != 0) return ErrnoStatus("rename", file.tmp);
    file.tmp.clear();
    if (renamed != nullptr) renamed->push_back(images[i].name);
  }
  return Status::OK();
}

}  // namespace

Status WriteImagesDurably(const std::string& dir, const std::vector<ImageWrite>& images, ParallelLoop* loop,
                          const ImageWriteHooks& hooks, std::vector<std::string>* renamed, IoEnv* io) {
  RETURN_IF_ERROR(CheckImageLayouts(images));
  std::vector<OpenImage> files(images.size());
  if (Status s = CreateTemporaries(dir, images, &files, io); !s.ok()) return RemoveTemporaries(&files, s, io);

  const std::vector<ImagePiece> pieces = CutPieces(images);
  ImageBatchState state;
  RunEach(loop, pieces.size(), [&](size_t k) {
    const ImagePiece& p = pieces[k];
    WriteImagePiece(p, images[p.image], files[p.image], hooks, &state, io);
  });
  if (!state.first_error.ok()) return RemoveTemporaries(&files, state.first_error, io);

  RunEach(loop, images.size(), [&](size_t i) {
    if (Status s = FinishImage(i, images[i], files[i], hooks, io); !s.ok()) state.Fail(s);
  });
  if (!state.first_error.ok()) return RemoveTemporaries(&files, state.first_error, io);
  if (Status s = RenameTemporaries(dir, images, &files, renamed, io); !s.ok()) {
    return RemoveTemporaries(&files, s, io);
  }
  return FsyncDir(dir, io);
}

Status WriteFileDurably(const std::string& dir, const std::string& name, std::string_view contents, bool* renamed,
                        IoEnv* io) {
  return WriteFileDurably(dir, name, std::vector<WriteSpan>{{contents.data(), contents.size()}}, renamed, io);
}

Result<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes, IoEnv* io) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(path, io));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("fstat", path);
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    return Corruption(path + " is " + std::to_string(size) + " bytes, more than the " + std::to_string(max_bytes) +
                      " allowed");
  }
  std::string out(size, '\0');
  RETURN_IF_ERROR(PreadFull(fd.get(), out.data(), size, 0, path, io));
  return out;
}

Result<std::vector<std::string>> ListDir(const std::string& dir, IoEnv* io) {
  std::vector<std::string> names;
  if (io->ListDir(dir, &names) != 0) return ErrnoStatus("opendir", dir);
  return names;
}

Status RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return IOError("remove " + path + ": " + ec.message());
  return Status::OK();
}

}  // namespace flashckpt

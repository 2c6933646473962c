// The durable image write: O_DIRECT from aligned memory where the file system allows it, buffered
// where it does not (tmpfs), exact size either way.
#include "common/io/fs.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <mutex>
#include <string>
#include <vector>

#include "common/base/thread_pool.h"
#include "common/io/io_env.h"
#include "test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

void WriteAndReadBack(const std::string& base) {
  char tmpl[256];
  std::snprintf(tmpl, sizeof tmpl, "%s/flashckpt-fs-test-XXXXXX", base.c_str());
  ASSERT_NE(::mkdtemp(tmpl), nullptr) << base;
  const std::string dir = tmpl;
  const uint64_t bytes = (40u << 20) + 1234, padded = (bytes + 4095) / 4096 * 4096;  // 3 chunks, ragged tail
  void* mem = ::mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* data = static_cast<char*>(mem);
  for (uint64_t i = 0; i < padded; ++i) data[i] = static_cast<char>((i * 131) >> 3);
  bool renamed = false;
  ASSERT_OK(WriteImageDurably(dir, "image.safetensors", data, bytes, padded, &renamed));
  EXPECT_TRUE(renamed);
  auto back = ReadSmallFile(dir + "/image.safetensors", 1ull << 30);
  ASSERT_OK(back.status());
  ASSERT_EQ(back->size(), bytes);
  EXPECT_EQ(std::memcmp(back->data(), data, bytes), 0);
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(e.path().filename(), "image.safetensors") << "no temporary left behind";
  }
  EXPECT_EQ(WriteImageDurably(dir, "bad", data + 1, 10, 4096).code(), StatusCode::kInternal);
  ::munmap(mem, padded);
  std::filesystem::remove_all(dir);
}

TEST(WriteImageDurably, DirectIoOnADiskFileSystem) { WriteAndReadBack("/var/tmp"); }

TEST(WriteImageDurably, BufferedFallbackOnTmpfs) { WriteAndReadBack("/dev/shm"); }

// Two images cut at unaligned offsets, written with 3 threads: every piece of every region is
// prepared exactly once, the head is written after `finish`, and the files equal
// memory.
void WriteImagesAndReadBack(const std::string& base) {
  char tmpl[256];
  std::snprintf(tmpl, sizeof tmpl, "%s/flashckpt-fs-test-XXXXXX", base.c_str());
  ASSERT_NE(::mkdtemp(tmpl), nullptr) << base;
  const std::string dir = tmpl;
  const uint64_t sizes[2] = {(9u << 20) + 4321, 3 * 4096};
  std::vector<char*> mems;
  std::vector<ImageWrite> images(2);
  for (int i = 0; i < 2; ++i) {
    const uint64_t padded = (sizes[i] + 4095) / 4096 * 4096;
    void* mem = ::mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(mem, MAP_FAILED);
    mems.push_back(static_cast<char*>(mem));
    for (uint64_t k = 0; k < padded; ++k) mems[i][k] = static_cast<char>((k * 131 + i) >> 3);
    images[i].name = "image" + std::to_string(i);
    images[i].data = mems[i];
    images[i].bytes = sizes[i];
    images[i].head = 4096;
    images[i].piece = 1u << 20;
  }
  images[0].cuts = {4096, 4096 + 10, 5000, (3u << 20) + 7, (7u << 20) + 1};  // one empty-ish, ragged cuts
  images[1].cuts = {4096};
  std::mutex mu;
  std::map<std::pair<size_t, size_t>, uint64_t> prepared;  // bytes prepared per region
  bool bad_piece = false;
  int finished = 0;
  ImageWriteHooks hooks;
  hooks.prepare = [&](size_t i, size_t r, uint64_t from, uint64_t to) {
    std::lock_guard<std::mutex> lock(mu);
    if (to < from || to - from > images[i].piece || (from - images[i].cuts[r]) % images[i].piece != 0) bad_piece = true;
    prepared[{i, r}] += to - from;
  };
  hooks.finish = [&](size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    std::memcpy(mems[i], "HEAD", 4);  // must reach the file: the head is written after finish
    ++finished;
  };
  ParallelLoop loop(2);
  std::vector<std::string> renamed;
  ASSERT_OK(WriteImagesDurably(dir, images, &loop, hooks, &renamed));
  EXPECT_FALSE(bad_piece);
  EXPECT_EQ(finished, 2);
  EXPECT_EQ(renamed, (std::vector<std::string>{"image0", "image1"}));
  for (int i = 0; i < 2; ++i) {
    for (size_t r = 0; r < images[i].cuts.size(); ++r) {
      uint64_t end = r + 1 < images[i].cuts.size() ? images[i].cuts[r + 1] : sizes[i];
      EXPECT_EQ(prepared[std::make_pair(size_t(i), r)], end - images[i].cuts[r])
          << "image " << i << " region " << r << " prepared once in full";
    }
    auto back = ReadSmallFile(dir + "/image" + std::to_string(i), 1ull << 30);
    ASSERT_OK(back.status());
    ASSERT_EQ(back->size(), sizes[i]);
    EXPECT_EQ(back->substr(0, 4), "HEAD");
    EXPECT_EQ(std::memcmp(back->data(), mems[i], sizes[i]), 0) << "image " << i;
  }
  size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) entries += e.is_regular_file();
  EXPECT_EQ(entries, 2u) << "no temporary left behind";
  images[1].cuts = {0};  // a head that is not the first cut: refused before anything is created
  EXPECT_EQ(WriteImagesDurably(dir, images, &loop, hooks, nullptr).code(), StatusCode::kInternal);
  for (int i = 0; i < 2; ++i) ::munmap(mems[i], (sizes[i] + 4095) / 4096 * 4096);
  std::filesystem::remove_all(dir);
}

TEST(WriteImagesDurably, DirectIoOnADiskFileSystem) { WriteImagesAndReadBack("/var/tmp"); }

TEST(WriteImagesDurably, BufferedFallbackOnTmpfs) { WriteImagesAndReadBack("/dev/shm"); }

// Counts the writes started and those in flight (each takes 20 ms); the n-th fails at once with
// ENOSPC when FailCall(n) was set.
class InFlightIo : public ForwardingIoEnv {
 public:
  ssize_t Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) override {
    if (++calls_ == fail_call_) {
      errno = ENOSPC;
      return -1;
    }
    const int now = ++in_flight_;
    for (int seen = most_.load(); now > seen && !most_.compare_exchange_weak(seen, now);) {
    }
    ::usleep(20 * 1000);
    --in_flight_;
    return ForwardingIoEnv::Pwrite(fd, buf, bytes, offset);
  }
  int in_flight() const { return in_flight_.load(); }
  int most() const { return most_.load(); }
  int calls() const { return calls_.load(); }
  void FailCall(int n) { fail_call_ = n; }

 private:
  std::atomic<int> in_flight_{0}, most_{0}, calls_{0};
  std::atomic<int> fail_call_{0};
};

// A loop of 6 threads with max_writes_in_flight 2: never more than 2 writes at once, the other
// threads prepare the next pieces meanwhile, and the file is whole. A failed write under the cap
// fails the call and leaves no temporary, with no thread left waiting for a write slot.
TEST(WriteImagesDurably, TheCapOnWritesInFlightHoldsAndOtherThreadsPrepareAhead) {
  char tmpl[] = "/var/tmp/flashckpt-fs-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const uint64_t bytes = (12u << 20) + 4096;  // a 4 KiB head and 12 pieces of 1 MiB
  void* mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* data = static_cast<char*>(mem);
  for (uint64_t k = 0; k < bytes; ++k) data[k] = static_cast<char>((k * 131 + 7) >> 3);
  std::vector<ImageWrite> images(1);
  images[0] = ImageWrite{"image", data, bytes, 4096, {4096}, 1u << 20};
  InFlightIo io;
  std::atomic<int> prepared_during_writes{0};
  ImageWriteHooks hooks;
  hooks.max_writes_in_flight = 2;
  hooks.prepare = [&](size_t, size_t, uint64_t, uint64_t) {
    if (io.in_flight() == 2) ++prepared_during_writes;  // only threads past the cap see it full
  };
  ParallelLoop loop(5);
  ASSERT_OK(WriteImagesDurably(dir, images, &loop, hooks, nullptr, &io));
  EXPECT_EQ(io.most(), 2) << "the cap is reached and held with 6 threads";
  EXPECT_GT(prepared_during_writes.load(), 0) << "pieces are prepared while the cap's writes are in flight";
  auto back = ReadSmallFile(dir + "/image", 1ull << 30);
  ASSERT_OK(back.status());
  ASSERT_EQ(back->size(), bytes);
  EXPECT_EQ(std::memcmp(back->data(), data, bytes), 0);

  InFlightIo failing;
  failing.FailCall(3);
  Status s = WriteImagesDurably(dir, {ImageWrite{"image2", data, bytes, 4096, {4096}, 1u << 20}}, &loop, hooks,
                                nullptr, &failing);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_LE(failing.most(), 2);
  // Two writes, then the failing third (and the fourth, if it took the other slot first): the slot
  // the failure frees goes to a thread that sees the failure, so no fifth write starts (the image
  // has 12 pieces).
  EXPECT_LE(failing.calls(), 4) << "writes went on after the failure";
  size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) entries += e.is_regular_file();
  EXPECT_EQ(entries, 1u) << "only the first image; the failed one's temporary is gone";
  ::munmap(mem, bytes);
  std::filesystem::remove_all(dir);
}

TEST(WriteImagesDurably, RemovesItsTemporariesOnFailure) {
  char tmpl[] = "/dev/shm/flashckpt-fs-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  void* mem = ::mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  std::vector<ImageWrite> images(2);
  for (int i = 0; i < 2; ++i) {
    images[i].name = "image" + std::to_string(i);
    images[i].data = static_cast<char*>(mem);
    images[i].bytes = 8192;
    images[i].head = 4096;
    images[i].cuts = {4096};
  }
  images[1].name = "missing/image1";  // its directory does not exist: the create fails
  std::vector<std::string> renamed;
  Status s = WriteImagesDurably(dir, images, nullptr, ImageWriteHooks{}, &renamed);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_TRUE(renamed.empty());
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the first image's temporary was removed";
  ::munmap(mem, 8192);
  std::filesystem::remove_all(dir);
}

// A temporary named after `pid` in `dir`, as a durable write of that process names it (of this
// process's place unless `place` is given; "" for the older form without one).
std::string TemporaryOf(const testing::TempDir& dir, pid_t pid, std::optional<std::string> place = std::nullopt) {
  const std::string at = place ? *place : TemporaryPlace();
  const std::string name = "model_state.tp00_pp00_shard00.safetensors.tmp." + std::to_string(pid) + "." +
                           (at.empty() ? "" : at + ".") + "0";
  UniqueFd fd(::open(dir.File(name).c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600));
  EXPECT_GE(fd.get(), 0) << name;
  return name;
}

TEST(RemoveStaleTemporaries, RemovesTheTemporaryOfAZombie) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  // Wait for it to exit without reaping it: it stays a zombie, and kill(pid, 0) still finds it.
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);
  ASSERT_EQ(::kill(child, 0), 0) << "the zombie is still a process";
  const std::string name = TemporaryOf(dir, child);

  std::vector<std::string> removed = RemoveStaleTemporaries(dir.path(), {name, "LATEST"});
  EXPECT_EQ(removed, std::vector<std::string>{dir.File(name)});
  EXPECT_FALSE(PathExists(dir.File(name))) << "a zombie writes nothing more: its temporary is stale";
  EXPECT_TRUE(PathExists(dir.path())) << "only the temporary goes";
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
}

TEST(RemoveStaleTemporaries, KeepsTheTemporaryOfALiveWriterAndOfThisProcess) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  int hold[2];
  ASSERT_EQ(::pipe(hold), 0);
  const pid_t child = ::fork();  // the same program as this one, alive until the pipe closes
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(hold[1]);
    char c;
    ::_exit(static_cast<int>(::read(hold[0], &c, 1)));
  }
  ::close(hold[0]);
  const std::string live = TemporaryOf(dir, child), own = TemporaryOf(dir, ::getpid());

  EXPECT_TRUE(IsTemporaryWriterAlive(child));
  EXPECT_TRUE(RemoveStaleTemporaries(dir.path(), {live, own}).empty());
  EXPECT_TRUE(PathExists(dir.File(live)));
  EXPECT_TRUE(PathExists(dir.File(own)));
  ::close(hold[1]);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  EXPECT_FALSE(IsTemporaryWriterAlive(child)) << "reaped: no such process";
}

TEST(RemoveStaleTemporaries, RemovesATemporaryWhosePidAnotherProgramHolds) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  int exec_done[2];
  ASSERT_EQ(::pipe2(exec_done, O_CLOEXEC), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::execl("/bin/sleep", "sleep", "60", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(exec_done[1]);
  char c;
  ASSERT_EQ(::read(exec_done[0], &c, 1), 0) << "closed by the exec";  // now the child runs sleep
  ::close(exec_done[0]);
  const std::string name = TemporaryOf(dir, child);

  EXPECT_FALSE(IsTemporaryWriterAlive(child)) << "sleep writes no checkpoint files";
  EXPECT_EQ(RemoveStaleTemporaries(dir.path(), {name}).size(), 1u);
  EXPECT_FALSE(PathExists(dir.File(name)));
  ::kill(child, SIGKILL);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
}

// A reaped child's pid: no process has it (until the kernel hands it out again, which takes a
// full turn of the pid space).
pid_t GonePid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  EXPECT_GT(child, 0);
  EXPECT_EQ(::waitpid(child, nullptr, 0), child);
  return child;
}

// Nodes (or containers) that share a root may run their daemons under the same pid (pid 1 of each
// container): the pid means nothing to another node, whose temporaries are never judged by it.
TEST(RemoveStaleTemporaries, LeavesATemporaryOfAnotherPlaceAloneAndJudgesTheOlderForm) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  const pid_t gone = GonePid();
  const std::string other = TemporaryOf(dir, gone, std::string("0123456789ab"));
  const std::string here = TemporaryOf(dir, gone);
  const std::string older = TemporaryOf(dir, gone, std::string());
  ASSERT_NE(TemporaryPlace(), "0123456789ab");
  auto owner = TemporaryOwner(other);
  ASSERT_TRUE(owner.has_value());
  EXPECT_EQ(owner->pid, gone);
  EXPECT_EQ(owner->place, "0123456789ab");
  ASSERT_TRUE(TemporaryOwner(older).has_value());
  EXPECT_EQ(TemporaryOwner(older)->place, "");
  EXPECT_FALSE(TemporaryOwner("LATEST").has_value());
  EXPECT_FALSE(TemporaryOwner("a.tmp.12.zz.3").has_value()) << "not a place";
  EXPECT_FALSE(TemporaryOwner("a.tmp.12.").has_value());

  std::vector<std::string> removed = RemoveStaleTemporaries(dir.path(), {other, here, older});
  std::sort(removed.begin(), removed.end());
  std::vector<std::string> expected{dir.File(here), dir.File(older)};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(removed, expected);
  EXPECT_TRUE(PathExists(dir.File(other))) << "another node's temporary stays";
}

// What each of two processes in new PID namespaces (both pid 1 there, as daemons in containers)
// names its first temporary of one path, and its pid; empty when namespaces cannot be made here.
// Both namespaces live until both names are read, as two daemons that could meet on one root do: a
// namespace's identity (its inode number) may be given to a new one once it is gone.
std::vector<std::pair<std::string, std::string>> TemporariesOfTwoPidOnes(const std::string& path) {
  int release[2];  // closed by the parent once it has both names; the pid 1s wait for that
  if (::pipe(release) != 0) return {};
  std::vector<pid_t> children;
  std::vector<int> reads;
  for (int i = 0; i < 2; ++i) {
    int fds[2];
    if (::pipe(fds) != 0) break;
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(fds[0]);
      ::close(release[1]);
      if (::unshare(CLONE_NEWPID) != 0) ::_exit(77);
      const pid_t inner = ::fork();  // pid 1 of the new namespace
      if (inner == 0) {
        const std::string line = std::to_string(::getpid()) + " " + TemporaryPath(path);
        const bool wrote = ::write(fds[1], line.data(), line.size()) == static_cast<ssize_t>(line.size());
        ::close(fds[1]);
        char c;
        while (::read(release[0], &c, 1) > 0) {
        }
        ::_exit(wrote ? 0 : 1);
      }
      ::close(fds[1]);
      ::close(release[0]);
      int status = 0;
      ::_exit(inner > 0 && ::waitpid(inner, &status, 0) == inner && WIFEXITED(status) ? WEXITSTATUS(status) : 1);
    }
    ::close(fds[1]);
    if (child < 0) {
      ::close(fds[0]);
      break;
    }
    children.push_back(child);
    reads.push_back(fds[0]);
  }
  std::vector<std::string> lines;
  for (int fd : reads) {
    std::string line;
    char buf[512];
    for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) line.append(buf, static_cast<size_t>(n));
    ::close(fd);
    lines.push_back(line);
  }
  ::close(release[1]);
  ::close(release[0]);
  bool ok = children.size() == 2;
  for (pid_t child : children) {
    int status = 0;
    ok = ::waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0 && ok;
  }
  if (!ok) return {};
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& line : lines) {
    const size_t space = line.find(' ');
    if (space == std::string::npos) return {};
    out.emplace_back(line.substr(0, space), line.substr(space + 1));
  }
  return out;
}

TEST(TemporaryPath, DiffersBetweenProcessesOfTheSamePidInTwoPidNamespaces) {
  (void)TemporaryPath("/x/warm");  // the parent's place is computed before the forks: each child's is its own
  auto names = TemporariesOfTwoPidOnes("/root/job/checkpoint-2/metadata.json");
  if (names.empty()) GTEST_SKIP() << "cannot make PID namespaces here (needs root)";
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[0].first, "1");
  EXPECT_EQ(names[1].first, "1");
  EXPECT_NE(names[0].second, names[1].second) << "two daemons, both pid 1, would write the same temporary";
  EXPECT_EQ(TemporaryOwner(names[0].second.substr(names[0].second.rfind('/') + 1))->pid, 1);
}

// Paths read from a checkpoint or an import directory are untrusted: a FIFO (which would block an
// open for reading until a writer came), a directory or a device is refused at once, by name.
TEST(OpenForRead, RefusesAnythingButARegularFileWithoutBlocking) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string fifo = dir.File("model.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  auto opened = OpenForRead(fifo);  // without O_NONBLOCK this waits for a writer forever
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kInvalidArgument) << opened.status().ToString();
  EXPECT_NE(opened.status().message().find("a FIFO, not a regular file"), std::string::npos)
      << opened.status().ToString();
  auto small = ReadSmallFile(fifo, 100);
  EXPECT_FALSE(small.ok());
  auto folder = OpenForRead(dir.path());
  ASSERT_FALSE(folder.ok());
  EXPECT_NE(folder.status().message().find("a directory"), std::string::npos) << folder.status().ToString();
  auto device = OpenForRead("/dev/zero");
  ASSERT_FALSE(device.ok());
  EXPECT_NE(device.status().message().find("a device"), std::string::npos) << device.status().ToString();
  const std::string plain = dir.File("plain");
  {
    FILE* f = std::fopen(plain.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("bytes", f);
    std::fclose(f);
  }
  auto read = ReadSmallFile(plain, 100);
  ASSERT_OK(read.status());
  EXPECT_EQ(*read, "bytes");
}

}  // namespace
}  // namespace flashckpt

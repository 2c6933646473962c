// save_bench: what a save costs the trainer and how soon it is durable, each against a limit of this
// machine measured in the same run.
//
// A real flashckptd (Daemon + Server) runs in this process on a UNIX socket; real Clients talk to it
// over gRPC and copy into its shared-memory slots; the daemon writes real files under --dir. EMA is
// off; the daemon's persist includes the header checksums (XXH3-64 of every tensor and of every
// 1 MiB chunk of it) and the durable sequence of every file, and ends when the checkpoint is
// complete (WaitPersisted returns after the writer has called the catalog).
//
//   1. staging  the time the trainer thread is blocked in Client::Snapshot(persist=true) for a host
//               state of --bytes (tensors of --tensor-bytes), against a bare memcpy of the same
//               tensors to the same offsets of an already-mapped, already-touched shared-memory
//               buffer, on as many threads as the client copies with and in the client's 16 MiB
//               chunks. Target: <= 1.1x. The warm-up's Snapshot, the first after Register, is shown
//               apart: it also faults in the slot's fresh shared-memory pages. Beside it, a memory
//               checkpoint of the same state (SnapshotOptions::tier = kMemory: kept in the daemon's
//               memory, checksummed in the background, never written), against the same memcpy; and
//               its restore (Client::Restore: the client hashes each chunk against the daemon's
//               checksums right before it copies it out), as a rate against a memcpy of the same bytes
//               out of the shared-memory buffer. Target: >= 0.8x. Beside it, the restore's own copy
//               (non-temporal stores) without the hash, and the restore's rate against that.
//   2. persist  --bytes / (Snapshot start -> WaitPersisted return), against
//               `dd if=/dev/zero of=<dir>/ddtest bs=16M count=N oflag=direct conv=fsync` of the same
//               size in the same directory (a C++ O_DIRECT write of 16 MiB blocks where dd is missing
//               or fails). Target: >= 0.9x. Beside it, to show where the time goes: what the checksums
//               alone cost on one thread (StampImage of the same images in memory) and what one small
//               durable file costs (the daemon writes four after the images).
//   3. scaling  1, 2 and 4 ranks of one job (pipeline stages, each its own Client on its own thread)
//               save at the same time, --bytes / 4 each so that the total stays bounded (4 ranks
//               write --bytes); aggregate bytes / time until every rank is durable, against the dd
//               rate of section 2.
//
// Every figure is the best of --repeat rounds after one warm-up round; the rows of a section run in
// turn within each round, so noise from other tenants spreads over them alike. Between timed writes
// the benchmark deletes what was written and syncfs()es, untimed. Nothing is asserted about timing.
// Everything it writes (files, shared memory, socket) is removed, also after SIGINT/SIGTERM (checked
// between rounds).
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench/local_daemon.h"
#include "bench/mapping.h"
#include "bench/summary.h"
#include "client/src/host_copy.h"
#include "common/base/log.h"
#include "common/base/names.h"
#include "common/base/thread_pool.h"
#include "common/format/image.h"
#include "common/format/layout.h"
#include "common/io/fs.h"
#include "common/io/shm.h"
#include "daemon/edge/server.h"
#include "flashckpt/client.h"

extern char** environ;

namespace flashckpt {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kBlock = 16u << 20;  // dd's bs, the client's copy chunk
constexpr uint32_t kSlots = 2;          // the daemon's default --slots

double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
double Gbps(uint64_t bytes, double secs) { return static_cast<double>(bytes) / secs / 1e9; }

std::atomic<bool> g_interrupted{false};
void OnSignal(int) {
  if (g_interrupted.exchange(true)) ::_exit(130);  // a second signal: give up on cleaning
}
Status CheckInterrupted() { return g_interrupted ? Cancelled("interrupted") : Status::OK(); }

using bench::Mapping;  // the trainer's host state and the limits' buffers

using bench::LocalDaemon;

// One rank's state: fp32 tensors of up to `tensor_bytes` that cycle through a weight (model_state
// file) and its two Adam moments (optimizer file), laid one after the other in host memory.
struct RankState {
  std::vector<TensorSpec> specs;
  std::vector<TensorBuffer> buffers;
  uint64_t bytes = 0;
};

RankState MakeRank(uint32_t stage, char* host, uint64_t bytes, uint64_t tensor_bytes) {
  static const char* const kSuffix[] = {".weight", ".exp_avg", ".exp_avg_sq"};
  RankState r;
  r.bytes = bytes;
  for (uint64_t i = 0, done = 0; done < bytes; ++i) {
    uint64_t n = std::min(tensor_bytes, bytes - done);
    TensorSpec s;
    s.name = "stage" + std::to_string(stage) + ".layers." + std::to_string(i / 3) + kSuffix[i % 3];
    s.kind = i % 3 == 0 ? TensorKind::kModel : TensorKind::kOptimizer;
    s.dtype = DType::kF32;
    s.shape = {n / sizeof(float)};
    r.buffers.push_back({s.name, host + done, n});
    r.specs.push_back(std::move(s));
    done += n;
  }
  return r;
}

Topology Stage(uint32_t stage, uint32_t stages) {
  Topology t;
  t.world_size = stages;
  t.pp_rank = stage;
  t.pp_degree = stages;
  return t;
}

Status SyncFs(const std::string& dir) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus("open directory", dir);
  if (::syncfs(fd.get()) != 0) return ErrnoStatus("syncfs", dir);
  return Status::OK();
}

// ---- The write limit: dd, or the same write in C++ where dd cannot run here ----

class WriteLimit {
 public:
  WriteLimit(std::string path, uint64_t blocks) : path_(std::move(path)), blocks_(blocks) {}
  uint64_t bytes() const { return blocks_ * kBlock; }
  std::string Describe() const {
    if (use_dd_) {
      return "dd if=/dev/zero of=" + path_ + " bs=16M count=" + std::to_string(blocks_) + " oflag=direct conv=fsync";
    }
    return std::string("C++ write of ") + std::to_string(blocks_) + " x 16 MiB, " +
           (direct_ ? "O_DIRECT" : "buffered (no O_DIRECT here)") + ", then fsync (dd unusable: " + why_not_dd_ + ")";
  }
  const std::string& dd_said() const { return dd_said_; }
  const char* Label() const { return use_dd_ ? "write limit (dd)" : "write limit (C++ write)"; }

  // Seconds for one write of the file, which is removed afterwards (untimed).
  Result<double> Run() {
    if (use_dd_) {
      auto secs = RunDd();
      if (secs.ok()) return secs;
      use_dd_ = false;  // dd missing or failing (tmpfs refuses oflag=direct): the C++ write from now on
      why_not_dd_ = secs.status().message();
      ::unlink(path_.c_str());
    }
    return RunDirect();
  }

 private:
  Result<double> RunDd() {
    std::vector<std::string> args = {
        "dd",           "if=/dev/zero", "of=" + path_, "bs=16M", "count=" + std::to_string(blocks_),
        "oflag=direct", "conv=fsync"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int pipefd[2];
    if (::pipe2(pipefd, O_CLOEXEC) != 0) return ErrnoStatus("pipe", "dd");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, pipefd[1], 1);
    posix_spawn_file_actions_adddup2(&actions, pipefd[1], 2);
    pid_t pid = 0;
    auto start = Clock::now();
    int err = ::posix_spawnp(&pid, "dd", &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(pipefd[1]);
    UniqueFd out(pipefd[0]);
    if (err != 0) return ErrnoStatus("spawn", "dd", err);
    std::string text;
    char buf[4096];
    for (;;) {
      ssize_t n = ::read(out.get(), buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      text.append(buf, static_cast<size_t>(n));
    }
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    double secs = Since(start);
    while (!text.empty() && text.back() == '\n') text.pop_back();
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      return IOError("dd failed: " + text.substr(0, text.find('\n')));
    }
    dd_said_ = text.substr(text.rfind('\n') + 1);  // "... bytes copied, 1.9 s, 1.1 GB/s"
    if (::unlink(path_.c_str()) != 0) return ErrnoStatus("unlink", path_);
    return secs;
  }

  Result<double> RunDirect() {
    if (!zeros_) {
      zeros_.reset(static_cast<char*>(std::aligned_alloc(kPageSize, kBlock)));
      if (!zeros_) return ResourceExhausted("cannot allocate 16 MiB");
      std::memset(zeros_.get(), 0, kBlock);
    }
    auto start = Clock::now();
    int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
    direct_ = fd >= 0 || errno != EINVAL;
    if (!direct_) fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoStatus("create", path_);
    UniqueFd owned(fd);
    for (uint64_t b = 0; b < blocks_; ++b) RETURN_IF_ERROR(PwriteFull(fd, zeros_.get(), kBlock, b * kBlock, path_));
    if (::fsync(fd) != 0) return ErrnoStatus("fsync", path_);
    owned.Reset();
    double secs = Since(start);
    if (::unlink(path_.c_str()) != 0) return ErrnoStatus("unlink", path_);
    return secs;
  }

  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };
  std::string path_;
  uint64_t blocks_;
  bool use_dd_ = true, direct_ = true;
  std::string why_not_dd_, dd_said_;
  std::unique_ptr<char, FreeDeleter> zeros_;
};

// ---- Statistics and the machine ----

struct Samples {
  std::vector<double> v;
  double best() const { return *std::min_element(v.begin(), v.end()); }
  double median() const {
    std::vector<double> s = v;
    std::sort(s.begin(), s.end());
    size_t n = s.size();
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
  }
};

const char* FsName(int64_t magic) {
  switch (static_cast<uint64_t>(magic)) {
    case 0xEF53: return "ext2/3/4";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    case 0x794C7630: return "overlayfs";
    case 0x6969: return "nfs";
    case 0x2FC12FC1: return "zfs";
    case 0xF2F52010: return "f2fs";
    case 0x65735546: return "fuse";
    default: return "other";
  }
}

// "/dev/vda on / (ext4)": the mount that holds `dir`, from /proc/self/mounts.
std::string MountOf(const std::string& dir) {
  char real[PATH_MAX];
  if (::realpath(dir.c_str(), real) == nullptr) return "unknown mount";
  std::string path = real, best, line;
  std::ifstream mounts("/proc/self/mounts");
  size_t best_len = 0;
  while (std::getline(mounts, line)) {
    char dev[512], point[512], type[128];
    if (std::sscanf(line.c_str(), "%511s %511s %127s", dev, point, type) != 3) continue;
    std::string p = point;
    bool under = path == p || p == "/" || (path.compare(0, p.size(), p) == 0 && path[p.size()] == '/');
    if (under && p.size() >= best_len) {
      best_len = p.size();
      best = std::string(dev) + " on " + p + " (" + type + ")";
    }
  }
  return best.empty() ? "unknown mount" : best;
}

std::string CpuModel() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

// Whether files under `dir` can be opened with O_DIRECT (the daemon falls back to buffered writes
// where they cannot, e.g. tmpfs).
std::string DirectIo(const std::string& dir) {
  std::string probe = dir + "/o_direct_probe";
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  int err = errno;
  if (fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
    return "yes (the daemon writes images with O_DIRECT, 16 MiB at a time)";
  }
  return std::string("no (") + std::strerror(err) + "): the daemon and the limit write through the page cache";
}

void PrintMachine(const std::string& dir, unsigned copy_threads, unsigned writer_threads) {
  cpu_set_t set;
  CPU_ZERO(&set);
  int usable = ::sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : -1;
  struct statfs fs {};
  std::string fs_type = ::statfs(dir.c_str(), &fs) == 0 ? FsName(fs.f_type) : "unknown";
  char magic[32] = "";
  std::snprintf(magic, sizeof magic, "0x%llx", static_cast<unsigned long long>(fs.f_type));
  uint64_t ram = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::printf("machine: %ld cores online, %d usable by this process (%s), %s of RAM\n", ::sysconf(_SC_NPROCESSORS_ONLN),
              usable, CpuModel().c_str(), FormatBytes(ram).c_str());
  std::printf("--dir %s: statfs type %s (%s), %s\n", dir.c_str(), fs_type.c_str(), magic, MountOf(dir).c_str());
  std::printf("O_DIRECT under --dir: %s\n", DirectIo(dir).c_str());
  std::printf(
      "client copy threads %u (min(cores, 8), the client's default); daemon: %u writer threads, %u slots, "
      "EMA off, 1 MiB checksum chunks\n\n",
      copy_threads, writer_threads, kSlots);
  std::fflush(stdout);
}

// ---- The benchmark ----

struct Options {
  uint64_t bytes = 0, tensor_bytes = 0;
  std::string dir;
  unsigned repeat = 3, writer_threads = 2, copy_threads = 1;
};

struct Work {
  std::string root;    // <dir>/flashckpt-save-bench-XXXXXX: the daemon's --root and the dd file
  std::string socket;  // /tmp/flashckpt-save-bench-XXXXXX/flashckptd.sock
  std::string job_prefix;
};

DaemonConfig Config(const Options& o, const Work& w) {
  DaemonConfig c;
  c.socket_path = w.socket;
  c.root = w.root;
  c.slots = kSlots;
  c.writer_threads = o.writer_threads;
  c.max_host_memory = kSlots * o.bytes + (1ull << 30);  // every section fits: 4 ranks of --bytes/4 at most
  return c;
}

Result<std::unique_ptr<Client>> ConnectRank(const Options& o, const Work& w, const std::string& job, uint32_t rank,
                                            const RankState& state, const Topology& topology) {
  ClientOptions co;
  co.socket_path = w.socket;
  co.job = job;
  co.rank = rank;
  co.copy_threads = o.copy_threads;
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(co));
  RETURN_IF_ERROR(client->Register(topology, state.specs));
  return client;
}

struct Save {
  double blocked = 0;  // in Client::Snapshot
  Clock::time_point durable;
};

Result<Save> SaveStep(Client* client, int64_t step, const std::vector<TensorBuffer>& buffers) {
  Save s;
  auto start = Clock::now();
  ASSIGN_OR_RETURN(SnapshotHandle handle, client->Snapshot(step, buffers, SnapshotOptions{}));
  s.blocked = Since(start);
  RETURN_IF_ERROR(handle.WaitCopied());
  RETURN_IF_ERROR(client->WaitPersisted(step, std::chrono::minutes(10)));
  s.durable = Clock::now();
  return s;
}

// Checks that the checkpoint is complete, then deletes it and lets the file system settle (untimed).
Status Discard(const Work& w, const std::string& job, int64_t step) {
  std::string dir = w.root + "/" + job + "/" + CheckpointDirName(step);
  if (!PathExists(dir + "/metadata.json")) {
    return Internal(dir + " has no metadata.json after every rank's WaitPersisted returned");
  }
  RETURN_IF_ERROR(RemoveTree(dir));
  return SyncFs(w.root);
}

void PrintTarget(double ratio, bool at_most, double target) {
  bool met = at_most ? ratio <= target : ratio >= target;
  std::printf(" %8s %.1fx  %s\n", at_most ? "<=" : ">=", target, met ? "met" : "NOT met");
}

// Sections 1 and 2 share their rounds: memcpy, StampImage, one save of --bytes, the write limit.
Result<double> StagingAndPersist(const Options& o, const Work& w, char* host, WriteLimit* limit) {
  const std::string job = w.job_prefix + "-1rank";
  RankState rank = MakeRank(0, host, o.bytes, o.tensor_bytes);
  ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout(job, 0, Topology{}, rank.specs));

  // The memcpy's destination: shared memory like a slot, mapped and touched before any timing.
  ASSIGN_OR_RETURN(auto shm, SharedSegment::Create("flashckpt." + job + ".memcpy", layout.slot_bytes, 0600));
  ParallelLoop loop(o.copy_threads - 1);
  loop.Run((layout.slot_bytes + kBlock - 1) / kBlock, [&](size_t i) {
    std::memset(shm->data() + i * kBlock, 0, std::min<uint64_t>(kBlock, layout.slot_bytes - i * kBlock));
  });
  InitSlotImages(shm->data(), layout);
  std::vector<CopyTask> tasks, back;  // into the slot-like buffer, and out of it into the state
  for (const TensorBuffer& b : rank.buffers) {
    int t = layout.Find(b.name);
    if (t < 0) return Internal("tensor " + b.name + " is missing from the layout");
    tasks.push_back({shm->data() + layout.placements[t].slot_offset, static_cast<const char*>(b.data), b.bytes});
    back.push_back({static_cast<char*>(b.data), shm->data() + layout.placements[t].slot_offset, b.bytes});
  }

  ASSIGN_OR_RETURN(auto daemon, LocalDaemon::Start(Config(o, w)));
  ASSIGN_OR_RETURN(auto client, ConnectRank(o, w, job, 0, rank, Topology{}));

  Samples memcpy_s, stamp_s, blocked_s, durable_s, limit_s, small_s, memory_s, copy_out_s, stream_out_s, restore_s;
  double first_snapshot = 0;                              // the warm-up round's: the slot's pages are faulted in
  for (unsigned round = 0; round <= o.repeat; ++round) {  // round 0 warms up and is not counted
    RETURN_IF_ERROR(CheckInterrupted());
    const bool counted = round > 0;
    const int64_t step = 2 * round + 1;  // a disk save, then memory checkpoint step + 1

    auto start = Clock::now();
    ParallelCopy(&loop, tasks);
    if (counted) memcpy_s.v.push_back(Since(start));

    start = Clock::now();
    for (size_t f = 0; f < layout.files.size(); ++f) StampImage(shm->data(), layout, f, step);
    if (counted) stamp_s.v.push_back(Since(start));

    start = Clock::now();
    ASSIGN_OR_RETURN(Save save, SaveStep(client.get(), step, rank.buffers));
    if (counted) {
      blocked_s.v.push_back(save.blocked);
      durable_s.v.push_back(std::chrono::duration<double>(save.durable - start).count());
    } else {
      first_snapshot = save.blocked;
    }
    RETURN_IF_ERROR(Discard(w, job, step));

    // A memory checkpoint of the same state: blocked as long as the disk save's staging, and never
    // written. Its checksums are computed in the background; Restorable waits for them (untimed).
    SnapshotOptions memory;
    memory.tier = Tier::kMemory;
    start = Clock::now();
    ASSIGN_OR_RETURN(SnapshotHandle kept, client->Snapshot(step + 1, rank.buffers, memory));
    if (counted) memory_s.v.push_back(Since(start));
    RETURN_IF_ERROR(kept.WaitCopied());
    ASSIGN_OR_RETURN(RestorableSteps held, client->Restorable(std::chrono::minutes(1)));
    if (held.memory_steps.empty() || held.memory_steps.front() != step + 1) {
      return Internal("memory checkpoint step " + std::to_string(step + 1) + " is not held after its Snapshot");
    }
    // Restoring it into the state: the client hashes each chunk and copies it out. Against a memcpy
    // of the same bytes out of the slot-like buffer into the state, and against the restore's own
    // copy (non-temporal stores) without the hash.
    start = Clock::now();
    ParallelCopy(&loop, back);
    if (counted) copy_out_s.v.push_back(Since(start));
    start = Clock::now();
    ParallelStreamCopy(&loop, back);
    if (counted) stream_out_s.v.push_back(Since(start));
    start = Clock::now();
    ASSIGN_OR_RETURN(RestoreResult restored, client->Restore(step + 1, rank.buffers, std::chrono::minutes(1)));
    if (counted) restore_s.v.push_back(Since(start));
    if (!restored.found || restored.step != step + 1 || restored.tier != Tier::kMemory) {
      return Internal("the restore of memory checkpoint step " + std::to_string(step + 1) + " got step " +
                      std::to_string(restored.step) + (restored.tier == Tier::kMemory ? " from memory" : " from disk"));
    }

    ASSIGN_OR_RETURN(double secs, limit->Run());
    RETURN_IF_ERROR(SyncFs(w.root));
    if (counted) limit_s.v.push_back(secs);

    // The fixed cost the daemon pays per small file after the data (extra, saved_signal,
    // metadata.json, LATEST): the durable sequence of common/io/fs.h on 1 KiB.
    start = Clock::now();
    RETURN_IF_ERROR(WriteFileDurably(w.root, "small.json", std::string(1024, ' ')));
    if (counted) small_s.v.push_back(Since(start));
    if (::unlink((w.root + "/small.json").c_str()) != 0) return ErrnoStatus("unlink", w.root + "/small.json");
  }
  client.reset();
  daemon.reset();

  const uint64_t bytes = o.bytes;
  std::printf(
      "1. staging: trainer thread blocked in Client::Snapshot(persist=true) vs a bare memcpy of the same "
      "bytes into mapped, touched shared memory\n");
  std::printf("   %s in %zu tensors of up to %s; %u copy threads, 16 MiB chunks; best of %u after a warm-up\n\n",
              FormatBytes(bytes).c_str(), rank.buffers.size(), FormatBytes(o.tensor_bytes).c_str(), o.copy_threads,
              o.repeat);
  std::printf("   %-40s %9s %10s %8s %10s %s\n", "row", "best ms", "median ms", "GB/s", "vs memcpy", "  target");
  std::printf("   %-40s %9.1f %10.1f %8.2f %9.2fx\n", "memcpy into shared memory (limit)", memcpy_s.best() * 1e3,
              memcpy_s.median() * 1e3, Gbps(bytes, memcpy_s.best()), 1.0);
  const double staging = blocked_s.best() / memcpy_s.best();
  std::printf("   %-40s %9.1f %10.1f %8.2f %9.2fx", "Client::Snapshot (Begin + copy + Commit)", blocked_s.best() * 1e3,
              blocked_s.median() * 1e3, Gbps(bytes, blocked_s.best()), staging);
  PrintTarget(staging, true, 1.1);
  bench::SummaryRow("1. staging: Snapshot blocking vs memcpy into shm", staging, "<=", 1.1);
  const double memory_ratio = memory_s.best() / memcpy_s.best();
  std::printf("   %-40s %9.1f %10.1f %8.2f %9.2fx", "Client::Snapshot(tier=memory)", memory_s.best() * 1e3,
              memory_s.median() * 1e3, Gbps(bytes, memory_s.best()), memory_ratio);
  PrintTarget(memory_ratio, true, 1.1);
  bench::SummaryRow("1. memory checkpoint: Snapshot(tier=memory) blocking vs memcpy into shm", memory_ratio, "<=",
                    1.1);
  const double restore_ratio = copy_out_s.best() / restore_s.best();  // a rate ratio: >= is better
  std::printf("   %-40s %9.1f %10.1f %8.2f %9.2fx\n", "memcpy out of shared memory (limit)", copy_out_s.best() * 1e3,
              copy_out_s.median() * 1e3, Gbps(bytes, copy_out_s.best()), 1.0);
  std::printf("   %-40s %9.1f %10.1f %8.2f %9.2fx", "Client::Restore of the memory checkpoint", restore_s.best() * 1e3,
              restore_s.median() * 1e3, Gbps(bytes, restore_s.best()), restore_ratio);
  PrintTarget(restore_ratio, false, 0.8);
  bench::SummaryRow("1. memory restore: Client::Restore (checksums verified) rate vs memcpy out of shm", restore_ratio,
                    ">=", 0.8);
  const double stream_ratio = stream_out_s.best() / restore_s.best();
  std::printf("   %-40s %9.1f %10.1f %8.2f %9.2fx  (Restore's rate / this one's: %.2fx)\n",
              "copy out, non-temporal stores, no hash", stream_out_s.best() * 1e3, stream_out_s.median() * 1e3,
              Gbps(bytes, stream_out_s.best()), copy_out_s.best() / stream_out_s.best(), stream_ratio);
  std::printf("   %-40s %9.1f %10s %8.2f %9.2fx  (warm-up, not in the ratio)\n", "first Snapshot after Register",
              first_snapshot * 1e3, "", Gbps(bytes, first_snapshot), first_snapshot / memcpy_s.best());
  std::printf(
      "   (vs memcpy = best time / memcpy's best time, except for the restore: its rate / the memcpy's rate, i.e. the\n"
      "   memcpy's time / its time; Snapshot adds the BeginSnapshot and Commit RPCs. The first\n"
      "   Snapshot also faults in the slot's fresh shared-memory pages, which the memcpy's buffer had before "
      "timing)\n\n");

  const double limit_rate = Gbps(limit->bytes(), limit_s.best());
  const double rate = Gbps(bytes, durable_s.best());
  std::printf("2. persist: %s from Snapshot start to WaitPersisted return (checkpoint complete) vs the write limit\n",
              FormatBytes(bytes).c_str());
  std::printf("   limit: %s\n", limit->Describe().c_str());
  if (!limit->dd_said().empty()) std::printf("   dd's own last line: %s\n", limit->dd_said().c_str());
  std::printf("\n   %-40s %9s %10s %8s %10s %s\n", "row", "best s", "median s", "GB/s", "vs limit", "  target");
  std::printf("   %-40s %9.3f %10.3f %8.2f %9.2fx\n", limit->Label(), limit_s.best(), limit_s.median(), limit_rate,
              1.0);
  std::printf("   %-40s %9.3f %10.3f %8.2f %9.2fx", "snapshot -> durable", durable_s.best(), durable_s.median(), rate,
              rate / limit_rate);
  PrintTarget(rate / limit_rate, false, 0.9);
  bench::SummaryRow("2. persist: snapshot -> durable vs dd oflag=direct", rate / limit_rate, ">=", 0.9);
  const double limit_same = limit_s.best() * static_cast<double>(bytes) / static_cast<double>(limit->bytes());
  std::printf("\n   where the time goes (best of each; the parts are measured apart, in the same rounds):\n");
  std::printf("   %-40s %9.3f s\n", "staging (Client::Snapshot)", blocked_s.best());
  std::printf("   %-40s %9.3f s  (%.2f GB/s)\n", "checksums: StampImage, 1 thread, in RAM", stamp_s.best(),
              Gbps(bytes, stamp_s.best()));
  std::printf("   %-40s %9.3f s\n", "write limit for the same bytes", limit_same);
  std::printf("   %-40s %9.3f s  (%.2f ms; x4 = %.3f s)\n", "small durable file (1 KiB, fdatasync..)", small_s.best(),
              small_s.best() * 1e3, 4 * small_s.best());
  const double fixed = 4 * small_s.best();
  std::printf("   %-40s %9.3f s\n", "  sum, if nothing overlapped",
              blocked_s.best() + stamp_s.best() + limit_same + fixed);
  std::printf("   %-40s %9.3f s\n", "  sum without the checksums", blocked_s.best() + limit_same + fixed);
  std::printf("   %-40s %9.3f s  (%.2f GB/s, %.2fx the limit)\n", "measured: snapshot -> durable", durable_s.best(),
              rate, rate / limit_rate);
  Samples after;  // per round: from Snapshot's return to WaitPersisted's
  for (size_t i = 0; i < durable_s.v.size(); ++i) after.v.push_back(durable_s.v[i] - blocked_s.v[i]);
  std::printf("   %-40s %9.3f s  (best of the per-round differences; median %.3f s)\n",
              "  of which after Snapshot returned", after.best(), after.median());
  std::printf(
      "   (x4: after the images the daemon writes extra.rankNNNNN.json, saved_signal_<rank>, metadata.json\n"
      "   and LATEST, each with the same durable sequence)\n\n");
  std::fflush(stdout);
  return limit_rate;
}

struct ScaleRow {
  uint32_t ranks = 0;
  uint64_t per_rank = 0;
  Samples secs, blocked;
};

Result<ScaleRow> Scale(const Options& o, const Work& w, char* host, uint32_t ranks) {
  const std::string job = w.job_prefix + "-" + std::to_string(ranks) + "ranks";
  ScaleRow row;
  row.ranks = ranks;
  row.per_rank = o.bytes / 4 / kPageSize * kPageSize;
  std::vector<RankState> states;
  for (uint32_t r = 0; r < ranks; ++r) {
    states.push_back(MakeRank(r, host + r * row.per_rank, row.per_rank, o.tensor_bytes));
  }

  ASSIGN_OR_RETURN(auto daemon, LocalDaemon::Start(Config(o, w)));
  std::vector<std::unique_ptr<Client>> clients;
  for (uint32_t r = 0; r < ranks; ++r) {
    ASSIGN_OR_RETURN(auto c, ConnectRank(o, w, job, r, states[r], Stage(r, ranks)));
    clients.push_back(std::move(c));
  }
  for (unsigned round = 0; round <= o.repeat; ++round) {
    RETURN_IF_ERROR(CheckInterrupted());
    const int64_t step = round + 1;
    std::vector<std::optional<Result<Save>>> saves(ranks);
    std::vector<std::thread> threads;
    auto start = Clock::now();
    for (uint32_t r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] { saves[r].emplace(SaveStep(clients[r].get(), step, states[r].buffers)); });
    }
    for (auto& t : threads) t.join();
    Clock::time_point end = start;
    double blocked = 0;
    for (auto& s : saves) {
      if (!s->ok()) return s->status();
      end = std::max(end, (*s)->durable);
      blocked = std::max(blocked, (*s)->blocked);
    }
    if (round > 0) {
      row.secs.v.push_back(std::chrono::duration<double>(end - start).count());
      row.blocked.v.push_back(blocked);
    }
    RETURN_IF_ERROR(Discard(w, job, step));
  }
  return row;
}

int Main(int argc, char** argv) {
  std::string bytes_text = "2GiB", tensor_text = "256MiB";
  Options o;
  o.dir = "/var/tmp";
  CLI::App app{"save_bench: staging and persist of a checkpoint through a real daemon, against memcpy and dd"};
  app.add_option("--bytes", bytes_text, "Host state of the rank (2GiB, 512MiB, ...)")->capture_default_str();
  app.add_option("--tensor-bytes", tensor_text, "Size of each tensor (the last one may be smaller)")
      ->capture_default_str();
  app.add_option("--dir", o.dir, "Directory to write checkpoints and the dd file under")->capture_default_str();
  app.add_option("--repeat", o.repeat, "Timed rounds after one warm-up round (the best is printed)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app.add_option("--writer-threads", o.writer_threads, "The daemon's --writer-threads")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  auto bytes = ParseByteSize(bytes_text);
  auto tensor_bytes = ParseByteSize(tensor_text);
  if (!bytes || *bytes < (1u << 20) || !tensor_bytes || *tensor_bytes < kPageSize) {
    std::fprintf(stderr, "save_bench: --bytes must be at least 1MiB and --tensor-bytes at least 4KiB\n");
    return 2;
  }
  o.bytes = *bytes / kPageSize * kPageSize;  // whole pages, so fp32 tensors
  o.tensor_bytes = *tensor_bytes / sizeof(float) * sizeof(float);
  o.copy_threads = std::min(8u, std::max(1u, std::thread::hardware_concurrency()));
  SetLogLevel("warn");  // no per-save log lines amid the tables

  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  Work w;
  std::string root_tmpl = o.dir + "/flashckpt-save-bench-XXXXXX";
  std::string socket_tmpl = "/tmp/flashckpt-save-bench-XXXXXX";  // short: a socket path has 108 bytes
  if (::mkdtemp(root_tmpl.data()) == nullptr) {
    std::fprintf(stderr, "save_bench: %s\n", ErrnoStatus("mkdtemp", root_tmpl).ToString().c_str());
    return 1;
  }
  if (::mkdtemp(socket_tmpl.data()) == nullptr) {
    std::fprintf(stderr, "save_bench: %s\n", ErrnoStatus("mkdtemp", socket_tmpl).ToString().c_str());
    (void)RemoveTree(root_tmpl);
    return 1;
  }
  w.root = root_tmpl;
  w.socket = socket_tmpl + "/flashckptd.sock";
  w.job_prefix = "save-bench-" + std::to_string(::getpid());

  PrintMachine(o.dir, o.copy_threads, o.writer_threads);
  Status status = [&]() -> Status {
    ASSIGN_OR_RETURN(Mapping host, Mapping::Make(o.bytes));
    {  // The trainer's state: touched on the copy threads, not constant.
      ParallelLoop loop(o.copy_threads - 1);
      loop.Run((o.bytes + kBlock - 1) / kBlock, [&](size_t i) {
        auto* words = reinterpret_cast<uint64_t*>(host.data() + i * kBlock);
        uint64_t n = std::min<uint64_t>(kBlock, o.bytes - i * kBlock) / 8, x = 0x9e3779b97f4a7c15ull * (i + 1);
        for (uint64_t k = 0; k < n; ++k) words[k] = x += 0x632be59bd9b4e019ull;
      });
    }
    WriteLimit limit(w.root + "/ddtest", (o.bytes + kBlock - 1) / kBlock);
    ASSIGN_OR_RETURN(double limit_rate, StagingAndPersist(o, w, host.data(), &limit));

    std::vector<ScaleRow> rows;
    for (uint32_t ranks : {1u, 2u, 4u}) {
      ASSIGN_OR_RETURN(ScaleRow row, Scale(o, w, host.data(), ranks));
      rows.push_back(std::move(row));
    }
    std::printf(
        "3. scaling: N ranks (pipeline stages of one job, a Client and a thread each) save at once, %s per "
        "rank (--bytes / 4, so 4 ranks write --bytes)\n",
        FormatBytes(rows[0].per_rank).c_str());
    std::printf(
        "   aggregate GB/s = N x per-rank bytes / (first Snapshot start -> last WaitPersisted return); "
        "limit: the write above, %.2f GB/s; best of %u\n\n",
        limit_rate, o.repeat);
    std::printf("   %5s %10s %9s %10s %8s %9s %18s\n", "ranks", "total", "best s", "median s", "GB/s", "vs limit",
                "max blocked ms");
    for (const ScaleRow& r : rows) {
      const uint64_t total = r.per_rank * r.ranks;
      const double rate = Gbps(total, r.secs.best());
      std::printf("   %5u %10s %9.3f %10.3f %8.2f %8.2fx %18.1f\n", r.ranks, FormatBytes(total).c_str(), r.secs.best(),
                  r.secs.median(), rate, rate / limit_rate, r.blocked.best() * 1e3);
      bench::SummaryRow("6. scaling: " + std::to_string(r.ranks) + " rank(s) to durable vs dd", rate / limit_rate);
    }
    std::printf(
        "   (max blocked = the longest any rank spent in Client::Snapshot in a round, best of the rounds; "
        "each rank copies on %u threads)\n",
        o.copy_threads);
    return Status::OK();
  }();
  Status removed = RemoveTree(w.root);
  (void)RemoveTree(socket_tmpl);
  if (!status.ok()) {
    std::fprintf(stderr, "save_bench: %s\n", status.ToString().c_str());
    return g_interrupted ? 130 : 1;
  }
  if (!removed.ok()) std::fprintf(stderr, "save_bench: %s\n", removed.ToString().c_str());
  return removed.ok() ? 0 : 1;
}

}  // namespace
}  // namespace flashckpt

int main(int argc, char** argv) { return flashckpt::Main(argc, argv); }

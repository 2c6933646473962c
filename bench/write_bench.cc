// write_bench: how the persist path's writes compare with the disk, and which way of keeping
// several O_DIRECT writes in flight is faster here: threads doing pwrite, or io_uring.
//
// Every row writes the same --bytes from the same page-aligned memory into a new file in --dir with
// O_DIRECT in --chunk pieces, then fdatasync; time is until fdatasync returns. Rows:
//
//   dd oflag=direct          `dd bs=<chunk> oflag=direct conv=fdatasync`: the limit
//   pwrite, 1 thread         one write in flight
//   pwrite, N threads        N writes in flight from N threads (ParallelLoop)
//   io_uring, depth N        N writes in flight from one thread (liburing)
//   writer path              WriteImagesDurably as the daemon's writer calls it: N threads, each
//                            16 MiB piece's 1 MiB chunks hashed right before its pages are written,
//                            a whole-tensor hash per tensor as a task of the same loop, header last,
//                            then fdatasync + rename + fsync(dir)
//   writer path, no hash     the same without hashing: what the fused checksums cost
//   hashing only             the writer path's hashing without any I/O, on the same threads: the
//                            CPU time the checksums need (xxh3 per chunk, then the whole-tensor pass)
//
// Best of --repeat runs each; every row is also given as a ratio to dd.
#include <fcntl.h>
#include <liburing.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/summary.h"
#include "common/base/names.h"
#include "common/base/thread_pool.h"
#include "common/format/checksum.h"
#include "common/io/fs.h"

namespace flashckpt {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

Result<UniqueFd> CreateDirect(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  if (fd < 0) return ErrnoStatus("open O_DIRECT", path);
  return UniqueFd(fd);
}

// Runs `dd` writing `bytes` of zeros to `path`; returns its wall time.
Result<double> RunDd(const std::string& path, uint64_t bytes, uint64_t chunk) {
  const std::string bs = "bs=" + std::to_string(chunk), count = "count=" + std::to_string(bytes / chunk),
                    of = "of=" + path;
  auto start = std::chrono::steady_clock::now();
  pid_t pid = ::fork();
  if (pid < 0) return ErrnoStatus("fork", "dd");
  if (pid == 0) {
    int null = ::open("/dev/null", O_WRONLY);
    if (null >= 0) ::dup2(null, 2);
    ::execlp("dd", "dd", "if=/dev/zero", of.c_str(), bs.c_str(), count.c_str(), "oflag=direct", "conv=fdatasync",
             static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Internal("dd failed (exit status " + std::to_string(WEXITSTATUS(status)) + ")");
  }
  return Seconds(start);
}

Result<double> PwriteThreads(const std::string& path, const char* data, uint64_t bytes, uint64_t chunk,
                             ParallelLoop* loop) {
  ASSIGN_OR_RETURN(UniqueFd fd, CreateDirect(path));
  const size_t pieces = (bytes + chunk - 1) / chunk;
  std::atomic<bool> failed{false};
  auto start = std::chrono::steady_clock::now();
  auto body = [&](size_t k) {
    const uint64_t off = k * chunk;
    if (!PwriteFull(fd.get(), data + off, std::min(chunk, bytes - off), off, path).ok()) failed = true;
  };
  if (loop != nullptr) {
    loop->Run(pieces, body);
  } else {
    for (size_t k = 0; k < pieces; ++k) body(k);
  }
  if (failed) return IOError("a pwrite failed");
  if (::fdatasync(fd.get()) != 0) return ErrnoStatus("fdatasync", path);
  return Seconds(start);
}

Result<double> IoUring(const std::string& path, const char* data, uint64_t bytes, uint64_t chunk, unsigned depth) {
  ASSIGN_OR_RETURN(UniqueFd fd, CreateDirect(path));
  io_uring ring;
  if (int rc = io_uring_queue_init(depth, &ring, 0); rc < 0) return ErrnoStatus("io_uring_queue_init", path, -rc);
  auto start = std::chrono::steady_clock::now();
  const size_t pieces = (bytes + chunk - 1) / chunk;
  size_t submitted = 0, completed = 0;
  Status status;
  while (completed < pieces && status.ok()) {
    while (submitted < pieces && submitted - completed < depth) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (sqe == nullptr) break;
      const uint64_t off = submitted * chunk;
      io_uring_prep_write(sqe, fd.get(), data + off, static_cast<unsigned>(std::min(chunk, bytes - off)), off);
      ++submitted;
    }
    if (int rc = io_uring_submit(&ring); rc < 0) {
      status = ErrnoStatus("io_uring_submit", path, -rc);
      break;
    }
    io_uring_cqe* cqe = nullptr;
    if (int rc = io_uring_wait_cqe(&ring, &cqe); rc < 0) {
      status = ErrnoStatus("io_uring_wait_cqe", path, -rc);
      break;
    }
    // A short write is not retried here: the benchmark wants whole chunks, and O_DIRECT writes of
    // aligned chunks are whole unless the disk is full.
    if (cqe->res < 0) status = ErrnoStatus("write", path, -cqe->res);
    io_uring_cqe_seen(&ring, cqe);
    ++completed;
  }
  io_uring_queue_exit(&ring);
  RETURN_IF_ERROR(status);
  if (::fdatasync(fd.get()) != 0) return ErrnoStatus("fdatasync", path);
  return Seconds(start);
}

// The writer's path on one image of --bytes cut into tensors of `tensor` bytes.
Result<double> WriterPath(const std::string& dir, const char* data, uint64_t bytes, uint64_t tensor, ParallelLoop* loop,
                          bool hash) {
  ImageWrite image;
  image.name = "writer-path.bin";
  image.data = data;
  image.bytes = bytes;
  image.head = 4096;
  for (uint64_t off = image.head; off < bytes; off += tensor) image.cuts.push_back(off);
  // As the daemon's writer: each piece's 1 MiB chunks hashed right before the piece is written, and
  // a whole-region hash per region as a side task of the same loop.
  std::vector<uint64_t> sink(image.cuts.size()), whole(image.cuts.size());
  ImageWriteHooks hooks;
  if (hash) {
    hooks.prepare = [&](size_t, size_t region, uint64_t from, uint64_t to) {
      uint64_t h = 0;
      for (uint64_t pos = from; pos < to; pos += 1u << 20)
        h ^= Xxh3(data + pos, std::min<uint64_t>(1u << 20, to - pos));
      sink[region] ^= h;
    };
    hooks.side_count = image.cuts.size();
    hooks.side = [&](size_t r) {
      const uint64_t hi = r + 1 < image.cuts.size() ? image.cuts[r + 1] : bytes;
      whole[r] = Xxh3(data + image.cuts[r], hi - image.cuts[r]);
      return Status::OK();
    };
  }
  auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(WriteImagesDurably(dir, {image}, loop, hooks, nullptr));
  return Seconds(start);
}

// The writer path's hashing alone: per tensor, xxh3 of each 1 MiB chunk and a whole-tensor pass.
Result<double> HashOnly(const char* data, uint64_t bytes, uint64_t tensor, ParallelLoop* loop) {
  const size_t tensors = (bytes - 4096 + tensor - 1) / tensor;
  std::vector<uint64_t> sink(tensors);
  auto start = std::chrono::steady_clock::now();
  loop->Run(tensors, [&](size_t t) {
    const uint64_t from = 4096 + t * tensor, to = std::min(bytes, from + tensor);
    for (uint64_t pos = from; pos < to; pos += 1u << 20)
      sink[t] ^= Xxh3(data + pos, std::min<uint64_t>(1u << 20, to - pos));
    sink[t] ^= Xxh3(data + from, to - from);
  });
  return Seconds(start);
}

int Main(int argc, char** argv) {
  std::string dir = "/var/tmp", size = "2GiB", chunk_text = "16MiB", tensor_text = "256MiB";
  unsigned depth = 4, repeat = 2;
  CLI::App app{"write_bench: O_DIRECT writes with threads and with io_uring against dd"};
  app.add_option("--dir", dir, "Directory on the disk to measure")->capture_default_str();
  app.add_option("--bytes", size, "Bytes per write test")->capture_default_str();
  app.add_option("--chunk", chunk_text, "Write size")->capture_default_str();
  app.add_option("--tensor-bytes", tensor_text, "Tensor size of the writer-path rows")->capture_default_str();
  app.add_option("--depth", depth, "Writes in flight (threads or io_uring depth)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--repeat", repeat, "Runs per row (the best is printed)")
      ->check(CLI::Range(1, 50))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  auto bytes = ParseByteSize(size), chunk = ParseByteSize(chunk_text), tensor = ParseByteSize(tensor_text);
  if (!bytes || !chunk || !tensor || *chunk % 4096 != 0 || *bytes < *chunk || *tensor == 0) {
    std::fprintf(stderr, "write_bench: sizes must parse, --chunk be a multiple of 4KiB and --bytes at least --chunk\n");
    return 2;
  }
  const uint64_t n = *bytes / *chunk * *chunk;
  char tmpl[4096];
  std::snprintf(tmpl, sizeof tmpl, "%s/flashckpt-write-bench-XXXXXX", dir.c_str());
  if (::mkdtemp(tmpl) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string root = tmpl;
  void* mem = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  auto* data = static_cast<char*>(mem);
  for (uint64_t i = 0; i < n; i += 8) std::memcpy(data + i, &i, 8);
  struct statfs fs {};
  ::statfs(root.c_str(), &fs);
  std::printf("write_bench: %s per row into %s (statfs type 0x%lx), %s writes, %u in flight, %ld cores, best of %u\n\n",
              FormatBytes(n).c_str(), dir.c_str(), static_cast<unsigned long>(fs.f_type), FormatBytes(*chunk).c_str(),
              depth, ::sysconf(_SC_NPROCESSORS_ONLN), repeat);

  ParallelLoop loop(depth - 1);
  const std::string path = root + "/data.bin";
  struct Row {
    std::string name;
    std::function<Result<double>()> run;
  };
  const std::vector<Row> rows = {
      {"dd oflag=direct (limit)", [&] { return RunDd(path, n, *chunk); }},
      {"pwrite, 1 thread", [&] { return PwriteThreads(path, data, n, *chunk, nullptr); }},
      {"pwrite, " + std::to_string(depth) + " threads", [&] { return PwriteThreads(path, data, n, *chunk, &loop); }},
      {"io_uring, depth " + std::to_string(depth), [&] { return IoUring(path, data, n, *chunk, depth); }},
      {"writer path", [&] { return WriterPath(root, data, n, *tensor, &loop, true); }},
      {"writer path, no hash", [&] { return WriterPath(root, data, n, *tensor, &loop, false); }},
      {"hashing only (no I/O)", [&] { return HashOnly(data, n, *tensor, &loop); }},
  };
  std::printf("%-26s %10s %10s %10s\n", "row", "seconds", "GB/s", "vs dd");
  double limit = 0, writer_rate = 0, plain_rate = 0;
  int rc = 0;
  for (const Row& row : rows) {
    double best = 0;
    for (unsigned i = 0; i < repeat; ++i) {
      ::unlink(path.c_str());
      ::unlink((root + "/writer-path.bin").c_str());
      auto secs = row.run();
      if (!secs.ok()) {
        std::fprintf(stderr, "write_bench: %s: %s\n", row.name.c_str(), secs.status().ToString().c_str());
        rc = 1;
        break;
      }
      if (best == 0 || *secs < best) best = *secs;
    }
    if (rc != 0) break;
    const double rate = n / best / 1e9;
    if (limit == 0) limit = rate;
    std::printf("%-26s %10.3f %10.2f %9.2fx\n", row.name.c_str(), best, rate, rate / limit);
    if (row.name == "writer path") writer_rate = rate;
    if (row.name == "writer path, no hash") plain_rate = rate;
  }
  if (rc == 0 && writer_rate > 0) {
    bench::SummaryRow("2. writer path (checksums fused) vs dd oflag=direct", writer_rate / limit, ">=", 0.9);
    bench::SummaryRow("2. checksum cost: writer path without / with hashing", plain_rate / writer_rate, "<=", 1.05);
  }
  ::munmap(mem, n);
  (void)RemoveTree(root);
  return rc;
}

}  // namespace
}  // namespace flashckpt

int main(int argc, char** argv) { return flashckpt::Main(argc, argv); }

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
//   writer path              WriteImagesDurably as the daemon's writer calls it, on a real rank layout
//                            of --tensor-bytes fp32 tensors: 2N threads of which N write at once,
//                            each 16 MiB piece's checksum chunks stamped (StampPieceChecksums)
//                            before its pages are written, the next pieces hashed during the writes,
//                            the whole-tensor checksums derived from the chunks' at the end
//                            (StampDerivedChecksums), header last, then fdatasync + rename + fsync(dir)
//   writer path, no hash     the same writes without checksums, on N threads (nothing to hash
//                            ahead): what the checksums cost
//   writer path, hash then   the writer as it was before it hashed ahead: N threads, each hashing
//     write                  its piece and then writing it
//   hashing only             the writer path's checksums without any I/O, on N threads
//
// The rows run in --repeat rounds, each round every row once in turn (dd first), so the limit and
// the rows see the same conditions; the best and the median of each row are printed, and ratios are
// of medians. The three writer-path rows run side by side, their order turned by one each round;
// a ratio of two of them is taken per round, then as the geometric mean over each three
// neighbouring rounds (in which each row ran once first, second and third, so the place a row ran
// in does not count), then as the median of those. The checksum cost needs --repeat 3 or more and
// is printed on a fixed line for scripts:
//   RESULT checksum_cost=<writer path time with checksums / without, as above>
#include <fcntl.h>
#include <liburing.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/summary.h"
#include "common/base/names.h"
#include "common/base/thread_pool.h"
#include "common/format/image.h"
#include "common/format/layout.h"
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

// A rank layout of fp32 tensors of `tensor` bytes (the last may be smaller) filling `bytes`, and a
// slot holding its images (pseudo-random tensor bytes, header templates in place).
struct WriterSetup {
  RankLayout layout;
  std::unique_ptr<char, void (*)(void*)> slot{nullptr, std::free};
};

Result<WriterSetup> MakeWriterSetup(uint64_t bytes, uint64_t tensor) {
  std::vector<TensorSpec> specs;
  for (uint64_t at = 0, k = 0; at < bytes; at += tensor, ++k) {
    const uint64_t elements = std::max<uint64_t>(1, std::min(tensor, bytes - at) / 4);
    TensorSpec t;
    t.name = "t" + std::to_string(k);
    t.kind = TensorKind::kModel;
    t.shape = {elements};
    t.global_shape = t.shape;
    t.box_offset = {0};
    t.box_shape = t.shape;
    specs.push_back(std::move(t));
  }
  WriterSetup setup;
  ASSIGN_OR_RETURN(setup.layout, BuildRankLayout("bench", 0, Topology{1, 0, 1, 0, 1, 0, 1}, specs));
  const uint64_t padded = (setup.layout.slot_bytes + kPageSize - 1) / kPageSize * kPageSize;
  setup.slot.reset(static_cast<char*>(std::aligned_alloc(kPageSize, padded)));
  if (!setup.slot) return ResourceExhausted("cannot allocate the slot");
  uint64_t x = 0x9e3779b97f4a7c15ull;
  auto* words = reinterpret_cast<uint64_t*>(setup.slot.get());
  for (uint64_t i = 0; i < padded / 8; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    words[i] = x;
  }
  InitSlotImages(setup.slot.get(), setup.layout);
  return setup;
}

// The daemon writer's path (daemon/pipeline/writer.cc) on the images of `setup`, with or without
// its checksums; `cap` writes in flight at most (WriteImagesDurably's max_writes_in_flight: the
// daemon's writer has twice as many threads as that, so the others hash the next pieces).
Result<double> WriterPath(const std::string& dir, WriterSetup& setup, ParallelLoop* loop, unsigned cap, bool hash) {
  const RankLayout& layout = setup.layout;
  char* slot = setup.slot.get();
  const uint64_t chunk = layout.checksum_chunk, piece = std::max(chunk, (kWritePiece / chunk) * chunk);
  std::vector<ImageWrite> images;
  for (const FileImage& image : layout.files) {
    ImageWrite w;
    w.name = image.stem + ".safetensors";
    w.data = slot + image.slot_offset;
    w.bytes = image.file_bytes();
    w.head = image.header.size();
    w.piece = piece;
    for (size_t t : image.tensors) w.cuts.push_back(layout.placements[t].slot_offset - image.slot_offset);
    images.push_back(std::move(w));
  }
  ImageWriteHooks hooks;
  hooks.max_writes_in_flight = cap;
  if (hash) {
    hooks.prepare = [&](size_t i, size_t r, uint64_t from, uint64_t to) {
      const uint64_t start = images[i].cuts[r];
      StampPieceChecksums(slot, layout, layout.files[i].tensors[r], from - start, to - start);
    };
    hooks.finish = [&](size_t i) {
      StampDerivedChecksums(slot, layout, i);
      StampStep(slot, layout, i, 100);
    };
  }
  auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(WriteImagesDurably(dir, images, loop, hooks, nullptr));
  return Seconds(start);
}

// The writer path's checksums alone, on the same pieces and threads.
Result<double> HashOnly(WriterSetup& setup, ParallelLoop* loop) {
  const RankLayout& layout = setup.layout;
  const uint64_t chunk = layout.checksum_chunk, piece = std::max(chunk, (kWritePiece / chunk) * chunk);
  struct Task {
    size_t tensor;
    uint64_t from, to;
  };
  std::vector<Task> tasks;
  for (size_t t = 0; t < layout.placements.size(); ++t) {
    for (uint64_t at = 0; at < layout.placements[t].bytes; at += piece) {
      tasks.push_back({t, at, std::min(layout.placements[t].bytes, at + piece)});
    }
  }
  auto start = std::chrono::steady_clock::now();
  loop->Run(tasks.size(), [&](size_t k) {
    StampPieceChecksums(setup.slot.get(), layout, tasks[k].tensor, tasks[k].from, tasks[k].to);
  });
  for (size_t f = 0; f < layout.files.size(); ++f) StampDerivedChecksums(setup.slot.get(), layout, f);
  return Seconds(start);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

int Main(int argc, char** argv) {
  std::string dir = "/var/tmp", size = "2GiB", chunk_text = "16MiB", tensor_text = "256MiB";
  unsigned depth = 4, repeat = 5;
  CLI::App app{"write_bench: O_DIRECT writes with threads and with io_uring against dd"};
  app.add_option("--dir", dir, "Directory on the disk to measure")->capture_default_str();
  app.add_option("--bytes", size, "Bytes per write test")->capture_default_str();
  app.add_option("--chunk", chunk_text, "Write size")->capture_default_str();
  app.add_option("--tensor-bytes", tensor_text, "Tensor size of the writer-path rows")->capture_default_str();
  app.add_option("--depth", depth, "Writes in flight (threads or io_uring depth)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--repeat", repeat, "Rounds (each runs every row once; best and median printed)")
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
  std::printf("write_bench: %s per row into %s (statfs type 0x%lx), %s writes, %u in flight, %ld cores, %u rounds\n\n",
              FormatBytes(n).c_str(), dir.c_str(), static_cast<unsigned long>(fs.f_type), FormatBytes(*chunk).c_str(),
              depth, ::sysconf(_SC_NPROCESSORS_ONLN), repeat);

  ParallelLoop loop(depth - 1);
  // The daemon writer's: `depth` threads write while as many hash the next pieces.
  ParallelLoop writer_loop(2 * depth - 1);
  auto setup = MakeWriterSetup(n, *tensor);
  if (!setup.ok()) {
    std::fprintf(stderr, "write_bench: %s\n", setup.status().ToString().c_str());
    ::munmap(mem, n);
    (void)RemoveTree(root);
    return 1;
  }
  const std::string path = root + "/data.bin";
  struct Row {
    std::string name;
    std::function<Result<double>()> run;
    uint64_t bytes;  // written (or hashed) per run
    std::vector<double> secs;
  };
  const uint64_t images = setup->layout.slot_bytes;  // the writer path's files, headers included
  std::vector<Row> rows = {
      {"dd oflag=direct (limit)", [&] { return RunDd(path, n, *chunk); }, n, {}},
      {"pwrite, 1 thread", [&] { return PwriteThreads(path, data, n, *chunk, nullptr); }, n, {}},
      {"pwrite, " + std::to_string(depth) + " threads", [&] { return PwriteThreads(path, data, n, *chunk, &loop); },
       n, {}},
      {"io_uring, depth " + std::to_string(depth), [&] { return IoUring(path, data, n, *chunk, depth); }, n, {}},
      {"writer path", [&] { return WriterPath(root, *setup, &writer_loop, depth, true); }, images, {}},
      {"writer path, no hash", [&] { return WriterPath(root, *setup, &loop, 0, false); }, images, {}},
      {"writer path, hash then write", [&] { return WriterPath(root, *setup, &loop, 0, true); }, images, {}},
      {"hashing only (no I/O)", [&] { return HashOnly(*setup, &loop); }, images, {}},
  };
  int rc = 0;
  // The three writer-path rows run next to each other, their order turned by one each round (A B C,
  // B C A, C A B, ...): the row that runs first of them can be slower only for that (on a virtual
  // disk here, by 10-25%), and over any three neighbouring rounds each row runs once in each place.
  constexpr size_t kWriter = 4, kNoHash = 5, kHashThenWrite = 6, kTurned = 3;
  std::vector<std::array<size_t, kTurned>> places;  // per round: the writer rows in the order they ran
  for (unsigned round = 0; round < repeat && rc == 0; ++round) {
    std::array<size_t, kTurned> turned{};
    for (size_t k = 0; k < kTurned; ++k) turned[k] = kWriter + (k + round) % kTurned;
    places.push_back(turned);
    std::vector<Row*> order;
    for (size_t k = 0; k < kWriter; ++k) order.push_back(&rows[k]);
    for (size_t k : turned) order.push_back(&rows[k]);
    for (size_t k = kWriter + kTurned; k < rows.size(); ++k) order.push_back(&rows[k]);
    for (Row* r : order) {
      Row& row = *r;
      ::unlink(path.c_str());
      for (const FileImage& image : setup->layout.files) ::unlink((root + "/" + image.stem + ".safetensors").c_str());
      auto secs = row.run();
      if (!secs.ok()) {
        std::fprintf(stderr, "write_bench: %s: %s\n", row.name.c_str(), secs.status().ToString().c_str());
        rc = 1;
        break;
      }
      row.secs.push_back(*secs);
    }
  }
  if (rc == 0) {
    std::printf("%-30s %10s %10s %10s %10s\n", "row", "best s", "median s", "GB/s", "vs dd");
    const double limit = rows[0].bytes / Median(rows[0].secs) / 1e9;
    for (const Row& row : rows) {
      const double median = Median(row.secs), rate = row.bytes / median / 1e9;
      std::printf("%-30s %10.3f %10.3f %10.2f %9.2fx\n", row.name.c_str(),
                  *std::min_element(row.secs.begin(), row.secs.end()), median, rate, rate / limit);
    }
    const double writer = Median(rows[kWriter].secs);
    bench::SummaryRow("2. writer path (checksums fused) vs dd oflag=direct", images / writer / 1e9 / limit, ">=",
                      0.9);
    if (repeat < kTurned) {
      std::printf("\nchecksum cost: not computed, it needs --repeat %zu or more (each writer row once in each place)\n",
                  kTurned);
    } else {
      // Row a's time over row b's, per round; then, over each three neighbouring rounds, the
      // geometric mean of those ratios, which cancels the places' effect; the median of those.
      auto ratio = [&](size_t a, size_t b, std::vector<double>* per_round) {
        std::vector<double> windows;
        for (size_t k = 0; k < rows[a].secs.size(); ++k) per_round->push_back(rows[a].secs[k] / rows[b].secs[k]);
        for (size_t k = 0; k + kTurned <= per_round->size(); ++k) {
          double product = 1;
          for (size_t j = k; j < k + kTurned; ++j) product *= (*per_round)[j];
          windows.push_back(std::cbrt(product));
        }
        return windows;
      };
      std::vector<double> cost_rounds, previous_rounds;
      const std::vector<double> cost = ratio(kWriter, kNoHash, &cost_rounds);
      const std::vector<double> previous = ratio(kHashThenWrite, kWriter, &previous_rounds);
      // Each place's own effect: a row's time there over the geometric mean of the three rows'
      // times in that round, averaged (geometrically) over the rounds.
      std::array<double, kTurned> place_effect{};
      for (size_t p = 0; p < kTurned; ++p) {
        double product = 1;
        for (size_t k = 0; k < places.size(); ++k) {
          const double mean = std::cbrt(rows[kWriter].secs[k] * rows[kNoHash].secs[k] * rows[kHashThenWrite].secs[k]);
          product *= rows[places[k][p]].secs[k] / mean;
        }
        place_effect[p] = std::pow(product, 1.0 / static_cast<double>(places.size()));
      }
      std::printf("\nwriter rows by the place they ran in (time / the round's mean): first %.3f, second %.3f, "
                  "third %.3f\n",
                  place_effect[0], place_effect[1], place_effect[2]);
      std::printf("checksum cost (writer path / no hash) per round:");
      for (double c : cost_rounds) std::printf(" %.3f", c);
      std::printf("\n  over each three neighbouring rounds:");
      for (double c : cost) std::printf(" %.3f", c);
      std::printf("\nhash then write / writer path (hashing ahead), over each three rounds:");
      for (double c : previous) std::printf(" %.3f", c);
      std::printf("; median %.3f\n", Median(previous));
      const double checksum_cost = Median(cost);
      std::printf("RESULT checksum_cost=%.3f\n", checksum_cost);
      bench::SummaryRow("2. checksum cost: writer path with / without hashing", checksum_cost, "<=", 1.05);
    }
  }
  ::munmap(mem, n);
  (void)RemoveTree(root);
  return rc;
}

}  // namespace
}  // namespace flashckpt

int main(int argc, char** argv) { return flashckpt::Main(argc, argv); }

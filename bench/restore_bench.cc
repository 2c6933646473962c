// restore_bench: how fast a checkpoint is read back into a rank's slot, in the layout that saved
// it and resharded into another one, against a plain parallel read of the same files.
//
// It writes a checkpoint saved by (tp, pp, shard) = (2, 1, 2) ranks: L layers of an fp32 weight
// [H, H] cut by rows over tp (written by shard 0) and its two Adam moments as flat ranges over
// shard, per-chunk checksums of 1 MiB. It then syncs and waits for the kernel's writeback to
// settle, so no timed row competes with the flush of what was just written. With the same reader
// threads, once with the page cache warm (one untimed run of every row first) and once cold (the
// files' pages dropped with POSIX_FADV_DONTNEED before every run, so the disk is read):
//
//   read files            pread of every file in 8 MiB blocks into memory: the limit
//   same layout           FillSlotFromCheckpoint of the 4 saving ranks' layouts (checksums verified)
//   reshard -> (3, 1, 1)  the same checkpoint into 3 ranks (uneven row blocks, moments whole)
//   reshard -> (1, 1, 3)  into 3 shard ranks (new flat ranges that straddle the saved ones)
//
// Rows are interleaved with the limit (limit, row, limit, row, ...) for --repeat rounds; best and
// median GB/s are printed and ratios are of medians. A limit that cannot be right is refused, with
// the reason, instead of giving ratios: a warm read slower than a tenth of a memcpy of the same
// bytes, or a cold read faster than 1.5x an O_DIRECT read of the files (both measured in the run;
// buffered reads with the kernel's readahead may beat O_DIRECT reads a little, not by much more).
// GB/s is bytes delivered into slots per second; "read x" is bytes read from the files over
// bytes delivered (the chunks that hold needed bytes are read in full). Headline lines for scripts:
//   RESULT warm_restore_gbps=<median GB/s of the same-layout restore from the page cache>
//   RESULT warm_limit_gbps=<median GB/s of its limit>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/summary.h"
#include "bench/synthetic_checkpoint.h"
#include "common/base/log.h"
#include "common/base/names.h"
#include "common/base/thread_pool.h"
#include "common/format/image.h"
#include "common/format/layout.h"
#include "common/format/metadata.h"
#include "common/io/fs.h"
#include "common/read/checkpoint_read.h"
#include "common/read/relayout.h"

namespace flashckpt {
namespace {

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<char, FreeDeleter>;

Buffer Allocate(uint64_t bytes) {
  return Buffer(static_cast<char*>(std::aligned_alloc(kPageSize, (bytes + kPageSize - 1) / kPageSize * kPageSize)));
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

std::vector<TensorSpec> SavedSpecs(uint32_t layers, uint64_t hidden, uint32_t tp, uint32_t shard) {
  std::vector<TensorSpec> specs;
  const uint64_t rows = hidden / 2, first = tp * rows, n = rows * hidden, half = n / 2;
  for (uint32_t l = 0; l < layers; ++l) {
    TensorSpec w;
    w.name = "layers." + std::to_string(l) + ".weight";
    w.kind = TensorKind::kModel;
    w.shape = {rows, hidden};
    w.global_shape = {hidden, hidden};
    w.box_offset = {first, 0};
    w.box_shape = {rows, hidden};
    w.replica = shard != 0;
    specs.push_back(w);
    for (const char* moment : {".exp_avg", ".exp_avg_sq"}) {
      TensorSpec m = w;
      m.name += moment;
      m.kind = TensorKind::kOptimizer;
      m.replica = false;
      m.flat_range = FlatRange{shard * half, shard == 0 ? half : n};
      m.shape = {m.flat_range->end - m.flat_range->begin};
      specs.push_back(m);
    }
  }
  return specs;
}

// Writes the (2, 1, 2) checkpoint; returns the bytes of its files.
Result<uint64_t> WriteCheckpoint(const std::string& dir, uint32_t layers, uint64_t hidden) {
  std::vector<bench::SyntheticRank> ranks;
  for (uint32_t r = 0; r < 4; ++r) {
    ranks.push_back({Topology{4, r % 2, 2, 0, 1, r / 2, 2}, SavedSpecs(layers, hidden, r % 2, r / 2)});
  }
  return bench::WriteSyntheticCheckpoint(dir, ranks);
}

struct Row {
  double secs = 0;
  uint64_t delivered = 0, read = 0;
};

struct Case {
  const char* name;
  std::function<Result<Row>()> run;
  std::vector<Row> rows;  // one per timed run
};

// Restores every rank layout of `ranks` (one after the other, each with all reader threads) into
// `slot`, which holds the largest of them.
//
// Every row reads into memory that the benchmark allocated and used once before (`slot` here, the
// same buffer for the limit): on the virtual machines this runs on, the first write into freshly
// allocated memory is several times slower than later ones even after a memset, and a trainer's
// slot is long-lived shared memory.
Result<Row> RestoreAll(const std::string& dir, const CheckpointMetadata& meta, const std::vector<RankLayout>& ranks,
                       ParallelLoop* loop, char* slot) {
  Row row;
  FillOptions options;
  options.loop = loop;
  auto start = std::chrono::steady_clock::now();
  for (const RankLayout& layout : ranks) {
    ASSIGN_OR_RETURN(FillStats stats, FillSlotFromCheckpoint(dir, meta, layout, slot, options));
    row.delivered += stats.bytes_needed;
    row.read += stats.bytes_read;
  }
  row.secs = Seconds(start);
  return row;
}

// Reads every file of the checkpoint in 8 MiB blocks, spread over the loop's threads, into
// `memory` (which holds them all).
Result<Row> ReadFiles(const std::string& dir, const CheckpointMetadata& meta, ParallelLoop* loop, char* memory) {
  constexpr uint64_t kBlock = 8u << 20;
  struct Block {
    int fd;
    uint64_t offset, bytes;
  };
  std::vector<UniqueFd> fds;
  std::vector<Block> blocks;
  uint64_t total = 0;
  for (const SavedFile& f : meta.files) {
    ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(dir + "/" + f.name));
    for (uint64_t off = 0; off < f.bytes; off += kBlock)
      blocks.push_back({fd.get(), off, std::min(kBlock, f.bytes - off)});
    total += f.bytes;
    fds.push_back(std::move(fd));
  }
  std::vector<uint64_t> dest(blocks.size());
  for (size_t i = 1; i < blocks.size(); ++i) dest[i] = dest[i - 1] + blocks[i - 1].bytes;
  std::atomic<bool> failed{false};
  auto start = std::chrono::steady_clock::now();
  loop->Run(blocks.size(), [&](size_t i) {
    if (!PreadFull(blocks[i].fd, memory + dest[i], blocks[i].bytes, blocks[i].offset, "bench file").ok()) {
      failed = true;
    }
  });
  Row row{Seconds(start), total, total};
  if (failed) return Internal("a read failed");
  return row;
}

// GB/s delivered of the fastest and of the median run.
double BestRate(const std::vector<Row>& rows) {
  double best = 0;
  for (const Row& r : rows) best = std::max(best, r.delivered / r.secs / 1e9);
  return best;
}

double MedianRate(const std::vector<Row>& rows) {
  std::vector<double> rates;
  for (const Row& r : rows) rates.push_back(r.delivered / r.secs / 1e9);
  std::sort(rates.begin(), rates.end());
  const size_t n = rates.size();
  return n == 0 ? 0 : n % 2 ? rates[n / 2] : (rates[n / 2 - 1] + rates[n / 2]) / 2;
}

// Syncs the file systems and waits (at most 60 s) until the kernel's dirty and writeback pages are
// below 64 MiB, so that no timed row runs while the checkpoint just written is still being flushed.
double SettleWriteback() {
  auto start = std::chrono::steady_clock::now();
  ::sync();
  while (Seconds(start) < 60) {
    auto text = ReadSmallFile("/proc/meminfo", 1 << 20);
    if (!text.ok()) break;
    uint64_t pending_kib = 0;
    for (const char* key : {"\nDirty:", "\nWriteback:"}) {
      const size_t at = text->find(key);
      if (at != std::string::npos) pending_kib += std::strtoull(text->c_str() + at + std::strlen(key), nullptr, 10);
    }
    if (pending_kib < (64u << 10)) break;
    ::usleep(100 * 1000);
  }
  return Seconds(start);
}

// GB/s of a memcpy of `bytes` between two buffers, in 8 MiB blocks on the loop's threads (best of 3).
Result<double> MemcpyRate(uint64_t bytes, ParallelLoop* loop) {
  constexpr uint64_t kBlock = 8u << 20;
  Buffer from = Allocate(bytes), to = Allocate(bytes);
  if (!from || !to) return ResourceExhausted("cannot allocate the memcpy buffers");
  std::memset(from.get(), 1, bytes);
  std::memset(to.get(), 0, bytes);
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    auto start = std::chrono::steady_clock::now();
    loop->Run((bytes + kBlock - 1) / kBlock, [&](size_t k) {
      const uint64_t off = k * kBlock;
      std::memcpy(to.get() + off, from.get() + off, std::min(kBlock, bytes - off));
    });
    best = std::max(best, bytes / Seconds(start) / 1e9);
  }
  return best;
}

// GB/s of an O_DIRECT read of every file of the checkpoint in 8 MiB blocks on the loop's threads
// into `memory` (page-aligned, room for every file rounded up to 8 MiB): what the disk delivers
// without the page cache. The error of a file system without O_DIRECT (tmpfs) is the status.
Result<double> DirectReadRate(const std::string& dir, const CheckpointMetadata& meta, ParallelLoop* loop,
                              char* memory) {
  constexpr uint64_t kBlock = 8u << 20;
  struct Block {
    int fd;
    uint64_t offset, bytes;
  };
  std::vector<UniqueFd> fds;
  std::vector<Block> blocks;
  uint64_t total = 0;
  for (const SavedFile& f : meta.files) {
    const std::string path = dir + "/" + f.name;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (fd < 0) return ErrnoStatus("open O_DIRECT", path);
    fds.emplace_back(fd);
    // Whole 4 KiB pages: the tail of a file is read up to its page boundary (O_DIRECT's rule).
    const uint64_t padded = (f.bytes + kPageSize - 1) / kPageSize * kPageSize;
    for (uint64_t off = 0; off < padded; off += kBlock) blocks.push_back({fd, off, std::min(kBlock, padded - off)});
    total += f.bytes;
  }
  std::vector<uint64_t> dest(blocks.size());
  for (size_t i = 1; i < blocks.size(); ++i) dest[i] = dest[i - 1] + blocks[i - 1].bytes;
  std::atomic<bool> failed{false};
  auto start = std::chrono::steady_clock::now();
  loop->Run(blocks.size(), [&](size_t i) {
    const ssize_t n = ::pread(blocks[i].fd, memory + dest[i], blocks[i].bytes, static_cast<off_t>(blocks[i].offset));
    if (n < 0) failed = true;
  });
  if (failed) return IOError("an O_DIRECT read failed");
  return total / Seconds(start) / 1e9;
}

Result<std::vector<RankLayout>> Layouts(const CheckpointMetadata& meta, Degrees degrees) {
  ASSIGN_OR_RETURN(std::vector<NewRank> ranks, PlanNewLayout(meta, degrees));
  std::vector<RankLayout> out;
  for (const NewRank& r : ranks) {
    if (r.tensors.empty()) continue;
    ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout(meta.job, r.rank, r.topology, r.tensors));
    out.push_back(std::move(layout));
  }
  return out;
}

int Main(int argc, char** argv) {
  std::string dir = "/var/tmp", size = "1GiB";
  unsigned threads = 4, repeat = 5;
  CLI::App app{"restore_bench: restore and reshard-restore throughput against a plain read of the files"};
  app.add_option("--dir", dir, "Directory to write the checkpoint under")->capture_default_str();
  app.add_option("--bytes", size, "Checkpoint size (model + moments), e.g. 1GiB")->capture_default_str();
  app.add_option("--threads", threads, "Reader threads")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--repeat", repeat, "Rounds (each runs the limit before every row; best and median printed)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  SetLogLevel("warn");
  auto bytes = ParseByteSize(size);
  if (!bytes || *bytes < (1u << 20)) {
    std::fprintf(stderr, "restore_bench: --bytes '%s' is not a size of at least 1MiB\n", size.c_str());
    return 2;
  }
  // 3 tensors of H*H fp32 per layer; 8 layers.
  const uint32_t layers = 8;
  uint64_t hidden = 2;
  while ((hidden + 2) * (hidden + 2) * 4 * 3 * layers <= *bytes) hidden += 2;

  char tmpl[4096];
  std::snprintf(tmpl, sizeof tmpl, "%s/flashckpt-restore-bench-XXXXXX", dir.c_str());
  if (::mkdtemp(tmpl) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string root = tmpl, ckpt = root + "/checkpoint-100";
  int rc = 0;
  auto fail = [&](const Status& s) {
    std::fprintf(stderr, "restore_bench: %s\n", s.ToString().c_str());
    rc = 1;
  };
  do {
    if (::mkdir(ckpt.c_str(), 0755) != 0) {
      fail(ErrnoStatus("mkdir", ckpt));
      break;
    }
    auto written = WriteCheckpoint(ckpt, layers, hidden);
    if (!written.ok()) {
      fail(written.status());
      break;
    }
    const double settled = SettleWriteback();
    auto meta = ReadMetadataFile(ckpt);
    if (!meta.ok()) {
      fail(meta.status());
      break;
    }
    std::printf(
        "checkpoint: %u layers of [%llu, %llu] fp32 + 2 moments, saved by (tp, pp, shard) = (2, 1, 2): %s in "
        "%zu files under %s; %u reader threads, %u rounds; writeback settled in %.1f s (sync, dirty pages "
        "below 64 MiB)\n",
        layers, static_cast<unsigned long long>(hidden), static_cast<unsigned long long>(hidden),
        FormatBytes(*written).c_str(), meta->files.size(), dir.c_str(), threads, repeat, settled);
    ParallelLoop loop(threads - 1);
    std::vector<RankLayout> same, tp3, shard3;
    {
      auto a = Layouts(*meta, Degrees{2, 1, 2});
      auto b = Layouts(*meta, Degrees{3, 1, 1});
      auto c = Layouts(*meta, Degrees{1, 1, 3});
      if (!a.ok() || !b.ok() || !c.ok()) {
        fail(!a.ok() ? a.status() : !b.ok() ? b.status() : c.status());
        break;
      }
      same = std::move(a).value();
      tp3 = std::move(b).value();
      shard3 = std::move(c).value();
    }
    // What the limits are checked against, measured here: a memcpy of the same bytes on the same
    // threads (a page-cache read cannot be much slower), and an O_DIRECT read of the files (a read
    // that bypasses the cache cannot be much slower than the disk).
    auto memcpy_rate = MemcpyRate(*written, &loop);
    if (!memcpy_rate.ok()) {
      fail(memcpy_rate.status());
      break;
    }
    std::printf("same run: memcpy of %s on %u threads %.2f GB/s\n\n", FormatBytes(*written).c_str(), threads,
                *memcpy_rate);
    Result<double> direct_rate = Unavailable("not measured");  // after the warm rows, into `dest`
    // One destination for every row, allocated and written once here (see RestoreAll).
    uint64_t dest_bytes = (*written / (8u << 20) + meta->files.size()) * (8u << 20);  // files in 8 MiB blocks
    for (const auto* ranks : {&same, &tp3, &shard3}) {
      for (const RankLayout& l : *ranks) dest_bytes = std::max(dest_bytes, l.slot_bytes);
    }
    Buffer dest = Allocate(dest_bytes);
    if (!dest) {
      fail(ResourceExhausted("cannot allocate the destination buffer"));
      break;
    }
    std::memset(dest.get(), 0, dest_bytes);
    Case limit{"read files (limit)", [&] { return ReadFiles(ckpt, *meta, &loop, dest.get()); }, {}};
    std::vector<Case> cases = {
        {"same layout", [&] { return RestoreAll(ckpt, *meta, same, &loop, dest.get()); }, {}},
        {"reshard -> (3, 1, 1)", [&] { return RestoreAll(ckpt, *meta, tp3, &loop, dest.get()); }, {}},
        {"reshard -> (1, 1, 3)", [&] { return RestoreAll(ckpt, *meta, shard3, &loop, dest.get()); }, {}},
    };
    // Cold: the files' pages are dropped from the page cache before every run, so each reads the disk.
    auto drop_cache = [&] {
      for (const SavedFile& f : meta->files) {
        auto fd = OpenForRead(ckpt + "/" + f.name);
        if (fd.ok()) (void)::posix_fadvise(fd->get(), 0, 0, POSIX_FADV_DONTNEED);
      }
    };
    for (bool cold : {false, true}) {
      const std::string temp = cold ? "cold" : "warm";
      if (cold) {
        direct_rate = DirectReadRate(ckpt, *meta, &loop, dest.get());
        auto again = DirectReadRate(ckpt, *meta, &loop, dest.get());  // the better of two
        if (direct_rate.ok() && again.ok()) direct_rate = std::max(*direct_rate, *again);
        if (direct_rate.ok()) std::printf("\nsame run: O_DIRECT read of the files %.2f GB/s\n", *direct_rate);
      }
      if (cold && !direct_rate.ok()) {
        std::printf("\ncold: not measured: without O_DIRECT the disk's read rate is unknown (%s)\n",
                    direct_rate.status().message().c_str());
        break;
      }
      limit.rows.clear();
      for (Case& c : cases) c.rows.clear();
      // Interleaved: in every round the limit runs right before each row, so the two see the same
      // conditions. Warm runs start after one untimed pass that brings the files into the cache.
      auto run = [&](Case& c, bool keep) -> Status {
        if (cold) drop_cache();
        ASSIGN_OR_RETURN(Row r, c.run());
        if (keep) c.rows.push_back(r);
        return Status::OK();
      };
      Status status;
      if (!cold) {  // the files into the page cache, and every row's destination written once
        status = run(limit, false);
        for (Case& c : cases) {
          if (status.ok()) status = run(c, false);
        }
      }
      for (unsigned round = 0; round < repeat && status.ok(); ++round) {
        for (Case& c : cases) {
          status = run(limit, true);
          if (status.ok()) status = run(c, true);
          if (!status.ok()) break;
        }
      }
      if (!status.ok()) {
        fail(status);
        break;
      }
      const double limit_rate = MedianRate(limit.rows);
      std::printf("%s\n%-22s %10s %9s %9s %9s %11s %14s\n",
                  cold ? "\ncold: page cache dropped before every run (the disk is read)"
                       : "warm: page cache holds the files (from memory)",
                  "row", "delivered", "best", "median", "read x", "vs read", "vs same layout");
      std::printf("%-22s %10s %9.2f %9.2f %8.3fx %10.2fx %14s\n", limit.name, FormatBytes(limit.rows[0].delivered).c_str(),
                  BestRate(limit.rows), limit_rate, 1.0, 1.0, "");
      // A limit that cannot be right makes every ratio meaningless: say why instead of printing them.
      std::string implausible;
      if (!cold && limit_rate < *memcpy_rate / 10) {
        implausible = "the page-cache read (" + std::to_string(limit_rate) + " GB/s) is slower than a tenth of a memcpy (" +
                      std::to_string(*memcpy_rate) + " GB/s): the cache was not warm or the machine was busy";
      }
      if (cold && limit_rate > *direct_rate * 1.5) {
        implausible = "the cold read (" + std::to_string(limit_rate) + " GB/s) is faster than 1.5x the disk's O_DIRECT read (" +
                      std::to_string(*direct_rate) + " GB/s): the page cache still held the files";
      }
      const double same_rate = MedianRate(cases[0].rows);
      for (const Case& c : cases) {
        const double rate = MedianRate(c.rows);
        const std::string name = c.name;
        char vs_same[32] = "", vs_read[32] = "-";
        if (name != "same layout") std::snprintf(vs_same, sizeof vs_same, "%.2fx", rate / same_rate);
        if (implausible.empty()) std::snprintf(vs_read, sizeof vs_read, "%.2fx", rate / limit_rate);
        uint64_t read = 0, delivered = 0;
        for (const Row& r : c.rows) read += r.read, delivered += r.delivered;
        std::printf("%-22s %10s %9.2f %9.2f %8.3fx %11s %14s\n", c.name, FormatBytes(c.rows[0].delivered).c_str(),
                    BestRate(c.rows), rate, double(read) / double(delivered), vs_read, vs_same);
      }
      if (!implausible.empty()) {
        std::printf("no ratio to the limit printed: %s\n", implausible.c_str());
        continue;
      }
      bench::SummaryRow("3. restore (" + temp + "), same layout vs pread of the files", same_rate / limit_rate, ">=",
                        cold ? 0.9 : 0.8);
      for (size_t k = 1; k < cases.size(); ++k) {
        bench::SummaryRow(std::string("3. ") + cases[k].name + " (" + temp + ") vs same layout",
                          MedianRate(cases[k].rows) / same_rate);
      }
      if (!cold) {
        std::printf("RESULT warm_restore_gbps=%.3f\nRESULT warm_limit_gbps=%.3f\n", same_rate, limit_rate);
      }
    }
  } while (false);
  (void)RemoveTree(root);
  return rc;
}

}  // namespace
}  // namespace flashckpt

int main(int argc, char** argv) { return flashckpt::Main(argc, argv); }

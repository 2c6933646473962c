// ema_bench: how close the daemon's EMA update comes to this machine's memory bandwidth.
//
// For one rank holding N fp32 master weights it measures, in the same run, with the same threads
// (a ParallelLoop, as the daemon's EMA stage uses) and the same 1 MiB chunks:
//
//   triad            a[i] = b[i] + s*c[i] (STREAM triad): the limit, over the same N elements
//   ema              RankEma::Apply on a persist=false snapshot: ema = d*ema + (1-d)*x
//   ema + slot copy  RankEma::Apply on a persisted snapshot: the update also writes the EMA into the
//                    slot's EMA room and stamps it (step + an XXH3-64 per tensor of the copy)
//   ... kernel only  the same update and copy without the stamp (EmaKernel with copy_out)
//   ... stamp only   StampImage of that copy: what the stamp adds
//
// Every GB/s is counted the same way: parameters (elements) per second x 4 bytes. It is not the
// memory traffic, which differs per row (printed beside each row as bytes moved per element).
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench/mapping.h"
#include "bench/summary.h"
#include "common/base/log.h"
#include "common/base/names.h"
#include "common/base/thread_pool.h"
#include "common/format/image.h"
#include "common/format/layout.h"
#include "common/io/shm.h"
#include "daemon/pipeline/ema.h"

namespace flashckpt {
namespace {

constexpr size_t kChunkElements = 1u << 18;  // 1 MiB of fp32, as RankEma::Apply chunks

using bench::Mapping;  // the trainer's host state and the limits' buffers

// The EMA segment outlives the process by design (the daemon adopts it); the benchmark must not
// leave one behind, even when interrupted.
char g_shm_path[256];
void UnlinkAndExit(int sig) {
  ::shm_unlink(g_shm_path);
  ::_exit(128 + sig);
}

struct Chunk {
  size_t tensor;
  size_t begin, count;  // elements within the tensor
};

struct Row {
  std::string what;
  std::string traffic;  // bytes moved per element, for reading the ratios
  std::function<void()> run;
  std::vector<double> seconds;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int Fail(const char* what, const Status& status) {
  std::fprintf(stderr, "ema_bench: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

void Triad(float* __restrict a, const float* __restrict b, const float* __restrict c, float s, size_t n) {
  for (size_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

int Run(uint64_t param_bytes, uint64_t tensor_bytes, unsigned threads, int reps, int warmup) {
  const uint64_t elements = param_bytes / sizeof(float);
  const uint64_t per_tensor = std::max<uint64_t>(1, tensor_bytes / sizeof(float));
  const std::string job = "ema-bench-" + std::to_string(::getpid());

  // A rank of fp32 master weights (layers.<i>.weight): the EMA covers all of them.
  std::vector<TensorSpec> specs;
  for (uint64_t done = 0, i = 0; done < elements; ++i) {
    uint64_t n = std::min(per_tensor, elements - done);
    char name[64];
    std::snprintf(name, sizeof name, "layers.%05llu.weight", static_cast<unsigned long long>(i));
    TensorSpec s;
    s.name = std::string(name) + ".master";
    s.param = name;
    s.kind = TensorKind::kMasterWeight;
    s.dtype = DType::kF32;
    s.shape = {n};
    specs.push_back(std::move(s));
    done += n;
  }
  auto layout = BuildRankLayout(job, 0, Topology{}, specs);
  if (!layout.ok()) return Fail("layout", layout.status());
  EmaConfig config;
  config.enabled = true;
  config.decay = 0.999;
  config.interval = 1;
  auto plan = PlanEma(*layout, config);
  if (!plan.ok()) return Fail("EMA plan", plan.status());
  const uint64_t ema_slot_bytes = plan->layout.slot_bytes;

  const std::string scope = "bench";
  std::snprintf(g_shm_path, sizeof g_shm_path, "/%s", EmaSegmentName(job, 0, scope).c_str());
  ::signal(SIGINT, UnlinkAndExit);
  ::signal(SIGTERM, UnlinkAndExit);
  auto opened = RankEma::Open(job, 0, scope, std::move(plan).value(), config, 0600);
  if (!opened.ok()) return Fail("EMA segment", opened.status());
  std::unique_ptr<RankEma> ema = std::move(opened).value();
  struct Unlinker {
    RankEma* ema;
    ~Unlinker() { ema->Unlink(); }
  } unlinker{ema.get()};

  auto slot_mem = Mapping::Make(layout->slot_bytes);  // the rank's slot: the snapshot x
  auto image_mem = Mapping::Make(ema_slot_bytes);     // the slot's EMA room (persisted steps)
  if (!slot_mem.ok()) return Fail("slot memory", slot_mem.status());
  if (!image_mem.ok()) return Fail("EMA room memory", image_mem.status());
  char* slot = slot_mem->data();
  char* image_base = image_mem->data();
  InitSlotImages(slot, *layout);

  ParallelLoop loop(threads - 1);
  const RankLayout& el = ema->plan().layout;
  std::vector<Chunk> chunks;  // per EMA tensor, exactly as RankEma::Apply splits them
  for (size_t k = 0; k < el.tensors.size(); ++k) {
    size_t n = el.placements[k].bytes / sizeof(float);
    for (size_t b = 0; b < n; b += kChunkElements) chunks.push_back({k, b, std::min(kChunkElements, n - b)});
  }
  auto e_ptr = [&](const Chunk& c) {
    return reinterpret_cast<float*>(ema->UnsyncedBase() + el.placements[c.tensor].slot_offset) + c.begin;
  };
  auto spare_ptr = [&](const Chunk& c) {  // where an update writes (the EMA keeps two images)
    return reinterpret_cast<float*>(ema->UnsyncedSpareBase() + el.placements[c.tensor].slot_offset) + c.begin;
  };
  auto x_ptr = [&](const Chunk& c) {
    return reinterpret_cast<float*>(slot + layout->placements[ema->plan().source[c.tensor]].slot_offset) + c.begin;
  };
  auto out_ptr = [&](const Chunk& c) {
    return reinterpret_cast<float*>(image_base + el.placements[c.tensor].slot_offset) + c.begin;
  };

  // First touch on the threads that will use the memory; x varies so nothing is trivially constant.
  loop.Run(chunks.size(), [&](size_t i) {
    const Chunk& c = chunks[i];
    float* x = x_ptr(c);
    float* o = out_ptr(c);
    for (size_t j = 0; j < c.count; ++j) {
      x[j] = static_cast<float>((c.begin + j) % 1000) / 1024.0f;
      o[j] = 0.0f;
    }
  });

  int64_t step = 0;
  uint64_t applies = 0;
  const float decay = static_cast<float>(config.decay);
  std::vector<Row> rows;
  auto add = [&](std::string what, std::string traffic, std::function<void()> run) {
    rows.push_back({std::move(what), std::move(traffic), std::move(run), {}});
  };
  add("triad  a[i] = b[i] + s*c[i]", "12 (+4 write-allocate)", [&] {
    loop.Run(chunks.size(), [&](size_t i) {
      const Chunk& c = chunks[i];
      Triad(out_ptr(c), x_ptr(c), e_ptr(c), 0.5f, c.count);
    });
  });
  add("ema              RankEma::Apply", "12 (+4 write-allocate)", [&] {
    ema->Apply(*layout, slot, ++step, std::nullopt, nullptr, &loop);
    ++applies;
  });
  add("ema + slot copy  RankEma::Apply", "16 (+8) + 4 (stamp)", [&] {
    ema->Apply(*layout, slot, ++step, std::nullopt, image_base, &loop);
    ++applies;
  });
  add("  kernel only    EmaKernel(copy_out)", "16 (+8 write-allocate)", [&] {
    loop.Run(chunks.size(), [&](size_t i) {
      const Chunk& c = chunks[i];
      EmaKernel(e_ptr(c), spare_ptr(c), x_ptr(c), DType::kF32, c.count, decay, EmaStep::kAverage, out_ptr(c));
    });
  });
  add("  stamp only     StampImage (1 thread)", "4 (xxh3 read)", [&] { StampImage(image_base, el, 0, step); });

  // Interleaved repetitions: noise from other tenants spreads over every row alike.
  using Clock = std::chrono::steady_clock;
  for (int r = 0; r < warmup + reps; ++r) {
    for (auto& row : rows) {
      auto t0 = Clock::now();
      row.run();
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (r >= warmup) row.seconds.push_back(s);
    }
  }
  if (ema->state().updates_applied != applies) {
    std::fprintf(stderr, "ema_bench: %llu updates applied, expected %llu\n",
                 static_cast<unsigned long long>(ema->state().updates_applied),
                 static_cast<unsigned long long>(applies));
    return 1;
  }

  auto gbps = [&](double secs) { return static_cast<double>(elements) * sizeof(float) / secs / 1e9; };
  std::printf(
      "ema_bench: %s of fp32 parameters (%llu elements, %zu tensors of up to %s), %u threads, "
      "1 MiB chunks, %d warm-up + %d repetitions\n",
      FormatBytes(elements * sizeof(float)).c_str(), static_cast<unsigned long long>(elements), specs.size(),
      FormatBytes(per_tensor * sizeof(float)).c_str(), threads, warmup, reps);
  std::printf("GB/s = parameters (elements) per second x 4 bytes, for every row (1 GB = 1e9 bytes)\n\n");
  std::printf("%-38s %9s %9s %10s %9s  %s\n", "what", "best", "median", "median", "vs triad", "bytes moved");
  std::printf("%-38s %9s %9s %10s %9s  %s\n", "", "GB/s", "GB/s", "ms/pass", "(median)", "per element");
  const double triad_median = gbps(Median(rows[0].seconds));
  for (const auto& row : rows) {
    double best = *std::min_element(row.seconds.begin(), row.seconds.end());
    double med = Median(row.seconds);
    std::printf("%-38s %9.2f %9.2f %10.1f %9.2f  %s\n", row.what.c_str(), gbps(best), gbps(med), med * 1e3,
                gbps(med) / triad_median, row.traffic.c_str());
  }
  std::printf(
      "\nbytes moved per element: reads + writes of 4 bytes each; a store to a line not read first\n"
      "also costs a write-allocate read (+4). The EMA update writes the segment's spare image (a crash\n"
      "mid-update keeps the previous one), so it moves what the triad moves. vs triad = the row's\n"
      "median / triad's median.\n");
  bench::SummaryRow("4. EMA update vs triad (median)", gbps(Median(rows[1].seconds)) / triad_median, ">=", 0.8);
  return 0;
}

}  // namespace
}  // namespace flashckpt

int main(int argc, char** argv) {
  CLI::App app{"ema_bench: EMA update bandwidth of the daemon's code path against a STREAM-like triad"};
  std::string bytes = "2GiB", tensor_bytes = "64MiB";
  unsigned threads = std::min(8u, std::max(1u, std::thread::hardware_concurrency()));
  int reps = 5, warmup = 1;
  app.add_option("--bytes", bytes, "fp32 parameters of the rank (512MiB, 2GiB, ...)")->capture_default_str();
  app.add_option("--tensor-bytes", tensor_bytes, "size of each parameter tensor")->capture_default_str();
  app.add_option("--threads", threads, "threads, the caller included (the daemon's default: min(cores, 8))")
      ->check(CLI::Range(1u, 256u))
      ->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions per row")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--warmup", warmup, "untimed repetitions first")->check(CLI::Range(0, 100))->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  auto param_bytes = flashckpt::ParseByteSize(bytes);
  auto per_tensor = flashckpt::ParseByteSize(tensor_bytes);
  if (!param_bytes || *param_bytes < 4096 || !per_tensor || *per_tensor < 4) {
    std::fprintf(stderr, "ema_bench: --bytes must be at least 4KiB and --tensor-bytes at least 4 bytes\n");
    return 2;
  }
  flashckpt::SetLogLevel("warn");  // no "created segment" log line amid the table
  return flashckpt::Run(*param_bytes, *per_tensor, threads, reps, warmup);
}

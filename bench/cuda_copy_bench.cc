// cuda_copy_bench: what a snapshot of device memory costs the trainer, against the bare PCIe limit
// measured in the same run.
//
// A real flashckptd (Daemon + Server) runs in this process on a UNIX socket; a real Client registers
// a rank state of --bytes of fp32 tensors (--tensor-bytes each, the last may be smaller) in device
// memory and snapshots it: cudaMemcpyAsync D2H on the client's copy stream into the pinned slot.
//
//   1. bandwidth  --bytes / (Snapshot() call -> WaitCopied() return), against a bare cudaMemcpyAsync
//                 of the same tensors on a non-blocking stream into cudaMallocHost memory of the same
//                 size (synchronised on an event). Target: >= 0.9x.
//   2. blocking   the time the trainer thread spends in Snapshot() (the BeginSnapshot RPC, telling
//                 device from host pointers, queueing the copies). Target: under 1 ms.
//   3. compute    a memory-bound kernel (a triad over three --triad-bytes arrays, launched back to back
//                 for about as long as a snapshot's copies take) on the trainer's compute stream,
//                 timed with CUDA events: alone, and queued right after a Snapshot() so that the
//                 copies run beside it. The ratio is what a snapshot costs the training step's
//                 kernels (HBM and PCIe traffic sharing the memory system). Median of --repeat rounds.
//
// Each figure is the best of --repeat rounds after one warm-up round (whose Snapshot also pins the
// slots with cudaHostRegister). Every round waits for the daemon to persist the step under --dir
// (untimed) and deletes it. Without a CUDA device it prints that it skipped and exits 0.
#include <cuda_runtime_api.h>
#include <stdlib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bench/local_daemon.h"
#include "bench/summary.h"
#include "bench/triad.h"
#include "common/base/cuda.h"
#include "common/base/cuda_info.h"
#include "common/base/log.h"
#include "common/base/names.h"
#include "daemon/edge/server.h"
#include "flashckpt/client.h"

namespace flashckpt {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
double Gbps(uint64_t bytes, double secs) { return static_cast<double>(bytes) / secs / 1e9; }

struct Options {
  uint64_t bytes = 4ull << 30;
  uint64_t tensor_bytes = 256ull << 20;
  uint64_t triad_bytes = 256ull << 20;
  unsigned repeat = 3;
  std::string dir = "/var/tmp";
};

// Device memory freed on destruction.
struct DeviceBuffer {
  void* p = nullptr;
  ~DeviceBuffer() {
    if (p != nullptr) (void)cudaFree(p);
  }
};
struct PinnedBuffer {
  void* p = nullptr;
  ~PinnedBuffer() {
    if (p != nullptr) (void)cudaFreeHost(p);
  }
};

// A CUDA event that records time (CudaEvent's are created without timing), destroyed with it.
struct TimingEvent {
  cudaEvent_t e = nullptr;
  ~TimingEvent() {
    if (e != nullptr) (void)cudaEventDestroy(e);
  }
};

// Three device arrays for the triad, freed on destruction.
struct TriadArrays {
  DeviceBuffer a, b, c;
  size_t n = 0;
};

// Milliseconds `reps` triads queued back to back on `stream` take on the device.
Result<double> TimeTriads(const TriadArrays& t, unsigned reps, cudaStream_t stream) {
  TimingEvent start, stop;
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&start.e));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop.e));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(start.e, stream));
  for (unsigned i = 0; i < reps; ++i) {
    CUDA_RETURN_IF_ERROR(bench::Triad(static_cast<float*>(t.a.p), static_cast<const float*>(t.b.p),
                                      static_cast<const float*>(t.c.p), 1.5f, t.n, stream));
  }
  CUDA_RETURN_IF_ERROR(cudaEventRecord(stop.e, stream));
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop.e));
  float ms = 0;
  CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.e, stop.e));
  return static_cast<double>(ms);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

using bench::LocalDaemon;

Status Run(const Options& o) {
  // The rank's state in device memory, and the bare copy's pinned destination.
  DeviceBuffer device;
  PinnedBuffer pinned;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&device.p, o.bytes));
  CUDA_RETURN_IF_ERROR(cudaMemset(device.p, 0x5a, o.bytes));
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinned.p, o.bytes));
  std::memset(pinned.p, 0, o.bytes);  // touched, like the daemon's slots
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());

  std::vector<TensorSpec> specs;
  std::vector<TensorBuffer> buffers;
  for (uint64_t done = 0, i = 0; done < o.bytes; ++i) {
    uint64_t n = std::min(o.tensor_bytes, o.bytes - done);
    TensorSpec s;
    s.name = "layers." + std::to_string(i) + (i % 3 == 0 ? ".weight" : i % 3 == 1 ? ".exp_avg" : ".exp_avg_sq");
    s.kind = i % 3 == 0 ? TensorKind::kModel : TensorKind::kOptimizer;
    s.shape = {n / sizeof(float)};
    specs.push_back(s);
    buffers.push_back({s.name, static_cast<char*>(device.p) + done, n, /*on_device=*/true});
    done += n;
  }

  char tmpl[] = "/tmp/fc-cuda-bench-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return ErrnoStatus("mkdtemp", tmpl);
  const std::string run = tmpl;
  const std::string root = o.dir + "/fc-cuda-bench-" + std::filesystem::path(run).filename().string();
  struct Cleanup {
    std::string a, b;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(a, ec);
      std::filesystem::remove_all(b, ec);
    }
  } cleanup{run, root};

  DaemonConfig config;
  config.socket_path = run + "/flashckptd.sock";
  config.root = root;
  config.slots = 2;
  config.max_host_memory = 2 * o.bytes + (1ull << 30);
  ASSIGN_OR_RETURN(auto daemon, LocalDaemon::Start(config));
  ClientOptions co;
  co.socket_path = config.socket_path;
  co.job = "cuda-bench";
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(co));
  RETURN_IF_ERROR(client->Register(Topology{}, specs));

  ASSIGN_OR_RETURN(CudaStream compute, CudaStream::Create());  // the trainer's stream
  ASSIGN_OR_RETURN(CudaStream bare_stream, CudaStream::Create());
  ASSIGN_OR_RETURN(CudaEvent bare_done, CudaEvent::Create());

  double best_bare = 1e30, best_copied = 1e30, best_blocked = 1e30, first_copied = 0;
  for (unsigned round = 0; round <= o.repeat; ++round) {  // round 0 warms up and is not counted
    const int64_t step = round + 1;
    // The limit: the same copies, bare.
    auto start = Clock::now();
    for (const TensorBuffer& b : buffers) {
      const uint64_t offset = static_cast<const char*>(b.data) - static_cast<const char*>(device.p);
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(pinned.p) + offset, b.data, b.bytes,
                                           cudaMemcpyDeviceToHost, bare_stream.get()));
    }
    RETURN_IF_ERROR(bare_done.Record(bare_stream.get()));
    RETURN_IF_ERROR(bare_done.Synchronize());
    const double bare = Since(start);

    // Through flashckpt.
    SnapshotOptions so;
    so.cuda_stream = compute.get();
    start = Clock::now();
    ASSIGN_OR_RETURN(SnapshotHandle handle, client->Snapshot(step, buffers, so));
    const double blocked = Since(start);
    RETURN_IF_ERROR(handle.WaitCopied());
    const double copied = Since(start);
    RETURN_IF_ERROR(handle.WaitCommitted());
    RETURN_IF_ERROR(client->WaitPersisted(step, std::chrono::minutes(10)));
    std::error_code ec;
    std::filesystem::remove_all(root + "/" + co.job + "/checkpoint-" + std::to_string(step), ec);
    if (round == 0) {
      first_copied = copied;
      continue;
    }
    best_bare = std::min(best_bare, bare);
    best_copied = std::min(best_copied, copied);
    best_blocked = std::min(best_blocked, blocked);
  }

  // 3. The compute stream's kernels with and without a snapshot's copies beside them.
  TriadArrays triad;
  triad.n = o.triad_bytes / sizeof(float);
  for (DeviceBuffer* d : {&triad.a, &triad.b, &triad.c}) {
    CUDA_RETURN_IF_ERROR(cudaMalloc(&d->p, triad.n * sizeof(float)));
    CUDA_RETURN_IF_ERROR(cudaMemset(d->p, 0, triad.n * sizeof(float)));
  }
  ASSIGN_OR_RETURN(double probe_ms, TimeTriads(triad, 20, compute.get()));
  const double one_ms = std::max(probe_ms / 20, 1e-3);
  const unsigned reps = static_cast<unsigned>(std::clamp(best_copied * 1e3 / one_ms, 1.0, 100000.0));
  std::vector<double> alone, beside, copied_beside;
  for (unsigned round = 0; round < o.repeat; ++round) {
    const int64_t step = o.repeat + 2 + round;
    ASSIGN_OR_RETURN(double ms, TimeTriads(triad, reps, compute.get()));
    alone.push_back(ms);
    SnapshotOptions so;
    so.cuda_stream = compute.get();
    auto start = Clock::now();
    ASSIGN_OR_RETURN(SnapshotHandle handle, client->Snapshot(step, buffers, so));
    ASSIGN_OR_RETURN(ms, TimeTriads(triad, reps, compute.get()));
    beside.push_back(ms);
    RETURN_IF_ERROR(handle.WaitCopied());
    copied_beside.push_back(Since(start));
    RETURN_IF_ERROR(handle.WaitCommitted());
    RETURN_IF_ERROR(client->WaitPersisted(step, std::chrono::minutes(10)));
    std::error_code ec;
    std::filesystem::remove_all(root + "/" + co.job + "/checkpoint-" + std::to_string(step), ec);
  }
  const double triad_gbps = 3.0 * static_cast<double>(triad.n * sizeof(float)) * reps / (Median(alone) / 1e3) / 1e9;

  std::printf("cuda_copy_bench: %s of device memory in %zu tensors, best of %u rounds (%s)\n",
              FormatBytes(o.bytes).c_str(), buffers.size(), o.repeat, CudaInfoText(GetCudaInfo()).c_str());
  std::printf("  bare cudaMemcpyAsync D2H -> cudaMallocHost  %8.2f GB/s\n", Gbps(o.bytes, best_bare));
  std::printf("  Snapshot -> WaitCopied, pinned slot         %8.2f GB/s  (first round, pinning: %.3f s)\n",
              Gbps(o.bytes, best_copied), first_copied);
  std::printf("  trainer blocked in Snapshot()               %8.3f ms\n", best_blocked * 1e3);
  std::printf("  compute stream: %u triads over 3 x %s, alone       %8.2f ms  (%.0f GB/s of device memory)\n", reps,
              FormatBytes(triad.n * sizeof(float)).c_str(), Median(alone), triad_gbps);
  std::printf("  the same with a snapshot's copies beside them       %8.2f ms  (the copies took %.2f ms, %.2f GB/s)\n",
              Median(beside), Median(copied_beside) * 1e3, Gbps(o.bytes, Median(copied_beside)));
  bench::SummaryRow("cuda: D2H into the slot vs bare D2H into cudaMallocHost", best_bare / best_copied, ">=", 0.9);
  bench::SummaryRow("cuda: compute kernels with a snapshot in flight vs alone", Median(beside) / Median(alone));
  bench::SummaryRow("cuda: Snapshot() blocking, ms (vs 1 ms)", best_blocked * 1e3, "<=", 1.0);
  return Status::OK();
}

int Main(int argc, char** argv) {
  std::string bytes_text = "4GiB", tensor_text = "256MiB", triad_text = "256MiB";
  Options o;
  CLI::App app{"cuda_copy_bench: snapshot of device memory through a real daemon, against a bare D2H copy"};
  app.add_option("--bytes", bytes_text, "Device state of the rank (4GiB, 512MiB, ...)")->capture_default_str();
  app.add_option("--tensor-bytes", tensor_text, "Size of each tensor (the last one may be smaller)")
      ->capture_default_str();
  app.add_option("--triad-bytes", triad_text, "Size of each of the compute kernel's three arrays")
      ->capture_default_str();
  app.add_option("--dir", o.dir, "Directory the daemon writes the checkpoints under")->capture_default_str();
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "debug: the client's time in each Snapshot() by phase")
      ->check([](const std::string& l) { return IsLogLevel(l) ? "" : "not a log level: " + l; })
      ->capture_default_str();
  app.add_option("--repeat", o.repeat, "Timed rounds after one warm-up round (the best is printed)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  auto bytes = ParseByteSize(bytes_text);
  auto tensor_bytes = ParseByteSize(tensor_text);
  auto triad_bytes = ParseByteSize(triad_text);
  if (!bytes || *bytes < (1u << 20) || !tensor_bytes || *tensor_bytes < 4096 || !triad_bytes ||
      *triad_bytes < 4096) {
    std::fprintf(stderr,
                 "cuda_copy_bench: --bytes must be at least 1MiB, --tensor-bytes and --triad-bytes at least 4KiB\n");
    return 2;
  }
  o.triad_bytes = *triad_bytes;
  o.bytes = *bytes / 4096 * 4096;
  o.tensor_bytes = *tensor_bytes / sizeof(float) * sizeof(float);
  const CudaInfo& cuda = GetCudaInfo();
  if (cuda.devices == 0) {
    std::printf("cuda_copy_bench: skipped: %s\n", CudaInfoText(cuda).c_str());
    return 0;
  }
  SetLogLevel(log_level);
  Status s = Run(o);
  if (!s.ok()) {
    std::fprintf(stderr, "cuda_copy_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace flashckpt

int main(int argc, char** argv) { return flashckpt::Main(argc, argv); }

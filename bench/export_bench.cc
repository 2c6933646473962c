// export_bench: `flashckpt export` of a checkpoint against `cp` of the same files, and the export's
// peak memory.
//
// It writes a checkpoint of `--bytes` of fp32 model weights saved by tp 2 ranks (L layers [H, H]
// cut by rows), then, with the files in the page cache (read once untimed before each row):
//
//   cp + sync            cp of the checkpoint's files into a new directory, then sync: the limit
//   flashckpt export     the program itself (a child process): every tensor merged from its two tp
//                        boxes, checksums verified, written into --max-shard-size files and fsynced
//
// GB/s is tensor bytes over seconds; `RESULT export_ratio=R` is the export's rate over cp's. The export's peak RSS comes from the kernel (wait4's
// ru_maxrss) and is set against its stated bound: one output shard plus one tensor (it holds one
// tensor at a time, so it stays near one tensor).
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "bench/summary.h"
#include "bench/synthetic_checkpoint.h"
#include "common/base/names.h"
#include "common/io/fs.h"

namespace flashckpt {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

std::string Quote(const std::string& s) { return "'" + s + "'"; }

// Runs `argv`, returns (exit status, peak RSS in bytes, seconds).
struct ChildRun {
  int status = -1;
  uint64_t max_rss = 0;
  double secs = 0;
};
ChildRun RunChild(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  ChildRun run;
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execv(args[0], args.data());
    std::_Exit(127);
  }
  int status = 0;
  struct rusage usage {};
  if (pid > 0 && ::wait4(pid, &status, 0, &usage) == pid) {
    run.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    run.max_rss = static_cast<uint64_t>(usage.ru_maxrss) * 1024;
  }
  run.secs = Seconds(start);
  return run;
}

int Main(int argc, char** argv) {
  CLI::App app{"flashckpt export against cp of the same files, and its peak memory"};
  std::string bytes_text = "2GiB", dir = "/var/tmp", shard_text = "1GiB";
  uint64_t hidden = 4096;
  unsigned threads = 4;
  app.add_option("--bytes", bytes_text, "Model bytes of the checkpoint")->capture_default_str();
  app.add_option("--hidden", hidden, "H: each weight is [H, H] fp32")->capture_default_str();
  app.add_option("--dir", dir, "Where to write (a disk, not tmpfs)")->capture_default_str();
  app.add_option("--max-shard-size", shard_text, "The export's --max-shard-size")->capture_default_str();
  app.add_option("--threads", threads, "The export's reader threads")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const auto bytes = ParseByteSize(bytes_text);
  const auto shard = ParseByteSize(shard_text);
  if (!bytes || !shard || hidden < 2 || hidden % 2 != 0) {
    std::fprintf(stderr, "export_bench: bad --bytes, --max-shard-size or --hidden (even, >= 2)\n");
    return 2;
  }
  const uint64_t tensor_bytes = hidden * hidden * 4;
  const uint32_t layers = static_cast<uint32_t>(std::max<uint64_t>(1, *bytes / tensor_bytes));

  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return 2;
  self[n] = 0;
  std::string cli = self;
  cli = cli.substr(0, cli.rfind('/')) + "/flashckpt";

  const std::string work = dir + "/export-bench-" + std::to_string(::getpid());
  // As a daemon lays it out (<root>/<job>/checkpoint-<step>): the export goes outside the root.
  const std::string ckpt = work + "/root/bench/checkpoint-100", copied = work + "/copied", out = work + "/exported";
  if (Status s = MakeDirs(ckpt); !s.ok()) {
    std::fprintf(stderr, "export_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  int rc = 0;
  {
    std::vector<bench::SyntheticRank> ranks;
    for (uint32_t r = 0; r < 2; ++r) {
      std::vector<TensorSpec> specs;
      for (uint32_t l = 0; l < layers; ++l) {
        TensorSpec w;
        w.name = "layers." + std::to_string(l) + ".weight";
        w.shape = {hidden / 2, hidden};
        w.global_shape = {hidden, hidden};
        w.box_offset = {r * hidden / 2, 0};
        w.box_shape = {hidden / 2, hidden};
        specs.push_back(w);
      }
      ranks.push_back({Topology{2, r, 2, 0, 1, 0, 1}, specs});
    }
    auto written = bench::WriteSyntheticCheckpoint(ckpt, ranks);
    if (!written.ok()) {
      std::fprintf(stderr, "export_bench: writing the checkpoint: %s\n", written.status().ToString().c_str());
      rc = 1;
    } else {
      const uint64_t total = static_cast<uint64_t>(layers) * tensor_bytes;
      std::printf("checkpoint: %u layers of [%llu, %llu] fp32 in 2 tp ranks, %s of tensors (%s of files) in %s\n",
                  layers, static_cast<unsigned long long>(hidden), static_cast<unsigned long long>(hidden),
                  FormatBytes(total).c_str(), FormatBytes(*written).c_str(), dir.c_str());
      const std::string warm = "cat " + Quote(ckpt) + "/* > /dev/null";
      // cp of the same files, made durable: the limit.
      (void)std::system(warm.c_str());
      auto start = std::chrono::steady_clock::now();
      const std::string cp = "mkdir -p " + Quote(copied) + " && cp " + Quote(ckpt) + "/*.safetensors " +
                             Quote(copied) + "/ && sync -f " + Quote(copied);
      const int cp_rc = std::system(cp.c_str());
      const double cp_secs = Seconds(start);
      // The export, as users run it; and the same program doing nothing, for the memory it starts with.
      const ChildRun idle = RunChild({cli, "--version"});
      (void)std::system(warm.c_str());
      std::fflush(stdout);
      ChildRun run = RunChild({cli, "export", ckpt, out, "--max-shard-size", shard_text, "--threads",
                               std::to_string(threads)});
      if (cp_rc != 0 || run.status != 0) {
        std::fprintf(stderr, "export_bench: cp exited %d, flashckpt export %d\n", cp_rc, run.status);
        rc = 1;
      } else {
        const double cp_gbps = total / cp_secs / 1e9, ex_gbps = total / run.secs / 1e9;
        const uint64_t bound = *shard + tensor_bytes;
        std::printf("%-22s %8.2f s %7.2f GB/s\n", "cp + sync (limit)", cp_secs, cp_gbps);
        std::printf("%-22s %8.2f s %7.2f GB/s   %.2fx of cp\n", "flashckpt export", run.secs, ex_gbps,
                    ex_gbps / cp_gbps);
        const uint64_t grown = run.max_rss > idle.max_rss ? run.max_rss - idle.max_rss : 0;
        std::printf("export peak RSS %s, %s above the program's own start (flashckpt --version: %s): %.2fx one "
                    "tensor (%s); the bound, one shard + one tensor, is %s\n",
                    FormatBytes(run.max_rss).c_str(), FormatBytes(grown).c_str(), FormatBytes(idle.max_rss).c_str(),
                    static_cast<double>(grown) / tensor_bytes, FormatBytes(tensor_bytes).c_str(),
                    FormatBytes(bound).c_str());
        std::printf("RESULT export_ratio=%.3f\n", ex_gbps / cp_gbps);
        bench::SummaryRow("export vs cp + sync", ex_gbps / cp_gbps);
        bench::SummaryRow("export RSS growth / (one shard + one tensor)", static_cast<double>(grown) / bound, "<=",
                          1.0);
      }
    }
  }
  if (std::getenv("EXPORT_BENCH_KEEP") == nullptr) (void)std::system(("rm -rf " + Quote(work)).c_str());
  return rc;
}

}  // namespace
}  // namespace flashckpt

int main(int argc, char** argv) { return flashckpt::Main(argc, argv); }

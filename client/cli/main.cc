// flashckpt: the operator command. Asks the local flashckptd for its status and checkpoints and to
// delete checkpoints, and inspects, verifies and reshards checkpoint directories offline.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "client/cli/commands.h"
#include "common/base/cuda_info.h"
#include "common/base/version.h"

int main(int argc, char** argv) {
  CLI::App app{"flashckpt: inspect the flashckpt daemon and verify checkpoints"};
  app.footer(
      "Exit status: 0 ok, 1 checkpoint incomplete or failed verification, 2 daemon unreachable or RPC\n"
      "error, 3 an offline command failed otherwise (a DIR or SRC that is missing or not a directory,\n"
      "a DST that is not empty), other values: command-line usage error.");
  app.set_version_flag("--version",
                       [] { return "flashckpt " + std::string(flashckpt::kVersion) + " (" + flashckpt::CudaInfoText(flashckpt::GetCudaInfo()) + ")"; });
  app.require_subcommand(1);
  app.fallthrough();  // `flashckpt status --socket PATH` works as well as `flashckpt --socket PATH status`
  flashckpt::cli::Endpoint endpoint{"/run/flashckpt/flashckptd.sock", "", ""};
  app.add_option("--socket", endpoint.socket, "UNIX socket of the daemon")
      ->envname("FLASHCKPT_SOCKET")
      ->capture_default_str();
  CLI::Option* address = app.add_option(
      "--address", endpoint.address,
      "HOST:PORT of the daemon's TCP listener (flashckptd --listen) instead of the socket; status, list, "
      "watch and health only, unless the daemon runs with --tcp-allow-writes");
  app.add_option("--tls-ca", endpoint.tls_ca,
                 "With --address: connect with TLS, trusting the CA (PEM) that signed the daemon's --tls-cert")
      ->check(CLI::ExistingFile)
      ->needs(address);

  bool json = false;
  CLI::App* status = app.add_subcommand("status", "Show the daemon, its memory, every registered rank and its EMA");
  status->add_flag("--json", json, "Print JSON instead of a table");

  CLI::App* health = app.add_subcommand(
      "health", "Ask the daemon's gRPC health service: prints SERVING (exit 0), else NOT_SERVING or why (exit 2)");

  std::string job;
  CLI::App* list = app.add_subcommand(
      "list", "List checkpoints under the daemon's root (with --root: under that root, from its files, no daemon)");
  list->add_option("--job", job, "Only this job");
  std::string list_root;
  list->add_option("--root", list_root,
                   "Read the checkpoints from this root's files instead of asking a daemon (offline: a login node "
                   "that sees the shared root)");
  list->add_flag("--json", json, "Print JSON instead of a table");

  uint64_t watch_count = 0;
  double watch_seconds = 0;
  CLI::App* watch = app.add_subcommand("watch", "Print the daemon's events as they happen, one line each");
  watch->add_option("--job", job, "Only this job");
  watch->add_flag("--json", json, "One JSON object per line instead of text");
  watch->add_option("--count", watch_count, "Stop after this many events (0: no limit)")->capture_default_str();
  watch->add_option("--seconds", watch_seconds, "Stop after this many seconds (0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();

  std::string dir;
  CLI::App* verify = app.add_subcommand("verify", "Check a checkpoint directory's files and checksums (offline)");
  verify->add_option("dir", dir, "The checkpoint directory, e.g. <root>/<job>/checkpoint-1200")->required();
  verify->add_flag("--json", json, "Print the result as JSON");

  std::string dst, chunk = "1MiB";
  uint32_t tp = 1, pp = 1, shard = 1;
  unsigned threads = 4;
  CLI::App* reshard =
      app.add_subcommand("reshard", "Rewrite a complete checkpoint into another (tp, pp, shard) layout (offline)");
  reshard->add_option("src", dir, "The complete checkpoint directory to read")->required();
  reshard->add_option("dst", dst, "A new (or empty) directory for the resharded checkpoint")->required();
  reshard->add_option("--tp-degree", tp, "Tensor-parallel degree of the new layout")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  reshard->add_option("--pp-degree", pp, "Pipeline-parallel degree of the new layout")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  reshard->add_option("--shard-degree", shard, "Sharding (data-parallel) degree of the new layout")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  reshard->add_option("--checksum-chunk", chunk, "Per-chunk checksum size of the new files")->capture_default_str();
  reshard->add_option("--threads", threads, "Reader threads")->check(CLI::Range(1, 64))->capture_default_str();
  bool progress = false;
  reshard->add_flag("--progress", progress,
                    "Print progress (bytes, GB/s, ETA) on stderr every second; on by default when stderr is a "
                    "terminal");

  std::string weights = "model", dtype, max_shard_size = "5GB", strip_prefix;
  CLI::App* exp = app.add_subcommand(
      "export", "Write a checkpoint's model or EMA weights as a Hugging Face safetensors directory (offline)");
  exp->add_option("src", dir, "The complete checkpoint directory to read")->required();
  exp->add_option("dst", dst, "A new (or empty) directory for model.safetensors (or shards and their index)")
      ->required();
  exp->add_option("--weights", weights, "model: the model weights; ema: the EMA, under the parameters' names")
      ->check(CLI::IsMember({"model", "ema"}))
      ->capture_default_str();
  exp->add_option("--dtype", dtype, "Convert fp32/bf16/fp16 tensors to this dtype (default: as saved)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  exp->add_option("--max-shard-size", max_shard_size,
                  "Most tensor bytes per file (K/M/G = 1024^n); a larger tensor gets a file of its own")
      ->capture_default_str();
  exp->add_option("--strip-prefix", strip_prefix, "Remove this prefix from the tensor names that have it");
  exp->add_option("--threads", threads, "Reader threads")->check(CLI::Range(1, 64))->capture_default_str();
  exp->add_flag("--progress", progress,
                "Print progress (bytes, GB/s, ETA) on stderr every second; on by default when stderr is a terminal");

  std::string import_root, import_job, add_prefix;
  int64_t import_step = 0;
  CLI::App* imp = app.add_subcommand(
      "import", "Write a Hugging Face safetensors directory as the first checkpoint of a new job (offline)");
  imp->add_option("src", dir, "The directory with model.safetensors, or model.safetensors.index.json and its files")
      ->required();
  imp->add_option("--root", import_root, "The checkpoint root (flashckptd --root)")->required();
  imp->add_option("--job", import_job, "The new job: it must have no checkpoints")->required();
  imp->add_option("--step", import_step, "The checkpoint's step")
      ->check(CLI::Range(int64_t{0}, int64_t{999'999'999'999'999'999}))
      ->capture_default_str();
  imp->add_option("--add-prefix", add_prefix, "Put this before every tensor name (model. for a Checkpointer's names)");
  imp->add_option("--checksum-chunk", chunk, "Per-chunk checksum size of the written file")->capture_default_str();
  imp->add_flag("--progress", progress,
                "Print progress (bytes, GB/s, ETA) on stderr every second; on by default when stderr is a terminal");

  CLI::App* inspect =
      app.add_subcommand("inspect", "Show a complete checkpoint's topology, files, tensors, sizes and EMA (offline)");
  inspect->add_option("dir", dir, "The checkpoint directory, e.g. <root>/<job>/checkpoint-1200")->required();
  inspect->add_flag("--json", json, "Print JSON instead of tables");

  // delete and gc go through the daemon: its catalog knows the steps in use and owns LATEST.
  std::string owner;
  int64_t step = 0;
  uint32_t keep = 0;
  bool force = false, dry_run = false;
  CLI::App* del = app.add_subcommand(
      "delete", "Delete one checkpoint (through the daemon; never one in use, the newest only with --force)");
  del->add_option("--job", owner, "The job")->required();
  del->add_option("--step", step, "The step to delete")->required()->check(CLI::Range(int64_t{1}, INT64_MAX));
  del->add_flag("--force", force,
                "Also delete the newest complete checkpoint (LATEST moves back to the newest one left)");
  del->add_flag("--dry-run", dry_run, "Only say what would be deleted");
  del->add_flag("--json", json, "Print JSON");
  CLI::App* gc = app.add_subcommand(
      "gc", "Keep the newest N complete checkpoints of a job and delete older ones, as flashckptd --keep does");
  gc->add_option("--job", owner, "The job")->required();
  gc->add_option("--keep", keep, "How many complete checkpoints to keep")->required()->check(CLI::Range(1u, 1000000u));
  gc->add_flag("--dry-run", dry_run, "Only say what would be deleted");
  gc->add_flag("--json", json, "Print JSON");

  CLI::App* release = app.add_subcommand(
      "release", "Give back the shared memory of a job whose ranks have all gone (as flashckptd --idle-release does)");
  release->add_option("--job", owner, "The job")->required();
  release->add_flag("--force", force,
                    "Drop the job's memory checkpoints even when they are newer than its newest complete checkpoint "
                    "on disk (without it they are written first, or the job is kept)");
  release->add_flag("--json", json, "Print JSON");

  CLI11_PARSE(app, argc, argv);

  if (*reshard) {
    return flashckpt::cli::RunReshard(dir, dst, tp, pp, shard, chunk, threads, progress || ::isatty(STDERR_FILENO));
  }
  if (*exp) {
    return flashckpt::cli::RunExport(dir, dst, weights, dtype, max_shard_size, strip_prefix, threads,
                                     progress || ::isatty(STDERR_FILENO));
  }
  if (*imp) {
    return flashckpt::cli::RunImport(dir, import_root, import_job, import_step, add_prefix, chunk,
                                     progress || ::isatty(STDERR_FILENO));
  }
  if (*inspect) return flashckpt::cli::RunInspect(dir, json);
  if (*del) return flashckpt::cli::RunDelete(endpoint, owner, step, 0, force, dry_run, json);
  if (*gc) return flashckpt::cli::RunDelete(endpoint, owner, 0, keep, false, dry_run, json);
  if (*release) return flashckpt::cli::RunRelease(endpoint, owner, force, json);

  if (*status) return flashckpt::cli::RunStatus(endpoint, json);
  if (*health) return flashckpt::cli::RunHealth(endpoint);
  if (*list && !list_root.empty()) return flashckpt::cli::RunListRoot(list_root, job, json);
  if (*list) return flashckpt::cli::RunList(endpoint, job, json);
  if (*watch) return flashckpt::cli::RunWatch(endpoint, job, json, watch_count, watch_seconds);
  return flashckpt::cli::RunVerify(dir, json);
}

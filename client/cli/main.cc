// flashckpt: the operator command. Asks the local flashckptd for its status and checkpoints and to
// delete checkpoints, and inspects, verifies and reshards checkpoint directories offline.
#include <openssl/crypto.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "client/cli/commands.h"
#include "common/base/cuda_info.h"
#include "common/base/version.h"

namespace {

// The command line: the variables its options fill (subcommands that take the same option share
// one) and the subcommands, to tell which one was given.
struct CommandLine {
  flashckpt::cli::Endpoint endpoint{"/run/flashckpt/flashckptd.sock", "", ""};
  bool json = false;
  std::string job;  // status, list and watch --job
  std::string list_root;
  uint64_t watch_count = 0;
  double watch_seconds = 0;
  std::string dir;  // verify and inspect DIR; reshard, export and import SRC
  std::string dst, chunk = "1MiB";
  uint32_t tp = 1, pp = 1, shard = 1;
  unsigned threads = 4;
  bool progress = false;
  std::string weights = "model", dtype, max_shard_size = "5GB", strip_prefix;
  std::string import_root, import_job, add_prefix;
  int64_t import_step = 0;
  std::string owner;  // delete, gc and release --job
  int64_t step = 0;
  uint32_t keep = 0;
  bool force = false, dry_run = false;

  CLI::App* status = nullptr;
  CLI::App* health = nullptr;
  CLI::App* list = nullptr;
  CLI::App* watch = nullptr;
  CLI::App* verify = nullptr;
  CLI::App* reshard = nullptr;
  CLI::App* exp = nullptr;
  CLI::App* imp = nullptr;
  CLI::App* inspect = nullptr;
  CLI::App* del = nullptr;
  CLI::App* gc = nullptr;
  CLI::App* release = nullptr;
};

// The help text around the subcommands, --version, and where the daemon answers.
void AddGlobalOptions(CLI::App& app, CommandLine& cl) {
  app.footer(
      "Exit status: 0 ok, 1 checkpoint incomplete or failed verification, 2 daemon unreachable or RPC\n"
      "error, 3 an offline command failed otherwise (a DIR or SRC that is missing or not a directory,\n"
      "a DST that is not empty), other values: command-line usage error.");
  app.set_version_flag("--version", [] {
    return "flashckpt " + std::string(flashckpt::kVersion) + " (" + flashckpt::CudaInfoText(flashckpt::GetCudaInfo()) +
           ")";
  });
  app.require_subcommand(1);
  app.fallthrough();  // `flashckpt status --socket PATH` works as well as `flashckpt --socket PATH status`
  app.add_option("--socket", cl.endpoint.socket, "UNIX socket of the daemon")
      ->envname("FLASHCKPT_SOCKET")
      ->capture_default_str();
  CLI::Option* address = app.add_option(
      "--address", cl.endpoint.address,
      "HOST:PORT of the daemon's TCP listener (flashckptd --listen) instead of the socket; status, list, "
      "watch and health only, unless the daemon runs with --tcp-allow-writes");
  app.add_option("--tls-ca", cl.endpoint.tls_ca,
                 "With --address: connect with TLS, trusting the CA (PEM) that signed the daemon's --tls-cert")
      ->check(CLI::ExistingFile)
      ->needs(address);
}

// The commands that ask the daemon: status, health, list and watch.
void AddQueryCommands(CLI::App& app, CommandLine& cl) {
  cl.status = app.add_subcommand("status", "Show the daemon, its memory, every registered rank and its EMA");
  cl.status->add_flag("--json", cl.json, "Print JSON instead of a table");

  cl.health = app.add_subcommand(
      "health", "Ask the daemon's gRPC health service: prints SERVING (exit 0), else NOT_SERVING or why (exit 2)");

  cl.list = app.add_subcommand(
      "list", "List checkpoints under the daemon's root (with --root: under that root, from its files, no daemon)");
  cl.list->add_option("--job", cl.job, "Only this job");
  cl.list->add_option("--root", cl.list_root,
                      "Read the checkpoints from this root's files instead of asking a daemon (offline: a login node "
                      "that sees the shared root)");
  cl.list->add_flag("--json", cl.json, "Print JSON instead of a table");

  cl.watch = app.add_subcommand("watch", "Print the daemon's events as they happen, one line each");
  cl.watch->add_option("--job", cl.job, "Only this job");
  cl.watch->add_flag("--json", cl.json, "One JSON object per line instead of text");
  cl.watch->add_option("--count", cl.watch_count, "Stop after this many events (0: no limit)")->capture_default_str();
  cl.watch->add_option("--seconds", cl.watch_seconds, "Stop after this many seconds (0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
}

void AddReshardCommand(CLI::App& app, CommandLine& cl) {
  cl.reshard =
      app.add_subcommand("reshard", "Rewrite a complete checkpoint into another (tp, pp, shard) layout (offline)");
  cl.reshard->add_option("src", cl.dir, "The complete checkpoint directory to read")->required();
  cl.reshard->add_option("dst", cl.dst, "A new (or empty) directory for the resharded checkpoint")->required();
  cl.reshard->add_option("--tp-degree", cl.tp, "Tensor-parallel degree of the new layout")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  cl.reshard->add_option("--pp-degree", cl.pp, "Pipeline-parallel degree of the new layout")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  cl.reshard->add_option("--shard-degree", cl.shard, "Sharding (data-parallel) degree of the new layout")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  cl.reshard->add_option("--checksum-chunk", cl.chunk, "Per-chunk checksum size of the new files")
      ->capture_default_str();
  cl.reshard->add_option("--threads", cl.threads, "Reader threads")->check(CLI::Range(1, 64))->capture_default_str();
  cl.reshard->add_flag("--progress", cl.progress,
                       "Print progress (bytes, GB/s, ETA) on stderr every second; on by default when stderr is a "
                       "terminal");
}

void AddExportCommand(CLI::App& app, CommandLine& cl) {
  cl.exp = app.add_subcommand(
      "export", "Write a checkpoint's model or EMA weights as a Hugging Face safetensors directory (offline)");
  cl.exp->add_option("src", cl.dir, "The complete checkpoint directory to read")->required();
  cl.exp->add_option("dst", cl.dst, "A new (or empty) directory for model.safetensors (or shards and their index)")
      ->required();
  cl.exp->add_option("--weights", cl.weights,
                     "model: the model weights; ema: the EMA, under the parameters' names; optimizer: the "
                     "training state")
      ->check(CLI::IsMember({"model", "ema", "optimizer"}))
      ->capture_default_str();
  cl.exp->add_option("--dtype", cl.dtype, "Convert fp32/bf16/fp16 tensors to this dtype (default: as saved)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  cl.exp
      ->add_option("--max-shard-size", cl.max_shard_size,
                   "Most tensor bytes per file (K/M/G = 1024^n); a larger tensor gets a file of its own")
      ->capture_default_str();
  cl.exp->add_option("--strip-prefix", cl.strip_prefix, "Remove this prefix from the tensor names that have it");
  cl.exp->add_option("--threads", cl.threads, "Reader threads")->check(CLI::Range(1, 64))->capture_default_str();
  cl.exp->add_flag("--progress", cl.progress,
                   "Print progress (bytes, GB/s, ETA) on stderr every second; on by default when stderr is a terminal");
}

void AddImportCommand(CLI::App& app, CommandLine& cl) {
  cl.imp = app.add_subcommand(
      "import", "Write a Hugging Face safetensors directory as the first checkpoint of a new job (offline)");
  cl.imp
      ->add_option("src", cl.dir, "The directory with model.safetensors, or model.safetensors.index.json and its files")
      ->required();
  cl.imp->add_option("--root", cl.import_root, "The checkpoint root (flashckptd --root)")->required();
  cl.imp->add_option("--job", cl.import_job, "The new job: it must have no checkpoints")->required();
  cl.imp->add_option("--step", cl.import_step, "The checkpoint's step")
      ->check(CLI::Range(int64_t{0}, int64_t{999'999'999'999'999'999}))
      ->capture_default_str();
  cl.imp->add_option("--add-prefix", cl.add_prefix,
                     "Put this before every tensor name (model. for a Checkpointer's names)");
  cl.imp->add_option("--checksum-chunk", cl.chunk, "Per-chunk checksum size of the written file")
      ->capture_default_str();
  cl.imp->add_flag("--progress", cl.progress,
                   "Print progress (bytes, GB/s, ETA) on stderr every second; on by default when stderr is a terminal");
}

// The offline commands, which read checkpoint directories themselves: verify, reshard, export,
// import and inspect.
void AddOfflineCommands(CLI::App& app, CommandLine& cl) {
  cl.verify = app.add_subcommand("verify", "Check a checkpoint directory's files and checksums (offline)");
  cl.verify->add_option("dir", cl.dir, "The checkpoint directory, e.g. <root>/<job>/checkpoint-1200")->required();
  cl.verify->add_flag("--json", cl.json, "Print the result as JSON");

  AddReshardCommand(app, cl);
  AddExportCommand(app, cl);
  AddImportCommand(app, cl);

  cl.inspect =
      app.add_subcommand("inspect", "Show a complete checkpoint's topology, files, tensors, sizes and EMA (offline)");
  cl.inspect->add_option("dir", cl.dir, "The checkpoint directory, e.g. <root>/<job>/checkpoint-1200")->required();
  cl.inspect->add_flag("--json", cl.json, "Print JSON instead of tables");
}

// delete and gc go through the daemon: its catalog knows the steps in use and owns LATEST.
void AddDeleteCommands(CLI::App& app, CommandLine& cl) {
  cl.del = app.add_subcommand(
      "delete", "Delete one checkpoint (through the daemon; never one in use, the newest only with --force)");
  cl.del->add_option("--job", cl.owner, "The job")->required();
  cl.del->add_option("--step", cl.step, "The step to delete")->required()->check(CLI::Range(int64_t{1}, INT64_MAX));
  cl.del->add_flag("--force", cl.force,
                   "Also delete the newest complete checkpoint (LATEST moves back to the newest one left)");
  cl.del->add_flag("--dry-run", cl.dry_run, "Only say what would be deleted");
  cl.del->add_flag("--json", cl.json, "Print JSON");
  cl.gc = app.add_subcommand(
      "gc", "Keep the newest N complete checkpoints of a job and delete older ones, as flashckptd --keep does");
  cl.gc->add_option("--job", cl.owner, "The job")->required();
  cl.gc->add_option("--keep", cl.keep, "How many complete checkpoints to keep")
      ->required()
      ->check(CLI::Range(1u, 1000000u));
  cl.gc->add_flag("--dry-run", cl.dry_run, "Only say what would be deleted");
  cl.gc->add_flag("--json", cl.json, "Print JSON");

  cl.release = app.add_subcommand(
      "release", "Give back the shared memory of a job whose ranks have all gone (as flashckptd --idle-release does)");
  cl.release->add_option("--job", cl.owner, "The job")->required();
  cl.release->add_flag("--force", cl.force,
                       "Drop the job's memory checkpoints even when they are newer than its newest complete checkpoint "
                       "on disk (without it they are written first, or the job is kept)");
  cl.release->add_flag("--json", cl.json, "Print JSON");
}

// Runs the subcommand given; returns the process exit status.
int RunCommand(const CommandLine& cl) {
  if (*cl.reshard) {
    return flashckpt::cli::RunReshard(cl.dir, cl.dst, cl.tp, cl.pp, cl.shard, cl.chunk, cl.threads,
                                      cl.progress || ::isatty(STDERR_FILENO));
  }
  if (*cl.exp) {
    return flashckpt::cli::RunExport(cl.dir, cl.dst, cl.weights, cl.dtype, cl.max_shard_size, cl.strip_prefix,
                                     cl.threads, cl.progress || ::isatty(STDERR_FILENO));
  }
  if (*cl.imp) {
    return flashckpt::cli::RunImport(cl.dir, cl.import_root, cl.import_job, cl.import_step, cl.add_prefix, cl.chunk,
                                     cl.progress || ::isatty(STDERR_FILENO));
  }
  if (*cl.inspect) return flashckpt::cli::RunInspect(cl.dir, cl.json);
  if (*cl.del) return flashckpt::cli::RunDelete(cl.endpoint, cl.owner, cl.step, 0, cl.force, cl.dry_run, cl.json);
  if (*cl.gc) return flashckpt::cli::RunDelete(cl.endpoint, cl.owner, 0, cl.keep, false, cl.dry_run, cl.json);
  if (*cl.release) return flashckpt::cli::RunRelease(cl.endpoint, cl.owner, cl.force, cl.json);

  if (*cl.status) return flashckpt::cli::RunStatus(cl.endpoint, cl.json);
  if (*cl.health) return flashckpt::cli::RunHealth(cl.endpoint);
  if (*cl.list && !cl.list_root.empty()) return flashckpt::cli::RunListRoot(cl.list_root, cl.job, cl.json);
  if (*cl.list) return flashckpt::cli::RunList(cl.endpoint, cl.job, cl.json);
  if (*cl.watch) return flashckpt::cli::RunWatch(cl.endpoint, cl.job, cl.json, cl.watch_count, cl.watch_seconds);
  return flashckpt::cli::RunVerify(cl.dir, cl.json);
}

}  // namespace

int main(int argc, char** argv) {
  // gRPC's TLS runs on threads it does not join: one may still be ending when main returns. OpenSSL's
  // exit handler would delete its per-thread keys first, and such a thread's state (freed by those
  // keys' destructors) would then never be freed. Without that handler, the keys outlive every thread.
  OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr);
  CLI::App app{"flashckpt: inspect the flashckpt daemon and verify checkpoints"};
  CommandLine cl;
  AddGlobalOptions(app, cl);
  AddQueryCommands(app, cl);
  AddOfflineCommands(app, cl);
  AddDeleteCommands(app, cl);
  CLI11_PARSE(app, argc, argv);
  return RunCommand(cl);
}

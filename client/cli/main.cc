// flashckpt: the operator command. Asks the local flashckptd for its status and checkpoints, and
// verifies and reshards checkpoint directories offline.
#include <CLI/CLI.hpp>
#include <string>

#include "client/cli/commands.h"
#include "common/cuda_info.h"

int main(int argc, char** argv) {
  CLI::App app{"flashckpt: inspect the flashckpt daemon and verify checkpoints"};
  app.footer(
      "Exit status: 0 ok, 1 checkpoint incomplete or failed verification, 2 daemon unreachable or RPC\n"
      "error, 3 an offline command failed otherwise, other values: command-line usage error.");
  app.set_version_flag("--version",
                       [] { return "flashckpt 0.1.0 (" + flashckpt::CudaInfoText(flashckpt::GetCudaInfo()) + ")"; });
  app.require_subcommand(1);
  app.fallthrough();  // `flashckpt status --socket PATH` works as well as `flashckpt --socket PATH status`
  flashckpt::cli::Endpoint endpoint{"/run/flashckpt/flashckptd.sock", "", ""};
  app.add_option("--socket", endpoint.socket, "UNIX socket of the daemon")
      ->envname("FLASHCKPT_SOCKET")
      ->capture_default_str();
  CLI::Option* address = app.add_option(
      "--address", endpoint.address,
      "HOST:PORT of the daemon's TCP listener (flashckptd --listen) instead of the socket; status and list only");
  app.add_option("--tls-ca", endpoint.tls_ca,
                 "With --address: connect with TLS, trusting the CA (PEM) that signed the daemon's --tls-cert")
      ->check(CLI::ExistingFile)
      ->needs(address);

  bool json = false;
  CLI::App* status = app.add_subcommand("status", "Show the daemon, its memory, every registered rank and its EMA");
  status->add_flag("--json", json, "Print JSON instead of a table");

  std::string job;
  CLI::App* list = app.add_subcommand("list", "List checkpoints under the daemon's root");
  list->add_option("--job", job, "Only this job");
  list->add_flag("--json", json, "Print JSON instead of a table");

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

  CLI11_PARSE(app, argc, argv);

  if (*reshard) return flashckpt::cli::RunReshard(dir, dst, tp, pp, shard, chunk, threads);

  if (*status) return flashckpt::cli::RunStatus(endpoint, json);
  if (*list) return flashckpt::cli::RunList(endpoint, job, json);
  return flashckpt::cli::RunVerify(dir, json);
}

#include "daemon/config.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "common/layout.h"
#include "common/names.h"

namespace flashckpt {
namespace {

// Half of physical memory: a sane default budget for a node that also runs the trainer.
uint64_t DefaultHostMemoryBudget() {
  long pages = ::sysconf(_SC_PHYS_PAGES);
  long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 8ull << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 2;
}

}  // namespace

Result<DaemonConfig> ParseDaemonFlags(int argc, char** argv) {
  DaemonConfig config;
  std::string budget;
  CLI::App app{"flashckptd: per-node asynchronous checkpoint daemon"};
  app.set_config("--config", "", "Read flags from an INI/TOML file (keys as the long flag names)");
  app.set_version_flag("--version", "flashckptd 0.1.0");
  app.add_option("--socket", config.socket_path, "UNIX socket to serve gRPC on")->required();
  app.add_option("--root", config.root, "Directory checkpoints are written under")->required();
  app.add_option("--state-dir", config.state_dir,
                 "Private directory (0700) of the records a restarted daemon uses to adopt the shared-memory "
                 "segments and committed snapshots a crashed one left (default: <socket>.state)");
  app.add_option("--slots", config.slots, "Snapshot slots per rank")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--max-host-memory", budget,
                 "Shared-memory budget for all segments, e.g. 64GiB (default: half of RAM)");
  app.add_option("--writer-threads", config.writer_threads, "Threads persisting snapshots")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--keep", config.keep,
                 "Keep the newest N complete checkpoints of each job and delete older ones (0: keep all)")
      ->capture_default_str();
  app.add_option("--io-threads", config.io_threads, "Writes in flight per writer thread (one persist)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--restore-threads", config.restore_threads, "Reader threads of one restore")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  std::string chunk;
  app.add_option("--checksum-chunk", chunk,
                 "Tensors record an xxh3 per chunk of this size (power of two, 4KiB..1GiB), so a restore "
                 "into another layout reads and verifies only the chunks it needs (default: 1MiB)");
  app.add_option("--log-level", config.log_level, "trace, debug, info, warn, error")->capture_default_str();
  app.add_option("--allow-uid", config.allow_uids, "Also accept socket peers with this uid (repeatable)");
  app.add_option("--allow-gid", config.allow_gids, "Also accept socket peers with this gid (repeatable)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    app.exit(e);
    return Cancelled("help or version printed");
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return InvalidArgument(e.what());
  }
  if (budget.empty()) {
    config.max_host_memory = DefaultHostMemoryBudget();
  } else {
    auto bytes = ParseByteSize(budget);
    if (!bytes || *bytes == 0) {
      return InvalidArgument("--max-host-memory '" + budget + "' is not a size like 64GiB, 512MiB or 1000000");
    }
    config.max_host_memory = *bytes;
  }
  if (!chunk.empty()) {
    auto bytes = ParseByteSize(chunk);
    if (!bytes) return InvalidArgument("--checksum-chunk '" + chunk + "' is not a size like 1MiB or 65536");
    RETURN_IF_ERROR(ValidateChecksumChunk(*bytes).WithContext("--checksum-chunk"));
    config.checksum_chunk = *bytes;
  }
  return config;
}

}  // namespace flashckpt

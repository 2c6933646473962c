#include "daemon/config.h"

#include <grp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <iostream>
#include <vector>

#include "common/cuda_info.h"
#include "common/layout.h"
#include "common/names.h"
#include "daemon/limits.h"
#include "daemon/tcp_listener.h"

namespace flashckpt {
namespace {

// Half of physical memory: a sane default budget for a node that also runs the trainer.
uint64_t DefaultHostMemoryBudget() {
  long pages = ::sysconf(_SC_PHYS_PAGES);
  long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 8ull << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 2;
}

// --shm-group: a group name or a numeric gid. The daemon must be able to hand its segments to the
// group (fchown): root can give them to any group, another user only to a group it is in.
Result<uint32_t> ResolveShmGroup(const std::string& text) {
  gid_t gid = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), gid);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
    std::vector<char> buf(16384);
    group entry{};
    group* found = nullptr;
    int err = ::getgrnam_r(text.c_str(), &entry, buf.data(), buf.size(), &found);
    if (err != 0 || found == nullptr) {
      return InvalidArgument("--shm-group '" + text + "': no such group (give a group name from /etc/group or a gid)");
    }
    gid = found->gr_gid;
  }
  if (::geteuid() != 0 && ::getegid() != gid) {
    std::vector<gid_t> groups(static_cast<size_t>(std::max(0, ::getgroups(0, nullptr))));
    int n = ::getgroups(static_cast<int>(groups.size()), groups.data());
    groups.resize(static_cast<size_t>(std::max(0, n)));
    if (std::find(groups.begin(), groups.end(), gid) == groups.end()) {
      return InvalidArgument("--shm-group '" + text + "' (gid " + std::to_string(gid) +
                             "): the daemon's user is not in that group, so it cannot give segments to it; add it "
                             "(usermod -aG) or run the daemon as root");
    }
  }
  return gid;
}

// What CLI11 cannot check alone: sizes, the group, and flags that only make sense together.
Status Finish(DaemonConfig& config, const std::string& budget, const std::string& chunk, const std::string& rank_bytes,
              const std::string& shm_group) {
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
  if (!rank_bytes.empty()) {
    auto bytes = ParseByteSize(rank_bytes);
    if (!bytes) {
      return InvalidArgument("--max-rank-bytes '" + rank_bytes + "' is not a size like 16GiB or 1000000 (0: no cap)");
    }
    config.max_rank_bytes = *bytes;
  }
  if (!shm_group.empty()) {
    ASSIGN_OR_RETURN(config.shm_group, ResolveShmGroup(shm_group));
  }
  if (config.tls_cert.empty() != config.tls_key.empty()) {
    return InvalidArgument("--tls-cert and --tls-key go together: give both (TLS on the --listen port) or neither");
  }
  if (config.listen.empty()) {
    if (!config.tls_cert.empty()) {
      return InvalidArgument("--tls-cert and --tls-key need --listen (TLS is for the TCP listener)");
    }
    if (config.tcp_allow_writes) return InvalidArgument("--tcp-allow-writes needs --listen");
  } else {
    RETURN_IF_ERROR(ParseListenAddress(config.listen).status());
  }
  return Status::OK();
}

}  // namespace

Result<DaemonConfig> ParseDaemonFlags(int argc, char** argv) {
  DaemonConfig config;
  std::string budget;
  CLI::App app{"flashckptd: per-node asynchronous checkpoint daemon"};
  app.set_config("--config", "", "Read flags from an INI/TOML file (keys as the long flag names)");
  app.set_version_flag("--version", [] { return "flashckptd 0.1.0 (" + CudaInfoText(GetCudaInfo()) + ")"; });
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
  std::string shm_group;
  app.add_option("--shm-group", shm_group,
                 "Create slot segments 0660 and give them to this group (name or gid), so trainers running as "
                 "other users in it can map them (default: 0600, the daemon's user only)");
  app.add_option("--listen", config.listen,
                 "Also serve gRPC on TCP HOST:PORT (PORT alone: 127.0.0.1); read-only (status, list) unless "
                 "--tcp-allow-writes");
  app.add_flag("--tcp-allow-writes", config.tcp_allow_writes,
               "Serve every RPC on the --listen port, not only GetStatus and ListCheckpoints (TCP callers are "
               "not authenticated)");
  app.add_option("--tls-cert", config.tls_cert,
                 "PEM certificate (chain) for TLS on the --listen port; needs --tls-key");
  app.add_option("--tls-key", config.tls_key, "PEM private key of --tls-cert");
  app.add_option("--max-tensors-per-rank", config.max_tensors_per_rank,
                 "Most tensors one rank may register; more is refused with INVALID_ARGUMENT")
      ->check(CLI::Range(uint32_t{1}, static_cast<uint32_t>(kMaxTensorsPerRank)))
      ->capture_default_str();
  std::string rank_bytes;
  app.add_option("--max-rank-bytes", rank_bytes,
                 "Most bytes of tensors one rank may register, e.g. 16GiB; more is refused with "
                 "RESOURCE_EXHAUSTED (default 0: only --max-host-memory)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    app.exit(e);
    return Cancelled("help or version printed");
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return InvalidArgument(e.what());
  }
  if (Status s = Finish(config, budget, chunk, rank_bytes, shm_group); !s.ok()) {
    std::cerr << "flashckptd: " << s.message() << "\n";  // as CLI11 prints its own errors
    return s;
  }
  return config;
}

}  // namespace flashckpt

#include "daemon/edge/config.h"

#include <grp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <vector>

#include "common/base/cuda_info.h"
#include "common/base/log.h"
#include "common/base/names.h"
#include "common/base/version.h"
#include "common/format/layout.h"
#include "daemon/edge/limits.h"
#include "daemon/edge/tcp_listener.h"
#include "daemon/parity/parity_group.h"
#include "daemon/replica/certificates.h"
#include "daemon/replica/replica_server.h"

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
  if (config.node_name.empty()) config.node_name = DefaultNodeName();
  if (Status s = ValidateNodeName(config.node_name); !s.ok()) return InvalidArgument("--node-name: " + s.message());
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
  if (!IsLogLevel(config.log_level)) {
    return InvalidArgument("--log-level '" + config.log_level + "' is not one of trace, debug, info, warn, error, off");
  }
  if (!config.log_file.empty()) {
    // The file is opened (appended to) only when the daemon starts; here its place is checked.
    struct stat st {};
    std::string dir = std::filesystem::path(config.log_file).parent_path().string();
    if (dir.empty()) dir = ".";
    if (::stat(config.log_file.c_str(), &st) == 0) {
      if (!S_ISREG(st.st_mode) || ::access(config.log_file.c_str(), W_OK) != 0) {
        return InvalidArgument("--log-file " + config.log_file + " is not a regular file this user can write to");
      }
    } else if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || ::access(dir.c_str(), W_OK | X_OK) != 0) {
      return InvalidArgument("--log-file " + config.log_file + ": its directory " + dir +
                             " does not exist or this user cannot create files in it");
    }
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
  if (!config.metrics_listen.empty()) {
    RETURN_IF_ERROR(ParseListenAddress(config.metrics_listen).status().WithContext("--metrics-listen"));
  }
  RETURN_IF_ERROR(CheckReplicaConfig(ReplicaListenConfigOf(config)));
  if (config.ec_parity > 0 && config.ec_group.empty()) return InvalidArgument("--ec-parity needs --ec-group");
  if (!config.ec_group.empty()) {
    RETURN_IF_ERROR(ParseParityGroup(config.ec_group, config.ec_parity == 0 ? 1 : config.ec_parity,
                                     config.replica_listen, !config.replica_tls_cert.empty())
                        .status());
  }
  if (config.replica_max_bytes_per_peer > 0 && config.replica_listen.empty()) {
    return InvalidArgument("--replica-max-bytes-per-peer needs --replica-listen");
  }
  if (!config.replica_tls_cert.empty()) {
    // An expired certificate, a key of another certificate or a CA that does not sign it: refused
    // now, by --check-config too, instead of every push and fetch failing with "Socket closed".
    RETURN_IF_ERROR(CheckCertificateFiles(config.replica_tls_cert, config.replica_tls_key, config.replica_tls_ca,
                                          "--replica-tls"));
  }
  return Status::OK();
}

// A size as the flags take it: the largest binary unit that divides it exactly.
std::string SizeText(uint64_t bytes) {
  const char* units[] = {"TiB", "GiB", "MiB", "KiB"};
  for (int i = 0; i < 4; ++i) {
    const uint64_t scale = 1ull << (10 * (4 - i));
    if (bytes != 0 && bytes % scale == 0) return std::to_string(bytes / scale) + units[i];
  }
  return std::to_string(bytes);
}

// A string value in the config file's syntax: double-quoted when it is empty or holds what would
// end or split it (CLI11 strips the quotes; it has no escapes).
std::string ValueText(const std::string& v) {
  if (!v.empty() && v.find_first_of(" \t\"'#;=[],") == std::string::npos) return v;
  return "\"" + v + "\"";
}

template <typename T>
std::string ListText(const std::vector<T>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

}  // namespace

std::string FormatDaemonConfig(const DaemonConfig& c) {
  std::ostringstream out;
  auto line = [&](const char* key, const std::string& value) { out << key << " = " << value << "\n"; };
  auto optional = [&](const char* key, const std::string& value) {
    if (value.empty()) {
      out << "# " << key << " = (not set)\n";
    } else {
      line(key, ValueText(value));
    }
  };
  line("socket", ValueText(c.socket_path));
  line("root", ValueText(c.root));
  line("state-dir", ValueText(!c.state_dir.empty() ? c.state_dir : c.socket_path + ".state"));
  line("node-name", ValueText(c.node_name));
  line("slots", std::to_string(c.slots));
  line("max-host-memory", SizeText(c.max_host_memory));
  line("writer-threads", std::to_string(c.writer_threads));
  line("io-threads", std::to_string(c.io_threads));
  line("restore-threads", std::to_string(c.restore_threads));
  line("checksum-chunk", SizeText(c.checksum_chunk));
  line("keep", std::to_string(c.keep));
  line("stop-timeout", std::to_string(c.stop_timeout_s));
  line("persist-on-stop", c.persist_on_stop ? "true" : "false");
  line("idle-release", std::to_string(c.idle_release.count()));
  line("sweep-interval", std::to_string(std::chrono::duration_cast<std::chrono::seconds>(c.sweep_interval).count()));
  line("lease-ttl", std::to_string(std::chrono::duration_cast<std::chrono::seconds>(c.lease_ttl).count()));
  line("log-level", ValueText(c.log_level));
  optional("log-file", c.log_file);
  if (c.allow_uids.empty()) {
    out << "# allow-uid = (none)\n";
  } else {
    line("allow-uid", ListText(c.allow_uids));
  }
  if (c.allow_gids.empty()) {
    out << "# allow-gid = (none)\n";
  } else {
    line("allow-gid", ListText(c.allow_gids));
  }
  optional("shm-group", c.shm_group ? std::to_string(*c.shm_group) : "");
  optional("listen", c.listen);
  line("tcp-allow-writes", c.tcp_allow_writes ? "true" : "false");
  optional("tls-cert", c.tls_cert);
  optional("tls-key", c.tls_key);
  optional("metrics-listen", c.metrics_listen);
  optional("replica-listen", c.replica_listen);
  optional("replica-tls-cert", c.replica_tls_cert);
  optional("replica-tls-key", c.replica_tls_key);
  optional("replica-tls-ca", c.replica_tls_ca);
  if (c.replica_allow_names.empty()) {
    out << "# replica-allow-name = (none)\n";
  } else {
    std::string names;
    for (const auto& n : c.replica_allow_names) names += (names.empty() ? "" : ", ") + ValueText(n);
    line("replica-allow-name", "[" + names + "]");
  }
  if (c.replicate_to.empty()) {
    out << "# replicate-to = (none)\n";
  } else {
    std::string peers;
    for (const auto& p : c.replicate_to) peers += (peers.empty() ? "" : ", ") + ValueText(p);
    line("replicate-to", "[" + peers + "]");
  }
  if (c.ec_group.empty()) {
    out << "# ec-group = (none)\n";
  } else {
    std::string members;
    for (const auto& m : c.ec_group) members += (members.empty() ? "" : ", ") + ValueText(m);
    line("ec-group", "[" + members + "]");
    line("ec-parity", std::to_string(c.ec_parity == 0 ? 1 : c.ec_parity));
  }
  line("replicate-max-rate", c.replicate_max_rate == 0 ? "0" : SizeText(c.replicate_max_rate));
  line("replica-max-bytes-per-peer", c.replica_max_bytes_per_peer == 0 ? "0" : SizeText(c.replica_max_bytes_per_peer));
  line("max-tensors-per-rank", std::to_string(c.max_tensors_per_rank));
  line("max-rank-bytes", c.max_rank_bytes == 0 ? "0" : SizeText(c.max_rank_bytes));
  return out.str();
}

ReplicaListenConfig ReplicaListenConfigOf(const DaemonConfig& config) {
  ReplicaListenConfig c;
  c.listen = config.replica_listen;
  c.tls_cert = config.replica_tls_cert;
  c.tls_key = config.replica_tls_key;
  c.tls_ca = config.replica_tls_ca;
  c.allow_names = config.replica_allow_names;
  c.replicate_to = config.replicate_to;
  c.max_rate = config.replicate_max_rate;
  return c;
}

namespace {

// The flags CLI11 parses into text or plain seconds: checked and converted into DaemonConfig after
// the parse (CLI11 writes into these while it parses, so they live as long as the CLI::App).
struct RawFlags {
  bool check_config = false;
  std::string budget;
  std::string chunk;
  std::string rank_bytes;
  std::string shm_group;
  std::string max_rate;
  std::string per_peer;
  uint32_t idle_release_s = 0;
  uint32_t sweep_s = 0;
  uint32_t lease_s = 0;
};

// --config, --check-config and --version: how the flags are read, and what to do instead of starting.
void AddConfigFileFlags(CLI::App& app, RawFlags& raw) {
  // CLI11's reader: TOML-style `key = value` lines; an unknown key (or a key under a [section]) is refused.
  app.set_config("--config", "",
                 "Read flags from a file of `key = value` lines (TOML style): keys are the long flag names, # starts "
                 "a comment, a repeatable flag takes a list (allow-uid = [1000, 1001]), a value may be quoted");
  app.allow_config_extras(CLI::config_extras_mode::error);  // a misspelt key is an error, not ignored
  app.add_flag("--check-config", raw.check_config,
               "Check the flags and the --config file (every key known, every value valid), print 'config ok' and "
               "the effective settings in the config file's syntax, and exit 0 (2 on an error) without starting");
  app.set_version_flag("--version", [] { return "flashckptd " + std::string(kVersion) + " (" + CudaInfoText(GetCudaInfo()) + ")"; });
}

// Where the daemon serves and writes, what it calls itself, and the shared memory it holds.
void AddStorageFlags(CLI::App& app, DaemonConfig& config, RawFlags& raw) {
  app.add_option("--socket", config.socket_path, "UNIX socket to serve gRPC on")->required();
  app.add_option("--root", config.root, "Directory checkpoints are written under")->required();
  app.add_option("--state-dir", config.state_dir,
                 "Private directory (0700) of the records a restarted daemon uses to adopt the shared-memory "
                 "segments and committed snapshots a crashed one left (default: <socket>.state)");
  app.add_option("--node-name", config.node_name,
                 "This node's name ([A-Za-z0-9._:-], at most 64), recorded in every saved_signal this daemon writes and shown "
                 "by flashckpt status, list and inspect, so an operator sees which node wrote or lags "
                 "(default: the host name)");
  app.add_option("--slots", config.slots, "Snapshot slots per rank")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--max-host-memory", raw.budget,
                 "Shared-memory budget for all segments, e.g. 64GiB (default: half of RAM)");
}

// The writer and reader threads, retention, and the checksum granularity of what they write.
void AddWriterFlags(CLI::App& app, DaemonConfig& config, RawFlags& raw) {
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
  app.add_option("--checksum-chunk", raw.chunk,
                 "Tensors record an xxh3 per chunk of this size (power of two, 4KiB..1GiB), so a restore "
                 "into another layout reads and verifies only the chunks it needs (default: 1MiB)");
}

void AddLogFlags(CLI::App& app, DaemonConfig& config) {
  app.add_option("--log-level", config.log_level, "trace, debug, info, warn, error")->capture_default_str();
  app.add_option("--log-file", config.log_file,
                 "Append the log to this file instead of stderr (reopened only at start: rotate with copytruncate)");
}

// Timing: the stop at SIGTERM, when idle jobs are released, the sweep of incomplete steps, leases.
void AddTimingFlags(CLI::App& app, DaemonConfig& config, RawFlags& raw) {
  app.add_option("--stop-timeout", config.stop_timeout_s,
                 "Seconds from SIGTERM to exit: writes in flight finish until then, the rest is left for the next "
                 "daemon to adopt")
      ->check(CLI::Range(1u, 86400u))
      ->capture_default_str();
  app.add_flag("--persist-on-stop,!--no-persist-on-stop", config.persist_on_stop,
               "At SIGTERM, also write (within --stop-timeout) each job's newest memory checkpoint that every rank "
               "of it here holds, when the disk has no complete checkpoint as new (default: on; "
               "--persist-on-stop=false or --no-persist-on-stop turns it off)");
  raw.idle_release_s = static_cast<uint32_t>(config.idle_release.count());
  app.add_option("--idle-release", raw.idle_release_s,
                 "Seconds after the last rank of a job disconnected, with nothing of it left to write, until the "
                 "daemon gives the job's shared memory back and forgets it (0: never; flashckpt release --job J "
                 "does it at once)")
      ->check(CLI::Range(0u, 30u * 86400u))
      ->capture_default_str();
  raw.sweep_s = static_cast<uint32_t>(std::chrono::duration_cast<std::chrono::seconds>(config.sweep_interval).count());
  app.add_option("--sweep-interval", raw.sweep_s,
                 "Seconds between re-checks of the newest incomplete steps of the daemon's jobs: a step whose "
                 "signals are all there (written by the daemons of several nodes on a shared root, or seen late) "
                 "completes within this time (0: never)")
      ->check(CLI::Range(0u, 3600u))
      ->capture_default_str();
  raw.lease_s = static_cast<uint32_t>(std::chrono::duration_cast<std::chrono::seconds>(config.lease_ttl).count());
  app.add_option("--lease-ttl", raw.lease_s,
                 "Seconds a lease in the root lives unless refreshed: a step being restored or written holds one, "
                 "and no daemon on the root deletes a step with a live lease; a lease of a daemon that died "
                 "expires after this (0: no leases)")
      ->check(CLI::Range(0u, 86400u))
      ->capture_default_str();
}

// Who may use the socket and map the segments.
void AddAccessFlags(CLI::App& app, DaemonConfig& config, RawFlags& raw) {
  app.add_option("--allow-uid", config.allow_uids, "Also accept socket peers with this uid (repeatable)");
  app.add_option("--allow-gid", config.allow_gids, "Also accept socket peers with this gid (repeatable)");
  app.add_option("--shm-group", raw.shm_group,
                 "Create slot segments 0660 and give them to this group (name or gid), so trainers running as "
                 "other users in it can map them (default: none: segments 0600, the daemon's user only)");
}

// The TCP listener and its TLS.
void AddNetworkFlags(CLI::App& app, DaemonConfig& config) {
  app.add_option("--listen", config.listen,
                 "Also serve gRPC on TCP HOST:PORT (PORT alone: 127.0.0.1); read-only (status, list) unless "
                 "--tcp-allow-writes");
  app.add_flag(
      "--tcp-allow-writes", config.tcp_allow_writes,
      "Serve every RPC on the --listen port, not only GetStatus, ListCheckpoints and WatchEvents (TCP callers are "
      "not authenticated)");
  app.add_option("--tls-cert", config.tls_cert,
                 "PEM certificate (chain) for TLS on the --listen port; needs --tls-key");
  app.add_option("--tls-key", config.tls_key, "PEM private key of --tls-cert");
}

// What one rank may register.
void AddRankLimitFlags(CLI::App& app, DaemonConfig& config, RawFlags& raw) {
  app.add_option("--max-tensors-per-rank", config.max_tensors_per_rank,
                 "Most tensors one rank may register; more is refused with INVALID_ARGUMENT")
      ->check(CLI::Range(uint32_t{1}, static_cast<uint32_t>(kMaxTensorsPerRank)))
      ->capture_default_str();
  app.add_option("--max-rank-bytes", raw.rank_bytes,
                 "Most bytes of tensors one rank may register, e.g. 16GiB; more is refused with "
                 "RESOURCE_EXHAUSTED (default 0: only --max-host-memory)");
}

void AddMetricsFlags(CLI::App& app, DaemonConfig& config) {
  app.add_option("--metrics-listen", config.metrics_listen,
                 "Serve Prometheus metrics over HTTP at HOST:PORT/metrics (PORT alone: 127.0.0.1); off when unset");
}

// The replica channel: holding peers' replicas, sending ours, its mutual TLS and its limits.
void AddReplicaFlags(CLI::App& app, DaemonConfig& config, RawFlags& raw) {
  app.add_option("--replica-listen", config.replica_listen,
                 "Hold peers' replicas of their memory checkpoints, served on HOST:PORT (PORT alone: 127.0.0.1; "
                 "another host's address needs the --replica-tls-* files); off when unset");
  app.add_option("--replica-tls-cert", config.replica_tls_cert,
                 "PEM certificate of this daemon on the replica channel (mutual TLS; with --replica-tls-key and "
                 "--replica-tls-ca)");
  app.add_option("--replica-tls-key", config.replica_tls_key, "PEM private key of --replica-tls-cert");
  app.add_option("--replica-tls-ca", config.replica_tls_ca,
                 "PEM certificate of the CA that signed the peers' replica certificates (a peer without one is "
                 "refused)");
  app.add_option("--replica-allow-name", config.replica_allow_names,
                 "A certificate name (common name or subject alternative name) of a peer allowed on the replica "
                 "channel (repeatable; needs --replica-tls-*)");
  app.add_option("--replicate-to", config.replicate_to,
                 "Send each memory checkpoint of this node's ranks to the replica listener of the peer daemon at "
                 "HOST:PORT (repeatable: one copy per peer; another host's address needs the --replica-tls-* "
                 "files, whose certificate is then this daemon's client certificate)");
  app.add_option("--replicate-max-rate", raw.max_rate,
                 "Bytes per second each --replicate-to peer is sent at most, e.g. 500MiB (default 0: no cap)");
  app.add_option("--ec-group", config.ec_group,
                 "Erasure-coded peer memory: every member's --replica-listen HOST:PORT, comma-separated, in the same "
                 "order on each member, this daemon's own included; each memory checkpoint of this node's ranks is "
                 "coded with the others' into parity the members hold, instead of a full copy")
      ->delimiter(',');
  app.add_option("--ec-parity", config.ec_parity,
                 "How many lost members of --ec-group can be rebuilt (default 1); each member holds about "
                 "M / (members - M) of its checkpoint's bytes for the others");
  app.add_option("--replica-max-bytes-per-peer", raw.per_peer,
                 "Most bytes the replicas of one peer (one certificate name; without TLS one node name) may take "
                 "under --replica-listen, e.g. 16GiB; a push over it evicts that peer's oldest replica (default 0: "
                 "only --max-host-memory bounds them)");
}

// Runs CLI11 over argv. --help and --version print and give kCancelled; a bad flag or config file
// prints CLI11's message (or, for an unknown config key, one that says so) and gives InvalidArgument.
Status ParseArgs(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    app.exit(e);
    return Cancelled("help or version printed");
  } catch (const CLI::ConfigError& e) {
    // CLI11 says "INI was not able to parse KEY" for a key no flag has.
    std::string what = e.what();
    const std::string prefix = "INI was not able to parse ";
    if (what.rfind(prefix, 0) == 0) {
      what = "unknown key '" + what.substr(prefix.size()) + "' in the --config file (keys are the long flag " +
             "names without dashes; flashckptd --help lists them)";
    }
    std::cerr << "flashckptd: " << what << "\n";
    return InvalidArgument(what);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return InvalidArgument(e.what());
  }
  return Status::OK();
}

// After the parse: the raw values converted into `config` and everything checked; an error is
// printed on stderr as well as returned.
Status ApplyRawFlags(const RawFlags& raw, DaemonConfig& config) {
  config.idle_release = std::chrono::seconds(raw.idle_release_s);
  config.sweep_interval = std::chrono::seconds(raw.sweep_s);
  config.lease_ttl = std::chrono::seconds(raw.lease_s);
  // A size flag other than those Finish reads (an empty text leaves `out` as it is).
  auto size_flag = [](const std::string& text, const std::string& flag, const char* example, uint64_t* out) {
    if (text.empty()) return Status::OK();
    auto bytes = ParseByteSize(text);
    if (!bytes) {
      const std::string message = flag + " '" + text + "' is not a size like " + example + " or 1000000";
      std::cerr << "flashckptd: " << message << "\n";
      return InvalidArgument(message);
    }
    *out = *bytes;
    return Status::OK();
  };
  RETURN_IF_ERROR(size_flag(raw.max_rate, "--replicate-max-rate", "500MiB", &config.replicate_max_rate));
  RETURN_IF_ERROR(size_flag(raw.per_peer, "--replica-max-bytes-per-peer", "16GiB", &config.replica_max_bytes_per_peer));
  if (Status s = Finish(config, raw.budget, raw.chunk, raw.rank_bytes, raw.shm_group); !s.ok()) {
    std::cerr << "flashckptd: " << s.message() << "\n";  // as CLI11 prints its own errors
    return s;
  }
  return Status::OK();
}

}  // namespace

Result<DaemonConfig> ParseDaemonFlags(int argc, char** argv) {
  DaemonConfig config;
  RawFlags raw;
  CLI::App app{"flashckptd: per-node asynchronous checkpoint daemon"};
  // Registered in the order --help lists them.
  AddConfigFileFlags(app, raw);
  AddStorageFlags(app, config, raw);
  AddWriterFlags(app, config, raw);
  AddLogFlags(app, config);
  AddTimingFlags(app, config, raw);
  AddAccessFlags(app, config, raw);
  AddNetworkFlags(app, config);
  AddRankLimitFlags(app, config, raw);
  AddMetricsFlags(app, config);
  AddReplicaFlags(app, config, raw);
  RETURN_IF_ERROR(ParseArgs(app, argc, argv));
  RETURN_IF_ERROR(ApplyRawFlags(raw, config));
  if (raw.check_config) {
    std::cout << "config ok\n" << FormatDaemonConfig(config);
    return Cancelled("config checked");
  }
  return config;
}

}  // namespace flashckpt

// The subcommands of the `flashckpt` operator command. Each prints its result (stdout) or its
// error (stderr) and returns the process exit status.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace flashckpt::cli {

// Exit statuses, documented in `flashckpt --help`.
inline constexpr int kExitOk = 0;
inline constexpr int kExitVerifyFailed = 1;  // the checkpoint is incomplete or corrupt
inline constexpr int kExitRpcFailed = 2;     // the daemon is unreachable or answered with an error
inline constexpr int kExitFailed = 3;        // an offline command failed otherwise (a missing directory, I/O error)

// Every RPC of the CLI is cheap for the daemon; one that takes longer is stuck.
inline constexpr std::chrono::seconds kRpcDeadline{10};
// DeleteCheckpoints removes directory trees, which on a shared file system takes a while.
inline constexpr std::chrono::seconds kDeleteDeadline{300};

// Where the daemon answers (--socket, --address, --tls-ca): its UNIX socket, or its TCP listener
// (flashckptd --listen), over TLS when a CA is given. Over TCP the daemon serves status, list, watch
// and health only, unless it allows writes. The commands that ask the daemon go through
// flashckpt::AdminClient (flashckpt/admin.h) with the deadlines above.
struct Endpoint {
  std::string socket;   // UNIX socket path; used when `address` is empty
  std::string address;  // HOST:PORT or [IPV6]:PORT of the daemon's --listen
  std::string tls_ca;   // PEM file of the CA that signed the daemon's --tls-cert; empty: plain TCP
};

// GetStatus from the daemon at `endpoint`.
int RunStatus(const Endpoint& endpoint, bool json);
// ListCheckpoints, for one job or (empty `job`) every job under the daemon's root.
int RunList(const Endpoint& endpoint, const std::string& job, bool json);
// The same from the files under `root`, without a daemon (offline): a missing root is kExitFailed.
int RunListRoot(const std::string& root, const std::string& job, bool json);
// WatchEvents: one line (or JSON object) per event on stdout as it happens, for one job or (empty)
// every job. Prints "watching ..." on stderr once the daemon has subscribed it. Runs until
// interrupted, or until `count` events (0: no limit) or `seconds` (0: no limit) have passed, which
// end it with kExitOk; a daemon that stops ("the daemon at ... stopped") or cannot be reached ends
// it with kExitRpcFailed.
int RunWatch(const Endpoint& endpoint, const std::string& job, bool json, uint64_t count, double seconds);
// grpc.health.v1.Health/Check of the daemon as a whole: prints SERVING (exit 0), or NOT_SERVING
// while it stops (exit 2); unreachable: exit 2 with the reason. An exec probe for supervisors.
int RunHealth(const Endpoint& endpoint);
// The offline commands below share one rule: the directory they read missing or not a directory is
// kExitFailed; an incomplete or corrupt checkpoint in it is kExitVerifyFailed.
// Offline: VerifyCheckpointDir on a checkpoint directory. Needs no daemon.
int RunVerify(const std::string& dir, bool json);
// Offline: RelayoutCheckpoint from `src` into the new directory `dst`, printing a line per new
// rank and a summary. Needs no daemon. `progress`: a progress line on stderr at most every second
// (bytes read and written of about twice the source's tensor bytes, GB/s, ETA).
int RunReshard(const std::string& src, const std::string& dst, uint32_t tp, uint32_t pp, uint32_t shard,
               const std::string& checksum_chunk, unsigned threads, bool progress);
// Offline: ExportCheckpoint (flashckpt/offline.h) of `src` into `dst`, then a summary line.
// `progress`: a progress line on stderr (tensor bytes written of their total, GB/s, ETA).
int RunExport(const std::string& src, const std::string& dst, const std::string& weights, const std::string& dtype,
              const std::string& max_shard_size, const std::string& strip_prefix, unsigned threads, bool progress);
// Offline: ImportCheckpoint (flashckpt/offline.h) of the Hugging Face directory `src` as checkpoint
// `step` of the new job `job` under `root`, then a summary line.
int RunImport(const std::string& src, const std::string& root, const std::string& job, int64_t step,
              const std::string& add_prefix, const std::string& checksum_chunk, bool progress);
// Offline: a complete checkpoint's topology, files, tensors, sizes and EMA, from its metadata.json
// once every file's header agrees with it (CheckFileHeaders; no tensor data is read). An incomplete
// or corrupt one, or one whose metadata.json disagrees with a file, is kExitVerifyFailed, a missing
// directory kExitFailed.
int RunInspect(const std::string& dir, bool json);
// DeleteCheckpoints through the daemon: `step` > 0 deletes that checkpoint (`flashckpt delete`;
// force: also the newest complete one), else gc keeping the newest `keep` (`flashckpt gc`).
int RunDelete(const Endpoint& endpoint, const std::string& job, int64_t step, uint32_t keep, bool force, bool dry_run,
              bool json);
// ReleaseJob through the daemon (`flashckpt release --job J`): its shared memory given back.
int RunRelease(const Endpoint& endpoint, const std::string& job, bool force, bool json);

}  // namespace flashckpt::cli

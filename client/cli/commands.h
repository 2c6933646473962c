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
inline constexpr int kExitFailed = 3;        // an offline command failed (bad argument, I/O error)

// Every RPC of the CLI is read-only and cheap for the daemon; one that takes longer is stuck.
inline constexpr std::chrono::seconds kRpcDeadline{10};

// GetStatus from the daemon listening on the UNIX socket `socket`.
int RunStatus(const std::string& socket, bool json);
// ListCheckpoints, for one job or (empty `job`) every job under the daemon's root.
int RunList(const std::string& socket, const std::string& job, bool json);
// Offline: VerifyCheckpointDir on a checkpoint directory. Needs no daemon.
int RunVerify(const std::string& dir, bool json);
// Offline: RelayoutCheckpoint from `src` into the new directory `dst`, printing a line per new
// rank and a summary. Needs no daemon.
int RunReshard(const std::string& src, const std::string& dst, uint32_t tp, uint32_t pp, uint32_t shard,
               const std::string& checksum_chunk, unsigned threads);

}  // namespace flashckpt::cli

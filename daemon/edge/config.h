// flashckptd's flags, also readable from a config file (--config, INI keys named like the flags).
#pragma once

#include <string>

#include "common/base/status.h"
#include "daemon/core/daemon_config.h"
#include "daemon/replica/replica_server.h"

namespace flashckpt {

// Parses argv. Returns kCancelled after printing --help or --version (exit 0), InvalidArgument
// for bad flags (CLI11's message, or one naming the flag for values and combinations CLI11 cannot
// check: sizes, --shm-group, --listen, TLS files without each other or without --listen); the
// message is also printed on stderr.
// With --check-config it prints "config ok" and FormatDaemonConfig on stdout and returns kCancelled
// (exit 0) when all is valid, the error as above otherwise; nothing is started either way.
Result<DaemonConfig> ParseDaemonFlags(int argc, char** argv);

// The --replica-* and --replicate-* flags of `config`, as the replica listener takes them.
ReplicaListenConfig ReplicaListenConfigOf(const DaemonConfig& config);

// The effective settings, one `key = value` line per flag in the --config file's syntax (unset
// optional ones as comments), so that the text read back as a config file gives the same settings.
std::string FormatDaemonConfig(const DaemonConfig& config);

}  // namespace flashckpt

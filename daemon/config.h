// flashckptd's flags, also readable from a config file (--config, INI keys named like the flags).
#pragma once

#include <string>

#include "common/status.h"
#include "daemon/daemon.h"

namespace flashckpt {

// Parses argv. Returns kCancelled after printing --help or --version (exit 0), InvalidArgument
// for bad flags (CLI11's message, or one naming the flag for values and combinations CLI11 cannot
// check: sizes, --shm-group, --listen, TLS files without each other or without --listen); the
// message is also printed on stderr.
Result<DaemonConfig> ParseDaemonFlags(int argc, char** argv);

}  // namespace flashckpt

// flashckptd's flags, also readable from a config file (--config, INI keys named like the flags).
#pragma once

#include <string>

#include "common/status.h"
#include "daemon/daemon.h"

namespace flashckpt {

// Parses argv. Returns kCancelled after printing --help or --version (exit 0), InvalidArgument
// with CLI11's message for bad flags.
Result<DaemonConfig> ParseDaemonFlags(int argc, char** argv);

}  // namespace flashckpt

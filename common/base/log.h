// Named spdlog loggers, one per subsystem: rpc, shm, writer, catalog, restore, client.
// Lines are key=value: "persisted job=llama step=1200 rank=3 bytes=12.4GiB secs=3.1".
// Every logger writes to one shared sink: stderr, or the file given to SetLogFile.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace flashckpt {

// Returns the logger called `name`, creating it (the shared sink, shared level) on first use.
// Thread-safe.
std::shared_ptr<spdlog::logger> Logger(const std::string& name);
// Sets the level of every flashckpt logger ("trace", "debug", "info", "warn", "error", "off").
bool SetLogLevel(const std::string& level);
// True when `level` is one SetLogLevel accepts.
bool IsLogLevel(const std::string& level);
// Sends every flashckpt logger, present and future, to `path` (appended to; created 0666 less the
// umask, 0640 under the unit's UMask=0027); empty: back to stderr. Returns an error message, or "" on success. Call it before the
// threads that log start: the loggers' sinks are swapped without a lock on their side.
std::string SetLogFile(const std::string& path);

}  // namespace flashckpt

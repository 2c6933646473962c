// Named spdlog loggers, one per subsystem: rpc, shm, writer, catalog, restore, client.
// Lines are key=value: "persisted job=llama step=1200 rank=3 bytes=12.4GiB secs=3.1".
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace flashckpt {

// Returns the logger called `name`, creating it (stderr, shared level) on first use. Thread-safe.
std::shared_ptr<spdlog::logger> Logger(const std::string& name);
// Sets the level of every flashckpt logger ("trace", "debug", "info", "warn", "error", "off").
bool SetLogLevel(const std::string& level);

}  // namespace flashckpt

#include "common/base/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include "common/base/mutex.h"

namespace flashckpt {
namespace {

constexpr char kPattern[] = "%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%n] %v";

Mutex g_mu;
spdlog::level::level_enum g_level = spdlog::level::info;  // guarded by g_mu
spdlog::sink_ptr g_sink;                                  // guarded by g_mu; null until first used

spdlog::sink_ptr SinkLocked() {
  if (!g_sink) {
    g_sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    g_sink->set_pattern(kPattern);
  }
  return g_sink;
}

}  // namespace

std::shared_ptr<spdlog::logger> Logger(const std::string& name) {
  MutexLock lock(&g_mu);
  if (auto existing = spdlog::get(name)) return existing;
  auto logger = std::make_shared<spdlog::logger>(name, SinkLocked());
  logger->set_level(g_level);
  // Every line reaches the sink's file as it is logged (a daemon killed a moment later leaves it
  // there): the daemon logs events, not per-byte traces, so a write per line costs nothing.
  logger->flush_on(spdlog::level::trace);
  spdlog::register_logger(logger);
  return logger;
}

bool IsLogLevel(const std::string& level) {
  return spdlog::level::from_str(level) != spdlog::level::off || level == "off";
}

bool SetLogLevel(const std::string& level) {
  if (!IsLogLevel(level)) return false;
  auto parsed = spdlog::level::from_str(level);
  MutexLock lock(&g_mu);
  g_level = parsed;
  spdlog::apply_all([&](const std::shared_ptr<spdlog::logger>& l) { l->set_level(parsed); });
  return true;
}

std::string SetLogFile(const std::string& path) {
  spdlog::sink_ptr sink;
  if (path.empty()) {
    sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  } else {
    try {
      sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
    } catch (const spdlog::spdlog_ex& e) {
      return e.what();
    }
  }
  sink->set_pattern(kPattern);
  MutexLock lock(&g_mu);
  g_sink = sink;
  spdlog::apply_all([&](const std::shared_ptr<spdlog::logger>& l) { l->sinks() = {sink}; });
  return "";
}

}  // namespace flashckpt

// flashckptd: parse flags, serve until SIGTERM or SIGINT, then stop within --stop-timeout.
#include <openssl/crypto.h>

#include <chrono>
#include <csignal>
#include <cstdio>

#include "common/base/allocator.h"
#include "common/base/log.h"
#include "daemon/edge/config.h"
#include "daemon/edge/grpc_log.h"
#include "daemon/edge/server.h"
#include "daemon/edge/state_records.h"
#include "daemon/observe/systemd_notify.h"

namespace {

// Above this, the start is logged as slow: clients wait connect_timeout (10 s by default) for it.
constexpr double kSlowStartupSecs = 2.0;

// "serving; 2 jobs, 8 ranks (8 connected)" for systemd's STATUS=. Read from memory under the
// daemon's lock and nothing else: the watchdog ping waits for it, so a daemon stuck on its lock
// stops pinging, while a slow filesystem (which status would read) does not.
std::string ServingLine(const flashckpt::Daemon& daemon) {
  const flashckpt::SessionCounts counts = daemon.CountSessions();
  return "serving; " + std::to_string(counts.jobs) + " jobs, " + std::to_string(counts.ranks) + " ranks (" +
         std::to_string(counts.connected) + " connected)";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace flashckpt;
  // No OpenSSL exit handler: it would delete OpenSSL's per-thread keys while a thread gRPC does not
  // join may still be ending, leaving that thread's state unfreed (as in client/cli/main.cc).
  OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr);
  auto config = ParseDaemonFlags(argc, argv);  // also --check-config: prints and returns kCancelled
  if (!config.ok()) return config.status().code() == StatusCode::kCancelled ? 0 : 2;
  if (std::string error = SetLogFile(config->log_file); !error.empty()) {
    std::fprintf(stderr, "flashckptd: --log-file %s: %s\n", config->log_file.c_str(), error.c_str());
    return 2;
  }
  SetLogLevel(config->log_level);  // checked by ParseDaemonFlags
  RouteGrpcLogsToDaemonLog();
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // inherited by every thread started below
  if (const AllocatorSetting a = KeepMessageBuffersInHeap(); a != AllocatorSetting::kSet) {
    // (Replica pushes and fetches are slower without it: docs/PERFORMANCE.md.)
    auto log = Logger("rpc");
    log->log(a == AllocatorSetting::kRefused ? spdlog::level::warn : spdlog::level::info,
             "allocator thresholds for large messages {}", AllocatorSettingName(a));
  }

  SystemdNotifier systemd;
  // A second daemon on a live daemon's socket must not adopt, release or delete anything of it:
  // refused before the daemon starts (and by the state directory's lock, below, when the socket
  // differs).
  if (Status free = CheckNoDaemonListening(config->socket_path); !free.ok()) {
    Logger("rpc")->critical("startup refused: {}", free.ToString());
    systemd.Status("startup refused: " + free.ToString());
    return 1;
  }
  const auto begun = std::chrono::steady_clock::now();
  config->state_records = &ProtoStateRecords();
  Daemon daemon(*config);
  Server server(&daemon);
  // In order: the daemon adopts what a predecessor left before the server lets anyone in, so a
  // client that reaches the socket (or the health service) reaches a daemon that is ready.
  Status started = daemon.Start();
  const double adopt_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - begun).count();
  if (started.ok()) started = server.Start();
  if (!started.ok()) {
    Logger("rpc")->critical("startup failed: {}", started.ToString());
    systemd.Status("startup failed: " + started.ToString());
    return 1;
  }
  const double startup_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - begun).count();
  Logger("rpc")->info("serving socket={} startup_secs={:.3f} adopt_secs={:.3f}", config->socket_path, startup_secs,
                      adopt_secs);
  if (startup_secs > kSlowStartupSecs) {
    Logger("rpc")->warn("slow start: serving {:.1f} s after start (adoption {:.1f} s); trainers wait up to their "
                        "connect_timeout (10 s by default)",
                        startup_secs, adopt_secs);
  }
  systemd.Ready(ServingLine(daemon), [&daemon] { return ServingLine(daemon); });
  int received = 0;
  sigwait(&signals, &received);

  // The whole stop fits in --stop-timeout: writes in flight get all of it but the last moment
  // (up to 2 s), which is left to the listeners to end open streams.
  const auto timeout = std::chrono::seconds(config->stop_timeout_s);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto listeners = std::min<std::chrono::steady_clock::duration>(std::chrono::seconds(2), timeout / 2);
  Logger("rpc")->info("stopping signal={} stop_timeout={}s", received, config->stop_timeout_s);
  systemd.Stopping("stopping: finishing the writes in flight (at most " + std::to_string(config->stop_timeout_s) +
                   " s)");
  server.SetServing(false);
  daemon.Stop(deadline - listeners);  // refuses new work, finishes or abandons the writes in flight
  systemd.Status("stopping: closing the listeners");
  auto left = std::min(deadline - std::chrono::steady_clock::now(), listeners);
  server.Shutdown(std::chrono::duration_cast<std::chrono::milliseconds>(
      std::max<std::chrono::steady_clock::duration>(left, std::chrono::steady_clock::duration::zero())));
  Logger("rpc")->info("stopped");
  return 0;
}

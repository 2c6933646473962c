// flashckptd: parse flags, serve until SIGTERM or SIGINT, then stop cleanly.
#include <csignal>
#include <cstdio>

#include "common/log.h"
#include "daemon/config.h"
#include "daemon/server.h"

int main(int argc, char** argv) {
  using namespace flashckpt;
  auto config = ParseDaemonFlags(argc, argv);
  if (!config.ok()) return config.status().code() == StatusCode::kCancelled ? 0 : 2;
  if (!SetLogLevel(config->log_level)) {
    std::fprintf(stderr, "unknown --log-level '%s'\n", config->log_level.c_str());
    return 2;
  }
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // inherited by every thread started below

  Daemon daemon(*config);
  Server server(&daemon);
  // In order: the daemon adopts what a predecessor left before the server lets anyone in.
  Status started = daemon.Start();
  if (started.ok()) started = server.Start();
  if (!started.ok()) {
    Logger("rpc")->critical("startup failed: {}", started.ToString());
    return 1;
  }
  int received = 0;
  sigwait(&signals, &received);
  Logger("rpc")->info("stopping signal={}", received);
  daemon.Stop();  // wakes waiting handlers and finishes writes in flight
  server.Shutdown(std::chrono::seconds(2));
  return 0;
}

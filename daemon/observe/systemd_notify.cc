#include "daemon/observe/systemd_notify.h"

#include <systemd/sd-daemon.h>

#include <cstdlib>
#include <cstring>

#include "common/base/log.h"

namespace flashckpt {

SystemdNotifier::SystemdNotifier() {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  enabled_ = socket != nullptr && socket[0] != '\0';
  if (!enabled_) return;
  uint64_t usec = 0;
  // > 0 only when WATCHDOG_USEC is set and WATCHDOG_PID, if set, is this process.
  if (::sd_watchdog_enabled(/*unset_environment=*/0, &usec) > 0 && usec > 0) {
    watchdog_ = std::chrono::microseconds(usec);
  }
  Logger("rpc")->info("systemd notify socket={} watchdog_usec={}", socket, watchdog_.count());
}

SystemdNotifier::~SystemdNotifier() {
  {
    MutexLock lock(&mu_);
    done_ = true;
  }
  cv_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

void SystemdNotifier::Send(const std::string& state) {
  if (!enabled_) return;
  int r = ::sd_notify(/*unset_environment=*/0, state.c_str());
  if (r < 0) Logger("rpc")->warn("sd_notify failed: {} ({})", std::strerror(-r), state);
}

void SystemdNotifier::Ready(const std::string& status_line, std::function<std::string()> status) {
  if (!enabled_) return;
  bool has_source = false;
  {
    MutexLock lock(&mu_);
    status_ = std::move(status);
    has_source = status_ != nullptr;
    last_status_ = status_line;
  }
  Send("READY=1\nSTATUS=" + status_line);
  if ((watchdog_.count() > 0 || has_source) && !thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

void SystemdNotifier::Stopping(const std::string& status_line) {
  if (!enabled_) return;
  {
    MutexLock lock(&mu_);
    status_ = nullptr;  // the stop's own lines from now on
    last_status_ = status_line;
  }
  Send("STOPPING=1\nSTATUS=" + status_line);
}

void SystemdNotifier::Status(const std::string& status_line) {
  if (!enabled_) return;
  {
    MutexLock lock(&mu_);
    last_status_ = status_line;
  }
  Send("STATUS=" + status_line);
}

void SystemdNotifier::Run() {
  const auto period = watchdog_.count() > 0 ? std::chrono::duration_cast<std::chrono::microseconds>(watchdog_ / 2)
                                            : std::chrono::microseconds(std::chrono::seconds(5));
  MutexLock lock(&mu_);
  for (;;) {
    // One period, or until the destructor says done.
    const auto next = std::chrono::steady_clock::now() + period;
    while (!done_ && cv_.WaitUntil(&lock, next)) {
    }
    if (done_) return;
    std::string line;
    if (status_) {
      auto source = status_;
      lock.Unlock();
      line = source();  // may take the daemon's lock: not under mu_
      lock.Lock();
      if (line == last_status_ || !status_) line.clear();
      if (!line.empty()) last_status_ = line;
    }
    lock.Unlock();
    std::string state = watchdog_.count() > 0 ? "WATCHDOG=1" : "";
    if (!line.empty()) state += (state.empty() ? "" : "\n") + std::string("STATUS=") + line;
    if (!state.empty()) Send(state);
    lock.Lock();
  }
}

}  // namespace flashckpt

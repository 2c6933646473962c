// flashckptd's side of systemd's notify protocol (Type=notify, WatchdogSec=): READY=1 once the
// daemon has adopted its predecessor's segments and its socket listens, STOPPING=1 when a stop
// begins, STATUS= lines for `systemctl status`, and WATCHDOG=1 pings from a thread of its own at
// half the interval systemd asks for (WATCHDOG_USEC, for this pid: WATCHDOG_PID).
//
// Without NOTIFY_SOCKET in the environment (not run by systemd) every call does nothing.
// Thread-safe.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "common/base/mutex.h"

namespace flashckpt {

class SystemdNotifier {
 public:
  SystemdNotifier();
  ~SystemdNotifier();  // stops the ping thread

  SystemdNotifier(const SystemdNotifier&) = delete;
  SystemdNotifier& operator=(const SystemdNotifier&) = delete;

  bool enabled() const { return enabled_; }
  // The watchdog interval systemd asked for; zero when none.
  std::chrono::microseconds watchdog_interval() const { return watchdog_; }

  // READY=1 with a STATUS= line. Then, with a watchdog, WATCHDOG=1 every half interval; with
  // `status`, a STATUS= line whenever its text changes (checked at each ping, or every 5 s). Each
  // ping waits for `status` first, so a daemon stuck on its lock stops pinging and systemd's
  // watchdog aborts it.
  void Ready(const std::string& status_line, std::function<std::string()> status = nullptr);
  // STOPPING=1 with a STATUS= line. The pings go on until destruction: a stop that takes longer
  // than the watchdog interval is not a hang.
  void Stopping(const std::string& status_line);
  void Status(const std::string& status_line);

 private:
  void Send(const std::string& state);
  void Run();

  bool enabled_ = false;
  std::chrono::microseconds watchdog_{0};
  Mutex mu_;
  CondVar cv_;
  bool done_ GUARDED_BY(mu_) = false;
  std::function<std::string()> status_ GUARDED_BY(mu_);
  std::string last_status_ GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace flashckpt

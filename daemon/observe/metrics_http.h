// The Prometheus scrape endpoint (--metrics-listen HOST:PORT): GET /metrics answers the text
// exposition of daemon/observe/metrics.h; HEAD likewise without a body; any other path is 404 and any other
// method 405. HTTP is Boost.Beast's, on one Asio thread of its own: every connection has a
// deadline for its whole exchange, a request is at most a small header (no body), at most
// kMaxConnections are open at once (more are closed at once), and each connection closes after
// one response.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/base/clock.h"
#include "common/base/status.h"

namespace flashckpt {

class MetricsHttpServer {
 public:
  static constexpr int kMaxConnections = 64;
  // `address` as --listen takes it (common/io/net.h: "9100" is 127.0.0.1:9100, port 0 lets
  // the kernel choose). `render` is called on the server's thread for each scrape.
  MetricsHttpServer(std::string address, std::function<std::string()> render);
  ~MetricsHttpServer();  // Stop()

  // Binds (an address in use is an error), logs "metrics listening http=HOST:PORT", and serves.
  Status Start();
  // Closes the listener and every connection at once, whatever `deadline` (a scrape in progress is
  // cut; the scraper tries again), and joins the thread. Idempotent.
  void Stop(Clock::TimePoint deadline = Clock::TimePoint::max());
  int port() const { return port_; }

 private:
  struct Impl;
  std::string address_;
  std::function<std::string()> render_;
  std::unique_ptr<Impl> impl_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace flashckpt

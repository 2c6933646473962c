// A flashckptd inside a benchmark's process, started as daemon/edge/main.cc starts it (the daemon, then
// its server); stopped on destruction (writes in flight finished, segments and socket removed).
#pragma once

#include <chrono>
#include <memory>

#include "common/base/status.h"
#include "daemon/edge/server.h"
#include "daemon/edge/state_records.h"

namespace flashckpt::bench {

class LocalDaemon {
 public:
  static Result<std::unique_ptr<LocalDaemon>> Start(const DaemonConfig& config) {
    std::unique_ptr<LocalDaemon> d(new LocalDaemon());
    DaemonConfig c = config;
    if (c.state_records == nullptr) c.state_records = &ProtoStateRecords();  // as flashckptd's main sets it
    d->daemon_ = std::make_unique<Daemon>(c);
    RETURN_IF_ERROR(d->daemon_->Start());
    d->server_ = std::make_unique<Server>(d->daemon_.get());
    RETURN_IF_ERROR(d->server_->Start());
    d->serving_ = true;
    return d;
  }
  ~LocalDaemon() {
    daemon_->Stop();
    if (serving_) server_->Shutdown(std::chrono::seconds(2));
  }
  LocalDaemon(const LocalDaemon&) = delete;
  LocalDaemon& operator=(const LocalDaemon&) = delete;

 private:
  LocalDaemon() = default;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Server> server_;
  bool serving_ = false;
};

}  // namespace flashckpt::bench

// A real flashckptd (Daemon + Server) in the test process, on a UNIX socket and root under a fresh
// temporary directory, and clients connected to it through the real gRPC path.
#pragma once

#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "daemon/server.h"
#include "flashckpt/client.h"
#include "testing.h"

namespace flashckpt {

// Two F32 tensors of n elements: a model weight "w" and its optimizer state "w.exp_avg".
inline std::vector<TensorSpec> ModelAndMomentSpecs(uint64_t n) {
  TensorSpec w;
  w.name = "w";
  w.shape = {n};
  TensorSpec m = w;
  m.name = "w.exp_avg";
  m.kind = TensorKind::kOptimizer;
  return {w, m};
}

class InProcessDaemon {
 public:
  // Creates /tmp/<prefix>-XXXXXX; the directory is removed by the destructor.
  explicit InProcessDaemon(const std::string& prefix) {
    std::string tmpl = "/tmp/" + prefix + "-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) dir_ = tmpl;
  }
  ~InProcessDaemon() {
    Stop();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  InProcessDaemon(const InProcessDaemon&) = delete;
  InProcessDaemon& operator=(const InProcessDaemon&) = delete;

  // Starts with a 64 MiB budget and 2 slots; `tweak` may change any field of the config.
  Status Start(const std::function<void(DaemonConfig&)>& tweak = {}) {
    if (dir_.empty()) return IOError("mkdtemp failed");
    DaemonConfig c;
    c.socket_path = socket();
    c.root = root();
    c.max_host_memory = 64ull << 20;
    c.slots = 2;
    if (tweak) tweak(c);
    daemon_ = std::make_unique<Daemon>(c);
    RETURN_IF_ERROR(daemon_->Start());
    server_ = std::make_unique<Server>(daemon_.get());
    return server_->Start();
  }
  void Stop() {
    if (daemon_) daemon_->Stop();
    if (server_) server_->Shutdown(std::chrono::seconds(1));
    server_.reset();
    daemon_.reset();
  }

  const std::string& dir() const { return dir_; }
  std::string socket() const { return dir_ + "/run/flashckptd.sock"; }
  std::string root() const { return dir_ + "/root"; }
  Daemon* daemon() const { return daemon_.get(); }
  Server* server() const { return server_.get(); }

  // A client of `job`/`rank` with short deadlines; null (and a test failure) when it cannot connect.
  // `tweak` may change any option (backpressure, fatal_persist_errors, timeouts).
  std::unique_ptr<Client> Connect(const std::string& job, uint32_t rank = 0,
                                  const std::function<void(ClientOptions&)>& tweak = {}) const {
    ClientOptions o;
    o.socket_path = socket();
    o.job = job;
    o.rank = rank;
    o.rpc_timeout = std::chrono::seconds(5);
    o.slot_timeout = std::chrono::seconds(2);
    if (tweak) tweak(o);
    auto c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }

 private:
  std::string dir_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Server> server_;
};

}  // namespace flashckpt

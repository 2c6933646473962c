// A real flashckptd (Daemon + Server) in the test process, on a UNIX socket and root under a fresh
// temporary directory, and clients connected to it through the real gRPC path.
#pragma once

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "support/fault_injecting_io.h"
#include "daemon/edge/server.h"
#include "daemon/edge/state_records.h"
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

// One rank of a job with the two tensors of ModelAndMomentSpecs, registered; a save fills the weight
// with the step and the moment with -step, so what a restore hands back tells which step it was.
struct TestTrainer {
  std::unique_ptr<Client> client;  // null when it could not connect (a test failure is recorded)
  std::vector<float> w, m;
  std::vector<TensorBuffer> bufs;

  Result<SnapshotHandle> Snapshot(int64_t step) {
    std::fill(w.begin(), w.end(), static_cast<float>(step));
    std::fill(m.begin(), m.end(), static_cast<float>(-step));
    return client->Snapshot(step, bufs, {});
  }
  // A memory checkpoint of `step` (SnapshotOptions::tier kMemory), its extra state naming the step.
  Status Memory(int64_t step) {
    std::fill(w.begin(), w.end(), static_cast<float>(step));
    std::fill(m.begin(), m.end(), static_cast<float>(-step));
    SnapshotOptions o;
    o.tier = Tier::kMemory;
    o.extra = "{\"step\":" + std::to_string(step) + "}";
    return client->Snapshot(step, bufs, o).status();
  }
  // Snapshot and wait until it is durable.
  Status Save(int64_t step) {
    auto snap = Snapshot(step);
    if (!snap.ok()) return snap.status();
    return client->WaitPersisted(step, std::chrono::seconds(30));
  }
  // Whether the buffers hold what a save of step `value` put there.
  bool All(float value) const {
    return std::all_of(w.begin(), w.end(), [&](float x) { return x == value; }) &&
           std::all_of(m.begin(), m.end(), [&](float x) { return x == -value; });
  }
};

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
    c.state_records = &ProtoStateRecords();
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
  // Every client of a job is a process of one run ("<job>-run"), so a test may connect again and
  // carry on saving; tests of runs themselves set run_id (empty: the daemon picks). `tweak` may
  // change any option (backpressure, fatal_persist_errors, timeouts, run_id).
  std::unique_ptr<Client> Connect(const std::string& job, uint32_t rank = 0,
                                  const std::function<void(ClientOptions&)>& tweak = {}) const {
    ClientOptions o;
    o.socket_path = socket();
    o.job = job;
    o.rank = rank;
    o.rpc_timeout = std::chrono::seconds(5);
    o.slot_timeout = std::chrono::seconds(2);
    o.run_id = job.substr(0, 60) + "-run";
    if (tweak) tweak(o);
    auto c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  // Rank 0 of `job`, connected (Connect) and registered with two tensors of n floats.
  TestTrainer StartTrainer(const std::string& job, uint64_t n,
                           const std::function<void(ClientOptions&)>& tweak = {}) const {
    TestTrainer t;
    t.client = Connect(job, 0, tweak);
    if (!t.client) return t;
    EXPECT_OK(t.client->Register(Topology{}, ModelAndMomentSpecs(n)));
    t.w.resize(n);
    t.m.resize(n);
    t.bufs = {{"w", t.w.data(), n * 4}, {"w.exp_avg", t.m.data(), n * 4}};
    return t;
  }

  std::string JobDir(const std::string& job) const { return root() + "/" + job; }
  std::string StepDir(const std::string& job, int64_t step) const {
    return JobDir(job) + "/checkpoint-" + std::to_string(step);
  }

 private:
  std::string dir_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Server> server_;
};

// A fixture: a daemon whose file-system calls all go through `io_`, where the test injects faults
// (failures, short writes, delays). TearDown clears them first, so what is still queued finishes.
class FaultyIoDaemonTest : public ::testing::Test {
 protected:
  explicit FaultyIoDaemonTest(const std::string& prefix) : d_(prefix) {}
  void SetUp() override {
    ASSERT_OK(d_.Start([&](DaemonConfig& c) { c.io_env = &io_; }));
  }
  void TearDown() override {
    io_.Clear();
    d_.Stop();
  }
  std::string JobDir(const std::string& job) const { return d_.JobDir(job); }
  std::string StepDir(const std::string& job, int64_t step) const { return d_.StepDir(job, step); }

  FaultInjectingIo io_;  // outlives the daemon, which reads and writes through it
  InProcessDaemon d_;
};

inline bool Contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace flashckpt

// The Daemon class driven directly, without gRPC, by several trainer threads at once, while other
// threads read its status and list its checkpoints: BeginSnapshot/Commit against the EMA stage, the
// writer pool (several writes in flight, chunk checksums on their loops) and the catalog's
// completion, then parallel restores and EMA copies. scripts/test.sh runs it under ThreadSanitizer
// (build-tsan/); the gRPC tests cannot run there, as Debian's gRPC is not instrumented.
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/io/fs.h"
#include "common/io/shm.h"
#include "daemon/core/daemon.h"
#include "daemon/edge/wire.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kRanks = 2;  // tp ranks of one job, one trainer thread each
constexpr uint64_t kElements = 3000;  // 12 000 bytes: three 4 KiB checksum chunks
constexpr int64_t kSteps = 12;

// The value a trainer stores at element i of tensor t on `rank` for `step`.
float Value(int64_t step, uint32_t rank, size_t t, uint64_t i) {
  return static_cast<float>(step * 1000 + rank * 100 + t * 10) + static_cast<float>(i % 7);
}

std::vector<TensorSpec> RankSpecs(uint32_t rank) {
  TensorSpec w;
  w.name = "w";
  w.shape = {kElements};
  w.global_shape = {kElements * kRanks};
  w.box_offset = {kElements * rank};
  TensorSpec m = w;
  m.name = "w.exp_avg";
  m.kind = TensorKind::kOptimizer;
  return {w, m};
}

// What a trainer process holds: its session, the registered placements and the mapped segment.
struct Trainer {
  std::string session;
  v1::RegisterResponse reg;
  std::unique_ptr<SharedSegment> shm;

  char* Slot(uint32_t slot) const { return shm->data() + reg.slot_offset() + reg.slot_stride() * slot; }
  float* Tensor(uint32_t slot, const std::string& name) const {
    for (const auto& p : reg.placements()) {
      if (p.name() == name) return reinterpret_cast<float*>(Slot(slot) + p.slot_offset());
    }
    return nullptr;
  }
};

class DaemonThreadsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = "/tmp/flashckpt-threads-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    job_ = "threads-" + std::to_string(::getpid());
    DaemonConfig c;
    c.root = dir_ + "/root";
    c.max_host_memory = 64ull << 20;
    c.slots = 2;
    c.writer_threads = 2;
    c.io_threads = 3;
    c.ema_threads = 3;
    c.restore_threads = 3;
    c.checksum_chunk = 4096;
    daemon_ = std::make_unique<Daemon>(c);
    ASSERT_OK(daemon_->Start());
  }
  void TearDown() override {
    if (daemon_) daemon_->Stop();
    daemon_.reset();
    // The daemon leaves EMA segments for its successor.
    UnlinkEmaSegments(job_);
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  Status Join(uint32_t rank, Trainer* t, const std::string& job = "", const std::string& run_id = "") {
    ASSIGN_OR_RETURN(t->session, daemon_->OpenSession(job.empty() ? job_ : job, rank));
    // RankSpecs(rank) as the request a client sends: tp across kRanks, EMA with decay 0.5.
    v1::RegisterRequest req;
    auto* topology = req.mutable_topology();
    topology->set_world_size(kRanks);
    topology->set_tp_degree(kRanks);
    topology->set_tp_rank(rank);
    topology->set_pp_degree(1);
    topology->set_shard_degree(1);
    for (const TensorSpec& spec : RankSpecs(rank)) {
      v1::TensorSpec* p = req.add_tensors();
      p->set_name(spec.name);
      p->set_kind(spec.kind == TensorKind::kModel ? v1::TENSOR_KIND_MODEL : v1::TENSOR_KIND_OPTIMIZER);
      p->set_dtype("F32");
      for (auto d : spec.shape) p->add_shape(d);
      for (auto d : spec.global_shape) p->add_global_shape(d);
      for (auto d : spec.box_offset) p->add_box_offset(d);
    }
    req.set_run_id(run_id);
    req.mutable_ema()->set_enabled(true);
    req.mutable_ema()->set_decay(0.5);
    req.mutable_ema()->set_interval(1);
    ASSIGN_OR_RETURN(Registration registration, ParseRegistration(req));
    ASSIGN_OR_RETURN(RegisterReply reply, daemon_->Register(t->session, registration));
    t->reg = ToProto(reply);  // the placements as a trainer receives them
    ASSIGN_OR_RETURN(t->shm, SharedSegment::Open(t->reg.segment_name(), t->reg.segment_bytes()));
    return Status::OK();
  }

  // Saves steps 1..kSteps, every other one EMA-only (persist=false), waiting for some of them.
  Status Train(uint32_t rank, Trainer* t) {
    for (int64_t step = 1; step <= kSteps; ++step) {
      ASSIGN_OR_RETURN(SlotTicket ticket, daemon_->BeginSnapshot(t->session, step, 20s));
      const char* names[] = {"w", "w.exp_avg"};
      for (size_t k = 0; k < 2; ++k) {
        float* dst = t->Tensor(ticket.slot, names[k]);
        if (dst == nullptr) return Internal(std::string("no placement for ") + names[k]);
        for (uint64_t i = 0; i < kElements; ++i) dst[i] = Value(step, rank, k, i);
      }
      const bool persist = step % 2 == 0;
      RETURN_IF_ERROR(daemon_->Commit(t->session, ticket, step, persist, 1.0, "{\"step\":" + std::to_string(step) + "}"));
      if (persist && step % 4 == 0) RETURN_IF_ERROR(daemon_->WaitPersisted(t->session, step, 20s).status());
    }
    return daemon_->WaitPersisted(t->session, kSteps, 20s).status();
  }

  // Restores the latest checkpoint and checks every element, then takes a copy of the EMA.
  Status RestoreAndReadEma(uint32_t rank, Trainer* t) {
    ASSIGN_OR_RETURN(RestoreOutcome restored, daemon_->Restore(t->session, 0, RestoreWant{}, 20s));
    if (!restored.found || restored.step != kSteps) return Internal("restore did not find the last step");
    const char* names[] = {"w", "w.exp_avg"};
    for (size_t k = 0; k < 2; ++k) {
      const float* src = t->Tensor(restored.ticket.slot, names[k]);
      for (uint64_t i = 0; i < kElements; ++i) {
        if (src[i] != Value(kSteps, rank, k, i)) {
          return Internal(std::string(names[k]) + "[" + std::to_string(i) + "] restored wrong");
        }
      }
    }
    RETURN_IF_ERROR(daemon_->ReleaseSlot(t->session, restored.ticket));
    ASSIGN_OR_RETURN(EmaCopy copy, daemon_->GetEma(t->session, 20s));
    if (!copy.initialized || copy.step != kSteps) return Internal("the EMA copy is not of the last step");
    return daemon_->ReleaseSlot(t->session, copy.ticket);
  }

  std::string dir_;
  std::string job_;
  std::unique_ptr<Daemon> daemon_;
};

TEST_F(DaemonThreadsTest, RanksSaveRestoreAndReadTheEmaConcurrentlyWhileStatusIsPolled) {
  std::vector<Trainer> trainers(kRanks);
  std::vector<Status> results(kRanks);
  std::atomic<bool> done{false};
  std::thread observer([&] {
    while (!done.load()) {
      DaemonStatus status = daemon_->GetStatus();
      (void)status;
      (void)daemon_->List(job_);
      std::this_thread::sleep_for(1ms);
    }
  });
  {
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        results[r] = Join(r, &trainers[r]);
        if (results[r].ok()) results[r] = Train(r, &trainers[r]);
      });
    }
    for (auto& t : threads) t.join();
  }
  for (uint32_t r = 0; r < kRanks; ++r) ASSERT_OK(results[r]);
  EXPECT_TRUE(PathExists(dir_ + "/root/" + job_ + "/checkpoint-" + std::to_string(kSteps) + "/metadata.json"));
  {
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] { results[r] = RestoreAndReadEma(r, &trainers[r]); });
    }
    for (auto& t : threads) t.join();
  }
  done = true;
  observer.join();
  for (uint32_t r = 0; r < kRanks; ++r) EXPECT_OK(results[r]);
}

// Ranks of one job launched together with no run id register at the same moment, each while the
// others make their segments (mu_ let go): they always end in one run. Ranks naming two runs at once
// are not both accepted: one run is refused, and its error names both.
TEST_F(DaemonThreadsTest, RanksRegisteringAtOnceWithoutARunIdShareOneRunAndTwoNamedRunsAreRefused) {
  constexpr int kLaunches = 30;
  for (int launch = 0; launch < kLaunches; ++launch) {
    const std::string job = job_ + "-l" + std::to_string(launch);
    std::vector<Trainer> trainers(kRanks);
    std::vector<Status> results(kRanks);
    std::atomic<uint32_t> ready{0};
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        ready.fetch_add(1);
        while (ready.load() < kRanks) {
        }
        results[r] = Join(r, &trainers[r], job);
      });
    }
    for (auto& t : threads) t.join();
    for (uint32_t r = 0; r < kRanks; ++r) ASSERT_TRUE(results[r].ok()) << "launch " << launch << ": " << results[r].ToString();
    for (uint32_t r = 1; r < kRanks; ++r) {
      ASSERT_EQ(trainers[r].reg.run_id(), trainers[0].reg.run_id()) << "launch " << launch << ": two runs";
    }
    for (uint32_t r = 0; r < kRanks; ++r) daemon_->CloseSession(trainers[r].session);
    UnlinkEmaSegments(job);
  }
  // Two named runs at once: rank 0 in run A, rank 1 in run B.
  const std::string job = job_ + "-two";
  std::vector<Trainer> trainers(kRanks);
  std::vector<Status> results(kRanks);
  std::atomic<uint32_t> ready{0};
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      ready.fetch_add(1);
      while (ready.load() < kRanks) {
      }
      results[r] = Join(r, &trainers[r], job, r == 0 ? "run-A" : "run-B");
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_NE(results[0].ok(), results[1].ok()) << results[0].ToString() << " / " << results[1].ToString();
  const Status& refused = results[0].ok() ? results[1] : results[0];
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
  EXPECT_NE(refused.message().find("run-A"), std::string::npos) << refused.ToString();
  EXPECT_NE(refused.message().find("run-B"), std::string::npos) << refused.ToString();
  for (uint32_t r = 0; r < kRanks; ++r) {
    if (!trainers[r].session.empty()) daemon_->CloseSession(trainers[r].session);
  }
  UnlinkEmaSegments(job);
}

// A trainer that dies with a slot FILLING while its other snapshots are written: the session ends
// from another thread (the gRPC stream breaking) and the daemon frees what it can.
TEST_F(DaemonThreadsTest, ASessionClosedWhileItsSnapshotsAreWrittenGivesItsSlotsBack) {
  Trainer t;
  ASSERT_OK(Join(0, &t));
  auto first = daemon_->BeginSnapshot(t.session, 1, 20s);
  ASSERT_OK(first.status());
  ASSERT_OK(daemon_->Commit(t.session, *first, 1, true, 1.0, ""));
  auto filling = daemon_->BeginSnapshot(t.session, 2, 20s);
  ASSERT_OK(filling.status());
  std::thread closer([&] { daemon_->CloseSession(t.session); });
  Status late = daemon_->Commit(t.session, *filling, 2, true, 1.0, "");
  closer.join();
  (void)late;  // ok or refused, depending on which thread was first; the slot is not lost either way
  Trainer again;
  ASSERT_OK(Join(0, &again));
  for (int64_t step = 3; step <= 6; ++step) {
    auto ticket = daemon_->BeginSnapshot(again.session, step, 20s);
    ASSERT_OK(ticket.status());
    ASSERT_OK(daemon_->Commit(again.session, *ticket, step, true, 1.0, ""));
  }
  ASSERT_OK(daemon_->WaitPersisted(again.session, 6, 20s).status());
}

// A job released (idle for --idle-release, or by an operator) while its trainer keeps coming back:
// each return either finds the job held or registers afresh, never a segment half released, and
// once the trainer is gone for good the job's memory comes back.
TEST_F(DaemonThreadsTest, AJobIsReleasedWhileItsTrainerComesAndGoes) {
  daemon_->Stop();
  DaemonConfig c = daemon_->config();
  c.idle_release = 1s;
  daemon_ = std::make_unique<Daemon>(c);
  ASSERT_OK(daemon_->Start());
  std::atomic<bool> done{false};
  Status trainer_status, operator_status;
  std::thread trainer([&] {
    for (int round = 0; round < 12 && trainer_status.ok(); ++round) {
      Trainer t;
      trainer_status = Join(0, &t);
      if (!trainer_status.ok()) break;
      auto ticket = daemon_->BeginSnapshot(t.session, round + 1, 20s);
      trainer_status = ticket.status();
      if (!trainer_status.ok()) break;
      trainer_status = daemon_->Commit(t.session, *ticket, round + 1, /*persist=*/false, 1.0, "");
      daemon_->CloseSession(t.session);
      std::this_thread::sleep_for(std::chrono::milliseconds(round % 3 == 0 ? 1300 : 50));
    }
    done = true;
  });
  std::thread operator_thread([&] {
    while (!done.load() && operator_status.ok()) {
      auto released = daemon_->ReleaseJob(job_);
      const StatusCode code = released.status().code();
      if (!released.ok() && code != StatusCode::kNotFound && code != StatusCode::kFailedPrecondition) {
        operator_status = released.status();
      }
      (void)daemon_->GetStatus();
      std::this_thread::sleep_for(7ms);
    }
  });
  trainer.join();
  operator_thread.join();
  EXPECT_OK(trainer_status);
  EXPECT_OK(operator_status);
  for (auto deadline = std::chrono::steady_clock::now() + 10s;
       daemon_->GetStatus().host_memory_used != 0 && std::chrono::steady_clock::now() < deadline;) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(daemon_->GetStatus().host_memory_used, 0u);
  EXPECT_TRUE(daemon_->GetStatus().jobs.empty());
}

}  // namespace
}  // namespace flashckpt

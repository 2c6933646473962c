// EMA: the kernels against a scalar reference, which tensors are covered, bad options, and the
// daemon path (GetEma after EMA-only snapshots, adoption by a restarted daemon) over real gRPC.
#include "daemon/pipeline/ema.h"

#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "daemon/edge/server.h"
#include "flashckpt/client.h"
#include "in_process_daemon.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;

uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);  // truncation: exact for the values used below
}

TEST(EmaKernel, AverageCopyAndScaledCopyMatchTheScalarFormula) {
  const size_t n = 1003;  // not a multiple of any vector width
  std::vector<float> x(n), e(n), out(n), ref(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 97) * 0.25f - 3.0f;
  const float d = 0.99f, w = 1.0f - d;

  EmaKernel(nullptr, e.data(), x.data(), DType::kF32, n, d, EmaStep::kCopy, nullptr);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(e[i], x[i]);

  EmaKernel(nullptr, e.data(), x.data(), DType::kF32, n, d, EmaStep::kScaledCopy, nullptr);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(e[i], w * x[i]);

  for (size_t i = 0; i < n; ++i) ref[i] = e[i];
  std::vector<float> x2(n);
  for (size_t i = 0; i < n; ++i) x2[i] = static_cast<float>(i % 13);
  EmaKernel(ref.data(), e.data(), x2.data(), DType::kF32, n, d, EmaStep::kAverage, out.data());
  for (size_t i = 0; i < n; ++i) {
    float want = d * ref[i] + w * x2[i];
    ASSERT_EQ(e[i], want) << i;
    ASSERT_EQ(out[i], want) << "copy_out must hold the same result " << i;
  }
}

TEST(EmaKernel, UpcastsBf16AndF16) {
  const float values[] = {0.0f, 1.0f, -2.5f, 0.15625f, 1024.0f, -0.0078125f};
  const uint16_t f16[] = {0x0000, 0x3c00, 0xc100, 0x3100, 0x6400, 0xa000};
  std::vector<uint16_t> bf16;
  for (float v : values) bf16.push_back(ToBf16(v));
  std::vector<float> e(6);
  EmaKernel(nullptr, e.data(), bf16.data(), DType::kBF16, 6, 0.5f, EmaStep::kCopy, nullptr);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(e[i], values[i]) << "bf16 " << i;
  EmaKernel(nullptr, e.data(), f16, DType::kF16, 6, 0.5f, EmaStep::kCopy, nullptr);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(e[i], values[i]) << "f16 " << i;
  const uint16_t subnormal = 0x0001;  // 2^-24
  EmaKernel(nullptr, e.data(), &subnormal, DType::kF16, 1, 0.5f, EmaStep::kCopy, nullptr);
  EXPECT_EQ(e[0], std::ldexp(1.0f, -24));
}

TensorSpec Spec(const std::string& name, TensorKind kind, DType dtype, uint64_t n) {
  TensorSpec t;
  t.name = name;
  t.kind = kind;
  t.dtype = dtype;
  t.shape = {n};
  return t;
}

EmaConfig On(double decay = 0.9) {
  EmaConfig c;
  c.enabled = true;
  c.decay = decay;
  return c;
}

TEST(PlanEma, CoversMasterWeightsAndFp32ModelsWithoutOne) {
  auto master = Spec("fp32.layer0", TensorKind::kMasterWeight, DType::kF32, 8);
  master.param = "layer0";
  std::vector<TensorSpec> specs = {Spec("layer0", TensorKind::kModel, DType::kBF16, 8), master,
                                   Spec("norm", TensorKind::kModel, DType::kF32, 4),
                                   Spec("emb", TensorKind::kModel, DType::kBF16, 4),
                                   Spec("layer0.exp_avg", TensorKind::kOptimizer, DType::kF32, 8)};
  auto layout = BuildRankLayout("job", 0, Topology{}, specs);
  ASSERT_OK(layout.status());
  auto plan = PlanEma(*layout, On());
  ASSERT_OK(plan.status());
  std::vector<std::string> names;
  for (const auto& t : plan->layout.tensors) names.push_back(t.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"layer0", "norm"}));  // emb is bf16: needs model_params=all
  ASSERT_EQ(plan->layout.files.size(), 1u);
  EXPECT_EQ(plan->layout.files[0].stem, "ema.tp00_pp00_shard00");
  for (const auto& t : plan->layout.tensors) EXPECT_EQ(t.dtype, DType::kF32);

  EmaConfig all = On();
  all.all_float_params = true;
  auto plan_all = PlanEma(*layout, all);
  ASSERT_OK(plan_all.status());
  EXPECT_EQ(plan_all->layout.tensors.size(), 3u);
}

TEST(PlanEma, ReplicasAreLeftToTheRankThatPersistsThem) {
  auto w = Spec("w", TensorKind::kModel, DType::kF32, 8);
  w.replica = true;
  auto layout = BuildRankLayout("job", 0, Topology{}, {w, Spec("w.exp_avg", TensorKind::kOptimizer, DType::kF32, 8)});
  ASSERT_OK(layout.status());
  auto plan = PlanEma(*layout, On());
  ASSERT_OK(plan.status());
  EXPECT_TRUE(plan->layout.files.empty());
}

TEST(PlanEma, BadOptionsAndNoFloatTensorsAreClearErrors) {
  auto layout = BuildRankLayout("job", 0, Topology{}, {Spec("w", TensorKind::kModel, DType::kF32, 8)});
  ASSERT_OK(layout.status());
  for (double bad : {0.0, 1.0, -0.5, 1.5, std::nan("")}) {
    Status s = PlanEma(*layout, On(bad)).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("ema_decay"), std::string::npos) << s.message();
  }
  EmaConfig zero_interval = On();
  zero_interval.interval = 0;
  EXPECT_NE(PlanEma(*layout, zero_interval).status().message().find("ema_interval"), std::string::npos);

  auto ints = BuildRankLayout("job", 0, Topology{},
                              {Spec("ids", TensorKind::kModel, DType::kI64, 8),
                               Spec("m", TensorKind::kOptimizer, DType::kF32, 8)});
  ASSERT_OK(ints.status());
  Status none = PlanEma(*ints, On()).status();
  EXPECT_EQ(none.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(none.message().find("no fp32 model or master_weight"), std::string::npos) << none.message();
}

class EmaDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    job_ = "ematest-" + std::filesystem::path(d_.dir()).filename().string();
    Start();
  }
  void TearDown() override {
    Stop();
    UnlinkEmaSegments(job_);  // the daemon leaves EMA segments for its successor
  }
  void Start() {
    ASSERT_OK(d_.Start([](DaemonConfig& c) { c.max_host_memory = 256ull << 20; }));
  }
  void Stop() { d_.Stop(); }
  std::unique_ptr<Client> Connect() { return d_.Connect(job_); }

  InProcessDaemon d_{"flashckpt-ema-test"};
  std::string job_;
};

TEST_F(EmaDaemonTest, BadEmaOptionsAreRefusedAtRegistration) {
  auto c = Connect();
  ASSERT_TRUE(c);
  std::vector<TensorSpec> specs = {Spec("w", TensorKind::kModel, DType::kF32, 16)};
  EmaOptions decay_one;
  decay_one.decay = 1.0;
  Status s = c->Register(Topology{}, specs, decay_one);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EmaOptions interval_zero;
  interval_zero.decay = 0.9;
  interval_zero.interval = 0;
  EXPECT_EQ(c->Register(Topology{}, specs, interval_zero).code(), StatusCode::kInvalidArgument);
  EmaOptions ok;
  ok.decay = 0.9;
  EXPECT_EQ(c->Register(Topology{}, {Spec("ids", TensorKind::kModel, DType::kI32, 16)}, ok).code(),
            StatusCode::kInvalidArgument);
  ASSERT_OK(c->Register(Topology{}, specs, ok));
}

TEST_F(EmaDaemonTest, EmaOnlySnapshotsUpdateAndARestartedDaemonAdoptsTheEma) {
  const size_t n = 4096;
  std::vector<TensorSpec> specs = {Spec("w", TensorKind::kModel, DType::kF32, n)};
  EmaOptions ema;
  ema.decay = 0.75;
  ema.loss_threshold = 5.0;
  std::vector<float> w(n), want(n), got(n);
  const float d = 0.75f, k = 1.0f - d;
  auto fill = [&](int64_t step) {
    for (size_t i = 0; i < n; ++i) w[i] = static_cast<float>(i % 31) + static_cast<float>(step);
  };
  auto expect = [&](int64_t step, bool first) {
    for (size_t i = 0; i < n; ++i) {
      float x = static_cast<float>(i % 31) + static_cast<float>(step);
      want[i] = first ? x : d * want[i] + k * x;
    }
  };
  {
    auto c = Connect();
    ASSERT_TRUE(c);
    ASSERT_OK(c->Register(Topology{}, specs, ema));
    EXPECT_EQ(c->EmaTensorNames(), std::vector<std::string>{"w"});
    for (int64_t step = 1; step <= 4; ++step) {
      fill(step);
      SnapshotOptions so;
      so.persist = false;
      so.loss = step == 3 ? 9.0 : 1.0;  // step 3 is gated
      ASSERT_OK(c->Snapshot(step, {{"w", w.data(), n * 4}}, so).status());
      if (step != 3) expect(step, step == 1);
    }
    auto r = c->Ema({{"w", got.data(), n * 4}}, 5s);
    ASSERT_OK(r.status());
    EXPECT_TRUE(r->initialized);
    EXPECT_EQ(r->step, 4);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], want[i]) << i;
    auto st = d_.daemon()->GetStatus();
    EXPECT_EQ(st.jobs[0].ranks[0].ema_updates_applied, 3u);
    EXPECT_EQ(st.jobs[0].ranks[0].ema_updates_skipped, 1u);
  }
  Stop();
  Start();
  auto c = Connect();
  ASSERT_TRUE(c);
  ASSERT_OK(c->Register(Topology{}, specs, ema));
  fill(5);
  ASSERT_OK(c->Snapshot(5, {{"w", w.data(), n * 4}}, {}).status());
  expect(5, false);
  ASSERT_OK(c->WaitPersisted(5, 10s));
  std::fill(got.begin(), got.end(), 0.f);
  auto r = c->Ema({{"w", got.data(), n * 4}}, 5s);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 5);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], want[i]) << i;
  // The persisted checkpoint carries the same EMA.
  EXPECT_TRUE(std::filesystem::exists(d_.dir() + "/root/" + job_ + "/checkpoint-5/ema.tp00_pp00_shard00.safetensors"));
}

TEST_F(EmaDaemonTest, AnEmaOnlySnapshotCopiesOnlyWhatTheEmaReads) {
  const size_t n = 256;
  std::vector<TensorSpec> specs = {Spec("w", TensorKind::kModel, DType::kF32, n),
                                   Spec("w.exp_avg", TensorKind::kOptimizer, DType::kF32, n)};
  EmaOptions ema;
  ema.decay = 0.5;
  auto c = Connect();
  ASSERT_TRUE(c);
  ASSERT_OK(c->Register(Topology{}, specs, ema));
  std::vector<float> w(n, 3.f), m(n, 1.f), got(n);
  SnapshotOptions ema_only;
  ema_only.persist = false;
  ASSERT_OK(c->Snapshot(1, {{"w", w.data(), n * 4}}, ema_only).status());  // no optimizer buffer needed
  auto r = c->Ema({{"w", got.data(), n * 4}}, 5s);
  ASSERT_OK(r.status());
  EXPECT_EQ(got[0], 3.f);
  // A persisted snapshot still needs every saved tensor.
  auto missing = c->Snapshot(2, {{"w", w.data(), n * 4}}, {});
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("w.exp_avg"), std::string::npos) << missing.status().message();
  ASSERT_OK(c->Snapshot(3, {{"w", w.data(), n * 4}, {"w.exp_avg", m.data(), n * 4}}, {}).status());
}

TEST_F(EmaDaemonTest, ANewRunOfTheJobStartsAFreshEmaInsteadOfAdoptingAStaleOne) {
  const size_t n = 1024;
  std::vector<TensorSpec> specs = {Spec("w", TensorKind::kModel, DType::kF32, n)};
  EmaOptions ema;
  ema.decay = 0.5;
  std::vector<float> w(n), got(n);
  auto snapshot = [&](Client& c, int64_t step, float value) {
    std::fill(w.begin(), w.end(), value);
    SnapshotOptions so;
    so.persist = false;
    ASSERT_OK(c.Snapshot(step, {{"w", w.data(), n * 4}}, so).status());
  };
  {
    auto c = Connect();
    ASSERT_TRUE(c);
    ASSERT_OK(c->Register(Topology{}, specs, ema));
    for (int64_t step = 1; step <= 3; ++step) snapshot(*c, step, 100.f * static_cast<float>(step));
    ASSERT_OK(c->Ema({{"w", got.data(), n * 4}}, 5s).status());
    EXPECT_EQ(got[0], 0.5f * (0.5f * 100.f + 0.5f * 200.f) + 0.5f * 300.f);
  }
  auto c = Connect();  // the job starts again from step 1 without restoring
  ASSERT_TRUE(c);
  ASSERT_OK(c->Register(Topology{}, specs, ema));
  snapshot(*c, 1, 7.f);
  auto r = c->Ema({{"w", got.data(), n * 4}}, 5s);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 1);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], 7.f) << "the first update of the new run copies the weights";
  EXPECT_EQ(d_.daemon()->GetStatus().jobs[0].ranks[0].ema_updates_applied, 1u);
}

}  // namespace
}  // namespace flashckpt

// The CUDA path of the client against a real daemon in this process: snapshots taken from device
// memory, restores into it, the copy's ordering against the caller's compute stream, and device
// memory refused cleanly where it cannot be copied. The tests that need a device skip without one.
#include <chrono>
#include <cstring>
#include <vector>

#include "../daemon/in_process_daemon.h"
#include "common/base/cuda_info.h"
#include "flashckpt/client.h"
#include "testing.h"

#if FLASHCKPT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels.h"
#endif

namespace flashckpt {
namespace {

using namespace std::chrono_literals;

// Refused before a slot is taken: a device buffer in a build without CUDA or a process without a
// device. Runs wherever there is no usable device (a build without CUDA, or CUDA with no GPU).
TEST(DeviceMemory, RefusedCleanlyWithoutCudaOrDevice) {
  const CudaInfo& cuda = GetCudaInfo();
  if (cuda.compiled && cuda.devices > 0) GTEST_SKIP() << "a CUDA device is present: " << CudaInfoText(cuda);
  InProcessDaemon d("fc-gpu");
  ASSERT_OK(d.Start());
  auto c = d.Connect("job");
  ASSERT_NE(c, nullptr);
  ASSERT_OK(c->Register(Topology{}, ModelAndMomentSpecs(1024)));
  std::vector<float> w(1024, 1.5f), m(1024, 2.5f);
  std::vector<TensorBuffer> bufs = {{"w", w.data(), w.size() * 4, /*on_device=*/true},
                                    {"w.exp_avg", m.data(), m.size() * 4}};
  // More refusals than slots: none of them may hold a slot.
  for (int64_t step = 1; step <= 3; ++step) {
    auto snap = c->Snapshot(step, bufs, {});
    ASSERT_FALSE(snap.ok());
    EXPECT_EQ(snap.status().code(), StatusCode::kFailedPrecondition) << snap.status().ToString();
    const std::string& why = snap.status().message();
    EXPECT_NE(why.find("tensor 'w'"), std::string::npos) << why;
    if (cuda.compiled) {
      EXPECT_NE(why.find("no usable CUDA device"), std::string::npos) << why;
      EXPECT_NE(why.find("cudaGetDeviceCount"), std::string::npos) << why;
    } else {
      EXPECT_NE(why.find("built without CUDA"), std::string::npos) << why;
    }
  }
  auto restored = c->Restore(std::nullopt, bufs, 5s);
  ASSERT_FALSE(restored.ok());
  EXPECT_EQ(restored.status().code(), StatusCode::kFailedPrecondition);

  // The same memory as host memory is saved and restored as before.
  bufs[0].on_device = false;
  auto snap = c->Snapshot(4, bufs, {});
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  ASSERT_OK(snap->WaitCopied());
  ASSERT_OK(snap->WaitCommitted());
  ASSERT_OK(c->WaitPersisted(4, 10s));
  std::vector<float> w2(1024, 0.f), m2(1024, 0.f);
  auto r = c->Restore(std::nullopt, {{"w", w2.data(), w2.size() * 4}, {"w.exp_avg", m2.data(), m2.size() * 4}}, 10s);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->step, 4);
  EXPECT_EQ(w2, w);
  EXPECT_EQ(m2, m);
}

#if FLASHCKPT_HAVE_CUDA

// Three tensors of odd sizes in both files: a weight, its optimizer moment and a small bias.
std::vector<TensorSpec> ThreeTensors() {
  auto specs = ModelAndMomentSpecs(1u << 20);
  TensorSpec bias;
  bias.name = "bias";
  bias.shape = {257};
  specs.push_back(bias);
  return specs;
}

uint64_t Elements(const TensorSpec& s) {
  uint64_t n = 1;
  for (auto d : s.shape) n *= d;
  return n;
}

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

// A daemon, a registered client, device buffers for ThreeTensors() and a compute stream.
class DeviceSnapshot : public ::testing::Test {
 protected:
  void SetUp() override {
    const CudaInfo& cuda = GetCudaInfo();
    if (cuda.devices == 0) GTEST_SKIP() << "no CUDA device: " << CudaInfoText(cuda);
    ASSERT_OK(d_.Start());
    client_ = d_.Connect("job");
    ASSERT_NE(client_, nullptr);
    specs_ = ThreeTensors();
    ASSERT_OK(client_->Register(Topology{}, specs_));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (const auto& s : specs_) {
      void* p = nullptr;
      ASSERT_CUDA(cudaMalloc(&p, Elements(s) * 4));
      device_.push_back(static_cast<uint32_t*>(p));
    }
  }
  void TearDown() override {
    client_.reset();
    for (auto* p : device_) (void)cudaFree(p);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  // Fills every tensor with the pattern `seed` on the compute stream, after `spin_ms` of spinning.
  void Fill(uint32_t seed, int spin_ms = 0) {
    long long spin = spin_ms * testing::CyclesPerMs();
    for (size_t i = 0; i < specs_.size(); ++i) {
      ASSERT_CUDA(testing::FillPattern(device_[i], Elements(specs_[i]), seed + static_cast<uint32_t>(i),
                                       i == 0 ? spin : 0, stream_));
    }
  }
  std::vector<TensorBuffer> DeviceBuffers() const {
    std::vector<TensorBuffer> out;
    for (size_t i = 0; i < specs_.size(); ++i) out.push_back({specs_[i].name, device_[i], Elements(specs_[i]) * 4});
    return out;
  }
  // The persisted `step`, restored into host memory, equals the pattern `seed`.
  void ExpectSaved(int64_t step, uint32_t seed) {
    std::vector<std::vector<uint32_t>> host;
    std::vector<TensorBuffer> bufs;
    for (const auto& s : specs_) host.emplace_back(Elements(s), 0u);
    for (size_t i = 0; i < specs_.size(); ++i) bufs.push_back({specs_[i].name, host[i].data(), host[i].size() * 4});
    auto r = client_->Restore(step, bufs, 10s);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_TRUE(r->found);
    for (size_t i = 0; i < specs_.size(); ++i) {
      for (uint64_t k = 0; k < host[i].size(); ++k) {
        ASSERT_EQ(host[i][k], testing::PatternWord(k, seed + static_cast<uint32_t>(i)))
            << specs_[i].name << "[" << k << "] of step " << step;
      }
    }
  }
  SnapshotOptions OnStream() const {
    SnapshotOptions o;
    o.cuda_stream = stream_;
    return o;
  }

  InProcessDaemon d_{"fc-gpu"};
  std::unique_ptr<Client> client_;
  std::vector<TensorSpec> specs_;
  std::vector<uint32_t*> device_;
  cudaStream_t stream_ = nullptr;
};

TEST_F(DeviceSnapshot, SavesSeveralTensorsFromDeviceMemory) {
  Fill(100);
  auto snap = client_->Snapshot(1, DeviceBuffers(), OnStream());
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  ASSERT_OK(snap->WaitCopied());
  ASSERT_OK(snap->WaitCommitted());
  ASSERT_OK(client_->WaitPersisted(1, 10s));
  ExpectSaved(1, 100);
}

TEST_F(DeviceSnapshot, RestoresBitExactIntoDeviceMemory) {
  Fill(200);
  auto snap = client_->Snapshot(1, DeviceBuffers(), OnStream());
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  ASSERT_OK(snap->WaitCommitted());
  ASSERT_OK(client_->WaitPersisted(1, 10s));
  for (size_t i = 0; i < specs_.size(); ++i)
    ASSERT_CUDA(cudaMemsetAsync(device_[i], 0, Elements(specs_[i]) * 4, stream_));
  RestoreOptions ro;
  ro.cuda_stream = stream_;
  auto r = client_->Restore(std::nullopt, DeviceBuffers(), 10s, ro);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->step, 1);
  // Work queued on the stream after Restore() sees the restored bytes.
  for (size_t i = 0; i < specs_.size(); ++i) {
    std::vector<uint32_t> host(Elements(specs_[i]));
    ASSERT_CUDA(cudaMemcpyAsync(host.data(), device_[i], host.size() * 4, cudaMemcpyDeviceToHost, stream_));
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
    for (uint64_t k = 0; k < host.size(); ++k) {
      ASSERT_EQ(host[k], testing::PatternWord(k, 200 + static_cast<uint32_t>(i))) << specs_[i].name << "[" << k << "]";
    }
  }
}

// The copy waits for the work queued before the call (the fill behind a 200 ms spin) but not for
// the work queued after it: it finishes while a long kernel still runs on the compute stream.
TEST_F(DeviceSnapshot, CopyOverlapsAKernelStillRunningOnTheComputeStream) {
  Fill(300, /*spin_ms=*/200);
  auto snap = client_->Snapshot(1, DeviceBuffers(), OnStream());
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  ASSERT_CUDA(testing::Spin(3000 * testing::CyclesPerMs(), stream_));  // 3 s of "compute"
  auto start = std::chrono::steady_clock::now();
  ASSERT_OK(snap->WaitCopied());
  auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(cudaStreamQuery(stream_), cudaErrorNotReady) << "the compute kernel ended before the copy did";
  EXPECT_LT(waited, 2500ms);
  ASSERT_OK(snap->WaitCommitted());
  ASSERT_OK(client_->WaitPersisted(1, 10s));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  ExpectSaved(1, 300);
}

// What WaitCopied() promises the optimizer: a kernel that overwrites the weights after it returns
// does not reach the snapshot, and one queued before the call (still pending) does.
TEST_F(DeviceSnapshot, KernelAfterWaitCopiedDoesNotChangeTheSnapshot) {
  Fill(400);
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  Fill(500, /*spin_ms=*/100);  // still pending when Snapshot() is called
  auto snap = client_->Snapshot(1, DeviceBuffers(), OnStream());
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  ASSERT_OK(snap->WaitCopied());
  Fill(600);  // the "optimizer step"
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  ASSERT_OK(snap->WaitCommitted());
  ASSERT_OK(client_->WaitPersisted(1, 10s));
  ExpectSaved(1, 500);
}

// A snapshot of device tensors only takes its slot on the commit thread: Snapshot() returns at
// once, and the daemon's refusal (a step that does not follow the session's last one) is the
// handle's commit answer; the tensors are free at once, and the client goes on with the next step.
TEST_F(DeviceSnapshot, ARefusedDeviceOnlySnapshotAnswersThroughItsHandle) {
  Fill(700);
  auto first = client_->Snapshot(1, DeviceBuffers(), OnStream());
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_OK(first->WaitCommitted());
  auto again = client_->Snapshot(1, DeviceBuffers(), OnStream());
  ASSERT_TRUE(again.ok()) << "the refusal came from Snapshot() itself: " << again.status().ToString();
  ASSERT_OK(again->WaitCopied());
  const Status refused = again->WaitCommitted();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  EXPECT_NE(refused.message().find("steps must increase"), std::string::npos) << refused.ToString();
  Fill(800);
  auto next = client_->Snapshot(2, DeviceBuffers(), OnStream());
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  ASSERT_OK(next->WaitCopied());
  ASSERT_OK(next->WaitCommitted());
  ASSERT_OK(client_->WaitPersisted(2, 10s));
  ExpectSaved(2, 800);
}

// With a host tensor among the device ones the slot is taken on the caller's thread (the host
// bytes are copied before Snapshot() returns): a refusal (the same step again) is Snapshot()'s own
// error, and a mixed snapshot saves both kinds of memory.
TEST_F(DeviceSnapshot, AMixedSnapshotTakesItsSlotOnTheCallersThread) {
  Fill(900);
  auto bufs = DeviceBuffers();
  std::vector<uint32_t> host(Elements(specs_[2]));
  for (uint64_t k = 0; k < host.size(); ++k) host[k] = testing::PatternWord(k, 900 + 2);
  bufs[2] = {specs_[2].name, host.data(), host.size() * 4};
  auto snap = client_->Snapshot(1, bufs, OnStream());
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  ASSERT_OK(snap->WaitCopied());
  ASSERT_OK(snap->WaitCommitted());
  ASSERT_OK(client_->WaitComplete(1, 10s));
  ExpectSaved(1, 900);
  auto again = client_->Snapshot(1, bufs, OnStream());
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument) << again.status().ToString();
  EXPECT_NE(again.status().message().find("steps must increase"), std::string::npos) << again.status().ToString();
}

// A host pointer marked as device memory is refused where a device exists too.
TEST_F(DeviceSnapshot, HostMemoryMarkedAsDeviceIsRefused) {
  auto bufs = DeviceBuffers();
  std::vector<uint32_t> host(Elements(specs_[2]));
  bufs[2] = {specs_[2].name, host.data(), host.size() * 4, /*on_device=*/true};
  auto snap = client_->Snapshot(1, bufs, OnStream());
  ASSERT_FALSE(snap.ok());
  EXPECT_EQ(snap.status().code(), StatusCode::kInvalidArgument) << snap.status().ToString();
}

#endif  // FLASHCKPT_HAVE_CUDA

}  // namespace
}  // namespace flashckpt

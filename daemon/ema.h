// The fp32 exponential moving average of a rank's weights, kept by the daemon.
//
// Which tensors: every master_weight tensor (named after the parameter it is the master copy of),
// plus model tensors without a master weight that are fp32 (or bf16/fp16 with
// model_params = all). Replicas are covered by the rank that persists them.
//
// Where: a daemon-owned shared-memory segment per rank, "flashckpt.<job>.<rank>.ema", laid out as
// [header page][ema.tpXX_ppYY_shardZZ safetensors image]. It outlives the daemon process, so a
// restarted daemon adopts it and the average carries on. Each slot of the rank's segment also has
// room for one EMA image: a persisted snapshot gets the EMA as of its step written there in the same
// pass as the update, and the writer persists it straight from the slot.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/layout.h"
#include "common/shm.h"
#include "common/status.h"
#include "common/thread_pool.h"

namespace flashckpt {

struct EmaConfig {
  bool enabled = false;
  double decay = 0.0;         // 0 < decay < 1
  uint32_t interval = 1;      // update on steps that are a multiple of it
  bool init_zeros = false;    // false: the first update copies the weights
  bool all_float_params = false;  // also bf16/fp16 model tensors (upcast)
  std::optional<double> loss_threshold;  // skip the update when the snapshot's loss is above it
};

Status ValidateEmaConfig(const EmaConfig& config);
std::string EmaInitName(const EmaConfig& config);

// The EMA tensors of a rank and the layout of their image.
struct EmaPlan {
  RankLayout layout;            // a single "ema" file image; its slot header page is the segment header
  std::vector<size_t> source;   // per EMA tensor: index of the tracked tensor in the rank layout
  uint64_t image_bytes() const { return layout.files.empty() ? 0 : layout.files[0].file_bytes(); }
};

// Fails when the config is invalid or the rank registers no floating-point model or master weight
// at all. A rank whose float tensors are all replicas gets an empty plan.
Result<EmaPlan> PlanEma(const RankLayout& rank, const EmaConfig& config);

// Header page of the EMA segment. The daemon is its only writer.
// Counters are atomics so that status readers need not take the EMA lock.
struct EmaSegmentHeader {
  char magic[8];
  uint64_t signature;  // xxh3 of the image header template: an adopted segment must match it
  std::atomic<uint64_t> initialized;
  std::atomic<uint64_t> updates_applied;
  std::atomic<uint64_t> updates_skipped;
  std::atomic<int64_t> last_step;
};

// How one update combines the average `e` with the weights `x`.
enum class EmaStep { kCopy, kScaledCopy, kAverage };

// e = x | (1-d)*x | d*e + (1-d)*x over n elements, x of dtype F32, BF16 or F16 upcast to fp32.
// With `copy_out`, the result is also stored there (the slot's EMA image) in the same pass.
void EmaKernel(float* e, const void* x, DType dtype, size_t n, float decay, EmaStep step, float* copy_out);

// One rank's EMA: the plan, its segment and counters. All methods are serialized by mu().
class RankEma {
 public:
  // Adopts "flashckpt.<job>.<rank>.ema" when it exists with the same signature, else creates it.
  static Result<std::unique_ptr<RankEma>> Open(const std::string& job, uint32_t rank, EmaPlan plan,
                                               const EmaConfig& config, unsigned mode);
  ~RankEma();

  const EmaPlan& plan() const { return plan_; }
  const EmaConfig& config() const { return config_; }
  std::mutex& mu() { return mu_; }
  const std::string& segment_name() const { return shm_->name(); }
  bool adopted() const { return adopted_; }
  uint64_t bytes() const { return shm_->size(); }
  EmaSegmentHeader* header() const { return reinterpret_cast<EmaSegmentHeader*>(shm_->data()); }
  // Base for the plan's offsets: the image lies at plan.layout.files[0].slot_offset from it.
  char* base() const { return shm_->data(); }

  // Applies the snapshot in `slot` (laid out by `rank`) taken at `step` with `loss`. When
  // `slot_image_base` is given (a persisted snapshot), the EMA image as of this step is also
  // written there, stamped. Returns whether an update was applied. With a loss threshold, a loss
  // above it, NaN or infinite skips the update (counted in updates_skipped).
  bool Apply(const RankLayout& rank, const char* slot, int64_t step, std::optional<double> loss,
             char* slot_image_base, ParallelLoop* loop);

  // Drops the segment's name so the next daemon does not adopt it (the job's layout changed).
  void Unlink();

 private:
  RankEma() = default;
  void Stamp(char* image_base, int64_t step, ParallelLoop* loop) const;

  struct Chunk {
    size_t tensor;
    size_t begin, count;
  };
  std::vector<Chunk> chunks_;  // the parallel work of one update, built once

  EmaPlan plan_;
  EmaConfig config_;
  std::unique_ptr<SharedSegment> shm_;
  bool adopted_ = false;
  std::mutex mu_;
};

}  // namespace flashckpt

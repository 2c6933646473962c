// The fp32 exponential moving average of a rank's weights, kept by the daemon.
//
// Which tensors: every master_weight tensor (named after the parameter it is the master copy of),
// plus model tensors without a master weight that are fp32 (or bf16/fp16 with
// model_params = all). Replicas are covered by the rank that persists them.
//
// Where: a daemon-owned shared-memory segment per rank, "flashckpt.<job>.<rank>.<scope>.ema"
// (EmaSegmentName: the scope tells the daemons of one host apart and stays the same when a daemon
// restarts), laid out as
// [header page][image 0][spare page][image 1], each image the ema.tpXX_ppYY_shardZZ safetensors file:
// two copies, so that an update interrupted by a crash never leaves a half-updated average. It
// outlives the daemon process, so a restarted daemon adopts it and the average carries on. Each slot of the rank's segment also has
// room for one EMA image: a persisted snapshot gets the EMA as of its step written there in the same
// pass as the update, and the writer persists it straight from the slot.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/base/thread_pool.h"
#include "common/format/layout.h"
#include "common/io/shm.h"

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

// "flashckpt.<job>.<rank>.<scope>.ema": the name of a rank's EMA segment. `scope` is the daemon's
// (Core::ema_scope_): two daemons on one host that serve a job of the same name keep apart.
std::string EmaSegmentName(const std::string& job, uint32_t rank, const std::string& scope);
// The name releases before the scope used: "flashckpt.<job>.<rank>.ema".
std::string UnscopedEmaSegmentName(const std::string& job, uint32_t rank);
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

// The EMA's counters. `last_seen` is the last due step that was applied or skipped by the loss
// gate: a restarted daemon replaying committed snapshots skips those (they are already counted).
struct EmaState {
  bool initialized = false;
  uint64_t updates_applied = 0;
  uint64_t updates_skipped = 0;
  int64_t last_step = -1;  // step of the last applied update
  int64_t last_seen = -1;
};

// Header page of the EMA segment. The daemon is its only writer. The segment holds two images:
// an update reads image `current` and writes the other, then publishes the other's counters and
// flips `current` with one atomic store, so a daemon killed in the middle of an update leaves the
// previous average intact (and the committed snapshot is replayed). Atomics so that status
// readers need not take the EMA lock.
struct EmaCounters {
  std::atomic<uint64_t> initialized;
  std::atomic<uint64_t> updates_applied;
  std::atomic<uint64_t> updates_skipped;
  std::atomic<int64_t> last_step;
  std::atomic<int64_t> last_seen;
};
struct EmaSegmentHeader {
  char magic[8];
  uint64_t signature;  // xxh3 of the image header template: an adopted segment must match it
  std::atomic<uint32_t> current;  // 0 or 1: the image that holds the average
  uint32_t reserved;
  EmaCounters counters[2];  // counters[i] describe image i
  // The run whose average this is (NUL-terminated; all zero in a segment made before runs had ids).
  char run_id[72];
};

// How one update combines the average `e` with the weights `x`.
enum class EmaStep { kCopy, kScaledCopy, kAverage };

// out = x | (1-d)*x | d*in + (1-d)*x over n elements, x of dtype F32, BF16 or F16 upcast to fp32.
// `in` (read only by kAverage), `out` and `copy_out` must not overlap. With `copy_out`, the result
// is also stored there (the slot's EMA image) in the same pass.
void EmaKernel(const float* in, float* out, const void* x, DType dtype, size_t n, float decay, EmaStep step,
               float* copy_out);

// One rank's EMA: the plan, its segment and counters. Thread-safe: an update, a load and a copy of
// the average exclude each other (the EMA's own lock, never handed out); the counters are read
// without it.
class RankEma {
 public:
  // Adopts EmaSegmentName(job, rank, scope) when it exists with the same signature, else creates
  // it. When the scoped one does not exist, a segment of the same signature under the name that
  // releases before the scope used, UnscopedEmaSegmentName (an upgrade), is adopted and renamed to
  // the scoped name if it is this daemon's: `recorded` (the caller knows its predecessor left it),
  // or its average belongs to `run_id` (non-empty), the run the rank registers in. Otherwise it
  // may be another daemon's and is left alone; one that is recorded but does not fit is removed.
  static Result<std::unique_ptr<RankEma>> Open(const std::string& job, uint32_t rank, const std::string& scope,
                                               EmaPlan plan, const EmaConfig& config, unsigned mode,
                                               bool recorded = false, const std::string& run_id = "");
  // Whether Open adopted a segment under the unscoped name (and renamed it).
  bool upgraded() const { return upgraded_; }
  ~RankEma();

  const EmaPlan& plan() const { return plan_; }
  const EmaConfig& config() const { return config_; }
  const std::string& segment_name() const { return shm_->name(); }
  bool adopted() const { return adopted_; }
  uint64_t bytes() const { return shm_->size(); }
  // The counters of the current average; lock-free (status).
  EmaState state() const;

  // Applies the snapshot in `slot` (laid out by `rank`) taken at `step` with `loss`. When
  // `slot_image_base` is given (a persisted snapshot), the EMA image as of this step is also
  // written there, stamped. With a loss threshold, a loss above it, NaN or infinite skips the update
  // (counted in updates_skipped). `replay`: a restarted daemon re-applies a snapshot committed
  // before the restart; a step the EMA has already seen is not applied again. Returns whether an
  // update was applied.
  bool Apply(const RankLayout& rank, const char* slot, int64_t step, std::optional<double> loss,
             char* slot_image_base, ParallelLoop* loop, bool replay = false) EXCLUDES(mu_);
  // Copies the tensor data of the current average into the image at `image_base` (the base of the
  // plan's offsets, as for Apply's slot image) and returns the counters it is as of.
  EmaState CopyAverage(char* image_base) const EXCLUDES(mu_);
  // Writes the header of the EMA image at `image_base` (the base of the plan's offsets, as for
  // Apply's slot image) as of `step` with `state`: the plan's header, then the step, the counters
  // and each tensor's checksum of the bytes there. For an image whose tensors were checked but whose
  // header came from elsewhere (a peer's replica): the header is this daemon's own again.
  void StampImage(char* image_base, int64_t step, const EmaState& state, ParallelLoop* loop) const;
  // Loads an average: `fill` writes it into the spare image at the base it is given; when it
  // succeeds, that image becomes current with `state` in one flip. A failed `fill` changes nothing.
  Status Load(const std::function<Status(char* image_base)>& fill, const EmaState& state) EXCLUDES(mu_);
  // Forgets the average (the next update starts it afresh); the image is left as it is.
  void Reset() EXCLUDES(mu_);
  // The run the average belongs to; empty for a segment made before runs had ids.
  std::string run_id() const EXCLUDES(mu_);
  // Makes the EMA `run_id`'s. An average of another run (a fresh start of a job name used before,
  // adopted by name) is forgotten first, so that run's weights never leak into this one's average;
  // a session that restores loads the checkpoint's average afterwards. Returns whether it was.
  bool StartRun(const std::string& run_id) EXCLUDES(mu_);

  // The current and the spare image, unsynchronized: for a caller that is the EMA's only user
  // (bench/ema_bench.cc times the kernels on them). The daemon goes through the methods above.
  char* UnsyncedBase() const { return ImageBase(header()->current.load(std::memory_order_acquire)); }
  char* UnsyncedSpareBase() const { return ImageBase(1 - header()->current.load(std::memory_order_acquire)); }

  // Drops the segment's name so the next daemon does not adopt it (the job's layout changed).
  void Unlink();

 private:
  RankEma() = default;
  EmaSegmentHeader* header() const { return reinterpret_cast<EmaSegmentHeader*>(shm_->data()); }
  char* ImageBase(uint32_t i) const { return shm_->data() + i * plan_.layout.slot_bytes; }
  // The current average's image and the other one; stable while mu_ is held.
  char* base() const REQUIRES(mu_) { return UnsyncedBase(); }
  char* spare_base() const REQUIRES(mu_) { return UnsyncedSpareBase(); }
  // Makes the spare image current with `state`, in one atomic flip.
  void Publish(const EmaState& state) REQUIRES(mu_);
  // Replaces the current image's counters (a reset, a skipped update) without touching the image.
  void SetState(const EmaState& state) REQUIRES(mu_);
  void Stamp(char* image_base, int64_t step, const EmaState& state, ParallelLoop* loop) const;

  struct Chunk {
    size_t tensor;
    size_t begin, count;
  };
  std::vector<Chunk> chunks_;  // the parallel work of one update, built once

  EmaPlan plan_;
  EmaConfig config_;
  std::unique_ptr<SharedSegment> shm_;
  bool adopted_ = false;
  bool upgraded_ = false;  // adopted under the unscoped name and renamed
  // Serializes what changes or reads the images: Apply, CopyAverage, Load, Reset.
  mutable Mutex mu_;
};

}  // namespace flashckpt

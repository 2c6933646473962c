#include "daemon/pipeline/ema.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/base/log.h"
#include "common/format/checksum.h"
#include "common/format/image.h"
#include "common/format/metadata.h"

namespace flashckpt {
namespace {

constexpr char kEmaMagic[8] = {'F', 'C', 'K', 'P', 'T', 'E', 'M', '2'};
constexpr size_t kChunkElements = 1u << 18;  // 1 MiB of fp32 per parallel chunk

inline float Bf16ToFloat(uint16_t v) {
  uint32_t bits = uint32_t{v} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float F16ToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      bits = sign | (uint32_t(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename Load>
void Combine(const float* __restrict in, float* __restrict e, size_t n, float d, EmaStep step, float* __restrict out,
             Load load) {
  const float w = 1.0f - d;
  switch (step) {
    case EmaStep::kCopy:
      for (size_t i = 0; i < n; ++i) e[i] = load(i);
      break;
    case EmaStep::kScaledCopy:
      for (size_t i = 0; i < n; ++i) e[i] = w * load(i);
      break;
    case EmaStep::kAverage:
      for (size_t i = 0; i < n; ++i) e[i] = d * in[i] + w * load(i);
      break;
  }
  if (out != nullptr) std::memcpy(out, e, n * sizeof(float));
}

void Store(EmaCounters* c, const EmaState& s) {
  c->initialized.store(s.initialized ? 1 : 0, std::memory_order_relaxed);
  c->updates_applied.store(s.updates_applied, std::memory_order_relaxed);
  c->updates_skipped.store(s.updates_skipped, std::memory_order_relaxed);
  c->last_step.store(s.last_step, std::memory_order_relaxed);
  c->last_seen.store(s.last_seen, std::memory_order_release);
}

bool IsFloat(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

}  // namespace

void EmaKernel(const float* in, float* e, const void* x, DType dtype, size_t n, float decay, EmaStep step,
               float* copy_out) {
  switch (dtype) {
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(x);
      Combine(in, e, n, decay, step, copy_out, [s](size_t i) { return Bf16ToFloat(s[i]); });
      break;
    }
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(x);
      Combine(in, e, n, decay, step, copy_out, [s](size_t i) { return F16ToFloat(s[i]); });
      break;
    }
    default: {
      const float* __restrict s = static_cast<const float*>(x);
      Combine(in, e, n, decay, step, copy_out, [s](size_t i) { return s[i]; });
      break;
    }
  }
}

Status ValidateEmaConfig(const EmaConfig& c) {
  if (!c.enabled) return Status::OK();
  if (!(c.decay > 0.0 && c.decay < 1.0)) {
    return InvalidArgument("ema_decay must lie strictly between 0 and 1, got " + std::to_string(c.decay));
  }
  if (c.interval == 0) return InvalidArgument("ema_interval must be at least 1, got 0");
  if (c.loss_threshold && !std::isfinite(*c.loss_threshold)) {
    return InvalidArgument("ema_loss_threshold must be a finite number");
  }
  return Status::OK();
}

std::string EmaInitName(const EmaConfig& c) { return c.init_zeros ? "zeros" : "first"; }

Result<EmaPlan> PlanEma(const RankLayout& rank, const EmaConfig& config) {
  RETURN_IF_ERROR(ValidateEmaConfig(config));
  EmaPlan plan;
  std::vector<TensorSpec> specs;
  bool any_float = false;
  auto add = [&](size_t i, const std::string& name) {
    TensorSpec s = rank.tensors[i];
    s.name = name;
    s.kind = TensorKind::kEma;
    s.dtype = DType::kF32;
    s.param.clear();
    specs.push_back(std::move(s));
    plan.source.push_back(i);
  };
  std::vector<std::string> mastered;
  for (size_t i = 0; i < rank.tensors.size(); ++i) {
    const TensorSpec& t = rank.tensors[i];
    if (t.kind != TensorKind::kMasterWeight || !IsFloat(t.dtype)) continue;
    any_float = true;
    std::string param = t.param.empty() ? t.name : t.param;
    mastered.push_back(param);
    if (!t.replica) add(i, param);
  }
  for (size_t i = 0; i < rank.tensors.size(); ++i) {
    const TensorSpec& t = rank.tensors[i];
    if (t.kind != TensorKind::kModel) continue;
    bool eligible = t.dtype == DType::kF32 || (config.all_float_params && IsFloat(t.dtype));
    if (!eligible) continue;
    any_float = true;
    if (t.replica || std::find(mastered.begin(), mastered.end(), t.name) != mastered.end()) continue;
    add(i, t.name);
  }
  if (!any_float) {
    return InvalidArgument("EMA requested for job '" + rank.job + "' rank " + std::to_string(rank.rank) +
                           " but it registers no fp32 model or master_weight tensor" +
                           (config.all_float_params ? "" : " (bf16/fp16 weights need ema_model_params=all)"));
  }
  // The plan keeps the order of `specs`; sort the sources the way the layout sorts the tensors.
  EmaRecord record;
  record.decay = config.decay;
  record.interval = config.interval;
  record.init = EmaInitName(config);
  record.model_params = config.all_float_params ? "all" : "fp32";
  record.loss_threshold = config.loss_threshold;
  const LayoutExtras extras = EmaFileExtras(record, rank.checksum_chunk);
  if (specs.empty()) return plan;  // every float tensor of this rank is a replica
  ASSIGN_OR_RETURN(plan.layout, BuildRankLayout(rank.job, rank.rank, rank.topology, specs, extras));
  return plan;
}

std::string EmaSegmentName(const std::string& job, uint32_t rank, const std::string& scope) {
  return "flashckpt." + job + "." + std::to_string(rank) + "." + scope + ".ema";
}

std::string UnscopedEmaSegmentName(const std::string& job, uint32_t rank) {
  return "flashckpt." + job + "." + std::to_string(rank) + ".ema";
}

Result<std::unique_ptr<RankEma>> RankEma::Open(const std::string& job, uint32_t rank, const std::string& scope,
                                               EmaPlan plan, const EmaConfig& config, unsigned mode, bool recorded,
                                               const std::string& run_id) {
  std::unique_ptr<RankEma> ema(new RankEma());
  const std::string name = EmaSegmentName(job, rank, scope);
  const FileImage& image = plan.layout.files.at(0);
  const uint64_t bytes = 2 * plan.layout.slot_bytes;  // two images (ema.h)
  const uint64_t signature = Xxh3(image.header.data(), image.header.size());
  bool scoped_missing = false;
  auto adopt = [&](const std::string& candidate) {
    auto existing = SharedSegment::Open(candidate, bytes);
    if (!existing.ok()) {
      scoped_missing = scoped_missing || (candidate == name && existing.status().code() == StatusCode::kNotFound);
      return false;
    }
    auto* h = reinterpret_cast<EmaSegmentHeader*>((*existing)->data());
    if (std::memcmp(h->magic, kEmaMagic, sizeof kEmaMagic) != 0 || h->signature != signature ||
        h->current.load() > 1) {
      return false;
    }
    ema->shm_ = std::move(existing).value();
    ema->adopted_ = true;
    return true;
  };
  if (!adopt(name) && scoped_missing) {
    // An upgrade from a release that named EMA segments without a scope.
    const std::string old = UnscopedEmaSegmentName(job, rank);
    if (adopt(old)) {
      const std::string its_run = ema->run_id();
      ema->shm_.reset();
      ema->adopted_ = false;
      if (recorded || (!run_id.empty() && its_run == run_id)) {
        Status renamed = SharedSegment::Rename(old, name);
        if (renamed.ok() && adopt(name)) {
          ema->upgraded_ = true;
          Logger("ema")->info("renamed segment={} to={}: the average of run {} carries on under this daemon's name",
                              old, name, its_run.empty() ? "(none)" : its_run);
        } else if (!renamed.ok()) {
          Logger("ema")->warn("segment={} is this daemon's but could not be renamed to {} ({}); a new average starts",
                              old, name, renamed.ToString());
        }
      } else {
        Logger("ema")->info("segment={} of run {} left alone: nothing says it is this daemon's", old,
                            its_run.empty() ? "(none)" : its_run);
      }
    } else if (recorded) {
      SharedSegment::Unlink(old);  // this daemon's, of another layout: a new average starts below
    }
  }
  if (!ema->shm_) {
    SharedSegment::Unlink(name);
    ASSIGN_OR_RETURN(ema->shm_, SharedSegment::Create(name, bytes, mode));
    auto* h = reinterpret_cast<EmaSegmentHeader*>(ema->shm_->data());
    std::memcpy(h->magic, kEmaMagic, sizeof kEmaMagic);
    h->signature = signature;
    Store(&h->counters[0], EmaState{});
    Store(&h->counters[1], EmaState{});
    h->current.store(0, std::memory_order_release);
    InitSlotImages(ema->shm_->data(), plan.layout);
    InitSlotImages(ema->shm_->data() + plan.layout.slot_bytes, plan.layout);
  }
  ema->shm_->KeepName();  // outlives this process: a restarted daemon adopts it
  ema->plan_ = std::move(plan);
  ema->config_ = config;
  for (size_t k = 0; k < ema->plan_.layout.tensors.size(); ++k) {
    size_t n = ema->plan_.layout.placements[k].bytes / sizeof(float);
    for (size_t b = 0; b < n; b += kChunkElements) ema->chunks_.push_back({k, b, std::min(kChunkElements, n - b)});
  }
  const EmaState state = ema->state();
  Logger("ema")->info("{} segment={} bytes={} tensors={} step={} applied={}", ema->adopted_ ? "adopted" : "created",
                      name, ema->shm_->size(), ema->plan_.layout.tensors.size(), state.last_step,
                      state.updates_applied);
  return ema;
}

RankEma::~RankEma() = default;

void RankEma::Unlink() { SharedSegment::Unlink(shm_->name()); }

EmaState RankEma::state() const {
  const EmaSegmentHeader* h = header();
  const EmaCounters& c = h->counters[h->current.load(std::memory_order_acquire)];
  EmaState s;
  s.last_seen = c.last_seen.load(std::memory_order_acquire);
  s.initialized = c.initialized.load(std::memory_order_relaxed) != 0;
  s.updates_applied = c.updates_applied.load(std::memory_order_relaxed);
  s.updates_skipped = c.updates_skipped.load(std::memory_order_relaxed);
  s.last_step = c.last_step.load(std::memory_order_relaxed);
  return s;
}

void RankEma::Publish(const EmaState& state) {
  EmaSegmentHeader* h = header();
  const uint32_t spare = 1 - h->current.load(std::memory_order_relaxed);
  Store(&h->counters[spare], state);
  h->current.store(spare, std::memory_order_release);  // the commit point of an update or a load
}

void RankEma::SetState(const EmaState& state) {
  EmaSegmentHeader* h = header();
  Store(&h->counters[h->current.load(std::memory_order_relaxed)], state);
}

void RankEma::Stamp(char* image_base, int64_t step, const EmaState& state, ParallelLoop* loop) const {
  StampStep(image_base, plan_.layout, 0, step);
  // One task per tensor: the checksums of a persisted step run on every EMA thread.
  loop->Run(plan_.layout.tensors.size(), [&](size_t t) { StampChecksum(image_base, plan_.layout, t); });
  StampEmaCounters(image_base, plan_.layout, 0, state.updates_applied, state.updates_skipped, state.last_step);
}

void RankEma::StampImage(char* image_base, int64_t step, const EmaState& state, ParallelLoop* loop) const {
  const FileImage& image = plan_.layout.files[0];
  std::memcpy(image_base + image.slot_offset, image.header.data(), image.header.size());
  Stamp(image_base, step, state, loop);
}

EmaState RankEma::CopyAverage(char* image_base) const {
  MutexLock lock(&mu_);
  const FileImage& image = plan_.layout.files[0];
  const uint64_t data = image.slot_offset + image.header.size();
  std::memcpy(image_base + data, base() + data, image.data_bytes);
  return state();
}

Status RankEma::Load(const std::function<Status(char* image_base)>& fill, const EmaState& state) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(fill(spare_base()));
  Publish(state);
  return Status::OK();
}

void RankEma::Reset() {
  MutexLock lock(&mu_);
  SetState(EmaState{});
}

std::string RankEma::run_id() const {
  MutexLock lock(&mu_);
  const char* id = header()->run_id;
  return std::string(id, strnlen(id, sizeof header()->run_id));
}

bool RankEma::StartRun(const std::string& run_id) {
  MutexLock lock(&mu_);
  char* id = header()->run_id;
  if (std::string(id, strnlen(id, sizeof header()->run_id)) == run_id) return false;
  // Forgotten before the new id is recorded: a daemon killed in between leaves a blank average.
  SetState(EmaState{});
  std::memset(id, 0, sizeof header()->run_id);
  std::memcpy(id, run_id.data(), std::min(run_id.size(), sizeof header()->run_id - 1));
  return true;
}

bool RankEma::Apply(const RankLayout& rank, const char* slot, int64_t step, std::optional<double> loss,
                    char* slot_image_base, ParallelLoop* loop, bool replay) {
  MutexLock lock(&mu_);
  EmaState s = state();
  bool changed = false;
  bool due = step % config_.interval == 0;
  if (due && replay && step <= s.last_seen) {
    due = false;  // applied (or skipped by the gate) before the daemon restarted
  } else if (due && s.last_seen >= 0 && step <= s.last_seen) {
    // Steps only increase within a run: an older or equal step means this average was left by
    // another run of the job (its segment adopted after a restart). Start afresh.
    Logger("ema")->warn("ema reset segment={} step={} last_step={}: the adopted EMA belongs to another run",
                        shm_->name(), step, s.last_step);
    s = EmaState{};
    changed = true;
  }
  // A NaN or infinite loss (a diverged step) is gated too; `NaN > threshold` alone is false.
  const bool gated =
      due && config_.loss_threshold && loss && (!std::isfinite(*loss) || *loss > *config_.loss_threshold);
  if (gated) {
    s.updates_skipped += 1;
    s.last_seen = step;
    changed = true;
  }
  const bool update = due && !gated;
  if (!update) {
    if (changed) SetState(s);
    if (slot_image_base == nullptr) return false;
  }

  EmaStep how = EmaStep::kAverage;
  if (!s.initialized) how = config_.init_zeros ? EmaStep::kScaledCopy : EmaStep::kCopy;
  const float decay = static_cast<float>(config_.decay);
  const char* from = base();
  char* to = update ? spare_base() : nullptr;

  const auto& chunks = chunks_;
  loop->Run(chunks.size(), [&](size_t c) {
    const Chunk& ch = chunks[c];
    const Placement& ep = plan_.layout.placements[ch.tensor];
    const float* in = reinterpret_cast<const float*>(from + ep.slot_offset) + ch.begin;
    float* copy = slot_image_base ? reinterpret_cast<float*>(slot_image_base + ep.slot_offset) + ch.begin : nullptr;
    if (!update) {
      std::memcpy(copy, in, ch.count * sizeof(float));
      return;
    }
    float* out = reinterpret_cast<float*>(to + ep.slot_offset) + ch.begin;
    const size_t src = plan_.source[ch.tensor];
    const DType dtype = rank.tensors[src].dtype;
    const char* x = slot + rank.placements[src].slot_offset + ch.begin * DTypeSize(dtype);
    EmaKernel(in, out, x, dtype, ch.count, decay, how, copy);
  });
  if (update) {
    s.initialized = true;
    s.updates_applied += 1;
    s.last_step = step;
    s.last_seen = step;
    Publish(s);
  }
  if (slot_image_base != nullptr) {
    std::memcpy(slot_image_base + plan_.layout.files[0].slot_offset, base() + plan_.layout.files[0].slot_offset,
                plan_.layout.files[0].header.size());
    Stamp(slot_image_base, step, s, loop);
  }
  return update;
}

}  // namespace flashckpt

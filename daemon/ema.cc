#include "daemon/ema.h"

#include <sys/mman.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/checksum.h"
#include "common/image.h"
#include "common/log.h"
#include "common/metadata.h"

namespace flashckpt {
namespace {

constexpr char kEmaMagic[8] = {'F', 'C', 'K', 'P', 'T', 'E', 'M', '1'};
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
void Combine(float* __restrict e, size_t n, float d, EmaStep step, float* __restrict out, Load load) {
  const float w = 1.0f - d;
  switch (step) {
    case EmaStep::kCopy:
      for (size_t i = 0; i < n; ++i) e[i] = load(i);
      break;
    case EmaStep::kScaledCopy:
      for (size_t i = 0; i < n; ++i) e[i] = w * load(i);
      break;
    case EmaStep::kAverage:
      for (size_t i = 0; i < n; ++i) e[i] = d * e[i] + w * load(i);
      break;
  }
  if (out != nullptr) std::memcpy(out, e, n * sizeof(float));
}

bool IsFloat(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

}  // namespace

void EmaKernel(float* e, const void* x, DType dtype, size_t n, float decay, EmaStep step, float* copy_out) {
  switch (dtype) {
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(x);
      Combine(e, n, decay, step, copy_out, [s](size_t i) { return Bf16ToFloat(s[i]); });
      break;
    }
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(x);
      Combine(e, n, decay, step, copy_out, [s](size_t i) { return F16ToFloat(s[i]); });
      break;
    }
    default: {
      const float* __restrict s = static_cast<const float*>(x);
      Combine(e, n, decay, step, copy_out, [s](size_t i) { return s[i]; });
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

Result<std::unique_ptr<RankEma>> RankEma::Open(const std::string& job, uint32_t rank, EmaPlan plan,
                                               const EmaConfig& config, unsigned mode) {
  std::unique_ptr<RankEma> ema(new RankEma());
  const std::string name = "flashckpt." + job + "." + std::to_string(rank) + ".ema";
  const FileImage& image = plan.layout.files.at(0);
  const uint64_t bytes = plan.layout.slot_bytes;
  const uint64_t signature = Xxh3(image.header.data(), image.header.size());
  auto existing = SharedSegment::Open(name, bytes);
  if (existing.ok()) {
    auto* h = reinterpret_cast<EmaSegmentHeader*>((*existing)->data());
    if (std::memcmp(h->magic, kEmaMagic, sizeof kEmaMagic) == 0 && h->signature == signature) {
      ema->shm_ = std::move(existing).value();
      ema->adopted_ = true;
    }
  }
  if (!ema->shm_) {
    SharedSegment::Unlink(name);
    ASSIGN_OR_RETURN(ema->shm_, SharedSegment::Create(name, bytes, mode));
    auto* h = reinterpret_cast<EmaSegmentHeader*>(ema->shm_->data());
    std::memcpy(h->magic, kEmaMagic, sizeof kEmaMagic);
    h->signature = signature;
    h->initialized = 0;
    h->updates_applied = 0;
    h->updates_skipped = 0;
    h->last_step = -1;
    InitSlotImages(ema->shm_->data(), plan.layout);
  }
  ema->shm_->KeepName();  // outlives this process: a restarted daemon adopts it
  ema->plan_ = std::move(plan);
  ema->config_ = config;
  for (size_t k = 0; k < ema->plan_.layout.tensors.size(); ++k) {
    size_t n = ema->plan_.layout.placements[k].bytes / sizeof(float);
    for (size_t b = 0; b < n; b += kChunkElements) ema->chunks_.push_back({k, b, std::min(kChunkElements, n - b)});
  }
  auto* h = ema->header();
  Logger("ema")->info("{} segment={} bytes={} tensors={} step={} applied={}", ema->adopted_ ? "adopted" : "created",
                      name, ema->shm_->size(), ema->plan_.layout.tensors.size(), h->last_step.load(),
                      h->updates_applied.load());
  return ema;
}

RankEma::~RankEma() = default;

void RankEma::Unlink() { SharedSegment::Unlink(shm_->name()); }

void RankEma::Stamp(char* image_base, int64_t step, ParallelLoop* loop) const {
  StampStep(image_base, plan_.layout, 0, step);
  // One task per tensor: the checksums of a persisted step run on every EMA thread.
  loop->Run(plan_.layout.tensors.size(), [&](size_t t) { StampChecksum(image_base, plan_.layout, t); });
  const EmaSegmentHeader* h = header();
  StampEmaCounters(image_base, plan_.layout, 0, h->updates_applied.load(), h->updates_skipped.load(),
                   h->last_step.load());
}

bool RankEma::Apply(const RankLayout& rank, const char* slot, int64_t step, std::optional<double> loss,
                    char* slot_image_base, ParallelLoop* loop) {
  EmaSegmentHeader* h = header();
  bool due = step % config_.interval == 0;
  if (due && h->initialized != 0 && step <= h->last_step) {
    // Steps only increase within a run: an older or equal step means this average was left by
    // another run of the job (its segment adopted after a restart). Start afresh.
    Logger("ema")->warn("ema reset segment={} step={} last_step={}: the adopted EMA belongs to another run",
                        shm_->name(), step, h->last_step.load());
    h->initialized = 0;
    h->updates_applied = 0;
    h->updates_skipped = 0;
    h->last_step = -1;
  }
  // A NaN or infinite loss (a diverged step) is gated too; `NaN > threshold` alone is false.
  bool gated = due && config_.loss_threshold && loss && (!std::isfinite(*loss) || *loss > *config_.loss_threshold);
  if (gated) h->updates_skipped += 1;
  bool update = due && !gated;
  if (!update && slot_image_base == nullptr) return false;

  EmaStep how = EmaStep::kAverage;
  if (h->initialized == 0) how = config_.init_zeros ? EmaStep::kScaledCopy : EmaStep::kCopy;
  const float decay = static_cast<float>(config_.decay);

  const auto& chunks = chunks_;
  loop->Run(chunks.size(), [&](size_t c) {
    const Chunk& ch = chunks[c];
    const Placement& ep = plan_.layout.placements[ch.tensor];
    float* e = reinterpret_cast<float*>(base() + ep.slot_offset) + ch.begin;
    float* out = slot_image_base ? reinterpret_cast<float*>(slot_image_base + ep.slot_offset) + ch.begin : nullptr;
    if (!update) {
      std::memcpy(out, e, ch.count * sizeof(float));
      return;
    }
    const size_t src = plan_.source[ch.tensor];
    const DType dtype = rank.tensors[src].dtype;
    const char* x = slot + rank.placements[src].slot_offset + ch.begin * DTypeSize(dtype);
    EmaKernel(e, x, dtype, ch.count, decay, how, out);
  });
  if (update) {
    h->initialized = 1;
    h->updates_applied += 1;
    h->last_step = step;
  }
  if (slot_image_base != nullptr) {
    std::memcpy(slot_image_base + plan_.layout.files[0].slot_offset, base() + plan_.layout.files[0].slot_offset,
                plan_.layout.files[0].header.size());
    Stamp(slot_image_base, step, loop);
  }
  return update;
}

}  // namespace flashckpt

#include "common/read/relayout.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "common/base/names.h"
#include "common/base/thread_pool.h"
#include "common/format/image.h"
#include "common/format/metadata.h"
#include "common/format/signal.h"
#include "common/io/fs.h"
#include "common/read/checkpoint_read.h"
#include "common/read/verify.h"
#include "test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

using testing::FlipByte;
using testing::Spec;
using testing::TempDir;

// ---------------------------------------------------------------------------------------------
// PlanNewLayout on metadata built in memory: only the geometry of pieces and the stage of their
// files matter to the planner.

class MetaBuilder {
 public:
  MetaBuilder(uint32_t tp, uint32_t pp, uint32_t shard) {
    meta_.job = "plan";
    meta_.step = 5;
    meta_.topology = Topology{tp * pp * shard, 0, tp, 0, pp, 0, shard};
  }

  // A piece saved by the rank at (tp, pp, shard). Empty box_offset/box_shape: the whole tensor.
  MetaBuilder& Add(const std::string& key, TensorKind kind, std::vector<uint64_t> global, uint32_t tp, uint32_t pp,
                   uint32_t shard, std::vector<uint64_t> box_offset = {}, std::vector<uint64_t> box_shape = {},
                   std::optional<FlatRange> flat = std::nullopt, DType dtype = DType::kF32) {
    Piece p;
    p.key = key;
    p.kind = kind;
    p.dtype = dtype;
    p.global_shape = global;
    p.box_offset = box_offset.empty() ? std::vector<uint64_t>(global.size(), 0) : box_offset;
    p.box_shape = box_shape.empty() ? global : box_shape;
    p.flat_range = flat;
    p.shape = flat ? std::vector<uint64_t>{flat->end - flat->begin} : p.box_shape;
    const char* file_kind = kind == TensorKind::kModel ? "model_state" : kind == TensorKind::kEma ? "ema" : "optimizer";
    p.file = FileStem(file_kind, tp, pp, shard) + ".safetensors";
    if (std::none_of(meta_.files.begin(), meta_.files.end(), [&](const SavedFile& f) { return f.name == p.file; })) {
      SavedFile f;
      f.name = p.file;
      f.tp_rank = tp;
      f.pp_rank = pp;
      f.shard_rank = shard;
      f.rank = tp + meta_.topology.tp_degree * (pp + meta_.topology.pp_degree * shard);
      meta_.files.push_back(f);
    }
    meta_.pieces.push_back(std::move(p));
    return *this;
  }

  const CheckpointMetadata& meta() const { return meta_; }

 private:
  CheckpointMetadata meta_;
};

const TensorSpec* FindSpec(const std::vector<TensorSpec>& specs, const std::string& name) {
  for (const TensorSpec& s : specs) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

using Shape = std::vector<uint64_t>;

// The new stage of every tensor of a plan (each must be held by exactly one stage).
std::map<std::string, uint32_t> StagesOf(const std::vector<NewRank>& plan) {
  std::map<std::string, uint32_t> stage;
  for (const NewRank& r : plan) {
    for (const TensorSpec& s : r.tensors) {
      auto [it, fresh] = stage.emplace(s.name, r.topology.pp_rank);
      EXPECT_TRUE(fresh || it->second == r.topology.pp_rank) << s.name << " on two stages";
    }
  }
  return stage;
}

TEST(PlanNewLayout, RankCoordinatesAreTpFastestThenPpThenShard) {
  MetaBuilder b(1, 1, 1);
  b.Add("w", TensorKind::kModel, {8, 8}, 0, 0, 0);
  auto plan = PlanNewLayout(b.meta(), Degrees{2, 3, 2});
  ASSERT_OK(plan.status());
  ASSERT_EQ(plan->size(), 12u);
  for (uint32_t r = 0; r < 12; ++r) {
    const NewRank& nr = (*plan)[r];
    EXPECT_EQ(nr.rank, r);
    EXPECT_EQ(nr.topology.world_size, 12u);
    EXPECT_EQ(nr.topology.tp_degree, 2u);
    EXPECT_EQ(nr.topology.pp_degree, 3u);
    EXPECT_EQ(nr.topology.shard_degree, 2u);
    EXPECT_EQ(nr.topology.tp_rank, r % 2) << "rank " << r;
    EXPECT_EQ(nr.topology.pp_rank, (r / 2) % 3) << "rank " << r;
    EXPECT_EQ(nr.topology.shard_rank, r / 6) << "rank " << r;
  }
}

TEST(PlanNewLayout, CutsASplitTensorIntoCeilBlocksAlongItsSplitDimension) {
  // Saved by tp = 2: "w" cut along rows, "col" along columns, "tiny" rows [0, 2) and [2, 4).
  MetaBuilder b(2, 1, 1);
  for (uint32_t t = 0; t < 2; ++t) {
    b.Add("w", TensorKind::kModel, {100, 64}, t, 0, 0, {50 * t, 0}, {50, 64});
    b.Add("col", TensorKind::kModel, {8, 10}, t, 0, 0, {0, 5 * t}, {8, 5});
    b.Add("tiny", TensorKind::kModel, {4, 8}, t, 0, 0, {2 * t, 0}, {2, 8});
  }
  auto plan = PlanNewLayout(b.meta(), Degrees{3, 1, 1});
  ASSERT_OK(plan.status());
  ASSERT_EQ(plan->size(), 3u);
  const Shape w_offset[] = {{0, 0}, {34, 0}, {68, 0}}, w_box[] = {{34, 64}, {34, 64}, {32, 64}};
  const Shape col_offset[] = {{0, 0}, {0, 4}, {0, 8}}, col_box[] = {{8, 4}, {8, 4}, {8, 2}};
  for (uint32_t t = 0; t < 3; ++t) {
    const NewRank& r = (*plan)[t];
    EXPECT_TRUE(r.ema.empty());
    const TensorSpec* w = FindSpec(r.tensors, "w");
    ASSERT_NE(w, nullptr) << "tp rank " << t;
    EXPECT_EQ(w->kind, TensorKind::kModel);
    EXPECT_EQ(w->global_shape, (Shape{100, 64}));
    EXPECT_EQ(w->box_offset, w_offset[t]) << "tp rank " << t;
    EXPECT_EQ(w->box_shape, w_box[t]) << "tp rank " << t;
    EXPECT_EQ(w->shape, w_box[t]) << "tp rank " << t;
    EXPECT_FALSE(w->flat_range.has_value());
    const TensorSpec* col = FindSpec(r.tensors, "col");
    ASSERT_NE(col, nullptr) << "tp rank " << t;
    EXPECT_EQ(col->box_offset, col_offset[t]) << "tp rank " << t;
    EXPECT_EQ(col->box_shape, col_box[t]) << "tp rank " << t;
  }
  // 4 rows over 3 ranks: blocks of 2, and the third rank is past the end.
  ASSERT_NE(FindSpec((*plan)[0].tensors, "tiny"), nullptr);
  ASSERT_NE(FindSpec((*plan)[1].tensors, "tiny"), nullptr);
  EXPECT_EQ(FindSpec((*plan)[1].tensors, "tiny")->box_offset, (Shape{2, 0}));
  EXPECT_EQ(FindSpec((*plan)[1].tensors, "tiny")->box_shape, (Shape{2, 8}));
  EXPECT_EQ(FindSpec((*plan)[2].tensors, "tiny"), nullptr);

  // Back to tp = 1: one whole tensor.
  auto one = PlanNewLayout(b.meta(), Degrees{1, 1, 1});
  ASSERT_OK(one.status());
  ASSERT_EQ(one->size(), 1u);
  const TensorSpec* w = FindSpec((*one)[0].tensors, "w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->box_offset, (Shape{0, 0}));
  EXPECT_EQ(w->box_shape, (Shape{100, 64}));
}

TEST(PlanNewLayout, ATensorSavedWholeGoesToTpRankZeroOnly) {
  // tp = 2 saved "bias" and the 2-D "emb" whole on both tp ranks (tp-replicated).
  MetaBuilder b(2, 1, 1);
  for (uint32_t t = 0; t < 2; ++t) {
    b.Add("w", TensorKind::kModel, {6, 4}, t, 0, 0, {3 * t, 0}, {3, 4});
    b.Add("bias", TensorKind::kModel, {64}, t, 0, 0);
    b.Add("emb", TensorKind::kModel, {16, 8}, t, 0, 0);
  }
  auto plan = PlanNewLayout(b.meta(), Degrees{3, 1, 1});
  ASSERT_OK(plan.status());
  ASSERT_EQ(plan->size(), 3u);
  for (const char* name : {"bias", "emb"}) {
    const TensorSpec* s = FindSpec((*plan)[0].tensors, name);
    ASSERT_NE(s, nullptr) << name;
    EXPECT_EQ(s->box_offset, Shape(s->global_shape.size(), 0)) << name;
    EXPECT_EQ(s->box_shape, s->global_shape) << name;
    EXPECT_EQ(s->shape, s->global_shape) << name;
    EXPECT_EQ(FindSpec((*plan)[1].tensors, name), nullptr) << name << " on tp rank 1";
    EXPECT_EQ(FindSpec((*plan)[2].tensors, name), nullptr) << name << " on tp rank 2";
  }
  EXPECT_NE(FindSpec((*plan)[2].tensors, "w"), nullptr);
}

TEST(PlanNewLayout, ATpDegreeOneCheckpointIsCutAlongDimensionZero) {
  // Saved with tp_degree 1, nothing says what is split: 2-D and larger are cut along rows.
  MetaBuilder b(1, 1, 1);
  b.Add("w", TensorKind::kModel, {10, 3}, 0, 0, 0);
  b.Add("bias", TensorKind::kModel, {10}, 0, 0, 0);
  auto plan = PlanNewLayout(b.meta(), Degrees{2, 1, 1});
  ASSERT_OK(plan.status());
  ASSERT_EQ(plan->size(), 2u);
  for (uint32_t t = 0; t < 2; ++t) {
    const TensorSpec* w = FindSpec((*plan)[t].tensors, "w");
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(w->box_offset, (Shape{5 * t, 0}));
    EXPECT_EQ(w->box_shape, (Shape{5, 3}));
  }
  EXPECT_NE(FindSpec((*plan)[0].tensors, "bias"), nullptr);
  EXPECT_EQ(FindSpec((*plan)[1].tensors, "bias"), nullptr);
}

TEST(PlanNewLayout, ShardsOptimizerStateAsFlatCeilRangesAndModelOnShardZero) {
  MetaBuilder b(1, 1, 1);
  b.Add("w", TensorKind::kModel, {10, 10}, 0, 0, 0);
  b.Add("w.exp_avg", TensorKind::kOptimizer, {10, 10}, 0, 0, 0);
  b.Add("w.master", TensorKind::kMasterWeight, {10, 10}, 0, 0, 0);
  auto plan = PlanNewLayout(b.meta(), Degrees{1, 1, 3});
  ASSERT_OK(plan.status());
  ASSERT_EQ(plan->size(), 3u);
  const uint64_t begin[] = {0, 34, 68}, end[] = {34, 68, 100};
  for (uint32_t s = 0; s < 3; ++s) {
    const NewRank& r = (*plan)[s];
    EXPECT_EQ(r.topology.shard_rank, s);
    EXPECT_EQ(FindSpec(r.tensors, "w") != nullptr, s == 0) << "model tensor on shard rank " << s;
    for (const char* name : {"w.exp_avg", "w.master"}) {
      const TensorSpec* o = FindSpec(r.tensors, name);
      ASSERT_NE(o, nullptr) << name << " on shard rank " << s;
      EXPECT_EQ(o->box_offset, (Shape{0, 0}));
      EXPECT_EQ(o->box_shape, (Shape{10, 10}));
      ASSERT_TRUE(o->flat_range.has_value()) << name;
      EXPECT_EQ(o->flat_range->begin, begin[s]) << name << " shard " << s;
      EXPECT_EQ(o->flat_range->end, end[s]) << name << " shard " << s;
      EXPECT_EQ(o->shape, (Shape{end[s] - begin[s]})) << name << " shard " << s;
    }
  }
  const TensorSpec* w = FindSpec((*plan)[0].tensors, "w");
  ASSERT_NE(w, nullptr);
  EXPECT_FALSE(w->flat_range.has_value());
  EXPECT_EQ(w->shape, (Shape{10, 10}));
}

TEST(PlanNewLayout, ShardsEachTpBoxSeparately) {
  // tp 1 -> 2 (rows cut) and shard 1 -> 2: each rank's flat range is of its own tp box.
  MetaBuilder b(1, 1, 1);
  b.Add("w", TensorKind::kModel, {10, 10}, 0, 0, 0);
  b.Add("w.exp_avg", TensorKind::kOptimizer, {10, 10}, 0, 0, 0);
  auto plan = PlanNewLayout(b.meta(), Degrees{2, 1, 2});
  ASSERT_OK(plan.status());
  ASSERT_EQ(plan->size(), 4u);
  for (uint32_t r = 0; r < 4; ++r) {
    const uint32_t tp = r % 2, shard = r / 2;
    const TensorSpec* o = FindSpec((*plan)[r].tensors, "w.exp_avg");
    ASSERT_NE(o, nullptr) << "rank " << r;
    EXPECT_EQ(o->box_offset, (Shape{5 * tp, 0})) << "rank " << r;
    EXPECT_EQ(o->box_shape, (Shape{5, 10})) << "rank " << r;
    ASSERT_TRUE(o->flat_range.has_value());
    EXPECT_EQ(o->flat_range->begin, 25u * shard) << "rank " << r;
    EXPECT_EQ(o->flat_range->end, 25u * (shard + 1)) << "rank " << r;
    EXPECT_EQ(FindSpec((*plan)[r].tensors, "w") != nullptr, shard == 0) << "rank " << r;
  }
}

TEST(PlanNewLayout, FlatRangesStayFlatAtShardDegreeOne) {
  // Saved by a distributed optimizer over two shard ranks; rewritten for one.
  MetaBuilder b(1, 1, 2);
  b.Add("w", TensorKind::kModel, {10, 10}, 0, 0, 0);
  b.Add("w.exp_avg", TensorKind::kOptimizer, {10, 10}, 0, 0, 0, {}, {}, FlatRange{0, 50});
  b.Add("w.exp_avg", TensorKind::kOptimizer, {10, 10}, 0, 0, 1, {}, {}, FlatRange{50, 100});
  auto plan = PlanNewLayout(b.meta(), Degrees{1, 1, 1});
  ASSERT_OK(plan.status());
  ASSERT_EQ(plan->size(), 1u);
  const TensorSpec* o = FindSpec((*plan)[0].tensors, "w.exp_avg");
  ASSERT_NE(o, nullptr);
  ASSERT_TRUE(o->flat_range.has_value());
  EXPECT_EQ(o->flat_range->begin, 0u);
  EXPECT_EQ(o->flat_range->end, 100u);
  EXPECT_EQ(o->shape, (Shape{100}));
  const TensorSpec* w = FindSpec((*plan)[0].tensors, "w");
  ASSERT_NE(w, nullptr);
  EXPECT_FALSE(w->flat_range.has_value());
}

TEST(PlanNewLayout, EmaPiecesGoToTheEmaListOnShardRankZero) {
  MetaBuilder b(1, 1, 1);
  b.Add("w", TensorKind::kModel, {8, 8}, 0, 0, 0);
  b.Add("w", TensorKind::kEma, {8, 8}, 0, 0, 0);
  auto plan = PlanNewLayout(b.meta(), Degrees{2, 1, 2});
  ASSERT_OK(plan.status());
  ASSERT_EQ(plan->size(), 4u);
  for (const NewRank& r : *plan) {
    const bool shard0 = r.topology.shard_rank == 0;
    for (const TensorSpec& s : r.tensors) EXPECT_NE(s.kind, TensorKind::kEma) << "rank " << r.rank;
    ASSERT_EQ(r.ema.size(), shard0 ? 1u : 0u) << "rank " << r.rank;
    if (!shard0) continue;
    const TensorSpec& e = r.ema[0];
    EXPECT_EQ(e.name, "w");
    EXPECT_EQ(e.kind, TensorKind::kEma);
    EXPECT_FALSE(e.flat_range.has_value());
    EXPECT_EQ(e.box_offset, (Shape{4 * r.topology.tp_rank, 0}));
    EXPECT_EQ(e.box_shape, (Shape{4, 8}));
    const TensorSpec* w = FindSpec(r.tensors, "w");
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(w->kind, TensorKind::kModel);
  }
}

TEST(PlanNewLayout, KeepsStagesWhenThePipelineDegreeIsUnchanged) {
  // A cut by bytes would move the second large tensor to stage 1; an unchanged degree must not.
  MetaBuilder b(1, 2, 1);
  b.Add("layers.0.w", TensorKind::kModel, {1000}, 0, 0, 0);
  b.Add("layers.1.w", TensorKind::kModel, {1000}, 0, 0, 0);
  b.Add("layers.2.w", TensorKind::kModel, {10}, 0, 1, 0);
  auto plan = PlanNewLayout(b.meta(), Degrees{1, 2, 1});
  ASSERT_OK(plan.status());
  auto stage = StagesOf(*plan);
  EXPECT_EQ(stage, (std::map<std::string, uint32_t>{{"layers.0.w", 0}, {"layers.1.w", 0}, {"layers.2.w", 1}}));
}

TEST(PlanNewLayout, MergesConsecutiveStagesForADivisor) {
  MetaBuilder b(1, 4, 1);
  // Stage 0 is much larger than the others: a cut by bytes would not merge (0,1) and (2,3).
  b.Add("a", TensorKind::kModel, {1000}, 0, 0, 0);
  b.Add("b", TensorKind::kModel, {10}, 0, 1, 0);
  b.Add("c", TensorKind::kModel, {10}, 0, 2, 0);
  b.Add("d", TensorKind::kModel, {10}, 0, 3, 0);
  auto two = PlanNewLayout(b.meta(), Degrees{1, 2, 1});
  ASSERT_OK(two.status());
  EXPECT_EQ(StagesOf(*two), (std::map<std::string, uint32_t>{{"a", 0}, {"b", 0}, {"c", 1}, {"d", 1}}));
  auto one = PlanNewLayout(b.meta(), Degrees{1, 1, 1});
  ASSERT_OK(one.status());
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0].tensors.size(), 4u);
}

TEST(PlanNewLayout, SplitsStagesByBytesInNaturalNameOrder) {
  // Equal sizes: "layers.2" sorts before "layers.10" and stays on the first stage.
  MetaBuilder b(1, 1, 1);
  for (const char* name : {"layers.10.w", "layers.11.w", "layers.1.w", "layers.2.w"})
    b.Add(name, TensorKind::kModel, {256}, 0, 0, 0);
  auto plan = PlanNewLayout(b.meta(), Degrees{1, 2, 1});
  ASSERT_OK(plan.status());
  ASSERT_EQ(plan->size(), 2u);
  EXPECT_EQ(StagesOf(*plan), (std::map<std::string, uint32_t>{
                                 {"layers.1.w", 0}, {"layers.2.w", 0}, {"layers.10.w", 1}, {"layers.11.w", 1}}));

  // By bytes, not by count: the first tensor is half of everything and has a stage to itself.
  MetaBuilder c(1, 1, 1);
  c.Add("a", TensorKind::kModel, {300}, 0, 0, 0);
  for (const char* name : {"b", "c", "d"}) c.Add(name, TensorKind::kModel, {100}, 0, 0, 0);
  auto bytes = PlanNewLayout(c.meta(), Degrees{1, 2, 1});
  ASSERT_OK(bytes.status());
  EXPECT_EQ(StagesOf(*bytes), (std::map<std::string, uint32_t>{{"a", 0}, {"b", 1}, {"c", 1}, {"d", 1}}));
}

TEST(PlanNewLayout, CutsAllStagesByBytesForAnUnrelatedDegree) {
  // 2 -> 3: neither a multiple nor a divisor; the (stage, name) sequence is cut into three runs.
  MetaBuilder b(1, 2, 1);
  b.Add("x", TensorKind::kModel, {100}, 0, 0, 0);
  b.Add("y", TensorKind::kModel, {100}, 0, 0, 0);
  b.Add("a", TensorKind::kModel, {100}, 0, 1, 0);  // stage 1 comes after stage 0 whatever its name
  b.Add("b", TensorKind::kModel, {100}, 0, 1, 0);
  auto plan = PlanNewLayout(b.meta(), Degrees{1, 3, 1});
  ASSERT_OK(plan.status());
  EXPECT_EQ(StagesOf(*plan), (std::map<std::string, uint32_t>{{"x", 0}, {"y", 1}, {"a", 1}, {"b", 2}}));
}

TEST(PlanNewLayout, RefusesZeroDegreesAndTooManyRanks) {
  MetaBuilder b(1, 1, 1);
  b.Add("w", TensorKind::kModel, {4}, 0, 0, 0);
  for (Degrees d : {Degrees{0, 1, 1}, Degrees{1, 0, 1}, Degrees{1, 1, 0}, Degrees{257, 256, 1}, Degrees{65536, 1, 2},
                    Degrees{65536, 65536, 65536}}) {
    auto plan = PlanNewLayout(b.meta(), d);
    EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument)
        << d.tp << "x" << d.pp << "x" << d.shard << ": " << plan.status().ToString();
  }
  auto most = PlanNewLayout(b.meta(), Degrees{256, 16, 16});  // exactly 65536 ranks
  ASSERT_OK(most.status());
  EXPECT_EQ(most->size(), 65536u);
}

// ---------------------------------------------------------------------------------------------
// RelayoutCheckpoint end to end on a checkpoint written the way the daemon writes one.

constexpr char kJob[] = "relayout";
constexpr int64_t kStep = 700;
constexpr uint64_t kH = 100, kW = 100, kChunk = 4096;
constexpr char kWeight[] = "layers.0.w", kBias[] = "layers.0.b", kExpAvg[] = "layers.0.w.exp_avg";

EmaRecord SourceEma() {
  EmaRecord e;
  e.decay = 0.999;
  e.interval = 2;
  e.init = "first";
  e.model_params = "fp32";
  e.updates_applied = 42;
  e.updates_skipped = 3;
  e.last_step = 698;
  return e;
}

// Writes an ema file of `rank` as the daemon does: its own layout with EmaFileExtras, counters
// stamped. Tensor bytes are PatternByte(local byte, index, seed).
Status WriteEmaFile(const std::string& dir, uint32_t rank, const Topology& topology,
                    const std::vector<TensorSpec>& specs, uint32_t seed) {
  const EmaRecord record = SourceEma();
  ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout(kJob, rank, topology, specs, EmaFileExtras(record, kChunk)));
  testing::SlotBuffer slot(layout.slot_bytes);
  if (slot.data() == nullptr) return Internal("aligned_alloc failed");
  InitSlotImages(slot.data(), layout);
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    const Placement& p = layout.placements[t];
    for (uint64_t i = 0; i < p.bytes; ++i) slot.data()[p.slot_offset + i] = testing::PatternByte(i, t, seed);
  }
  for (size_t f = 0; f < layout.files.size(); ++f) {
    StampImage(slot.data(), layout, f, kStep);
    StampEmaCounters(slot.data(), layout, f, record.updates_applied, record.updates_skipped, record.last_step);
    const FileImage& image = layout.files[f];
    RETURN_IF_ERROR(WriteFileDurably(dir, image.stem + ".safetensors",
                                     std::string_view(slot.data() + image.slot_offset, image.file_bytes())));
  }
  return Status::OK();
}

// The source: (tp, pp, shard) = (2, 1, 2), rank = tp + 2 * shard, seed rank + 1.
//   layers.0.w         model [100, 100] fp32, rows cut over tp; written by shard 0 only.
//   layers.0.b         model [100] fp32, tp-replicated; written by tp 0, shard 0 only.
//   layers.0.w.exp_avg optimizer, the tp box of layers.0.w in flat ranges over the shard ranks.
//   ema                layers.0.w (tp box) and layers.0.b (tp 0) on shard 0, seed rank + 101.
Status WriteSource(const std::string& dir) {
  Topology t;
  t.world_size = 4;
  t.tp_degree = 2;
  t.shard_degree = 2;
  for (uint32_t rank = 0; rank < 4; ++rank) {
    t.tp_rank = rank % 2;
    t.shard_rank = rank / 2;
    const uint64_t rows = kH / 2, first = rows * t.tp_rank, half = rows * kW / 2;
    TensorSpec w = Spec(kWeight, TensorKind::kModel, DType::kF32, {rows, kW});
    w.global_shape = {kH, kW};
    w.box_offset = {first, 0};
    w.box_shape = {rows, kW};
    w.replica = t.shard_rank != 0;
    TensorSpec b = Spec(kBias, TensorKind::kModel, DType::kF32, {kW});
    b.replica = t.tp_rank != 0 || t.shard_rank != 0;
    TensorSpec m = Spec(kExpAvg, TensorKind::kOptimizer, DType::kF32, {half});
    m.global_shape = {kH, kW};
    m.box_offset = {first, 0};
    m.box_shape = {rows, kW};
    m.flat_range = FlatRange{half * t.shard_rank, half * (t.shard_rank + 1)};
    RETURN_IF_ERROR(testing::WriteRankFiles(dir, kJob, rank, t, {w, b, m}, kStep, rank + 1, kChunk));
    if (t.shard_rank == 0) {
      TensorSpec ew = w, eb = b;
      ew.kind = eb.kind = TensorKind::kEma;
      std::vector<TensorSpec> ema = {ew};
      if (t.tp_rank == 0) ema.push_back(eb);
      RETURN_IF_ERROR(WriteEmaFile(dir, rank, t, ema, rank + 101));
    }
  }
  return testing::WriteMetadata(dir);
}

// What the source holds, computed from the pattern: the whole global tensor, keyed "kind:name".
std::map<std::string, std::string> ExpectedTensors() {
  constexpr uint64_t kRowBytes = kW * 4, kRows = kH / 2, kHalf = kRows * kW / 2;
  std::map<std::string, std::string> out;
  std::string w(kH * kRowBytes, 0), ema_w(kH * kRowBytes, 0), opt(kH * kRowBytes, 0);
  for (uint64_t g = 0; g < kH; ++g) {
    const uint32_t tp = static_cast<uint32_t>(g / kRows);
    for (uint64_t c = 0; c < kRowBytes; ++c) {
      const uint64_t local = (g - tp * kRows) * kRowBytes + c;
      w[g * kRowBytes + c] = testing::PatternByte(local, 0, tp + 1);
      ema_w[g * kRowBytes + c] = testing::PatternByte(local, 0, tp + 101);
      const uint64_t element = local / 4, shard = element / kHalf;
      opt[g * kRowBytes + c] =
          testing::PatternByte((element - shard * kHalf) * 4 + c % 4, 2, static_cast<uint32_t>(tp + 2 * shard + 1));
    }
  }
  std::string b(kRowBytes, 0), ema_b(kRowBytes, 0);
  for (uint64_t i = 0; i < kRowBytes; ++i) {
    b[i] = testing::PatternByte(i, 1, 1);
    ema_b[i] = testing::PatternByte(i, 1, 101);
  }
  out[std::string("model:") + kWeight] = w;
  out[std::string("model:") + kBias] = b;
  out[std::string("optimizer:") + kExpAvg] = opt;
  out[std::string("ema:") + kWeight] = ema_w;
  out[std::string("ema:") + kBias] = ema_b;
  return out;
}

// Reads the whole global tensors of a checkpoint through FillSlotFromCheckpoint into one rank
// that holds all of them, keyed "kind:name".
Result<std::map<std::string, std::string>> ReadWholeTensors(const std::string& dir) {
  ASSIGN_OR_RETURN(CheckpointMetadata meta, ReadMetadataFile(dir));
  auto whole = [](const char* name, TensorKind kind, Shape shape) { return Spec(name, kind, DType::kF32, shape); };
  const std::vector<std::vector<TensorSpec>> groups = {
      {whole(kWeight, TensorKind::kModel, {kH, kW}), whole(kBias, TensorKind::kModel, {kW}),
       whole(kExpAvg, TensorKind::kOptimizer, {kH, kW})},
      {whole(kWeight, TensorKind::kEma, {kH, kW}), whole(kBias, TensorKind::kEma, {kW})}};
  std::map<std::string, std::string> out;
  for (const auto& specs : groups) {
    ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout(kJob, 0, Topology{}, specs));
    testing::SlotBuffer slot(layout.slot_bytes);
    if (slot.data() == nullptr) return Internal("aligned_alloc failed");
    RETURN_IF_ERROR(FillSlotFromCheckpoint(dir, meta, layout, slot.data()).status());
    for (size_t t = 0; t < layout.tensors.size(); ++t) {
      const TensorSpec& s = layout.tensors[t];
      const char* kind = s.kind == TensorKind::kModel ? "model:" : s.kind == TensorKind::kEma ? "ema:" : "optimizer:";
      out[kind + s.name] = std::string(slot.data() + layout.placements[t].slot_offset, layout.placements[t].bytes);
    }
  }
  return out;
}

// Where the first differing byte of each tensor lies, for a readable failure.
void ExpectSameTensors(const std::map<std::string, std::string>& got, const std::map<std::string, std::string>& want,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [key, bytes] : want) {
    auto it = got.find(key);
    ASSERT_NE(it, got.end()) << what << ": " << key;
    ASSERT_EQ(it->second.size(), bytes.size()) << what << ": " << key;
    auto diff = std::mismatch(bytes.begin(), bytes.end(), it->second.begin());
    EXPECT_TRUE(diff.first == bytes.end())
        << what << ": " << key << " differs first at byte " << (diff.first - bytes.begin()) << " of " << bytes.size();
  }
}

std::set<std::string> SafetensorsIn(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") names.insert(e.path().filename().string());
  }
  return names;
}

class RelayoutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(root_.ok());
    src_ = root_.File("src");
    ASSERT_EQ(::mkdir(src_.c_str(), 0755), 0);
    ASSERT_OK(WriteSource(src_));
  }

  // Reshards the source (or `from`) into root/<name> and checks everything but the tensor bytes.
  void Relayout(const std::string& from, const std::string& name, Degrees d) {
    const std::string dst = root_.File(name);
    RelayoutReport report;
    std::vector<uint32_t> progressed;
    ParallelLoop loop(2);
    ASSERT_OK(RelayoutCheckpoint(from, dst, d, kChunk, &loop, &report,
                                 [&](const NewRank& r, const RelayoutReport&) { progressed.push_back(r.rank); }));
    const uint32_t world = d.tp * d.pp * d.shard;
    std::vector<uint32_t> all(world);
    for (uint32_t r = 0; r < world; ++r) all[r] = r;
    EXPECT_EQ(progressed, all) << "progress once per new rank, in rank order";

    VerifyReport verified;
    ASSERT_OK(VerifyCheckpointDir(dst, &verified));
    EXPECT_EQ(verified.job, kJob);
    EXPECT_EQ(verified.step, kStep);

    auto meta = ReadMetadataFile(dst);
    ASSERT_OK(meta.status());
    EXPECT_EQ(meta->job, kJob);
    EXPECT_EQ(meta->step, kStep);
    EXPECT_EQ(meta->topology.world_size, world);
    EXPECT_EQ(meta->topology.tp_degree, d.tp);
    EXPECT_EQ(meta->topology.pp_degree, d.pp);
    EXPECT_EQ(meta->topology.shard_degree, d.shard);
    ASSERT_TRUE(meta->ema.has_value()) << "the EMA record is carried";
    const EmaRecord want = SourceEma();
    EXPECT_EQ(meta->ema->updates_applied, want.updates_applied);
    EXPECT_EQ(meta->ema->updates_skipped, want.updates_skipped);
    EXPECT_EQ(meta->ema->last_step, want.last_step);
    EXPECT_EQ(meta->ema->decay, want.decay);
    EXPECT_EQ(meta->ema->interval, want.interval);

    // Every new rank signals, and the signals list exactly the files of metadata.json.
    std::set<std::string> signalled;
    for (uint32_t r = 0; r < world; ++r) {
      auto signal = ReadSignal(root_.File(name + "/" + SignalFileName(r)));
      ASSERT_OK(signal.status());
      EXPECT_EQ(signal->rank, r);
      EXPECT_EQ(signal->step, kStep);
      for (const std::string& f : signal->files) EXPECT_TRUE(signalled.insert(f).second) << f << " signalled twice";
    }
    std::set<std::string> listed;
    for (const SavedFile& f : meta->files) listed.insert(f.name);
    EXPECT_EQ(signalled, listed);
    EXPECT_EQ(SafetensorsIn(dst), listed);

    std::set<uint32_t> writers;
    for (const SavedFile& f : meta->files) writers.insert(f.rank);
    EXPECT_EQ(report.ranks, writers.size());
    EXPECT_EQ(report.files, listed.size());
    uint64_t bytes = 0;
    for (const SavedFile& f : meta->files) bytes += f.bytes;
    EXPECT_EQ(report.bytes_written, bytes);
    EXPECT_GT(report.bytes_read, 0u);
  }

  // The pieces of `key` (of `kind`) in root/<name>/metadata.json.
  std::vector<Piece> PiecesOf(const std::string& name, const std::string& key, TensorKind kind) {
    std::vector<Piece> out;
    auto meta = ReadMetadataFile(root_.File(name));
    EXPECT_OK(meta.status());
    if (!meta.ok()) return out;
    for (const Piece& p : meta->pieces) {
      if (p.key == key && p.kind == kind) out.push_back(p);
    }
    std::sort(out.begin(), out.end(), [](const Piece& a, const Piece& b) { return a.file < b.file; });
    return out;
  }

  TempDir root_;
  std::string src_;
};

TEST_F(RelayoutTest, TheSourceHoldsWhatTheFixtureWrote) {
  auto src = ReadWholeTensors(src_);
  ASSERT_OK(src.status());
  ExpectSameTensors(*src, ExpectedTensors(), "source");
  ASSERT_OK(VerifyCheckpointDir(src_, nullptr));
}

TEST_F(RelayoutTest, ToOneRank) {
  ASSERT_OK(WriteFileDurably(src_, ExtraFileName(3), "{\"lr\": 0.1}"));  // belongs to a rank that goes away
  ASSERT_NO_FATAL_FAILURE(Relayout(src_, "one", Degrees{1, 1, 1}));
  auto got = ReadWholeTensors(root_.File("one"));
  ASSERT_OK(got.status());
  ExpectSameTensors(*got, ExpectedTensors(), "(1,1,1)");
  EXPECT_EQ(SafetensorsIn(root_.File("one")),
            (std::set<std::string>{"model_state.tp00_pp00_shard00.safetensors",
                                   "optimizer.tp00_pp00_shard00.safetensors", "ema.tp00_pp00_shard00.safetensors"}));
  EXPECT_FALSE(std::filesystem::exists(root_.File("one/" + ExtraFileName(3))));
  EXPECT_FALSE(std::filesystem::exists(root_.File("one/" + ExtraFileName(0))));
  // The optimizer state was saved as flat ranges: it stays one flat range of the whole box.
  auto opt = PiecesOf("one", kExpAvg, TensorKind::kOptimizer);
  ASSERT_EQ(opt.size(), 1u);
  ASSERT_TRUE(opt[0].flat_range.has_value());
  EXPECT_EQ(opt[0].flat_range->begin, 0u);
  EXPECT_EQ(opt[0].flat_range->end, kH * kW);
}

TEST_F(RelayoutTest, ToThreeTpRanksUnevenly) {
  ASSERT_NO_FATAL_FAILURE(Relayout(src_, "tp3", Degrees{3, 1, 1}));
  auto got = ReadWholeTensors(root_.File("tp3"));
  ASSERT_OK(got.status());
  ExpectSameTensors(*got, ExpectedTensors(), "(3,1,1)");
  // 100 rows over 3 ranks: 34, 34, 32.
  for (TensorKind kind : {TensorKind::kModel, TensorKind::kEma, TensorKind::kOptimizer}) {
    const std::string key = kind == TensorKind::kOptimizer ? kExpAvg : kWeight;
    auto pieces = PiecesOf("tp3", key, kind);
    ASSERT_EQ(pieces.size(), 3u) << key;
    for (uint32_t t = 0; t < 3; ++t) {
      EXPECT_EQ(pieces[t].box_offset, (Shape{34 * t, 0})) << key << " tp " << t;
      EXPECT_EQ(pieces[t].box_shape, (Shape{t == 2 ? 32u : 34u, kW})) << key << " tp " << t;
    }
  }
  auto bias = PiecesOf("tp3", kBias, TensorKind::kModel);
  ASSERT_EQ(bias.size(), 1u);
  EXPECT_EQ(bias[0].file, "model_state.tp00_pp00_shard00.safetensors");
}

TEST_F(RelayoutTest, ToThreeShardRanks) {
  ASSERT_NO_FATAL_FAILURE(Relayout(src_, "shard3", Degrees{1, 1, 3}));
  auto got = ReadWholeTensors(root_.File("shard3"));
  ASSERT_OK(got.status());
  ExpectSameTensors(*got, ExpectedTensors(), "(1,1,3)");
  // 10000 elements over 3 shard ranks: 3334, 3334, 3332; the model and EMA on shard 0 only.
  auto opt = PiecesOf("shard3", kExpAvg, TensorKind::kOptimizer);
  ASSERT_EQ(opt.size(), 3u);
  for (uint32_t s = 0; s < 3; ++s) {
    EXPECT_EQ(opt[s].file, FileStem("optimizer", 0, 0, s) + ".safetensors");
    ASSERT_TRUE(opt[s].flat_range.has_value());
    EXPECT_EQ(opt[s].flat_range->begin, 3334u * s);
    EXPECT_EQ(opt[s].flat_range->end, std::min<uint64_t>(3334u * (s + 1), kH * kW));
  }
  for (TensorKind kind : {TensorKind::kModel, TensorKind::kEma}) {
    auto w = PiecesOf("shard3", kWeight, kind);
    ASSERT_EQ(w.size(), 1u);
    EXPECT_NE(w[0].file.find("shard00"), std::string::npos) << w[0].file;
  }
}

TEST_F(RelayoutTest, ToEightStagesSomeOfThemEmpty) {
  // Five (tensor, kind) pairs cut by bytes into 8 stages: the ranks of stages 2, 3, 5 and 7 hold
  // nothing and still signal, each tensor lies whole in one stage.
  ASSERT_NO_FATAL_FAILURE(Relayout(src_, "pp8", Degrees{1, 8, 1}));
  auto got = ReadWholeTensors(root_.File("pp8"));
  ASSERT_OK(got.status());
  ExpectSameTensors(*got, ExpectedTensors(), "(1,8,1)");
  auto meta = ReadMetadataFile(root_.File("pp8"));
  ASSERT_OK(meta.status());
  std::set<uint32_t> stages;
  for (const SavedFile& f : meta->files) stages.insert(f.pp_rank);
  EXPECT_EQ(stages, (std::set<uint32_t>{0, 1, 4, 6}));
  for (uint32_t r : {2u, 3u, 5u, 7u}) {
    auto signal = ReadSignal(root_.File("pp8/" + SignalFileName(r)));
    ASSERT_OK(signal.status());
    EXPECT_TRUE(signal->files.empty()) << "rank " << r;
  }
  for (const Piece& p : meta->pieces) {
    EXPECT_EQ(p.box_shape, p.global_shape) << p.key << " in " << p.file;
    if (p.flat_range) {  // saved as flat ranges: one range of the whole tensor at shard_degree 1
      EXPECT_EQ(p.flat_range->begin, 0u) << p.key;
      EXPECT_EQ(p.flat_range->end, kH * kW) << p.key;
    }
  }
}

TEST_F(RelayoutTest, RoundTripGivesBackTheSameFiles) {
  ASSERT_NO_FATAL_FAILURE(Relayout(src_, "tp3", Degrees{3, 1, 1}));
  ASSERT_NO_FATAL_FAILURE(Relayout(root_.File("tp3"), "back", Degrees{2, 1, 2}));
  auto got = ReadWholeTensors(root_.File("back"));
  ASSERT_OK(got.status());
  ExpectSameTensors(*got, ExpectedTensors(), "(2,1,2) -> (3,1,1) -> (2,1,2)");
  // The source layout is what the planner makes for (2, 1, 2), so the files come back byte for byte.
  const std::set<std::string> names = SafetensorsIn(src_);
  ASSERT_EQ(SafetensorsIn(root_.File("back")), names);
  for (const std::string& name : names) {
    auto a = ReadSmallFile(src_ + "/" + name, 1 << 24);
    auto b = ReadSmallFile(root_.File("back/" + name), 1 << 24);
    ASSERT_OK(a.status());
    ASSERT_OK(b.status());
    EXPECT_TRUE(*a == *b) << name << " differs after the round trip";
  }
}

TEST_F(RelayoutTest, RefusesADestinationThatIsNotEmpty) {
  const std::string dst = root_.File("busy");
  ASSERT_EQ(::mkdir(dst.c_str(), 0755), 0);
  ASSERT_OK(WriteFileDurably(dst, "keep.txt", "mine"));
  Status s = RelayoutCheckpoint(src_, dst, Degrees{1, 1, 1}, kChunk, nullptr, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists) << s.ToString();
  auto names = ListDir(dst);
  ASSERT_OK(names.status());
  EXPECT_EQ(*names, std::vector<std::string>{"keep.txt"}) << "nothing written";

  ASSERT_OK(WriteFileDurably(root_.path(), "plain", "a file"));
  s = RelayoutCheckpoint(src_, root_.File("plain"), Degrees{1, 1, 1}, kChunk, nullptr, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists) << s.ToString();

  // An empty directory is fine.
  const std::string empty = root_.File("empty");
  ASSERT_EQ(::mkdir(empty.c_str(), 0755), 0);
  ASSERT_OK(RelayoutCheckpoint(src_, empty, Degrees{1, 1, 1}, kChunk, nullptr, nullptr));
  ASSERT_OK(VerifyCheckpointDir(empty, nullptr));
}

TEST_F(RelayoutTest, RefusesAnIncompleteSourceWithoutCreatingTheDestination) {
  ASSERT_EQ(::unlink((src_ + "/metadata.json").c_str()), 0);
  const std::string dst = root_.File("out");
  Status s = RelayoutCheckpoint(src_, dst, Degrees{1, 1, 1}, kChunk, nullptr, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_NE(s.message().find("metadata.json"), std::string::npos) << s.ToString();
  EXPECT_FALSE(std::filesystem::exists(dst));
}

TEST_F(RelayoutTest, RefusesBadDegreesAndChunksWithoutCreatingTheDestination) {
  const std::string dst = root_.File("out");
  Status s = RelayoutCheckpoint(src_, dst, Degrees{0, 1, 1}, kChunk, nullptr, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_FALSE(std::filesystem::exists(dst));
  s = RelayoutCheckpoint(src_, dst, Degrees{1, 1, 1}, 1000, nullptr, nullptr);
  EXPECT_FALSE(s.ok());
  EXPECT_FALSE(std::filesystem::exists(dst));
}

TEST_F(RelayoutTest, RefusesMisplacedPiecesWithoutWritingAnything) {
  // metadata.json swaps the flat ranges of the two shards of one tp box: every checksum still
  // matches, but resharding would write each half of the optimizer state where the other belongs.
  const std::string shard0 = "optimizer.tp01_pp00_shard00.safetensors";
  const std::string shard1 = "optimizer.tp01_pp00_shard01.safetensors";
  ASSERT_OK(testing::SwapPlacements(src_, kExpAvg, shard0, shard1));
  const std::string dst = root_.File("out");
  RelayoutReport report;
  ParallelLoop loop(2);
  Status s = RelayoutCheckpoint(src_, dst, Degrees{1, 1, 1}, kChunk, &loop, &report);
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
  for (const std::string& word : {std::string("tensor '") + kExpAvg + "'", std::string("flat range"),
                                  std::string("metadata.json"), std::string("optimizer.tp01_pp00_shard0")}) {
    EXPECT_NE(s.message().find(word), std::string::npos) << "'" << word << "' in " << s.ToString();
  }
  EXPECT_FALSE(std::filesystem::exists(dst)) << "the destination was created";
  EXPECT_EQ(report.files, 0u);
  // verify refuses the source for the same reason.
  Status verified = VerifyCheckpointDir(src_, nullptr);
  EXPECT_EQ(verified.code(), StatusCode::kCorruption) << verified.ToString();
  EXPECT_NE(verified.message().find("flat range"), std::string::npos) << verified.ToString();
}

TEST_F(RelayoutTest, StopsAtACorruptSourcePieceWithoutMetadata) {
  auto meta = ReadMetadataFile(src_);
  ASSERT_OK(meta.status());
  const std::string file = "optimizer.tp01_pp00_shard01.safetensors";
  const Piece* piece = nullptr;
  for (const Piece& p : meta->pieces) {
    if (p.file == file && p.key == kExpAvg) piece = &p;
  }
  ASSERT_NE(piece, nullptr);
  ASSERT_OK(FlipByte(src_ + "/" + file, piece->begin + (piece->end - piece->begin) / 2));
  const std::string dst = root_.File("out");
  RelayoutReport report;
  Status s = RelayoutCheckpoint(src_, dst, Degrees{1, 1, 1}, kChunk, nullptr, &report);
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
  EXPECT_NE(s.message().find(file), std::string::npos) << s.ToString();
  EXPECT_FALSE(std::filesystem::exists(dst + "/metadata.json"));
}

}  // namespace
}  // namespace flashckpt

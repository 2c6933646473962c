#include "common/read/reshard.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/base/dtype.h"
#include "common/format/layout.h"
#include "common/format/metadata.h"
#include "testing.h"

namespace flashckpt {
namespace {

constexpr char kKey[] = "layers.0.mlp.weight";

uint64_t Numel(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

std::string Dims(const std::vector<uint64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Global coordinates of element `f` of the row-major flattening of a box.
std::vector<uint64_t> BoxCoords(const std::vector<uint64_t>& off, const std::vector<uint64_t>& shape, uint64_t f) {
  std::vector<uint64_t> c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    c[d] = off[d] + f % shape[d];
    f /= shape[d];
  }
  return c;
}

uint64_t GlobalLinear(const std::vector<uint64_t>& global, const std::vector<uint64_t>& coords) {
  uint64_t g = 0;
  for (size_t d = 0; d < global.size(); ++d) g = g * global[d] + coords[d];
  return g;
}

// Element values are the global linear index, little-endian in the element's bytes (at least 2
// bytes per element, enough for every test shape).
void Encode(uint8_t* p, size_t elem, uint64_t v) {
  for (size_t i = 0; i < elem; ++i) p[i] = static_cast<uint8_t>(i < 8 ? v >> (8 * i) : 0);
}
uint64_t Decode(const uint8_t* p, size_t elem) {
  uint64_t v = 0;
  for (size_t i = 0; i < elem && i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

// A piece's place: a box of the global tensor and optionally a flat range of it.
struct Box {
  std::vector<uint64_t> offset, shape;
  std::optional<FlatRange> flat;

  uint64_t FlatBegin() const { return flat ? flat->begin : 0; }
  uint64_t FlatEnd() const { return flat ? flat->end : Numel(shape); }
};

// Saved pieces with an in-memory "file" each, every element holding its global linear index.
class FakeCheckpoint {
 public:
  FakeCheckpoint(std::vector<uint64_t> global, DType dtype) : global_(std::move(global)), dtype_(dtype) {}

  void Add(const Box& box, const std::string& file = "") {
    const size_t elem = DTypeSize(dtype_);
    Piece p;
    p.key = kKey;
    p.kind = TensorKind::kOptimizer;
    p.dtype = dtype_;
    p.global_shape = global_;
    p.box_offset = box.offset;
    p.box_shape = box.shape;
    p.flat_range = box.flat;
    p.shape = box.flat ? std::vector<uint64_t>{box.FlatEnd() - box.FlatBegin()} : box.shape;
    p.file = file.empty() ? "file" + std::to_string(pieces_.size()) + ".safetensors" : file;
    p.begin = 4096 + 24 * pieces_.size();  // a header before the data, different per file
    p.end = p.begin + (box.FlatEnd() - box.FlatBegin()) * elem;
    std::vector<uint8_t> bytes(p.end + 13, 0xEE);
    for (uint64_t f = box.FlatBegin(); f < box.FlatEnd(); ++f) {
      Encode(&bytes[p.begin + (f - box.FlatBegin()) * elem], elem,
             GlobalLinear(global_, BoxCoords(box.offset, box.shape, f)));
    }
    pieces_.push_back(std::move(p));
    files_.push_back(std::move(bytes));
  }

  std::vector<const Piece*> Pointers() const {
    std::vector<const Piece*> out;
    for (const auto& p : pieces_) out.push_back(&p);
    return out;
  }
  const std::vector<Piece>& pieces() const { return pieces_; }
  std::vector<Piece>& mutable_pieces() { return pieces_; }
  const std::vector<uint64_t>& global() const { return global_; }
  DType dtype() const { return dtype_; }

  // Whether some piece holds the element at global coordinates `c`.
  bool Covers(const std::vector<uint64_t>& c) const {
    for (const auto& p : pieces_) {
      bool in = true;
      uint64_t f = 0;
      for (size_t d = 0; d < c.size(); ++d) {
        if (c[d] < p.box_offset[d] || c[d] >= p.box_offset[d] + p.box_shape[d]) in = false;
        if (in) f = f * p.box_shape[d] + (c[d] - p.box_offset[d]);
      }
      if (!in) continue;
      if (p.flat_range && (f < p.flat_range->begin || f >= p.flat_range->end)) continue;
      return true;
    }
    return false;
  }

  // Executes `plan` into the local buffer of `want` and checks it against the reference: every
  // byte written exactly once, every element the right global index, each run inside its piece,
  // runs in destination order and merged as far as possible.
  ::testing::AssertionResult Check(const TensorSpec& want_in, const ReshardPlan& plan) const {
    auto normalized = NormalizeTensorSpec(want_in);
    if (!normalized.ok()) return ::testing::AssertionFailure() << normalized.status().ToString();
    const TensorSpec& want = *normalized;
    const size_t elem = DTypeSize(dtype_);
    Box box{want.box_offset, want.box_shape, want.flat_range};
    const uint64_t count = box.FlatEnd() - box.FlatBegin();
    if (plan.bytes != count * elem) {
      return ::testing::AssertionFailure() << "plan.bytes " << plan.bytes << " != " << count * elem;
    }
    std::vector<uint8_t> dest(count * elem, 0);
    std::vector<uint8_t> writes(count * elem, 0);
    uint64_t total = 0;
    for (size_t i = 0; i < plan.runs.size(); ++i) {
      const ReadRun& r = plan.runs[i];
      if (r.piece >= pieces_.size()) return ::testing::AssertionFailure() << "run " << i << ": bad piece";
      const Piece& p = pieces_[r.piece];
      if (r.bytes == 0 || r.file_offset < p.begin || r.file_offset + r.bytes > p.end ||
          r.dest_offset + r.bytes > dest.size() || (r.file_offset - p.begin) % elem != 0 || r.dest_offset % elem != 0 ||
          r.bytes % elem != 0) {
        return ::testing::AssertionFailure() << "run " << i << " out of bounds: piece " << r.piece << " file "
                                             << r.file_offset << " dest " << r.dest_offset << " bytes " << r.bytes;
      }
      if (i > 0) {
        const ReadRun& q = plan.runs[i - 1];
        if (q.dest_offset >= r.dest_offset) return ::testing::AssertionFailure() << "runs not in dest order";
        if (q.piece == r.piece && q.file_offset + q.bytes == r.file_offset &&
            q.dest_offset + q.bytes == r.dest_offset) {
          return ::testing::AssertionFailure() << "runs " << i - 1 << " and " << i << " should have been merged";
        }
      }
      std::memcpy(&dest[r.dest_offset], &files_[r.piece][r.file_offset], r.bytes);
      for (uint64_t b = 0; b < r.bytes; ++b) ++writes[r.dest_offset + b];
      total += r.bytes;
    }
    if (total != plan.bytes) return ::testing::AssertionFailure() << "runs hold " << total << " bytes";
    for (uint64_t k = 0; k < count; ++k) {
      if (writes[k * elem] != 1) {
        return ::testing::AssertionFailure() << "element " << k << " written " << int{writes[k * elem]} << " times";
      }
      const uint64_t expected = GlobalLinear(global_, BoxCoords(box.offset, box.shape, box.FlatBegin() + k));
      const uint64_t got = Decode(&dest[k * elem], elem);
      if (got != expected) {
        return ::testing::AssertionFailure()
               << "element " << k << " holds global index " << got << ", expected " << expected;
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  std::vector<uint64_t> global_;
  DType dtype_;
  std::vector<Piece> pieces_;
  std::vector<std::vector<uint8_t>> files_;
};

TensorSpec Want(const std::vector<uint64_t>& global, const Box& box, DType dtype = DType::kF32) {
  TensorSpec s;
  s.name = kKey;
  s.kind = TensorKind::kOptimizer;
  s.dtype = dtype;
  s.global_shape = global;
  s.box_offset = box.offset;
  s.box_shape = box.shape;
  s.flat_range = box.flat;
  s.shape = box.flat ? std::vector<uint64_t>{box.FlatEnd() - box.FlatBegin()} : box.shape;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Megatron-style layouts: a [H, H] weight saved by tp = 2 row blocks, each flattened and split
// into D = 2 flat ranges by the distributed optimizer, so the ranges straddle rows (H = 10: a row
// block holds 50 elements, a range 25, two and a half rows).

constexpr uint64_t kH = 10;

// Row blocks of `sizes` rows, each split into `shards` near-equal flat ranges (shards == 0: whole
// boxes without a flat range).
std::vector<Box> RowBlocks(const std::vector<uint64_t>& sizes, uint64_t shards) {
  std::vector<Box> boxes;
  uint64_t row = 0;
  for (uint64_t rows : sizes) {
    Box b{{row, 0}, {rows, kH}, std::nullopt};
    if (shards == 0) {
      boxes.push_back(b);
    } else {
      const uint64_t n = rows * kH;
      for (uint64_t s = 0; s < shards; ++s) {
        b.flat = FlatRange{n * s / shards, n * (s + 1) / shards};
        boxes.push_back(b);
      }
    }
    row += rows;
  }
  return boxes;
}

FakeCheckpoint MegatronSaved() {
  FakeCheckpoint ckpt({kH, kH}, DType::kF32);
  uint64_t tp = 0;
  for (const Box& b : RowBlocks({5, 5}, 2)) {
    const uint64_t shard = b.flat->begin == 0 ? 0 : 1;
    ckpt.Add(b, "optimizer.tp0" + std::to_string(tp) + "_pp00_shard0" + std::to_string(shard) + ".safetensors");
    if (shard == 1) ++tp;
  }
  return ckpt;
}

// Plans and checks every wanted box; returns the run count of each plan.
std::vector<size_t> PlanAll(const FakeCheckpoint& ckpt, const std::vector<Box>& wanted) {
  std::vector<size_t> counts;
  for (const Box& b : wanted) {
    TensorSpec want = Want(ckpt.global(), b, ckpt.dtype());
    auto plan = PlanPieceReads(want, ckpt.Pointers());
    EXPECT_OK(plan.status());
    if (!plan.ok()) return counts;
    EXPECT_TRUE(ckpt.Check(want, *plan)) << "box offset " << Dims(b.offset) << " shape " << Dims(b.shape);
    counts.push_back(plan->runs.size());
  }
  return counts;
}

TEST(PlanPieceReads, MegatronToTp1) {
  FakeCheckpoint ckpt = MegatronSaved();
  // The four saved ranges follow each other in the full tensor: one read per saved piece.
  EXPECT_EQ(PlanAll(ckpt, RowBlocks({10}, 0)), (std::vector<size_t>{4}));
}

TEST(PlanPieceReads, MegatronToTp4) {
  FakeCheckpoint ckpt = MegatronSaved();
  // Rows 3, 3, 2, 2: rows 3..5 span both tp blocks, rows 6..7 the range boundary in row 7.
  EXPECT_EQ(PlanAll(ckpt, RowBlocks({3, 3, 2, 2}, 0)), (std::vector<size_t>{2, 2, 2, 1}));
}

TEST(PlanPieceReads, MegatronToUnevenTp3) {
  FakeCheckpoint ckpt = MegatronSaved();
  EXPECT_EQ(PlanAll(ckpt, RowBlocks({4, 4, 2}, 0)), (std::vector<size_t>{2, 3, 1}));
}

TEST(PlanPieceReads, MegatronToShard3) {
  FakeCheckpoint ckpt = MegatronSaved();
  // Same tp blocks, ranges of 16/17/17 elements instead of 25/25.
  EXPECT_EQ(PlanAll(ckpt, RowBlocks({5, 5}, 3)), (std::vector<size_t>{1, 2, 1, 1, 2, 1}));
  // tp = 1 with shard 3 over the full tensor: ranges of 33/33/34 elements.
  EXPECT_EQ(PlanAll(ckpt, RowBlocks({10}, 3)), (std::vector<size_t>{2, 2, 2}));
  // tp = 3 and shard 3 together.
  for (size_t runs : PlanAll(ckpt, RowBlocks({4, 4, 2}, 3))) EXPECT_LE(runs, 2u);
}

TEST(PlanPieceReads, SameLayoutIsOneRunPerPiece) {
  FakeCheckpoint ckpt = MegatronSaved();
  const auto& pieces = ckpt.pieces();
  for (size_t i = 0; i < pieces.size(); ++i) {
    Box b{pieces[i].box_offset, pieces[i].box_shape, pieces[i].flat_range};
    auto plan = PlanPieceReads(Want(ckpt.global(), b), ckpt.Pointers());
    ASSERT_OK(plan.status());
    ASSERT_EQ(plan->runs.size(), 1u);
    EXPECT_EQ(plan->runs[0].piece, i);
    EXPECT_EQ(plan->runs[0].file_offset, pieces[i].begin);
    EXPECT_EQ(plan->runs[0].dest_offset, 0u);
    EXPECT_EQ(plan->runs[0].bytes, pieces[i].end - pieces[i].begin);
    EXPECT_EQ(plan->bytes, pieces[i].end - pieces[i].begin);
  }
}

TEST(PlanPieceReads, FullTensorFromTwoRowBlocksIsTwoRuns) {
  FakeCheckpoint ckpt({kH, kH}, DType::kBF16);
  for (const Box& b : RowBlocks({5, 5}, 0)) ckpt.Add(b);
  EXPECT_EQ(PlanAll(ckpt, RowBlocks({10}, 0)), (std::vector<size_t>{2}));
  // Sub-boxes of full rows stay one run each.
  EXPECT_EQ(PlanAll(ckpt, RowBlocks({3, 2, 4, 1}, 0)), (std::vector<size_t>{1, 1, 1, 1}));
}

TEST(PlanPieceReads, ColumnBlocksReadRowByRow) {
  // tp splitting the last dimension: each row of the full tensor alternates between the two files.
  FakeCheckpoint ckpt({kH, kH}, DType::kF32);
  ckpt.Add(Box{{0, 0}, {kH, 4}, std::nullopt});
  ckpt.Add(Box{{0, 4}, {kH, 6}, std::nullopt});
  EXPECT_EQ(PlanAll(ckpt, RowBlocks({10}, 0)), (std::vector<size_t>{2 * kH}));
  // A column block restored as is: one run.
  EXPECT_EQ(PlanAll(ckpt, {Box{{0, 4}, {kH, 6}, std::nullopt}}), (std::vector<size_t>{1}));
}

TEST(PlanPieceReads, ReplicasAreReadOnce) {
  FakeCheckpoint ckpt({kH, kH}, DType::kF32);
  ckpt.Add(Box{{0, 0}, {6, kH}, std::nullopt});         // rows 0..5
  for (const Box& b : RowBlocks({10}, 3)) ckpt.Add(b);  // a full copy, three ranges
  ckpt.Add(Box{{0, 0}, {kH, kH}, std::nullopt});        // another full copy
  auto plan = PlanPieceReads(Want(ckpt.global(), RowBlocks({10}, 0)[0]), ckpt.Pointers());
  ASSERT_OK(plan.status());
  EXPECT_TRUE(ckpt.Check(Want(ckpt.global(), RowBlocks({10}, 0)[0]), *plan));
  // Rows 0..5 from the first piece, the rest from the ranges that hold it (the first to hold it).
  ASSERT_EQ(plan->runs.size(), 3u);
  EXPECT_EQ(plan->runs[0].piece, 0u);
  EXPECT_EQ(plan->runs[0].bytes, 60u * 4);
  EXPECT_EQ(plan->runs[1].piece, 2u);  // elements 60..65 of range [33, 66)
  EXPECT_EQ(plan->runs[1].bytes, 6u * 4);
  EXPECT_EQ(plan->runs[2].piece, 3u);
  EXPECT_EQ(plan->runs[2].bytes, 34u * 4);
}

// ---------------------------------------------------------------------------------------------
// Errors.

TEST(PlanPieceReads, MissingRowBlockIsNotFound) {
  FakeCheckpoint ckpt({kH, kH}, DType::kF32);
  ckpt.Add(RowBlocks({5, 5}, 0)[0]);
  auto plan = PlanPieceReads(Want(ckpt.global(), RowBlocks({10}, 0)[0]), ckpt.Pointers());
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kNotFound);
  EXPECT_NE(plan.status().message().find(kKey), std::string::npos) << plan.status().ToString();
  EXPECT_NE(plan.status().message().find("position [5, 0]"), std::string::npos) << plan.status().ToString();
  // The rows that are there still plan.
  EXPECT_EQ(PlanAll(ckpt, RowBlocks({5}, 0)), (std::vector<size_t>{1}));
}

TEST(PlanPieceReads, MissingFlatRangeNamesFirstUncoveredElement) {
  FakeCheckpoint full = MegatronSaved();
  FakeCheckpoint ckpt({kH, kH}, DType::kF32);
  for (size_t i = 0; i < full.pieces().size(); ++i) {
    if (i == 1) continue;  // tp 0, shard 1: box-flat [25, 50) of rows 0..4, starts at row 2 column 5
    const Piece& p = full.pieces()[i];
    ckpt.Add(Box{p.box_offset, p.box_shape, p.flat_range});
  }
  auto plan = PlanPieceReads(Want(ckpt.global(), RowBlocks({3, 3, 2, 2}, 0)[0]), ckpt.Pointers());
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kNotFound);
  EXPECT_NE(plan.status().message().find("position [2, 5]"), std::string::npos) << plan.status().ToString();
}

TEST(PlanPieceReads, NoSavedPiecesIsNotFound) {
  auto plan = PlanPieceReads(Want({3, 4}, Box{{0, 0}, {3, 4}, std::nullopt}), {});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kNotFound);
  EXPECT_NE(plan.status().message().find("position [0, 0]"), std::string::npos) << plan.status().ToString();
}

TEST(PlanPieceReads, DtypeMismatchIsInvalidArgument) {
  FakeCheckpoint ckpt = MegatronSaved();
  auto plan = PlanPieceReads(Want(ckpt.global(), RowBlocks({10}, 0)[0], DType::kBF16), ckpt.Pointers());
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  const std::string& m = plan.status().message();
  EXPECT_NE(m.find(kKey), std::string::npos) << m;
  EXPECT_NE(m.find("BF16"), std::string::npos) << m;
  EXPECT_NE(m.find("F32"), std::string::npos) << m;
}

TEST(PlanPieceReads, GlobalShapeMismatchIsInvalidArgument) {
  FakeCheckpoint ckpt = MegatronSaved();
  auto plan = PlanPieceReads(Want({kH, 12}, Box{{0, 0}, {kH, 12}, std::nullopt}), ckpt.Pointers());
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  const std::string& m = plan.status().message();
  EXPECT_NE(m.find(kKey), std::string::npos) << m;
  EXPECT_NE(m.find("[10, 12]"), std::string::npos) << m;
  EXPECT_NE(m.find("[10, 10]"), std::string::npos) << m;
  // A different rank is a different global shape too.
  auto flat = PlanPieceReads(Want({kH * kH}, Box{{0}, {kH * kH}, std::nullopt}), ckpt.Pointers());
  EXPECT_EQ(flat.status().code(), StatusCode::kInvalidArgument);
}

TEST(PlanPieceReads, ForeignOrNullPieceIsInvalidArgument) {
  FakeCheckpoint ckpt = MegatronSaved();
  const TensorSpec want = Want(ckpt.global(), RowBlocks({10}, 0)[0]);
  std::vector<const Piece*> saved = ckpt.Pointers();
  saved.push_back(nullptr);
  EXPECT_EQ(PlanPieceReads(want, saved).status().code(), StatusCode::kInvalidArgument);
  Piece other = ckpt.pieces()[0];
  other.key = "other";
  saved.back() = &other;
  auto plan = PlanPieceReads(want, saved);
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("'other'"), std::string::npos) << plan.status().ToString();
}

TEST(PlanPieceReads, InconsistentSavedPieceIsCorruption) {
  const TensorSpec want = Want({kH, kH}, RowBlocks({10}, 0)[0]);
  {
    FakeCheckpoint ckpt = MegatronSaved();
    ckpt.mutable_pieces()[2].end -= 4;  // one element short
    auto plan = PlanPieceReads(want, ckpt.Pointers());
    EXPECT_EQ(plan.status().code(), StatusCode::kCorruption);
    EXPECT_NE(plan.status().message().find("optimizer.tp01_pp00_shard00"), std::string::npos)
        << plan.status().ToString();
  }
  {
    FakeCheckpoint ckpt = MegatronSaved();
    ckpt.mutable_pieces()[3].box_offset = {6, 0};  // rows 6..10 leave the tensor
    EXPECT_EQ(PlanPieceReads(want, ckpt.Pointers()).status().code(), StatusCode::kCorruption);
  }
  {
    FakeCheckpoint ckpt = MegatronSaved();
    ckpt.mutable_pieces()[0].flat_range = FlatRange{0, 51};  // beyond the 50-element box
    ckpt.mutable_pieces()[0].end = ckpt.mutable_pieces()[0].begin + 51 * 4;
    EXPECT_EQ(PlanPieceReads(want, ckpt.Pointers()).status().code(), StatusCode::kCorruption);
  }
  {
    FakeCheckpoint ckpt = MegatronSaved();
    ckpt.mutable_pieces()[0].box_shape = {5};  // rank differs from the global shape
    EXPECT_EQ(PlanPieceReads(want, ckpt.Pointers()).status().code(), StatusCode::kCorruption);
  }
  {
    // Element counts and byte sizes beyond 64 bits do not wrap around.
    const uint64_t big = uint64_t{1} << 33;
    Piece p;
    p.key = kKey;
    p.dtype = DType::kF32;
    p.global_shape = p.box_shape = {big, big, 4};
    p.box_offset = {0, 0, 0};
    p.end = 16;
    TensorSpec w = Want({big, big, 4}, Box{{0, 0, 0}, {1, 1, 4}, std::nullopt});
    EXPECT_EQ(PlanPieceReads(w, {&p}).status().code(), StatusCode::kCorruption);
    p.global_shape = p.box_shape = {big, big / 2, 1};
    w = Want({big, big / 2, 1}, Box{{0, 0, 0}, {1, 1, 1}, std::nullopt});
    EXPECT_EQ(PlanPieceReads(w, {&p}).status().code(), StatusCode::kCorruption);  // 2^65 bytes
  }
}

TEST(PlanPieceReads, MalformedWantIsInvalidArgument) {
  FakeCheckpoint ckpt = MegatronSaved();
  TensorSpec want = Want(ckpt.global(), Box{{0, 0}, {kH, kH}, FlatRange{10, 101}});
  EXPECT_EQ(PlanPieceReads(want, ckpt.Pointers()).status().code(), StatusCode::kInvalidArgument);
  want = Want(ckpt.global(), Box{{8, 0}, {3, kH}, std::nullopt});
  EXPECT_EQ(PlanPieceReads(want, ckpt.Pointers()).status().code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Edge shapes.

TEST(PlanPieceReads, ZeroDimensionalTensor) {
  FakeCheckpoint ckpt({}, DType::kF64);
  ckpt.Add(Box{{}, {}, std::nullopt});
  ckpt.Add(Box{{}, {}, std::nullopt});  // a replica
  TensorSpec want = Want({}, Box{{}, {}, std::nullopt}, DType::kF64);
  auto plan = PlanPieceReads(want, ckpt.Pointers());
  ASSERT_OK(plan.status());
  EXPECT_TRUE(ckpt.Check(want, *plan));
  ASSERT_EQ(plan->runs.size(), 1u);
  EXPECT_EQ(plan->runs[0].piece, 0u);
  EXPECT_EQ(plan->bytes, 8u);
  // Defaults left empty: the spec of an unsharded scalar.
  TensorSpec bare;
  bare.name = kKey;
  bare.dtype = DType::kF64;
  plan = PlanPieceReads(bare, ckpt.Pointers());
  ASSERT_OK(plan.status());
  EXPECT_EQ(plan->runs.size(), 1u);
  // A saved scalar in a flat range of one element, and an empty one before it.
  FakeCheckpoint flat({}, DType::kF64);
  flat.Add(Box{{}, {}, FlatRange{0, 0}});
  flat.Add(Box{{}, {}, FlatRange{0, 1}});
  plan = PlanPieceReads(want, flat.Pointers());
  ASSERT_OK(plan.status());
  EXPECT_TRUE(flat.Check(want, *plan));
  EXPECT_EQ(plan->runs[0].piece, 1u);
  // No piece at all.
  auto missing = PlanPieceReads(want, {});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("position []"), std::string::npos) << missing.status().ToString();
}

TEST(PlanPieceReads, ZeroSizedDimensions) {
  for (const std::vector<uint64_t>& global : {std::vector<uint64_t>{0, 5}, {4, 0}, {3, 0, 2}}) {
    FakeCheckpoint ckpt(global, DType::kF32);
    ckpt.Add(Box{std::vector<uint64_t>(global.size(), 0), global, std::nullopt});
    TensorSpec want = Want(global, Box{std::vector<uint64_t>(global.size(), 0), global, std::nullopt});
    auto plan = PlanPieceReads(want, ckpt.Pointers());
    ASSERT_OK(plan.status());
    EXPECT_TRUE(plan->runs.empty());
    EXPECT_EQ(plan->bytes, 0u);
    // Nothing to read needs no saved piece either.
    ASSERT_OK(PlanPieceReads(want, {}).status());
  }
  // An empty box or flat range of a non-empty tensor.
  FakeCheckpoint ckpt({4, 5}, DType::kF32);
  ckpt.Add(Box{{0, 0}, {4, 5}, std::nullopt});
  for (const Box& b : {Box{{2, 0}, {0, 5}, std::nullopt}, Box{{0, 0}, {4, 5}, FlatRange{7, 7}}}) {
    auto plan = PlanPieceReads(Want({4, 5}, b), ckpt.Pointers());
    ASSERT_OK(plan.status());
    EXPECT_TRUE(plan->runs.empty());
  }
}

// ---------------------------------------------------------------------------------------------
// Brute force: random global shapes, saved layouts and wanted pieces, checked element by element.

std::vector<std::pair<uint64_t, uint64_t>> SplitDim(uint64_t n, std::mt19937_64& rng) {
  if (n == 0) return {{0, 0}};
  const uint64_t blocks = 1 + rng() % std::min<uint64_t>(n, 4);
  std::vector<uint64_t> cuts = {0, n};
  while (cuts.size() < blocks + 1) {
    uint64_t c = 1 + rng() % (n - 1);
    if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) out.push_back({cuts[i], cuts[i + 1] - cuts[i]});
  return out;
}

// A random layout covering the whole tensor: dimensions split into blocks, some blocks split
// into flat ranges at random points (so ranges straddle rows), some ranges empty.
std::vector<Box> RandomLayout(const std::vector<uint64_t>& global, std::mt19937_64& rng) {
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> splits;
  for (uint64_t g : global) splits.push_back(SplitDim(g, rng));
  std::vector<Box> boxes;
  std::vector<size_t> idx(global.size(), 0);
  while (true) {
    Box b;
    for (size_t d = 0; d < global.size(); ++d) {
      b.offset.push_back(splits[d][idx[d]].first);
      b.shape.push_back(splits[d][idx[d]].second);
    }
    const uint64_t n = Numel(b.shape);
    switch (rng() % 4) {
      case 0:
      case 1: boxes.push_back(b); break;
      case 2:
        b.flat = FlatRange{0, n};
        boxes.push_back(b);
        break;
      default: {
        const uint64_t ranges = 1 + rng() % 4;
        std::vector<uint64_t> cuts = {0, n};
        for (uint64_t i = 1; i < ranges; ++i) cuts.push_back(n == 0 ? 0 : rng() % (n + 1));
        std::sort(cuts.begin(), cuts.end());
        for (size_t i = 0; i + 1 < cuts.size(); ++i) {
          b.flat = FlatRange{cuts[i], cuts[i + 1]};
          boxes.push_back(b);
        }
      }
    }
    size_t d = global.size();
    while (d > 0) {
      if (++idx[d - 1] < splits[d - 1].size()) break;
      idx[d - 1] = 0;
      --d;
    }
    if (d == 0) break;
  }
  return boxes;
}

TEST(PlanPieceReads, RandomLayoutsMatchBruteForce) {
  std::mt19937_64 rng(20240611);
  const DType dtypes[] = {DType::kF64, DType::kF32, DType::kBF16, DType::kI16};
  size_t planned = 0, not_found = 0, replicated = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    const size_t rank = iter % 50 == 0 ? 0 : 1 + rng() % 3;
    std::vector<uint64_t> global;
    for (size_t d = 0; d < rank; ++d) global.push_back(1 + rng() % 9);
    FakeCheckpoint ckpt(global, dtypes[rng() % 4]);

    std::vector<Box> saved = RandomLayout(global, rng);
    if (rng() % 3 == 0) {  // a second full copy in another layout (replicated weights)
      for (const Box& b : RandomLayout(global, rng)) saved.push_back(b);
      ++replicated;
    }
    for (int dup = rng() % 3; dup > 0; --dup) saved.push_back(saved[rng() % saved.size()]);  // partial replicas
    if (rng() % 5 == 0) saved.erase(saved.begin() + rng() % saved.size());                   // a lost piece
    std::shuffle(saved.begin(), saved.end(), rng);
    for (const Box& b : saved) ckpt.Add(b);

    std::vector<Box> wanted = RandomLayout(global, rng);
    // A TensorSpec cannot give a 0-d tensor a flat range (NormalizeTensorSpec wants a box shape).
    if (global.empty()) wanted = {Box{}};
    for (const Box& b : wanted) {
      SCOPED_TRACE("iter " + std::to_string(iter) + " global " + Dims(global) + " want offset " + Dims(b.offset) +
                   " shape " + Dims(b.shape) +
                   (b.flat ? " flat [" + std::to_string(b.flat->begin) + ", " + std::to_string(b.flat->end) + ")"
                           : std::string()));
      const TensorSpec want = Want(global, b, ckpt.dtype());
      std::optional<std::vector<uint64_t>> first_missing;
      for (uint64_t f = b.FlatBegin(); f < b.FlatEnd() && !first_missing; ++f) {
        std::vector<uint64_t> c = BoxCoords(b.offset, b.shape, f);
        if (!ckpt.Covers(c)) first_missing = c;
      }
      auto plan = PlanPieceReads(want, ckpt.Pointers());
      if (first_missing) {
        ASSERT_EQ(plan.status().code(), StatusCode::kNotFound) << plan.status().ToString();
        ASSERT_NE(plan.status().message().find("position " + Dims(*first_missing) + " "), std::string::npos)
            << plan.status().ToString();
        ++not_found;
        continue;
      }
      ASSERT_OK(plan.status());
      ASSERT_TRUE(ckpt.Check(want, *plan));
      ++planned;
    }
  }
  // The generator exercises each outcome.
  EXPECT_GT(planned, 10000u);
  EXPECT_GT(not_found, 100u);
  EXPECT_GT(replicated, 1000u);
}

}  // namespace
}  // namespace flashckpt

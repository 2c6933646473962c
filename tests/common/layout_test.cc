#include "common/format/layout.h"

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "common/base/dtype.h"
#include "common/format/checksum.h"
#include "common/format/image.h"
#include "common/format/metadata.h"
#include "test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

using testing::SlotBuffer;
using testing::Spec;

Topology Single() { return Topology{}; }

Topology Grid(uint32_t tp, uint32_t tp_deg, uint32_t pp, uint32_t pp_deg, uint32_t shard, uint32_t shard_deg) {
  Topology t;
  t.world_size = tp_deg * pp_deg * shard_deg;
  t.tp_rank = tp;
  t.tp_degree = tp_deg;
  t.pp_rank = pp;
  t.pp_degree = pp_deg;
  t.shard_rank = shard;
  t.shard_degree = shard_deg;
  return t;
}

// Tensors of every element size with odd lengths, so that alignment does not happen by accident.
std::vector<TensorSpec> MixedSpecs() {
  return {
      Spec("mask", TensorKind::kModel, DType::kU8, {3}),
      Spec("w.bf16", TensorKind::kModel, DType::kBF16, {5, 3}),
      Spec("bias", TensorKind::kModel, DType::kF32, {7}),
      Spec("a.f32", TensorKind::kModel, DType::kF32, {1}),
      Spec("scale", TensorKind::kModel, DType::kF64, {1}),
      Spec("counts", TensorKind::kModel, DType::kI16, {3}),
      Spec("exp_avg", TensorKind::kOptimizer, DType::kF32, {9}),
      Spec("w.master", TensorKind::kMasterWeight, DType::kF32, {5, 3}),
      Spec("step_count", TensorKind::kOptimizer, DType::kI64, {1}),
  };
}

Status BuildStatus(const std::vector<TensorSpec>& specs, const Topology& t = Single(), uint32_t rank = 0) {
  return BuildRankLayout("job", rank, t, specs).status();
}

TEST(BuildRankLayout, AlignsImagesAndTensors) {
  auto layout = BuildRankLayout("llama", 0, Single(), MixedSpecs());
  ASSERT_OK(layout.status());
  ASSERT_EQ(layout->files.size(), 2u);
  EXPECT_EQ(layout->files[0].kind, "model_state");
  EXPECT_EQ(layout->files[0].stem, "model_state.tp00_pp00_shard00");
  EXPECT_EQ(layout->files[1].kind, "optimizer");
  EXPECT_EQ(layout->files[1].stem, "optimizer.tp00_pp00_shard00");
  EXPECT_EQ(layout->slot_bytes % kPageSize, 0u);
  EXPECT_EQ(layout->replica_offset % kPageSize, 0u);

  uint64_t previous_end = kPageSize;  // the slot header page comes first
  for (const auto& image : layout->files) {
    EXPECT_EQ(image.slot_offset % kPageSize, 0u) << image.stem;
    EXPECT_GE(image.slot_offset, previous_end) << image.stem;
    EXPECT_EQ(image.header.size() % kPageSize, 0u) << image.stem;
    previous_end = image.slot_offset + image.file_bytes();
    // Tensors follow the header back to back, each naturally aligned, in data order.
    uint64_t expect = image.slot_offset + image.header.size();
    for (size_t t : image.tensors) {
      const auto& p = layout->placements[t];
      EXPECT_EQ(p.slot_offset, expect) << layout->tensors[t].name;
      EXPECT_EQ(p.slot_offset % DTypeSize(layout->tensors[t].dtype), 0u) << layout->tensors[t].name;
      EXPECT_EQ(p.bytes, TensorBytes(layout->tensors[t].dtype, layout->tensors[t].shape).value());
      expect += p.bytes;
    }
    EXPECT_EQ(expect, previous_end) << image.stem;
  }
  EXPECT_LE(previous_end, layout->replica_offset);
  EXPECT_LE(layout->replica_offset, layout->slot_bytes);
}

TEST(BuildRankLayout, OrdersByElementSizeThenName) {
  auto layout = BuildRankLayout("llama", 0, Single(), MixedSpecs());
  ASSERT_OK(layout.status());
  auto names = [&](const FileImage& image) {
    std::vector<std::string> out;
    for (size_t t : image.tensors) out.push_back(layout->tensors[t].name);
    return out;
  };
  EXPECT_EQ(names(layout->files[0]), (std::vector<std::string>{"scale", "a.f32", "bias", "counts", "w.bf16", "mask"}));
  // master weights go to the optimizer file with the optimizer states.
  EXPECT_EQ(names(layout->files[1]), (std::vector<std::string>{"step_count", "exp_avg", "w.master"}));
  for (size_t i = 0; i < layout->tensors.size(); ++i) {
    EXPECT_EQ(layout->tensors[i].name, MixedSpecs()[i].name) << "tensors keep registration order";
    EXPECT_EQ(layout->Find(layout->tensors[i].name), static_cast<int>(i));
  }
  EXPECT_EQ(layout->Find("nope"), -1);
}

TEST(BuildRankLayout, UsesTheRankCoordinatesInFileStems) {
  auto layout = BuildRankLayout("llama", 13, Grid(1, 2, 2, 4, 1, 2), {Spec("w", TensorKind::kModel, DType::kF32, {4})});
  ASSERT_OK(layout.status());
  ASSERT_EQ(layout->files.size(), 1u);
  EXPECT_EQ(layout->files[0].stem, "model_state.tp01_pp02_shard01");
}

TEST(BuildRankLayout, PutsReplicasInTheReplicaArea) {
  auto specs = MixedSpecs();
  TensorSpec r1 = Spec("replica.w", TensorKind::kModel, DType::kBF16, {3, 3});
  r1.replica = true;
  TensorSpec r2 = Spec("replica.b", TensorKind::kModel, DType::kF32, {5});
  r2.replica = true;
  specs.push_back(r1);
  specs.push_back(r2);
  auto layout = BuildRankLayout("llama", 0, Single(), specs);
  ASSERT_OK(layout.status());
  std::set<uint64_t> starts;
  for (const char* name : {"replica.w", "replica.b"}) {
    int i = layout->Find(name);
    ASSERT_GE(i, 0);
    const auto& p = layout->placements[i];
    EXPECT_EQ(p.file, -1) << name;
    EXPECT_GE(p.slot_offset, layout->replica_offset) << name;
    EXPECT_EQ(p.slot_offset % kPageSize, 0u) << name;
    EXPECT_LE(p.slot_offset + p.bytes, layout->slot_bytes) << name;
    starts.insert(p.slot_offset);
    for (const auto& image : layout->files) {
      for (size_t t : image.tensors) EXPECT_NE(static_cast<int>(t), i) << name << " is in " << image.stem;
      EXPECT_EQ(image.header.find(name), std::string::npos) << name << " is named in the header of " << image.stem;
    }
  }
  EXPECT_EQ(starts.size(), 2u) << "replicas share bytes";
  EXPECT_EQ(layout->slot_bytes % kPageSize, 0u);

  // A rank that persists nothing of its own has no images, only a replica area.
  auto only = BuildRankLayout("llama", 0, Single(), {r1});
  ASSERT_OK(only.status());
  EXPECT_TRUE(only->files.empty());
  EXPECT_EQ(only->replica_offset, kPageSize);
  EXPECT_EQ(only->slot_bytes, 2 * kPageSize);
}

TEST(BuildRankLayout, SlotBytesArePageMultiples) {
  for (uint64_t n : {1ull, 4095ull, 4096ull, 4097ull, 100000ull}) {
    auto layout = BuildRankLayout("j", 0, Single(), {Spec("x", TensorKind::kModel, DType::kU8, {n})});
    ASSERT_OK(layout.status());
    EXPECT_EQ(layout->slot_bytes % kPageSize, 0u) << n;
    EXPECT_GE(layout->slot_bytes, layout->files[0].slot_offset + layout->files[0].file_bytes()) << n;
  }
}

TEST(NormalizeTensorSpec, FillsDefaults) {
  auto s = NormalizeTensorSpec(Spec("w", TensorKind::kModel, DType::kF32, {4, 6}));
  ASSERT_OK(s.status());
  EXPECT_EQ(s->box_shape, (std::vector<uint64_t>{4, 6}));
  EXPECT_EQ(s->global_shape, (std::vector<uint64_t>{4, 6}));
  EXPECT_EQ(s->box_offset, (std::vector<uint64_t>{0, 0}));
}

TEST(NormalizeTensorSpec, ValidatesFlatRanges) {
  TensorSpec s = Spec("exp_avg", TensorKind::kOptimizer, DType::kF32, {6});
  s.global_shape = {8, 4};
  s.box_offset = {4, 0};
  s.box_shape = {4, 4};
  s.flat_range = FlatRange{10, 16};
  ASSERT_OK(NormalizeTensorSpec(s).status());
  ASSERT_OK(BuildStatus({s}));

  TensorSpec no_box = s;
  no_box.box_shape.clear();
  EXPECT_FALSE(NormalizeTensorSpec(no_box).ok()) << "a flat range without a box";
  TensorSpec reversed = s;
  reversed.flat_range = FlatRange{16, 10};
  EXPECT_FALSE(NormalizeTensorSpec(reversed).ok()) << "begin after end";
  TensorSpec past_box = s;
  past_box.flat_range = FlatRange{12, 18};
  EXPECT_FALSE(NormalizeTensorSpec(past_box).ok()) << "range leaves the 16-element box";
  TensorSpec wrong_count = s;
  wrong_count.flat_range = FlatRange{10, 15};
  EXPECT_FALSE(NormalizeTensorSpec(wrong_count).ok()) << "5 elements in the range, 6 in the shape";
  TensorSpec no_range = s;
  no_range.flat_range.reset();
  EXPECT_FALSE(NormalizeTensorSpec(no_range).ok()) << "shape differs from box without a flat range";

  Status st = BuildStatus({wrong_count});
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("exp_avg"), std::string::npos) << st.ToString();
}

TEST(NormalizeTensorSpec, RejectsBoxesOutsideTheGlobalShape) {
  TensorSpec s = Spec("w", TensorKind::kModel, DType::kBF16, {4, 8});
  s.global_shape = {8, 8};
  s.box_offset = {4, 0};
  ASSERT_OK(NormalizeTensorSpec(s).status());
  TensorSpec past = s;
  past.box_offset = {5, 0};
  Status st = BuildStatus({past});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("'w'"), std::string::npos) << st.ToString();
  TensorSpec wraps = s;
  wraps.box_offset = {~0ull, 0};  // offset + size overflows
  EXPECT_FALSE(NormalizeTensorSpec(wraps).ok());
  TensorSpec rank_mismatch = s;
  rank_mismatch.global_shape = {8, 8, 1};
  rank_mismatch.box_offset = {4, 0, 0};
  EXPECT_FALSE(NormalizeTensorSpec(rank_mismatch).ok());
  TensorSpec offset_rank = s;
  offset_rank.box_offset = {4};
  EXPECT_FALSE(NormalizeTensorSpec(offset_rank).ok());
}

TEST(NormalizeTensorSpec, RejectsOversizedTensors) {
  EXPECT_FALSE(NormalizeTensorSpec(Spec("w", TensorKind::kModel, DType::kF32, {1ull << 40, 1ull << 40})).ok());
  EXPECT_FALSE(NormalizeTensorSpec(Spec("w", TensorKind::kModel, DType::kF32, std::vector<uint64_t>(9, 1))).ok());
  EXPECT_FALSE(NormalizeTensorSpec(Spec("a@b", TensorKind::kModel, DType::kF32, {1})).ok());
}

TEST(BuildRankLayout, RejectsDuplicateNames) {
  Status st = BuildStatus(
      {Spec("w", TensorKind::kModel, DType::kF32, {4}), Spec("w", TensorKind::kOptimizer, DType::kF32, {4})});
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'w'"), std::string::npos) << st.ToString();
}

TEST(BuildRankLayout, RefusesAHeaderAboveTheSafetensorsLimit) {
  // 32 GiB in 4 KiB checksum chunks: 8 Mi chunk checksums of 16 digits, a 128 MiB header.
  LayoutExtras extras;
  extras.checksum_chunk = 4096;
  auto layout = BuildRankLayout("job", 0, Single(), {Spec("w", TensorKind::kModel, DType::kU8, {32ull << 30})}, extras);
  EXPECT_EQ(layout.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(layout.status().message().find("larger checksum chunk"), std::string::npos) << layout.status().ToString();
  extras.checksum_chunk = 1u << 20;  // 32 Ki chunks: fine
  EXPECT_OK(
      BuildRankLayout("job", 0, Single(), {Spec("w", TensorKind::kModel, DType::kU8, {32ull << 30})}, extras).status());
}

// Before the bound, a 2^63-byte replica made the slot size, and SegmentBytes() of two slots, wrap to
// a few KiB: the daemon created a tiny segment and wrote slot headers past its mapping (SIGSEGV).
TEST(BuildRankLayout, BoundsTheSlotWhateverTheTensorSizes) {
  TensorSpec huge = Spec("r", TensorKind::kModel, DType::kF32, {1ull << 61});  // 2^63 bytes
  huge.replica = true;
  Status st = BuildStatus({Spec("w", TensorKind::kModel, DType::kF32, {4}), huge});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  std::vector<TensorSpec> replicas = {Spec("w", TensorKind::kModel, DType::kF32, {4})};
  for (int i = 0; i < 4; ++i) {  // 2^47 bytes each: every one fits, their sum does not
    replicas.push_back(Spec("r" + std::to_string(i), TensorKind::kModel, DType::kF32, {1ull << 45}));
    replicas.back().replica = true;
  }
  st = BuildStatus(replicas);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("256 TiB"), std::string::npos) << st.ToString();
  replicas.resize(2);  // 2^47 bytes of replica: fits, and 64 slots of it stay far from 2^64
  auto layout = BuildRankLayout("job", 0, Single(), replicas);
  ASSERT_OK(layout.status());
  EXPECT_LE(layout->slot_bytes, kMaxSlotBytes);
  EXPECT_GT(SegmentBytes(layout->slot_bytes, 64), 63 * layout->slot_bytes);
}

TEST(BuildRankLayout, RefusesChecksumDigitsBeyondTheHeaderBoundBeforeBuildingThem) {
  // 64 TiB in 1 MiB chunks: 1 GiB of checksum digits, refused before any of it is allocated.
  auto layout = BuildRankLayout("job", 0, Single(), {Spec("w", TensorKind::kModel, DType::kF32, {1ull << 44})});
  EXPECT_EQ(layout.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(layout.status().message().find("larger checksum chunk"), std::string::npos) << layout.status().ToString();
}

TEST(BuildRankLayout, ChecksTheGlobalSizeAndTheParamName) {
  TensorSpec s = Spec("w", TensorKind::kModel, DType::kF32, {1, 1});
  s.global_shape = {1ull << 32, 1ull << 32};  // 2^64 elements, 2^66 bytes: a restore could never read it
  Status st = BuildStatus({s});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("global_shape"), std::string::npos) << st.ToString();
  TensorSpec master = Spec("w.master", TensorKind::kMasterWeight, DType::kF32, {4});
  master.param = "w";
  EXPECT_OK(NormalizeTensorSpec(master).status());
  master.param = "w\"x";
  st = NormalizeTensorSpec(master).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("param"), std::string::npos) << st.ToString();
}

TEST(BuildRankLayout, RejectsBadJobsAndEmptyRanks) {
  EXPECT_FALSE(BuildRankLayout("../etc", 0, Single(), {Spec("w", TensorKind::kModel, DType::kF32, {4})}).ok());
  EXPECT_FALSE(BuildRankLayout("job", 0, Single(), {}).ok());
}

TEST(ValidateTopology, RejectsInconsistentTopologies) {
  EXPECT_OK(ValidateTopology(Grid(1, 2, 3, 4, 0, 2), 5));
  Topology t = Grid(0, 2, 0, 2, 0, 2);
  EXPECT_OK(ValidateTopology(t, 7));
  EXPECT_FALSE(ValidateTopology(t, 8).ok()) << "rank not below world_size";
  Topology wrong_world = t;
  wrong_world.world_size = 6;
  EXPECT_FALSE(ValidateTopology(wrong_world, 0).ok());
  Topology zero = t;
  zero.pp_degree = 0;
  zero.world_size = 0;
  EXPECT_FALSE(ValidateTopology(zero, 0).ok());
  Topology tp_out = t;
  tp_out.tp_rank = 2;
  EXPECT_FALSE(ValidateTopology(tp_out, 0).ok());
  Topology shard_out = t;
  shard_out.shard_rank = 5;
  EXPECT_FALSE(ValidateTopology(shard_out, 0).ok());
  Topology overflow;  // 65536 * 65537 wraps to 65536 in 32 bits: the product must not wrap to match
  overflow.tp_degree = 65536;
  overflow.pp_degree = 65537;
  overflow.world_size = 65536;
  EXPECT_FALSE(ValidateTopology(overflow, 0).ok());
  Status st = BuildStatus({Spec("w", TensorKind::kModel, DType::kF32, {4})}, wrong_world);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  Topology wraps64;  // 2^31 * 3 * 2863311531 = 2^64 + 2^31: wrapped to 64 bits it equals world_size
  wraps64.tp_degree = 1u << 31;
  wraps64.pp_degree = 3;
  wraps64.shard_degree = 2863311531u;
  wraps64.world_size = 1u << 31;
  st = ValidateTopology(wraps64, 0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("overflows"), std::string::npos) << st.ToString();
}

// Fills each tensor with bytes derived from its index, so two tensors never hold the same bytes.
void Fill(char* slot, const RankLayout& layout) {
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    const auto& p = layout.placements[t];
    for (uint64_t i = 0; i < p.bytes; ++i) slot[p.slot_offset + i] = static_cast<char>(i * 31 + t * 7 + 1);
  }
}

TEST(StampImage, WritesStepAndChecksumsThatParse) {
  auto specs = MixedSpecs();
  TensorSpec sharded = Spec("exp_avg_sq", TensorKind::kOptimizer, DType::kF32, {6});
  sharded.global_shape = {8, 4};
  sharded.box_offset = {4, 0};
  sharded.box_shape = {4, 4};
  sharded.flat_range = FlatRange{10, 16};
  specs.push_back(sharded);
  Topology topo = Grid(1, 2, 0, 1, 0, 1);
  auto layout = BuildRankLayout("llama", 1, topo, specs);
  ASSERT_OK(layout.status());
  SlotBuffer slot(layout->slot_bytes);
  ASSERT_NE(slot.data(), nullptr);
  InitSlotImages(slot.data(), *layout);
  Fill(slot.data(), *layout);

  for (size_t f = 0; f < layout->files.size(); ++f) {
    StampImage(slot.data(), *layout, f, 1200);
    const FileImage& image = layout->files[f];
    const char* base = slot.data() + image.slot_offset;
    auto n = ParseHeaderLength(reinterpret_cast<const unsigned char*>(base), image.file_bytes());
    ASSERT_OK(n.status());
    auto header = ParseSafetensorsHeader(std::string_view(base + 8, *n), image.file_bytes());
    ASSERT_OK(header.status());
    EXPECT_EQ(header->data_start, image.header.size());
    EXPECT_EQ(header->metadata.at("step"), "00000000000000001200");
    EXPECT_EQ(header->metadata.at("job"), "llama");
    EXPECT_EQ(header->metadata.at("rank"), "1");
    EXPECT_EQ(header->metadata.at("tp_rank"), "1");
    EXPECT_EQ(header->metadata.at("world_size"), "2");
    auto pieces = PiecesFromHeader(*header, image.stem + ".safetensors");
    ASSERT_OK(pieces.status());
    ASSERT_EQ(pieces->size(), image.tensors.size());
    for (const Piece& piece : *pieces) {
      int t = layout->Find(piece.key);
      ASSERT_GE(t, 0) << piece.key;
      const auto& p = layout->placements[t];
      const auto& spec = layout->tensors[t];
      EXPECT_EQ(p.file, static_cast<int>(f));
      EXPECT_EQ(piece.begin, p.slot_offset - image.slot_offset) << piece.key;
      EXPECT_EQ(piece.end - piece.begin, p.bytes) << piece.key;
      EXPECT_EQ(piece.xxh3, Xxh3(slot.data() + p.slot_offset, p.bytes)) << piece.key;
      EXPECT_EQ(piece.dtype, spec.dtype);
      EXPECT_EQ(piece.kind, spec.kind);
      EXPECT_EQ(piece.shape, spec.shape);
      EXPECT_EQ(piece.global_shape, spec.global_shape);
      EXPECT_EQ(piece.box_offset, spec.box_offset);
      EXPECT_EQ(piece.box_shape, spec.box_shape);
      EXPECT_EQ(piece.flat_range.has_value(), spec.flat_range.has_value()) << piece.key;
      if (piece.flat_range) {
        EXPECT_EQ(piece.flat_range->begin, spec.flat_range->begin);
        EXPECT_EQ(piece.flat_range->end, spec.flat_range->end);
      }
    }
  }

  // A later save of the same slot: new data, new step, same header size, checksums follow the data.
  int w = layout->Find("w.bf16");
  ASSERT_GE(w, 0);
  slot.data()[layout->placements[w].slot_offset] ^= 0x5a;
  StampImage(slot.data(), *layout, 0, 98765);
  const FileImage& image = layout->files[0];
  const char* base = slot.data() + image.slot_offset;
  auto header = ParseSafetensorsHeader(std::string_view(base + 8, image.header.size() - 8), image.file_bytes());
  ASSERT_OK(header.status());
  EXPECT_EQ(header->metadata.at("step"), "00000000000000098765");
  auto pieces = PiecesFromHeader(*header, "m");
  ASSERT_OK(pieces.status());
  for (const Piece& piece : *pieces) {
    const auto& p = layout->placements[layout->Find(piece.key)];
    EXPECT_EQ(piece.xxh3, Xxh3(slot.data() + p.slot_offset, p.bytes)) << piece.key;
  }
}

// The format version 2 rule (docs/format.md, "Checksums"): values computed by the independent
// test reader (tests/integration/flashckpt_reader.py) from the documented rule alone.
TEST(CombineChunkChecksums, FollowsTheDocumentedRule) {
  const uint64_t three[] = {1, 2, 3};
  EXPECT_EQ(ChecksumHex(CombineChunkChecksums(three, 3, 10)), "123253d2e6be5077");
  const uint64_t two[] = {0x0123456789abcdefull, 0xfedcba9876543210ull};
  EXPECT_EQ(ChecksumHex(CombineChunkChecksums(two, 2, 1u << 21)), "a934dd8605359f4c");
  EXPECT_EQ(ChecksumHex(Xxh3("", 0)), "2d06800538d394c2");
}

// Every byte is hashed once: a tensor of several chunks gets per-chunk checksums of its bytes and a
// whole checksum computed from them; a tensor of one chunk the checksum of its bytes. A header
// whose whole checksum is not the one its chunks give is refused.
TEST(StampImage, TheWholeChecksumOfAChunkedTensorDerivesFromItsChunks) {
  LayoutExtras extras;
  extras.checksum_chunk = 4096;
  auto layout = BuildRankLayout("job", 0, Single(),
                                {Spec("big", TensorKind::kModel, DType::kF32, {2500}),  // 10000 bytes: 3 chunks
                                 Spec("small", TensorKind::kModel, DType::kF32, {100})},
                                extras);
  ASSERT_OK(layout.status());
  SlotBuffer slot(layout->slot_bytes);
  for (uint64_t i = 0; i < layout->slot_bytes; ++i) slot.data()[i] = static_cast<char>(i * 7 + 3);
  InitSlotImages(slot.data(), *layout);
  StampImage(slot.data(), *layout, 0, 42);
  const FileImage& image = layout->files[0];
  auto header = ParseSafetensorsHeader(std::string_view(slot.data() + image.slot_offset + 8, image.header.size() - 8),
                                       image.file_bytes());
  ASSERT_OK(header.status());
  EXPECT_EQ(header->metadata.at("format_version"), "2");
  auto pieces = PiecesFromHeader(*header, "model_state");
  ASSERT_OK(pieces.status());
  ASSERT_EQ(pieces->size(), 2u);
  for (const Piece& piece : *pieces) {
    const Placement& p = layout->placements[layout->Find(piece.key)];
    const char* data = slot.data() + p.slot_offset;
    if (piece.key == "small") {
      EXPECT_FALSE(piece.whole_from_chunks);
      EXPECT_TRUE(piece.chunk_xxh3.empty());
      EXPECT_EQ(piece.xxh3, Xxh3(data, p.bytes));
      continue;
    }
    EXPECT_TRUE(piece.whole_from_chunks);
    ASSERT_EQ(piece.chunk_xxh3.size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_EQ(piece.chunk_xxh3[k], Xxh3(data + k * 4096, std::min<uint64_t>(4096, p.bytes - k * 4096)));
    }
    EXPECT_EQ(piece.xxh3, CombineChunkChecksums(piece.chunk_xxh3.data(), 3, p.bytes));
    EXPECT_NE(piece.xxh3, Xxh3(data, p.bytes));
  }
  // A whole checksum that its chunks do not give: refused when the header is parsed, naming the tensor.
  auto edited = *header;
  const std::string key = TensorMetaKey("big", "xxh3");
  edited.metadata[key] = ChecksumHex(Xxh3(slot.data() + layout->placements[layout->Find("big")].slot_offset,
                                          layout->placements[layout->Find("big")].bytes));
  auto refused = PiecesFromHeader(edited, "model_state");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kCorruption);
  EXPECT_NE(refused.status().message().find("'big'"), std::string::npos) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("chunk checksums give"), std::string::npos) << refused.status().ToString();
  // A version this release does not know is refused too; version 1 takes the whole checksum as given.
  edited.metadata["format_version"] = "3";
  EXPECT_NE(PiecesFromHeader(edited, "model_state").status().message().find("format_version '3'"), std::string::npos);
  edited.metadata["format_version"] = "1";
  auto v1 = PiecesFromHeader(edited, "model_state");
  ASSERT_OK(v1.status());
  EXPECT_FALSE((*v1)[0].whole_from_chunks || (*v1)[1].whole_from_chunks);
}

TEST(InitSlotImages, TouchesOnlyHeaderBytes) {
  auto layout = BuildRankLayout("llama", 0, Single(), MixedSpecs());
  ASSERT_OK(layout.status());
  SlotBuffer slot(layout->slot_bytes);
  ASSERT_NE(slot.data(), nullptr);
  std::memset(slot.data(), 0x77, slot.size());
  InitSlotImages(slot.data(), *layout);
  for (const auto& image : layout->files) {
    EXPECT_EQ(std::memcmp(slot.data() + image.slot_offset, image.header.data(), image.header.size()), 0);
    EXPECT_EQ(slot.data()[image.slot_offset + image.header.size()], 0x77) << "tensor data was overwritten";
  }
  EXPECT_EQ(slot.data()[0], 0x77) << "the slot header page was overwritten";
}

}  // namespace
}  // namespace flashckpt

#include "common/read/checkpoint_read.h"

#include <fcntl.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "common/base/dtype.h"
#include "common/base/thread_pool.h"
#include "common/format/metadata.h"
#include "common/io/fs.h"
#include "test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

using testing::FlipByte;
using testing::Spec;
using testing::TempDir;

constexpr uint64_t kRows = 256, kCols = 256, kRowBytes = kCols * sizeof(float), kChunk = 4096;

// "w" [256, 256] fp32 saved by two tp ranks, rank r holding rows [128r, 128r + 128).
TensorSpec RowBlock(uint64_t first, uint64_t rows, DType dtype = DType::kF32) {
  TensorSpec s = Spec("w", TensorKind::kModel, dtype, {rows, kCols});
  s.global_shape = {kRows, kCols};
  s.box_offset = {first, 0};
  s.box_shape = {rows, kCols};
  return s;
}

Status SaveTwoRanks(const std::string& dir, uint64_t checksum_chunk) {
  Topology t;
  t.world_size = 2;
  t.tp_degree = 2;
  for (uint32_t r = 0; r < 2; ++r) {
    t.tp_rank = r;
    RETURN_IF_ERROR(testing::WriteRankFiles(dir, "job", r, t, {RowBlock(128 * r, 128)}, 10, r + 1, checksum_chunk));
  }
  return testing::WriteMetadata(dir);
}

// The saved byte at column byte `c` of global row `g`.
char SavedByte(uint64_t g, uint64_t c) {
  const uint64_t r = g / 128;
  return testing::PatternByte((g - 128 * r) * kRowBytes + c, 0, static_cast<uint32_t>(r + 1));
}

std::string FileOf(uint32_t tp_rank) {
  return "model_state.tp0" + std::to_string(tp_rank) + "_pp00_shard00.safetensors";
}

struct Filled {
  Status status;
  FillStats stats;
  RankLayout layout;
  std::unique_ptr<testing::SlotBuffer> slot;
};

Filled Fill(const std::string& dir, const TensorSpec& want, const FillOptions& options = {}) {
  Filled out;
  auto meta = ReadMetadataFile(dir);
  if (!meta.ok()) {
    out.status = meta.status();
    return out;
  }
  auto layout = BuildRankLayout("job", 0, Topology{}, {want});
  if (!layout.ok()) {
    out.status = layout.status();
    return out;
  }
  out.layout = std::move(layout).value();
  out.slot = std::make_unique<testing::SlotBuffer>(out.layout.slot_bytes);
  auto stats = FillSlotFromCheckpoint(dir, *meta, out.layout, out.slot->data(), options);
  out.status = stats.status();
  if (stats.ok()) out.stats = *stats;
  return out;
}

TEST(FillSlotFromCheckpoint, ReadsOnlyTheChunksAnotherLayoutNeeds) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  ASSERT_OK(SaveTwoRanks(dir.path(), kChunk));
  ParallelLoop loop(2);
  FillOptions options;
  options.loop = &loop;
  // Rows [61, 195): across both saved pieces, starting and ending inside a 4-row chunk.
  Filled f = Fill(dir.path(), RowBlock(61, 134), options);
  ASSERT_OK(f.status);
  const char* data = f.slot->data() + f.layout.placements[0].slot_offset;
  for (uint64_t row = 0; row < 134; ++row) {
    for (uint64_t c = 0; c < kRowBytes; ++c) {
      ASSERT_EQ(data[row * kRowBytes + c], SavedByte(61 + row, c)) << "row " << 61 + row << " byte " << c;
    }
  }
  EXPECT_EQ(f.stats.bytes_needed, 134 * kRowBytes);
  EXPECT_GE(f.stats.bytes_read, f.stats.bytes_needed);
  EXPECT_LE(f.stats.bytes_read, f.stats.bytes_needed + 2 * kChunk) << "at most one partial chunk at each end";
  std::printf("rows [61, 195) of 2 x 128: needed %llu bytes, read %llu (%.3fx)\n",
              static_cast<unsigned long long>(f.stats.bytes_needed),
              static_cast<unsigned long long>(f.stats.bytes_read),
              double(f.stats.bytes_read) / double(f.stats.bytes_needed));
}

TEST(FillSlotFromCheckpoint, ReadsWholePiecesThatHaveOneChecksum) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  ASSERT_OK(SaveTwoRanks(dir.path(), 1u << 20));  // each piece (128 KiB) is a single chunk
  Filled f = Fill(dir.path(), RowBlock(61, 134));
  ASSERT_OK(f.status);
  EXPECT_EQ(f.stats.bytes_read, kRows * kRowBytes) << "both pieces read in full to check their checksum";
  const char* data = f.slot->data() + f.layout.placements[0].slot_offset;
  EXPECT_EQ(data[0], SavedByte(61, 0));
  EXPECT_EQ(data[134 * kRowBytes - 1], SavedByte(194, kRowBytes - 1));
}

TEST(FillSlotFromCheckpoint, VerifiesTheChunksItReadsAndOnlyThose) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  ASSERT_OK(SaveTwoRanks(dir.path(), kChunk));
  auto meta = ReadMetadataFile(dir.path());
  ASSERT_OK(meta.status());
  const Piece* rank0 = nullptr;
  for (const Piece& p : meta->pieces) {
    if (p.file == FileOf(0)) rank0 = &p;
  }
  ASSERT_NE(rank0, nullptr);
  // Row 2 is in chunk 0 (rows 0-3), which rows [61, 195) do not touch.
  ASSERT_OK(FlipByte(dir.File(FileOf(0)), rank0->begin + 2 * kRowBytes + 5));
  ASSERT_OK(Fill(dir.path(), RowBlock(61, 134)).status);
  // Row 100 is in chunk 25, which they do.
  ASSERT_OK(FlipByte(dir.File(FileOf(0)), rank0->begin + 100 * kRowBytes + 5));
  Status s = Fill(dir.path(), RowBlock(61, 134)).status;
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("chunk 25 of tensor 'w'"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find(FileOf(0)), std::string::npos) << s.ToString();
}

TEST(FillSlotFromCheckpoint, RefusesPiecesThatMetadataPlacesOtherwiseThanTheirFileHeader) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  ASSERT_OK(SaveTwoRanks(dir.path(), kChunk));
  // metadata.json now puts rank 1's rows at the top and rank 0's below; every checksum still
  // matches the bytes it covers, so only the files' own headers can tell.
  ASSERT_OK(testing::SwapPlacements(dir.path(), "w", FileOf(0), FileOf(1)));
  // The same layout (rank 0's rows, read as a whole piece) and another one (chunks of both pieces).
  for (const TensorSpec& want : {RowBlock(0, 128), RowBlock(61, 134)}) {
    Filled f = Fill(dir.path(), want);
    ASSERT_FALSE(f.status.ok()) << "rows [" << want.box_offset[0] << ", " << want.box_offset[0] + want.box_shape[0]
                                << ") were filled from a misplaced piece";
    EXPECT_EQ(f.status.code(), StatusCode::kCorruption) << f.status.ToString();
    for (const char* word : {"tensor 'w'", "box offset", "in the file header", "metadata.json", ".safetensors"}) {
      EXPECT_NE(f.status.message().find(word), std::string::npos) << "'" << word << "' in " << f.status.ToString();
    }
  }
  // Rank 0's rows are the piece metadata.json now places at offset 0: the one in rank 1's file.
  Status s = Fill(dir.path(), RowBlock(0, 128)).status;
  EXPECT_NE(s.message().find(dir.File(FileOf(1))), std::string::npos) << s.ToString();
}

// A restore reads metadata.json's pieces of its own tensors only (ReadMetadataFor). The files it
// opens also hold tensors it did not read: their header is checked for the tensors it read.
TEST(FillSlotFromCheckpoint, ChecksTheTensorsItReadOfPartOfMetadataJson) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Topology t;
  t.world_size = 2;
  t.tp_degree = 2;
  for (uint32_t r = 0; r < 2; ++r) {
    t.tp_rank = r;
    const std::vector<TensorSpec> tensors = {RowBlock(128 * r, 128), Spec("v", TensorKind::kModel, DType::kF32, {64})};
    ASSERT_OK(testing::WriteRankFiles(dir.path(), "job", r, t, tensors, 10, r + 1, kChunk));
  }
  ASSERT_OK(WriteMetadataFiles(dir.path(), *BuildMetadataFromDir(dir.path())));
  auto fill = [&](const TensorSpec& want, MetadataReadStats* stats) -> Filled {
    Filled out;
    auto meta = ReadMetadataFor(dir.path(), {want.name}, IoEnv::Default(), stats);
    if (!meta.ok()) {
      out.status = meta.status();
      return out;
    }
    out.layout = *BuildRankLayout("job", 0, Topology{}, {want});
    out.slot = std::make_unique<testing::SlotBuffer>(out.layout.slot_bytes);
    out.status = FillSlotFromCheckpoint(dir.path(), *meta, out.layout, out.slot->data()).status();
    return out;
  };
  MetadataReadStats stats;
  Filled f = fill(RowBlock(61, 134), &stats);
  ASSERT_OK(f.status);
  EXPECT_TRUE(stats.used_index);
  const char* data = f.slot->data() + f.layout.placements[0].slot_offset;
  EXPECT_EQ(data[0], SavedByte(61, 0));
  EXPECT_EQ(data[134 * kRowBytes - 1], SavedByte(194, kRowBytes - 1));
  // metadata.json rewritten with the pieces of 'w' misplaced: its index no longer matches it, so the
  // whole file is read, and the headers refuse the placement as before.
  ASSERT_OK(testing::SwapPlacements(dir.path(), "w", FileOf(0), FileOf(1)));
  f = fill(RowBlock(0, 128), &stats);
  EXPECT_FALSE(stats.used_index);
  ASSERT_FALSE(f.status.ok());
  EXPECT_EQ(f.status.code(), StatusCode::kCorruption) << f.status.ToString();
  EXPECT_NE(f.status.message().find("tensor 'w'"), std::string::npos) << f.status.ToString();
}

TEST(FillSlotFromCheckpoint, NarrowsFp32OnlyWhenAsked) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  ASSERT_OK(SaveTwoRanks(dir.path(), kChunk));
  for (DType to : {DType::kBF16, DType::kF16}) {
    Status refused = Fill(dir.path(), RowBlock(0, 128, to)).status;
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
    EXPECT_NE(refused.message().find("dtype conversion"), std::string::npos) << refused.ToString();

    FillOptions options;
    options.convert_dtype = true;
    Filled f = Fill(dir.path(), RowBlock(64, 128, to), options);  // and in another layout
    ASSERT_OK(f.status);
    const char* data = f.slot->data() + f.layout.placements[0].slot_offset;
    for (uint64_t row = 0; row < 128; ++row) {
      for (uint64_t col = 0; col < kCols; ++col) {
        char saved[4];
        for (int b = 0; b < 4; ++b) saved[b] = SavedByte(64 + row, col * 4 + b);
        float value;
        std::memcpy(&value, saved, 4);
        uint16_t want, got;
        NarrowF32(&value, 1, to, &want);
        std::memcpy(&got, data + (row * kCols + col) * 2, 2);
        ASSERT_EQ(got, want) << DTypeName(to) << " row " << row << " col " << col;
      }
    }
  }
  // Never the other way, and never to an integer type.
  FillOptions options;
  options.convert_dtype = true;
  EXPECT_EQ(Fill(dir.path(), RowBlock(0, 128, DType::kI32), options).status.code(), StatusCode::kFailedPrecondition);
}

uint16_t Narrow(float v, DType to) {
  uint16_t out;
  NarrowF32(&v, 1, to, &out);
  return out;
}

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(NarrowF32, RoundsToNearestEven) {
  EXPECT_EQ(Narrow(1.0f, DType::kBF16), 0x3f80);
  EXPECT_EQ(Narrow(-2.5f, DType::kBF16), 0xc020);
  EXPECT_EQ(Narrow(FromBits(0x3f808000), DType::kBF16), 0x3f80);               // tie, even below
  EXPECT_EQ(Narrow(FromBits(0x3f818000), DType::kBF16), 0x3f82);               // tie, even above
  EXPECT_EQ(Narrow(FromBits(0x3f808001), DType::kBF16), 0x3f81);               // just above the tie
  EXPECT_EQ(Narrow(std::numeric_limits<float>::max(), DType::kBF16), 0x7f80);  // rounds to infinity
  EXPECT_EQ(Narrow(std::numeric_limits<float>::infinity(), DType::kBF16), 0x7f80);
  const uint16_t nan = Narrow(std::numeric_limits<float>::quiet_NaN(), DType::kBF16);
  EXPECT_EQ(nan & 0x7f80, 0x7f80);
  EXPECT_NE(nan & 0x007f, 0);
  EXPECT_NE(Narrow(FromBits(0x7f800001), DType::kBF16) & 0x007f, 0) << "a NaN with low payload bits stays NaN";

  EXPECT_EQ(Narrow(1.0f, DType::kF16), 0x3c00);
  EXPECT_EQ(Narrow(65504.0f, DType::kF16), 0x7bff);
  EXPECT_EQ(Narrow(65520.0f, DType::kF16), 0x7c00);                      // tie between the largest finite and infinity
  EXPECT_EQ(Narrow(1.0f + std::ldexp(1.0f, -11), DType::kF16), 0x3c00);  // tie, even below
  EXPECT_EQ(Narrow(1.0f + 3 * std::ldexp(1.0f, -11), DType::kF16), 0x3c02);  // tie, even above
  EXPECT_EQ(Narrow(std::ldexp(1.0f, -24), DType::kF16), 0x0001);             // smallest subnormal
  EXPECT_EQ(Narrow(std::ldexp(1.0f, -25), DType::kF16), 0x0000);             // tie to even zero
  EXPECT_EQ(Narrow(-0.0f, DType::kF16), 0x8000);
  EXPECT_EQ(Narrow(std::ldexp(1.0f, -14), DType::kF16), 0x0400);                   // smallest normal
  EXPECT_EQ(Narrow(std::ldexp(1023.5f, -24), DType::kF16), 0x0400);  // largest subnormal + half: tie, rounds up
  EXPECT_EQ(Narrow(std::ldexp(3.0f, -25), DType::kF16), 0x0002);     // 1.5 x smallest subnormal: tie to even
  EXPECT_EQ(Narrow(-std::numeric_limits<float>::infinity(), DType::kF16), 0xfc00);
  EXPECT_EQ(Narrow(std::numeric_limits<float>::max(), DType::kF16), 0x7c00);
  const uint16_t f16_nan = Narrow(std::numeric_limits<float>::quiet_NaN(), DType::kF16);
  EXPECT_EQ(f16_nan & 0x7c00, 0x7c00);
  EXPECT_NE(f16_nan & 0x03ff, 0);
  EXPECT_NE(Narrow(FromBits(0x7f800001), DType::kF16) & 0x03ff, 0) << "a NaN with low payload bits stays NaN";
}

}  // namespace
}  // namespace flashckpt

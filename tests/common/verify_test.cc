#include "common/read/verify.h"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "common/format/checksum.h"
#include "common/format/metadata.h"
#include "common/io/fs.h"
#include "test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

using testing::FlipByte;
using testing::Spec;
using testing::TempDir;

constexpr char kModel0[] = "model_state.tp00_pp00_shard00.safetensors";
constexpr char kOptim1[] = "optimizer.tp00_pp00_shard01.safetensors";

// A two-rank checkpoint (sharded optimizer) written exactly as the daemon writes one.
class VerifyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    Topology t;
    t.world_size = 2;
    t.shard_degree = 2;
    for (uint32_t r = 0; r < 2; ++r) {
      t.shard_rank = r;
      std::vector<TensorSpec> specs = {Spec("layers.0.w", TensorKind::kModel, DType::kBF16, {64, 64}),
                                       Spec("layers.0.b", TensorKind::kModel, DType::kF32, {64})};
      TensorSpec exp_avg = Spec("layers.0.w.exp_avg", TensorKind::kOptimizer, DType::kF32, {2048});
      exp_avg.global_shape = {64, 64};
      exp_avg.box_shape = {64, 64};
      exp_avg.flat_range = FlatRange{2048 * r, 2048 * (r + 1)};
      specs.push_back(exp_avg);
      specs.push_back(Spec("step", TensorKind::kOptimizer, DType::kI64, {1}));
      ASSERT_OK(testing::WriteRankFiles(dir_.path(), "llama", r, t, specs, 1200, r + 1));
    }
    ASSERT_OK(testing::WriteMetadata(dir_.path()));
  }

  // The absolute byte range of `tensor` in `file`, from metadata.json.
  Piece Find(const std::string& file, const std::string& tensor) {
    auto meta = ReadMetadataFile(dir_.path());
    EXPECT_OK(meta.status());
    if (meta.ok()) {
      for (const Piece& p : meta->pieces) {
        if (p.file == file && p.key == tensor) return p;
      }
    }
    ADD_FAILURE() << tensor << " not found in " << file;
    return Piece{};
  }

  Status Verify() { return VerifyCheckpointDir(dir_.path(), &report_); }

  static void ExpectMentions(const Status& s, const std::vector<std::string>& words) {
    for (const auto& w : words)
      EXPECT_NE(s.message().find(w), std::string::npos) << "'" << w << "' in " << s.ToString();
  }

  TempDir dir_;
  VerifyReport report_;
};

TEST_F(VerifyTest, PassesOnAnIntactCheckpoint) {
  ASSERT_OK(Verify());
  EXPECT_EQ(report_.job, "llama");
  EXPECT_EQ(report_.step, 1200);
  EXPECT_EQ(report_.files, 4u);
  EXPECT_EQ(report_.tensors, 4u) << "layers.0.w, layers.0.b, layers.0.w.exp_avg and step, each saved by both ranks";
  EXPECT_EQ(report_.pieces, 8u);
  uint64_t total = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_.path())) {
    if (e.path().extension() == ".safetensors") total += e.file_size();
  }
  EXPECT_EQ(report_.bytes, total);
  ASSERT_OK(VerifyCheckpointDir(dir_.path(), nullptr));  // the report is optional
}

TEST_F(VerifyTest, DetectsAFlippedDataByte) {
  Piece p = Find(kModel0, "layers.0.w");
  ASSERT_OK(FlipByte(dir_.File(kModel0), p.begin + 100));
  Status s = Verify();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  ExpectMentions(s, {kModel0, "'layers.0.w'"});
  EXPECT_LT(report_.files, 4u);
}

TEST_F(VerifyTest, DetectsAFlippedByteInTheLastTensorOfAFile) {
  Piece p = Find(kOptim1, "layers.0.w.exp_avg");
  ASSERT_OK(FlipByte(dir_.File(kOptim1), p.end - 1));
  Status s = Verify();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  ExpectMentions(s, {kOptim1, "'layers.0.w.exp_avg'"});
}

TEST_F(VerifyTest, DetectsATruncatedFile) {
  uint64_t size = std::filesystem::file_size(dir_.File(kOptim1));
  std::filesystem::resize_file(dir_.File(kOptim1), size - 3);
  Status s = Verify();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  ExpectMentions(s, {kOptim1, "truncated"});
  EXPECT_EQ(report_.files, 0u) << "sizes are checked before any data is hashed";
}

TEST_F(VerifyTest, DetectsAGrownFile) {
  std::filesystem::resize_file(dir_.File(kModel0), std::filesystem::file_size(dir_.File(kModel0)) + 4096);
  Status s = Verify();
  ASSERT_FALSE(s.ok());
  ExpectMentions(s, {kModel0});
}

TEST_F(VerifyTest, DetectsADeletedFile) {
  ASSERT_TRUE(std::filesystem::remove(dir_.File(kOptim1)));
  Status s = Verify();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  ExpectMentions(s, {kOptim1});
}

TEST_F(VerifyTest, DetectsACorruptHeader) {
  ASSERT_OK(FlipByte(dir_.File(kModel0), 8));  // the '{' that opens the JSON
  Status s = Verify();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  ExpectMentions(s, {kModel0});
}

TEST_F(VerifyTest, DetectsAHeaderChecksumThatDisagreesWithMetadata) {
  // Rewrite the recorded checksum of one tensor in the file header: the header still parses, and
  // the data would even match a recomputed header, but it is no longer the checkpoint that was saved.
  auto text = ReadSmallFile(dir_.File(kModel0), 1 << 20);
  ASSERT_OK(text.status());
  Piece p = Find(kModel0, "layers.0.b");
  std::string hex = ChecksumHex(p.xxh3);
  size_t pos = text->find(hex);
  ASSERT_NE(pos, std::string::npos);
  ASSERT_OK(FlipByte(dir_.File(kModel0), pos));  // '0'..'9' <-> another digit, 'a'..'f' <-> '`'..'g'
  Status s = Verify();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  ExpectMentions(s, {kModel0});
}

TEST_F(VerifyTest, DetectsMetadataThatRecordsAnotherChecksum) {
  auto text = ReadSmallFile(dir_.File("metadata.json"), 1 << 20);
  ASSERT_OK(text.status());
  Piece p = Find(kOptim1, "step");
  std::string hex = ChecksumHex(p.xxh3);
  size_t pos = text->find(hex);
  ASSERT_NE(pos, std::string::npos);
  std::string edited = *text;
  edited.replace(pos, 16, ChecksumHex(p.xxh3 ^ 1));
  ASSERT_OK(WriteFileDurably(dir_.path(), "metadata.json", edited));
  Status s = Verify();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  ExpectMentions(s, {kOptim1, "'step'"});
}

TEST_F(VerifyTest, DetectsMetadataThatSwapsWherePiecesGo) {
  // The two shards' flat ranges of exp_avg swapped in metadata.json: every checksum still matches.
  const std::string optim0 = "optimizer.tp00_pp00_shard00.safetensors";
  ASSERT_OK(testing::SwapPlacements(dir_.path(), "layers.0.w.exp_avg", optim0, kOptim1));
  Status s = Verify();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  ExpectMentions(s, {optim0, "'layers.0.w.exp_avg'", "flat range is [0, 2048) in the file header",
                     "[2048, 4096) in metadata.json"});
  EXPECT_EQ(report_.tensors, 0u) << "no data is hashed before the headers are checked";
}

TEST_F(VerifyTest, DetectsAFileOfAnotherStep) {
  // Rank 1's files of step 1300 land in checkpoint 1200: each file is self-consistent, but not
  // the checkpoint metadata.json describes.
  Topology t;
  t.world_size = 2;
  t.shard_degree = 2;
  t.shard_rank = 1;
  TensorSpec exp_avg = Spec("layers.0.w.exp_avg", TensorKind::kOptimizer, DType::kF32, {2048});
  exp_avg.global_shape = {64, 64};
  exp_avg.box_shape = {64, 64};
  exp_avg.flat_range = FlatRange{2048, 4096};
  ASSERT_OK(testing::WriteRankFiles(dir_.path(), "llama", 1, t,
                                    {Spec("layers.0.w", TensorKind::kModel, DType::kBF16, {64, 64}),
                                     Spec("layers.0.b", TensorKind::kModel, DType::kF32, {64}), exp_avg,
                                     Spec("step", TensorKind::kOptimizer, DType::kI64, {1})},
                                    1300, 2));
  Status s = Verify();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  ExpectMentions(s, {"1300"});
}

TEST_F(VerifyTest, RefusesADirectoryWithoutMetadata) {
  ASSERT_TRUE(std::filesystem::remove(dir_.File("metadata.json")));
  Status s = Verify();
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  ExpectMentions(s, {"metadata.json", "incomplete"});
  Status none = VerifyCheckpointDir(dir_.File("nope"), nullptr);
  EXPECT_EQ(none.code(), StatusCode::kNotFound);
  ExpectMentions(none, {"no such checkpoint directory"});
}

// Tensors larger than the verifier's read chunk, and a corruption past the first chunk.
TEST(Verify, HashesTensorsLargerThanOneChunk) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::vector<TensorSpec> specs = {Spec("big", TensorKind::kModel, DType::kF32, {5u << 20}),  // 20 MiB
                                   Spec("small.a", TensorKind::kModel, DType::kU8, {3}),
                                   Spec("small.b", TensorKind::kModel, DType::kBF16, {7})};
  ASSERT_OK(testing::WriteRankFiles(dir.path(), "big-job", 0, Topology{}, specs, 5));
  ASSERT_OK(testing::WriteMetadata(dir.path()));
  VerifyReport report;
  ASSERT_OK(VerifyCheckpointDir(dir.path(), &report));
  EXPECT_EQ(report.tensors, 3u);
  EXPECT_EQ(report.pieces, 3u);
  EXPECT_GT(report.bytes, 20u << 20);

  auto meta = ReadMetadataFile(dir.path());
  ASSERT_OK(meta.status());
  for (const Piece& p : meta->pieces) {
    if (p.key != "big") continue;
    ASSERT_OK(FlipByte(dir.File(p.file), p.begin + (17u << 20)));
  }
  Status s = VerifyCheckpointDir(dir.path(), &report);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'big'"), std::string::npos) << s.ToString();
}

// Per-chunk checksums are verified on their own: a wrong one is found even when the whole-tensor
// checksum is right, and the error names the chunk.
TEST(Verify, ChecksEveryChunkChecksum) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::vector<TensorSpec> specs = {Spec("w", TensorKind::kModel, DType::kF32, {16384}),  // 64 KiB: 16 chunks
                                   Spec("b", TensorKind::kModel, DType::kF32, {100})};
  ASSERT_OK(testing::WriteRankFiles(dir.path(), "chunky", 0, Topology{}, specs, 7, 1, /*checksum_chunk=*/4096));
  ASSERT_OK(testing::WriteMetadata(dir.path()));
  VerifyReport report;
  ASSERT_OK(VerifyCheckpointDir(dir.path(), &report));
  auto meta = ReadMetadataFile(dir.path());
  ASSERT_OK(meta.status());
  Piece w;
  for (const Piece& p : meta->pieces) {
    if (p.key == "w") w = p;
    if (p.key == "b") {
      EXPECT_TRUE(p.chunk_xxh3.empty()) << "a one-chunk tensor has only its whole checksum";
    }
  }
  ASSERT_EQ(w.chunk_xxh3.size(), 16u);
  EXPECT_EQ(w.chunk_bytes, 4096u);

  // Replace chunk 5's checksum with another value in both the header and metadata.json, so that
  // they agree with each other. (The fixture's data repeats every 256 bytes, so all chunks have the
  // same checksum: edit by position in the list.) The whole checksum derives from the chunks'
  // (format version 2), so the edit alone is refused before any data is hashed; with the whole
  // checksum edited to match, only hashing chunk 5 finds it.
  std::string all;
  for (uint64_t c : w.chunk_xxh3) all += ChecksumHex(c);
  std::vector<uint64_t> edited_chunks = w.chunk_xxh3;
  edited_chunks[5] ^= 0x10;
  const uint64_t edited_whole = CombineChunkChecksums(edited_chunks.data(), edited_chunks.size(), w.end - w.begin);
  auto edit = [&](bool whole_too) {
    for (const char* name : {"model_state.tp00_pp00_shard00.safetensors", "metadata.json"}) {
      auto text = ReadSmallFile(dir.File(name), 1 << 20);
      ASSERT_OK(text.status());
      std::string edited = *text;
      size_t pos = edited.find(all);
      if (pos != std::string::npos) edited.replace(pos + 5 * 16, 16, ChecksumHex(edited_chunks[5]));
      if (whole_too) {
        pos = edited.find(ChecksumHex(w.xxh3));
        ASSERT_NE(pos, std::string::npos) << name;
        edited.replace(pos, 16, ChecksumHex(edited_whole));
      }
      ASSERT_OK(WriteFileDurably(dir.path(), name, edited));
    }
  };
  edit(false);
  Status s = VerifyCheckpointDir(dir.path(), &report);
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
  EXPECT_NE(s.message().find("chunk checksums give"), std::string::npos) << s.ToString();
  edit(true);
  s = VerifyCheckpointDir(dir.path(), &report);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("chunk 5"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace flashckpt

// Format versions: a checkpoint written by the release before format version 2 (kept in the tree
// as that release wrote it: tests/data/format_v1) still verifies and restores, in its own layout and
// resharded; version 2 checkpoints are verified chunk by chunk, a large piece on several threads,
// and a damaged byte is found wherever it is; files and metadata.json must agree on the version.
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "common/base/thread_pool.h"
#include "common/format/checksum.h"
#include "common/format/metadata.h"
#include "common/io/fs.h"
#include "common/read/checkpoint_read.h"
#include "common/read/relayout.h"
#include "common/read/verify.h"
#include "test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

using testing::FlipByte;
using testing::Spec;
using testing::TempDir;

// Saved by flashckptd (format version 1) with --checksum-chunk 4KiB: four flashckpt-sim ranks,
// (tp, shard) = (2, 2), 2 layers of [48, 48] fp32 and their Adam moments, EMA on, step 10.
constexpr char kV1Job[] = "format-v1";
constexpr int64_t kV1Step = 10;
constexpr uint64_t kHidden = 48;
constexpr uint32_t kLayers = 2;

std::string CopyOfV1Checkpoint(const TempDir& tmp) {
  const std::string from = std::string(FLASHCKPT_TEST_DATA) + "/format_v1/" + kV1Job + "/checkpoint-10";
  const std::string to = tmp.path() + "/checkpoint-10";
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
  return to;
}

// flashckpt-sim's value of layers.<l>.weight at global (i, j) at `step` (tests/integration/
// flashckpt_reader.py, sim_expected); the moments are v / 2 and v / 4.
float SimValue(uint32_t layer, uint64_t i, uint64_t j, int64_t step) {
  return static_cast<float>((layer * 7919 + i * kHidden + j) % 1000) / 1024.0f + static_cast<float>(step);
}

TEST(FormatV1Checkpoint, VerifiesAsItWasWritten) {
  TempDir tmp;
  const std::string dir = CopyOfV1Checkpoint(tmp);
  auto meta = ReadMetadataFile(dir);
  ASSERT_OK(meta.status());
  EXPECT_EQ(meta->format_version, 1);
  size_t chunked = 0;
  for (const Piece& p : meta->pieces) {
    EXPECT_FALSE(p.whole_from_chunks) << p.key;  // version 1: whole checksums hash the bytes
    if (!p.chunk_xxh3.empty()) ++chunked;
  }
  EXPECT_GT(chunked, 0u);  // the fixture does have chunked pieces
  VerifyReport report;
  ASSERT_OK(VerifyCheckpointDir(dir, &report));
  EXPECT_EQ(report.step, kV1Step);

  // One flipped byte in a chunked piece is found, naming its chunk.
  const Piece* victim = nullptr;
  for (const Piece& p : meta->pieces) {
    if (!p.chunk_xxh3.empty() && p.kind == TensorKind::kModel) victim = &p;
  }
  ASSERT_NE(victim, nullptr);
  ASSERT_OK(FlipByte(dir + "/" + victim->file, victim->begin + victim->chunk_bytes + 3));
  Status s = VerifyCheckpointDir(dir, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
  EXPECT_NE(s.message().find("chunk 1"), std::string::npos) << s.ToString();
}

// The version 1 checkpoint restores into one rank holding everything: every weight and moment
// element is the simulator's value at step 10.
TEST(FormatV1Checkpoint, RestoresInItsOwnLayoutAndResharded) {
  TempDir tmp;
  const std::string dir = CopyOfV1Checkpoint(tmp);
  auto meta = ReadMetadataFile(dir);
  ASSERT_OK(meta.status());
  ParallelLoop loop(3);
  for (Degrees degrees : {Degrees{2, 1, 2}, Degrees{1, 1, 1}, Degrees{1, 1, 3}}) {
    auto ranks = PlanNewLayout(*meta, degrees);
    ASSERT_OK(ranks.status());
    for (const NewRank& r : *ranks) {
      auto layout = BuildRankLayout(kV1Job, r.rank, r.topology, r.tensors);
      ASSERT_OK(layout.status());
      testing::SlotBuffer slot(layout->slot_bytes);
      FillOptions options;
      options.loop = &loop;
      auto stats = FillSlotFromCheckpoint(dir, *meta, *layout, slot.data(), options);
      ASSERT_TRUE(stats.ok()) << degrees.tp << "," << degrees.shard << ": " << stats.status().ToString();
      if (degrees.tp != 1 || degrees.shard != 1) continue;
      // (1, 1, 1): whole tensors, in row-major order.
      for (uint32_t l = 0; l < kLayers; ++l) {
        const std::string w = "layers." + std::to_string(l) + ".weight";
        for (const auto& [name, scale] : std::vector<std::pair<std::string, float>>{
                 {w, 1.0f}, {w + ".exp_avg", 0.5f}, {w + ".exp_avg_sq", 0.25f}}) {
          const int t = layout->Find(name);
          ASSERT_GE(t, 0) << name;
          const auto* values = reinterpret_cast<const float*>(slot.data() + layout->placements[t].slot_offset);
          for (uint64_t i = 0; i < kHidden; ++i) {
            for (uint64_t j = 0; j < kHidden; ++j) {
              ASSERT_EQ(values[i * kHidden + j], SimValue(l, i, j, kV1Step) * scale) << name << " " << i << "," << j;
            }
          }
        }
      }
    }
  }
}

// A version 2 checkpoint of one rank whose weight (40 MiB, 1 MiB chunks) is larger than a read
// task: the restore cuts it into tasks of whole chunks on several threads and verifies each chunk.
class FormatV2LargePiece : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    specs_ = {Spec("w", TensorKind::kModel, DType::kF32, {10, 1u << 20}),  // 40 MiB
              Spec("b", TensorKind::kModel, DType::kF32, {100})};
    ASSERT_OK(testing::WriteRankFiles(dir_.path(), "v2", 0, Topology{}, specs_, 7));
    ASSERT_OK(testing::WriteMetadata(dir_.path()));
  }

  Result<FillStats> Restore(ParallelLoop* loop, testing::SlotBuffer* slot, const RankLayout& layout) {
    ASSIGN_OR_RETURN(CheckpointMetadata meta, ReadMetadataFile(dir_.path()));
    FillOptions options;
    options.loop = loop;
    return FillSlotFromCheckpoint(dir_.path(), meta, layout, slot->data(), options);
  }

  TempDir dir_;
  std::vector<TensorSpec> specs_;
};

TEST_F(FormatV2LargePiece, RestoresChunkByChunkAndFindsAFlippedByteInAnyTask) {
  auto meta = ReadMetadataFile(dir_.path());
  ASSERT_OK(meta.status());
  EXPECT_EQ(meta->format_version, kFormatVersion);
  const Piece* w = nullptr;
  for (const Piece& p : meta->pieces) {
    if (p.key == "w") w = &p;
  }
  ASSERT_NE(w, nullptr);
  EXPECT_TRUE(w->whole_from_chunks);
  EXPECT_EQ(w->chunk_xxh3.size(), 40u);
  auto layout = BuildRankLayout("v2", 0, Topology{}, specs_);
  ASSERT_OK(layout.status());
  const Placement& place = layout->placements[layout->Find("w")];
  ParallelLoop loop(3);
  for (ParallelLoop* l : {&loop, static_cast<ParallelLoop*>(nullptr)}) {
    testing::SlotBuffer slot(layout->slot_bytes);
    auto stats = Restore(l, &slot, *layout);
    ASSERT_OK(stats.status());
    EXPECT_EQ(stats->bytes_read, stats->bytes_needed);
    for (uint64_t i = 0; i < place.bytes; i += 4099) {
      ASSERT_EQ(slot.data()[place.slot_offset + i], testing::PatternByte(i, layout->Find("w"), 1)) << i;
    }
  }
  ASSERT_OK(VerifyCheckpointDir(dir_.path(), nullptr));
  // A byte in chunk 30 (the second task of 16 MiB) and then one in the last chunk.
  for (uint64_t offset : {30 * (1ull << 20) + 5, 40 * (1ull << 20) - 1}) {
    ASSERT_OK(FlipByte(dir_.path() + "/" + w->file, w->begin + offset));
    const std::string chunk = "chunk " + std::to_string(offset >> 20);
    testing::SlotBuffer slot(layout->slot_bytes);
    Status s = Restore(&loop, &slot, *layout).status();
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
    EXPECT_NE(s.message().find(chunk), std::string::npos) << s.ToString();
    s = VerifyCheckpointDir(dir_.path(), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
    EXPECT_NE(s.message().find(chunk), std::string::npos) << s.ToString();
    ASSERT_OK(FlipByte(dir_.path() + "/" + w->file, w->begin + offset));  // back as it was
  }
}

// metadata.json and the files record one format version; a checkpoint whose records disagree, or
// that names a version this release does not know, is refused before any data is read.
TEST_F(FormatV2LargePiece, MetadataJsonAndTheFilesMustAgreeOnTheVersion) {
  const std::string path = dir_.path() + "/metadata.json";
  auto text = ReadSmallFile(path, 1u << 20);
  ASSERT_OK(text.status());
  const std::string field = "\"format_version\": 2";
  const size_t at = text->find(field);
  ASSERT_NE(at, std::string::npos) << *text;
  for (const char* version : {"1", "3"}) {
    std::string edited = *text;
    edited.replace(at, field.size(), std::string("\"format_version\": ") + version);
    ASSERT_OK(WriteFileDurably(dir_.path(), "metadata.json", edited));
    Status s = VerifyCheckpointDir(dir_.path(), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << version << ": " << s.ToString();
    EXPECT_NE(s.message().find("format_version"), std::string::npos) << s.ToString();
  }
}

}  // namespace
}  // namespace flashckpt

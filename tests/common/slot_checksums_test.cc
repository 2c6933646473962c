#include "common/format/slot_checksums.h"

#include <string>
#include <vector>

#include "common/base/dtype.h"
#include "common/format/checksum.h"
#include "common/format/image.h"
#include "test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

using testing::SlotBuffer;
using testing::Spec;

// Chunks of 4 KiB: "big" spans 5 chunks (the last one short), "small" one chunk, "replica.w" (held,
// not written) 2 chunks, "empty" none.
RankLayout Layout() {
  TensorSpec replica = Spec("replica.w", TensorKind::kModel, DType::kF32, {1500});
  replica.replica = true;
  LayoutExtras extras;
  extras.checksum_chunk = 4096;
  auto layout = BuildRankLayout("job", 0, Topology{},
                                {Spec("big", TensorKind::kModel, DType::kF32, {4600}),
                                 Spec("small", TensorKind::kOptimizer, DType::kF32, {10}),
                                 Spec("empty", TensorKind::kModel, DType::kF32, {0}), replica},
                                extras);
  EXPECT_OK(layout.status());
  return *layout;
}

void Fill(char* slot, const RankLayout& layout) {
  for (const Placement& p : layout.placements) {
    for (uint64_t i = 0; i < p.bytes; ++i) slot[p.slot_offset + i] = static_cast<char>(i * 131 + p.slot_offset);
  }
}

TEST(SlotChecksums, CoverEveryChunkOfEveryTensorAndVerify) {
  const RankLayout layout = Layout();
  SlotBuffer slot(layout.slot_bytes);
  Fill(slot.data(), layout);
  ParallelLoop loop(2);
  const SlotChecksums sums = ComputeSlotChecksums(slot.data(), layout, &loop);
  EXPECT_EQ(sums.chunk_bytes, 4096u);
  ASSERT_EQ(sums.first.size(), 4u);
  EXPECT_EQ(sums.sums.size(), 5u + 1u + 0u + 2u);
  // The same values on one thread as on several.
  EXPECT_EQ(ComputeSlotChecksums(slot.data(), layout, nullptr).sums, sums.sums);
  EXPECT_OK(VerifySlotChecksums(slot.data(), layout, sums, &loop));
}

TEST(SlotChecksums, AFlippedByteInAnyTensorIsFoundAndNamed) {
  const RankLayout layout = Layout();
  SlotBuffer slot(layout.slot_bytes);
  Fill(slot.data(), layout);
  const SlotChecksums sums = ComputeSlotChecksums(slot.data(), layout, nullptr);
  ParallelLoop loop(2);
  struct Case {
    const char* tensor;
    uint64_t byte;
    const char* chunk;
  };
  for (const Case& c : {Case{"big", 4 * 4096 + 7, "chunk 4 (bytes 16384-18400)"}, Case{"small", 39, "chunk 0"},
                        Case{"replica.w", 5000, "chunk 1"}}) {
    char* byte = slot.data() + layout.placements[layout.Find(c.tensor)].slot_offset + c.byte;
    *byte ^= 1;
    Status s = VerifySlotChecksums(slot.data(), layout, sums, &loop);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << c.tensor;
    EXPECT_NE(s.message().find(std::string("tensor '") + c.tensor + "'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(c.chunk), std::string::npos) << s.message();
    *byte ^= 1;
    EXPECT_OK(VerifySlotChecksums(slot.data(), layout, sums, &loop));
  }
}

TEST(SlotChecksums, ATableOfAnotherLayoutIsRefused) {
  const RankLayout layout = Layout();
  SlotBuffer slot(layout.slot_bytes);
  SlotChecksums sums = ComputeSlotChecksums(slot.data(), layout, nullptr);
  sums.sums.pop_back();
  EXPECT_EQ(VerifySlotChecksums(slot.data(), layout, sums, nullptr).code(), StatusCode::kCorruption);
  sums = ComputeSlotChecksums(slot.data(), layout, nullptr);
  sums.chunk_bytes = 8192;
  EXPECT_EQ(VerifySlotChecksums(slot.data(), layout, sums, nullptr).code(), StatusCode::kCorruption);
}

TEST(SlotChecksums, AreTheValuesTheWriterStampsIntoFileHeaders) {
  const RankLayout layout = Layout();
  SlotBuffer slot(layout.slot_bytes);
  InitSlotImages(slot.data(), layout);
  Fill(slot.data(), layout);
  for (size_t f = 0; f < layout.files.size(); ++f) StampImage(slot.data(), layout, f, 7);
  const SlotChecksums sums = ComputeSlotChecksums(slot.data(), layout, nullptr);
  auto digits = [&](uint64_t at) { return std::string(slot.data() + at, kChecksumFieldWidth); };
  const Placement& big = layout.placements[layout.Find("big")];
  ASSERT_NE(big.chunks_field, 0u);
  for (uint64_t c = 0; c < 5; ++c) {
    EXPECT_EQ(digits(big.chunks_field + c * kChecksumFieldWidth), ChecksumHex(sums.sums[sums.first[0] + c])) << c;
  }
  const Placement& small = layout.placements[layout.Find("small")];
  EXPECT_EQ(small.chunks_field, 0u);
  EXPECT_EQ(digits(small.checksum_field), ChecksumHex(sums.sums[sums.first[1]]));
}

}  // namespace
}  // namespace flashckpt

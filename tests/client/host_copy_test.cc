// The client's host copies: ParallelStreamCopy and ParallelVerifiedCopy copy every byte, whatever
// the alignment and length of each tensor, and a verified copy finds a changed byte in any chunk.
#include "client/src/host_copy.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/format/checksum.h"
#include "testing.h"

namespace flashckpt {
namespace {

constexpr uint64_t kChunk = 4096;

// Source and destination buffers for tensors of awkward sizes, at awkward offsets (not 16-aligned),
// with the per-chunk XXH3 of each source.
struct Copies {
  std::vector<char> src, dst;
  std::vector<size_t> offsets, sizes;
  std::vector<std::vector<uint64_t>> sums;

  explicit Copies(const std::vector<size_t>& tensor_sizes) : sizes(tensor_sizes) {
    size_t total = 0;
    for (size_t n : sizes) {
      total += 3;  // misaligns the next tensor in both buffers
      offsets.push_back(total);
      total += n;
    }
    src.resize(total + 64);
    dst.assign(total + 64, 0);
    std::mt19937_64 random(7);
    for (char& c : src) c = static_cast<char>(random());
    for (size_t t = 0; t < sizes.size(); ++t) {
      std::vector<uint64_t> s;
      for (size_t from = 0; from < sizes[t]; from += kChunk) {
        s.push_back(Xxh3(src.data() + offsets[t] + from, std::min<size_t>(kChunk, sizes[t] - from)));
      }
      sums.push_back(std::move(s));
    }
  }
  std::vector<CopyTask> Tasks() {
    std::vector<CopyTask> out;
    for (size_t t = 0; t < sizes.size(); ++t) out.push_back({dst.data() + offsets[t] + 1, src.data() + offsets[t], sizes[t]});
    return out;
  }
  std::vector<VerifiedCopyTask> Verified() {
    std::vector<VerifiedCopyTask> out;
    std::vector<CopyTask> tasks = Tasks();
    for (size_t t = 0; t < sizes.size(); ++t) {
      out.push_back({tasks[t], sums[t].data(), sums[t].size(), "t" + std::to_string(t)});
    }
    return out;
  }
  bool Copied(size_t t) const {
    return std::memcmp(dst.data() + offsets[t] + 1, src.data() + offsets[t], sizes[t]) == 0;
  }
  // No byte outside the destinations was written.
  bool GuardsIntact() const {
    std::vector<bool> inside(dst.size(), false);
    for (size_t t = 0; t < sizes.size(); ++t) {
      for (size_t k = 0; k < sizes[t]; ++k) inside[offsets[t] + 1 + k] = true;
    }
    for (size_t k = 0; k < dst.size(); ++k) {
      if (!inside[k] && dst[k] != 0) return false;
    }
    return true;
  }
};

const std::vector<size_t> kSizes = {0, 1, 15, 63, 64, 65, 4095, 4096, 4097, 3 * 4096 + 17, (40u << 20) + 5};

TEST(HostCopy, StreamCopyCopiesEveryByteAtAnyAlignmentAndLength) {
  for (unsigned threads : {1u, 3u}) {
    Copies c(kSizes);
    ParallelLoop loop(threads - 1);
    ParallelStreamCopy(&loop, c.Tasks());
    for (size_t t = 0; t < kSizes.size(); ++t) EXPECT_TRUE(c.Copied(t)) << "tensor " << t << ", " << threads << " threads";
    EXPECT_TRUE(c.GuardsIntact());
  }
}

TEST(HostCopy, VerifiedCopyCopiesEveryByteWhenEveryChunkMatches) {
  for (unsigned threads : {1u, 3u}) {
    Copies c(kSizes);
    ParallelLoop loop(threads - 1);
    EXPECT_OK(ParallelVerifiedCopy(&loop, c.Verified(), kChunk));
    for (size_t t = 0; t < kSizes.size(); ++t) EXPECT_TRUE(c.Copied(t)) << "tensor " << t << ", " << threads << " threads";
    EXPECT_TRUE(c.GuardsIntact());
  }
}

TEST(HostCopy, VerifiedCopyNamesTheTensorAndChunkOfAChangedByte) {
  // The first byte, a middle one, and the last byte of the large tensor; the last byte of a short
  // last chunk.
  const size_t large = kSizes.size() - 1;
  struct Case {
    size_t tensor, byte;
    std::string chunk;
  };
  for (const Case& k : {Case{large, 0, "chunk 0 "}, Case{large, (20u << 20) + 100, "chunk 5120 "},
                        Case{large, kSizes[large] - 1, "chunk 10240 "}, Case{9, 3 * 4096 + 16, "chunk 3 "}}) {
    for (unsigned threads : {1u, 3u}) {
      Copies c(kSizes);
      c.src[c.offsets[k.tensor] + k.byte] ^= 0x20;
      ParallelLoop loop(threads - 1);
      Status s = ParallelVerifiedCopy(&loop, c.Verified(), kChunk);
      EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
      EXPECT_NE(s.message().find(k.chunk), std::string::npos) << s.ToString();
      EXPECT_NE(s.message().find("tensor 't" + std::to_string(k.tensor) + "'"), std::string::npos) << s.ToString();
    }
  }
}

TEST(HostCopy, VerifiedCopyRefusesChecksumsThatDoNotCoverATensor) {
  Copies c({10000});
  std::vector<VerifiedCopyTask> tasks = c.Verified();
  tasks[0].sum_count = 2;  // 10000 bytes are 3 chunks of 4096
  ParallelLoop loop(0);
  EXPECT_EQ(ParallelVerifiedCopy(&loop, tasks, kChunk).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParallelVerifiedCopy(&loop, c.Verified(), 0).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(c.Copied(0));
}

}  // namespace
}  // namespace flashckpt

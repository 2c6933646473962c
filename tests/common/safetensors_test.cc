#include "common/format/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include "common/format/checksum.h"
#include "common/io/fs.h"
#include "test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

using testing::TempDir;

// 8-byte little-endian length + `json`, without any padding.
std::string RawHeader(const std::string& json, uint64_t declared_length) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((declared_length >> (8 * i)) & 0xff);
  return out + json;
}
std::string RawHeader(const std::string& json) { return RawHeader(json, json.size()); }

Status WriteFile(const TempDir& dir, const std::string& name, const std::string& bytes) {
  return WriteFileDurably(dir.path(), name, bytes);
}

Status ParseStatus(const std::string& json, uint64_t data_bytes) {
  return ParseSafetensorsHeader(json, 8 + json.size() + data_bytes).status();
}

void ExpectCorruption(const Status& s, const std::string& what) {
  EXPECT_FALSE(s.ok()) << what << " was accepted";
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << what << ": " << s.ToString();
}

TEST(SafetensorsHeaderBuilder, RoundTripsThroughARealFile) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  SafetensorsHeaderBuilder b;
  b.AddMetadata("format", "flashckpt");
  b.AddMetadata("job", "llama");
  size_t step = b.AddFixedWidthMetadata("step", 20);
  size_t ck = b.AddFixedWidthMetadata("w@xxh3", 16);
  // 2x3 F32 (24 bytes) then 4 BF16 (8 bytes) then 3 U8.
  b.AddTensor("w", DType::kF32, {2, 3}, 0, 24);
  b.AddTensor("b", DType::kBF16, {4}, 24, 32);
  b.AddTensor("mask", DType::kU8, {3}, 32, 35);
  auto built = b.Build();
  ASSERT_OK(built.status());
  EXPECT_EQ(built->bytes.size() % kPageSize, 0u);
  ASSERT_EQ(built->field_offsets.size(), 2u);
  ASSERT_EQ(built->field_widths.size(), 2u);
  EXPECT_EQ(built->field_widths[step], 20u);
  EXPECT_EQ(built->field_widths[ck], 16u);

  // Patch the fixed-width fields in place, as StampImage does.
  std::string file = built->bytes;
  EXPECT_EQ(file.substr(built->field_offsets[step], 20), std::string(20, '0'));
  EXPECT_EQ(file.substr(built->field_offsets[ck], 16), std::string(16, '0'));
  std::memcpy(file.data() + built->field_offsets[step], "00000000000000001200", 20);
  std::memcpy(file.data() + built->field_offsets[ck], "0123456789abcdef", 16);
  std::string data(35, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i);
  file += data;
  ASSERT_OK(WriteFile(dir, "x.safetensors", file));

  auto h = ReadSafetensorsHeader(dir.File("x.safetensors"));
  ASSERT_OK(h.status());
  EXPECT_EQ(h->data_start, built->bytes.size());
  EXPECT_EQ(h->data_start % 4096, 0u);
  EXPECT_EQ(h->data_bytes, 35u);
  EXPECT_EQ(h->metadata.at("format"), "flashckpt");
  EXPECT_EQ(h->metadata.at("job"), "llama");
  EXPECT_EQ(h->metadata.at("step"), "00000000000000001200");
  EXPECT_EQ(h->metadata.at("w@xxh3"), "0123456789abcdef");
  ASSERT_EQ(h->entries.size(), 3u);
  EXPECT_EQ(h->entries[0].name, "w");
  EXPECT_EQ(h->entries[0].dtype, DType::kF32);
  EXPECT_EQ(h->entries[0].shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(h->entries[0].begin, 0u);
  EXPECT_EQ(h->entries[0].end, 24u);
  EXPECT_EQ(h->entries[1].name, "b");
  EXPECT_EQ(h->entries[1].dtype, DType::kBF16);
  EXPECT_EQ(h->entries[2].name, "mask");
  EXPECT_EQ(h->entries[2].begin, 32u);
  EXPECT_EQ(h->entries[2].end, 35u);
}

TEST(SafetensorsHeaderBuilder, PadsEveryHeaderToAPage) {
  // Grow the JSON across page boundaries: the data must always start on one.
  for (int n : {0, 1, 50, 200}) {
    SafetensorsHeaderBuilder b;
    uint64_t off = 0;
    for (int i = 0; i < n; ++i) {
      b.AddTensor("tensor_" + std::to_string(i), DType::kF16, {8}, off, off + 16);
      off += 16;
    }
    auto built = b.Build();
    ASSERT_OK(built.status());
    EXPECT_EQ(built->bytes.size() % kPageSize, 0u) << n;
    std::string json = built->bytes.substr(8);
    auto h = ParseSafetensorsHeader(json, built->bytes.size() + off);
    ASSERT_OK(h.status());
    EXPECT_EQ(h->entries.size(), static_cast<size_t>(n));
    EXPECT_EQ(h->data_start, built->bytes.size());
  }
}

TEST(SafetensorsHeaderBuilder, ZeroSizedTensorsAreAllowed) {
  SafetensorsHeaderBuilder b;
  b.AddTensor("empty", DType::kF32, {0, 5}, 0, 0);
  b.AddTensor("one", DType::kF32, {1}, 0, 4);
  auto built = b.Build();
  ASSERT_OK(built.status());
  auto h = ParseSafetensorsHeader(built->bytes.substr(8), built->bytes.size() + 4);
  ASSERT_OK(h.status());
  EXPECT_EQ(h->entries.size(), 2u);
}

TEST(TensorBytes, DetectsOverflow) {
  EXPECT_EQ(TensorBytes(DType::kBF16, {3, 5}).value(), 30u);
  EXPECT_EQ(TensorBytes(DType::kF64, {}).value(), 8u);  // a scalar
  EXPECT_FALSE(TensorBytes(DType::kF32, {1ull << 32, 1ull << 31}).ok());
  EXPECT_FALSE(TensorBytes(DType::kU8, std::vector<uint64_t>(9, 1)).ok());
}

TEST(ParseHeaderLength, BoundsTheLength) {
  unsigned char p[8] = {};
  EXPECT_EQ(ParseHeaderLength(p, 100).status().code(), StatusCode::kCorruption);  // zero
  p[0] = 10;
  EXPECT_EQ(ParseHeaderLength(p, 18).value(), 10u);
  EXPECT_EQ(ParseHeaderLength(p, 17).status().code(), StatusCode::kCorruption);  // past the end
  EXPECT_EQ(ParseHeaderLength(p, 4).status().code(), StatusCode::kCorruption);   // no prefix at all
  unsigned char huge[8] = {0, 0, 0, 0, 0, 0, 0, 0x80};
  EXPECT_EQ(ParseHeaderLength(huge, ~0ull).status().code(), StatusCode::kCorruption);
  uint64_t just_over = kMaxHeaderJsonBytes + 1;
  unsigned char over[8];
  for (int i = 0; i < 8; ++i) over[i] = static_cast<unsigned char>((just_over >> (8 * i)) & 0xff);
  EXPECT_EQ(ParseHeaderLength(over, 1ull << 40).status().code(), StatusCode::kCorruption);
}

// Files whose length prefix is wrong are rejected by the reader, before any JSON is parsed.
TEST(ReadSafetensorsHeader, RejectsBadLengthPrefixes) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string json = R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  ASSERT_OK(WriteFile(dir, "zero", RawHeader(json, 0) + "xx"));
  ASSERT_OK(WriteFile(dir, "huge", RawHeader(json, ~0ull) + "xx"));
  ASSERT_OK(WriteFile(dir, "past_end", RawHeader(json, json.size() + 100) + "xx"));
  ASSERT_OK(WriteFile(dir, "short", std::string("\x05\x00\x00", 3)));
  ASSERT_OK(WriteFile(dir, "empty", ""));
  ASSERT_OK(WriteFile(dir, "good", RawHeader(json) + "xx"));
  for (const char* name : {"zero", "huge", "past_end", "short", "empty"}) {
    auto h = ReadSafetensorsHeader(dir.File(name));
    ExpectCorruption(h.status(), name);
    // The path is in the message so an operator knows which file is bad.
    EXPECT_NE(h.status().message().find(name), std::string::npos) << h.status().ToString();
  }
  ASSERT_OK(ReadSafetensorsHeader(dir.File("good")).status());
  EXPECT_EQ(ReadSafetensorsHeader(dir.File("missing")).status().code(), StatusCode::kNotFound);
}

TEST(ReadSafetensorsHeader, RejectsTruncatedAndExtendedFiles) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  SafetensorsHeaderBuilder b;
  b.AddTensor("w", DType::kF32, {256}, 0, 1024);
  auto built = b.Build();
  ASSERT_OK(built.status());
  std::string file = built->bytes + std::string(1024, 'w');
  ASSERT_OK(WriteFile(dir, "full", file));
  ASSERT_OK(WriteFile(dir, "truncated_data", file.substr(0, file.size() - 1)));
  ASSERT_OK(WriteFile(dir, "truncated_header", file.substr(0, 100)));
  ASSERT_OK(WriteFile(dir, "trailing", file + "x"));
  ASSERT_OK(ReadSafetensorsHeader(dir.File("full")).status());
  for (const char* name : {"truncated_data", "truncated_header", "trailing"}) {
    ExpectCorruption(ReadSafetensorsHeader(dir.File(name)).status(), name);
  }
}

TEST(ParseSafetensorsHeader, RejectsMalformedJson) {
  const std::string entry = R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]})";
  ASSERT_OK(ParseStatus("{" + entry + "}", 4));
  struct Case {
    const char* what;
    std::string json;
    uint64_t data_bytes;
  };
  const std::vector<Case> cases = {
      {"not JSON", "{\"a\":", 4},
      {"array", "[1,2,3]", 0},
      {"string", "\"hello\"", 0},
      {"number", "42", 0},
      {"metadata not an object", R"({"__metadata__":["x"],)" + entry + "}", 4},
      {"metadata value not a string", R"({"__metadata__":{"step":12},)" + entry + "}", 4},
      {"metadata value null", R"({"__metadata__":{"step":null},)" + entry + "}", 4},
      {"entry not an object", R"({"a":[1]})", 0},
      {"missing dtype", R"({"a":{"shape":[4],"data_offsets":[0,4]}})", 4},
      {"missing shape", R"({"a":{"dtype":"U8","data_offsets":[0,4]}})", 4},
      {"missing offsets", R"({"a":{"dtype":"U8","shape":[4]}})", 4},
      {"three offsets", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4,4]}})", 4},
      {"unknown dtype", R"({"a":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})", 4},
      {"lowercase dtype", R"({"a":{"dtype":"u8","shape":[4],"data_offsets":[0,4]}})", 4},
      {"negative dim", R"({"a":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}})", 4},
      {"fractional dim", R"({"a":{"dtype":"U8","shape":[4.0],"data_offsets":[0,4]}})", 4},
      {"rank 9", R"({"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,4],"data_offsets":[0,4]}})", 4},
      {"negative offset", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[-1,3]}})", 4},
      {"string offset", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":["0",4]}})", 4},
      {"shape/offset size mismatch", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,4]}})", 4},
      {"shape overflow", R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4},
      {"begin after end", R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", 4},
      {"out-of-range offsets", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 3},
      {"offset past the file", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[100,104]}})", 4},
      {"overlapping offsets",
       R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
       6},
      {"duplicate range",
       R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
       8},
      {"gap at start", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6},
      {"gap between",
       R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[5,9]}})",
       9},
      {"trailing data", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 5},
  };
  for (const auto& c : cases) ExpectCorruption(ParseStatus(c.json, c.data_bytes), c.what);
}

TEST(ParseSafetensorsHeader, NamesTheBadEntry) {
  Status s = ParseStatus(R"({"layers.0.w":{"dtype":"F32","shape":[3],"data_offsets":[0,4]}})", 4);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("layers.0.w"), std::string::npos) << s.ToString();
}

TEST(ParseSafetensorsHeader, AcceptsAHeaderWithoutTensors) {
  const std::string json = R"({"__metadata__":{"k":"v"}})";
  auto h = ParseSafetensorsHeader(json, 8 + json.size());
  ASSERT_OK(h.status());
  EXPECT_TRUE(h->entries.empty());
  EXPECT_EQ(h->metadata.at("k"), "v");
}

// The safetensors library writes a 0-byte tensor at the offset of the tensor after it, whatever the
// names' order: it overlaps nothing.
TEST(ParseSafetensorsHeader, AcceptsAnEmptyTensorAtTheOffsetOfTheNextOne) {
  const std::string json =
      R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
      R"("c":{"dtype":"F32","shape":[2,0],"data_offsets":[3,3]}})";
  auto h = ParseSafetensorsHeader(json, 8 + json.size() + 3);
  ASSERT_OK(h.status());
  ASSERT_EQ(h->entries.size(), 3u);
  EXPECT_EQ(h->entries[0].name, "b");
  EXPECT_EQ(h->entries[1].name, "a");
  EXPECT_EQ(h->entries[2].name, "c");
  // An empty tensor inside another's bytes is still an overlap.
  const std::string inside =
      R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"F32","shape":[0],"data_offsets":[1,1]}})";
  EXPECT_FALSE(ParseSafetensorsHeader(inside, 8 + inside.size() + 3).ok());
}

TEST(ParseSafetensorsHeader, SortsEntriesByOffset) {
  const std::string json =
      R"({"z":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})";
  auto h = ParseSafetensorsHeader(json, 8 + json.size() + 3);
  ASSERT_OK(h.status());
  ASSERT_EQ(h->entries.size(), 2u);
  EXPECT_EQ(h->entries[0].name, "z");
  EXPECT_EQ(h->entries[1].name, "a");
}

}  // namespace
}  // namespace flashckpt

// extra.rankNNNNN.json: the trainer's opaque bytes survive the round trip whatever they are, and a
// file that is not such an object is kCorruption (the file is untrusted when read back).
#include "common/format/extra.h"

#include <nlohmann/json.hpp>
#include <string>

#include "testing.h"

namespace flashckpt {
namespace {

TEST(ExtraTest, JsonIsEmbeddedAndBinaryIsBase64AndBothComeBack) {
  const std::string json = R"({"data_pos":42,"lr":0.5})";
  std::string file = EncodeExtra("llama", 3, 1200, json);
  auto parsed = nlohmann::json::parse(file);
  EXPECT_EQ(parsed["format"], "flashckpt-extra");
  EXPECT_EQ(parsed["rank"], 3);
  EXPECT_EQ(parsed["step"], 1200);
  EXPECT_EQ(parsed["encoding"], "json");
  EXPECT_EQ(parsed["data"]["data_pos"], 42);  // readable with any JSON tool
  auto back = DecodeExtra(file);
  ASSERT_OK(back.status());
  EXPECT_EQ(nlohmann::json::parse(*back), nlohmann::json::parse(json));

  for (size_t n = 0; n < 7; ++n) {  // every base64 padding case, and bytes that are not UTF-8
    std::string binary;
    for (size_t i = 0; i < n; ++i) binary += static_cast<char>(0xf0 + i);
    if (n > 0) binary[0] = '\0';
    std::string encoded = EncodeExtra("j", 0, 1, binary);
    EXPECT_EQ(nlohmann::json::parse(encoded)["encoding"], n == 0 ? "none" : "base64") << n;
    auto decoded = DecodeExtra(encoded);
    ASSERT_OK(decoded.status());
    EXPECT_EQ(*decoded, binary) << n;
  }
}

TEST(ExtraTest, MalformedFilesAreCorruption) {
  for (const std::string bad :
       {"", "[]", "not json", R"({"encoding":"json"})", R"({"data":1})", R"({"encoding":"zip","data":"x"})",
        R"({"encoding":"base64","data":"@@@@"})", R"({"encoding":"base64","data":7})"}) {
    auto decoded = DecodeExtra(bad);
    EXPECT_EQ(decoded.status().code(), StatusCode::kCorruption) << bad;
  }
}

}  // namespace
}  // namespace flashckpt

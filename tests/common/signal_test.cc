#include "common/format/signal.h"

#include <string>

#include "common/io/fs.h"
#include "test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

using testing::TempDir;

TEST(Signal, RoundTrips) {
  Signal s;
  s.rank = 3;
  s.step = 1200;
  s.resumed_from = 800;
  s.files = {"model_state.tp03_pp00_shard00.safetensors", "extra.rank00003.json"};
  auto parsed = ParseSignal(EncodeSignal("llama", s, 4096));
  ASSERT_OK(parsed.status());
  EXPECT_EQ(parsed->rank, 3u);
  EXPECT_EQ(parsed->step, 1200);
  EXPECT_EQ(parsed->resumed_from, 800);
  EXPECT_EQ(parsed->files, s.files);
}

TEST(Signal, RejectsBadInputs) {
  const std::string good_tail = R"("step": 5, "resumed_from": 0, "files": ["a.safetensors"]})";
  ASSERT_OK(ParseSignal(R"({"rank": 1, )" + good_tail).status());
  for (const std::string& bad : {
           std::string("not json"),
           std::string("[1, 2]"),
           R"({"rank": -1, )" + good_tail,
           R"({"rank": 1.5, )" + good_tail,
           // The catalog compares the signal's rank with the rank whose file it read: a rank that
           // only truncates to it (2^32 + 1 -> 1) must be refused, not taken for rank 1.
           R"({"rank": 4294967297, )" + good_tail,
           std::string(R"({"rank": 1, "step": "5", "resumed_from": 0, "files": []})"),
           std::string(R"({"rank": 1, "step": 5, "files": []})"),
           std::string(R"({"rank": 1, "step": 5, "resumed_from": 0, "files": "a"})"),
           std::string(R"({"rank": 1, "step": 5, "resumed_from": 0, "files": [7]})"),
       }) {
    auto s = ParseSignal(bad);
    EXPECT_EQ(s.status().code(), StatusCode::kCorruption) << bad;
  }
  EXPECT_OK(ParseSignal(R"({"rank": 4294967295, )" + good_tail).status());
}

// Names are joined to the checkpoint directory: each must be an entry of it.
TEST(Signal, RejectsFileNamesThatAreNotPlainNames) {
  for (const std::string name : {"", ".", "..", "../x.safetensors", "a/b.safetensors", "/etc/passwd",
                                 // a NUL would cut the path short: "..\0.safetensors" opens ".."
                                 "..\\u0000.safetensors"}) {
    const std::string text = R"({"rank": 0, "step": 5, "resumed_from": 0, "files": [")" + name + R"("]})";
    auto s = ParseSignal(text);
    EXPECT_EQ(s.status().code(), StatusCode::kCorruption) << text;
  }
}

TEST(Signal, ReadSignalNamesTheFile) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  ASSERT_OK(WriteFileDurably(dir.path(), "saved_signal_0", "{\"rank\": 0}"));
  auto s = ReadSignal(dir.File("saved_signal_0"));
  EXPECT_EQ(s.status().code(), StatusCode::kCorruption);
  EXPECT_NE(s.status().message().find(dir.File("saved_signal_0")), std::string::npos) << s.status().ToString();
  EXPECT_FALSE(ReadSignal(dir.File("saved_signal_1")).ok());
}

}  // namespace
}  // namespace flashckpt

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
  EXPECT_EQ(parsed->node, "");
  EXPECT_EQ(parsed->world_size, 0u);
}

// The run, the node that wrote it and the layout's world size travel with the signal; a signal
// without them (an older release) parses with them empty.
TEST(Signal, CarriesTheRunTheNodeAndTheWorldSize) {
  Signal s;
  s.rank = 5;
  s.step = 30;
  s.run_id = "slurm:4471";
  s.node = "gpu-node-07.cluster";
  s.world_size = 8;
  s.files = {"model_state.tp01_pp00_shard02.safetensors"};
  auto parsed = ParseSignal(EncodeSignal("llama", s, 10));
  ASSERT_OK(parsed.status());
  EXPECT_EQ(parsed->run_id, "slurm:4471");
  EXPECT_EQ(parsed->node, "gpu-node-07.cluster");
  EXPECT_EQ(parsed->world_size, 8u);

  const std::string head = R"({"rank": 5, "step": 30, "resumed_from": 0, "files": [])";
  for (const std::string& bad : {head + R"(, "node": ""})", head + R"(, "node": "a/b"})",
                                 head + R"(, "node": "a b"})", head + R"(, "node": 7})",
                                 head + R"(, "node": ")" + std::string(65, 'n') + R"("})",
                                 head + R"(, "world_size": 0})", head + R"(, "world_size": 5})",
                                 head + R"(, "world_size": -8})", head + R"(, "world_size": 4294967296})",
                                 head + R"(, "run_id": "a b"})"}) {
    EXPECT_EQ(ParseSignal(bad).status().code(), StatusCode::kCorruption) << bad;
  }
  EXPECT_OK(ParseSignal(head + R"(, "node": ")" + std::string(64, 'n') + R"(", "world_size": 6})").status());
}

// A signal records its files' headers (the completion then opens none of them); each must name one
// of its files, once, and fit in that file.
TEST(Signal, CarriesTheHeadersOfItsFiles) {
  Signal s;
  s.rank = 2;
  s.step = 40;
  s.files = {"model_state.tp02_pp00_shard00.safetensors", "optimizer.tp02_pp00_shard00.safetensors"};
  s.headers = {{s.files[0], 4088, 4096 + 512, R"({"w":{"dtype":"F32","shape":[128],"data_offsets":[0,512]}})"},
               {s.files[1], 4088, 4096, R"({"__metadata__":{"job":"a \"quoted\" name"}})"}};
  auto parsed = ParseSignal(EncodeSignal("llama", s, 0));
  ASSERT_OK(parsed.status());
  ASSERT_EQ(parsed->headers.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(parsed->headers[i].file, s.headers[i].file);
    EXPECT_EQ(parsed->headers[i].header_bytes, s.headers[i].header_bytes);
    EXPECT_EQ(parsed->headers[i].file_bytes, s.headers[i].file_bytes);
    EXPECT_EQ(parsed->headers[i].json, s.headers[i].json);
  }
  // Without headers (older releases, relayout, import) the field is absent and parses empty.
  s.headers.clear();
  EXPECT_EQ(EncodeSignal("llama", s, 0).find("headers"), std::string::npos);
  EXPECT_TRUE(ParseSignal(EncodeSignal("llama", s, 0))->headers.empty());

  const std::string head = R"({"rank": 1, "step": 5, "resumed_from": 0, "files": ["a.safetensors"], "headers": )";
  EXPECT_OK(ParseSignal(head + R"([{"file": "a.safetensors", "header_bytes": 2, "file_bytes": 10, "json": "{}"}]})")
                .status());
  for (const std::string& bad : {
           head + R"({}})",
           head + R"([7]})",
           head + R"([{"file": "a.safetensors", "header_bytes": 2, "file_bytes": 10}]})",
           head + R"([{"file": "b.safetensors", "header_bytes": 2, "file_bytes": 10, "json": "{}"}]})",
           head + R"([{"file": "a.safetensors", "header_bytes": -2, "file_bytes": 10, "json": "{}"}]})",
           // longer than its place, a place past the file's end, a header twice
           head + R"([{"file": "a.safetensors", "header_bytes": 1, "file_bytes": 10, "json": "{}"}]})",
           head + R"([{"file": "a.safetensors", "header_bytes": 2, "file_bytes": 9, "json": "{}"}]})",
           head + R"([{"file": "a.safetensors", "header_bytes": 4, "file_bytes": 3, "json": "{}"}]})",
           head + R"([{"file": "a.safetensors", "header_bytes": 2, "file_bytes": 10, "json": "{}"},)" +
               R"({"file": "a.safetensors", "header_bytes": 2, "file_bytes": 10, "json": "{}"}]})",
       }) {
    EXPECT_EQ(ParseSignal(bad).status().code(), StatusCode::kCorruption) << bad;
  }
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

#include "common/base/names.h"

#include <string>

#include "testing.h"

namespace flashckpt {
namespace {

TEST(ValidateJobName, AcceptsTheAllowedAlphabet) {
  EXPECT_OK(ValidateJobName("llama-7b_v1.2"));
  EXPECT_OK(ValidateJobName("a"));
  EXPECT_OK(ValidateJobName(std::string(kMaxJobNameLength, 'x')));
  EXPECT_OK(ValidateJobName("..."));  // only "." and ".." are path components with a meaning
}

TEST(ValidateJobName, RejectsNamesThatCouldEscapeTheRoot) {
  for (const char* bad : {"", "a/b", "/abs", "..", ".", "a b", "job\n", "ü", "a\\b", "a:b"}) {
    Status s = ValidateJobName(bad);
    EXPECT_FALSE(s.ok()) << "'" << bad << "' was accepted";
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_FALSE(ValidateJobName(std::string(kMaxJobNameLength + 1, 'x')).ok());
  EXPECT_FALSE(ValidateJobName(std::string("a\0b", 3)).ok());
}

TEST(ValidateTensorName, RejectsReservedAndSeparatorCharacters) {
  EXPECT_OK(ValidateTensorName("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_OK(ValidateTensorName("exp_avg/layer 1[0]"));
  for (const char* bad : {"", "__metadata__", "a@b", "a\"b", "a\\b", "a\tb", "\x7f"}) {
    EXPECT_FALSE(ValidateTensorName(bad).ok()) << "'" << bad << "' was accepted";
  }
  EXPECT_FALSE(ValidateTensorName(std::string(kMaxTensorNameLength + 1, 'x')).ok());
  EXPECT_OK(ValidateTensorName(std::string(kMaxTensorNameLength, 'x')));
}

TEST(Names, FormatFilesAndDirectories) {
  EXPECT_EQ(FileStem("model_state", 0, 1, 0), "model_state.tp00_pp01_shard00");
  EXPECT_EQ(FileStem("optimizer", 123, 4, 56), "optimizer.tp123_pp04_shard56");
  EXPECT_EQ(CheckpointDirName(1200), "checkpoint-1200");
  EXPECT_EQ(SignalFileName(3), "saved_signal_3");
  EXPECT_EQ(ExtraFileName(3), "extra.rank00003.json");
}

TEST(ParseCheckpointDirName, AcceptsOnlyCanonicalNames) {
  EXPECT_EQ(ParseCheckpointDirName("checkpoint-1200"), 1200);
  EXPECT_EQ(ParseCheckpointDirName("checkpoint-0"), 0);
  EXPECT_EQ(ParseCheckpointDirName(CheckpointDirName(987654321012345678)), 987654321012345678);
  for (const char* bad :
       {"checkpoint-", "checkpoint-01", "checkpoint--1", "checkpoint-+1", "checkpoint-12a", "checkpoint-1.5",
        "checkpoint-1200.tmp", "Checkpoint-1", "ckpt-1", "", "checkpoint-1 ", "checkpoint-9999999999999999999"}) {
    EXPECT_EQ(ParseCheckpointDirName(bad), std::nullopt) << "'" << bad << "' was accepted";
  }
}

TEST(ParseByteSize, ReadsBinaryUnits) {
  EXPECT_EQ(ParseByteSize("64GiB"), 64ull << 30);
  EXPECT_EQ(ParseByteSize("1.5GiB"), 3ull << 29);
  EXPECT_EQ(ParseByteSize("512MiB"), 512ull << 20);
  EXPECT_EQ(ParseByteSize("100"), 100u);
  EXPECT_EQ(ParseByteSize("4G"), 4ull << 30);
  EXPECT_EQ(ParseByteSize("2TiB"), 2ull << 40);
  EXPECT_EQ(ParseByteSize("8 KiB"), 8192u);
  EXPECT_EQ(ParseByteSize("0"), 0u);
}

TEST(ParseByteSize, RejectsGarbage) {
  for (const char* bad : {"abc", "12XB", "", "GiB", "-1", "1.2.3GiB", "12 XB", "1e3", "99999999999TiB"}) {
    EXPECT_EQ(ParseByteSize(bad), std::nullopt) << "'" << bad << "' was accepted";
  }
}

TEST(FormatBytes, PicksAReadableUnit) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1.0 KiB");
  EXPECT_EQ(FormatBytes(3ull << 29), "1.5 GiB");
  EXPECT_EQ(FormatBytes(5ull << 40), "5.0 TiB");
}

}  // namespace
}  // namespace flashckpt

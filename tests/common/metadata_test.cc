#include "common/format/metadata.h"

#include <filesystem>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "common/format/checksum.h"
#include "common/format/image.h"
#include "test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

using json = nlohmann::json;
using testing::Spec;
using testing::TempDir;

CheckpointMetadata SampleMetadata() {
  CheckpointMetadata m;
  m.job = "llama-7b";
  m.step = 1200;
  m.created = "2024-05-01T12:00:00Z";
  m.topology.world_size = 2;
  m.topology.tp_degree = 2;
  m.files = {SavedFile{"model_state.tp00_pp00_shard00.safetensors", 0, 0, 0, 0, 8192},
             SavedFile{"model_state.tp01_pp00_shard00.safetensors", 1, 1, 0, 0, 24576}};
  for (uint32_t r = 0; r < 2; ++r) {
    Piece p;
    p.key = "layers.0.w";
    p.kind = TensorKind::kModel;
    p.dtype = DType::kBF16;
    p.shape = {4, 8};
    p.global_shape = {8, 8};
    p.box_offset = {4 * r, 0};
    p.box_shape = {4, 8};
    p.file = m.files[r].name;
    p.begin = 4096;
    p.end = 4096 + 64;
    p.xxh3 = 0x0123456789abcdefull + r;
    m.pieces.push_back(p);
  }
  Piece opt;
  opt.key = "layers.0.w.exp_avg";
  opt.kind = TensorKind::kOptimizer;
  opt.dtype = DType::kF32;
  opt.shape = {6};
  opt.global_shape = {8, 8};
  opt.box_offset = {0, 0};
  opt.box_shape = {4, 8};
  opt.flat_range = FlatRange{10, 16};
  opt.file = m.files[0].name;
  opt.begin = 4096 + 64;
  opt.end = 4096 + 88;
  opt.xxh3 = ~0ull;
  m.pieces.push_back(opt);
  Piece big;  // larger than its checksum chunk: one xxh3 per 4 KiB chunk as well
  big.key = "layers.1.w";
  big.kind = TensorKind::kModel;
  big.dtype = DType::kF32;
  big.shape = {4000};
  big.global_shape = {4000};
  big.box_offset = {0};
  big.box_shape = {4000};
  big.file = m.files[1].name;
  big.begin = 4096 + 64;
  big.end = big.begin + 16000;
  big.chunk_bytes = 4096;
  big.chunk_xxh3 = {1, 2, 0xabcdefull, ~0ull};
  // Format version 2: the whole checksum of a chunked piece is the one its chunk checksums give.
  big.xxh3 = CombineChunkChecksums(big.chunk_xxh3.data(), big.chunk_xxh3.size(), big.end - big.begin);
  m.pieces.push_back(big);
  return m;
}

void ExpectSamePieces(const std::vector<Piece>& a, const std::vector<Piece>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].key, b[i].key);
    EXPECT_EQ(a[i].kind, b[i].kind);
    EXPECT_EQ(a[i].dtype, b[i].dtype);
    EXPECT_EQ(a[i].shape, b[i].shape);
    EXPECT_EQ(a[i].global_shape, b[i].global_shape);
    EXPECT_EQ(a[i].box_offset, b[i].box_offset);
    EXPECT_EQ(a[i].box_shape, b[i].box_shape);
    ASSERT_EQ(a[i].flat_range.has_value(), b[i].flat_range.has_value()) << a[i].key;
    if (a[i].flat_range) {
      EXPECT_EQ(a[i].flat_range->begin, b[i].flat_range->begin);
      EXPECT_EQ(a[i].flat_range->end, b[i].flat_range->end);
    }
    EXPECT_EQ(a[i].file, b[i].file);
    EXPECT_EQ(a[i].begin, b[i].begin);
    EXPECT_EQ(a[i].end, b[i].end);
    EXPECT_EQ(a[i].xxh3, b[i].xxh3);
    EXPECT_EQ(a[i].chunk_bytes, b[i].chunk_bytes);
    EXPECT_EQ(a[i].chunk_xxh3, b[i].chunk_xxh3);
  }
}

TEST(MetadataJson, RoundTrips) {
  CheckpointMetadata m = SampleMetadata();
  auto parsed = ParseMetadataJson(MetadataToJson(m));
  ASSERT_OK(parsed.status());
  EXPECT_EQ(parsed->job, m.job);
  EXPECT_EQ(parsed->step, m.step);
  EXPECT_EQ(parsed->created, m.created);
  EXPECT_EQ(parsed->topology.world_size, 2u);
  EXPECT_EQ(parsed->topology.tp_degree, 2u);
  EXPECT_EQ(parsed->topology.pp_degree, 1u);
  EXPECT_EQ(parsed->topology.shard_degree, 1u);
  ASSERT_EQ(parsed->files.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(parsed->files[i].name, m.files[i].name);
    EXPECT_EQ(parsed->files[i].rank, m.files[i].rank);
    EXPECT_EQ(parsed->files[i].tp_rank, m.files[i].tp_rank);
    EXPECT_EQ(parsed->files[i].bytes, m.files[i].bytes);
  }
  // Pieces are grouped by tensor name in the JSON; this sample is already in that order.
  ExpectSamePieces(parsed->pieces, m.pieces);
  // Serialising the parsed copy gives the same text: nothing was lost or reinterpreted.
  EXPECT_EQ(MetadataToJson(*parsed), MetadataToJson(m));
}

// Each case edits a valid metadata.json; every edit must be refused as corruption.
TEST(MetadataJson, RejectsBadInputs) {
  const json good = json::parse(MetadataToJson(SampleMetadata()));
  ASSERT_OK(ParseMetadataJson(good.dump()).status());
  auto first_piece = [](json& j) -> json& { return j["tensors"]["layers.0.w"][0]; };
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
  };
  const std::vector<Case> cases = {
      {"file name with a slash", [](json& j) { j["files"][0]["name"] = "../../etc/passwd"; }},
      {"file name with a slash inside", [](json& j) { j["files"][0]["name"] = "sub/x.safetensors"; }},
      {"file name ..", [](json& j) { j["files"][0]["name"] = ".."; }},
      {"file name .", [](json& j) { j["files"][0]["name"] = "."; }},
      {"empty file name", [](json& j) { j["files"][0]["name"] = ""; }},
      {"file name with a NUL", [](json& j) { j["files"][0]["name"] = std::string("x\0y", 3); }},
      {"piece names an unknown file", [&](json& j) { first_piece(j)["file"] = "other.safetensors"; }},
      {"job not a string", [](json& j) { j["job"] = 7; }},
      {"job missing", [](json& j) { j.erase("job"); }},
      {"step a string", [](json& j) { j["step"] = "1200"; }},
      {"step negative", [](json& j) { j["step"] = -1; }},
      {"step fractional", [](json& j) { j["step"] = 1.5; }},
      {"topology missing", [](json& j) { j.erase("topology"); }},
      {"world_size a string", [](json& j) { j["topology"]["world_size"] = "2"; }},
      {"world_size negative", [](json& j) { j["topology"]["world_size"] = -2; }},
      {"world_size above 32 bits", [](json& j) { j["topology"]["world_size"] = 1ull << 32; }},
      {"files not an array", [](json& j) { j["files"] = json::object(); }},
      {"file entry not an object", [](json& j) { j["files"][0] = "x"; }},
      {"file bytes negative", [](json& j) { j["files"][0]["bytes"] = -1; }},
      {"file rank missing", [](json& j) { j["files"][0].erase("rank"); }},
      {"tensors not an object", [](json& j) { j["tensors"] = json::array(); }},
      {"tensor not a list", [](json& j) { j["tensors"]["layers.0.w"] = json::object(); }},
      {"piece not an object", [&](json& j) { first_piece(j) = 3; }},
      {"unknown kind", [&](json& j) { first_piece(j)["kind"] = "weights"; }},
      {"unknown dtype", [&](json& j) { first_piece(j)["dtype"] = "F8"; }},
      {"shape of strings",
       [&](json& j) {
         first_piece(j)["shape"] = {"4", "8"};
       }},
      {"shape not an array", [&](json& j) { first_piece(j)["shape"] = 32; }},
      {"shape rank 9", [&](json& j) { first_piece(j)["shape"] = std::vector<int>(9, 1); }},
      {"offsets not matching shape",
       [&](json& j) {
         first_piece(j)["offsets"] = {4096, 4096 + 63};
       }},
      {"offsets reversed",
       [&](json& j) {
         first_piece(j)["offsets"] = {4160, 4096};
       }},
      {"three offsets",
       [&](json& j) {
         first_piece(j)["offsets"] = {4096, 4160, 4200};
       }},
      {"offsets missing", [&](json& j) { first_piece(j).erase("offsets"); }},
      {"box leaves the global tensor",
       [&](json& j) {
         first_piece(j)["box_offset"] = {5, 0};
       }},
      {"box rank differs", [&](json& j) { first_piece(j)["box_offset"] = {0}; }},
      {"flat range reversed",
       [](json& j) {
         j["tensors"]["layers.0.w.exp_avg"][0]["flat_range"] = {16, 10};
       }},
      {"flat range of one", [](json& j) { j["tensors"]["layers.0.w.exp_avg"][0]["flat_range"] = {16}; }},
      {"checksum too short", [&](json& j) { first_piece(j)["xxh3"] = "0123"; }},
      {"checksum not hex", [&](json& j) { first_piece(j)["xxh3"] = "0123456789abcdeg"; }},
      {"checksum a number", [&](json& j) { first_piece(j)["xxh3"] = 12; }},
      {"chunk checksums for a piece of one chunk",
       [&](json& j) {
         first_piece(j)["chunk_bytes"] = 4096;
         first_piece(j)["xxh3_chunks"] = "0123456789abcdef0123456789abcdef";
       }},
      {"one chunk checksum missing",
       [](json& j) {
         std::string& hex = j["tensors"]["layers.1.w"][0]["xxh3_chunks"].get_ref<std::string&>();
         hex.resize(hex.size() - 16);
       }},
      {"chunk checksum not hex",
       [](json& j) { j["tensors"]["layers.1.w"][0]["xxh3_chunks"].get_ref<std::string&>()[20] = 'x'; }},
      {"chunk size not a power of two", [](json& j) { j["tensors"]["layers.1.w"][0]["chunk_bytes"] = 4100; }},
      {"chunk size below 4 KiB", [](json& j) { j["tensors"]["layers.1.w"][0]["chunk_bytes"] = 2048; }},
      {"chunk size a string", [](json& j) { j["tensors"]["layers.1.w"][0]["chunk_bytes"] = "4096"; }},
      {"chunk checksums without a size", [](json& j) { j["tensors"]["layers.1.w"][0].erase("chunk_bytes"); }},
      {"chunk size without checksums", [](json& j) { j["tensors"]["layers.1.w"][0].erase("xxh3_chunks"); }},
      {"offsets beyond the end of the file",
       [&](json& j) {
         first_piece(j)["offsets"] = {8192, 8192 + 64};
       }},
      {"offsets near 2^64",
       [&](json& j) {
         first_piece(j)["offsets"] = {~0ull - 64, ~0ull};
       }},
      {"file of more than 2^62 bytes", [](json& j) { j["files"][0]["bytes"] = (1ull << 62) + 1; }},
      {"stored shape differs from the box",
       [&](json& j) {
         first_piece(j)["shape"] = {8, 4};
       }},
      {"flat range of another length",
       [](json& j) {
         j["tensors"]["layers.0.w.exp_avg"][0]["flat_range"] = {9, 16};
       }},
  };
  for (const auto& c : cases) {
    json j = good;
    c.edit(j);
    auto parsed = ParseMetadataJson(j.dump());
    EXPECT_FALSE(parsed.ok()) << c.what << " was accepted";
    EXPECT_EQ(parsed.status().code(), StatusCode::kCorruption) << c.what << ": " << parsed.status().ToString();
  }
  for (const char* text : {"", "[]", "null", "\"metadata\"", "{", "{\"job\":\"x\"}"}) {
    EXPECT_EQ(ParseMetadataJson(text).status().code(), StatusCode::kCorruption) << "'" << text << "'";
  }
}

// A files list that names a file twice (readers refuse it when they group pieces by file) is
// still written back as valid JSON: found by fuzz.metadata_json.
TEST(MetadataJson, WritesAFileListedTwiceAsItWasRead) {
  CheckpointMetadata m = SampleMetadata();
  m.files.push_back(m.files[0]);
  const std::string text = MetadataToJson(m);
  auto parsed = ParseMetadataJson(text);
  ASSERT_OK(parsed.status());
  EXPECT_EQ(parsed->files.size(), 3u);
  EXPECT_EQ(MetadataToJson(*parsed), text);
}

// A tensor named twice in "tensors" would have its pieces read twice (a JSON object with a repeated
// key has no one meaning): refused.
TEST(MetadataJson, RejectsATensorListedTwice) {
  const std::string good = MetadataToJson(SampleMetadata());
  ASSERT_OK(ParseMetadataJson(good).status());
  std::string twice = good;
  const std::string other = "\"layers.1.w\": [";
  const size_t at = twice.find(other);
  ASSERT_NE(at, std::string::npos);
  twice.replace(at, other.size(), "\"layers.0.w\": [");
  auto parsed = ParseMetadataJson(twice);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kCorruption);
  EXPECT_NE(parsed.status().message().find("'layers.0.w' is listed twice"), std::string::npos)
      << parsed.status().ToString();
}

// The pieces of `meta` whose tensor is `name`, in order.
std::vector<Piece> PiecesNamed(const CheckpointMetadata& meta, const std::string& name) {
  std::vector<Piece> out;
  for (const Piece& p : meta.pieces) {
    if (p.key == name) out.push_back(p);
  }
  return out;
}

// A reader that needs some tensors reads the index, the head and their lists, not the whole file.
TEST(MetadataIndex, ReadsTheHeadAndTheNamedTensorsOnly) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  CheckpointMetadata m = SampleMetadata();
  m.ema = EmaRecord{0.999, 2, "first", "fp32", std::nullopt, 7, 1, 1200};
  ASSERT_OK(WriteMetadataFiles(dir.path(), m));
  MetadataReadStats stats;
  auto some = ReadMetadataFor(dir.path(), {"layers.0.w.exp_avg", "not.saved"}, IoEnv::Default(), &stats);
  ASSERT_OK(some.status());
  EXPECT_TRUE(stats.used_index);
  EXPECT_EQ(stats.metadata_bytes, MetadataToJson(m).size());
  // The index, the head and one list: less than metadata.json, whose other lists were not read.
  EXPECT_LT(stats.bytes_read - MetadataToText(m).index.size(), stats.metadata_bytes);
  EXPECT_TRUE(some->partial);
  EXPECT_EQ(some->job, m.job);
  EXPECT_EQ(some->step, m.step);
  EXPECT_EQ(some->created, m.created);
  ASSERT_TRUE(some->ema.has_value());
  EXPECT_EQ(some->ema->updates_applied, 7u);
  ASSERT_EQ(some->files.size(), m.files.size());
  ExpectSamePieces(some->pieces, PiecesNamed(m, "layers.0.w.exp_avg"));
  // The kinds are the whole checkpoint's, though no model piece was read.
  EXPECT_TRUE(HoldsKind(*some, TensorKind::kModel));
  EXPECT_TRUE(HoldsKind(*some, TensorKind::kOptimizer));
  EXPECT_FALSE(HoldsKind(*some, TensorKind::kEma));

  auto all = ReadMetadataFor(dir.path(), {"layers.1.w", "layers.0.w", "layers.0.w.exp_avg"});
  ASSERT_OK(all.status());
  ExpectSamePieces(all->pieces, ParseMetadataJson(MetadataToJson(m))->pieces);
}

// An index that does not describe the metadata.json beside it (left from an earlier write, or
// either file damaged) is not used: the whole file is read, and what it says is what is returned.
TEST(MetadataIndex, OneThatDoesNotMatchMetadataJsonIsNotUsed) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const CheckpointMetadata m = SampleMetadata();
  ASSERT_OK(WriteMetadataFiles(dir.path(), m));
  const std::string good = MetadataToJson(m);
  // The same size, one checksum digit changed: in a tensor's list, then in the head.
  std::string other_list = good;
  const size_t digit = other_list.find("0123456789abcdef");
  ASSERT_NE(digit, std::string::npos);
  other_list[digit] = 'f';
  std::string other_head = good;
  const size_t size_digit = other_head.find("\"bytes\":8192");
  ASSERT_NE(size_digit, std::string::npos);
  other_head.replace(size_digit, 12, "\"bytes\":8193");
  struct Case {
    const char* what;
    std::string text;
  };
  for (const Case& c : {Case{"a list changed", other_list}, Case{"the head changed", other_head},
                        Case{"another size", good + " "}}) {
    ASSERT_OK(WriteFileDurably(dir.path(), "metadata.json", c.text));
    MetadataReadStats stats;
    auto read = ReadMetadataFor(dir.path(), {"layers.0.w"}, IoEnv::Default(), &stats);
    ASSERT_TRUE(read.ok()) << c.what << ": " << read.status().ToString();
    EXPECT_FALSE(stats.used_index) << c.what;
    auto whole = ParseMetadataJson(c.text);
    ASSERT_TRUE(whole.ok()) << c.what << ": " << whole.status().ToString();
    ExpectSamePieces(read->pieces, PiecesNamed(*whole, "layers.0.w"));
    EXPECT_EQ(read->files[0].bytes, whole->files[0].bytes) << c.what;
  }
  // A damaged index is no worse than none.
  ASSERT_OK(WriteFileDurably(dir.path(), kMetadataIndexName, "{\"format\": 7"));
  MetadataReadStats stats;
  auto read = ReadMetadataFor(dir.path(), {"layers.0.w"}, IoEnv::Default(), &stats);
  ASSERT_OK(read.status());
  EXPECT_FALSE(stats.used_index);
}

// Checkpoints of earlier releases have no index: the whole file is read and filtered.
TEST(MetadataIndex, WithoutOneTheWholeFileIsReadAndFiltered) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const CheckpointMetadata m = SampleMetadata();
  ASSERT_OK(WriteFileDurably(dir.path(), "metadata.json", MetadataToJson(m)));
  MetadataReadStats stats;
  auto read = ReadMetadataFor(dir.path(), {"layers.1.w"}, IoEnv::Default(), &stats);
  ASSERT_OK(read.status());
  EXPECT_FALSE(stats.used_index);
  EXPECT_TRUE(read->partial);
  ExpectSamePieces(read->pieces, PiecesNamed(m, "layers.1.w"));
  EXPECT_TRUE(HoldsKind(*read, TensorKind::kOptimizer));
  EXPECT_EQ(ReadMetadataFor(dir.path() + "/absent", {"layers.1.w"}).status().code(), StatusCode::kNotFound);
}

TEST(PiecesFromHeader, RejectsIncompleteTensorMetadata) {
  SafetensorsHeader h;
  h.data_start = 4096;
  h.data_bytes = 16;
  h.entries.push_back(SafetensorsEntry{"w", DType::kF32, {4}, 0, 16});
  h.metadata = {{"format_version", "2"},
                {"w@kind", "model"},
                {"w@global_shape", "[8]"},
                {"w@box_offset", "[4]"},
                {"w@box_shape", "[4]"},
                {"w@xxh3", "00000000000000ff"}};
  auto good = PiecesFromHeader(h, "f.safetensors");
  ASSERT_OK(good.status());
  ASSERT_EQ(good->size(), 1u);
  EXPECT_EQ((*good)[0].begin, 4096u);
  EXPECT_EQ((*good)[0].end, 4112u);
  EXPECT_EQ((*good)[0].xxh3, 0xffu);
  EXPECT_EQ((*good)[0].file, "f.safetensors");

  const std::vector<std::pair<std::string, std::string>> edits = {
      {"w@kind", ""},
      {"w@kind", "weights"},
      {"w@global_shape", ""},
      {"w@global_shape", "x"},
      {"w@box_offset", "[5]"},
      {"w@box_shape", "[4, 1]"},
      {"w@xxh3", ""},
      {"w@xxh3", "00000000000000FF"},
      {"w@flat_range", "[3, 2]"},
      {"w@flat_range", "[1]"},
      {"w@xxh3_chunks", "00000000000000ff00000000000000ff"},  // one chunk, and no checksum_chunk
      {"format_version", ""},
      {"format_version", "3"},
      {"format_version", "0"},
      {"format_version", "2.0"},
  };
  for (const auto& [key, value] : edits) {
    SafetensorsHeader bad = h;
    if (value.empty())
      bad.metadata.erase(key);
    else
      bad.metadata[key] = value;
    auto pieces = PiecesFromHeader(bad, "f.safetensors");
    EXPECT_FALSE(pieces.ok()) << key << "=" << value << " was accepted";
    EXPECT_NE(pieces.status().message().find("f.safetensors"), std::string::npos) << pieces.status().ToString();
  }
}

TEST(BuildMetadataFromDir, GathersEveryRanksFiles) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Topology t;
  t.world_size = 2;
  t.shard_degree = 2;
  std::vector<TensorSpec> specs = {Spec("w", TensorKind::kModel, DType::kBF16, {4, 4}),
                                   Spec("w.exp_avg", TensorKind::kOptimizer, DType::kF32, {16})};
  for (uint32_t r = 0; r < 2; ++r) {
    t.shard_rank = r;
    ASSERT_OK(testing::WriteRankFiles(dir.path(), "llama", r, t, specs, 300, r + 1));
  }
  ASSERT_OK(WriteFileDurably(dir.path(), "saved_signal_0", ""));  // not a .safetensors file: ignored
  auto meta = BuildMetadataFromDir(dir.path());
  ASSERT_OK(meta.status());
  EXPECT_EQ(meta->job, "llama");
  EXPECT_EQ(meta->step, 300);
  EXPECT_EQ(meta->topology.world_size, 2u);
  EXPECT_EQ(meta->topology.shard_degree, 2u);
  ASSERT_EQ(meta->files.size(), 4u);
  EXPECT_EQ(meta->pieces.size(), 4u);
  EXPECT_FALSE(meta->created.empty());
  for (const auto& f : meta->files) {
    ASSERT_TRUE(PathExists(dir.File(f.name))) << f.name;
    EXPECT_EQ(f.bytes, std::filesystem::file_size(dir.File(f.name))) << f.name;
    EXPECT_EQ(f.rank, f.shard_rank) << f.name;
  }
  ASSERT_OK(testing::WriteMetadata(dir.path()));
  auto read = ReadMetadataFile(dir.path());
  ASSERT_OK(read.status());
  EXPECT_EQ(read->files.size(), 4u);
  EXPECT_EQ(read->step, 300);
}

TEST(BuildMetadataFromDir, RefusesFilesOfDifferentSteps) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Topology t;
  t.world_size = 2;
  t.shard_degree = 2;
  std::vector<TensorSpec> specs = {Spec("w", TensorKind::kModel, DType::kF32, {4})};
  ASSERT_OK(testing::WriteRankFiles(dir.path(), "llama", 0, t, specs, 300));
  t.shard_rank = 1;
  ASSERT_OK(testing::WriteRankFiles(dir.path(), "llama", 1, t, specs, 400));
  EXPECT_EQ(BuildMetadataFromDir(dir.path()).status().code(), StatusCode::kCorruption);

  TempDir empty;
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(BuildMetadataFromDir(empty.path()).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(ReadMetadataFile(empty.path()).status().code(), StatusCode::kNotFound);
}

// Writes the ema file of rank 0 at step 300 whose header records `record`, as the daemon does.
Status WriteEmaFile(const std::string& dir, const EmaRecord& record) {
  ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout("llama", 0, Topology{},
                                                      {Spec("w", TensorKind::kEma, DType::kF32, {4})},
                                                      EmaFileExtras(record, kDefaultChecksumChunk)));
  testing::SlotBuffer slot(layout.slot_bytes);
  InitSlotImages(slot.data(), layout);
  StampImage(slot.data(), layout, 0, 300);
  StampEmaCounters(slot.data(), layout, 0, 7, 1, 300);
  const FileImage& image = layout.files[0];
  return WriteFileDurably(dir, image.stem + ".safetensors",
                          std::string_view(slot.data() + image.slot_offset, image.file_bytes()));
}

// Found by tests/fuzz/safetensors_header_fuzzer: an ema file header with ema_decay "1e999" or "nan"
// was accepted, and the metadata.json built from it held "decay": null, which ReadMetadataFile
// refuses, so the checkpoint completed and could never be restored or verified.
TEST(BuildMetadataFromDir, RefusesAnEmaRecordThatMetadataJsonCannotHold) {
  EmaRecord good;
  good.decay = 0.999;
  good.interval = 2;
  good.init = "first";
  good.model_params = "fp32";
  good.loss_threshold = 5.0;
  {
    TempDir dir;
    ASSERT_TRUE(dir.ok());
    ASSERT_OK(WriteEmaFile(dir.path(), good));
    ASSERT_OK(testing::WriteMetadata(dir.path()));
    auto read = ReadMetadataFile(dir.path());
    ASSERT_OK(read.status());
    ASSERT_TRUE(read->ema.has_value());
    EXPECT_EQ(read->ema->decay, 0.999);
    EXPECT_EQ(read->ema->loss_threshold, 5.0);
    EXPECT_EQ(read->ema->updates_applied, 7u);
  }
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<std::pair<double, double>> bad_values = {{inf, 5.0}, {nan, 5.0}, {-inf, 5.0}, {0.999, inf}, {0.999, nan}};
  for (const auto& [decay, threshold] : bad_values) {
    EmaRecord bad = good;
    bad.decay = decay;
    bad.loss_threshold = threshold;
    TempDir dir;
    ASSERT_TRUE(dir.ok());
    ASSERT_OK(WriteEmaFile(dir.path(), bad));
    auto meta = BuildMetadataFromDir(dir.path());
    EXPECT_EQ(meta.status().code(), StatusCode::kCorruption) << "decay " << decay << " threshold " << threshold;
    EXPECT_NE(meta.status().message().find("finite"), std::string::npos) << meta.status().ToString();
  }
}

}  // namespace
}  // namespace flashckpt

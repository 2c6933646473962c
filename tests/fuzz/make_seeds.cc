// fuzz_seeds DIR: writes the seed corpora of the fuzz targets, one folder per target under DIR,
// from a small real checkpoint made by the daemon's own code: rank layouts (a tensor split over
// shard ranks as flat ranges, one larger than its 4 KiB checksum chunk, a replica, an EMA file),
// stamped images (and copies without the header padding), metadata.json gathered from their
// headers, and the ranks' signals. Generated rather than checked in, so the seeds follow the format
// as it changes. Each file is a few KiB at most. With a second argument, a checkpoint directory of
// an older format version (tests/data/format_v1), its files and metadata.json are added as seeds
// ("v1.<name>") so that the fuzzers cover every format version readers accept. The replica-part
// fuzzer gets a few encoded parts, written here byte by byte.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/base/names.h"
#include "common/format/checksum.h"
#include "common/format/image.h"
#include "common/format/layout.h"
#include "common/format/metadata.h"
#include "common/format/node_part.h"
#include "common/format/safetensors.h"
#include "common/format/signal.h"
#include "common/io/fs.h"
#include "common/test_util.h"

namespace flashckpt {
namespace {

using testing::SlotBuffer;
using testing::Spec;

constexpr char kJob[] = "seed-job";
constexpr int64_t kStep = 1200;
constexpr uint64_t kChunk = kMinChecksumChunk;

// Writes the images of one rank layout into `dir` and returns their names.
Result<std::vector<std::string>> WriteLayout(const std::string& dir, uint32_t rank, const Topology& topology,
                                             const std::vector<TensorSpec>& specs, const LayoutExtras& extras) {
  ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout(kJob, rank, topology, specs, extras));
  SlotBuffer slot(layout.slot_bytes);
  if (slot.data() == nullptr) return Internal("aligned_alloc failed");
  InitSlotImages(slot.data(), layout);
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    const Placement& p = layout.placements[t];
    for (uint64_t i = 0; i < p.bytes; ++i) slot.data()[p.slot_offset + i] = static_cast<char>(i * 7 + t);
  }
  std::vector<std::string> names;
  for (size_t f = 0; f < layout.files.size(); ++f) {
    StampImage(slot.data(), layout, f, kStep);
    if (layout.files[f].kind == "ema") StampEmaCounters(slot.data(), layout, f, 12, 3, kStep);
    const FileImage& image = layout.files[f];
    names.push_back(image.stem + ".safetensors");
    RETURN_IF_ERROR(WriteFileDurably(dir, names.back(),
                                     std::string_view(slot.data() + image.slot_offset, image.file_bytes())));
  }
  return names;
}

// Beside each image, "<name>.compact": the same file without the header's padding (the length
// prefix says so), most of whose bytes are then JSON for the fuzzer to mutate.
Status WriteCompactCopies(const std::string& dir, const CheckpointMetadata& meta) {
  for (const SavedFile& f : meta.files) {
    ASSIGN_OR_RETURN(std::string bytes, ReadSmallFile(dir + "/" + f.name, 1u << 20));
    ASSIGN_OR_RETURN(uint64_t n, ParseHeaderLength(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()));
    const std::string json = bytes.substr(8, n);
    const std::string trimmed = json.substr(0, json.find_last_not_of(' ') + 1);
    std::string compact(8, '\0');
    for (int i = 0; i < 8; ++i) compact[i] = static_cast<char>((trimmed.size() >> (8 * i)) & 0xff);
    compact += trimmed;
    compact += bytes.substr(8 + n);
    RETURN_IF_ERROR(WriteFileDurably(dir, f.name + ".compact", compact));
  }
  return Status::OK();
}

Status WriteSeeds(const std::string& root) {
  const std::string headers = root + "/safetensors_header";
  const std::string metadata = root + "/metadata_json";
  const std::string signals = root + "/signal";
  for (const auto& dir : {headers, metadata, signals}) RETURN_IF_ERROR(MakeDirs(dir));


  // Two shard ranks: the weight "w" (4 x 260 f32: two 4 KiB checksum chunks) is saved by shard 0
  // and a replica on shard 1; its optimizer state is split between them as flat ranges.
  Topology topology;
  topology.world_size = 2;
  topology.shard_degree = 2;
  EmaRecord ema;
  ema.decay = 0.999;
  ema.interval = 2;
  ema.init = "first";
  ema.model_params = "fp32";
  ema.loss_threshold = 5.0;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    Topology t = topology;
    t.shard_rank = rank;
    TensorSpec w = Spec("w", TensorKind::kModel, DType::kF32, {4, 260});
    w.replica = rank != 0;
    TensorSpec b = Spec("b", TensorKind::kModel, DType::kBF16, {4});
    b.replica = rank != 0;
    TensorSpec m = Spec("w.exp_avg", TensorKind::kOptimizer, DType::kF32, {520});
    m.box_shape = {4, 260};
    m.flat_range = FlatRange{520 * rank, 520 * (rank + 1)};
    TensorSpec step = Spec("step", TensorKind::kOptimizer, DType::kI64, {});
    LayoutExtras plain;
    plain.checksum_chunk = kChunk;
    ASSIGN_OR_RETURN(auto files, WriteLayout(headers, rank, t, {w, b, m, step}, plain));
    if (rank == 0) {
      ASSIGN_OR_RETURN(auto ema_files, WriteLayout(headers, rank, t, {Spec("b", TensorKind::kEma, DType::kF32, {4})},
                                                   EmaFileExtras(ema, kChunk)));
      files.insert(files.end(), ema_files.begin(), ema_files.end());
    }
    Signal signal;
    signal.rank = rank;
    signal.step = kStep;
    signal.resumed_from = 1000;
    signal.run_id = "seed-run";
    signal.node = "seed-node-" + std::to_string(rank);
    signal.world_size = 2;
    signal.files = files;
    // The first file's header, recorded as a daemon's signal records it (padding left out).
    ASSIGN_OR_RETURN(std::string first, ReadSmallFile(headers + "/" + files[0], 1u << 24));
    if (first.size() < 8) return Corruption(files[0] + " is shorter than a safetensors length prefix");
    ASSIGN_OR_RETURN(const uint64_t header_bytes,
                     ParseHeaderLength(reinterpret_cast<const unsigned char*>(first.data()), first.size()));
    std::string json = first.substr(8, header_bytes);
    json.erase(json.find_last_not_of(' ') + 1);
    signal.headers.push_back(SignalHeader{files[0], header_bytes, first.size(), json});
    RETURN_IF_ERROR(WriteFileDurably(signals, SignalFileName(rank), EncodeSignal(kJob, signal, 16384)));
  }
  ASSIGN_OR_RETURN(CheckpointMetadata meta, BuildMetadataFromDir(headers));
  meta.run_id = "seed-run";
  meta.resumed_from = 1000;
  RETURN_IF_ERROR(WriteFileDurably(metadata, "metadata.json", MetadataToJson(meta)));
  RETURN_IF_ERROR(WriteCompactCopies(headers, meta));

  // A daemon's part of the step: both ranks' files, rendered (daemon/pipeline/node_parts.h).
  {
    const std::string parts = root + "/node_part";
    RETURN_IF_ERROR(MakeDirs(parts));
    ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(headers));
    ASSIGN_OR_RETURN(std::vector<RenderedFile> rendered, RenderFiles(headers, names));
    NodePart part;
    part.job = kJob;
    part.step = kStep;
    part.attempt = Attempt{"seed-run", 1000};
    for (uint32_t rank = 0; rank < 2; ++rank) {
      RankPart r;
      r.rank = rank;
      r.written_us = 1764000000000000 + rank;
      r.signal = SignalIdentity{100 + rank, 2048, 1764000000000000000};
      for (const RenderedFile& f : rendered) {
        if (f.file.rank == rank) r.files.push_back(f);
      }
      part.ranks.push_back(std::move(r));
    }
    std::string json = EncodeNodePart(part);
    json.resize(json.rfind("\nxxh3 "));  // the fuzzer appends the checksum line itself
    RETURN_IF_ERROR(WriteFileDurably(parts, "node_part_seed.json", json));
  }

  // A replica part as peers send it (first byte: how the fuzzer cuts it into slices): a data part
  // in the encoding read in place (data = 2, then xxh3 = 3), the same cut in three, the fields the
  // other way round, and a header (field 1, an empty ReplicaHeader).
  {
    const std::string parts = root + "/replica_part";
    RETURN_IF_ERROR(MakeDirs(parts));
    const std::string payload = "replica bytes";
    std::string data_part = std::string("\x12") + static_cast<char>(payload.size()) + payload + "\x19";
    const uint64_t sum = Xxh3(payload.data(), payload.size());
    for (int i = 0; i < 8; ++i) data_part += static_cast<char>((sum >> (8 * i)) & 0xff);
    RETURN_IF_ERROR(WriteFileDurably(parts, "data", std::string(1, '\0') + data_part));
    RETURN_IF_ERROR(WriteFileDurably(parts, "data-in-three", std::string(1, '\x96') + data_part));
    const std::string reordered = data_part.substr(2 + payload.size()) + data_part.substr(0, 2 + payload.size());
    RETURN_IF_ERROR(WriteFileDurably(parts, "reordered", std::string(1, '\x01') + reordered));
    RETURN_IF_ERROR(WriteFileDurably(parts, "header", std::string("\x00\x0a\x00", 3)));
  }

  // What `flashckpt import` reads: a Hugging Face file (a compact header, "format": "pt", two
  // tensors) and an index, named so that the gathering above (of *.safetensors) skips them.
  {
    const std::string json =
        R"({"__metadata__":{"format":"pt"},"a.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
        R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[16,20]}})";
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
    file += json + std::string(20, '\x01');
    RETURN_IF_ERROR(WriteFileDurably(headers, "hf-model-file", file));
    RETURN_IF_ERROR(WriteFileDurably(
        headers, "hf-index-json",
        R"({"metadata":{"total_size":20},"weight_map":{"a.weight":"model-00001-of-00002.safetensors",)"
        R"("b":"model-00002-of-00002.safetensors"}})"));
  }
  return Status::OK();
}

// The files of an older-format checkpoint `from` as seeds: its safetensors files (and compact
// copies) for the header fuzzer, its metadata.json for the metadata fuzzer.
Status AddOlderFormatSeeds(const std::string& root, const std::string& from) {
  ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(from));
  size_t added = 0;
  for (const std::string& name : names) {
    const bool is_meta = name == "metadata.json";
    if (!is_meta && (name.size() < 12 || name.compare(name.size() - 12, 12, ".safetensors") != 0)) continue;
    ASSIGN_OR_RETURN(std::string bytes, ReadSmallFile(from + "/" + name, 1u << 20));
    RETURN_IF_ERROR(WriteFileDurably(root + (is_meta ? "/metadata_json" : "/safetensors_header"), "v1." + name, bytes));
    ++added;
  }
  if (added == 0) return NotFound(from + ": no checkpoint files to add as seeds");
  return Status::OK();
}

}  // namespace
}  // namespace flashckpt

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s DIR [OLDER_FORMAT_CHECKPOINT_DIR]\n", argv[0]);
    return 2;
  }
  flashckpt::Status s = flashckpt::WriteSeeds(argv[1]);
  if (s.ok() && argc == 3) s = flashckpt::AddOlderFormatSeeds(argv[1], argv[2]);
  if (!s.ok()) {
    std::fprintf(stderr, "fuzz_seeds: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

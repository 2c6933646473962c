// What a checkpoint holds: pieces of tensors in files, described by each file's own header and
// gathered into metadata.json, the file whose presence makes a checkpoint complete.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/status.h"
#include "common/format/layout.h"
#include "common/format/safetensors.h"
#include "common/format/signal.h"
#include "flashckpt/tensor.h"

namespace simdjson::dom {
class element;
}

namespace flashckpt {

class ParallelLoop;

inline constexpr uint64_t kMaxMetadataJsonBytes = 1ull << 30;
// Files larger than this (4 EiB) are refused as corrupt, so offsets within them never overflow.
inline constexpr uint64_t kMaxCheckpointFileBytes = 1ull << 62;

// One saved piece of a tensor: where it sits in the global tensor and in which file.
struct Piece {
  std::string key;  // tensor name
  TensorKind kind = TensorKind::kModel;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;  // local shape as stored
  std::vector<uint64_t> global_shape;
  std::vector<uint64_t> box_offset;
  std::vector<uint64_t> box_shape;
  std::optional<FlatRange> flat_range;
  std::string file;    // file name inside the checkpoint directory
  uint64_t begin = 0;  // absolute byte range in the file
  uint64_t end = 0;
  uint64_t xxh3 = 0;
  // xxh3 of each chunk of `chunk_bytes` bytes from `begin` (the last may be shorter); empty when
  // the piece fits in one chunk, whose checksum is then `xxh3`.
  uint64_t chunk_bytes = 0;
  std::vector<uint64_t> chunk_xxh3;
  // Whether `xxh3` is CombineChunkChecksums of `chunk_xxh3` (format version 2 and later, pieces with
  // chunk checksums) rather than the hash of the bytes. Readers that parse a piece check this
  // relation, so verifying every chunk verifies the piece.
  bool whole_from_chunks = false;
};

struct SavedFile {
  std::string name;  // "model_state.tp00_pp00_shard00.safetensors"
  uint32_t rank = 0;
  uint32_t tp_rank = 0, pp_rank = 0, shard_rank = 0;
  uint64_t bytes = 0;
};

// The EMA configuration and progress recorded in the ema files of a checkpoint.
struct EmaRecord {
  double decay = 0;
  uint32_t interval = 1;
  std::string init;          // "first" or "zeros"
  std::string model_params;  // "fp32" or "all"
  std::optional<double> loss_threshold;
  uint64_t updates_applied = 0;
  uint64_t updates_skipped = 0;
  int64_t last_step = 0;
};

// The "ema" object of metadata.json and of a node part (common/format/node_part.h): its one writer
// (nlohmann's json, so the keys come out sorted, as metadata.json has always had them) and its one
// parser of untrusted text; `where` names the document in errors. A loss_threshold of null (how a
// NaN is written) reads as none.
nlohmann::json EmaRecordToJson(const EmaRecord& e);
Result<EmaRecord> ParseEmaRecord(const simdjson::dom::element& e, const std::string& where);

// The metadata of an ema file image, read back by BuildMetadataFromFiles into an EmaRecord: the
// configuration of `record` as fixed strings, and the three counters as fixed-width fields that
// StampEmaCounters (common/format/image.h) fills at save time.
LayoutExtras EmaFileExtras(const EmaRecord& record, uint64_t checksum_chunk);

struct CheckpointMetadata {
  int format_version = kFormatVersion;  // of every file (they agree); see kFormatVersion
  std::string job;
  int64_t step = 0;
  Topology topology;  // degrees and world size; the per-rank coordinates are per file
  std::vector<SavedFile> files;
  std::vector<Piece> pieces;
  std::string created;           // UTC, ISO 8601
  // The attempt whose signals completed it (common/format/signal.h); run_id is empty for a
  // checkpoint written before runs had ids, and for one built from its files alone.
  std::string run_id;
  int64_t resumed_from = 0;
  std::optional<EmaRecord> ema;  // present when the checkpoint carries ema files
  // Set by ReadMetadataFor: `pieces` holds only the pieces of the tensors named in `names_read`
  // (sorted, each once), and `kinds_saved` the kinds of tensor the whole checkpoint holds.
  bool partial = false;
  std::vector<std::string> names_read;
  std::vector<TensorKind> kinds_saved;
};

// Whether the checkpoint holds tensors of `kind` (for partial metadata, from kinds_saved).
bool HoldsKind(const CheckpointMetadata& meta, TensorKind kind);
// Whether `meta` has every piece of tensor `name` the checkpoint holds: true unless it is partial
// and `name` was not read. A reader checking a file's header skips the tensors it did not read.
bool HasPiecesOf(const CheckpointMetadata& meta, const std::string& name);

// The format version a file's `__metadata__` or metadata.json records: kCorruption unless it is
// one this release reads (kOldestFormatVersion..kFormatVersion), naming `where`.
Result<int> ParseFormatVersion(std::string_view text, const std::string& where);

// The pieces a flashckpt safetensors file declares, checked for consistency (kind, global shape,
// box, flat range and checksum present and well-formed for every tensor, and from format version 2
// a chunked tensor's whole checksum equal to the one its chunk checksums give).
Result<std::vector<Piece>> PiecesFromHeader(const SafetensorsHeader& header, const std::string& file_name);

// Reads every *.safetensors file header of a checkpoint directory and gathers the metadata. All
// files must agree on job, step and topology degrees.
Result<CheckpointMetadata> BuildMetadataFromDir(const std::string& dir);
// The same from the named files only (what the ranks' signals list), ignoring anything else there.
// `loop` (optional): reads the headers on its threads (the caller's loop, not running anything else).
// `recorded` (optional): headers the ranks' signals record, by file name; those files are not opened.
Result<CheckpointMetadata> BuildMetadataFromFiles(const std::string& dir, std::vector<std::string> names,
                                                  IoEnv* io = IoEnv::Default(), ParallelLoop* loop = nullptr,
                                                  const std::map<std::string, const SignalHeader*>* recorded = nullptr);

// metadata.json, and metadata.index.json: where in metadata.json its head (everything but the
// tensors) and each tensor's list of pieces sit, with their XXH3 checksums, and the kinds of tensor
// the checkpoint holds. A reader that needs a few tensors of a job of thousands of ranks reads the
// index, the head and those lists (ReadMetadataFor) instead of the whole file.
inline constexpr char kMetadataIndexName[] = "metadata.index.json";
struct MetadataText {
  std::string json;
  std::string index;
};
MetadataText MetadataToText(const CheckpointMetadata& meta);
std::string MetadataToJson(const CheckpointMetadata& meta);  // MetadataToText(meta).json
// Writes metadata.index.json then metadata.json into `dir`, each durably (WriteFileDurably):
// metadata.json last, since it makes the checkpoint complete.
Status WriteMetadataFiles(const std::string& dir, const CheckpointMetadata& meta, IoEnv* io = IoEnv::Default());
// The same, of text made already (MetadataToText, MetadataTextOfRendered).
Status WriteMetadataText(const std::string& dir, const MetadataText& text, IoEnv* io = IoEnv::Default());

// A file's share of metadata.json, rendered from its header before the completion: the daemon that
// writes a rank's files renders them as it writes the rank's signal, so that the completion of a
// step of thousands of ranks joins text instead of parsing a header per file on its critical path
// (daemon/pipeline/node_parts.h).
struct RenderedFile {
  int format_version = 0;
  std::string job;
  int64_t step = 0;
  Topology topology;
  SavedFile file;
  std::optional<EmaRecord> ema;   // an ema file's record
  std::vector<TensorKind> kinds;  // of its pieces, each once, in the enum's order
  size_t pieces = 0;
  // Per tensor (in the file's order): its pieces of this file as metadata.json lists them, joined
  // by ",\n   ".
  std::vector<std::pair<std::string, std::string>> tensors;
};
// `header` of file `name` (at `path`, for errors), checked as BuildMetadataFromFiles checks it.
Result<RenderedFile> RenderFile(const std::string& path, const std::string& name, const SafetensorsHeader& header);
// The named *.safetensors files of `dir`, rendered (other names are left out), with the headers
// as BuildMetadataFromFiles reads them (`loop`, `recorded`). Sorted by name.
Result<std::vector<RenderedFile>> RenderFiles(const std::string& dir, std::vector<std::string> names,
                                              IoEnv* io = IoEnv::Default(), ParallelLoop* loop = nullptr,
                                              const std::map<std::string, const SignalHeader*>* recorded = nullptr);
// metadata.json and its index of the checkpoint whose files are `files` (in any order), checked to
// agree as BuildMetadataFromFiles checks them: byte for byte what MetadataToText writes for the
// metadata BuildMetadataFromFiles gathers from the same files. `head` gives run_id, resumed_from and
// created (empty: now) and receives the rest of the metadata but the pieces (kinds_saved set).
Result<MetadataText> MetadataTextOfRendered(const std::string& dir, std::vector<const RenderedFile*> files,
                                            CheckpointMetadata* head);

// The "files" list of metadata.json (and of `flashckpt inspect --json`): per file its name, rank,
// tp_rank, pp_rank, shard_rank and bytes, in that key order.
nlohmann::ordered_json SavedFilesJson(const std::vector<SavedFile>& files);
// Parses metadata.json; the input is untrusted and every field is checked.
Result<CheckpointMetadata> ParseMetadataJson(std::string_view json);
Result<CheckpointMetadata> ReadMetadataFile(const std::string& checkpoint_dir, IoEnv* io = IoEnv::Default());

// What ReadMetadataFor read: metadata.json's size, the bytes it read of it and of the index, and
// whether the index was used (false: no index, or one that does not match metadata.json, and the
// whole file was read).
struct MetadataReadStats {
  uint64_t metadata_bytes = 0;
  uint64_t bytes_read = 0;
  bool used_index = false;
};
// The metadata with the pieces of the tensors named in `names` only (`partial` set): through
// metadata.index.json, the index, metadata.json's head and those tensors' lists, each checked
// against the index's checksum; the whole of metadata.json, filtered, when there is no index or it
// does not match. A name the checkpoint does not hold has no pieces.
Result<CheckpointMetadata> ReadMetadataFor(const std::string& checkpoint_dir, const std::vector<std::string>& names,
                                           IoEnv* io = IoEnv::Default(), MetadataReadStats* stats = nullptr);

}  // namespace flashckpt

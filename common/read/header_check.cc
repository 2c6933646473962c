#include "common/read/header_check.h"

#include <algorithm>
#include <charconv>
#include <set>

#include "common/base/dtype.h"
#include "common/format/checksum.h"

namespace flashckpt {
namespace {

std::string ShapeText(const std::vector<uint64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string RangeText(const std::optional<FlatRange>& r) {
  return r ? "[" + std::to_string(r->begin) + ", " + std::to_string(r->end) + ")" : "none";
}

// How the piece a file's header declares differs from what metadata.json records; empty if not.
std::string PieceDifference(const Piece& disk, const Piece& meta) {
  auto differ = [](const char* what, const std::string& d, const std::string& m) {
    return std::string(what) + " is " + d + " in the file header but " + m + " in metadata.json";
  };
  if (disk.kind != meta.kind) {
    return differ("kind", std::string(TensorKindName(disk.kind)), std::string(TensorKindName(meta.kind)));
  }
  if (disk.dtype != meta.dtype) {
    return differ("dtype", std::string(DTypeName(disk.dtype)), std::string(DTypeName(meta.dtype)));
  }
  if (disk.shape != meta.shape) return differ("shape", ShapeText(disk.shape), ShapeText(meta.shape));
  if (disk.global_shape != meta.global_shape) {
    return differ("global shape", ShapeText(disk.global_shape), ShapeText(meta.global_shape));
  }
  if (disk.box_offset != meta.box_offset) {
    return differ("box offset", ShapeText(disk.box_offset), ShapeText(meta.box_offset));
  }
  if (disk.box_shape != meta.box_shape) {
    return differ("box shape", ShapeText(disk.box_shape), ShapeText(meta.box_shape));
  }
  bool same_range = disk.flat_range.has_value() == meta.flat_range.has_value() &&
                    (!disk.flat_range || (disk.flat_range->begin == meta.flat_range->begin &&
                                          disk.flat_range->end == meta.flat_range->end));
  if (!same_range) return differ("flat range", RangeText(disk.flat_range), RangeText(meta.flat_range));
  if (disk.begin != meta.begin || disk.end != meta.end) {
    return differ("byte range", ShapeText({disk.begin, disk.end}), ShapeText({meta.begin, meta.end}));
  }
  if (disk.xxh3 != meta.xxh3) return differ("recorded xxh3", ChecksumHex(disk.xxh3), ChecksumHex(meta.xxh3));
  if (disk.chunk_bytes != meta.chunk_bytes || disk.chunk_xxh3 != meta.chunk_xxh3) {
    return "the per-chunk checksums in the file header differ from those in metadata.json";
  }
  return {};
}

}  // namespace

Result<RecordedFiles> GroupPiecesByFile(const std::string& dir, const CheckpointMetadata& meta) {
  RecordedFiles recorded;
  for (const SavedFile& f : meta.files) {
    if (!recorded.emplace(f.name, RecordedPieces{}).second) {
      return Corruption(dir + "/metadata.json: file '" + f.name + "' is listed twice");
    }
  }
  for (const Piece& p : meta.pieces) {
    if (!recorded[p.file].emplace(p.key, &p).second) {
      return Corruption(dir + "/metadata.json: tensor '" + p.key + "' has two pieces in file '" + p.file + "'");
    }
  }
  return recorded;
}

Result<std::vector<Piece>> CheckFileHeader(const std::string& path, const std::string& file_name,
                                           const SafetensorsHeader& header, const CheckpointMetadata& meta,
                                           const RecordedPieces& recorded) {
  // A file of another step or job copied over this one may be self-consistent; its header says so.
  auto job = header.metadata.find("job");
  auto step = header.metadata.find("step");
  int64_t file_step = -1;
  if (step != header.metadata.end()) {
    const std::string& s = step->second;
    auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), file_step);
    if (ec != std::errc() || ptr != s.data() + s.size()) file_step = -1;
  }
  if (job == header.metadata.end() || job->second != meta.job || file_step != meta.step) {
    return Corruption(path + ": header names job '" + (job == header.metadata.end() ? "" : job->second) + "' step " +
                      (step == header.metadata.end() ? "?" : step->second) + ", metadata.json job '" + meta.job +
                      "' step " + std::to_string(meta.step));
  }
  // The format version decides how the whole checksums are checked: the file and metadata.json agree.
  auto version = header.metadata.find("format_version");
  if (version != header.metadata.end() && version->second != std::to_string(meta.format_version)) {
    return Corruption(path + ": header has format_version " + version->second + ", metadata.json " +
                      std::to_string(meta.format_version));
  }
  ASSIGN_OR_RETURN(std::vector<Piece> pieces, PiecesFromHeader(header, file_name));
  for (const Piece& p : pieces) {
    auto it = recorded.find(p.key);
    if (it == recorded.end()) {
      if (!HasPiecesOf(meta, p.key)) continue;  // a tensor this reader did not read of metadata.json
      return Corruption(path + ": tensor '" + p.key + "' is in the file but metadata.json does not list it there");
    }
    std::string diff = PieceDifference(p, *it->second);
    if (!diff.empty()) return Corruption(path + ": tensor '" + p.key + "': " + diff);
  }
  // A reader of part of metadata.json checks the tensors it read, and returns only those.
  pieces.erase(std::remove_if(pieces.begin(), pieces.end(), [&](const Piece& p) { return !HasPiecesOf(meta, p.key); }),
               pieces.end());
  if (pieces.size() != recorded.size()) {
    std::set<std::string> present;
    for (const Piece& p : pieces) present.insert(p.key);
    for (const auto& [key, piece] : recorded) {
      if (!present.count(key)) {
        return Corruption(path + ": tensor '" + key + "' is listed in metadata.json but absent from the file");
      }
    }
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  return pieces;
}

Status CheckFileHeaders(const std::string& dir, const CheckpointMetadata& meta, IoEnv* io) {
  ASSIGN_OR_RETURN(RecordedFiles recorded, GroupPiecesByFile(dir, meta));
  for (const SavedFile& f : meta.files) {
    const std::string path = dir + "/" + f.name;
    ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(path, io));
    RETURN_IF_ERROR(CheckFileHeader(path, f.name, header, meta, recorded[f.name]).status());
  }
  return Status::OK();
}

}  // namespace flashckpt

#include "common/read/verify.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/base/dtype.h"
#include "common/format/checksum.h"
#include "common/format/metadata.h"
#include "common/format/safetensors.h"
#include "common/io/fs.h"

namespace flashckpt {
namespace {

// Big enough for sequential reads to run at disk speed, small enough to never matter for memory.
constexpr size_t kChunkBytes = 8u << 20;

struct Xxh3StateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};
using Xxh3State = std::unique_ptr<XXH3_state_t, Xxh3StateDeleter>;

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

// A file that passed the cheap checks, waiting for its data to be hashed.
struct CheckedFile {
  std::string path;
  uint64_t bytes = 0;
  std::vector<Piece> pieces;  // as declared by the header, sorted by offset
};

// Size, header and declared pieces of one listed file against metadata.json.
Result<CheckedFile> CheckFileShape(const std::string& dir, const SavedFile& file, const CheckpointMetadata& meta,
                                   const std::map<std::string, const Piece*>& recorded) {
  CheckedFile out;
  out.path = dir + "/" + file.name;
  struct stat st {};
  if (::stat(out.path.c_str(), &st) != 0) {
    return ErrnoStatus("stat", out.path).WithContext("file listed in metadata.json is not readable");
  }
  if (!S_ISREG(st.st_mode)) return Corruption(out.path + ": listed in metadata.json but not a regular file");
  out.bytes = static_cast<uint64_t>(st.st_size);
  if (out.bytes != file.bytes) {
    return Corruption(out.path + ": file is " + std::to_string(out.bytes) + " bytes but metadata.json records " +
                      std::to_string(file.bytes) + (out.bytes < file.bytes ? " (truncated)" : " (grown)"));
  }
  ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(out.path));
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
    return Corruption(out.path + ": header names job '" + (job == header.metadata.end() ? "" : job->second) +
                      "' step " + (step == header.metadata.end() ? "?" : step->second) + ", metadata.json job '" +
                      meta.job + "' step " + std::to_string(meta.step));
  }
  ASSIGN_OR_RETURN(out.pieces, PiecesFromHeader(header, file.name));
  for (const Piece& p : out.pieces) {
    auto it = recorded.find(p.key);
    if (it == recorded.end()) {
      return Corruption(out.path + ": tensor '" + p.key + "' is in the file but metadata.json does not list it there");
    }
    std::string diff = PieceDifference(p, *it->second);
    if (!diff.empty()) return Corruption(out.path + ": tensor '" + p.key + "': " + diff);
  }
  if (out.pieces.size() != recorded.size()) {
    std::set<std::string> present;
    for (const Piece& p : out.pieces) present.insert(p.key);
    for (const auto& [key, piece] : recorded) {
      if (!present.count(key)) {
        return Corruption(out.path + ": tensor '" + key + "' is listed in metadata.json but absent from the file");
      }
    }
  }
  std::sort(out.pieces.begin(), out.pieces.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  return out;
}

// Hashes every piece of a checked file, and each chunk of the pieces that record per-chunk
// checksums. The pieces tile the data region (the header parser refuses gaps), so the file is read
// front to back in large chunks, each chunk feeding whichever pieces it covers: a file of many
// small tensors costs a few reads, not one per tensor.
// `tensors` collects the (kind, name) of every matched piece, for the report's tensor count.
Status HashPieces(const CheckedFile& file, char* buf, XXH3_state_t* whole, XXH3_state_t* chunk,
                  std::set<std::pair<TensorKind, std::string>>* tensors, VerifyReport* report) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(file.path));
  (void)::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  uint64_t window_begin = 0, window_end = 0;  // file bytes [window_begin, window_end) are in buf
  for (const Piece& p : file.pieces) {
    const bool chunked = !p.chunk_xxh3.empty();
    if (XXH3_64bits_reset(whole) != XXH_OK || XXH3_64bits_reset(chunk) != XXH_OK) {
      return Internal("XXH3_64bits_reset failed");
    }
    size_t chunk_index = 0;
    uint64_t chunk_end = chunked ? std::min(p.end, p.begin + p.chunk_bytes) : p.end;
    for (uint64_t pos = p.begin; pos < p.end;) {
      if (pos < window_begin || pos >= window_end) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, file.bytes - pos));
        RETURN_IF_ERROR(PreadFull(fd.get(), buf, n, pos, file.path));
        window_begin = pos;
        window_end = pos + n;
      }
      const uint64_t take = std::min(chunk_end, window_end) - pos;
      const char* data = buf + (pos - window_begin);
      if (XXH3_64bits_update(whole, data, static_cast<size_t>(take)) != XXH_OK ||
          (chunked && XXH3_64bits_update(chunk, data, static_cast<size_t>(take)) != XXH_OK)) {
        return Internal("XXH3_64bits_update failed");
      }
      pos += take;
      if (chunked && pos == chunk_end) {
        uint64_t actual = XXH3_64bits_digest(chunk);
        if (actual != p.chunk_xxh3[chunk_index]) {
          uint64_t from = p.begin + chunk_index * p.chunk_bytes;
          return Corruption(file.path + ": tensor '" + p.key + "': xxh3 of chunk " + std::to_string(chunk_index) +
                            " (bytes [" + std::to_string(from) + ", " + std::to_string(chunk_end) + ")) is " +
                            ChecksumHex(actual) + " but " + ChecksumHex(p.chunk_xxh3[chunk_index]) +
                            " is recorded: the data is corrupt");
        }
        if (XXH3_64bits_reset(chunk) != XXH_OK) return Internal("XXH3_64bits_reset failed");
        ++chunk_index;
        chunk_end = std::min(p.end, chunk_end + p.chunk_bytes);
      }
    }
    uint64_t actual = XXH3_64bits_digest(whole);
    if (actual != p.xxh3) {
      return Corruption(file.path + ": tensor '" + p.key + "': xxh3 of its bytes [" + std::to_string(p.begin) + ", " +
                        std::to_string(p.end) + ") is " + ChecksumHex(actual) + " but " + ChecksumHex(p.xxh3) +
                        " is recorded: the data is corrupt");
    }
    tensors->emplace(p.kind, p.key);
    report->tensors = tensors->size();
    ++report->pieces;
  }
  return Status::OK();
}

}  // namespace

Status VerifyCheckpointDir(const std::string& dir, VerifyReport* report) {
  VerifyReport local;
  if (report == nullptr) report = &local;
  *report = VerifyReport{};
  auto read = ReadMetadataFile(dir);
  if (!read.ok()) {
    if (read.status().code() != StatusCode::kNotFound) return read.status();
    if (!PathExists(dir)) return NotFound(dir + ": no such checkpoint directory");
    return NotFound(dir +
                    " has no metadata.json: the checkpoint is incomplete (a save in flight or interrupted) or "
                    "this is not a checkpoint-<step> directory");
  }
  CheckpointMetadata meta = std::move(read).value();
  report->job = meta.job;
  report->step = meta.step;

  // metadata.json's pieces by file, then by tensor name.
  std::map<std::string, std::map<std::string, const Piece*>> recorded;
  for (const SavedFile& f : meta.files) {
    if (!recorded.emplace(f.name, std::map<std::string, const Piece*>{}).second) {
      return Corruption(dir + "/metadata.json: file '" + f.name + "' is listed twice");
    }
  }
  for (const Piece& p : meta.pieces) {
    if (!recorded[p.file].emplace(p.key, &p).second) {
      return Corruption(dir + "/metadata.json: tensor '" + p.key + "' has two pieces in file '" + p.file + "'");
    }
  }

  std::vector<CheckedFile> checked;
  checked.reserve(meta.files.size());
  for (const SavedFile& f : meta.files) {
    ASSIGN_OR_RETURN(CheckedFile c, CheckFileShape(dir, f, meta, recorded[f.name]));
    checked.push_back(std::move(c));
  }

  Xxh3State whole(XXH3_createState()), chunk(XXH3_createState());
  std::unique_ptr<char[]> buf(new (std::nothrow) char[kChunkBytes]);
  if (!whole || !chunk || !buf) return ResourceExhausted("cannot allocate the verification buffer");
  std::set<std::pair<TensorKind, std::string>> tensors;
  for (const CheckedFile& c : checked) {
    RETURN_IF_ERROR(HashPieces(c, buf.get(), whole.get(), chunk.get(), &tensors, report));
    ++report->files;
    report->bytes += c.bytes;
  }
  return Status::OK();
}

}  // namespace flashckpt

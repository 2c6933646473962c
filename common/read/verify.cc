#include "common/read/verify.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/format/checksum.h"
#include "common/format/metadata.h"
#include "common/format/safetensors.h"
#include "common/io/fs.h"
#include "common/read/header_check.h"

namespace flashckpt {
namespace {

// Big enough for sequential reads to run at disk speed, small enough to never matter for memory.
constexpr size_t kChunkBytes = 8u << 20;

// A file that passed the cheap checks, waiting for its data to be hashed.
struct CheckedFile {
  std::string path;
  uint64_t bytes = 0;
  std::vector<Piece> pieces;  // as declared by the header, sorted by offset
};

// Size, header and declared pieces of one listed file against metadata.json.
Result<CheckedFile> CheckFileShape(const std::string& dir, const SavedFile& file, const CheckpointMetadata& meta,
                                   const RecordedPieces& recorded) {
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
  ASSIGN_OR_RETURN(out.pieces, CheckFileHeader(out.path, file.name, header, meta, recorded));
  return out;
}

// Hashes every piece of a checked file, and each chunk of the pieces that record per-chunk
// checksums. The pieces tile the data region (the header parser refuses gaps), so the file is read
// front to back in large chunks, each chunk feeding whichever pieces it covers: a file of many
// small tensors costs a few reads, not one per tensor. A piece whose whole checksum derives from its
// chunk checksums (format version 2; the parser checked that relation) is verified by its chunks
// alone, so each byte is hashed once; otherwise its bytes are hashed whole as well.
// `tensors` collects the (kind, name) of every matched piece, for the report's tensor count.
Status HashPieces(const CheckedFile& file, char* buf, std::set<std::pair<TensorKind, std::string>>* tensors,
                  VerifyReport* report) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(file.path));
  (void)::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  Xxh3Stream whole, chunk;
  uint64_t window_begin = 0, window_end = 0;  // file bytes [window_begin, window_end) are in buf
  for (const Piece& p : file.pieces) {
    const bool chunked = !p.chunk_xxh3.empty();
    const bool hash_whole = !p.whole_from_chunks;
    whole.Reset();
    chunk.Reset();
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
      if (hash_whole) whole.Update(data, static_cast<size_t>(take));
      if (chunked) chunk.Update(data, static_cast<size_t>(take));
      pos += take;
      if (chunked && pos == chunk_end) {
        uint64_t actual = chunk.Digest();
        if (actual != p.chunk_xxh3[chunk_index]) {
          uint64_t from = p.begin + chunk_index * p.chunk_bytes;
          return Corruption(file.path + ": tensor '" + p.key + "': xxh3 of chunk " + std::to_string(chunk_index) +
                            " (bytes [" + std::to_string(from) + ", " + std::to_string(chunk_end) + ")) is " +
                            ChecksumHex(actual) + " but " + ChecksumHex(p.chunk_xxh3[chunk_index]) +
                            " is recorded: the data is corrupt");
        }
        chunk.Reset();
        ++chunk_index;
        chunk_end = std::min(p.end, chunk_end + p.chunk_bytes);
      }
    }
    if (hash_whole) {
      uint64_t actual = whole.Digest();
      if (actual != p.xxh3) {
        return Corruption(file.path + ": tensor '" + p.key + "': xxh3 of its bytes [" + std::to_string(p.begin) +
                          ", " + std::to_string(p.end) + ") is " + ChecksumHex(actual) + " but " +
                          ChecksumHex(p.xxh3) + " is recorded: the data is corrupt");
      }
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

  ASSIGN_OR_RETURN(RecordedFiles recorded, GroupPiecesByFile(dir, meta));
  std::vector<CheckedFile> checked;
  checked.reserve(meta.files.size());
  for (const SavedFile& f : meta.files) {
    ASSIGN_OR_RETURN(CheckedFile c, CheckFileShape(dir, f, meta, recorded[f.name]));
    checked.push_back(std::move(c));
  }

  std::unique_ptr<char[]> buf(new (std::nothrow) char[kChunkBytes]);
  if (!buf) return ResourceExhausted("cannot allocate the verification buffer");
  std::set<std::pair<TensorKind, std::string>> tensors;
  for (const CheckedFile& c : checked) {
    RETURN_IF_ERROR(HashPieces(c, buf.get(), &tensors, report));
    ++report->files;
    report->bytes += c.bytes;
  }
  return Status::OK();
}

}  // namespace flashckpt

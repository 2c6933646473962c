// Checking metadata.json against the files' own headers before a reader trusts it.
//
// metadata.json is gathered from the files' safetensors headers when a checkpoint completes, and
// every reader plans from it: which file holds a piece, where its bytes lie, and where the piece
// goes in the global tensor (box offset and shape, flat range). Its checksums cover each piece's
// bytes but not that placement, so a metadata.json whose boxes or flat ranges were edited or damaged
// still matches every checksum, and a reader that trusted it would put the right bytes in the wrong
// place. Each file's header records the same facts for the pieces it holds, so every reader checks,
// before it reads a file's data, that the header declares exactly the pieces metadata.json records
// there, placement included: the daemon's restore and the offline reshard through
// FillSlotFromCheckpoint, `flashckpt verify` and `flashckpt inspect` directly. A header is small and
// read once per file.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/format/metadata.h"
#include "common/format/safetensors.h"
#include "common/io/io_env.h"

namespace flashckpt {

// metadata.json's pieces of one file, by tensor name (pointers into CheckpointMetadata::pieces).
using RecordedPieces = std::map<std::string, const Piece*>;
// The same for every file, by file name.
using RecordedFiles = std::map<std::string, RecordedPieces>;

// Groups `meta.pieces` by file; every file of `meta.files` has an entry, also one that holds no
// piece. The result points into `meta`, which must outlive it. kCorruption, naming
// `dir`/metadata.json, when a file is listed twice or a tensor has two pieces in one file.
Result<RecordedFiles> GroupPiecesByFile(const std::string& dir, const CheckpointMetadata& meta);

// Checks `header`, read from the file at `path` (named `file_name` in metadata.json), against
// `meta`: it names meta's job and step, and declares exactly the pieces of `recorded`, each with the
// same kind, dtype, shape, global shape, box offset and shape, flat range, byte range and checksums.
// Returns the header's pieces sorted by offset; kCorruption naming `path` (and the tensor, where
// one is concerned) and what differs otherwise.
Result<std::vector<Piece>> CheckFileHeader(const std::string& path, const std::string& file_name,
                                           const SafetensorsHeader& header, const CheckpointMetadata& meta,
                                           const RecordedPieces& recorded);

// Reads the header of every file of `meta` in `dir` and checks it with CheckFileHeader: what a
// reader of the whole checkpoint runs before it reads any data. Errors as above, and those of
// opening and reading the file (kNotFound, kIOError, kCorruption for a header that does not parse).
Status CheckFileHeaders(const std::string& dir, const CheckpointMetadata& meta, IoEnv* io = IoEnv::Default());

}  // namespace flashckpt

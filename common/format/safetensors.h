// The safetensors file format: building the fixed-size header of a slot image, and parsing
// headers read from disk, which are untrusted.
//
// A file is: 8-byte little-endian header length N, N bytes of JSON, then the data. flashckpt pads
// the JSON with spaces so that 8 + N is a multiple of 4 KiB, and keeps every value that changes per
// save (step, checksums) fixed-width, so one header template serves every save of a layout and the
// daemon patches it in place before writing.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/base/dtype.h"
#include "common/base/status.h"
#include "common/io/io_env.h"

namespace flashckpt {

inline constexpr uint64_t kPageSize = 4096;
// Safetensors' own bound on the JSON header; also what we accept from untrusted files.
inline constexpr uint64_t kMaxHeaderJsonBytes = 100ull << 20;
inline constexpr size_t kMaxTensorRank = 8;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // relative to the start of the data (after the header)
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t data_start = 0;  // 8 + N: file offset of the data
  uint64_t data_bytes = 0;
  std::map<std::string, std::string> metadata;  // the "__metadata__" object
  std::vector<SafetensorsEntry> entries;        // sorted by begin
};

// Builds a header whose JSON is padded so that the data starts on a 4 KiB boundary. Fixed-width
// metadata fields are placeholders whose offsets in the header are reported, to be patched later.
class SafetensorsHeaderBuilder {
 public:
  void AddMetadata(std::string key, std::string value);
  // Returns a field id; the value starts as `width` '0' characters.
  size_t AddFixedWidthMetadata(std::string key, size_t width);
  void AddTensor(const std::string& name, DType dtype, const std::vector<uint64_t>& shape, uint64_t begin,
                 uint64_t end);

  struct Built {
    std::string bytes;                  // 8-byte length + padded JSON
    std::vector<uint64_t> field_offsets;  // by field id: offset in `bytes` of the value's first char
    std::vector<size_t> field_widths;
  };
  Result<Built> Build() const;

 private:
  struct Field {
    std::string key;
    std::string value;
    bool fixed = false;
    size_t width = 0;
  };
  std::vector<Field> metadata_;
  std::vector<SafetensorsEntry> tensors_;
};

// Parses the 8-byte length prefix; checks it against kMaxHeaderJsonBytes and the file size.
Result<uint64_t> ParseHeaderLength(const unsigned char prefix[8], uint64_t file_size);
// Parses and validates the JSON header of a file of `file_size` bytes: known dtypes, shapes whose
// byte size does not overflow and matches the offsets, offsets inside the file, no overlaps or gaps.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t file_size);
// The same for a header recorded apart from its file: `json` is the header without its trailing
// padding, `header_bytes` its length in the file (at least json.size(); the data starts at
// 8 + header_bytes).
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t header_bytes, uint64_t file_size);
// Reads and parses the header of the file at `path`.
Result<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path, IoEnv* io = IoEnv::Default());
// The same through `fd`, open for reading on the file at `path` (named in errors); reads only the
// header, with pread, so the fd's offset is unchanged and other threads may read it at once.
Result<SafetensorsHeader> ReadSafetensorsHeader(int fd, const std::string& path, IoEnv* io = IoEnv::Default());

// numel * element size, or an error on overflow.
Result<uint64_t> TensorBytes(DType dtype, const std::vector<uint64_t>& shape);

}  // namespace flashckpt

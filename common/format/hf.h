// Reading a Hugging Face safetensors directory (what `flashckpt import` takes): model.safetensors,
// or model.safetensors.index.json and the files its weight_map names. The input is untrusted:
// every header is parsed by ParseSafetensorsHeader (dtypes, shapes, offsets inside the file, no
// overlap or gap), the index is checked, and every tensor must be in exactly one file, the one the
// index names.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "common/base/status.h"
#include "common/format/safetensors.h"
#include "common/io/io_env.h"

namespace flashckpt {

inline constexpr uint64_t kMaxHfIndexBytes = 64ull << 20;

// The weight_map of a model.safetensors.index.json (tensor name -> file name), read from `path`'s
// contents `json`. kCorruption naming `path` (and the tensor) unless it is a JSON object with a
// non-empty "weight_map" object whose values are plain file names (no '/', not "." or "..").
Result<std::map<std::string, std::string>> ParseHfIndex(std::string_view json, const std::string& path);

// A tensor of the input: its file and its entry in that file's header (entry offsets relative to
// `data_start`).
struct HfTensor {
  std::string file;
  SafetensorsEntry entry;
  uint64_t data_start = 0;
};

// Every tensor of the directory `dir`, by name. kNotFound when it holds neither model.safetensors
// nor the index; kCorruption, naming the file and tensor, for a bad header, an index naming a
// missing file or a tensor its file lacks, a tensor in a file the index does not place it in, or
// no tensor at all. `files_read`, when given, is set to the number of files read.
Result<std::map<std::string, HfTensor>> ReadHfDirectory(const std::string& dir, uint32_t* files_read = nullptr,
                                                        IoEnv* io = IoEnv::Default());

}  // namespace flashckpt

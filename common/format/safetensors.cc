#include "common/format/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <simdjson.h>

#include "common/format/json_parser.h"
#include "common/io/fs.h"

namespace flashckpt {
namespace {

// A placeholder's text: '@' then the field id, padded with '@'. '@' may not begin a key (keys are
// tensor names, which exclude '@', or fixed ASCII words), so the quoted placeholder is unique.
std::string Placeholder(size_t id, size_t width) {
  std::string s = "@" + std::to_string(id);
  s.resize(width, '@');
  return s;
}

bool CheckedMul(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

}  // namespace

Result<uint64_t> TensorBytes(DType dtype, const std::vector<uint64_t>& shape) {
  if (shape.size() > kMaxTensorRank) {
    return InvalidArgument("tensor rank " + std::to_string(shape.size()) + " exceeds " +
                           std::to_string(kMaxTensorRank));
  }
  uint64_t n = DTypeSize(dtype);
  for (uint64_t d : shape) {
    if (!CheckedMul(n, d, &n)) return InvalidArgument("tensor byte size overflows 64 bits");
  }
  return n;
}

void SafetensorsHeaderBuilder::AddMetadata(std::string key, std::string value) {
  metadata_.push_back(Field{std::move(key), std::move(value), false, 0});
}

size_t SafetensorsHeaderBuilder::AddFixedWidthMetadata(std::string key, size_t width) {
  metadata_.push_back(Field{std::move(key), std::string(width, '0'), true, width});
  size_t id = 0;
  for (const auto& f : metadata_) id += f.fixed ? 1 : 0;
  return id - 1;
}

void SafetensorsHeaderBuilder::AddTensor(const std::string& name, DType dtype, const std::vector<uint64_t>& shape,
                                         uint64_t begin, uint64_t end) {
  tensors_.push_back(SafetensorsEntry{name, dtype, shape, begin, end});
}

Result<SafetensorsHeaderBuilder::Built> SafetensorsHeaderBuilder::Build() const {
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  std::vector<size_t> widths;
  for (const auto& f : metadata_) {
    if (f.fixed) {
      meta[f.key] = Placeholder(widths.size(), f.width);
      widths.push_back(f.width);
    } else {
      meta[f.key] = f.value;
    }
  }
  root["__metadata__"] = std::move(meta);
  for (const auto& t : tensors_) {
    root[t.name] = {{"dtype", std::string(DTypeName(t.dtype))}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  std::string json = root.dump();

  Built built;
  built.field_widths = widths;
  for (size_t id = 0; id < widths.size(); ++id) {
    std::string quoted = "\"" + Placeholder(id, widths[id]) + "\"";
    size_t pos = json.find(quoted);
    if (pos == std::string::npos) return Internal("header placeholder " + std::to_string(id) + " not found");
    std::fill(json.begin() + static_cast<std::ptrdiff_t>(pos) + 1,
              json.begin() + static_cast<std::ptrdiff_t>(pos + 1 + widths[id]), '0');
    built.field_offsets.push_back(8 + pos + 1);
  }
  uint64_t total = 8 + json.size();
  uint64_t padded = (total + kPageSize - 1) / kPageSize * kPageSize;
  json.append(padded - total, ' ');
  uint64_t n = json.size();
  built.bytes.resize(8);
  for (int i = 0; i < 8; ++i) built.bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  built.bytes += json;
  return built;
}

Result<uint64_t> ParseHeaderLength(const unsigned char prefix[8], uint64_t file_size) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (file_size < 8) return Corruption("file of " + std::to_string(file_size) + " bytes has no safetensors header");
  if (n == 0 || n > kMaxHeaderJsonBytes) {
    return Corruption("safetensors header length " + std::to_string(n) + " is outside 1.." +
                      std::to_string(kMaxHeaderJsonBytes));
  }
  if (n > file_size - 8) {
    return Corruption("safetensors header length " + std::to_string(n) + " runs past the end of a " +
                      std::to_string(file_size) + "-byte file (truncated?)");
  }
  return n;
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t file_size) {
  return ParseSafetensorsHeader(json, json.size(), file_size);
}

namespace {

// The rest of ParseSafetensorsHeader, on the parsed object: `h` has its data region set.
Result<SafetensorsHeader> HeaderFromJson(simdjson::dom::object root, SafetensorsHeader h) {
  std::set<std::string_view> names;
  for (auto field : root) {
    const std::string key(field.key);
    simdjson::dom::element v = field.value;
    if (key == "__metadata__") {
      simdjson::dom::object m;
      if (v.get_object().get(m) != simdjson::SUCCESS) return Corruption("__metadata__ is not an object");
      for (auto entry : m) {
        std::string_view text;
        if (entry.value.get_string().get(text) != simdjson::SUCCESS) {
          return Corruption("__metadata__ value of '" + std::string(entry.key) + "' is not a string");
        }
        h.metadata[std::string(entry.key)] = std::string(text);
      }
      continue;
    }
    // A name given twice has no one meaning (JSON leaves duplicate keys undefined).
    if (!names.insert(field.key).second) return Corruption("entry '" + key + "' appears twice");
    simdjson::dom::object e;
    if (v.get_object().get(e) != simdjson::SUCCESS) return Corruption("entry '" + key + "' is not an object");
    std::string_view dtype_name;
    simdjson::dom::array shape, offsets;
    if (e.at_key("dtype").get_string().get(dtype_name) != simdjson::SUCCESS ||
        e.at_key("shape").get_array().get(shape) != simdjson::SUCCESS ||
        e.at_key("data_offsets").get_array().get(offsets) != simdjson::SUCCESS || offsets.size() != 2) {
      return Corruption("entry '" + key + "' needs dtype, shape and two data_offsets");
    }
    SafetensorsEntry entry;
    entry.name = key;
    auto dtype = ParseDType(dtype_name);
    if (!dtype) return Corruption("entry '" + key + "' has unknown dtype '" + std::string(dtype_name) + "'");
    entry.dtype = *dtype;
    if (shape.size() > kMaxTensorRank) return Corruption("entry '" + key + "' has rank above 8");
    for (simdjson::dom::element d : shape) {
      uint64_t n = 0;
      if (d.get_uint64().get(n) != simdjson::SUCCESS) {
        return Corruption("entry '" + key + "' has a shape that is not unsigned integers");
      }
      entry.shape.push_back(n);
    }
    if (offsets.at(0).get_uint64().get(entry.begin) != simdjson::SUCCESS ||
        offsets.at(1).get_uint64().get(entry.end) != simdjson::SUCCESS) {
      return Corruption("entry '" + key + "' has data_offsets that are not unsigned integers");
    }
    if (entry.begin > entry.end || entry.end > h.data_bytes) {
      return Corruption("entry '" + key + "' has data_offsets [" + std::to_string(entry.begin) + ", " +
                        std::to_string(entry.end) + ") outside the " + std::to_string(h.data_bytes) +
                        "-byte data region");
    }
    auto bytes = TensorBytes(entry.dtype, entry.shape);
    if (!bytes.ok()) return Corruption("entry '" + key + "': " + bytes.status().message());
    if (*bytes != entry.end - entry.begin) {
      return Corruption("entry '" + key + "' spans " + std::to_string(entry.end - entry.begin) +
                        " bytes but its shape needs " + std::to_string(*bytes));
    }
    h.entries.push_back(std::move(entry));
  }
  // By offset, and an empty tensor before a tensor that starts where it does (the safetensors library
  // places a 0-byte tensor at the offset of the next one): it overlaps nothing.
  std::sort(h.entries.begin(), h.entries.end(),
            [](const auto& a, const auto& b) {
              if (a.begin != b.begin) return a.begin < b.begin;
              return a.end != b.end ? a.end < b.end : a.name < b.name;
            });
  uint64_t expected = 0;
  for (const auto& e : h.entries) {
    if (e.begin < expected) return Corruption("entry '" + e.name + "' overlaps the tensor before it");
    if (e.begin > expected) return Corruption("gap in the data region before entry '" + e.name + "'");
    expected = e.end;
  }
  if (expected != h.data_bytes) {
    return Corruption("the tensors cover " + std::to_string(expected) + " bytes but the data region has " +
                      std::to_string(h.data_bytes) + " (truncated or trailing bytes)");
  }
  return h;
}

}  // namespace

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t header_bytes, uint64_t file_size) {
  if (json.size() > header_bytes || header_bytes > kMaxHeaderJsonBytes) {
    return Corruption("safetensors header of " + std::to_string(json.size()) + " bytes is not within its " +
                      std::to_string(header_bytes) + "-byte place (at most " + std::to_string(kMaxHeaderJsonBytes) +
                      ")");
  }
  SafetensorsHeader h;
  h.data_start = 8 + header_bytes;
  if (h.data_start > file_size) return Corruption("safetensors header runs past the end of the file");
  h.data_bytes = file_size - h.data_start;
  // simdjson: a completing daemon parses the header of every file of the step, thousands in a large job.
  return WithJsonParser(json.size(), [&](simdjson::dom::parser& parser) -> Result<SafetensorsHeader> {
    simdjson::dom::object root;
    if (parser.parse(json.data(), json.size()).get_object().get(root) != simdjson::SUCCESS) {
      return Corruption("safetensors header is not a JSON object");
    }
    return HeaderFromJson(root, std::move(h));
  });
}

Result<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path, IoEnv* io) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(path, io));
  return ReadSafetensorsHeader(fd.get(), path, io);
}

Result<SafetensorsHeader> ReadSafetensorsHeader(int fd, const std::string& path, IoEnv* io) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoStatus("fstat", path);
  uint64_t size = static_cast<uint64_t>(st.st_size);
  unsigned char prefix[8] = {};
  if (size >= 8) RETURN_IF_ERROR(PreadFull(fd, prefix, 8, 0, path, io));
  auto n = ParseHeaderLength(prefix, size);
  if (!n.ok()) return n.status().WithContext(path);
  std::string json(*n, '\0');
  RETURN_IF_ERROR(PreadFull(fd, json.data(), *n, 8, path, io));
  auto parsed = ParseSafetensorsHeader(json, size);
  if (!parsed.ok()) return parsed.status().WithContext(path);
  return parsed;
}

}  // namespace flashckpt

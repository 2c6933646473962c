#include "common/format/hf.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <vector>

#include "common/io/fs.h"

namespace flashckpt {
namespace {

bool PlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

Result<std::map<std::string, std::string>> ParseHfIndex(std::string_view json, const std::string& path) {
  const nlohmann::json index = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object()) return Corruption(path + ": not a JSON object");
  auto map = index.find("weight_map");
  if (map == index.end() || !map->is_object() || map->empty()) {
    return Corruption(path + ": no \"weight_map\" object naming the tensors' files");
  }
  std::map<std::string, std::string> out;
  for (auto it = map->begin(); it != map->end(); ++it) {
    if (!it.value().is_string() || !PlainFileName(it.value().get<std::string>())) {
      return Corruption(path + ": tensor '" + it.key() + "': its file is not a plain file name");
    }
    out[it.key()] = it.value().get<std::string>();
  }
  return out;
}

Result<std::map<std::string, HfTensor>> ReadHfDirectory(const std::string& dir, uint32_t* files_read, IoEnv* io) {
  uint32_t read = 0;
  const std::string index_path = dir + "/model.safetensors.index.json";
  ASSIGN_OR_RETURN(bool has_index, Exists(index_path, io));
  std::map<std::string, std::string> weight_map;  // tensor -> file
  std::vector<std::string> files;
  if (has_index) {
    ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path, kMaxHfIndexBytes, io));
    ASSIGN_OR_RETURN(weight_map, ParseHfIndex(text, index_path));
    for (const auto& [name, file] : weight_map) files.push_back(file);
    std::sort(files.begin(), files.end());
    files.erase(std::unique(files.begin(), files.end()), files.end());
  } else {
    ASSIGN_OR_RETURN(bool single, Exists(dir + "/model.safetensors", io));
    if (!single) return NotFound(dir + " holds neither model.safetensors nor model.safetensors.index.json");
    files.push_back("model.safetensors");
  }

  std::map<std::string, HfTensor> out;
  for (const std::string& file : files) {
    const std::string path = dir + "/" + file;
    ASSIGN_OR_RETURN(bool exists, Exists(path, io));
    if (!exists) {
      std::string example;
      for (const auto& [name, f] : weight_map) {
        if (f == file) {
          example = name;
          break;
        }
      }
      return Corruption(index_path + " places tensor '" + example + "' in " + file + ", which does not exist");
    }
    ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(path, io));
    for (const SafetensorsEntry& e : header.entries) {
      if (has_index) {
        auto it = weight_map.find(e.name);
        if (it == weight_map.end()) return Corruption(path + ": tensor '" + e.name + "' is not in the index's weight_map");
        if (it->second != file) {
          return Corruption(path + ": tensor '" + e.name + "' is here, but the index places it in " + it->second);
        }
      }
      auto [it, inserted] = out.emplace(e.name, HfTensor{file, e, header.data_start});
      if (!inserted) return Corruption("tensor '" + e.name + "' is in both " + it->second.file + " and " + file);
    }
    ++read;
  }
  for (const auto& [name, file] : weight_map) {
    if (out.find(name) == out.end()) {
      return Corruption(index_path + " places tensor '" + name + "' in " + file + ", which does not hold it");
    }
  }
  if (out.empty()) return Corruption(dir + ": the safetensors files hold no tensor");
  if (files_read != nullptr) *files_read = read;
  return out;
}

}  // namespace flashckpt

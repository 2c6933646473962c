#include "common/metadata.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <nlohmann/json.hpp>

#include "common/checksum.h"
#include "common/fs.h"
#include "common/layout.h"
#include "common/names.h"

namespace flashckpt {
namespace {

using json = nlohmann::json;

constexpr std::string_view kSuffix = ".safetensors";

std::string NowUtc() {
  std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// nlohmann throws on type mismatches; every access below goes through these checked readers.
Result<std::vector<uint64_t>> U64Array(const json& j, const std::string& what) {
  if (!j.is_array() || j.size() > kMaxTensorRank) return Corruption(what + " is not an array of at most 8 integers");
  std::vector<uint64_t> out;
  for (const auto& v : j) {
    if (!v.is_number_unsigned()) return Corruption(what + " holds a value that is not an unsigned integer");
    out.push_back(v.get<uint64_t>());
  }
  return out;
}

Result<std::vector<uint64_t>> U64ArrayFromString(const std::map<std::string, std::string>& meta,
                                                 const std::string& key) {
  auto it = meta.find(key);
  if (it == meta.end()) return Corruption("missing metadata key '" + key + "'");
  auto j = json::parse(it->second, nullptr, false);
  if (j.is_discarded()) return Corruption("metadata key '" + key + "' is not JSON");
  return U64Array(j, "metadata key '" + key + "'");
}

Result<uint64_t> U64Field(const json& obj, const char* key, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_number_unsigned()) {
    return Corruption(where + ": field '" + key + "' missing or not an unsigned integer");
  }
  return it->get<uint64_t>();
}

Result<std::string> StringField(const json& obj, const char* key, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_string()) return Corruption(where + ": field '" + key + "' missing or not a string");
  return it->get<std::string>();
}

Result<uint32_t> U32Meta(const std::map<std::string, std::string>& meta, const std::string& key) {
  auto it = meta.find(key);
  if (it == meta.end()) return Corruption("missing metadata key '" + key + "'");
  const std::string& s = it->second;
  if (s.empty() || s.size() > 9 || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return Corruption("metadata key '" + key + "' is not a small unsigned integer");
  }
  return static_cast<uint32_t>(std::stoul(s));
}

Status CheckPieceGeometry(const Piece& p) {
  if (p.global_shape.size() != p.box_offset.size() || p.global_shape.size() != p.box_shape.size()) {
    return Corruption("tensor '" + p.key + "': global shape, box offset and box shape differ in rank");
  }
  for (size_t d = 0; d < p.global_shape.size(); ++d) {
    uint64_t end;
    if (__builtin_add_overflow(p.box_offset[d], p.box_shape[d], &end) || end > p.global_shape[d]) {
      return Corruption("tensor '" + p.key + "': box leaves the global tensor in dimension " + std::to_string(d));
    }
  }
  return Status::OK();
}

}  // namespace

Result<std::vector<Piece>> PiecesFromHeader(const SafetensorsHeader& header, const std::string& file_name) {
  std::vector<Piece> pieces;
  for (const auto& e : header.entries) {
    auto fail = [&](const std::string& why) { return Corruption(file_name + ": tensor '" + e.name + "': " + why); };
    Piece p;
    p.key = e.name;
    p.dtype = e.dtype;
    p.shape = e.shape;
    p.file = file_name;
    p.begin = header.data_start + e.begin;
    p.end = header.data_start + e.end;
    auto kind = header.metadata.find(TensorMetaKey(e.name, "kind"));
    if (kind == header.metadata.end()) return fail("no kind in __metadata__");
    auto k = ParseTensorKind(kind->second);
    if (!k) return fail("unknown kind '" + kind->second + "'");
    p.kind = *k;
    ASSIGN_OR_RETURN(p.global_shape, U64ArrayFromString(header.metadata, TensorMetaKey(e.name, "global_shape")));
    ASSIGN_OR_RETURN(p.box_offset, U64ArrayFromString(header.metadata, TensorMetaKey(e.name, "box_offset")));
    ASSIGN_OR_RETURN(p.box_shape, U64ArrayFromString(header.metadata, TensorMetaKey(e.name, "box_shape")));
    if (header.metadata.count(TensorMetaKey(e.name, "flat_range"))) {
      ASSIGN_OR_RETURN(auto r, U64ArrayFromString(header.metadata, TensorMetaKey(e.name, "flat_range")));
      if (r.size() != 2 || r[0] > r[1]) return fail("flat_range is not [begin, end]");
      p.flat_range = FlatRange{r[0], r[1]};
    }
    auto ck = header.metadata.find(TensorMetaKey(e.name, "xxh3"));
    if (ck == header.metadata.end()) return fail("no xxh3 checksum in __metadata__");
    auto parsed = ParseChecksumHex(ck->second);
    if (!parsed) return fail("xxh3 checksum '" + ck->second + "' is not 16 hex digits");
    p.xxh3 = *parsed;
    Status geometry = CheckPieceGeometry(p);
    if (!geometry.ok()) return geometry.WithContext(file_name);
    pieces.push_back(std::move(p));
  }
  return pieces;
}

Result<CheckpointMetadata> BuildMetadataFromDir(const std::string& dir) {
  ASSIGN_OR_RETURN(auto names, ListDir(dir));
  std::sort(names.begin(), names.end());
  CheckpointMetadata meta;
  bool first = true;
  for (const auto& name : names) {
    if (name.size() <= kSuffix.size() || name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0) {
      continue;
    }
    std::string path = dir + "/" + name;
    ASSIGN_OR_RETURN(auto header, ReadSafetensorsHeader(path));
    const auto& m = header.metadata;
    auto job = m.find("job");
    auto step = m.find("step");
    if (job == m.end() || step == m.end()) return Corruption(path + ": no job or step in __metadata__");
    int64_t file_step = 0;
    try {
      file_step = std::stoll(step->second);
    } catch (...) {
      return Corruption(path + ": step '" + step->second + "' is not a number");
    }
    Topology t;
    ASSIGN_OR_RETURN(t.world_size, U32Meta(m, "world_size"));
    ASSIGN_OR_RETURN(t.tp_degree, U32Meta(m, "tp_degree"));
    ASSIGN_OR_RETURN(t.pp_degree, U32Meta(m, "pp_degree"));
    ASSIGN_OR_RETURN(t.shard_degree, U32Meta(m, "shard_degree"));
    SavedFile f;
    f.name = name;
    ASSIGN_OR_RETURN(f.rank, U32Meta(m, "rank"));
    ASSIGN_OR_RETURN(f.tp_rank, U32Meta(m, "tp_rank"));
    ASSIGN_OR_RETURN(f.pp_rank, U32Meta(m, "pp_rank"));
    ASSIGN_OR_RETURN(f.shard_rank, U32Meta(m, "shard_rank"));
    f.bytes = header.data_start + header.data_bytes;
    if (first) {
      meta.job = job->second;
      meta.step = file_step;
      meta.topology = t;
      first = false;
    } else if (meta.job != job->second || meta.step != file_step || meta.topology.world_size != t.world_size ||
               meta.topology.tp_degree != t.tp_degree || meta.topology.pp_degree != t.pp_degree ||
               meta.topology.shard_degree != t.shard_degree) {
      return Corruption(path + ": job, step or topology differs from the other files of " + dir);
    }
    ASSIGN_OR_RETURN(auto pieces, PiecesFromHeader(header, name));
    for (auto& p : pieces) meta.pieces.push_back(std::move(p));
    meta.files.push_back(std::move(f));
  }
  if (first) return NotFound("no .safetensors files in " + dir);
  meta.created = NowUtc();
  return meta;
}

std::string MetadataToJson(const CheckpointMetadata& meta) {
  json j;
  j["format"] = "flashckpt";
  j["format_version"] = kFormatVersion;
  j["job"] = meta.job;
  j["step"] = meta.step;
  j["created"] = meta.created;
  j["topology"] = {{"world_size", meta.topology.world_size},
                   {"tp_degree", meta.topology.tp_degree},
                   {"pp_degree", meta.topology.pp_degree},
                   {"shard_degree", meta.topology.shard_degree}};
  json files = json::array();
  for (const auto& f : meta.files) {
    files.push_back({{"name", f.name}, {"rank", f.rank}, {"tp_rank", f.tp_rank}, {"pp_rank", f.pp_rank},
                     {"shard_rank", f.shard_rank}, {"bytes", f.bytes}});
  }
  j["files"] = std::move(files);
  json tensors = json::object();
  for (const auto& p : meta.pieces) {
    json piece = {{"file", p.file},
                  {"kind", std::string(TensorKindName(p.kind))},
                  {"dtype", std::string(DTypeName(p.dtype))},
                  {"shape", p.shape},
                  {"global_shape", p.global_shape},
                  {"box_offset", p.box_offset},
                  {"box_shape", p.box_shape},
                  {"offsets", {p.begin, p.end}},
                  {"xxh3", ChecksumHex(p.xxh3)}};
    if (p.flat_range) piece["flat_range"] = {p.flat_range->begin, p.flat_range->end};
    tensors[p.key].push_back(std::move(piece));
  }
  j["tensors"] = std::move(tensors);
  return j.dump(1);
}

Result<CheckpointMetadata> ParseMetadataJson(std::string_view text) {
  auto j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Corruption("metadata.json is not a JSON object");
  CheckpointMetadata meta;
  const std::string where = "metadata.json";
  ASSIGN_OR_RETURN(meta.job, StringField(j, "job", where));
  auto step = j.find("step");
  if (step == j.end() || !step->is_number_integer() || step->get<int64_t>() < 0) {
    return Corruption("metadata.json: step missing or negative");
  }
  meta.step = step->get<int64_t>();
  if (j.contains("created") && j["created"].is_string()) meta.created = j["created"].get<std::string>();
  auto topo = j.find("topology");
  if (topo == j.end() || !topo->is_object()) return Corruption("metadata.json: no topology object");
  auto u32 = [&](const json& obj, const char* key, uint32_t* out) -> Status {
    auto v = U64Field(obj, key, where);
    if (!v.ok()) return v.status();
    if (*v > 0xffffffffull) return Corruption(where + ": " + key + " out of range");
    *out = static_cast<uint32_t>(*v);
    return Status::OK();
  };
  RETURN_IF_ERROR(u32(*topo, "world_size", &meta.topology.world_size));
  RETURN_IF_ERROR(u32(*topo, "tp_degree", &meta.topology.tp_degree));
  RETURN_IF_ERROR(u32(*topo, "pp_degree", &meta.topology.pp_degree));
  RETURN_IF_ERROR(u32(*topo, "shard_degree", &meta.topology.shard_degree));
  auto files = j.find("files");
  if (files == j.end() || !files->is_array()) return Corruption("metadata.json: no files array");
  for (const auto& f : *files) {
    if (!f.is_object()) return Corruption("metadata.json: a files entry is not an object");
    SavedFile sf;
    ASSIGN_OR_RETURN(sf.name, StringField(f, "name", where));
    if (sf.name.find('/') != std::string::npos || sf.name == ".." || sf.name == ".") {
      return Corruption("metadata.json: file name '" + sf.name + "' is not a plain name");
    }
    RETURN_IF_ERROR(u32(f, "rank", &sf.rank));
    RETURN_IF_ERROR(u32(f, "tp_rank", &sf.tp_rank));
    RETURN_IF_ERROR(u32(f, "pp_rank", &sf.pp_rank));
    RETURN_IF_ERROR(u32(f, "shard_rank", &sf.shard_rank));
    ASSIGN_OR_RETURN(sf.bytes, U64Field(f, "bytes", where));
    meta.files.push_back(std::move(sf));
  }
  auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_object()) return Corruption("metadata.json: no tensors object");
  for (auto it = tensors->begin(); it != tensors->end(); ++it) {
    if (!it.value().is_array()) return Corruption("metadata.json: tensor '" + it.key() + "' is not a list of pieces");
    for (const auto& pj : it.value()) {
      std::string pw = "metadata.json: tensor '" + it.key() + "'";
      if (!pj.is_object()) return Corruption(pw + ": a piece is not an object");
      Piece p;
      p.key = it.key();
      ASSIGN_OR_RETURN(p.file, StringField(pj, "file", pw));
      bool known = std::any_of(meta.files.begin(), meta.files.end(), [&](const SavedFile& f) { return f.name == p.file; });
      if (!known) return Corruption(pw + ": piece names file '" + p.file + "' that is not in the files list");
      ASSIGN_OR_RETURN(std::string kind, StringField(pj, "kind", pw));
      auto k = ParseTensorKind(kind);
      if (!k) return Corruption(pw + ": unknown kind '" + kind + "'");
      p.kind = *k;
      ASSIGN_OR_RETURN(std::string dtype, StringField(pj, "dtype", pw));
      auto dt = ParseDType(dtype);
      if (!dt) return Corruption(pw + ": unknown dtype '" + dtype + "'");
      p.dtype = *dt;
      auto arr = [&](const char* key, std::vector<uint64_t>* out) -> Status {
        auto f = pj.find(key);
        if (f == pj.end()) return Corruption(pw + ": no " + key);
        auto v = U64Array(*f, pw + " " + key);
        if (!v.ok()) return v.status();
        *out = std::move(v).value();
        return Status::OK();
      };
      RETURN_IF_ERROR(arr("shape", &p.shape));
      RETURN_IF_ERROR(arr("global_shape", &p.global_shape));
      RETURN_IF_ERROR(arr("box_offset", &p.box_offset));
      RETURN_IF_ERROR(arr("box_shape", &p.box_shape));
      std::vector<uint64_t> offsets;
      RETURN_IF_ERROR(arr("offsets", &offsets));
      if (offsets.size() != 2 || offsets[0] > offsets[1]) return Corruption(pw + ": offsets are not [begin, end]");
      p.begin = offsets[0];
      p.end = offsets[1];
      auto bytes = TensorBytes(p.dtype, p.shape);
      if (!bytes.ok() || *bytes != p.end - p.begin) return Corruption(pw + ": offsets do not match dtype and shape");
      if (pj.contains("flat_range")) {
        std::vector<uint64_t> r;
        RETURN_IF_ERROR(arr("flat_range", &r));
        if (r.size() != 2 || r[0] > r[1]) return Corruption(pw + ": flat_range is not [begin, end]");
        p.flat_range = FlatRange{r[0], r[1]};
      }
      ASSIGN_OR_RETURN(std::string ck, StringField(pj, "xxh3", pw));
      auto parsed = ParseChecksumHex(ck);
      if (!parsed) return Corruption(pw + ": xxh3 is not 16 hex digits");
      p.xxh3 = *parsed;
      RETURN_IF_ERROR(CheckPieceGeometry(p));
      meta.pieces.push_back(std::move(p));
    }
  }
  return meta;
}

Result<CheckpointMetadata> ReadMetadataFile(const std::string& checkpoint_dir) {
  std::string path = checkpoint_dir + "/metadata.json";
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxMetadataJsonBytes));
  auto meta = ParseMetadataJson(text);
  if (!meta.ok()) return meta.status().WithContext(path);
  return meta;
}

}  // namespace flashckpt

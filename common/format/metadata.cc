#include "common/format/metadata.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <nlohmann/json.hpp>

#include "common/base/names.h"
#include "common/base/thread_pool.h"
#include "common/format/checksum.h"
#include "common/format/layout.h"
#include "common/io/fs.h"

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

// Fills p->chunk_bytes and p->chunk_xxh3 from `hex`, 16 hex digits per chunk of a piece whose
// byte range is already set.
Status ParseChunkChecksums(std::string_view hex, uint64_t chunk, Piece* p) {
  if (Status valid = ValidateChecksumChunk(chunk); !valid.ok()) {
    return Corruption("tensor '" + p->key + "': " + valid.message());
  }
  const uint64_t count = ChunkCount(p->end - p->begin, chunk);
  if (count < 2 || hex.size() / kChecksumFieldWidth != count || hex.size() % kChecksumFieldWidth != 0) {
    return Corruption("tensor '" + p->key + "': " + std::to_string(hex.size()) + " chunk checksum digits for " +
                      std::to_string(count) + " chunks of " + std::to_string(chunk) + " bytes");
  }
  p->chunk_bytes = chunk;
  p->chunk_xxh3.resize(count);
  for (uint64_t k = 0; k < count; ++k) {
    auto parsed = ParseChecksumHex(hex.substr(k * kChecksumFieldWidth, kChecksumFieldWidth));
    if (!parsed) return Corruption("tensor '" + p->key + "': chunk checksum " + std::to_string(k) + " is not hex");
    p->chunk_xxh3[k] = *parsed;
  }
  return Status::OK();
}

// The stored shape matches the flat range, or the box when there is none.
Status CheckPieceShape(const Piece& p) {
  if (p.flat_range) {
    uint64_t box = 1, local = 1;
    for (uint64_t d : p.box_shape) box = __builtin_mul_overflow(box, d, &box) ? UINT64_MAX : box;
    for (uint64_t d : p.shape) local = __builtin_mul_overflow(local, d, &local) ? UINT64_MAX : local;
    if (p.flat_range->end > box || p.flat_range->end - p.flat_range->begin != local) {
      return Corruption("tensor '" + p.key + "': flat_range does not fit the box or the stored shape");
    }
  } else if (p.shape != p.box_shape) {
    return Corruption("tensor '" + p.key + "': stored shape differs from box_shape and there is no flat_range");
  }
  return Status::OK();
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

Result<double> DoubleMeta(const std::map<std::string, std::string>& meta, const std::string& key) {
  auto it = meta.find(key);
  if (it == meta.end()) return Corruption("missing metadata key '" + key + "'");
  char* end = nullptr;
  double v = std::strtod(it->second.c_str(), &end);
  // Not finite ("inf", "nan", "1e999") would be written to metadata.json as null, which its reader
  // refuses: the checkpoint would complete and then never restore.
  if (it->second.empty() || end != it->second.c_str() + it->second.size() || !std::isfinite(v)) {
    return Corruption("metadata key '" + key + "' is not a finite number: '" + it->second + "'");
  }
  return v;
}

Result<uint64_t> CounterMeta(const std::map<std::string, std::string>& meta, const std::string& key) {
  auto it = meta.find(key);
  if (it == meta.end()) return Corruption("missing metadata key '" + key + "'");
  const std::string& s = it->second;
  if (s.empty() || s.size() > 20 || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return Corruption("metadata key '" + key + "' is not a decimal counter");
  }
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) {
    return Corruption("metadata key '" + key + "' does not fit 64 bits");
  }
  return v;
}

Result<EmaRecord> EmaRecordFromHeader(const std::map<std::string, std::string>& m, const std::string& path) {
  EmaRecord r;
  auto fail = [&](const Status& s) { return s.WithContext(path); };
  auto decay = DoubleMeta(m, "ema_decay");
  if (!decay.ok()) return fail(decay.status());
  r.decay = *decay;
  auto interval = U32Meta(m, "ema_interval");
  if (!interval.ok()) return fail(interval.status());
  r.interval = *interval;
  if (!m.count("ema_init") || !m.count("ema_model_params"))
    return Corruption(path + ": ema_init or ema_model_params missing");
  r.init = m.at("ema_init");
  r.model_params = m.at("ema_model_params");
  if (m.count("ema_loss_threshold")) {
    auto t = DoubleMeta(m, "ema_loss_threshold");
    if (!t.ok()) return fail(t.status());
    r.loss_threshold = *t;
  }
  auto applied = CounterMeta(m, "ema_updates_applied");
  auto skipped = CounterMeta(m, "ema_updates_skipped");
  auto last = CounterMeta(m, "ema_last_step");
  if (!applied.ok() || !skipped.ok() || !last.ok()) return Corruption(path + ": EMA counters missing or malformed");
  r.updates_applied = *applied;
  r.updates_skipped = *skipped;
  r.last_step = static_cast<int64_t>(*last);
  return r;
}

}  // namespace

LayoutExtras EmaFileExtras(const EmaRecord& record, uint64_t checksum_chunk) {
  LayoutExtras extras;
  char decay[32];
  std::snprintf(decay, sizeof decay, "%.17g", record.decay);
  extras.metadata = {{"ema_decay", decay},
                     {"ema_interval", std::to_string(record.interval)},
                     {"ema_init", record.init},
                     {"ema_model_params", record.model_params}};
  if (record.loss_threshold) {
    char t[32];
    std::snprintf(t, sizeof t, "%.17g", *record.loss_threshold);
    extras.metadata.emplace_back("ema_loss_threshold", t);
  }
  extras.fixed_fields = {{"ema_updates_applied", kStepFieldWidth},
                         {"ema_updates_skipped", kStepFieldWidth},
                         {"ema_last_step", kStepFieldWidth}};
  extras.checksum_chunk = checksum_chunk;
  return extras;
}

Result<int> ParseFormatVersion(std::string_view text, const std::string& where) {
  int version = 0;
  const bool digits = !text.empty() && text.size() <= 4 &&
                      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (digits) version = std::stoi(std::string(text));
  if (!digits || version < kOldestFormatVersion || version > kFormatVersion) {
    return Corruption(where + ": format_version '" + std::string(text) + "' is not one this release reads (" +
                      std::to_string(kOldestFormatVersion) + " to " + std::to_string(kFormatVersion) +
                      "; a newer flashckpt wrote it?)");
  }
  return version;
}

// From format version 2 on, a chunked piece's whole checksum is a function of its chunk checksums.
static Status ApplyChecksumRule(int format_version, Piece* p) {
  p->whole_from_chunks = format_version >= 2 && !p->chunk_xxh3.empty();
  if (!p->whole_from_chunks) return Status::OK();
  const uint64_t want = CombineChunkChecksums(p->chunk_xxh3.data(), p->chunk_xxh3.size(), p->end - p->begin);
  if (p->xxh3 != want) {
    return Corruption("tensor '" + p->key + "': xxh3 " + ChecksumHex(p->xxh3) + " is not the " + ChecksumHex(want) +
                      " that its chunk checksums give (format version " + std::to_string(format_version) + ")");
  }
  return Status::OK();
}

Result<std::vector<Piece>> PiecesFromHeader(const SafetensorsHeader& header, const std::string& file_name) {
  std::vector<Piece> pieces;
  auto version_text = header.metadata.find("format_version");
  if (version_text == header.metadata.end()) return Corruption(file_name + ": no format_version in __metadata__");
  ASSIGN_OR_RETURN(const int version, ParseFormatVersion(version_text->second, file_name));
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
    // Errors name the file and the tensor, like every other error of this function.
    auto array_meta = [&](const char* what) -> Result<std::vector<uint64_t>> {
      auto r = U64ArrayFromString(header.metadata, TensorMetaKey(e.name, what));
      if (!r.ok()) return r.status().WithContext(file_name + ": tensor '" + e.name + "'");
      return r;
    };
    ASSIGN_OR_RETURN(p.global_shape, array_meta("global_shape"));
    ASSIGN_OR_RETURN(p.box_offset, array_meta("box_offset"));
    ASSIGN_OR_RETURN(p.box_shape, array_meta("box_shape"));
    if (header.metadata.count(TensorMetaKey(e.name, "flat_range"))) {
      ASSIGN_OR_RETURN(auto r, array_meta("flat_range"));
      if (r.size() != 2 || r[0] > r[1]) return fail("flat_range is not [begin, end]");
      p.flat_range = FlatRange{r[0], r[1]};
    }
    auto ck = header.metadata.find(TensorMetaKey(e.name, "xxh3"));
    if (ck == header.metadata.end()) return fail("no xxh3 checksum in __metadata__");
    auto parsed = ParseChecksumHex(ck->second);
    if (!parsed) return fail("xxh3 checksum '" + ck->second + "' is not 16 hex digits");
    p.xxh3 = *parsed;
    if (auto chunks = header.metadata.find(TensorMetaKey(e.name, "xxh3_chunks")); chunks != header.metadata.end()) {
      auto chunk = CounterMeta(header.metadata, "checksum_chunk");
      if (!chunk.ok()) return fail(chunk.status().message());
      RETURN_IF_ERROR(ParseChunkChecksums(chunks->second, *chunk, &p).WithContext(file_name));
    }
    RETURN_IF_ERROR(ApplyChecksumRule(version, &p).WithContext(file_name));
    Status geometry = CheckPieceGeometry(p);
    if (!geometry.ok()) return geometry.WithContext(file_name);
    Status shape = CheckPieceShape(p);
    if (!shape.ok()) return shape.WithContext(file_name);
    pieces.push_back(std::move(p));
  }
  return pieces;
}

Result<CheckpointMetadata> BuildMetadataFromDir(const std::string& dir) {
  ASSIGN_OR_RETURN(auto names, ListDir(dir));
  return BuildMetadataFromFiles(dir, std::move(names));
}

Result<CheckpointMetadata> BuildMetadataFromFiles(const std::string& dir, std::vector<std::string> names,
                                                  IoEnv* io, ParallelLoop* loop) {
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  names.erase(std::remove_if(names.begin(), names.end(),
                             [](const std::string& name) {
                               return name.size() <= kSuffix.size() ||
                                      name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0;
                             }),
              names.end());
  // The headers are read first, on the loop's threads when there is one: on a network file system
  // each open and read waits for a round trip, and a job has thousands of files.
  std::vector<Result<SafetensorsHeader>> headers(names.size(), Result<SafetensorsHeader>(Internal("not read")));
  auto read = [&](size_t i) { headers[i] = ReadSafetensorsHeader(dir + "/" + names[i], io); };
  if (loop != nullptr) {
    loop->Run(names.size(), read);
  } else {
    for (size_t i = 0; i < names.size(); ++i) read(i);
  }
  CheckpointMetadata meta;
  bool first = true;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    std::string path = dir + "/" + name;
    ASSIGN_OR_RETURN(auto header, std::move(headers[i]));
    const auto& m = header.metadata;
    auto job = m.find("job");
    auto step = m.find("step");
    if (job == m.end() || step == m.end()) return Corruption(path + ": no job or step in __metadata__");
    auto parsed_step = CounterMeta(m, "step");
    if (!parsed_step.ok() || *parsed_step > static_cast<uint64_t>(INT64_MAX)) {
      return Corruption(path + ": step '" + step->second + "' is not a decimal step");
    }
    int64_t file_step = static_cast<int64_t>(*parsed_step);
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
    auto version_text = m.find("format_version");
    if (version_text == m.end()) return Corruption(path + ": no format_version in __metadata__");
    ASSIGN_OR_RETURN(const int version, ParseFormatVersion(version_text->second, path));
    if (first) {
      meta.format_version = version;
      meta.job = job->second;
      meta.step = file_step;
      meta.topology = t;
      first = false;
    } else if (version != meta.format_version) {
      return Corruption(path + ": format_version " + std::to_string(version) + " differs from the other files' " +
                        std::to_string(meta.format_version) + " in " + dir);
    } else if (meta.job != job->second || meta.step != file_step || meta.topology.world_size != t.world_size ||
               meta.topology.tp_degree != t.tp_degree || meta.topology.pp_degree != t.pp_degree ||
               meta.topology.shard_degree != t.shard_degree) {
      return Corruption(path + ": job, step or topology differs from the other files of " + dir);
    }
    if (m.count("file") && m.at("file") == "ema" && !meta.ema) {
      ASSIGN_OR_RETURN(meta.ema, EmaRecordFromHeader(m, path));
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
  j["format_version"] = meta.format_version;
  j["job"] = meta.job;
  j["step"] = meta.step;
  j["created"] = meta.created;
  if (!meta.run_id.empty()) j["run_id"] = meta.run_id;
  j["resumed_from"] = meta.resumed_from;
  j["topology"] = {{"world_size", meta.topology.world_size},
                   {"tp_degree", meta.topology.tp_degree},
                   {"pp_degree", meta.topology.pp_degree},
                   {"shard_degree", meta.topology.shard_degree}};
  j["files"] = json(SavedFilesJson(meta.files));
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
    if (!p.chunk_xxh3.empty()) {
      std::string hex;
      hex.reserve(p.chunk_xxh3.size() * kChecksumFieldWidth);
      for (uint64_t c : p.chunk_xxh3) hex += ChecksumHex(c);
      piece["chunk_bytes"] = p.chunk_bytes;
      piece["xxh3_chunks"] = std::move(hex);
    }
    tensors[p.key].push_back(std::move(piece));
  }
  j["tensors"] = std::move(tensors);
  if (meta.ema) {
    const EmaRecord& e = *meta.ema;
    j["ema"] = {{"decay", e.decay},
                {"interval", e.interval},
                {"init", e.init},
                {"model_params", e.model_params},
                {"updates_applied", e.updates_applied},
                {"updates_skipped", e.updates_skipped},
                {"last_step", e.last_step}};
    if (e.loss_threshold) j["ema"]["loss_threshold"] = *e.loss_threshold;
  }
  return j.dump(1, ' ', false, json::error_handler_t::replace);
}

nlohmann::ordered_json SavedFilesJson(const std::vector<SavedFile>& files) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const auto& f : files) {
    out.push_back({{"name", f.name},
                   {"rank", f.rank},
                   {"tp_rank", f.tp_rank},
                   {"pp_rank", f.pp_rank},
                   {"shard_rank", f.shard_rank},
                   {"bytes", f.bytes}});
  }
  return out;
}

namespace {

// A u32 field of metadata.json: U64Field, then its range.
Status U32Field(const json& obj, const char* key, const std::string& where, uint32_t* out) {
  auto v = U64Field(obj, key, where);
  if (!v.ok()) return v.status();
  if (*v > 0xffffffffull) return Corruption(where + ": " + key + " out of range");
  *out = static_cast<uint32_t>(*v);
  return Status::OK();
}

// format_version, job, step, created, run_id, resumed_from and the topology.
Status ParseHeaderFields(const json& j, const std::string& where, CheckpointMetadata* meta) {
  auto version = j.find("format_version");
  if (version == j.end() || !version->is_number_unsigned()) {
    return Corruption("metadata.json: format_version missing or not a number");
  }
  ASSIGN_OR_RETURN(meta->format_version, ParseFormatVersion(std::to_string(version->get<uint64_t>()), where));
  ASSIGN_OR_RETURN(meta->job, StringField(j, "job", where));
  auto step = j.find("step");
  if (step == j.end() || !step->is_number_integer() || step->get<int64_t>() < 0) {
    return Corruption("metadata.json: step missing or negative");
  }
  meta->step = step->get<int64_t>();
  if (j.contains("created") && j["created"].is_string()) meta->created = j["created"].get<std::string>();
  if (auto run = j.find("run_id"); run != j.end()) {
    if (!run->is_string() || !ValidateRunId(run->get<std::string>()).ok()) {
      return Corruption("metadata.json: run_id is not a run id ([A-Za-z0-9._:-]{1,64})");
    }
    meta->run_id = run->get<std::string>();
  }
  if (auto from = j.find("resumed_from"); from != j.end()) {
    if (!from->is_number_integer() || from->get<int64_t>() < 0) {
      return Corruption("metadata.json: resumed_from is not a non-negative integer");
    }
    meta->resumed_from = from->get<int64_t>();
  }
  auto topo = j.find("topology");
  if (topo == j.end() || !topo->is_object()) return Corruption("metadata.json: no topology object");
  RETURN_IF_ERROR(U32Field(*topo, "world_size", where, &meta->topology.world_size));
  RETURN_IF_ERROR(U32Field(*topo, "tp_degree", where, &meta->topology.tp_degree));
  RETURN_IF_ERROR(U32Field(*topo, "pp_degree", where, &meta->topology.pp_degree));
  RETURN_IF_ERROR(U32Field(*topo, "shard_degree", where, &meta->topology.shard_degree));
  return Status::OK();
}

Status ParseFiles(const json& j, const std::string& where, std::vector<SavedFile>* out) {
  auto files = j.find("files");
  if (files == j.end() || !files->is_array()) return Corruption("metadata.json: no files array");
  for (const auto& f : *files) {
    if (!f.is_object()) return Corruption("metadata.json: a files entry is not an object");
    SavedFile sf;
    ASSIGN_OR_RETURN(sf.name, StringField(f, "name", where));
    // The name is joined to the checkpoint directory: it must name an entry of that directory.
    if (sf.name.empty() || sf.name.find('/') != std::string::npos || sf.name.find('\0') != std::string::npos ||
        sf.name == ".." || sf.name == ".") {
      return Corruption("metadata.json: file name '" + sf.name + "' is not a plain name");
    }
    RETURN_IF_ERROR(U32Field(f, "rank", where, &sf.rank));
    RETURN_IF_ERROR(U32Field(f, "tp_rank", where, &sf.tp_rank));
    RETURN_IF_ERROR(U32Field(f, "pp_rank", where, &sf.pp_rank));
    RETURN_IF_ERROR(U32Field(f, "shard_rank", where, &sf.shard_rank));
    ASSIGN_OR_RETURN(sf.bytes, U64Field(f, "bytes", where));
    if (sf.bytes > kMaxCheckpointFileBytes) return Corruption("metadata.json: file '" + sf.name + "' is too large");
    out->push_back(std::move(sf));
  }
  return Status::OK();
}

// One piece of tensor `tensor`, checked against the files already parsed and the format version.
Result<Piece> ParsePiece(const json& pj, const std::string& tensor, const CheckpointMetadata& meta) {
  std::string pw = "metadata.json: tensor '" + tensor + "'";
  if (!pj.is_object()) return Corruption(pw + ": a piece is not an object");
  Piece p;
  p.key = tensor;
  ASSIGN_OR_RETURN(p.file, StringField(pj, "file", pw));
  auto file = std::find_if(meta.files.begin(), meta.files.end(), [&](const SavedFile& f) { return f.name == p.file; });
  if (file == meta.files.end()) {
    return Corruption(pw + ": piece names file '" + p.file + "' that is not in the files list");
  }
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
  if (p.end > file->bytes) return Corruption(pw + ": offsets lie beyond the end of file '" + p.file + "'");
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
  if (pj.contains("chunk_bytes") || pj.contains("xxh3_chunks")) {
    ASSIGN_OR_RETURN(uint64_t chunk, U64Field(pj, "chunk_bytes", pw));
    ASSIGN_OR_RETURN(std::string hex, StringField(pj, "xxh3_chunks", pw));
    RETURN_IF_ERROR(ParseChunkChecksums(hex, chunk, &p).WithContext("metadata.json"));
  }
  RETURN_IF_ERROR(ApplyChecksumRule(meta.format_version, &p).WithContext("metadata.json"));
  RETURN_IF_ERROR(CheckPieceGeometry(p));
  RETURN_IF_ERROR(CheckPieceShape(p).WithContext("metadata.json"));
  return p;
}

// The tensors object: every piece of every tensor, into meta->pieces (the files parsed before).
Status ParseTensors(const json& j, CheckpointMetadata* meta) {
  auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_object()) return Corruption("metadata.json: no tensors object");
  for (auto it = tensors->begin(); it != tensors->end(); ++it) {
    if (!it.value().is_array()) return Corruption("metadata.json: tensor '" + it.key() + "' is not a list of pieces");
    for (const auto& pj : it.value()) {
      ASSIGN_OR_RETURN(Piece p, ParsePiece(pj, it.key(), *meta));
      meta->pieces.push_back(std::move(p));
    }
  }
  return Status::OK();
}

Result<EmaRecord> ParseEmaRecord(const json& ema, const std::string& where) {
  if (!ema.is_object()) return Corruption("metadata.json: ema is not an object");
  EmaRecord r;
  auto d = ema.find("decay");
  if (d == ema.end() || !d->is_number()) return Corruption("metadata.json: ema.decay missing");
  r.decay = d->get<double>();
  RETURN_IF_ERROR(U32Field(ema, "interval", where, &r.interval));
  ASSIGN_OR_RETURN(r.init, StringField(ema, "init", where));
  ASSIGN_OR_RETURN(r.model_params, StringField(ema, "model_params", where));
  ASSIGN_OR_RETURN(r.updates_applied, U64Field(ema, "updates_applied", where));
  ASSIGN_OR_RETURN(r.updates_skipped, U64Field(ema, "updates_skipped", where));
  auto last = ema.find("last_step");
  if (last == ema.end() || !last->is_number_integer()) return Corruption("metadata.json: ema.last_step missing");
  r.last_step = last->get<int64_t>();
  if (auto t = ema.find("loss_threshold"); t != ema.end() && t->is_number()) r.loss_threshold = t->get<double>();
  return r;
}

}  // namespace

Result<CheckpointMetadata> ParseMetadataJson(std::string_view text) {
  auto j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Corruption("metadata.json is not a JSON object");
  CheckpointMetadata meta;
  const std::string where = "metadata.json";
  RETURN_IF_ERROR(ParseHeaderFields(j, where, &meta));
  RETURN_IF_ERROR(ParseFiles(j, where, &meta.files));
  RETURN_IF_ERROR(ParseTensors(j, &meta));
  if (auto ema = j.find("ema"); ema != j.end()) {
    ASSIGN_OR_RETURN(meta.ema, ParseEmaRecord(*ema, where));
  }
  return meta;
}

Result<CheckpointMetadata> ReadMetadataFile(const std::string& checkpoint_dir, IoEnv* io) {
  std::string path = checkpoint_dir + "/metadata.json";
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxMetadataJsonBytes, io));
  auto meta = ParseMetadataJson(text);
  if (!meta.ok()) return meta.status().WithContext(path);
  return meta;
}

}  // namespace flashckpt

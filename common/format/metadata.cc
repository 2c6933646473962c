#include "common/format/metadata.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <sys/stat.h>
#include <nlohmann/json.hpp>
#include <simdjson.h>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

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

// A JSON array of at most kMaxTensorRank unsigned integers ("[4, 8]") in a header's metadata value:
// read by hand (a completing daemon reads four per tensor of every file of the step), accepting
// what a JSON parser accepts for such an array: whitespace around the tokens, no sign, fraction,
// exponent or leading zero.
std::optional<std::vector<uint64_t>> ParseU64Array(std::string_view s) {
  size_t i = 0;
  auto skip_space = [&] {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
  };
  std::vector<uint64_t> out;
  skip_space();
  if (i >= s.size() || s[i] != '[') return std::nullopt;
  ++i;
  skip_space();
  if (i < s.size() && s[i] == ']') {
    ++i;
  } else {
    while (true) {
      skip_space();
      const size_t start = i;
      while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
      if (i == start || (s[start] == '0' && i - start > 1) || out.size() == kMaxTensorRank) return std::nullopt;
      uint64_t v = 0;
      auto [end, ec] = std::from_chars(s.data() + start, s.data() + i, v);
      if (ec != std::errc() || end != s.data() + i) return std::nullopt;
      out.push_back(v);
      skip_space();
      if (i < s.size() && s[i] == ',') {
        ++i;
        continue;
      }
      if (i < s.size() && s[i] == ']') {
        ++i;
        break;
      }
      return std::nullopt;
    }
  }
  skip_space();
  if (i != s.size()) return std::nullopt;
  return out;
}

// The array in `value`, the value of tensor `tensor`'s metadata key for `what` (nullptr: the key
// is missing).
Result<std::vector<uint64_t>> U64ArrayFromValue(const std::string* value, const std::string& tensor,
                                                const char* what) {
  if (value == nullptr) return Corruption("missing metadata key '" + TensorMetaKey(tensor, what) + "'");
  auto parsed = ParseU64Array(*value);
  if (!parsed) {
    return Corruption("metadata key '" + TensorMetaKey(tensor, what) +
                      "' is not an array of at most 8 unsigned integers");
  }
  return std::move(*parsed);
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

namespace {

// A tensor's values in a header's __metadata__ (keys "<tensor>@<what>", TensorMetaKey); nullptr
// where the key is missing.
struct TensorValues {
  const std::string* kind = nullptr;
  const std::string* global_shape = nullptr;
  const std::string* box_offset = nullptr;
  const std::string* box_shape = nullptr;
  const std::string* flat_range = nullptr;
  const std::string* xxh3 = nullptr;
  const std::string* xxh3_chunks = nullptr;
};

// The values of every entry of `header`, in one pass over __metadata__ rather than a lookup per
// value: a completion reads every tensor of every file of the step. A key is split at its last '@'
// (a tensor name may hold one; what follows never does).
std::unordered_map<std::string_view, TensorValues> ValuesByTensor(const SafetensorsHeader& header) {
  std::unordered_map<std::string_view, TensorValues> values;
  values.reserve(header.entries.size());
  for (const auto& e : header.entries) values.emplace(e.name, TensorValues{});
  for (const auto& [key, value] : header.metadata) {
    const size_t at = key.rfind('@');
    if (at == std::string::npos) continue;
    auto it = values.find(std::string_view(key).substr(0, at));
    if (it == values.end()) continue;
    const std::string_view what = std::string_view(key).substr(at + 1);
    TensorValues& v = it->second;
    if (what == "kind") {
      v.kind = &value;
    } else if (what == "global_shape") {
      v.global_shape = &value;
    } else if (what == "box_offset") {
      v.box_offset = &value;
    } else if (what == "box_shape") {
      v.box_shape = &value;
    } else if (what == "flat_range") {
      v.flat_range = &value;
    } else if (what == "xxh3") {
      v.xxh3 = &value;
    } else if (what == "xxh3_chunks") {
      v.xxh3_chunks = &value;
    }
  }
  return values;
}

}  // namespace

Result<std::vector<Piece>> PiecesFromHeader(const SafetensorsHeader& header, const std::string& file_name) {
  std::vector<Piece> pieces;
  auto version_text = header.metadata.find("format_version");
  if (version_text == header.metadata.end()) return Corruption(file_name + ": no format_version in __metadata__");
  ASSIGN_OR_RETURN(const int version, ParseFormatVersion(version_text->second, file_name));
  const std::unordered_map<std::string_view, TensorValues> values = ValuesByTensor(header);
  std::optional<Result<uint64_t>> chunk;  // the file's checksum_chunk, read once a tensor needs it
  pieces.reserve(header.entries.size());
  for (const auto& e : header.entries) {
    auto fail = [&](const std::string& why) { return Corruption(file_name + ": tensor '" + e.name + "': " + why); };
    const TensorValues& v = values.at(e.name);
    Piece p;
    p.key = e.name;
    p.dtype = e.dtype;
    p.shape = e.shape;
    p.file = file_name;
    p.begin = header.data_start + e.begin;
    p.end = header.data_start + e.end;
    if (v.kind == nullptr) return fail("no kind in __metadata__");
    auto k = ParseTensorKind(*v.kind);
    if (!k) return fail("unknown kind '" + *v.kind + "'");
    p.kind = *k;
    // Errors name the file and the tensor, like every other error of this function.
    auto array_meta = [&](const std::string* value, const char* what) -> Result<std::vector<uint64_t>> {
      auto r = U64ArrayFromValue(value, e.name, what);
      if (!r.ok()) return r.status().WithContext(file_name + ": tensor '" + e.name + "'");
      return r;
    };
    ASSIGN_OR_RETURN(p.global_shape, array_meta(v.global_shape, "global_shape"));
    ASSIGN_OR_RETURN(p.box_offset, array_meta(v.box_offset, "box_offset"));
    ASSIGN_OR_RETURN(p.box_shape, array_meta(v.box_shape, "box_shape"));
    if (v.flat_range != nullptr) {
      ASSIGN_OR_RETURN(auto r, array_meta(v.flat_range, "flat_range"));
      if (r.size() != 2 || r[0] > r[1]) return fail("flat_range is not [begin, end]");
      p.flat_range = FlatRange{r[0], r[1]};
    }
    if (v.xxh3 == nullptr) return fail("no xxh3 checksum in __metadata__");
    auto parsed = ParseChecksumHex(*v.xxh3);
    if (!parsed) return fail("xxh3 checksum '" + *v.xxh3 + "' is not 16 hex digits");
    p.xxh3 = *parsed;
    if (v.xxh3_chunks != nullptr) {
      if (!chunk) chunk = CounterMeta(header.metadata, "checksum_chunk");
      if (!chunk->ok()) return fail(chunk->status().message());
      RETURN_IF_ERROR(ParseChunkChecksums(*v.xxh3_chunks, **chunk, &p).WithContext(file_name));
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

namespace {

// What one file gives the metadata, read from its header and checked on its own.
struct FilePart {
  int format_version = 0;
  std::string job;
  int64_t step = 0;
  Topology topology;
  SavedFile file;
  bool ema_file = false;
  Result<EmaRecord> ema = Internal("not an ema file");  // an ema file's record, or why it has none
  std::vector<Piece> pieces;
};

Result<FilePart> FilePartFromHeader(const std::string& path, const std::string& name, const SafetensorsHeader& header) {
  const auto& m = header.metadata;
  FilePart part;
  auto job = m.find("job");
  auto step = m.find("step");
  if (job == m.end() || step == m.end()) return Corruption(path + ": no job or step in __metadata__");
  auto parsed_step = CounterMeta(m, "step");
  if (!parsed_step.ok() || *parsed_step > static_cast<uint64_t>(INT64_MAX)) {
    return Corruption(path + ": step '" + step->second + "' is not a decimal step");
  }
  part.job = job->second;
  part.step = static_cast<int64_t>(*parsed_step);
  Topology& t = part.topology;
  ASSIGN_OR_RETURN(t.world_size, U32Meta(m, "world_size"));
  ASSIGN_OR_RETURN(t.tp_degree, U32Meta(m, "tp_degree"));
  ASSIGN_OR_RETURN(t.pp_degree, U32Meta(m, "pp_degree"));
  ASSIGN_OR_RETURN(t.shard_degree, U32Meta(m, "shard_degree"));
  SavedFile& f = part.file;
  f.name = name;
  ASSIGN_OR_RETURN(f.rank, U32Meta(m, "rank"));
  ASSIGN_OR_RETURN(f.tp_rank, U32Meta(m, "tp_rank"));
  ASSIGN_OR_RETURN(f.pp_rank, U32Meta(m, "pp_rank"));
  ASSIGN_OR_RETURN(f.shard_rank, U32Meta(m, "shard_rank"));
  f.bytes = header.data_start + header.data_bytes;
  auto version_text = m.find("format_version");
  if (version_text == m.end()) return Corruption(path + ": no format_version in __metadata__");
  ASSIGN_OR_RETURN(part.format_version, ParseFormatVersion(version_text->second, path));
  if (auto kind = m.find("file"); kind != m.end() && kind->second == "ema") {
    part.ema_file = true;
    part.ema = EmaRecordFromHeader(m, path);
  }
  ASSIGN_OR_RETURN(part.pieces, PiecesFromHeader(header, name));
  return part;
}

}  // namespace

namespace {

// Each of the named *.safetensors files' part of the metadata (sorted by name, each once; other
// names are left out), built on the loop's threads when there is one, from its header: the one
// its rank's signal records, or else the one read from the file (on a network file system each
// open and read waits for a round trip, and a job has thousands of files).
std::vector<std::pair<std::string, Result<FilePart>>> ReadFileParts(
    const std::string& dir, std::vector<std::string> names, IoEnv* io, ParallelLoop* loop,
    const std::map<std::string, const SignalHeader*>* recorded) {
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  names.erase(std::remove_if(names.begin(), names.end(),
                             [](const std::string& name) {
                               return name.size() <= kSuffix.size() ||
                                      name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0;
                             }),
              names.end());
  std::vector<std::pair<std::string, Result<FilePart>>> parts;
  parts.reserve(names.size());
  for (std::string& n : names) parts.emplace_back(std::move(n), Result<FilePart>(Internal("not read")));
  auto read = [&](size_t i) {
    const std::string path = dir + "/" + parts[i].first;
    const SignalHeader* known = nullptr;
    if (recorded != nullptr) {
      auto it = recorded->find(parts[i].first);
      if (it != recorded->end()) known = it->second;
    }
    Result<SafetensorsHeader> header = Internal("not read");
    if (known == nullptr) {
      header = ReadSafetensorsHeader(path, io);
    } else {
      header = ParseSafetensorsHeader(known->json, known->header_bytes, known->file_bytes);
      if (!header.ok()) header = header.status().WithContext(path + " (the header its rank's signal records)");
    }
    if (!header.ok()) {
      parts[i].second = header.status();
      return;
    }
    parts[i].second = FilePartFromHeader(path, parts[i].first, *header);
  };
  if (loop != nullptr) {
    loop->Run(parts.size(), read);
  } else {
    for (size_t i = 0; i < parts.size(); ++i) read(i);
  }
  return parts;
}

}  // namespace

Result<CheckpointMetadata> BuildMetadataFromFiles(const std::string& dir, std::vector<std::string> names,
                                                  IoEnv* io, ParallelLoop* loop,
                                                  const std::map<std::string, const SignalHeader*>* recorded) {
  // What is left here, after the parts are read, is checking that they agree and gathering them.
  auto parts = ReadFileParts(dir, std::move(names), io, loop, recorded);
  CheckpointMetadata meta;
  bool first = true;
  for (auto& [name, read] : parts) {
    const std::string path = dir + "/" + name;
    ASSIGN_OR_RETURN(FilePart part, std::move(read));
    const Topology& t = part.topology;
    if (first) {
      meta.format_version = part.format_version;
      meta.job = part.job;
      meta.step = part.step;
      meta.topology = t;
      first = false;
    } else if (part.format_version != meta.format_version) {
      return Corruption(path + ": format_version " + std::to_string(part.format_version) +
                        " differs from the other files' " + std::to_string(meta.format_version) + " in " + dir);
    } else if (meta.job != part.job || meta.step != part.step || meta.topology.world_size != t.world_size ||
               meta.topology.tp_degree != t.tp_degree || meta.topology.pp_degree != t.pp_degree ||
               meta.topology.shard_degree != t.shard_degree) {
      return Corruption(path + ": job, step or topology differs from the other files of " + dir);
    }
    if (part.ema_file && !meta.ema) {
      ASSIGN_OR_RETURN(meta.ema, std::move(part.ema));
    }
    for (auto& p : part.pieces) meta.pieces.push_back(std::move(p));
    meta.files.push_back(std::move(part.file));
  }
  if (first) return NotFound("no .safetensors files in " + dir);
  meta.created = NowUtc();
  return meta;
}

namespace {

// metadata.json is written directly, not through a JSON document: a job of thousands of ranks has
// close to a million pieces, and building a document of them costs more than the rest of a commit.
// One line per field, per file and per piece, keys in the order below (docs/format.md).

// The kinds of tensor among `pieces`, each once, in the enum's order.
std::vector<TensorKind> KindsOfPieces(const std::vector<Piece>& pieces) {
  std::vector<TensorKind> kinds;
  for (TensorKind kind : {TensorKind::kModel, TensorKind::kOptimizer, TensorKind::kMasterWeight, TensorKind::kEma}) {
    if (std::any_of(pieces.begin(), pieces.end(), [&](const Piece& p) { return p.kind == kind; })) kinds.push_back(kind);
  }
  return kinds;
}

// `s` as a JSON string. Plain ASCII (every name this release writes) is copied; anything else goes
// through nlohmann, which escapes control characters and replaces invalid UTF-8.
void AppendString(std::string* out, std::string_view s) {
  const bool plain = std::all_of(s.begin(), s.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return u >= 0x20 && u < 0x80 && c != '"' && c != '\\';
  });
  if (plain) {
    out->push_back('"');
    out->append(s);
    out->push_back('"');
  } else {
    out->append(json(std::string(s)).dump(-1, ' ', false, json::error_handler_t::replace));
  }
}

template <typename Int>
void AppendInt(std::string* out, Int v) {
  char buf[24];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  out->append(buf, end);
}

void AppendU64(std::string* out, uint64_t v) { AppendInt(out, v); }

void AppendU64s(std::string* out, const uint64_t* v, size_t n) {
  out->push_back('[');
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) out->push_back(',');
    AppendU64(out, v[i]);
  }
  out->push_back(']');
}

void AppendU64s(std::string* out, const std::vector<uint64_t>& v) { AppendU64s(out, v.data(), v.size()); }

void AppendPiece(std::string* out, const Piece& p, std::string_view file) {
  *out += "{\"file\":";
  out->append(file);
  *out += ",\"kind\":\"";
  *out += TensorKindName(p.kind);
  *out += "\",\"dtype\":\"";
  *out += DTypeName(p.dtype);
  *out += "\",\"shape\":";
  AppendU64s(out, p.shape);
  *out += ",\"global_shape\":";
  AppendU64s(out, p.global_shape);
  *out += ",\"box_offset\":";
  AppendU64s(out, p.box_offset);
  *out += ",\"box_shape\":";
  AppendU64s(out, p.box_shape);
  const uint64_t offsets[2] = {p.begin, p.end};
  *out += ",\"offsets\":";
  AppendU64s(out, offsets, 2);
  *out += ",\"xxh3\":\"";
  *out += ChecksumHex(p.xxh3);
  out->push_back('"');
  if (p.flat_range) {
    const uint64_t range[2] = {p.flat_range->begin, p.flat_range->end};
    *out += ",\"flat_range\":";
    AppendU64s(out, range, 2);
  }
  if (!p.chunk_xxh3.empty()) {
    *out += ",\"chunk_bytes\":";
    AppendU64(out, p.chunk_bytes);
    *out += ",\"xxh3_chunks\":\"";
    for (uint64_t c : p.chunk_xxh3) *out += ChecksumHex(c);
    out->push_back('"');
  }
  out->push_back('}');
}

}  // namespace

namespace {

// metadata.json and its index: the head of `meta` (its pieces are not read here), then the list of
// each of `keys` (sorted, each once), which `append(i, &out)` writes for keys[i] as
// "\n   {piece},\n   {piece}" (about `pieces_bytes` in all); the index lists `kinds`.
template <typename AppendPieces>
MetadataText TextOf(const CheckpointMetadata& meta, const std::vector<std::string_view>& keys,
                    const std::vector<TensorKind>& kinds, size_t pieces_bytes, AppendPieces append) {
  std::string out;
  out.reserve(1024 + meta.files.size() * 128 + pieces_bytes);
  out += "{\n \"format\": \"flashckpt\",\n \"format_version\": ";
  AppendInt<int64_t>(&out, meta.format_version);
  out += ",\n \"job\": ";
  AppendString(&out, meta.job);
  out += ",\n \"step\": ";
  AppendInt<int64_t>(&out, meta.step);
  out += ",\n \"created\": ";
  AppendString(&out, meta.created);
  if (!meta.run_id.empty()) {
    out += ",\n \"run_id\": ";
    AppendString(&out, meta.run_id);
  }
  out += ",\n \"resumed_from\": ";
  AppendInt<int64_t>(&out, meta.resumed_from);
  out += ",\n \"topology\": {\"world_size\":";
  AppendU64(&out, meta.topology.world_size);
  out += ",\"tp_degree\":";
  AppendU64(&out, meta.topology.tp_degree);
  out += ",\"pp_degree\":";
  AppendU64(&out, meta.topology.pp_degree);
  out += ",\"shard_degree\":";
  AppendU64(&out, meta.topology.shard_degree);
  out += "}";
  if (meta.ema) {
    out += ",\n \"ema\": ";
    out += EmaRecordToJson(*meta.ema).dump(-1, ' ', false, json::error_handler_t::replace);
  }
  out += ",\n \"files\": [";
  for (size_t i = 0; i < meta.files.size(); ++i) {
    const SavedFile& f = meta.files[i];
    out += i == 0 ? "\n  {\"name\":" : ",\n  {\"name\":";
    AppendString(&out, f.name);
    out += ",\"rank\":";
    AppendU64(&out, f.rank);
    out += ",\"tp_rank\":";
    AppendU64(&out, f.tp_rank);
    out += ",\"pp_rank\":";
    AppendU64(&out, f.pp_rank);
    out += ",\"shard_rank\":";
    AppendU64(&out, f.shard_rank);
    out += ",\"bytes\":";
    AppendU64(&out, f.bytes);
    out += "}";
  }
  out += "\n ]";
  // Everything up to here is the head: with a closing brace it is a JSON object of its own.
  const size_t head_end = out.size();
  out += ",\n \"tensors\": {";
  struct Range {
    size_t begin, end;
  };
  std::vector<Range> ranges;
  ranges.reserve(keys.size());
  for (size_t k = 0; k < keys.size(); ++k) {
    out += k == 0 ? "\n  " : ",\n  ";
    AppendString(&out, keys[k]);
    out += ": ";
    const size_t begin = out.size();
    out += "[";
    append(k, &out);
    out += "\n  ]";
    ranges.push_back(Range{begin, out.size()});
  }
  out += "\n }\n}\n";

  // metadata.index.json: where the head and each tensor's list of pieces sit in the text above, with
  // the checksum of each, and the kinds the checkpoint holds.
  std::string index;
  index.reserve(256 + ranges.size() * 96);
  index += "{\n \"format\": \"flashckpt-metadata-index\",\n \"format_version\": ";
  AppendInt<int64_t>(&index, meta.format_version);
  index += ",\n \"metadata_bytes\": ";
  AppendU64(&index, out.size());
  index += ",\n \"head\": [0,";
  AppendU64(&index, head_end);
  index += ",\"";
  index += ChecksumHex(Xxh3(out.data(), head_end));
  index += "\"],\n \"kinds\": [";
  bool first_kind = true;
  for (TensorKind kind : kinds) {
    index += first_kind ? "\"" : ",\"";
    first_kind = false;
    index += TensorKindName(kind);
    index += "\"";
  }
  index += "],\n \"tensors\": {";
  for (size_t i = 0; i < ranges.size(); ++i) {
    index += i == 0 ? "\n  " : ",\n  ";
    AppendString(&index, keys[i]);
    index += ": [";
    AppendU64(&index, ranges[i].begin);
    index += ",";
    AppendU64(&index, ranges[i].end);
    index += ",\"";
    index += ChecksumHex(Xxh3(out.data() + ranges[i].begin, ranges[i].end - ranges[i].begin));
    index += "\"]";
  }
  index += "\n }\n}\n";
  return MetadataText{std::move(out), std::move(index)};
}

// The kinds among `kinds` (in any order, repeated or not), each once, in the enum's order.
std::vector<TensorKind> KindsInOrder(const std::vector<TensorKind>& kinds) {
  std::vector<TensorKind> out;
  for (TensorKind kind : {TensorKind::kModel, TensorKind::kOptimizer, TensorKind::kMasterWeight, TensorKind::kEma}) {
    if (std::find(kinds.begin(), kinds.end(), kind) != kinds.end()) out.push_back(kind);
  }
  return out;
}

}  // namespace

namespace {

// A file's part, rendered: its pieces as metadata.json lists them, by tensor in the file's order.
Result<RenderedFile> RenderedFromPart(FilePart part) {
  RenderedFile r;
  r.format_version = part.format_version;
  r.job = std::move(part.job);
  r.step = part.step;
  r.topology = part.topology;
  if (part.ema_file) {
    ASSIGN_OR_RETURN(EmaRecord record, std::move(part.ema));
    r.ema = std::move(record);
  }
  std::string file_json;
  AppendString(&file_json, part.file.name);
  r.file = std::move(part.file);
  r.pieces = part.pieces.size();
  std::vector<TensorKind> kinds;
  for (const Piece& p : part.pieces) {
    kinds.push_back(p.kind);
    auto it = std::find_if(r.tensors.rbegin(), r.tensors.rend(), [&](const auto& t) { return t.first == p.key; });
    std::string* text = nullptr;
    if (it == r.tensors.rend()) {
      r.tensors.emplace_back(p.key, std::string());
      text = &r.tensors.back().second;
    } else {
      text = &it->second;
      *text += ",\n   ";
    }
    AppendPiece(text, p, file_json);
  }
  r.kinds = KindsInOrder(kinds);
  return r;
}

}  // namespace

MetadataText MetadataToText(const CheckpointMetadata& meta) {
  // The pieces by tensor name (sorted), each name's in the order of meta.pieces.
  std::map<std::string_view, std::vector<const Piece*>> by_key;
  for (const Piece& p : meta.pieces) by_key[p.key].push_back(&p);
  std::map<std::string_view, std::string> file_json;  // each file name as a JSON string, made once
  for (const SavedFile& f : meta.files) {
    auto [it, added] = file_json.try_emplace(f.name);
    if (added) AppendString(&it->second, f.name);
  }
  std::vector<std::string_view> keys;
  std::vector<const std::vector<const Piece*>*> lists;
  keys.reserve(by_key.size());
  lists.reserve(by_key.size());
  for (const auto& [key, pieces] : by_key) {
    keys.push_back(key);
    lists.push_back(&pieces);
  }
  return TextOf(meta, keys, KindsOfPieces(meta.pieces), meta.pieces.size() * 256, [&](size_t k, std::string* out) {
    const std::vector<const Piece*>& pieces = *lists[k];
    for (size_t i = 0; i < pieces.size(); ++i) {
      *out += i == 0 ? "\n   " : ",\n   ";
      auto file = file_json.find(pieces[i]->file);
      if (file == file_json.end()) {  // a piece of a file not in the list (the parser refuses it)
        file = file_json.emplace(pieces[i]->file, std::string()).first;
        AppendString(&file->second, pieces[i]->file);
      }
      AppendPiece(out, *pieces[i], file->second);
    }
  });
}

Result<RenderedFile> RenderFile(const std::string& path, const std::string& name, const SafetensorsHeader& header) {
  ASSIGN_OR_RETURN(FilePart part, FilePartFromHeader(path, name, header));
  return RenderedFromPart(std::move(part));
}

Result<std::vector<RenderedFile>> RenderFiles(const std::string& dir, std::vector<std::string> names, IoEnv* io,
                                              ParallelLoop* loop,
                                              const std::map<std::string, const SignalHeader*>* recorded) {
  auto parts = ReadFileParts(dir, std::move(names), io, loop, recorded);
  std::vector<RenderedFile> out;
  out.reserve(parts.size());
  for (auto& [name, read] : parts) {
    ASSIGN_OR_RETURN(FilePart part, std::move(read));
    ASSIGN_OR_RETURN(RenderedFile file, RenderedFromPart(std::move(part)));
    out.push_back(std::move(file));
  }
  return out;
}

Result<MetadataText> MetadataTextOfRendered(const std::string& dir, std::vector<const RenderedFile*> files,
                                            CheckpointMetadata* head) {
  std::sort(files.begin(), files.end(),
            [](const RenderedFile* a, const RenderedFile* b) { return a->file.name < b->file.name; });
  CheckpointMetadata meta;
  meta.run_id = std::move(head->run_id);
  meta.resumed_from = head->resumed_from;
  // Agreement, as BuildMetadataFromFiles checks it; the first ema file's record is the checkpoint's.
  // A file listed twice (by two signals, or a signal and a part) counts once if both say the same,
  // as BuildMetadataFromFiles reads each name once.
  auto same = [](const RenderedFile& a, const RenderedFile& b) {
    return a.file.rank == b.file.rank && a.file.bytes == b.file.bytes && a.tensors == b.tensors;
  };
  std::vector<const RenderedFile*> unique;
  unique.reserve(files.size());
  for (const RenderedFile* f : files) {
    if (!unique.empty() && unique.back()->file.name == f->file.name) {
      if (!same(*unique.back(), *f)) return Corruption(dir + "/" + f->file.name + ": described two ways in " + dir);
      continue;
    }
    unique.push_back(f);
  }
  files = std::move(unique);
  std::vector<TensorKind> kinds;
  size_t text_bytes = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const RenderedFile& f = *files[i];
    const std::string path = dir + "/" + f.file.name;
    const Topology& t = f.topology;
    if (i == 0) {
      meta.format_version = f.format_version;
      meta.job = f.job;
      meta.step = f.step;
      meta.topology = t;
    } else if (f.format_version != meta.format_version) {
      return Corruption(path + ": format_version " + std::to_string(f.format_version) +
                        " differs from the other files' " + std::to_string(meta.format_version) + " in " + dir);
    } else if (meta.job != f.job || meta.step != f.step || meta.topology.world_size != t.world_size ||
               meta.topology.tp_degree != t.tp_degree || meta.topology.pp_degree != t.pp_degree ||
               meta.topology.shard_degree != t.shard_degree) {
      return Corruption(path + ": job, step or topology differs from the other files of " + dir);
    }
    if (f.ema && !meta.ema) meta.ema = f.ema;
    kinds.insert(kinds.end(), f.kinds.begin(), f.kinds.end());
    for (const auto& [key, text] : f.tensors) text_bytes += text.size() + 8;
    meta.files.push_back(f.file);
  }
  if (files.empty()) return NotFound("no .safetensors files in " + dir);
  meta.created = head->created.empty() ? NowUtc() : head->created;
  // Each tensor's lists, in the order of the files (sorted by name), as MetadataToText orders them.
  std::map<std::string_view, std::vector<const std::string*>> by_key;
  for (const RenderedFile* f : files) {
    for (const auto& [key, text] : f->tensors) by_key[key].push_back(&text);
  }
  std::vector<std::string_view> keys;
  std::vector<const std::vector<const std::string*>*> lists;
  for (const auto& [key, texts] : by_key) {
    keys.push_back(key);
    lists.push_back(&texts);
  }
  MetadataText text = TextOf(meta, keys, KindsInOrder(kinds), text_bytes, [&](size_t k, std::string* out) {
    const auto& texts = *lists[k];
    for (size_t i = 0; i < texts.size(); ++i) {
      *out += i == 0 ? "\n   " : ",\n   ";
      *out += *texts[i];
    }
  });
  meta.pieces.clear();
  *head = std::move(meta);
  head->kinds_saved = KindsInOrder(kinds);
  return text;
}

std::string MetadataToJson(const CheckpointMetadata& meta) { return MetadataToText(meta).json; }

Status WriteMetadataFiles(const std::string& dir, const CheckpointMetadata& meta, IoEnv* io) {
  return WriteMetadataText(dir, MetadataToText(meta), io);
}

Status WriteMetadataText(const std::string& dir, const MetadataText& text, IoEnv* io) {
  // The index first: metadata.json completes the checkpoint, and a reader that finds it finds its
  // index. A reader also checks the index against metadata.json (size and checksums) and reads the
  // whole file when they disagree, so an index left from an earlier write is never trusted.
  RETURN_IF_ERROR(WriteFileDurably(dir, kMetadataIndexName, text.index, nullptr, io));
  bool renamed = false;
  Status written = WriteFileDurably(dir, "metadata.json", text.json, &renamed, io);
  // Not complete: the index goes too (best effort: an index without metadata.json is never read).
  if (!written.ok() && !renamed) (void)io->Unlink(dir + "/" + kMetadataIndexName);
  return written;
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

// metadata.json is read with simdjson: a job of thousands of ranks writes hundreds of MiB of it, which
// a document parser that allocates per value reads at a tenth of the speed. Every field is checked
// as before; the helpers below turn simdjson's error codes into kCorruption naming the field.
using JsonElement = simdjson::dom::element;
using JsonObject = simdjson::dom::object;
using JsonArray = simdjson::dom::array;

Result<uint64_t> JsonU64(JsonObject obj, const char* key, const std::string& where) {
  uint64_t v = 0;
  if (obj.at_key(key).get_uint64().get(v) != simdjson::SUCCESS) {
    return Corruption(where + ": field '" + key + "' missing or not an unsigned integer");
  }
  return v;
}

Status JsonU32(JsonObject obj, const char* key, const std::string& where, uint32_t* out) {
  ASSIGN_OR_RETURN(uint64_t v, JsonU64(obj, key, where));
  if (v > 0xffffffffull) return Corruption(where + ": " + key + " out of range");
  *out = static_cast<uint32_t>(v);
  return Status::OK();
}

Result<std::string_view> JsonString(JsonObject obj, const char* key, const std::string& where) {
  std::string_view v;
  if (obj.at_key(key).get_string().get(v) != simdjson::SUCCESS) {
    return Corruption(where + ": field '" + key + "' missing or not a string");
  }
  return v;
}

// format_version, job, step, created, run_id, resumed_from and the topology.
Status ParseHeaderFields(JsonObject j, const std::string& where, CheckpointMetadata* meta) {
  uint64_t version = 0;
  if (j.at_key("format_version").get_uint64().get(version) != simdjson::SUCCESS) {
    return Corruption("metadata.json: format_version missing or not a number");
  }
  ASSIGN_OR_RETURN(meta->format_version, ParseFormatVersion(std::to_string(version), where));
  ASSIGN_OR_RETURN(std::string_view job, JsonString(j, "job", where));
  meta->job = job;
  int64_t step = 0;
  if (j.at_key("step").get_int64().get(step) != simdjson::SUCCESS || step < 0) {
    return Corruption("metadata.json: step missing or negative");
  }
  meta->step = step;
  std::string_view created;
  if (j.at_key("created").get_string().get(created) == simdjson::SUCCESS) meta->created = created;
  if (JsonElement run; j.at_key("run_id").get(run) == simdjson::SUCCESS) {
    std::string_view id;
    if (run.get_string().get(id) != simdjson::SUCCESS || !ValidateRunId(std::string(id)).ok()) {
      return Corruption("metadata.json: run_id is not a run id ([A-Za-z0-9._:-]{1,64})");
    }
    meta->run_id = id;
  }
  if (JsonElement from; j.at_key("resumed_from").get(from) == simdjson::SUCCESS) {
    int64_t v = 0;
    if (from.get_int64().get(v) != simdjson::SUCCESS || v < 0) {
      return Corruption("metadata.json: resumed_from is not a non-negative integer");
    }
    meta->resumed_from = v;
  }
  JsonObject topo;
  if (j.at_key("topology").get_object().get(topo) != simdjson::SUCCESS) {
    return Corruption("metadata.json: no topology object");
  }
  RETURN_IF_ERROR(JsonU32(topo, "world_size", where, &meta->topology.world_size));
  RETURN_IF_ERROR(JsonU32(topo, "tp_degree", where, &meta->topology.tp_degree));
  RETURN_IF_ERROR(JsonU32(topo, "pp_degree", where, &meta->topology.pp_degree));
  RETURN_IF_ERROR(JsonU32(topo, "shard_degree", where, &meta->topology.shard_degree));
  return Status::OK();
}

Status ParseFiles(JsonObject j, const std::string& where, std::vector<SavedFile>* out) {
  JsonArray files;
  if (j.at_key("files").get_array().get(files) != simdjson::SUCCESS) {
    return Corruption("metadata.json: no files array");
  }
  for (JsonElement e : files) {
    JsonObject f;
    if (e.get_object().get(f) != simdjson::SUCCESS) return Corruption("metadata.json: a files entry is not an object");
    SavedFile sf;
    ASSIGN_OR_RETURN(std::string_view name, JsonString(f, "name", where));
    sf.name = name;
    // The name is joined to the checkpoint directory: it must name an entry of that directory.
    if (sf.name.empty() || sf.name.find('/') != std::string::npos || sf.name.find('\0') != std::string::npos ||
        sf.name == ".." || sf.name == ".") {
      return Corruption("metadata.json: file name '" + sf.name + "' is not a plain name");
    }
    RETURN_IF_ERROR(JsonU32(f, "rank", where, &sf.rank));
    RETURN_IF_ERROR(JsonU32(f, "tp_rank", where, &sf.tp_rank));
    RETURN_IF_ERROR(JsonU32(f, "pp_rank", where, &sf.pp_rank));
    RETURN_IF_ERROR(JsonU32(f, "shard_rank", where, &sf.shard_rank));
    ASSIGN_OR_RETURN(sf.bytes, JsonU64(f, "bytes", where));
    if (sf.bytes > kMaxCheckpointFileBytes) return Corruption("metadata.json: file '" + sf.name + "' is too large");
    out->push_back(std::move(sf));
  }
  return Status::OK();
}

// The files parsed so far, by name, for the pieces to find theirs.
using FileIndex = std::unordered_map<std::string_view, const SavedFile*>;

FileIndex IndexFiles(const std::vector<SavedFile>& files) {
  FileIndex index;
  index.reserve(files.size());
  for (const SavedFile& f : files) index.emplace(f.name, &f);
  return index;
}

// An array of at most kMaxTensorRank unsigned integers into *out; false if it is not one.
bool ReadU64s(JsonElement e, std::vector<uint64_t>* out) {
  JsonArray a;
  if (e.get_array().get(a) != simdjson::SUCCESS || a.size() > kMaxTensorRank) return false;
  out->clear();
  for (JsonElement v : a) {
    uint64_t x = 0;
    if (v.get_uint64().get(x) != simdjson::SUCCESS) return false;
    out->push_back(x);
  }
  return true;
}

// One piece of tensor `tensor`, checked against the files already parsed and the format version.
// A large job has close to a million pieces: the fields are read in one pass, and the messages
// naming the tensor are made only on an error.
Result<Piece> ParsePiece(JsonElement e, std::string_view tensor, const FileIndex& files, int format_version) {
  auto fail = [&](const std::string& why) {
    return Corruption("metadata.json: tensor '" + std::string(tensor) + "': " + why);
  };
  JsonObject pj;
  if (e.get_object().get(pj) != simdjson::SUCCESS) return fail("a piece is not an object");
  Piece p;
  p.key = tensor;
  std::string_view file_name, kind, dtype, xxh3, chunks_hex;
  bool has_file = false, has_kind = false, has_dtype = false, has_xxh3 = false, has_chunks = false;
  bool has_chunk_bytes = false, has_offsets = false;
  bool has_shape = false, has_global = false, has_box_offset = false, has_box_shape = false;
  uint64_t chunk_bytes = 0;
  std::vector<uint64_t> offsets, range;
  for (auto field : pj) {
    const std::string_view k = field.key;
    JsonElement v = field.value;
    auto array = [&](std::vector<uint64_t>* out, bool* seen) -> Status {
      if (!ReadU64s(v, out)) return fail(std::string(k) + " is not an array of at most 8 unsigned integers");
      *seen = true;
      return Status::OK();
    };
    auto string = [&](std::string_view* out, bool* seen) -> Status {
      if (v.get_string().get(*out) != simdjson::SUCCESS) return fail("field '" + std::string(k) + "' is not a string");
      *seen = true;
      return Status::OK();
    };
    if (k == "file") {
      RETURN_IF_ERROR(string(&file_name, &has_file));
    } else if (k == "kind") {
      RETURN_IF_ERROR(string(&kind, &has_kind));
    } else if (k == "dtype") {
      RETURN_IF_ERROR(string(&dtype, &has_dtype));
    } else if (k == "shape") {
      RETURN_IF_ERROR(array(&p.shape, &has_shape));
    } else if (k == "global_shape") {
      RETURN_IF_ERROR(array(&p.global_shape, &has_global));
    } else if (k == "box_offset") {
      RETURN_IF_ERROR(array(&p.box_offset, &has_box_offset));
    } else if (k == "box_shape") {
      RETURN_IF_ERROR(array(&p.box_shape, &has_box_shape));
    } else if (k == "offsets") {
      RETURN_IF_ERROR(array(&offsets, &has_offsets));
    } else if (k == "flat_range") {
      bool seen = false;
      RETURN_IF_ERROR(array(&range, &seen));
      if (range.size() != 2 || range[0] > range[1]) return fail("flat_range is not [begin, end]");
      p.flat_range = FlatRange{range[0], range[1]};
    } else if (k == "xxh3") {
      RETURN_IF_ERROR(string(&xxh3, &has_xxh3));
    } else if (k == "xxh3_chunks") {
      RETURN_IF_ERROR(string(&chunks_hex, &has_chunks));
    } else if (k == "chunk_bytes") {
      if (v.get_uint64().get(chunk_bytes) != simdjson::SUCCESS) {
        return fail("field 'chunk_bytes' is not an unsigned integer");
      }
      has_chunk_bytes = true;
    }
  }
  if (!has_file) return fail("field 'file' missing");
  auto file = files.find(file_name);
  if (file == files.end()) {
    return fail("piece names file '" + std::string(file_name) + "' that is not in the files list");
  }
  p.file = file->second->name;
  if (!has_kind) return fail("field 'kind' missing");
  auto parsed_kind = ParseTensorKind(kind);
  if (!parsed_kind) return fail("unknown kind '" + std::string(kind) + "'");
  p.kind = *parsed_kind;
  if (!has_dtype) return fail("field 'dtype' missing");
  auto parsed_dtype = ParseDType(dtype);
  if (!parsed_dtype) return fail("unknown dtype '" + std::string(dtype) + "'");
  p.dtype = *parsed_dtype;
  if (!has_shape || !has_global || !has_box_offset || !has_box_shape || !has_offsets) {
    return fail("shape, global_shape, box_offset, box_shape or offsets missing");
  }
  if (offsets.size() != 2 || offsets[0] > offsets[1]) return fail("offsets are not [begin, end]");
  p.begin = offsets[0];
  p.end = offsets[1];
  if (p.end > file->second->bytes) return fail("offsets lie beyond the end of file '" + p.file + "'");
  auto bytes = TensorBytes(p.dtype, p.shape);
  if (!bytes.ok() || *bytes != p.end - p.begin) return fail("offsets do not match dtype and shape");
  if (!has_xxh3) return fail("field 'xxh3' missing");
  auto parsed = ParseChecksumHex(xxh3);
  if (!parsed) return fail("xxh3 is not 16 hex digits");
  p.xxh3 = *parsed;
  if (has_chunk_bytes || has_chunks) {
    if (!has_chunk_bytes || !has_chunks) return fail("chunk_bytes and xxh3_chunks come together");
    RETURN_IF_ERROR(ParseChunkChecksums(chunks_hex, chunk_bytes, &p).WithContext("metadata.json"));
  }
  RETURN_IF_ERROR(ApplyChecksumRule(format_version, &p).WithContext("metadata.json"));
  RETURN_IF_ERROR(CheckPieceGeometry(p));
  RETURN_IF_ERROR(CheckPieceShape(p).WithContext("metadata.json"));
  return p;
}

// One tensor's list of pieces, appended to *out.
Status ParsePieceList(JsonElement list, std::string_view tensor, const FileIndex& files, int format_version,
                      std::vector<Piece>* out) {
  JsonArray pieces;
  if (list.get_array().get(pieces) != simdjson::SUCCESS) {
    return Corruption("metadata.json: tensor '" + std::string(tensor) + "' is not a list of pieces");
  }
  for (JsonElement pj : pieces) {
    ASSIGN_OR_RETURN(Piece p, ParsePiece(pj, tensor, files, format_version));
    out->push_back(std::move(p));
  }
  return Status::OK();
}

// The tensors object: every piece of every tensor, into meta->pieces (the files parsed before).
Status ParseTensors(JsonObject j, CheckpointMetadata* meta) {
  JsonObject tensors;
  if (j.at_key("tensors").get_object().get(tensors) != simdjson::SUCCESS) {
    return Corruption("metadata.json: no tensors object");
  }
  const FileIndex files = IndexFiles(meta->files);
  std::unordered_set<std::string_view> seen;
  for (auto field : tensors) {
    if (!seen.insert(field.key).second) {
      return Corruption("metadata.json: tensor '" + std::string(field.key) + "' is listed twice");
    }
    RETURN_IF_ERROR(ParsePieceList(field.value, field.key, files, meta->format_version, &meta->pieces));
  }
  return Status::OK();
}

// Everything but the tensors: the header fields, the EMA record and the files.
Status ParseHead(JsonObject j, CheckpointMetadata* meta) {
  const std::string where = "metadata.json";
  RETURN_IF_ERROR(ParseHeaderFields(j, where, meta));
  RETURN_IF_ERROR(ParseFiles(j, where, &meta->files));
  if (JsonElement ema; j.at_key("ema").get(ema) == simdjson::SUCCESS) {
    ASSIGN_OR_RETURN(meta->ema, ParseEmaRecord(ema, where));
  }
  return Status::OK();
}

// Text read for simdjson, which wants SIMDJSON_PADDING readable bytes past the end.
struct PaddedText {
  std::string bytes;
  size_t size = 0;
  void Resize(size_t n) {
    size = n;
    bytes.resize(n + simdjson::SIMDJSON_PADDING);
  }
};

// A range of a file read into *text; its XXH3 must be `xxh3`.
Result<bool> ReadRange(int fd, const std::string& path, uint64_t begin, uint64_t end, uint64_t xxh3, IoEnv* io,
                       PaddedText* text) {
  text->Resize(end - begin);
  RETURN_IF_ERROR(PreadFull(fd, text->bytes.data(), end - begin, begin, path, io));
  return Xxh3(text->bytes.data(), end - begin) == xxh3;
}

// metadata.index.json, parsed and checked against itself; nullopt when it does not describe a
// metadata.json of `metadata_bytes` bytes (a reader then reads the whole file).
struct MetadataIndex {
  int format_version = 0;
  uint64_t head_end = 0, head_xxh3 = 0;
  std::vector<TensorKind> kinds;
  struct Range {
    uint64_t begin, end, xxh3;
  };
  std::unordered_map<std::string, Range> tensors;
};

bool ReadIndexRange(JsonElement e, uint64_t limit, MetadataIndex::Range* out) {
  JsonArray a;
  if (e.get_array().get(a) != simdjson::SUCCESS || a.size() != 3) return false;
  auto it = a.begin();
  std::string_view hex;
  if ((*it).get_uint64().get(out->begin) != simdjson::SUCCESS) return false;
  ++it;
  if ((*it).get_uint64().get(out->end) != simdjson::SUCCESS) return false;
  ++it;
  if ((*it).get_string().get(hex) != simdjson::SUCCESS) return false;
  auto parsed = ParseChecksumHex(hex);
  if (!parsed || out->begin > out->end || out->end > limit) return false;
  out->xxh3 = *parsed;
  return true;
}

std::optional<MetadataIndex> ParseMetadataIndex(std::string_view text, uint64_t metadata_bytes) {
  simdjson::dom::parser parser;
  JsonObject j;
  if (parser.parse(text.data(), text.size()).get_object().get(j) != simdjson::SUCCESS) return std::nullopt;
  MetadataIndex index;
  std::string_view format;
  uint64_t version = 0, bytes = 0;
  if (j.at_key("format").get_string().get(format) != simdjson::SUCCESS || format != "flashckpt-metadata-index" ||
      j.at_key("format_version").get_uint64().get(version) != simdjson::SUCCESS ||
      j.at_key("metadata_bytes").get_uint64().get(bytes) != simdjson::SUCCESS || bytes != metadata_bytes ||
      version > static_cast<uint64_t>(kFormatVersion)) {
    return std::nullopt;
  }
  index.format_version = static_cast<int>(version);
  JsonElement head;
  MetadataIndex::Range head_range{};
  if (j.at_key("head").get(head) != simdjson::SUCCESS || !ReadIndexRange(head, bytes, &head_range) ||
      head_range.begin != 0) {
    return std::nullopt;
  }
  index.head_end = head_range.end;
  index.head_xxh3 = head_range.xxh3;
  JsonArray kinds;
  if (j.at_key("kinds").get_array().get(kinds) != simdjson::SUCCESS) return std::nullopt;
  for (JsonElement k : kinds) {
    std::string_view name;
    if (k.get_string().get(name) != simdjson::SUCCESS) return std::nullopt;
    auto kind = ParseTensorKind(name);
    if (!kind) return std::nullopt;
    index.kinds.push_back(*kind);
  }
  JsonObject tensors;
  if (j.at_key("tensors").get_object().get(tensors) != simdjson::SUCCESS) return std::nullopt;
  for (auto field : tensors) {
    MetadataIndex::Range r{};
    if (!ReadIndexRange(field.value, bytes, &r) || r.begin < index.head_end) return std::nullopt;
    if (!index.tensors.emplace(std::string(field.key), r).second) return std::nullopt;
  }
  return index;
}

std::vector<std::string> SortedNames(std::vector<std::string> names) {
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

// The whole metadata.json, its pieces then kept only for `names`.
Result<CheckpointMetadata> ReadWholeFor(const std::string& checkpoint_dir, const std::vector<std::string>& names,
                                        IoEnv* io, MetadataReadStats* stats) {
  ASSIGN_OR_RETURN(CheckpointMetadata meta, ReadMetadataFile(checkpoint_dir, io));
  if (stats != nullptr) {
    stats->used_index = false;
    stats->bytes_read += stats->metadata_bytes;
  }
  meta.kinds_saved = KindsOfPieces(meta.pieces);
  const std::unordered_set<std::string_view> wanted(names.begin(), names.end());
  meta.pieces.erase(std::remove_if(meta.pieces.begin(), meta.pieces.end(),
                                   [&](const Piece& p) { return wanted.count(p.key) == 0; }),
                    meta.pieces.end());
  meta.partial = true;
  meta.names_read = SortedNames(names);
  return meta;
}

}  // namespace

json EmaRecordToJson(const EmaRecord& e) {
  json ema = {{"decay", e.decay},
              {"interval", e.interval},
              {"init", e.init},
              {"model_params", e.model_params},
              {"updates_applied", e.updates_applied},
              {"updates_skipped", e.updates_skipped},
              {"last_step", e.last_step}};
  if (e.loss_threshold) ema["loss_threshold"] = *e.loss_threshold;
  return ema;
}

Result<EmaRecord> ParseEmaRecord(const JsonElement& e, const std::string& where) {
  JsonObject ema;
  if (e.get_object().get(ema) != simdjson::SUCCESS) return Corruption(where + ": ema is not an object");
  EmaRecord r;
  if (ema.at_key("decay").get_double().get(r.decay) != simdjson::SUCCESS) {
    return Corruption(where + ": ema.decay missing or not a number");
  }
  RETURN_IF_ERROR(JsonU32(ema, "interval", where, &r.interval));
  ASSIGN_OR_RETURN(std::string_view init, JsonString(ema, "init", where));
  r.init = init;
  ASSIGN_OR_RETURN(std::string_view model_params, JsonString(ema, "model_params", where));
  r.model_params = model_params;
  ASSIGN_OR_RETURN(r.updates_applied, JsonU64(ema, "updates_applied", where));
  ASSIGN_OR_RETURN(r.updates_skipped, JsonU64(ema, "updates_skipped", where));
  if (ema.at_key("last_step").get_int64().get(r.last_step) != simdjson::SUCCESS) {
    return Corruption(where + ": ema.last_step missing or not an integer");
  }
  if (JsonElement t; ema.at_key("loss_threshold").get(t) == simdjson::SUCCESS && !t.is_null()) {
    double threshold = 0;
    if (t.get_double().get(threshold) != simdjson::SUCCESS) {
      return Corruption(where + ": ema.loss_threshold is not a number");
    }
    r.loss_threshold = threshold;
  }
  return r;
}

Result<CheckpointMetadata> ParseMetadataJson(std::string_view text) {
  simdjson::dom::parser parser;
  JsonObject j;
  if (auto err = parser.parse(text.data(), text.size()).get_object().get(j); err != simdjson::SUCCESS) {
    return Corruption(std::string("metadata.json is not a JSON object: ") + simdjson::error_message(err));
  }
  CheckpointMetadata meta;
  RETURN_IF_ERROR(ParseHead(j, &meta));
  RETURN_IF_ERROR(ParseTensors(j, &meta));
  return meta;
}

bool HasPiecesOf(const CheckpointMetadata& meta, const std::string& name) {
  return !meta.partial || std::binary_search(meta.names_read.begin(), meta.names_read.end(), name);
}

bool HoldsKind(const CheckpointMetadata& meta, TensorKind kind) {
  if (meta.partial) return std::find(meta.kinds_saved.begin(), meta.kinds_saved.end(), kind) != meta.kinds_saved.end();
  return std::any_of(meta.pieces.begin(), meta.pieces.end(), [&](const Piece& p) { return p.kind == kind; });
}

Result<CheckpointMetadata> ReadMetadataFor(const std::string& checkpoint_dir, const std::vector<std::string>& names,
                                           IoEnv* io, MetadataReadStats* stats) {
  const std::string path = checkpoint_dir + "/metadata.json";
  MetadataReadStats local;
  if (stats == nullptr) stats = &local;
  *stats = MetadataReadStats{};
  ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(path, io));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("fstat", path);
  stats->metadata_bytes = static_cast<uint64_t>(st.st_size);
  if (stats->metadata_bytes > kMaxMetadataJsonBytes) {
    return Corruption(path + " is " + std::to_string(stats->metadata_bytes) + " bytes, more than the " +
                      std::to_string(kMaxMetadataJsonBytes) + " allowed");
  }
  auto index_text = ReadSmallFile(checkpoint_dir + "/" + kMetadataIndexName, kMaxMetadataJsonBytes, io);
  if (!index_text.ok()) {
    // A checkpoint of an earlier release has none.
    if (index_text.status().code() == StatusCode::kNotFound) return ReadWholeFor(checkpoint_dir, names, io, stats);
    return index_text.status();
  }
  stats->bytes_read += index_text->size();
  std::optional<MetadataIndex> index = ParseMetadataIndex(*index_text, stats->metadata_bytes);
  if (!index) return ReadWholeFor(checkpoint_dir, names, io, stats);

  PaddedText text;
  ASSIGN_OR_RETURN(bool head_intact, ReadRange(fd.get(), path, 0, index->head_end, index->head_xxh3, io, &text));
  if (!head_intact) return ReadWholeFor(checkpoint_dir, names, io, stats);
  stats->bytes_read += text.size;
  // The head ends after the files list: closed with a brace it is an object of its own.
  text.bytes[text.size] = '}';
  text.Resize(text.size + 1);
  simdjson::dom::parser parser;
  JsonObject head;
  if (auto err = parser.parse(text.bytes.data(), text.size, false).get_object().get(head); err != simdjson::SUCCESS) {
    return Corruption(path + ": its head is not a JSON object: " + simdjson::error_message(err));
  }
  CheckpointMetadata meta;
  RETURN_IF_ERROR(ParseHead(head, &meta).WithContext(path));
  if (meta.format_version != index->format_version) return ReadWholeFor(checkpoint_dir, names, io, stats);
  meta.partial = true;
  meta.names_read = SortedNames(names);
  meta.kinds_saved = index->kinds;

  // The named tensors' lists, in file order.
  std::vector<std::pair<const std::string*, const MetadataIndex::Range*>> wanted;
  for (const std::string& name : names) {
    auto it = index->tensors.find(name);
    if (it != index->tensors.end()) wanted.emplace_back(&it->first, &it->second);
  }
  std::sort(wanted.begin(), wanted.end(), [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  const FileIndex files = IndexFiles(meta.files);
  for (const auto& [name, range] : wanted) {
    ASSIGN_OR_RETURN(bool intact, ReadRange(fd.get(), path, range->begin, range->end, range->xxh3, io, &text));
    if (!intact) return ReadWholeFor(checkpoint_dir, names, io, stats);
    stats->bytes_read += text.size;
    JsonElement list;
    if (auto err = parser.parse(text.bytes.data(), text.size, false).get(list); err != simdjson::SUCCESS) {
      return Corruption(path + ": the pieces of tensor '" + *name + "' are not JSON: " + simdjson::error_message(err));
    }
    RETURN_IF_ERROR(ParsePieceList(list, *name, files, meta.format_version, &meta.pieces).WithContext(path));
  }
  stats->used_index = true;
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

#include "common/format/node_part.h"

#include <simdjson.h>

#include <nlohmann/json.hpp>
#include <optional>

#include "common/base/names.h"
#include "common/format/checksum.h"
#include "common/format/json_parser.h"
#include "common/format/layout.h"

namespace flashckpt {

namespace {

constexpr std::string_view kPrefix = "node_part_";
constexpr std::string_view kSuffix = ".json";
constexpr std::string_view kFormat = "flashckpt-node-part";

using Object = simdjson::dom::object;
using Element = simdjson::dom::element;

// The fields of an untrusted part; each returns nullopt when the field is missing or of another type.
std::optional<uint64_t> U64(Object o, const char* key) { return JsonField(o, key, JsonUnsigned); }
std::optional<uint32_t> U32(Object o, const char* key) {
  auto v = U64(o, key);
  if (!v || *v > UINT32_MAX) return std::nullopt;
  return static_cast<uint32_t>(*v);
}
std::optional<int64_t> I64(Object o, const char* key) { return JsonField(o, key, JsonInteger); }
std::optional<std::string> Str(Object o, const char* key) { return JsonField(o, key, JsonText); }

bool PlainName(const std::string& n) {
  return !n.empty() && n.find('/') == std::string::npos && n.find('\0') == std::string::npos && n != "." &&
         n != "..";
}

Result<RenderedFile> FileFromJson(Object o, const NodePart& part) {
  RenderedFile f;
  f.job = part.job;
  f.step = part.step;
  auto name = Str(o, "name");
  auto rank = U32(o, "rank");
  auto tp = U32(o, "tp_rank");
  auto pp = U32(o, "pp_rank");
  auto shard = U32(o, "shard_rank");
  auto bytes = U64(o, "bytes");
  auto version = U32(o, "format_version");
  auto world = U32(o, "world_size");
  auto tpd = U32(o, "tp_degree");
  auto ppd = U32(o, "pp_degree");
  auto shardd = U32(o, "shard_degree");
  auto pieces = U64(o, "pieces");
  simdjson::dom::array kinds, tensors;
  if (!name || !rank || !tp || !pp || !shard || !bytes || !version || !world || !tpd || !ppd || !shardd || !pieces ||
      o.at_key("kinds").get_array().get(kinds) != simdjson::SUCCESS ||
      o.at_key("tensors").get_array().get(tensors) != simdjson::SUCCESS) {
    return Corruption("a file entry needs name, rank, tp_rank, pp_rank, shard_rank, bytes, format_version, "
                      "world_size, the degrees, pieces, kinds and tensors");
  }
  if (!PlainName(*name)) return Corruption("file name '" + *name + "' is not a plain name");
  if (*bytes > kMaxCheckpointFileBytes) return Corruption(*name + ": bytes out of range");
  if (*version < static_cast<uint32_t>(kOldestFormatVersion) || *version > static_cast<uint32_t>(kFormatVersion)) {
    return Corruption(*name + ": format_version " + std::to_string(*version) + " is not one this release reads");
  }
  f.file = SavedFile{std::move(*name), *rank, *tp, *pp, *shard, *bytes};
  f.format_version = static_cast<int>(*version);
  f.topology.world_size = *world;
  f.topology.tp_degree = *tpd;
  f.topology.pp_degree = *ppd;
  f.topology.shard_degree = *shardd;
  f.pieces = *pieces;
  for (Element k : kinds) {
    std::string_view text;
    std::optional<TensorKind> kind;
    if (k.get_string().get(text) == simdjson::SUCCESS) kind = ParseTensorKind(text);
    if (!kind) return Corruption(f.file.name + ": a kind is not a tensor kind");
    f.kinds.push_back(*kind);
  }
  for (Element t : tensors) {
    simdjson::dom::array pair;
    std::string_view key, text;
    if (t.get_array().get(pair) != simdjson::SUCCESS || pair.size() != 2 ||
        pair.at(0).get_string().get(key) != simdjson::SUCCESS ||
        pair.at(1).get_string().get(text) != simdjson::SUCCESS || key.empty() || text.empty()) {
      return Corruption(f.file.name + ": a tensors entry is not [name, pieces]");
    }
    f.tensors.emplace_back(std::string(key), std::string(text));
  }
  if (Element ema; o.at_key("ema").get(ema) == simdjson::SUCCESS) {
    ASSIGN_OR_RETURN(f.ema, ParseEmaRecord(ema, f.file.name));
  }
  return f;
}

Result<NodePart> PartFromJson(Object j) {
  NodePart part;
  auto format = Str(j, "format");
  auto job = Str(j, "job");
  auto step = I64(j, "step");
  auto from = I64(j, "resumed_from");
  simdjson::dom::array ranks;
  if (!format || *format != kFormat || !job || !step || !from ||
      j.at_key("ranks").get_array().get(ranks) != simdjson::SUCCESS) {
    return Corruption("not a flashckpt node part: needs format, job, step, resumed_from and ranks");
  }
  if (!ValidateJobName(*job).ok()) return Corruption("not a flashckpt node part: job is not a job name");
  part.job = std::move(*job);
  part.step = *step;
  part.attempt.resumed_from = *from;
  Element run;
  if (j.at_key("run_id").get(run) == simdjson::SUCCESS) {
    auto id = Str(j, "run_id");
    if (!id || !ValidateRunId(*id).ok()) return Corruption("not a flashckpt node part: run_id is not a run id");
    part.attempt.run_id = std::move(*id);
  }
  for (Element r : ranks) {
    Object o;
    simdjson::dom::array files;
    if (r.get_object().get(o) != simdjson::SUCCESS || o.at_key("files").get_array().get(files) != simdjson::SUCCESS) {
      return Corruption("not a flashckpt node part: a ranks entry is not an object with files");
    }
    auto rank = U32(o, "rank");
    auto written = I64(o, "written_us");
    auto inode = U64(o, "signal_inode");
    auto size = U64(o, "signal_size");
    auto mtime = I64(o, "signal_mtime_ns");
    auto ctime = I64(o, "signal_ctime_ns");
    if (!rank || !written || !inode || !size || !mtime || !ctime) {
      return Corruption("not a flashckpt node part: a ranks entry needs rank, written_us, the signal's identity and "
                        "files");
    }
    RankPart rp;
    rp.rank = *rank;
    rp.written_us = *written;
    rp.signal = SignalIdentity{*inode, *size, *mtime, *ctime};
    for (Element f : files) {
      Object fo;
      if (f.get_object().get(fo) != simdjson::SUCCESS) return Corruption("not a flashckpt node part: a file entry is not an object");
      auto file = FileFromJson(fo, part);
      if (!file.ok()) return file.status().WithContext("node part, rank " + std::to_string(rp.rank));
      rp.files.push_back(std::move(*file));
    }
    part.ranks.push_back(std::move(rp));
  }
  return part;
}

}  // namespace

std::string NodePartFileName(const std::string& token) {
  return std::string(kPrefix) + token + std::string(kSuffix);
}

bool IsNodePartFileName(std::string_view name) {
  return name.size() > kPrefix.size() + kSuffix.size() && name.substr(0, kPrefix.size()) == kPrefix &&
         name.substr(name.size() - kSuffix.size()) == kSuffix;
}

std::string EncodeNodePart(const NodePart& part, const std::vector<const RankPart*>* given) {
  std::vector<const RankPart*> own;
  if (given == nullptr) {
    for (const RankPart& r : part.ranks) own.push_back(&r);
  }
  const std::vector<const RankPart*>& parts = given != nullptr ? *given : own;
  nlohmann::ordered_json j = {{"format", kFormat}, {"job", part.job}, {"step", part.step}};
  if (!part.attempt.run_id.empty()) j["run_id"] = part.attempt.run_id;
  j["resumed_from"] = part.attempt.resumed_from;
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (const RankPart* rp : parts) {
    const RankPart& r = *rp;
    nlohmann::ordered_json files = nlohmann::ordered_json::array();
    for (const RenderedFile& f : r.files) {
      nlohmann::ordered_json kinds = nlohmann::ordered_json::array();
      for (TensorKind k : f.kinds) kinds.push_back(std::string(TensorKindName(k)));
      nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
      for (const auto& [key, text] : f.tensors) tensors.push_back({key, text});
      nlohmann::ordered_json fj = {{"name", f.file.name},
                                   {"rank", f.file.rank},
                                   {"tp_rank", f.file.tp_rank},
                                   {"pp_rank", f.file.pp_rank},
                                   {"shard_rank", f.file.shard_rank},
                                   {"bytes", f.file.bytes},
                                   {"format_version", f.format_version},
                                   {"world_size", f.topology.world_size},
                                   {"tp_degree", f.topology.tp_degree},
                                   {"pp_degree", f.topology.pp_degree},
                                   {"shard_degree", f.topology.shard_degree},
                                   {"pieces", f.pieces},
                                   {"kinds", std::move(kinds)},
                                   {"tensors", std::move(tensors)}};
      if (f.ema) fj["ema"] = EmaRecordToJson(*f.ema);
      files.push_back(std::move(fj));
    }
    ranks.push_back({{"rank", r.rank},
                     {"written_us", r.written_us},
                     {"signal_inode", r.signal.inode},
                     {"signal_size", r.signal.size},
                     {"signal_mtime_ns", r.signal.mtime_ns},
                     {"signal_ctime_ns", r.signal.ctime_ns},
                     {"files", std::move(files)}});
  }
  j["ranks"] = std::move(ranks);
  std::string text = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  const std::string sum = ChecksumHex(Xxh3(text.data(), text.size()));
  text += "\nxxh3 ";
  text += sum;
  text += "\n";
  return text;
}

Result<NodePart> ParseNodePart(std::string_view file) {
  // "<json>\nxxh3 <16 hex>\n"
  constexpr std::string_view kSum = "\nxxh3 ";
  constexpr size_t kTrailer = kSum.size() + 16 + 1;
  if (file.size() < kTrailer || file.substr(file.size() - kTrailer, kSum.size()) != kSum ||
      file.back() != '\n') {
    return Corruption("not a flashckpt node part: no checksum line at its end");
  }
  const std::string_view text = file.substr(0, file.size() - kTrailer);
  const std::optional<uint64_t> sum = ParseChecksumHex(file.substr(file.size() - 17, 16));
  if (!sum || *sum != Xxh3(text.data(), text.size())) {
    return Corruption("not a flashckpt node part: its checksum does not match (damaged)");
  }
  return WithJsonParser(text.size(), [&](simdjson::dom::parser& parser) -> Result<NodePart> {
    Object j;
    if (parser.parse(text.data(), text.size()).get_object().get(j) != simdjson::SUCCESS) {
      return Corruption("not a flashckpt node part: not a JSON object");
    }
    return PartFromJson(j);
  });
}

}  // namespace flashckpt

#include "common/format/signal.h"

#include <cstdint>
#include <optional>
#include <set>
#include <string_view>
#include <nlohmann/json.hpp>

#include "common/base/names.h"
#include "common/format/json_parser.h"
#include "common/io/fs.h"

namespace flashckpt {

std::string AttemptText(const Attempt& a) {
  std::string run = "run " + (a.run_id.empty() ? std::string("(no id)") : a.run_id);
  return a.resumed_from > 0 ? run + " resumed from step " + std::to_string(a.resumed_from) : run + " (fresh)";
}

std::string EncodeSignal(const std::string& job, const Signal& s, uint64_t bytes) {
  nlohmann::json j = {{"job", job},       {"rank", s.rank}, {"step", s.step}, {"resumed_from", s.resumed_from},
                      {"files", s.files}, {"bytes", bytes}};
  if (!s.run_id.empty()) j["run_id"] = s.run_id;
  if (!s.node.empty()) j["node"] = s.node;
  if (s.world_size != 0) j["world_size"] = s.world_size;
  if (s.committed_ms > 0) j["committed_ms"] = s.committed_ms;
  if (s.written_us > 0) j["written_us"] = s.written_us;
  if (!s.headers.empty()) {
    nlohmann::json headers = nlohmann::json::array();
    for (const SignalHeader& h : s.headers) {
      headers.push_back(
          {{"file", h.file}, {"header_bytes", h.header_bytes}, {"file_bytes", h.file_bytes}, {"json", h.json}});
    }
    j["headers"] = std::move(headers);
  }
  // Replace, not throw, on invalid UTF-8: the daemon's own names are ASCII, and a header's JSON
  // came through a parser that took it.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

namespace {

Result<Signal> SignalFromJson(simdjson::dom::object j) {
  simdjson::dom::array files;
  const std::optional<uint64_t> rank = JsonField(j, "rank", JsonUnsigned);
  const std::optional<int64_t> step = JsonField(j, "step", JsonInteger);
  const std::optional<int64_t> from = JsonField(j, "resumed_from", JsonInteger);
  if (!rank || !step || !from || j.at_key("files").get_array().get(files) != simdjson::SUCCESS) {
    return Corruption("not a flashckpt signal: needs an unsigned rank, integer step and resumed_from, and files");
  }
  // A rank that only truncates to a valid one (2^32 + 1 -> 1) must not pass for it.
  if (*rank > UINT32_MAX) {
    return Corruption("not a flashckpt signal: rank " + std::to_string(*rank) + " is above 2^32-1");
  }
  Signal s;
  s.rank = static_cast<uint32_t>(*rank);
  s.step = *step;
  s.resumed_from = *from;
  simdjson::dom::element e;
  if (j.at_key("run_id").get(e) == simdjson::SUCCESS) {
    auto run = JsonText(e);
    if (!run || !ValidateRunId(*run).ok()) {
      return Corruption("not a flashckpt signal: run_id is not a run id ([A-Za-z0-9._:-]{1,64})");
    }
    s.run_id = std::move(*run);
  }
  if (j.at_key("node").get(e) == simdjson::SUCCESS) {
    auto node = JsonText(e);
    if (!node || !ValidateNodeName(*node).ok()) {
      return Corruption("not a flashckpt signal: node is not a node name ([A-Za-z0-9._:-]{1,64})");
    }
    s.node = std::move(*node);
  }
  if (j.at_key("world_size").get(e) == simdjson::SUCCESS) {
    auto world = JsonUnsigned(e);
    if (!world || *world == 0 || *world > UINT32_MAX || s.rank >= *world) {
      return Corruption("not a flashckpt signal: world_size is not a count of ranks above the signal's rank");
    }
    s.world_size = static_cast<uint32_t>(*world);
  }
  if (j.at_key("committed_ms").get(e) == simdjson::SUCCESS) {
    auto committed = JsonUnsigned(e);
    if (!committed || *committed > static_cast<uint64_t>(INT64_MAX)) {
      return Corruption("not a flashckpt signal: committed_ms is not a time in ms since the epoch");
    }
    s.committed_ms = static_cast<int64_t>(*committed);
  }
  if (j.at_key("written_us").get(e) == simdjson::SUCCESS) {
    auto written = JsonUnsigned(e);
    if (!written || *written > static_cast<uint64_t>(INT64_MAX)) {
      return Corruption("not a flashckpt signal: written_us is not a time in us since the epoch");
    }
    s.written_us = static_cast<int64_t>(*written);
  }
  for (simdjson::dom::element f : files) {
    auto name = JsonText(f);
    if (!name) return Corruption("not a flashckpt signal: a files entry is not a string");
    // The name is joined to the checkpoint directory: it must name an entry of that directory.
    if (name->empty() || name->find('/') != std::string::npos || name->find('\0') != std::string::npos ||
        *name == "." || *name == "..") {
      return Corruption("not a flashckpt signal: file name '" + *name + "' is not a plain name");
    }
    s.files.push_back(std::move(*name));
  }
  if (j.at_key("headers").get(e) == simdjson::SUCCESS) {
    simdjson::dom::array headers;
    if (e.get_array().get(headers) != simdjson::SUCCESS) {
      return Corruption("not a flashckpt signal: headers is not an array");
    }
    const std::set<std::string_view> listed(s.files.begin(), s.files.end());
    std::set<std::string> recorded;
    for (simdjson::dom::element h : headers) {
      simdjson::dom::object o;
      std::optional<std::string> file, json;
      std::optional<uint64_t> header_bytes, file_bytes;
      if (h.get_object().get(o) == simdjson::SUCCESS) {
        file = JsonField(o, "file", JsonText);
        header_bytes = JsonField(o, "header_bytes", JsonUnsigned);
        file_bytes = JsonField(o, "file_bytes", JsonUnsigned);
        json = JsonField(o, "json", JsonText);
      }
      if (!file || !header_bytes || !file_bytes || !json) {
        return Corruption("not a flashckpt signal: a headers entry needs a file, header_bytes, file_bytes and json");
      }
      SignalHeader r{std::move(*file), *header_bytes, *file_bytes, std::move(*json)};
      if (listed.count(r.file) == 0) {
        return Corruption("not a flashckpt signal: a header is recorded for '" + r.file + "', not one of its files");
      }
      if (!recorded.insert(r.file).second) {
        return Corruption("not a flashckpt signal: the header of '" + r.file + "' is recorded twice");
      }
      if (r.json.size() > r.header_bytes || r.header_bytes > r.file_bytes || r.file_bytes - r.header_bytes < 8) {
        return Corruption("not a flashckpt signal: the header recorded for '" + r.file + "' (" +
                          std::to_string(r.json.size()) + " bytes of json, header_bytes " +
                          std::to_string(r.header_bytes) + ", file_bytes " + std::to_string(r.file_bytes) +
                          ") does not fit its file");
      }
      s.headers.push_back(std::move(r));
    }
  }
  return s;
}

}  // namespace

// simdjson: a completing daemon parses every rank's signal, thousands in a large job.
Result<Signal> ParseSignal(std::string_view text) {
  return WithJsonParser(text.size(), [&](simdjson::dom::parser& parser) -> Result<Signal> {
    simdjson::dom::object j;
    if (parser.parse(text.data(), text.size()).get_object().get(j) != simdjson::SUCCESS) {
      return Corruption("not a flashckpt signal: not a JSON object");
    }
    return SignalFromJson(j);
  });
}

Result<Signal> ReadSignal(const std::string& path, IoEnv* io) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, 1u << 20, io));
  auto signal = ParseSignal(text);
  if (!signal.ok()) return signal.status().WithContext(path);
  return signal;
}

}  // namespace flashckpt

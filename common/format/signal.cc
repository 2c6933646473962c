#include "common/format/signal.h"

#include <cstdint>
#include <nlohmann/json.hpp>

#include "common/base/names.h"
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
  return j.dump() + "\n";
}

Result<Signal> ParseSignal(std::string_view text) {
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Corruption("not a flashckpt signal: not a JSON object");
  auto rank = j.find("rank");
  auto step = j.find("step");
  auto from = j.find("resumed_from");
  auto files = j.find("files");
  if (rank == j.end() || !rank->is_number_unsigned() || step == j.end() || !step->is_number_integer() ||
      from == j.end() || !from->is_number_integer() || files == j.end() || !files->is_array()) {
    return Corruption("not a flashckpt signal: needs an unsigned rank, integer step and resumed_from, and files");
  }
  // get<uint32_t>() would truncate: rank 2^32 + 1 must not pass for rank 1.
  if (rank->get<uint64_t>() > UINT32_MAX) {
    return Corruption("not a flashckpt signal: rank " + std::to_string(rank->get<uint64_t>()) + " is above 2^32-1");
  }
  Signal s;
  s.rank = static_cast<uint32_t>(rank->get<uint64_t>());
  s.step = step->get<int64_t>();
  s.resumed_from = from->get<int64_t>();
  if (auto run = j.find("run_id"); run != j.end()) {
    if (!run->is_string() || !ValidateRunId(run->get<std::string>()).ok()) {
      return Corruption("not a flashckpt signal: run_id is not a run id ([A-Za-z0-9._:-]{1,64})");
    }
    s.run_id = run->get<std::string>();
  }
  if (auto node = j.find("node"); node != j.end()) {
    if (!node->is_string() || !ValidateNodeName(node->get<std::string>()).ok()) {
      return Corruption("not a flashckpt signal: node is not a node name ([A-Za-z0-9._:-]{1,64})");
    }
    s.node = node->get<std::string>();
  }
  if (auto world = j.find("world_size"); world != j.end()) {
    if (!world->is_number_unsigned() || world->get<uint64_t>() == 0 || world->get<uint64_t>() > UINT32_MAX ||
        s.rank >= world->get<uint64_t>()) {
      return Corruption("not a flashckpt signal: world_size is not a count of ranks above the signal's rank");
    }
    s.world_size = static_cast<uint32_t>(world->get<uint64_t>());
  }
  if (auto committed = j.find("committed_ms"); committed != j.end()) {
    if (!committed->is_number_unsigned() || committed->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return Corruption("not a flashckpt signal: committed_ms is not a time in ms since the epoch");
    }
    s.committed_ms = static_cast<int64_t>(committed->get<uint64_t>());
  }
  if (auto written = j.find("written_us"); written != j.end()) {
    if (!written->is_number_unsigned() || written->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return Corruption("not a flashckpt signal: written_us is not a time in us since the epoch");
    }
    s.written_us = static_cast<int64_t>(written->get<uint64_t>());
  }
  for (const auto& f : *files) {
    if (!f.is_string()) return Corruption("not a flashckpt signal: a files entry is not a string");
    std::string name = f.get<std::string>();
    // The name is joined to the checkpoint directory: it must name an entry of that directory.
    if (name.empty() || name.find('/') != std::string::npos || name.find('\0') != std::string::npos ||
        name == "." || name == "..") {
      return Corruption("not a flashckpt signal: file name '" + name + "' is not a plain name");
    }
    s.files.push_back(std::move(name));
  }
  return s;
}

Result<Signal> ReadSignal(const std::string& path, IoEnv* io) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, 1u << 20, io));
  auto signal = ParseSignal(text);
  if (!signal.ok()) return signal.status().WithContext(path);
  return signal;
}

}  // namespace flashckpt

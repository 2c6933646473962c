#include "common/signal.h"

#include <nlohmann/json.hpp>

#include "common/fs.h"

namespace flashckpt {

std::string EncodeSignal(const std::string& job, const Signal& s, uint64_t bytes) {
  nlohmann::json j = {{"job", job},       {"rank", s.rank}, {"step", s.step}, {"resumed_from", s.resumed_from},
                      {"files", s.files}, {"bytes", bytes}};
  return j.dump() + "\n";
}

Result<Signal> ReadSignal(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, 1u << 20));
  auto j = nlohmann::json::parse(text, nullptr, false);
  auto bad = [&] { return Corruption(path + " is not a flashckpt signal"); };
  if (j.is_discarded() || !j.is_object()) return bad();
  auto rank = j.find("rank");
  auto step = j.find("step");
  auto from = j.find("resumed_from");
  auto files = j.find("files");
  if (rank == j.end() || !rank->is_number_unsigned() || step == j.end() || !step->is_number_integer() ||
      from == j.end() || !from->is_number_integer() || files == j.end() || !files->is_array()) {
    return bad();
  }
  Signal s;
  s.rank = rank->get<uint32_t>();
  s.step = step->get<int64_t>();
  s.resumed_from = from->get<int64_t>();
  for (const auto& f : *files) {
    if (!f.is_string()) return bad();
    std::string name = f.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") return bad();
    s.files.push_back(std::move(name));
  }
  return s;
}

}  // namespace flashckpt

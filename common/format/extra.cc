#include "common/format/extra.h"

#include <nlohmann/json.hpp>

namespace flashckpt {
namespace {

constexpr char kBase64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string Base64Encode(const std::string& in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kBase64[(v >> s) & 63];
  }
  if (i < in.size()) {
    uint32_t v = uint8_t(in[i]) << 16;
    if (i + 1 < in.size()) v |= uint8_t(in[i + 1]) << 8;
    out += kBase64[(v >> 18) & 63];
    out += kBase64[(v >> 12) & 63];
    out += i + 1 < in.size() ? kBase64[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

Result<std::string> Base64Decode(const std::string& in) {
  if (in.size() % 4 != 0) return Corruption("extra: base64 length is not a multiple of 4");
  std::string out;
  out.reserve(in.size() / 4 * 3);
  for (size_t i = 0; i < in.size(); i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      char c = in[i + k];
      uint32_t d;
      if (c == '=' && i + 4 == in.size() && k >= 2) {
        d = 0;
        ++pad;
      } else if (c >= 'A' && c <= 'Z')
        d = c - 'A';
      else if (c >= 'a' && c <= 'z')
        d = c - 'a' + 26;
      else if (c >= '0' && c <= '9')
        d = c - '0' + 52;
      else if (c == '+')
        d = 62;
      else if (c == '/')
        d = 63;
      else
        return Corruption("extra: invalid base64 character");
      v = (v << 6) | d;
    }
    out += static_cast<char>((v >> 16) & 0xff);
    if (pad < 2) out += static_cast<char>((v >> 8) & 0xff);
    if (pad < 1) out += static_cast<char>(v & 0xff);
  }
  return out;
}

}  // namespace

std::string EncodeExtra(const std::string& job, uint32_t rank, int64_t step, const std::string& extra) {
  nlohmann::json j = {{"format", "flashckpt-extra"}, {"job", job}, {"rank", rank}, {"step", step}};
  auto parsed = nlohmann::json::parse(extra, nullptr, /*allow_exceptions=*/false);
  if (extra.empty()) {
    j["encoding"] = "none";
    j["data"] = nullptr;
  } else if (!parsed.is_discarded()) {
    j["encoding"] = "json";
    j["data"] = std::move(parsed);
  } else {
    j["encoding"] = "base64";
    j["data"] = Base64Encode(extra);
  }
  return j.dump(1) + "\n";
}

Result<std::string> DecodeExtra(const std::string& file_contents) {
  auto j = nlohmann::json::parse(file_contents, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Corruption("extra file is not a JSON object");
  auto enc = j.find("encoding");
  auto data = j.find("data");
  if (enc == j.end() || !enc->is_string() || data == j.end()) return Corruption("extra file lacks encoding or data");
  const std::string e = enc->get<std::string>();
  if (e == "none") return std::string();
  if (e == "json") return data->dump();
  if (e == "base64" && data->is_string()) return Base64Decode(data->get<std::string>());
  return Corruption("extra file has unknown encoding '" + e + "'");
}

Result<std::string> DecodeExtra(const std::string& file_contents, const std::string& job, uint32_t rank,
                                int64_t step) {
  auto j = nlohmann::json::parse(file_contents, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Corruption("extra file is not a JSON object");
  auto owner = j.find("job");
  auto r = j.find("rank");
  auto s = j.find("step");
  const bool mine = owner != j.end() && owner->is_string() && owner->get<std::string>() == job && r != j.end() &&
                    r->is_number_unsigned() && r->get<uint64_t>() == rank && s != j.end() &&
                    s->is_number_integer() && s->get<int64_t>() == step;
  if (!mine) {
    return Corruption("extra file is not job '" + job + "' rank " + std::to_string(rank) + " step " +
                      std::to_string(step) + "'s (it says job " + (owner != j.end() ? owner->dump() : "?") + " rank " +
                      (r != j.end() ? r->dump() : "?") + " step " + (s != j.end() ? s->dump() : "?") + ")");
  }
  return DecodeExtra(file_contents);
}

}  // namespace flashckpt

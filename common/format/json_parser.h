// A simdjson DOM parser for a document the caller parses and reads at once. Building a parser
// allocates its buffers, sized to the document: a completion parses thousands of small documents
// (signals, safetensors headers) one after another, so small ones reuse the calling thread's
// parser, whose buffers stay allocated at the size of the largest such document. A larger one gets
// a parser of its own, freed afterwards, so what a thread keeps is bounded.
#pragma once

#include <simdjson.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace flashckpt {

// Documents up to this size are parsed by the thread's reused parser.
inline constexpr size_t kReusedJsonParserBytes = 1u << 20;

// Calls f(simdjson::dom::parser&) with a parser for a document of `bytes` bytes, and returns what
// f returns. Whatever f reads from the parsed document must be copied out before it returns; f
// must not parse another document with a parser of this function.
template <typename F>
auto WithJsonParser(size_t bytes, F&& f) {
  if (bytes > kReusedJsonParserBytes) {
    simdjson::dom::parser own;
    return f(own);
  }
  thread_local simdjson::dom::parser reused;
  return f(reused);
}

// Typed values of an untrusted document; nullopt when the value is of another type. simdjson types
// a non-negative integer that fits in int64 as int64: both integer types are integers, and an
// unsigned one is either of them >= 0.
inline std::optional<uint64_t> JsonUnsigned(simdjson::dom::element e) {
  int64_t i = 0;
  uint64_t u = 0;
  if (e.is_int64() && e.get_int64().get(i) == simdjson::SUCCESS && i >= 0) return static_cast<uint64_t>(i);
  if (e.is_uint64() && e.get_uint64().get(u) == simdjson::SUCCESS) return u;
  return std::nullopt;
}
inline std::optional<int64_t> JsonInteger(simdjson::dom::element e) {
  int64_t i = 0;
  if (e.is_int64() && e.get_int64().get(i) == simdjson::SUCCESS) return i;
  return std::nullopt;  // above INT64_MAX, a fraction or not a number
}
inline std::optional<std::string> JsonText(simdjson::dom::element e) {
  std::string_view v;
  if (e.get_string().get(v) != simdjson::SUCCESS) return std::nullopt;
  return std::string(v);
}

// An object's field read by one of the above: nullopt also when the field is missing.
template <typename Read>
auto JsonField(simdjson::dom::object o, const char* key, Read read) -> decltype(read(simdjson::dom::element())) {
  simdjson::dom::element e;
  if (o.at_key(key).get(e) != simdjson::SUCCESS) return std::nullopt;
  return read(e);
}

}  // namespace flashckpt

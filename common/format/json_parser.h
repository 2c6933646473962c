// A simdjson DOM parser for a document the caller parses and reads at once. Building a parser
// allocates its buffers, sized to the document: a completion parses thousands of small documents
// (signals, safetensors headers) one after another, so small ones reuse the calling thread's
// parser, whose buffers stay allocated at the size of the largest such document. A larger one gets
// a parser of its own, freed afterwards, so what a thread keeps is bounded.
#pragma once

#include <simdjson.h>

#include <cstddef>

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

}  // namespace flashckpt

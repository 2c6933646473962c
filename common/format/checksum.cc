#include "common/format/checksum.h"

#include <xxhash.h>

#include <cstdio>

namespace flashckpt {

uint64_t Xxh3(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

Xxh3Stream::Xxh3Stream() : state_(XXH3_createState()) { Reset(); }
Xxh3Stream::~Xxh3Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::Reset() { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::Update(const void* data, size_t bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, bytes);
}
uint64_t Xxh3Stream::Digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

std::string ChecksumHex(uint64_t checksum) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(checksum));
  return std::string(buf, 16);
}

std::optional<uint64_t> ParseChecksumHex(std::string_view hex) {
  if (hex.size() != 16) return std::nullopt;
  uint64_t v = 0;
  for (char c : hex) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else return std::nullopt;
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v;
}

}  // namespace flashckpt

#include "common/format/checksum.h"

#include <xxhash.h>
#if FLASHCKPT_XXH3_DISPATCH
#include <xxh_x86dispatch.h>
#endif

#include <cstdio>

namespace flashckpt {

#if FLASHCKPT_XXH3_DISPATCH
// The same functions, on the widest vector unit this CPU has (libxxhash's x86 dispatcher).
#define FLASHCKPT_XXH3_64(data, bytes) XXH3_64bits_dispatch(data, bytes)
#define FLASHCKPT_XXH3_UPDATE(state, data, bytes) XXH3_64bits_update_dispatch(state, data, bytes)
#else
#define FLASHCKPT_XXH3_64(data, bytes) XXH3_64bits(data, bytes)
#define FLASHCKPT_XXH3_UPDATE(state, data, bytes) XXH3_64bits_update(state, data, bytes)
#endif

uint64_t Xxh3(const void* data, size_t bytes) { return FLASHCKPT_XXH3_64(data, bytes); }

Xxh3Stream::Xxh3Stream() : state_(XXH3_createState()) { Reset(); }
Xxh3Stream::~Xxh3Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::Reset() { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::Update(const void* data, size_t bytes) {
  FLASHCKPT_XXH3_UPDATE(static_cast<XXH3_state_t*>(state_), data, bytes);
}
uint64_t Xxh3Stream::Digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

uint64_t CombineChunkChecksums(const uint64_t* chunks, size_t count, uint64_t bytes) {
  Xxh3Stream hash;
  auto feed = [&hash](uint64_t v) {
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(v >> (8 * i));
    hash.Update(le, sizeof le);
  };
  for (size_t k = 0; k < count; ++k) feed(chunks[k]);
  feed(bytes);
  return hash.Digest();
}

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

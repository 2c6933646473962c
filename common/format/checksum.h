// xxh3-64 checksums and their fixed-width hex form (16 lowercase digits) used in file headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace flashckpt {

uint64_t Xxh3(const void* data, size_t bytes);

// XXH3-64 of data fed in pieces; equal to Xxh3() of their concatenation.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;
  void Reset();
  void Update(const void* data, size_t bytes);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t, kept out of this header
};
std::string ChecksumHex(uint64_t checksum);
// nullopt unless `hex` is exactly 16 hex digits.
std::optional<uint64_t> ParseChecksumHex(std::string_view hex);

}  // namespace flashckpt

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
// The whole-tensor checksum of a tensor that records per-chunk checksums, from format version 2 on:
// the XXH3-64 of its chunks' checksums, each as 8 little-endian bytes in chunk order, followed by
// the tensor's byte length as 8 little-endian bytes. A writer hashes every byte once (for its
// chunk), and a reader verifies a tensor chunk by chunk, on as many threads as it likes, and then
// this cheap function of the chunk list (docs/format.md, "Checksums").
uint64_t CombineChunkChecksums(const uint64_t* chunks, size_t count, uint64_t bytes);

std::string ChecksumHex(uint64_t checksum);
// nullopt unless `hex` is exactly 16 hex digits.
std::optional<uint64_t> ParseChecksumHex(std::string_view hex);

}  // namespace flashckpt

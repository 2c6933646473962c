// xxh3-64 checksums and their fixed-width hex form (16 lowercase digits) used in file headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace flashckpt {

uint64_t Xxh3(const void* data, size_t bytes);
std::string ChecksumHex(uint64_t checksum);
// nullopt unless `hex` is exactly 16 hex digits.
std::optional<uint64_t> ParseChecksumHex(std::string_view hex);

}  // namespace flashckpt

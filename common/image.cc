#include "common/image.h"

#include <cstdio>
#include <cstring>

#include "common/checksum.h"

namespace flashckpt {

void InitSlotImages(char* slot, const RankLayout& layout) {
  for (const auto& image : layout.files) {
    std::memcpy(slot + image.slot_offset, image.header.data(), image.header.size());
  }
}

void StampImage(char* slot, const RankLayout& layout, size_t file, int64_t step) {
  const FileImage& image = layout.files[file];
  char digits[kStepFieldWidth + 1];
  std::snprintf(digits, sizeof digits, "%020lld", static_cast<long long>(step));
  std::memcpy(slot + image.slot_offset + image.step_field, digits, kStepFieldWidth);
  for (size_t t : image.tensors) {
    const Placement& p = layout.placements[t];
    std::string hex = ChecksumHex(Xxh3(slot + p.slot_offset, p.bytes));
    std::memcpy(slot + p.checksum_field, hex.data(), kChecksumFieldWidth);
  }
}

}  // namespace flashckpt

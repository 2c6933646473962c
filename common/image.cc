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

void StampStep(char* slot, const RankLayout& layout, size_t file, int64_t step) {
  const FileImage& image = layout.files[file];
  char digits[kStepFieldWidth + 1];
  std::snprintf(digits, sizeof digits, "%020lld", static_cast<long long>(step));
  std::memcpy(slot + image.slot_offset + image.step_field, digits, kStepFieldWidth);
}

void StampChecksum(char* slot, const RankLayout& layout, size_t tensor) {
  const Placement& p = layout.placements[tensor];
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(Xxh3(slot + p.slot_offset, p.bytes)));
  std::memcpy(slot + p.checksum_field, hex, kChecksumFieldWidth);
}

void StampImage(char* slot, const RankLayout& layout, size_t file, int64_t step) {
  StampStep(slot, layout, file, step);
  for (size_t t : layout.files[file].tensors) StampChecksum(slot, layout, t);
}

}  // namespace flashckpt

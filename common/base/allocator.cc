#include "common/base/allocator.h"

#include <malloc.h>

namespace flashckpt {

bool KeepMessageBuffersInHeap() {
  // Setting either turns off glibc's sliding mmap threshold; both are needed (with only one, the
  // blocks are still mapped each time, or the heap is still trimmed after each).
  const bool heap = mallopt(M_MMAP_THRESHOLD, static_cast<int>(kHeapBlockBytes)) == 1;
  const bool kept = mallopt(M_TRIM_THRESHOLD, static_cast<int>(kKeptFreeBytes)) == 1;
  return heap && kept;
}

}  // namespace flashckpt

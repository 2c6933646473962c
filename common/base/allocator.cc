#include "common/base/allocator.h"

#include <malloc.h>

#include <cstdlib>
#include <cstring>

namespace flashckpt {
namespace {

// The sanitizers bring their own allocator, which ignores mallopt.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizerAllocator = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
constexpr bool kSanitizerAllocator = true;
#else
constexpr bool kSanitizerAllocator = false;
#endif
#else
constexpr bool kSanitizerAllocator = false;
#endif

// An operator's own setting of a threshold or of the arenas (glibc's environment variables or
// tunables) wins.
bool SetByOperator() {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr || std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_ARENA_MAX") != nullptr) {
    return true;
  }
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  return tunables != nullptr &&
         (std::strstr(tunables, "mmap_threshold") != nullptr || std::strstr(tunables, "trim_threshold") != nullptr ||
          std::strstr(tunables, "arena_max") != nullptr);
}

}  // namespace

AllocatorSetting KeepMessageBuffersInHeap() {
  if (kSanitizerAllocator) return AllocatorSetting::kSanitizer;
  if (SetByOperator()) return AllocatorSetting::kOperator;
  // Setting either turns off glibc's sliding mmap threshold; both are needed (with only one, the
  // blocks are still mapped each time, or the heap is still trimmed after each).
  const bool heap = mallopt(M_MMAP_THRESHOLD, static_cast<int>(kHeapBlockBytes)) == 1;
  const bool kept = mallopt(M_TRIM_THRESHOLD, static_cast<int>(kKeptFreeBytes)) == 1;
  const bool arenas = mallopt(M_ARENA_MAX, kArenas) == 1;
  return heap && kept && arenas ? AllocatorSetting::kSet : AllocatorSetting::kRefused;
}

const char* AllocatorSettingName(AllocatorSetting s) {
  switch (s) {
    case AllocatorSetting::kSet: return "set";
    case AllocatorSetting::kOperator: return "left to MALLOC_*_THRESHOLD_ or GLIBC_TUNABLES";
    case AllocatorSetting::kSanitizer: return "left to the sanitizer's allocator";
    case AllocatorSetting::kRefused: return "refused by the allocator";
  }
  return "unknown";
}

}  // namespace flashckpt

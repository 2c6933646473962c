#pragma once
// The process's allocator, set for streams of large messages.
//
// gRPC and protobuf allocate each large message (a 1 MiB replica part, a chunk of a resumed
// tensor) and free it when the next one comes. With glibc's defaults such a block is mapped and
// unmapped, or the top of the heap is given back after it, so every message faults its pages in
// again: page faults took more of a replica push's time than the copies did (bench/replica_bench,
// docs/PERFORMANCE.md). KeepMessageBuffersInHeap serves blocks up to kHeapBlockBytes from the heap
// and lets each arena keep up to kKeptFreeBytes of freed memory at its top for the next message.

#include <cstddef>

namespace flashckpt {

// Above the largest replica part (4 MiB) with its framing.
constexpr size_t kHeapBlockBytes = 8u << 20;
// Per arena: a few messages in flight.
constexpr size_t kKeptFreeBytes = 16u << 20;

// The heap keeps what the busiest moment needed, up to kHeapBlockBytes a block: freed blocks are
// reused by the next messages, and each arena gives its top back beyond kKeptFreeBytes.

enum class AllocatorSetting {
  kSet,        // both thresholds set
  kOperator,   // left alone: MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES set one
  kSanitizer,  // left alone: a sanitizer's allocator, which ignores them
  kRefused,    // mallopt refused one
};

// Call once, at the start of main, before threads start.
AllocatorSetting KeepMessageBuffersInHeap();
const char* AllocatorSettingName(AllocatorSetting s);

}  // namespace flashckpt

#pragma once
// The process's allocator, set for streams of large messages.
//
// gRPC and protobuf allocate each large message (a 1 MiB replica part, a chunk of a resumed
// tensor) and free it when the next one comes. With glibc's defaults such a block is mapped and
// unmapped, or the top of the heap is given back after it, so every message faults its pages in
// again: page faults took more of a replica push's time than the copies did (bench/replica_bench,
// docs/PERFORMANCE.md). KeepMessageBuffersInHeap serves blocks up to kHeapBlockBytes from the heap,
// lets each arena keep up to kKeptFreeBytes of freed memory at its top for the next message, and
// holds the process to kArenas arenas, which bounds the freed memory kept at the arenas' tops
// (kArenas x kKeptFreeBytes, 128 MiB) on a machine of many cores (glibc's default: 8 arenas a core).

#include <cstddef>

namespace flashckpt {

// Above the largest messages gRPC allocates on a stream of parts (8 MiB and a page, seen with
// strace in a replica push: with an 8 MiB threshold each was mapped and unmapped).
constexpr size_t kHeapBlockBytes = 32u << 20;
// Per arena: several messages of several streams in flight (16 MiB trimmed its heap dozens of
// times a push, MADV_DONTNEED each time).
constexpr size_t kKeptFreeBytes = 32u << 20;
// Small allocations do not contend on the arenas' locks: glibc gives each thread a cache of them.
constexpr int kArenas = 4;

enum class AllocatorSetting {
  kSet,        // both thresholds and the arenas set
  kOperator,   // left alone: MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_ARENA_MAX or
               // GLIBC_TUNABLES set one
  kSanitizer,  // left alone: a sanitizer's allocator, which ignores them
  kRefused,    // mallopt refused one
};

// Call once, at the start of main, before threads start.
AllocatorSetting KeepMessageBuffersInHeap();
const char* AllocatorSettingName(AllocatorSetting s);

}  // namespace flashckpt

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

// Call once, at the start of main, before threads start. Returns false if glibc refused a setting.
bool KeepMessageBuffersInHeap();

}  // namespace flashckpt

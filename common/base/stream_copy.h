// memcpy with non-temporal stores, for a destination that is not read back soon (a slot the trainer
// restores from later, a replica held for a peer): its lines are not pulled into the cache only to be
// overwritten, which halves the memory traffic of a large copy. x86-64 uses SSE2's streaming stores
// (every such CPU has them); elsewhere it is memcpy.
#pragma once

#include <cstddef>

namespace flashckpt {

// Copies `bytes` from `src` to `dst` (not overlapping). Call StreamFence before the bytes are handed
// to another thread or read as data by this one.
void StreamCopy(char* dst, const char* src, size_t bytes);
// Orders the streaming stores before what follows.
void StreamFence();

}  // namespace flashckpt

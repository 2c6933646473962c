#include "common/base/stream_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace flashckpt {

void StreamCopy(char* dst, const char* src, size_t bytes) {
#if defined(__x86_64__)
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  size_t at = head;
  for (; at + 64 <= bytes; at += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at + 48), d);
  }
  std::memcpy(dst + at, src + at, bytes - at);
#else
  std::memcpy(dst, src, bytes);
#endif
}

void StreamFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace flashckpt

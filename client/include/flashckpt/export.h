// FLASHCKPT_API marks what libflashckpt.so exports: the public API of the headers in flashckpt/.
// The library is built with hidden visibility, so everything else in it (the gRPC and protobuf
// code it links, its internals) stays private to it; FLASHCKPT_HIDDEN keeps the private parts of an
// exported class (its pimpl) private too.
#pragma once

#if defined(__GNUC__) || defined(__clang__)
#define FLASHCKPT_API [[gnu::visibility("default")]]
#define FLASHCKPT_HIDDEN [[gnu::visibility("hidden")]]
#else
#define FLASHCKPT_API
#define FLASHCKPT_HIDDEN
#endif

// Clang thread-safety annotations (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html).
//
// `GUARDED_BY(mu_)` on a member says which mutex protects it; `REQUIRES(mu_)` on a method says its
// caller holds it; `EXCLUDES(mu_)` that it must not. Clang checks them with -Wthread-safety (the
// clang pass of scripts/test.sh builds with it and -Werror); other compilers ignore them. Use them
// with flashckpt::Mutex (common/mutex.h): std::mutex carries no annotations.
#pragma once

#if defined(__clang__)
#define FLASHCKPT_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define FLASHCKPT_THREAD_ANNOTATION(x)
#endif

// gRPC's headers bring Abseil's legacy unprefixed macros (absl/base/internal/thread_annotations.h:
// GUARDED_BY, PT_GUARDED_BY, ACQUIRED_BEFORE/AFTER, NO_THREAD_SAFETY_ANALYSIS), which expand to the
// same attributes; a name defined already is kept rather than redefined.
#ifndef CAPABILITY
#define CAPABILITY(x) FLASHCKPT_THREAD_ANNOTATION(capability(x))
#endif
#ifndef SCOPED_CAPABILITY
#define SCOPED_CAPABILITY FLASHCKPT_THREAD_ANNOTATION(scoped_lockable)
#endif
#ifndef GUARDED_BY
#define GUARDED_BY(x) FLASHCKPT_THREAD_ANNOTATION(guarded_by(x))
#endif
#ifndef PT_GUARDED_BY
#define PT_GUARDED_BY(x) FLASHCKPT_THREAD_ANNOTATION(pt_guarded_by(x))
#endif
#ifndef ACQUIRED_BEFORE
#define ACQUIRED_BEFORE(...) FLASHCKPT_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#endif
#ifndef ACQUIRED_AFTER
#define ACQUIRED_AFTER(...) FLASHCKPT_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#endif
#ifndef REQUIRES
#define REQUIRES(...) FLASHCKPT_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#endif
#ifndef ACQUIRE
#define ACQUIRE(...) FLASHCKPT_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#endif
#ifndef RELEASE
#define RELEASE(...) FLASHCKPT_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#endif
#ifndef TRY_ACQUIRE
#define TRY_ACQUIRE(...) FLASHCKPT_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#endif
#ifndef EXCLUDES
#define EXCLUDES(...) FLASHCKPT_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#endif
#ifndef ASSERT_CAPABILITY
#define ASSERT_CAPABILITY(x) FLASHCKPT_THREAD_ANNOTATION(assert_capability(x))
#endif
#ifndef RETURN_CAPABILITY
#define RETURN_CAPABILITY(x) FLASHCKPT_THREAD_ANNOTATION(lock_returned(x))
#endif
#ifndef NO_THREAD_SAFETY_ANALYSIS
#define NO_THREAD_SAFETY_ANALYSIS FLASHCKPT_THREAD_ANNOTATION(no_thread_safety_analysis)
#endif

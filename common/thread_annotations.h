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

#define CAPABILITY(x) FLASHCKPT_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY FLASHCKPT_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) FLASHCKPT_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) FLASHCKPT_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) FLASHCKPT_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) FLASHCKPT_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) FLASHCKPT_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) FLASHCKPT_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) FLASHCKPT_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) FLASHCKPT_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) FLASHCKPT_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) FLASHCKPT_THREAD_ANNOTATION(assert_capability(x))
#define RETURN_CAPABILITY(x) FLASHCKPT_THREAD_ANNOTATION(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS FLASHCKPT_THREAD_ANNOTATION(no_thread_safety_analysis)

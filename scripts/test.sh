#!/usr/bin/env bash
# Builds flashckpt and runs every test, twice:
#   1. build/       RelWithDebInfo, warnings are errors
#   2. build-asan/  Debug with AddressSanitizer + UndefinedBehaviorSanitizer
#                   (skipped when FLASHCKPT_SKIP_SANITIZERS=1)
# Exits with ctest's status: the first failing pass stops the script. Works from any directory.
# FLASHCKPT_JOBS overrides the build parallelism (default: nproc).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

JOBS="${FLASHCKPT_JOBS:-$(nproc)}"
section() { printf '\n==== %s (%ds elapsed)\n' "$*" "$SECONDS"; }

section "dependencies"
./scripts/deps.sh

section "build/ : RelWithDebInfo, -Werror"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHCKPT_WERROR=ON
cmake --build build -j"$JOBS"

section "tests in build/"
rc=0
ctest --test-dir build --output-on-failure || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "test.sh: tests failed in build/ (ctest exit $rc)" >&2
  exit "$rc"
fi

if [ "${FLASHCKPT_SKIP_SANITIZERS:-0}" = "1" ]; then
  section "sanitizer pass skipped (FLASHCKPT_SKIP_SANITIZERS=1)"
  exit 0
fi

section "build-asan/ : Debug, address;undefined"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFLASHCKPT_SANITIZE="address;undefined"
cmake --build build-asan -j"$JOBS"

section "tests in build-asan/"
# Leak checks on, stacks for UBSan findings (-fno-sanitize-recover already stops at the first); the
# caller's own settings win.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
ctest --test-dir build-asan --output-on-failure || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "test.sh: tests failed in build-asan/ (ctest exit $rc)" >&2
  exit "$rc"
fi

section "all tests passed"

#!/usr/bin/env bash
# Builds flashckpt and runs its tests in four passes (after checking that the default CMake
# generator builds the protocol, in build-make/):
#   1. build/       RelWithDebInfo, warnings are errors: every test
#   2. build-asan/  Debug with AddressSanitizer + UndefinedBehaviorSanitizer: every test
#   3. build-fuzz/  clang, libFuzzer + ASan + UBSan, warnings (-Wthread-safety too) are errors:
#                   the daemon, client and CLI compile (their lock annotations checked), and each
#                   fuzz target of tests/fuzz runs for FLASHCKPT_FUZZ_SECONDS (default 30) from
#                   generated seeds (skipped when FLASHCKPT_SKIP_FUZZ=1)
#   4. build-tsan/  Debug with ThreadSanitizer: the tests labelled `threads` (those that
#                   run work on several threads without gRPC; skipped when FLASHCKPT_SKIP_TSAN=1)
# FLASHCKPT_SKIP_SANITIZERS=1 skips passes 2 to 4. Exits with ctest's status: the first failing pass
# stops the script. Works from any directory. FLASHCKPT_JOBS overrides the build parallelism
# (default: nproc); FLASHCKPT_TEST_JOBS the number of tests ctest runs at once (default: twice nproc,
# at least 4: most tests wait on processes and files more than they compute; tests that cannot share
# the machine say so with RESOURCE_LOCK, PROCESSORS or RUN_SERIAL in their CMakeLists.txt).
# The script ends, passing or failing, with where the time went: each pass's build and test seconds,
# the 15 slowest tests, and a last line `RESULT ci_seconds=N`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

JOBS="${FLASHCKPT_JOBS:-$(nproc)}"
TEST_JOBS="${FLASHCKPT_TEST_JOBS:-$(( $(nproc) * 2 > 4 ? $(nproc) * 2 : 4 ))}"
section() { printf '\n==== %s (%ds elapsed)\n' "$*" "$SECONDS"; }

# Where the time goes: one "<pass> <build|test> <seconds>" line per step, and each pass's ctest
# output (the slowest tests are read from it).
TIMES="$(mktemp)"
CTEST_LOGS=()
# Runs "$@" and records its seconds as step $2 of pass $1.
timed() {
  local pass=$1 step=$2 t0=$SECONDS rc=0
  shift 2
  "$@" || rc=$?
  printf '%s %s %d\n' "$pass" "$step" $((SECONDS - t0)) >>"$TIMES"
  return "$rc"
}
# Runs ctest in build folder $2 for pass $1, $3 tests at once, with the extra arguments after them;
# its output is shown and kept in <folder>/ctest-output.log.
run_tests() {
  local pass=$1 dir=$2 jobs=$3
  shift 3
  CTEST_LOGS+=("$pass:$dir/ctest-output.log")
  timed "$pass" test bash -c 'set -o pipefail; ctest --test-dir "$1" -j"$2" --output-on-failure "${@:4}" 2>&1 | tee "$3"' \
    _ "$dir" "$jobs" "$dir/ctest-output.log" "$@"
}
summary() {
  local rc=$?
  # What follows must not end the script early (a `head` closing its pipe is not a failure).
  set +e +o pipefail
  printf '\n==== where the time went\n'
  printf '%-12s %8s %8s\n' pass build_s test_s
  awk '{ if (!($1 in seen)) { seen[$1] = 1; order[n++] = $1 } t[$1 " " $2] += $3 }
       END { for (i = 0; i < n; i++) { p = order[i]
               printf "%-12s %8s %8s\n", p, (p " build" in t) ? t[p " build"] : "-", (p " test" in t) ? t[p " test"] : "-" } }' "$TIMES"
  if [ "${#CTEST_LOGS[@]}" -gt 0 ]; then
    printf '\nslowest tests (seconds, pass, test):\n'
    local entry
    for entry in "${CTEST_LOGS[@]}"; do
      [ -f "${entry#*:}" ] || continue
      sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) .* ([0-9]+\.[0-9]+) sec$/\2 \1/p' "${entry#*:}" |
        awk -v pass="${entry%%:*}" '{ printf "%8.1f  %-11s %s\n", $1, pass, $2 }'
    done | sort -rn | head -15
  fi
  rm -f "$TIMES"
  printf 'RESULT ci_seconds=%d\n' "$SECONDS"
  exit "$rc"
}
trap summary EXIT

section "dependencies"
./scripts/deps.sh

# Every compiler call goes through ccache, keyed on paths relative to the checkout and not on the
# build folder's name: a fresh clone elsewhere on this machine reuses what earlier builds compiled.
# What is compiled and every flag stay the same (warnings are errors still: a failing compile is
# never cached). FLASHCKPT_NO_CCACHE=1 turns it off.
if [ "${FLASHCKPT_NO_CCACHE:-0}" != "1" ] && command -v ccache >/dev/null; then
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-20G}"
fi

section "build-make/ : the default generator (Unix Makefiles) configures and builds the protocol"
# The passes below use Ninja; users often do not. Protocol generation is where the generators differ.
cmake -S . -B build-make -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHCKPT_WITH_CUDA=OFF >/dev/null
timed build-make build cmake --build build-make --target flashckpt_proto -j"$JOBS"

section "build/ : RelWithDebInfo, -Werror"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHCKPT_WERROR=ON
timed build build cmake --build build -j"$JOBS"

section "tests in build/ ($TEST_JOBS at once)"
rc=0
run_tests build build "$TEST_JOBS" || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "test.sh: tests failed in build/ (ctest exit $rc)" >&2
  exit "$rc"
fi

if [ "${FLASHCKPT_SKIP_SANITIZERS:-0}" = "1" ]; then
  section "sanitizer passes skipped (FLASHCKPT_SKIP_SANITIZERS=1)"
  exit 0
fi

section "build-asan/ : Debug, address;undefined"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFLASHCKPT_SANITIZE="address;undefined"
timed build-asan build cmake --build build-asan -j"$JOBS"

section "tests in build-asan/ ($TEST_JOBS at once)"
# Leak checks on, stacks for UBSan findings (-fno-sanitize-recover already stops at the first); the
# caller's own settings win.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
run_tests build-asan build-asan "$TEST_JOBS" || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "test.sh: tests failed in build-asan/ (ctest exit $rc)" >&2
  exit "$rc"
fi

if [ "${FLASHCKPT_SKIP_FUZZ:-0}" = "1" ]; then
  section "fuzz pass skipped (FLASHCKPT_SKIP_FUZZ=1)"
else
  section "build-fuzz/ : clang, libFuzzer + address;undefined, -Wthread-safety -Werror"
  # The fuzz targets and the seed generator (tests/fuzz/CMakeLists.txt), and the daemon, the client
  # library and the CLI: clang checks their lock annotations (common/base/thread_annotations.h).
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHCKPT_FUZZ=ON \
    -DFLASHCKPT_WERROR=ON -DFLASHCKPT_FUZZ_SECONDS="${FLASHCKPT_FUZZ_SECONDS:-30}"
  timed build-fuzz build cmake --build build-fuzz -j"$JOBS" --target fuzzers flashckpt_daemon flashckpt_client flashckpt

  section "fuzz targets in build-fuzz/ (${FLASHCKPT_FUZZ_SECONDS:-30}s each, $(nproc) at once)"
  # A crash fails the target's test; its input is saved under build-fuzz/fuzz/crashes/. Each target
  # keeps one core busy for its whole time, so as many run at once as there are cores.
  run_tests build-fuzz build-fuzz "$(nproc)" -L fuzz || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "test.sh: fuzzing failed in build-fuzz/ (ctest exit $rc); inputs in build-fuzz/fuzz/crashes/" >&2
    exit "$rc"
  fi
fi

if [ "${FLASHCKPT_SKIP_TSAN:-0}" = "1" ]; then
  section "thread sanitizer pass skipped (FLASHCKPT_SKIP_TSAN=1)"
else
  section "build-tsan/ : Debug, thread"
  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFLASHCKPT_SANITIZE=thread
  timed build-tsan build cmake --build build-tsan -j"$JOBS" --target threaded_tests

  section "tests labelled threads in build-tsan/"
  # A race makes the test exit 66 with both stacks printed; no suppressions.
  TSAN_OPTIONS="${TSAN_OPTIONS:-second_deadlock_stack=1}" \
    run_tests build-tsan build-tsan "$TEST_JOBS" -L threads || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "test.sh: tests failed under ThreadSanitizer in build-tsan/ (ctest exit $rc)" >&2
    exit "$rc"
  fi
fi

section "all tests passed"

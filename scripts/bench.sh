#!/usr/bin/env bash
# Builds the benchmarks in a Release build (build-release/, tests off) and runs them.
#
#   scripts/bench.sh                              every benchmark, default sizes
#   scripts/bench.sh -- --bytes 256MiB            every benchmark, these arguments to each
#   scripts/bench.sh ema_bench -- --bytes 256MiB  only the named ones
#
# The benchmarks are the FLASHCKPT_BENCHMARKS list of bench/CMakeLists.txt, which CMake writes to
# build-release/bench/benchmarks.txt; a new benchmark is added there only. Each prints its own table, measured against a limit taken in the same run. Exits
# with the first failing benchmark's status. FLASHCKPT_JOBS overrides the build parallelism.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

JOBS="${FLASHCKPT_JOBS:-$(nproc)}"
BUILD=build-release
section() { printf '\n==== %s (%ds elapsed)\n' "$*" "$SECONDS"; }

names=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  names+=("$1")
  shift
done
[ "${1:-}" = "--" ] && shift
args=("$@")

section "dependencies"
./scripts/deps.sh

section "$BUILD/ : Release, tests off"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCKPT_BUILD_TESTS=OFF >/dev/null
if [ ${#names[@]} -eq 0 ]; then
  # The list CMake wrote, so that this script never needs editing for a new benchmark.
  mapfile -t names < "$BUILD/bench/benchmarks.txt"
fi
cmake --build "$BUILD" -j"$JOBS" --target "${names[@]}"

for name in "${names[@]}"; do
  section "$name ${args[*]:-}"
  "$BUILD/bin/$name" "${args[@]}"
done
section "done"

#!/usr/bin/env bash
# Builds the benchmarks in a Release build (build-release/, tests off), runs them (and, with
# PyTorch installed, bench/torch_save_bench.py, bench/torch_ddp_bench.py and bench/torch_memory_bench.py), then prints one
# table of their headline ratios.
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
explicit=()
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
explicit=("${names[@]}")
if [ ${#names[@]} -eq 0 ]; then
  # The list CMake wrote, so that this script never needs editing for a new benchmark.
  mapfile -t names < "$BUILD/bench/benchmarks.txt"
fi
cmake --build "$BUILD" -j"$JOBS" --target "${names[@]}"

# Every benchmark's output also goes to a log, from which the headline rows (SUMMARY lines) are
# gathered into one table at the end.
LOG="$(mktemp /tmp/flashckpt-bench-XXXXXX.log)"
trap 'rm -f "$LOG"' EXIT
for name in "${names[@]}"; do
  section "$name ${args[*]:-}"
  "$BUILD/bin/$name" "${args[@]}" | tee -a "$LOG" | grep -v '^SUMMARY'
done

# Row 5, against peers: torch.save and a plain writer, and a 4-process DDP job's save, with Debian's PyTorch (when it is there and
# no benchmark was named).
if [ ${#explicit[@]} -eq 0 ] && /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  cmake --build "$BUILD" -j"$JOBS" --target flashckptd flashckpt_python >/dev/null
  section "bench/torch_save_bench.py"
  /usr/bin/python3 bench/torch_save_bench.py --bin-dir "$BUILD/bin" --python-dir "$BUILD/python" \
    | tee -a "$LOG" | grep -v '^SUMMARY'
  section "bench/torch_ddp_bench.py"
  /usr/bin/python3 bench/torch_ddp_bench.py --bin-dir "$BUILD/bin" --python-dir "$BUILD/python" \
    | tee -a "$LOG" | grep -v '^SUMMARY'
  section "bench/torch_memory_bench.py"
  /usr/bin/python3 bench/torch_memory_bench.py --bin-dir "$BUILD/bin" --python-dir "$BUILD/python" \
    | tee -a "$LOG" | grep -v '^SUMMARY'
fi

section "summary: each row a ratio measured in the same run (docs/PERFORMANCE.md explains them)"
printf '%-58s %9s %11s  %s\n' "row" "ratio" "target" ""
grep '^SUMMARY' "$LOG" | sort -t$'\t' -k2,2 -s | while IFS=$'\t' read -r _ row ratio target verdict; do
  printf '%-58s %9s %11s  %s\n' "$row" "$ratio" "$target" "$verdict"
done
section "done"

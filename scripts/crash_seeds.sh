#!/usr/bin/env bash
# Runs the seeded crash tests many times (outside CI, which runs each once with a fresh seed):
#   scripts/crash_seeds.sh [BUILD_DIR] [RUNS] [SIDES]
# BUILD_DIR defaults to build-asan (the sanitizer build, where timing is tightest), RUNS to 50,
# SIDES to "daemon trainer". Each run gets a fresh random seed (printed by the test); a failing
# run's output is kept in $OUT_DIR (default /tmp/flashckpt-crash-seeds) as <side>.<n>.log. Prints
# one line per run and, per side, the failures and the slowest run; exits 1 when any run failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD="${1:-build-asan}"
RUNS="${2:-50}"
SIDES="${3:-daemon trainer}"
OUT_DIR="${OUT_DIR:-/tmp/flashckpt-crash-seeds}"
mkdir -p "$OUT_DIR"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"

status=0
for side in $SIDES; do
  failed=0 slowest=0
  for n in $(seq 1 "$RUNS"); do
    log="$OUT_DIR/$side.$n.log"
    begun=$SECONDS
    if /usr/bin/python3 tests/integration/test_crash_points.py --bin-dir "$BUILD/bin" --side "$side" \
        --kills 24 >"$log" 2>&1; then
      result=passed
    else
      result="FAILED (log: $log)"
      failed=$((failed + 1))
    fi
    secs=$((SECONDS - begun))
    [ "$secs" -gt "$slowest" ] && slowest=$secs
    seed=$(grep -m1 -o 'seed=[0-9]*' "$log" || true)
    start=$(grep -m1 -o 'slowest_start_secs=[0-9.]*' "$log" || true)
    [ "$result" = passed ] && rm -f "$log"
    echo "$side run $n/$RUNS: $result in ${secs}s $seed $start"
  done
  echo "SUMMARY side=$side runs=$RUNS failed=$failed slowest_secs=$slowest"
  [ "$failed" -eq 0 ] || status=1
done
exit "$status"

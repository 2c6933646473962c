#!/usr/bin/env bash
# The flashckpt demo: a two-rank simulated trainer checkpoints through a real flashckptd, one rank is
# SIGKILLed mid-run, the operator CLI shows what is on disk, both ranks resume from the newest
# complete checkpoint, and `flashckpt verify` checks it. Everything lives in a temporary folder
# that is removed on exit (FLASHCKPT_DEMO_KEEP=1 keeps it); the daemon is always stopped.
# FLASHCKPT_BIN_DIR=<dir> runs binaries from <dir> (e.g. /usr/local/bin) instead of building build/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$(pwd)"
BIN="${FLASHCKPT_BIN_DIR:-$REPO/build/bin}"

if [ -t 1 ]; then BOLD=$'\033[1m' PLAIN=$'\033[0m'; else BOLD="" PLAIN=""; fi
heading() { printf '\n%s== %s%s\n' "$BOLD" "$*" "$PLAIN"; }
note() { printf '   %s\n' "$*"; }
die() { printf 'demo: %s\n' "$*" >&2; exit 1; }
indent() { sed "s/^/   $1/"; }

# Waits up to $2 seconds for process $1 to exit; returns its exit status (124 on timeout).
wait_pid() {
  local pid=$1 deadline=$((SECONDS + $2))
  while kill -0 "$pid" 2>/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || return 124
    sleep 0.1
  done
  wait "$pid"
}

# Waits up to $2 seconds for file $1; fails early if process $3 (when given) has exited.
wait_file() {
  local path=$1 deadline=$((SECONDS + $2)) pid=${3:-}
  until [ -e "$path" ]; do
    [ "$SECONDS" -lt "$deadline" ] || die "timed out waiting for $path"
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then die "process $pid exited while waiting for $path"; fi
    sleep 0.05
  done
}

if [ -z "${FLASHCKPT_BIN_DIR:-}" ]; then
  heading "Building flashckpt (build/, RelWithDebInfo)"
  ./scripts/deps.sh
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build -j"$(nproc)"
fi
for b in flashckptd flashckpt-sim flashckpt; do
  [ -x "$BIN/$b" ] || die "$BIN/$b was not built"
done

# /tmp rather than $TMPDIR: a UNIX socket path must stay under 108 bytes.
TMP="$(mktemp -d /tmp/flashckpt-demo.XXXXXX)"
SOCK="$TMP/flashckptd.sock"
ROOT="$TMP/root"
JOB=demo
JOB_DIR="$ROOT/$JOB"
DAEMON_PID=""
SIM_PIDS=()

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for pid in ${SIM_PIDS[@]+"${SIM_PIDS[@]}"}; do kill -9 "$pid" 2>/dev/null || true; done
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -TERM "$DAEMON_PID" 2>/dev/null || true
    wait_pid "$DAEMON_PID" 15 >/dev/null 2>&1 || true
    kill -9 "$DAEMON_PID" 2>/dev/null || true
  fi
  if [ "$rc" -ne 0 ] && [ -f "$TMP/flashckptd.log" ]; then
    printf '\ndemo failed (exit %d); last daemon log lines:\n' "$rc" >&2
    tail -n 20 "$TMP/flashckptd.log" >&2 || true
  fi
  if [ "${FLASHCKPT_DEMO_KEEP:-0}" = "1" ]; then
    printf '\nkept %s (daemon log, rank logs, checkpoints)\n' "$TMP"
  else
    rm -rf "$TMP"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

sim() {  # sim <rank> <log> [extra flags...]: starts one simulated rank in the background
  local rank=$1 log=$2
  shift 2
  "$BIN/flashckpt-sim" --socket "$SOCK" --job "$JOB" --rank "$rank" --world-size 2 --tp-degree 2 \
    --layers 4 --hidden 256 --steps 40 --save-every 10 --step-ms 50 "$@" >"$log" 2>&1 &
  SIM_PIDS+=($!)
}

heading "1. Start flashckptd: one daemon per node, owning the host shared memory"
note "socket $SOCK, root $ROOT, host-memory budget 1 GiB"
"$BIN/flashckptd" --socket "$SOCK" --root "$ROOT" --max-host-memory 1GiB 2>"$TMP/flashckptd.log" &
DAEMON_PID=$!
wait_file "$SOCK" 20 "$DAEMON_PID"
note "flashckptd is up (pid $DAEMON_PID)"

heading "2. Train: 2 ranks (tensor parallel 2), 40 steps of 50 ms, a checkpoint every 10 steps"
sim 0 "$TMP/rank0.train.log"; RANK0=$!
sim 1 "$TMP/rank1.train.log"; RANK1=$!
note "rank 0 pid $RANK0, rank 1 pid $RANK1"
wait_file "$JOB_DIR/checkpoint-20/metadata.json" 120 "$RANK1"
note "checkpoint-20 is complete (metadata.json written after both ranks' saved_signal_*)"

heading "3. SIGKILL rank 1 mid-run; rank 0 trains on alone"
disown "$RANK1"  # so bash does not report the job as "Killed"
kill -9 "$RANK1"
while kill -0 "$RANK1" 2>/dev/null; do sleep 0.05; done
note "rank 1 (pid $RANK1) killed; whatever it had committed, the daemon still persists"
rc=0
wait_pid "$RANK0" 120 || rc=$?
[ "$rc" -eq 0 ] || { indent "[rank 0] " <"$TMP/rank0.train.log"; die "rank 0 exited with status $rc"; }
note "rank 0 finished:"
tail -n 1 "$TMP/rank0.train.log" | indent "[rank 0] "
note "a checkpoint is complete only once every rank's saved_signal_* is there:"
for d in "$JOB_DIR"/checkpoint-*; do
  if [ -f "$d/metadata.json" ]; then state=complete; else state="incomplete (no metadata.json)"; fi
  note "  $(basename "$d"): $state"
done
note "LATEST = $(cat "$JOB_DIR/LATEST")"

heading "4. What the operator sees: flashckpt list, flashckpt status"
"$BIN/flashckpt" --socket "$SOCK" list | indent ""
echo
"$BIN/flashckpt" --socket "$SOCK" status | indent ""

heading "5. Restart both ranks with --resume: they restore the newest complete checkpoint"
sim 0 "$TMP/rank0.resume.log" --resume; RANK0=$!
sim 1 "$TMP/rank1.resume.log" --resume; RANK1=$!
for r in 0 1; do
  pid=$RANK0; [ "$r" -eq 1 ] && pid=$RANK1
  rc=0
  wait_pid "$pid" 120 || rc=$?
  [ "$rc" -eq 0 ] || { indent "[rank $r] " <"$TMP/rank$r.resume.log"; die "rank $r exited with status $rc after --resume"; }
done
for r in 0 1; do
  grep -E '^(resumed|done) ' "$TMP/rank$r.resume.log" | indent "[rank $r] "
done
LATEST="$(tr -d '[:space:]' <"$JOB_DIR/LATEST")"
note "LATEST = $LATEST"

heading "6. Verify checkpoint-$LATEST offline with flashckpt verify (files, headers, checksums)"
"$BIN/flashckpt" verify "$JOB_DIR/checkpoint-$LATEST" | indent ""
ls -l "$JOB_DIR/checkpoint-$LATEST" | indent ""

RESUMED="$(sed -n 's/^resumed step=\([0-9]*\).*/\1/p' "$TMP/rank0.resume.log")"
heading "Done: after the kill both ranks resumed from checkpoint-${RESUMED:-?} and trained on to step 40"

#!/usr/bin/env bash
# The flashckpt demo. Everything lives in a temporary folder that is removed on exit
# (FLASHCKPT_DEMO_KEEP=1 keeps it); the daemon is always stopped.
#
#   scripts/demo.sh        PyTorch: examples/train_mlp.py (an MLP with dropout, AdamW, the daemon's
#                          EMA) checkpoints through a real flashckptd: a memory checkpoint every step,
#                          a disk one every 50; the trainer is SIGKILLed mid-run and resumes from the
#                          step it died at, from memory, and its loss curve is printed beside an
#                          uninterrupted run's (they must be bit-identical, the EMA too), with the EMA
#                          weights' eval loss and the time the loop was blocked in save() next to what
#                          torch.save takes.
#   scripts/demo.sh sim    a two-rank simulated trainer (flashckpt-sim): one rank is SIGKILLed, the
#                          operator CLI shows what is on disk, both resume, `flashckpt verify` checks.
#
# FLASHCKPT_BIN_DIR=<dir> runs binaries from <dir> (e.g. /usr/local/bin) instead of building build/;
# the Python package then comes from FLASHCKPT_PYTHON_DIR, else build/python, else the installed one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$(pwd)"
BIN="${FLASHCKPT_BIN_DIR:-$REPO/build/bin}"
PYTHON_DIR="${FLASHCKPT_PYTHON_DIR:-$REPO/build/python}"
MODE="${1:-torch}"
case "$MODE" in torch|sim) ;; *) echo "usage: scripts/demo.sh [torch|sim]" >&2; exit 2 ;; esac

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
  # Only what the demo runs (the daemon, the simulated trainer, the operator command and, for the
  # PyTorch demo, the Python package): not the tests and benchmarks that `cmake --build build` adds.
  targets=(flashckptd flashckpt-sim flashckpt_cli)
  if [ "$MODE" = torch ] && grep -q '^FLASHCKPT_WITH_PYTHON:BOOL=ON' build/CMakeCache.txt; then
    targets+=(flashckpt_python)
  fi
  cmake --build build -j"$(nproc)" --target "${targets[@]}"
fi
for b in flashckptd flashckpt-sim flashckpt; do
  [ -x "$BIN/$b" ] || die "$BIN/$b was not built"
done
if [ "$MODE" = torch ]; then
  [ -d "$PYTHON_DIR/flashckpt" ] && export PYTHONPATH="$PYTHON_DIR${PYTHONPATH:+:$PYTHONPATH}"
  /usr/bin/python3 -c "import flashckpt.torch" 2>/dev/null ||
    die "the flashckpt Python package is not importable (build with FLASHCKPT_WITH_PYTHON=ON; needs python3-torch)"
fi

# /tmp rather than $TMPDIR: a UNIX socket path must stay under 108 bytes.
TMP="$(mktemp -d /tmp/flashckpt-demo.XXXXXX)"
SOCK="$TMP/flashckptd.sock"
ROOT="$TMP/root"
JOB=demo
JOB_DIR="$ROOT/$JOB"
DAEMON_PID=""
SIM_PIDS=()
TRAINER_PID=""

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for pid in ${SIM_PIDS[@]+"${SIM_PIDS[@]}"} $TRAINER_PID; do kill -9 "$pid" 2>/dev/null || true; done
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
    rm -f /dev/shm/flashckpt."$JOB".*.ema /dev/shm/flashckpt."$JOB"-ref.*.ema  # the daemon keeps EMA segments
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

demo_sim() {
  heading "2. Train: 2 ranks (tensor parallel 2), 40 steps of 50 ms, a checkpoint every 10 steps"
  # Rank 0 ends once its own last save is durable: rank 1, killed below, never completes that checkpoint.
  sim 0 "$TMP/rank0.train.log" --no-wait-complete; RANK0=$!
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
}

# Prints the resumed run's losses beside the uninterrupted run's; fails unless every one is identical.
compare_runs() {
  /usr/bin/python3 - "$@" <<'PY'
import json, sys
ref_log, killed_log, resumed_log, ref_sum, resumed_sum = sys.argv[1:6]
def losses(path):
    with open(path) as f:
        return {r["step"]: float.fromhex(r["loss"]) for r in (json.loads(l) for l in f if l.endswith("\n"))}
ref, killed, resumed = losses(ref_log), losses(killed_log), losses(resumed_log)
ref_s, res_s = (json.load(open(p)) for p in (ref_sum, resumed_sum))
start = res_s["resumed_step"]
shown = sorted(s for s in resumed if s == start + 1 or s % 25 == 0 or s == max(resumed))
print("   %6s  %-22s %-22s %s" % ("step", "uninterrupted", "killed + resumed", "identical"))
for s in sorted(set(shown) | {max(killed)}):
    mine = resumed.get(s, killed.get(s))
    tag = "   <- SIGKILL here" if s == max(killed) else ("   <- first step after the resume" if s == start + 1 else "")
    print("   %6d  %-22.17g %-22.17g %s%s" % (s, ref[s], mine, "yes" if mine == ref[s] else "NO", tag))
bad = [s for s, v in list(killed.items()) + list(resumed.items()) if v != ref[s]]
print()
if bad:
    print("   MISMATCH at steps %s" % bad[:10])
    sys.exit(1)
print("   all %d losses of the killed run and %d of the resumed run are bit-identical to the uninterrupted run"
      % (len(killed), len(resumed)))
same = all(ref_s[k] == res_s[k] for k in ("params_sha256", "ema_sha256"))
print("   final weights and EMA identical too: %s" % ("yes" if same else "NO"))
print()
print("   eval loss of the final weights %.5f, of the EMA weights (decay 0.99, kept by the daemon) %.5f"
      % (res_s["eval_loss"], res_s["ema_eval_loss"]))
print("   blocked in save(): %.2f ms per persisted save (%.1f ms over all %d saves, memory checkpoints included);"
      % (res_s["blocked_ms_per_persisted_save"], res_s["blocked_ms_total"], res_s["saves"]))
print("   torch.save of the same state (%.2f MiB) takes %.2f ms"
      % (res_s["state_bytes"] / 2**20, res_s["torch_save_ms"]))
print("   (a state this small costs both a fixed ~1 ms of calls; bench/torch_save_bench.py compares them at 1 GiB)")
sys.exit(0 if same else 1)
PY
}

demo_torch() {
  local steps=300 save_every=50 kill_at=$((120 + RANDOM % 120))
  # A fresh job would adopt the EMA an earlier demo left in /dev/shm (it outlives the daemon).
  rm -f /dev/shm/flashckpt."$JOB".*.ema /dev/shm/flashckpt."$JOB"-ref.*.ema
  train() {  # train <job> <name> [extra flags...]: examples/train_mlp.py in the background
    local job=$1 name=$2
    shift 2
    /usr/bin/python3 examples/train_mlp.py --socket "$SOCK" --job "$job" --steps "$steps" \
      --save-every "$save_every" --memory-every 1 --ema-decay 0.99 --quiet --log "$TMP/$name.jsonl" \
      --summary "$TMP/$name.json" --torch-save-dir "$TMP" "$@" >"$TMP/$name.log" 2>&1 &
    TRAINER_PID=$!
  }
  finish() {  # finish <name>: waits for the trainer, shows its log on failure
    local rc=0
    wait_pid "$TRAINER_PID" 300 || rc=$?
    TRAINER_PID=""
    [ "$rc" -eq 0 ] || { indent "[$1] " <"$TMP/$1.log"; die "$1 exited with status $rc"; }
  }
  last_step() { tail -n 1 "$TMP/$1.jsonl" 2>/dev/null | sed -n 's/.*"step": *\([0-9]*\).*/\1/p'; }

  heading "2. Uninterrupted run: an MLP with dropout and AdamW, $steps steps, a memory checkpoint every step" \
    "(with the EMA), a disk checkpoint every $save_every"
  train "$JOB-ref" reference
  finish reference
  tail -n 2 "$TMP/reference.log" | indent "[reference] "

  heading "3. The same run as job '$JOB', SIGKILLed at step ~$kill_at"
  train "$JOB" killed --step-delay 0.01
  until [ -f "$JOB_DIR/LATEST" ] && [ "$(last_step killed)" -ge "$kill_at" ] 2>/dev/null; do
    kill -0 "$TRAINER_PID" 2>/dev/null || { indent "[killed] " <"$TMP/killed.log"; die "the trainer exited early"; }
    sleep 0.005
  done
  disown "$TRAINER_PID"  # so bash does not report the job as "Killed"
  kill -9 "$TRAINER_PID"
  while kill -0 "$TRAINER_PID" 2>/dev/null; do sleep 0.05; done
  TRAINER_PID=""
  note "killed the trainer after step $(last_step killed); the daemon still persists what it had committed"
  note "LATEST = $(cat "$JOB_DIR/LATEST")"
  "$BIN/flashckpt" --socket "$SOCK" list --job "$JOB" | indent ""

  heading "4. Restart it: ck.resume() loads weights, AdamW moments, RNG, data position and the EMA of the step it" \
    "died at, from the daemon's memory"
  train "$JOB" resumed
  finish resumed
  grep '^resumed' "$TMP/resumed.log" | indent "[resumed] "

  heading "5. The loss curve of the resumed run beside the uninterrupted run"
  compare_runs "$TMP/reference.jsonl" "$TMP/killed.jsonl" "$TMP/resumed.jsonl" "$TMP/reference.json" \
    "$TMP/resumed.json"

  LATEST="$(tr -d '[:space:]' <"$JOB_DIR/LATEST")"
  heading "6. Verify checkpoint-$LATEST offline with flashckpt verify (files, headers, checksums)"
  "$BIN/flashckpt" verify "$JOB_DIR/checkpoint-$LATEST" | indent ""
  local resumed_from
  resumed_from="$(sed -n 's/^resumed step=\([0-9]*\) from=\([a-z]*\) in \([0-9.]*\) s/step \1 from \2 in \3 s/p' \
    "$TMP/resumed.log")"
  heading "Done: killed at step $(last_step killed), resumed $resumed_from," \
    "identical to the run that never stopped"
}

heading "1. Start flashckptd: one daemon per node, owning the host shared memory"
note "socket $SOCK, root $ROOT, host-memory budget 1 GiB"
"$BIN/flashckptd" --socket "$SOCK" --root "$ROOT" --max-host-memory 1GiB 2>"$TMP/flashckptd.log" &
DAEMON_PID=$!
wait_file "$SOCK" 20 "$DAEMON_PID"
note "flashckptd is up (pid $DAEMON_PID)"

if [ "$MODE" = sim ]; then demo_sim; else demo_torch; fi

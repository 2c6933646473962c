#!/usr/bin/python3
"""Crash points on both sides, chosen by a seeded random generator.

Daemon side (--side daemon): two flashckpt-sim ranks (tp=2) train with EMA snapshots every other
step and a persisted save every 10 steps, and tolerate daemon restarts. The test SIGKILLs
flashckptd at KILLS random moments (random up-time and down-time) and restarts it on the same
socket; the trainers carry on, re-attaching on their own. Afterwards:
  - every save step that both ranks saw acknowledged is a complete checkpoint (a committed
    snapshot is persisted even when the daemon died before writing it);
  - every complete checkpoint passes the independent reader (every element against the formula,
    checksums) and `flashckpt verify`;
  - no temporary file is left in the tree, and after a clean stop the state directory is empty and
    no slot segment of the job is left in /dev/shm;
  - each rank's EMA (dumped at the end) equals a numpy reference built from exactly the EMA steps
    that rank committed (a Commit cut off by the kill may or may not count: the reference that
    matches the daemon's update count is searched among those), so the EMA survived every kill;
  - the ranks resume from the latest checkpoint and verify every element bit-exact.

Trainer side (--side trainer): KILLS rounds, each starting both ranks with --resume and SIGKILLing
one or both at a random moment (while restoring, filling a slot, committing or waiting). After
every round the complete checkpoints so far are unchanged (same files, sizes and mtimes: nothing
changes a complete checkpoint, a restore included) and each new complete checkpoint passes the
reader. A final clean run finishes, resumes bit-exact, and `flashckpt verify` passes.

    test_crash_points.py --bin-dir build/bin --side daemon|trainer [--kills N] [--seed S] [--keep]
"""

import argparse
import glob
import itertools
import json
import os
import random
import re
import subprocess
import sys
import time

import numpy as np

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashckpt_reader as reader  # noqa: E402
from harness import (DaemonHarness, TestFailure, check, kill_processes, log, run_with_daemon_harness,  # noqa: E402
                     wait_for)

WORLD, TP = 2, 2
LAYERS, HIDDEN = 4, 64
SAVE_EVERY = 10
EMA_DECAY, EMA_INTERVAL = 0.9, 2
REL_TOL = 1e-6
SIM_TIMEOUT_S = 240

COMMITTED = re.compile(r"^committed step=(\d+) persist=([01])$", re.M)
LOST = re.compile(r"^lost step=(\d+) persist=([01]) uncertain=([01]) code=(\S+)$", re.M)
DONE = re.compile(r"^done rank=(\d+) last_step=(\d+) saves=(\d+) ", re.M)
RESUMED = re.compile(r"^resumed step=(\d+) from=\w+ verified_elements=(\d+)\b", re.M)
EMA_LINE = re.compile(r"^ema step=(-?\d+) tensors=(\d+)$", re.M)
RECOVERED = re.compile(r"recovered job=\S+ rank=\d+ step=(\d+)")
SERVING = re.compile(r"serving socket=\S+ startup_secs=([0-9.]+) adopt_secs=([0-9.]+)")
VERIFY_SAMPLE = 40


class Harness(DaemonHarness):
    def __init__(self, bin_dir, tmp):
        super().__init__(bin_dir, tmp)
        self.job = "crash-%d" % os.getpid()
        self.job_dir = os.path.join(self.root, self.job)
        self.daemon_starts = 0
        self.sims = []

    def start_daemon(self, extra_args=()):
        self.daemon_starts += 1
        self.daemon_log = os.path.join(self.tmp, "flashckptd.%d.log" % self.daemon_starts)
        super().start_daemon(extra_args)

    def start_sims(self, phase, steps, step_ms, resume=False, dump=False, tolerate=False):
        procs = {}
        for rank in range(WORLD):
            cmd = [self.binary("flashckpt-sim"), "--socket", self.sock, "--job", self.job, "--rank", str(rank),
                   "--world-size", str(WORLD), "--tp-degree", str(TP), "--layers", str(LAYERS),
                   "--hidden", str(HIDDEN), "--steps", str(steps), "--save-every", str(SAVE_EVERY),
                   "--step-ms", str(step_ms), "--wait-timeout", "60", "--ema-decay", repr(EMA_DECAY),
                   "--ema-interval", str(EMA_INTERVAL),
                   # One run id for the ranks started together: a rank that starts after the other
                   # has finished would otherwise be a run of its own, and its steps never complete.
                   "--run-id", "%s-%s" % (self.job, phase)]
            if resume:
                cmd.append("--resume")
            if tolerate:
                cmd.append("--tolerate-daemon-restarts")
            if dump:
                d = self.dump_dir(rank)
                os.makedirs(d, exist_ok=True)
                cmd += ["--dump-ema", d]
            path = os.path.join(self.tmp, "%s.rank%d.log" % (phase, rank))
            self.logs.append(path)
            with open(path, "wb") as out:
                procs[rank] = (subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL),
                               path)
            self.sims.append(procs[rank][0])
        return procs

    def wait_sims(self, procs, what):
        deadline = time.monotonic() + SIM_TIMEOUT_S
        results = {}
        for rank, (p, path) in procs.items():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TestFailure("%s: rank %d still running after %ds" % (what, rank, SIM_TIMEOUT_S))
            with open(path, errors="replace") as f:
                results[rank] = (p.returncode, f.read())
        return results

    def dump_dir(self, rank):
        return os.path.join(self.tmp, "dump", "rank%d" % rank)

    def kill_all(self):
        kill_processes(self.sims)


# ------------------------------------------------------------------------------------------------
# References and checks
# ------------------------------------------------------------------------------------------------

_FLAT = np.arange(HIDDEN * HIDDEN, dtype=np.int64).reshape(HIDDEN, HIDDEN)


def sim_weight(layer, step):
    """flashckpt-sim's layers.<layer>.weight at `step`, global [H, H], in float32 (exact)."""
    return ((layer * 7919 + _FLAT) % 1000).astype(np.float32) / np.float32(1024) + np.float32(step)


def reference_ema(steps):
    """The EMA (init 'first') after applying exactly `steps`, in order, in numpy float32."""
    d = np.float32(EMA_DECAY)
    w = np.float32(1) - d
    ema = None
    for s in sorted(steps):
        x = [sim_weight(layer, s) for layer in range(LAYERS)]
        ema = [v.copy() for v in x] if ema is None else [d * e + w * v for e, v in zip(ema, x)]
    return ema


def close_enough(got, want):
    g, r = got.astype(np.float64), want.astype(np.float64)
    return bool(np.all(np.isfinite(g)) and np.all(np.abs(g - r) <= REL_TOL * np.abs(r)))


def complete_snapshot(h):
    """{step: {file: (size, mtime_ns)}} of every complete checkpoint."""
    out = {}
    for step in reader.complete_steps(h.job_dir):
        d = os.path.join(h.job_dir, "checkpoint-%d" % step)
        out[step] = {n: (os.stat(os.path.join(d, n)).st_size, os.stat(os.path.join(d, n)).st_mtime_ns)
                     for n in sorted(os.listdir(d))}
    return out


def verify_complete(h, steps, verified):
    """The independent reader and `flashckpt verify` accept each of `steps` (once per step)."""
    for step in steps:
        if step in verified:
            continue
        d = os.path.join(h.job_dir, "checkpoint-%d" % step)
        try:
            reader.verify_checkpoint(d, layers=LAYERS, hidden=HIDDEN)
        except reader.CheckpointError as e:
            raise TestFailure("checkpoint-%d is complete but the independent reader rejects it: %s" % (step, e))
        rc, out, err = h.cli("verify", d)
        check(rc == 0, "flashckpt verify rejects complete checkpoint-%d (exit %d):\n%s%s" % (step, rc, out, err))
        verified.add(step)


def temporaries(h):
    return sorted(p for p in glob.glob(os.path.join(h.root, "**", "*"), recursive=True) if ".tmp." in
                  os.path.basename(p))


def check_resume(h, phase):
    """Every rank resumes from the latest complete checkpoint and verifies every element."""
    latest = reader.read_latest(h.job_dir)
    results = h.wait_sims(h.start_sims(phase, steps=latest + 1, step_ms=0, resume=True), phase)
    for rank, (rc, out) in sorted(results.items()):
        check(rc == 0, "%s: rank %d exited with %d:\n%s" % (phase, rank, rc, out[-3000:]))
        resumed = RESUMED.findall(out)
        check(len(resumed) == 1 and int(resumed[0][0]) == latest and int(resumed[0][1]) > 0,
              "%s: rank %d did not resume from checkpoint-%d with verified elements:\n%s" %
              (phase, rank, latest, out[-2000:]))
    log("%s: both ranks resumed from checkpoint-%d and verified every element bit-exact" % (phase, latest))
    return latest


# ------------------------------------------------------------------------------------------------
# Daemon side
# ------------------------------------------------------------------------------------------------

def run_daemon_side(h, rng, kills):
    h.start_daemon()
    steps, step_ms = 4000, 6
    procs = h.start_sims("train", steps=steps, step_ms=step_ms, dump=True, tolerate=True)
    done_kills = 0
    downtime = []
    while done_kills < kills:
        time.sleep(rng.uniform(0.15, 0.6))  # up: saves go on
        if any(p.poll() is not None for p, _ in procs.values()):
            raise TestFailure("a trainer ended after %d of %d daemon kills; see its log" % (done_kills, kills))
        h.daemon.kill()
        h.daemon.wait(timeout=10)
        done_kills += 1
        down = rng.uniform(0.0, 0.4)
        downtime.append(down)
        time.sleep(down)  # down: saves fail with UNAVAILABLE and training goes on
        h.start_daemon()
    log("daemon side: %d SIGKILLs survived (down %.1fs in all); the trainers carry on" % (done_kills, sum(downtime)))
    results = h.wait_sims(procs, "train")

    committed, lost, uncertain = {}, {}, {}
    for rank, (rc, out) in sorted(results.items()):
        check(rc == 0, "train: rank %d exited with %d:\n%s" % (rank, rc, out[-3000:]))
        check(len(DONE.findall(out)) == 1, "train: rank %d did not finish:\n%s" % (rank, out[-2000:]))
        committed[rank] = {(int(s), p == "1") for s, p in COMMITTED.findall(out)}
        lost[rank] = [(int(s), p == "1", u == "1", c) for s, p, u, c in LOST.findall(out)]
        uncertain[rank] = {s for s, _, u, _ in lost[rank] if u}
        log("train: rank %d: %d snapshots acknowledged, %d lost to the kills (%d of them at Commit)" %
            (rank, len(committed[rank]), len(lost[rank]), len(uncertain[rank])))
    check(sum(len(v) for v in lost.values()) > 0, "no save was lost: the kills did not hit any save")

    # Let the restarted daemon finish the committed snapshots it adopted.
    latest, complete = settle(h)
    saves_acked = set.intersection(*({s for s, p in committed[r] if p} for r in range(WORLD)))
    missing = sorted(s for s in saves_acked if s not in complete)
    check(not missing, "save steps acknowledged on both ranks but not complete: %s (complete: %s)" %
          (missing, complete))
    log("daemon side: all %d save steps acknowledged on both ranks are complete checkpoints (%d complete in all)" %
        (len(saves_acked), len(complete)))
    # Every checkpoint written around a kill is among the sample often enough over runs; the newest
    # and those written by a recovering daemon are always checked.
    recovered = recovered_steps(h)
    sample = sorted(set(rng.sample(complete, min(VERIFY_SAMPLE, len(complete)))) | {complete[-1]} |
                    (recovered & set(complete)))
    verify_complete(h, sample, set())
    log("daemon side: %d complete checkpoints (a seeded sample, the newest, and the %d a restarted daemon finished) "
        "pass the independent reader and flashckpt verify" % (len(sample), len(recovered & set(complete))))
    left = temporaries(h)
    check(not left, "temporary files left in the tree: %s" % left[:10])

    check_ema(h, results, committed, uncertain)

    latest = check_resume(h, "resume")
    rc = h.stop_daemon()
    check(rc == 0, "flashckptd exited with %s on SIGTERM" % rc)
    state = h.sock + ".state"
    # The lock file stays (unlocked), and so does a record of each EMA segment kept for the next daemon.
    # flashckpt.<job>.<rank>.<scope>.ema.kept, the scope the daemon's (16 hex digits).
    kept = re.compile(r"flashckpt\.%s\.[01]\.[0-9a-f]{16}\.ema\.kept$" % re.escape(h.job))
    emas = "flashckpt.%s.<rank>.<scope>.ema.kept" % h.job
    records = sorted(r for r in os.listdir(state) if r != "daemon.lock") if os.path.isdir(state) else None
    check(records is not None and all(kept.match(r) for r in records),
          "after a clean stop the state directory should hold no record but the kept EMAs' %s: %s"
          % (emas, records if records is not None else "missing"))
    slots = [p for p in glob.glob("/dev/shm/flashckpt.%s.*" % h.job) if not p.endswith(".ema")]
    check(not slots, "slot segments left in /dev/shm after a clean stop: %s" % slots)
    log("daemon side: clean stop leaves no record but the kept EMA segments' and no slot segment")
    startup, adopt = slowest_start(h)
    print("FIGURES side=daemon kills=%d lost_snapshots=%d recovered_steps=%d complete=%d verified=%d latest=%d "
          "slowest_start_secs=%.3f its_adoption_secs=%.3f" %
          (done_kills, sum(len(v) for v in lost.values()), len(recovered), len(complete), len(sample), latest,
           startup, adopt), flush=True)


def slowest_start(h):
    """(startup, adoption) seconds of the slowest of the daemon's starts, from its logs."""
    slowest = (0.0, 0.0)
    for path in glob.glob(os.path.join(h.tmp, "flashckptd.*.log")):
        with open(path, errors="replace") as f:
            for startup, adopt in SERVING.findall(f.read()):
                slowest = max(slowest, (float(startup), float(adopt)))
    return slowest


def recovered_steps(h):
    """Steps a restarted daemon persisted or completed from an adopted commit record."""
    steps = set()
    for path in glob.glob(os.path.join(h.tmp, "flashckptd.*.log")):
        with open(path, errors="replace") as f:
            steps |= {int(s) for s in RECOVERED.findall(f.read())}
    return steps


def settle(h, quiet_s=1.0, timeout=60):
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        complete = tuple(reader.complete_steps(h.job_dir))
        if complete != last:
            last, since = complete, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return (complete[-1] if complete else 0), list(complete)
        if time.monotonic() > deadline:
            raise TestFailure("the checkpoint tree did not settle within %ds" % timeout)
        time.sleep(0.1)


def check_ema(h, results, committed, uncertain):
    rc, out, err = h.cli("status", "--json", "--socket", h.sock)
    check(rc == 0, "flashckpt status --json failed: %s%s" % (out, err))
    status = json.loads(out)
    ranks = {}
    for j in status.get("jobs", []):
        if j.get("job") == h.job:
            ranks = {int(r.get("rank", 0)): r for r in j.get("ranks", [])}
    rows = HIDDEN // TP
    for rank, (_, out) in sorted(results.items()):
        ema = ranks.get(rank, {}).get("ema") or {}
        check(ema.get("enabled"), "status shows no EMA for rank %d: %s" % (rank, ranks.get(rank)))
        applied = int(ema.get("updates_applied", 0))
        acked = sorted(s for s, _ in committed[rank] if s % EMA_INTERVAL == 0)
        maybe = sorted(s for s in uncertain[rank] if s % EMA_INTERVAL == 0)
        extra = applied - len(acked)
        check(0 <= extra <= len(maybe), "rank %d: the EMA applied %d updates; %d were acknowledged and %d more "
              "were cut off at Commit" % (rank, applied, len(acked), len(maybe)))
        dumped = [np.fromfile(os.path.join(h.dump_dir(rank), "layers.%d.weight.f32" % layer), dtype="<f4")
                  .reshape(rows, HIDDEN) for layer in range(LAYERS)]
        box = slice(rank * rows, (rank + 1) * rows)
        match = None
        for chosen in itertools.combinations(maybe, extra):
            ref = reference_ema(acked + list(chosen))
            if all(close_enough(dumped[layer], ref[layer][box]) for layer in range(LAYERS)):
                match = chosen
                break
        check(match is not None, "rank %d: the EMA after the kills matches no reference built from its %d "
              "acknowledged EMA steps plus %d of the %d cut off at Commit" % (rank, len(acked), extra, len(maybe)))
        log("rank %d: EMA equals the numpy reference over %d updates (%d acknowledged, %d cut off at Commit but "
            "kept by the daemon)" % (rank, applied, len(acked), len(match)))


# ------------------------------------------------------------------------------------------------
# Trainer side
# ------------------------------------------------------------------------------------------------

def run_trainer_side(h, rng, kills):
    h.start_daemon()
    # A first clean run, so that every round has a checkpoint to restore.
    results = h.wait_sims(h.start_sims("seed", steps=20, step_ms=0), "seed")
    for rank, (rc, out) in results.items():
        check(rc == 0, "seed: rank %d exited with %d:\n%s" % (rank, rc, out[-2000:]))
    before = complete_snapshot(h)
    verified = set()
    verify_complete(h, before, verified)
    outcomes = {"both": 0, "one": 0}
    phases = {"before or during restore": 0, "training": 0}
    for k in range(kills):
        procs = h.start_sims("round%02d" % k, steps=8000, step_ms=rng.choice([0, 2, 5]), resume=True)
        # A third of the rounds kill within 60 ms: while connecting, registering or restoring.
        time.sleep(rng.uniform(0.0, 0.06) if rng.random() < 1 / 3 else rng.uniform(0.0, 0.8))
        victims = [0, 1] if rng.random() < 0.5 else [rng.randrange(WORLD)]
        for r in victims:
            procs[r][0].kill()
        if len(victims) == 1:  # the survivor runs on alone for a moment, then dies too
            time.sleep(rng.uniform(0.0, 0.3))
        for p, _ in procs.values():
            p.kill()
            p.wait(timeout=10)
        outcomes["both" if len(victims) == 2 else "one"] += 1
        for _, path in procs.values():
            with open(path, errors="replace") as f:
                phases["training" if RESUMED.search(f.read()) else "before or during restore"] += 1
        time.sleep(0.3)  # committed snapshots are still written after the trainers died
        after = complete_snapshot(h)
        for step, files in before.items():
            check(after.get(step) == files, "round %d: complete checkpoint-%d changed after a trainer was killed:\n"
                  "before %s\nafter  %s" % (k, step, files, after.get(step)))
        verify_complete(h, after, verified)
        before = after
    log("trainer side: %d rounds of SIGKILL (%d with both ranks at once, %d one first); complete checkpoints "
        "never changed, each new one (%d in all) passes the reader and flashckpt verify" %
        (kills, outcomes["both"], outcomes["one"], len(verified)))
    try:
        wait_for(lambda: all(s["state"] == "free" for s in slot_states(h)), 30, "every slot to be free again")
    except TestFailure:
        rc, out, err = h.cli("status", "--socket", h.sock)
        log("status (exit %d):\n%s%s" % (rc, out, err))
        raise
    latest = check_resume(h, "final")
    verify_complete(h, reader.complete_steps(h.job_dir), verified)
    print("FIGURES side=trainer rounds=%d rank_kills=%d killed_before_or_during_restore=%d killed_training=%d "
          "complete=%d latest=%d" % (kills, sum(phases.values()), phases["before or during restore"],
                                     phases["training"], len(verified), latest), flush=True)


def slot_states(h):
    rc, out, err = h.cli("status", "--json", "--socket", h.sock)
    if rc != 0:
        return [{"state": "?"}]
    states = []
    for j in json.loads(out).get("jobs", []):
        if j.get("job") == h.job:
            for r in j.get("ranks", []):
                states += r.get("slots", [])
    return states


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--side", choices=["daemon", "trainer"], required=True)
    ap.add_argument("--kills", type=int, default=24)
    ap.add_argument("--seed", type=int, default=None, help="default: random, printed")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    log("side=%s kills=%d seed=%d (rerun with --seed %d)" % (args.side, args.kills, seed, seed))
    rng = random.Random(seed)
    run = run_daemon_side if args.side == "daemon" else run_trainer_side
    return run_with_daemon_harness(lambda h: run(h, rng, args.kills), "fc-crash-", lambda h: [h.job], args.bin_dir,
                                   keep=args.keep, harness=Harness)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""EMA: a real flashckptd, real flashckpt-sim ranks, and an EMA computed independently in numpy.

The reference is computed here, in numpy float32, from the simulator's documented weight formula
    x = float32(((l*7919 + i*H + j) % 1000) / 1024) + s        (layers.<l>.weight at global (i, j))
and the loss it sends with every snapshot (10.0 when s % 7 == 0, else 1.0). An update is due on the
snapshots whose step is a multiple of the interval, and skipped (counted) when a loss threshold is
set and the loss is above it; the first update is e = x ("first") or e = (1-d)*x ("zeros"), later
ones e = d*e + (1-d)*x with d = float32(decay). The EMA files are read with flashckpt_reader.py (no
project code) and must match the reference to a relative error of 1e-6, element by element.

  1. Basic runs on one daemon, steps 1..30, a save every 10, each its own job: interval 1 and 3, both
     inits, the loss gate, and a tp=2 x shard=2 job whose shard-1 ranks hold replicas (no EMA).
     Every checkpoint's EMA, metadata.json's "ema" section, the EMA fields of the files' headers,
     and --dump-ema (the daemon's EMA through the client's Ema() call) at the final step.
  2. SIGKILL: a rank is killed once checkpoint-20 is complete, the other finishes; all ranks resume
     and run to step 40. Every checkpoint's EMA, the final one included, equals the uninterrupted
     reference over steps 1..40 (the resume reloads the EMA of the checkpoint it resumes from).
  3. Daemon restart: ranks run to step 15, the daemon is stopped with SIGTERM, a new one adopts the
     EMA segments in /dev/shm (and logs it), and new rank processes resume from checkpoint-10 (a new
     process carries on a run only by restoring) to step 30; the restore reloads checkpoint-10's EMA.
  4. `flashckpt verify` accepts every final checkpoint (with its EMA files) and rejects a copy with
     one flipped byte in an EMA file, naming it; flashckptd exits 0 on SIGTERM.

Every wait has a deadline; daemons and simulators are stopped in a finally block, and the EMA
segments the daemon leaves in /dev/shm for these jobs are removed.

    test_ema.py --bin-dir build/bin [--keep]
"""

import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashckpt_reader as reader  # noqa: E402
from harness import (DaemonHarness, TestFailure, check, check_flipped_byte_is_caught, kill_processes, log,  # noqa: E402
                     run_with_daemon_harness, wait_for)

LAYERS, HIDDEN = 2, 64
SAVE_EVERY = 10
STEPS = 30
KILL_STEPS = 40
KILL_AFTER_STEP = 20
KILL_STEP_MS = 30          # phase with the kill: time to SIGKILL the victim between two saves
RESUME_STEP_MS = 20        # the victim restarts last; the others restore within this head start
RESTART_AT_STEP = 15       # the daemon restart happens after this step
REL_TOL = 1e-6

SIM_TIMEOUT_S = 60
WAIT_TIMEOUT_S = 60

DONE = re.compile(r"^done rank=(\d+) last_step=(\d+) saves=(\d+) ", re.M)
RESUMED = re.compile(r"^resumed step=(\d+) from=\w+ verified_elements=(\d+)\b", re.M)
EMA_LINE = re.compile(r"^ema step=(-?\d+) tensors=(\d+)$", re.M)


# ------------------------------------------------------------------------------------------------
# The independent reference
# ------------------------------------------------------------------------------------------------

class Scenario:
    def __init__(self, name, world, tp, shard, decay, interval, init, threshold=None):
        self.name, self.world, self.tp, self.shard = name, world, tp, shard
        self.decay, self.interval, self.init, self.threshold = decay, interval, init, threshold
        self.job = "ema-%d-%s" % (os.getpid(), name)

    def ema_ranks(self):
        """Ranks that hold an EMA: shard rank 0 (the others hold the weights as replicas)."""
        return [r for r in range(self.world) if r // self.tp == 0]

    def sim_args(self):
        args = ["--ema-decay", repr(self.decay), "--ema-interval", str(self.interval), "--ema-init", self.init]
        if self.threshold is not None:
            args += ["--ema-loss-threshold", repr(self.threshold)]
        return args

    def __str__(self):
        return "%s (W=%d tp=%d shard=%d decay=%s interval=%d init=%s threshold=%s)" % (
            self.name, self.world, self.tp, self.shard, self.decay, self.interval, self.init, self.threshold)


_FLAT = np.arange(HIDDEN * HIDDEN, dtype=np.int64).reshape(HIDDEN, HIDDEN)


def sim_weight(layer, step):
    """flashckpt-sim's layers.<layer>.weight at `step`, global [H, H], computed in float32 (exact)."""
    base = ((layer * 7919 + _FLAT) % 1000).astype(np.float32) / np.float32(1024)
    return base + np.float32(step)


def sim_loss(step):
    return 10.0 if step % 7 == 0 else 1.0


class Reference:
    """The EMA after every step 1..last_step, in numpy float32: at[step] = (ema, applied, skipped, last)."""

    def __init__(self, sc, last_step):
        d = np.float32(sc.decay)
        w = np.float32(1) - d
        ema, applied, skipped, last = None, 0, 0, -1
        self.at = {}
        for s in range(1, last_step + 1):
            if s % sc.interval == 0:
                if sc.threshold is not None and sim_loss(s) > sc.threshold:
                    skipped += 1
                else:
                    x = {layer: sim_weight(layer, s) for layer in range(LAYERS)}
                    if ema is None:
                        ema = {layer: (x[layer].copy() if sc.init == "first" else w * x[layer]) for layer in x}
                    else:
                        ema = {layer: d * ema[layer] + w * x[layer] for layer in x}
                    applied, last = applied + 1, s
            self.at[s] = (ema, applied, skipped, last)
        for e in (ema or {}).values():
            assert e.dtype == np.float32


def compare(what, got, want):
    """Element-wise relative error <= REL_TOL; returns the number of bit-identical elements."""
    check(got.shape == want.shape, "%s: shape %s, reference %s" % (what, got.shape, want.shape))
    g, r = got.astype(np.float64), want.astype(np.float64)
    rel = np.abs(g - r) / np.abs(r)
    worst = float(np.nanmax(rel)) if rel.size else 0.0
    if not (np.all(np.isfinite(g)) and worst <= REL_TOL):
        bad = np.flatnonzero(~(rel <= REL_TOL))
        k = int(bad[0])
        idx = np.unravel_index(k, got.shape)
        raise TestFailure("%s: %d of %d elements are off; first at %s: %r, reference %r (relative error %.3g, "
                          "tolerance %g)" % (what, bad.size, got.size, tuple(int(i) for i in idx),
                                             float(got.flat[k]), float(want.flat[k]), float(rel.flat[k]), REL_TOL))
    return int(np.count_nonzero(got == want))


# ------------------------------------------------------------------------------------------------
# Processes
# ------------------------------------------------------------------------------------------------

class Harness(DaemonHarness):
    def __init__(self, bin_dir, tmp):
        super().__init__(bin_dir, tmp)
        self.daemon_starts = 0
        self.sims = []     # every Popen
        self.jobs = []     # every job name, for the /dev/shm cleanup

    # --- daemon ---------------------------------------------------------------------------------

    def start_daemon(self):
        self.daemon_starts += 1
        self.daemon_log = os.path.join(self.tmp, "flashckptd.%d.log" % self.daemon_starts)
        super().start_daemon()

    def stop_daemon_cleanly(self, what):
        rc = self.stop_daemon()
        check(rc == 0, "%s: flashckptd exited with %s on SIGTERM, expected 0" % (what, rc))
        log("%s: flashckptd stopped cleanly on SIGTERM" % what)

    # --- simulators -----------------------------------------------------------------------------

    def dump_dir(self, sc, rank):
        return os.path.join(self.tmp, "dump", sc.job, "rank%d" % rank)

    def start_sims(self, sc, phase, steps, resume=False, first_step=None, step_ms=None, order=None, dump=False,
                   wait_complete=True):
        if sc.job not in self.jobs:
            self.jobs.append(sc.job)
        procs = {}
        for rank in order or range(sc.world):
            cmd = [self.binary("flashckpt-sim"), "--socket", self.sock, "--job", sc.job,
                   "--rank", str(rank), "--world-size", str(sc.world), "--tp-degree", str(sc.tp),
                   "--shard-degree", str(sc.shard), "--layers", str(LAYERS), "--hidden", str(HIDDEN),
                   "--steps", str(steps), "--save-every", str(SAVE_EVERY), "--wait-timeout", "30"] + sc.sim_args()
            if resume:
                cmd.append("--resume")
            # One run per scenario: its launches are told apart by the steps they resume from.
            cmd += ["--run-id", sc.job + "-run"]
            if first_step is not None:
                cmd += ["--first-step", str(first_step)]
            if step_ms is not None:
                cmd += ["--step-ms", str(step_ms)]
            if not wait_complete:  # a rank is killed: the survivors' last step never completes
                cmd.append("--no-wait-complete")
            if dump:
                d = self.dump_dir(sc, rank)
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
                cmd += ["--dump-ema", d]
            path = os.path.join(self.tmp, "%s.%s.rank%d.log" % (sc.name, phase, rank))
            self.logs.append(path)
            with open(path, "wb") as out:
                procs[rank] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.sims.append(procs[rank])
        log("%s/%s: started %d ranks (steps=%d resume=%s first_step=%s step_ms=%s)" %
            (sc.name, phase, len(procs), steps, resume, first_step, step_ms))
        return procs

    def wait_sims(self, sc, phase, procs):
        deadline = time.monotonic() + SIM_TIMEOUT_S
        results = {}
        for rank, p in procs.items():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TestFailure("%s/%s: rank %d still running after %ds" % (sc.name, phase, rank, SIM_TIMEOUT_S))
            with open(os.path.join(self.tmp, "%s.%s.rank%d.log" % (sc.name, phase, rank)), "r",
                      errors="replace") as f:
                results[rank] = (p.returncode, f.read())
        return results

    def kill_all(self):
        kill_processes(self.sims)

    # --- the checkpoint tree --------------------------------------------------------------------

    def job_dir(self, sc):
        return os.path.join(self.root, sc.job)

    def ckpt(self, sc, step):
        return os.path.join(self.job_dir(sc), "checkpoint-%d" % step)

    def settled_state(self, sc, quiet_s=0.5, timeout=WAIT_TIMEOUT_S):
        """Waits until LATEST and the set of complete checkpoints stop changing and agree."""
        deadline = time.monotonic() + timeout
        last, since = None, time.monotonic()
        while True:
            try:
                latest = reader.read_latest(self.job_dir(sc))
            except (OSError, reader.CheckpointError):
                latest = None
            try:
                complete = tuple(reader.complete_steps(self.job_dir(sc)))
            except OSError:
                complete = ()
            state = (latest, complete)
            if state != last:
                last, since = state, time.monotonic()
            elif time.monotonic() - since >= quiet_s and complete and latest == complete[-1]:
                return latest, list(complete)
            if time.monotonic() > deadline:
                raise TestFailure("%s: checkpoint tree did not settle within %ds: LATEST=%s complete=%s" %
                                  (sc.name, timeout, latest, list(complete)))
            time.sleep(0.05)


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------

def check_finished(sc, phase, results, last_step, saves, ranks=None):
    for rank, (rc, out) in sorted(results.items()):
        if ranks is not None and rank not in ranks:
            continue
        check(rc == 0, "%s/%s: rank %d exited with %d:\n%s" % (sc.name, phase, rank, rc, out[-3000:]))
        done = DONE.findall(out)
        check(len(done) == 1, "%s/%s: rank %d printed %d 'done' lines:\n%s" % (sc.name, phase, rank, len(done),
                                                                             out[-3000:]))
        got = tuple(int(v) for v in done[0])
        check(got == (rank, last_step, saves), "%s/%s: rank %d: done rank=%d last_step=%d saves=%d, expected "
              "last_step=%d saves=%d" % ((sc.name, phase, rank) + got + (last_step, saves)))


def saves_between(after, upto):
    return len([s for s in range(after + 1, upto + 1) if s % SAVE_EVERY == 0])


def check_checkpoint_ema(h, sc, step, ref):
    """Checkpoint-<step>: reader-verified, and its EMA files and metadata equal the reference at `step`."""
    ckpt = h.ckpt(sc, step)
    where = "%s: checkpoint-%d" % (sc.name, step)
    try:
        s = reader.verify_checkpoint(ckpt, layers=LAYERS, hidden=HIDDEN)
    except reader.CheckpointError as e:
        raise TestFailure("%s: the independent reader rejects it: %s" % (where, e))
    check(s["ema_tensors"] == LAYERS and s["ema_elements"] == LAYERS * HIDDEN * HIDDEN,
          "%s: %d EMA tensors with %d elements, expected %d with %d" %
          (where, s["ema_tensors"], s["ema_elements"], LAYERS, LAYERS * HIDDEN * HIDDEN))
    ema_files = sorted(n for n in os.listdir(ckpt) if n.startswith("ema."))
    want_files = sorted("ema.tp%02d_pp00_shard00.safetensors" % tp for tp in range(sc.tp))
    check(ema_files == want_files, "%s: EMA files %s, expected %s (shard-0 ranks only)" %
          (where, ema_files, want_files))

    ref_ema, applied, skipped, last = ref.at[step]
    with open(os.path.join(ckpt, "metadata.json")) as f:
        meta = json.load(f)
    m = meta.get("ema")
    check(isinstance(m, dict), "%s: metadata.json has no 'ema' object: %r" % (where, m))
    want = {"decay": sc.decay, "interval": sc.interval, "init": sc.init, "model_params": "fp32",
            "updates_applied": applied, "updates_skipped": skipped, "last_step": last}
    if sc.threshold is not None:
        want["loss_threshold"] = sc.threshold
    for key, value in want.items():
        check(key in m and m[key] == value and type(m[key]) is type(value),
              "%s: metadata.json ema.%s = %r, the reference says %r (ema section: %s)" %
              (where, key, m.get(key), value, json.dumps(m)))
    if sc.threshold is None:
        check("loss_threshold" not in m, "%s: metadata.json has ema.loss_threshold without a threshold" % where)

    # The per-file header carries the same counters (fixed-width fields stamped at each save).
    for fname in ema_files:
        hm = reader.read_safetensors(os.path.join(ckpt, fname)).metadata
        for key, value in (("ema_updates_applied", applied), ("ema_updates_skipped", skipped),
                           ("ema_last_step", last), ("ema_interval", sc.interval)):
            check(key in hm and re.fullmatch(r"[0-9]+", hm[key]) and int(hm[key]) == value,
                  "%s: %s __metadata__ %s = %r, expected %d" % (where, fname, key, hm.get(key), value))
        check(hm.get("ema_init") == sc.init and float(hm.get("ema_decay", "nan")) == sc.decay,
              "%s: %s __metadata__ ema_init=%r ema_decay=%r" % (where, fname, hm.get("ema_init"), hm.get("ema_decay")))

    try:
        got = reader.read_ema(ckpt)
    except reader.CheckpointError as e:
        raise TestFailure("%s: the reader cannot assemble the EMA: %s" % (where, e))
    names = ["layers.%d.weight" % layer for layer in range(LAYERS)]
    check(sorted(got) == names, "%s: EMA tensors %s, expected %s" % (where, sorted(got), names))
    check(ref_ema is not None, "%s: the reference has no EMA yet" % where)
    exact = 0
    for layer in range(LAYERS):
        exact += compare("%s: ema layers.%d.weight" % (where, layer), got["layers.%d.weight" % layer], ref_ema[layer])
    log("%s: EMA matches the numpy reference (applied=%d skipped=%d last_step=%d; %d of %d elements bit-identical)" %
        (where, applied, skipped, last, exact, LAYERS * HIDDEN * HIDDEN))
    return got


def check_dump(h, sc, results, step, ref, ckpt_ema):
    """--dump-ema at the end: the daemon's EMA equals the reference at `step` and the checkpoint's EMA."""
    ref_ema, _, _, last = ref.at[step]
    rows = HIDDEN // sc.tp
    for rank, (_, out) in sorted(results.items()):
        lines = EMA_LINE.findall(out)
        check(len(lines) == 1, "%s: rank %d printed %d 'ema' lines:\n%s" % (sc.name, rank, len(lines), out[-3000:]))
        d = h.dump_dir(sc, rank)
        dumped = sorted(os.listdir(d))
        if rank not in sc.ema_ranks():
            check(lines[0] == ("-1", "0") and dumped == [],
                  "%s: replica rank %d (no EMA) dumped %s and printed 'ema step=%s tensors=%s'" %
                  ((sc.name, rank, dumped) + lines[0]))
            continue
        want = ["layers.%d.weight.f32" % layer for layer in range(LAYERS)]
        check(dumped == want, "%s: rank %d dumped %s, expected %s" % (sc.name, rank, dumped, want))
        check(lines[0] == (str(last), str(LAYERS)), "%s: rank %d printed 'ema step=%s tensors=%s', expected step=%d "
              "tensors=%d" % ((sc.name, rank) + lines[0] + (last, LAYERS)))
        tp = rank % sc.tp
        for layer in range(LAYERS):
            arr = np.fromfile(os.path.join(d, "layers.%d.weight.f32" % layer), dtype="<f4")
            check(arr.size == rows * HIDDEN, "%s: rank %d dumped %d floats for layers.%d.weight, expected %d" %
                  (sc.name, rank, arr.size, layer, rows * HIDDEN))
            arr = arr.reshape(rows, HIDDEN)
            box = slice(tp * rows, (tp + 1) * rows)
            compare("%s: --dump-ema of rank %d, layers.%d.weight" % (sc.name, rank, layer), arr, ref_ema[layer][box])
            saved = ckpt_ema["layers.%d.weight" % layer][box]
            check(np.array_equal(arr, saved), "%s: rank %d: --dump-ema of layers.%d.weight differs from checkpoint-%d's "
                  "EMA file (%d elements)" % (sc.name, rank, layer, step, int(np.count_nonzero(arr != saved))))
    log("%s: --dump-ema at step %d equals the reference and checkpoint-%d's EMA" % (sc.name, step, step))


def check_verify_cli(h, sc, step):
    ckpt = h.ckpt(sc, step)
    rc, out, err = h.cli("verify", ckpt)
    check(rc == 0, "flashckpt verify %s exited %d:\n%s%s" % (ckpt, rc, out, err))
    log("%s: flashckpt verify accepts checkpoint-%d: %s" % (sc.name, step, (out + err).strip().splitlines()[-1:]))


def check_verify_rejects_ema_damage(h, sc, step):
    bad_file = "ema.tp%02d_pp00_shard00.safetensors" % (sc.tp - 1)
    rc = check_flipped_byte_is_caught(h, h.ckpt(sc, step), bad_file, "layers.%d.weight" % (LAYERS - 1))
    log("%s: flashckpt verify rejects a flipped byte in %s (exit %d)" % (sc.name, bad_file, rc))


# ------------------------------------------------------------------------------------------------
# Scenarios
# ------------------------------------------------------------------------------------------------

BASIC = [
    Scenario("i1-first", world=2, tp=2, shard=1, decay=0.9, interval=1, init="first"),
    Scenario("i3-zeros", world=2, tp=2, shard=1, decay=0.95, interval=3, init="zeros"),
    Scenario("i1-zeros-gated", world=2, tp=2, shard=1, decay=0.9, interval=1, init="zeros", threshold=5.0),
    Scenario("i3-first-gated-shard2", world=4, tp=2, shard=2, decay=0.8, interval=3, init="first", threshold=5.0),
]
KILL = Scenario("kill", world=2, tp=2, shard=1, decay=0.9, interval=1, init="first", threshold=5.0)
RESTART = Scenario("restart", world=4, tp=2, shard=2, decay=0.9, interval=1, init="zeros", threshold=5.0)


def run_basic(h, sc):
    ref = Reference(sc, STEPS)
    procs = h.start_sims(sc, "run", STEPS, dump=True)
    results = h.wait_sims(sc, "run", procs)
    check_finished(sc, "run", results, STEPS, STEPS // SAVE_EVERY)
    latest, complete = h.settled_state(sc)
    check(complete == [10, 20, 30] and latest == 30, "%s: complete checkpoints %s, LATEST %s; expected [10, 20, 30]"
          % (sc.name, complete, latest))
    ema = None
    for step in complete:
        ema = check_checkpoint_ema(h, sc, step, ref)
    check_dump(h, sc, results, STEPS, ref, ema)
    check_verify_cli(h, sc, STEPS)


def run_kill(h, sc):
    ref = Reference(sc, KILL_STEPS)
    victim = 1  # tp 1, shard 0: holds an EMA
    procs = h.start_sims(sc, "run", KILL_STEPS, step_ms=KILL_STEP_MS, wait_complete=False)
    wait_for(lambda: os.path.isfile(os.path.join(h.ckpt(sc, KILL_AFTER_STEP), "metadata.json")), WAIT_TIMEOUT_S,
             "%s: checkpoint-%d to complete" % (sc.name, KILL_AFTER_STEP))
    check(procs[victim].poll() is None, "%s: rank %d already exited (%s) before the kill" %
          (sc.name, victim, procs[victim].returncode))
    procs[victim].kill()
    log("%s: checkpoint-%d is complete; SIGKILLed rank %d (pid %d)" % (sc.name, KILL_AFTER_STEP, victim,
                                                                       procs[victim].pid))
    results = h.wait_sims(sc, "run", procs)
    check(results[victim][0] == -signal.SIGKILL, "%s: victim exit status %s" % (sc.name, results[victim][0]))
    survivors = [r for r in procs if r != victim]
    check_finished(sc, "run", results, KILL_STEPS, KILL_STEPS // SAVE_EVERY, ranks=survivors)
    latest, complete = h.settled_state(sc)
    log("%s: after the kill LATEST=%d, complete %s" % (sc.name, latest, complete))
    check(KILL_AFTER_STEP <= latest < KILL_STEPS, "%s: LATEST %d after the kill, expected %d <= LATEST < %d" %
          (sc.name, latest, KILL_AFTER_STEP, KILL_STEPS))
    for step in complete:
        check_checkpoint_ema(h, sc, step, ref)

    # All ranks resume; the victim starts last, so that the others restore before its first save
    # can complete one of their leftover (incomplete) checkpoints.
    order = survivors + [victim]
    procs = h.start_sims(sc, "resume", KILL_STEPS, resume=True, step_ms=RESUME_STEP_MS, order=order, dump=True)
    results = h.wait_sims(sc, "resume", procs)
    for rank, (rc, out) in sorted(results.items()):
        found = RESUMED.findall(out)
        check(len(found) == 1 and int(found[0][0]) == latest and int(found[0][1]) > 0,
              "%s/resume: rank %d printed %s, expected one 'resumed step=%d' with verified elements:\n%s" %
              (sc.name, rank, found, latest, out[-3000:]))
    check_finished(sc, "resume", results, KILL_STEPS, saves_between(latest, KILL_STEPS))
    latest2, complete = h.settled_state(sc)
    check(latest2 == KILL_STEPS and complete == list(range(SAVE_EVERY, KILL_STEPS + 1, SAVE_EVERY)),
          "%s: after the resume LATEST=%s complete=%s" % (sc.name, latest2, complete))
    ema = None
    for step in complete:
        ema = check_checkpoint_ema(h, sc, step, ref)
    check_dump(h, sc, results, KILL_STEPS, ref, ema)
    check_verify_cli(h, sc, KILL_STEPS)


def ema_segments(sc):
    return sorted(os.path.basename(p) for p in glob.glob("/dev/shm/flashckpt.%s.*.ema" % sc.job))


def run_restart(h, sc):
    """Needs the daemon running; stops it and leaves a new one running."""
    ref = Reference(sc, STEPS)
    procs = h.start_sims(sc, "before", RESTART_AT_STEP)
    results = h.wait_sims(sc, "before", procs)
    check_finished(sc, "before", results, RESTART_AT_STEP, RESTART_AT_STEP // SAVE_EVERY)
    latest, complete = h.settled_state(sc)
    check(complete == [10] and latest == 10, "%s: complete %s LATEST %s, expected [10]" % (sc.name, complete, latest))
    check_checkpoint_ema(h, sc, 10, ref)

    # SIGTERM drains the EMA stage: the updates of steps 11..15 (no checkpoint) live on in /dev/shm.
    h.stop_daemon_cleanly("%s: daemon restart" % sc.name)
    # flashckpt.<job>.<rank>.<scope>.ema, the scope the daemon's (16 hex digits), one per EMA rank.
    got = ema_segments(sc)
    ranks = sorted(int(m.group(1)) for m in
                   (re.match(r"flashckpt\.%s\.(\d+)\.[0-9a-f]{16}\.ema$" % re.escape(sc.job), n) for n in got) if m)
    check(len(ranks) == len(got) and ranks == sorted(sc.ema_ranks()),
          "%s: after the daemon stopped /dev/shm holds %s, expected flashckpt.%s.<rank>.<scope>.ema for ranks %s" %
          (sc.name, got, sc.job, sorted(sc.ema_ranks())))
    h.start_daemon()

    procs = h.start_sims(sc, "after", STEPS, resume=True, dump=True)
    results = h.wait_sims(sc, "after", procs)
    check_finished(sc, "after", results, STEPS, saves_between(SAVE_EVERY, STEPS))
    with open(h.daemon_log, "r", errors="replace") as f:
        daemon_text = f.read()
    for seg in got:
        check(re.search(r"\badopted segment=%s\b" % re.escape(seg), daemon_text),
              "%s: the restarted daemon did not log that it adopted %s" % (sc.name, seg))
    latest, complete = h.settled_state(sc)
    check(complete == [10, 20, 30] and latest == 30, "%s: complete %s LATEST %s, expected [10, 20, 30]" %
          (sc.name, complete, latest))
    ema = None
    for step in complete:
        ema = check_checkpoint_ema(h, sc, step, ref)
    check_dump(h, sc, results, STEPS, ref, ema)
    check_verify_cli(h, sc, STEPS)


def run(h):
    # The reference's weight formula agrees with the reader's (which follows the simulator's).
    for layer in range(LAYERS):
        check(np.array_equal(sim_weight(layer, 17).reshape(-1),
                             reader.sim_expected(layer, HIDDEN, 17, np.arange(HIDDEN * HIDDEN))),
              "sim_weight disagrees with flashckpt_reader.sim_expected")
    h.start_daemon()
    for sc in BASIC:
        log("--- %s" % sc)
        run_basic(h, sc)
    log("--- %s" % KILL)
    run_kill(h, KILL)
    log("--- %s" % RESTART)
    run_restart(h, RESTART)
    check_verify_rejects_ema_damage(h, BASIC[-1], STEPS)
    h.stop_daemon_cleanly("end")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True, help="folder with flashckptd, flashckpt-sim and flashckpt")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()

    return run_with_daemon_harness(run, "fc-ema.", [sc.job for sc in BASIC + [KILL, RESTART]], args.bin_dir,
                                   args.keep, errors=(TestFailure, reader.CheckpointError,
                                                      subprocess.TimeoutExpired, OSError), harness=Harness)

if __name__ == "__main__":
    sys.exit(main())

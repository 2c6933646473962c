#!/usr/bin/python3
"""Save, kill, resume: a real flashckptd, real trainer processes, an independent reader.

  1. Start flashckptd on a temporary socket and root.
  2. Four flashckpt-sim ranks (tp=2 x shard=2) save checkpoints 10, 20, 30. Every checkpoint is read
     back with flashckpt_reader.py (no project code) and checked element by element.
  3. The four resume from 30 and run on; once a later checkpoint is complete, one rank is SIGKILLed.
     The other three finish. LATEST must name the newest complete checkpoint, and the final one must
     stay incomplete (its killed rank never saved it).
  4. All four resume: each must report the step in LATEST (= the newest directory with metadata.json)
     and a positive verified_elements, then finish, completing the final checkpoint.
  5. `flashckpt verify` accepts the final checkpoint and rejects a copy with one flipped data byte,
     naming the file; `flashckpt list --json` and `status --json` parse and show the job.
  6. SIGTERM stops the daemon with exit status 0.

Every wait has a deadline; the daemon and the simulators are killed in a finally block.

    test_save_kill_resume.py --bin-dir build/bin [--keep]
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashckpt_reader as reader  # noqa: E402
from harness import (DaemonHarness, TestFailure, check, check_flipped_byte_is_caught, kill_processes, log,  # noqa: E402
                     run_with_daemon_harness, wait_for)

WORLD, TP, SHARD = 4, 2, 2
LAYERS, HIDDEN = 4, 128
SAVE_EVERY = 10
PHASE1_STEPS = 30           # checkpoints 10, 20, 30
FINAL_STEP = 150            # phases 2 and 3 run to this step
PHASE2_STEP_MS = 20
# Phase 3 resumes with the survivors' later (incomplete) checkpoints on disk: the victim's first save
# completes one of them, and a rank that restored after that would resume from it. Ranks in a real
# job agree on the resume step; these independent processes only get a head start of 10 steps.
PHASE3_STEP_MS = 50
KILL_AFTER_STEP = 60        # SIGKILL the victim once this checkpoint is complete
VICTIM = 1                  # tp 1, shard 0: writes both a model_state and an optimizer file

SIM_TIMEOUT_S = 120
WAIT_TIMEOUT_S = 60

RESUMED = re.compile(r"^resumed step=(\d+) from=\w+ verified_elements=(\d+)\b", re.M)
DONE = re.compile(r"^done rank=(\d+) last_step=(\d+) saves=(\d+) blocked_in_save_ms=([0-9.]+)", re.M)


class Harness(DaemonHarness):
    def __init__(self, bin_dir, tmp):
        super().__init__(bin_dir, tmp)
        self.job = "itest-%d" % os.getpid()
        self.job_dir = os.path.join(self.root, self.job)
        self.daemon_log = os.path.join(tmp, "flashckptd.log")
        self.sims = {}     # (phase, rank) -> Popen


    # --- simulators -----------------------------------------------------------------------------

    def start_sims(self, phase, steps, resume=False, step_ms=None, order=None, wait_complete=True):
        procs = {}
        for rank in order or range(WORLD):
            cmd = [self.binary("flashckpt-sim"), "--socket", self.sock, "--job", self.job,
                   "--rank", str(rank), "--world-size", str(WORLD), "--tp-degree", str(TP),
                   "--shard-degree", str(SHARD), "--layers", str(LAYERS), "--hidden", str(HIDDEN),
                   "--steps", str(steps), "--save-every", str(SAVE_EVERY),
                   # One run id for the phase's ranks: a rank that starts after another has finished
                   # would otherwise be a run of its own, and its steps would never complete.
                   "--run-id", "%s-%s" % (self.job, phase)]
            if resume:
                cmd.append("--resume")
            if step_ms is not None:
                cmd += ["--step-ms", str(step_ms)]
            if not wait_complete:  # a rank is killed: the survivors' last step never completes
                cmd.append("--no-wait-complete")
            path = os.path.join(self.tmp, "%s.rank%d.log" % (phase, rank))
            self.logs.append(path)
            with open(path, "wb") as out:
                procs[rank] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.sims[(phase, rank)] = procs[rank]
        log("%s: started %d ranks (steps=%d resume=%s step_ms=%s)" % (phase, WORLD, steps, resume, step_ms))
        return procs

    def wait_sims(self, phase, procs):
        deadline = time.monotonic() + SIM_TIMEOUT_S
        results = {}
        for rank, p in procs.items():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TestFailure("%s: rank %d still running after %ds" % (phase, rank, SIM_TIMEOUT_S))
            with open(os.path.join(self.tmp, "%s.rank%d.log" % (phase, rank)), "r", errors="replace") as f:
                results[rank] = (p.returncode, f.read())
        return results

    def kill_all(self):
        kill_processes(self.sims.values())

    # --- the operator CLI -----------------------------------------------------------------------


    def cli_json(self, *args):
        rc, out, err = self.cli("--socket", self.sock, *args, "--json")
        check(rc == 0, "flashckpt %s --json exited %d: %s%s" % (" ".join(args), rc, out, err))
        try:
            return json.loads(out)
        except ValueError as e:
            raise TestFailure("flashckpt %s --json printed no JSON (%s): %r" % (" ".join(args), e, out[:2000]))

    # --- the checkpoint tree --------------------------------------------------------------------

    def ckpt(self, step):
        return os.path.join(self.job_dir, "checkpoint-%d" % step)

    def latest(self):
        try:
            return reader.read_latest(self.job_dir)
        except (OSError, reader.CheckpointError):
            return None

    def settled_state(self, quiet_s=1.0, timeout=WAIT_TIMEOUT_S):
        """Waits until LATEST and the set of complete checkpoints stop changing and agree."""
        deadline = time.monotonic() + timeout
        last, since = None, time.monotonic()
        while True:
            state = (self.latest(), tuple(reader.complete_steps(self.job_dir)))
            if state != last:
                last, since = state, time.monotonic()
            elif time.monotonic() - since >= quiet_s and state[1] and state[0] == state[1][-1]:
                return state[0], list(state[1])
            if time.monotonic() > deadline:
                raise TestFailure("checkpoint tree did not settle within %ds: LATEST=%s complete=%s" %
                                  (timeout, state[0], list(state[1])))
            time.sleep(0.05)

    def verify_with_reader(self, step):
        try:
            s = reader.verify_checkpoint(self.ckpt(step), layers=LAYERS, hidden=HIDDEN)
        except reader.CheckpointError as e:
            raise TestFailure("independent reader rejects checkpoint-%d: %s" % (step, e))
        check(s["job"] == self.job and s["step"] == step and s["world_size"] == WORLD,
              "checkpoint-%d: reader summary %s" % (step, s))
        check(s["elements"] == 3 * LAYERS * HIDDEN * HIDDEN,
              "checkpoint-%d: %d elements checked, expected %d" % (step, s["elements"], 3 * LAYERS * HIDDEN * HIDDEN))
        return s


def expected_files():
    """Every rank writes an optimizer file; only shard 0 writes model_state (others hold replicas)."""
    names = set()
    for rank in range(WORLD):
        tp, shard = rank % TP, rank // TP
        names.add("optimizer.tp%02d_pp00_shard%02d.safetensors" % (tp, shard))
        if shard == 0:
            names.add("model_state.tp%02d_pp00_shard%02d.safetensors" % (tp, shard))
    return names


def saves_between(after, upto):
    return len([s for s in range(after + 1, upto + 1) if s % SAVE_EVERY == 0])


def check_finished(phase, results, last_step, saves):
    for rank, (rc, out) in sorted(results.items()):
        check(rc == 0, "%s: rank %d exited with %d:\n%s" % (phase, rank, rc, out[-3000:]))
        done = DONE.findall(out)
        check(len(done) == 1, "%s: rank %d printed %d 'done' lines:\n%s" % (phase, rank, len(done), out[-3000:]))
        r, last, n, _ = done[0]
        check((int(r), int(last), int(n)) == (rank, last_step, saves),
              "%s: rank %d: %r, expected rank=%d last_step=%d saves=%d" % (phase, rank, done[0], rank, last_step, saves))


def check_resumed(phase, results, step):
    for rank, (rc, out) in sorted(results.items()):
        found = RESUMED.findall(out)
        check(len(found) == 1, "%s: rank %d printed %d 'resumed' lines:\n%s" % (phase, rank, len(found), out[-3000:]))
        s, n = int(found[0][0]), int(found[0][1])
        check(s == step, "%s: rank %d resumed at step %d, LATEST and the newest complete checkpoint say %d "
              "(a newer one means another rank completed it before this one restored)" % (phase, rank, s, step))
        check(n > 0, "%s: rank %d verified %d elements after resuming" % (phase, rank, n))
        log("%s: rank %d resumed step=%d verified_elements=%d" % (phase, rank, s, n))


def walk(obj):
    """Every value in a JSON document, dict keys included (a listing may be keyed by job)."""
    yield obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from walk(v)


def as_int(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def run(h):
    h.start_daemon()

    # --- 1. three checkpoints -------------------------------------------------------------------
    procs = h.start_sims("phase1", PHASE1_STEPS)
    results = h.wait_sims("phase1", procs)
    check_finished("phase1", results, PHASE1_STEPS, PHASE1_STEPS // SAVE_EVERY)
    latest, complete = h.settled_state()
    check(complete == [10, 20, 30], "phase1: complete checkpoints %s, expected [10, 20, 30]" % complete)
    check(latest == 30, "phase1: LATEST is %s, expected 30" % latest)
    for step in complete:
        files = {n for n in os.listdir(h.ckpt(step)) if n.endswith(".safetensors")}
        check(files == expected_files(), "checkpoint-%d holds %s, expected %s" % (step, sorted(files),
                                                                                 sorted(expected_files())))
        s = h.verify_with_reader(step)
        log("phase1: checkpoint-%d verified by the independent reader (%d files, %d elements)" %
            (step, s["files"], s["elements"]))

    # --- 2. run on, kill one rank once a later checkpoint is complete ---------------------------
    procs = h.start_sims("phase2", FINAL_STEP, resume=True, step_ms=PHASE2_STEP_MS, wait_complete=False)
    wait_for(lambda: os.path.isfile(os.path.join(h.ckpt(40), "metadata.json")), WAIT_TIMEOUT_S,
             "checkpoint-40 to complete")
    status = h.cli_json("status")
    check(any(v == h.job for v in walk(status)), "status --json does not show job %s: %s" %
          (h.job, json.dumps(status)[:2000]))
    log("phase2: status --json shows the job while its ranks run")
    wait_for(lambda: os.path.isfile(os.path.join(h.ckpt(KILL_AFTER_STEP), "metadata.json")), WAIT_TIMEOUT_S,
             "checkpoint-%d to complete" % KILL_AFTER_STEP)
    victim = procs[VICTIM]
    check(victim.poll() is None, "phase2: rank %d already exited (%s) before the kill; raise FINAL_STEP" %
          (VICTIM, victim.returncode))
    victim.kill()
    log("phase2: checkpoint-%d is complete; SIGKILLed rank %d (pid %d)" % (KILL_AFTER_STEP, VICTIM, victim.pid))
    results = h.wait_sims("phase2", procs)
    check(results[VICTIM][0] == -signal.SIGKILL, "phase2: victim exit status %s" % results[VICTIM][0])
    check(not DONE.search(results[VICTIM][1]), "phase2: the killed rank printed its 'done' line")
    survivors = {r: v for r, v in results.items() if r != VICTIM}
    check_resumed("phase2", survivors, 30)  # the victim's buffered stdout may have died with it
    check_finished("phase2", survivors, FINAL_STEP, saves_between(30, FINAL_STEP))

    latest, complete = h.settled_state()
    log("phase2: LATEST=%d, complete checkpoints %s" % (latest, complete))
    check(latest >= KILL_AFTER_STEP, "phase2: LATEST %d is older than checkpoint-%d, which was complete" %
          (latest, KILL_AFTER_STEP))
    check(latest < FINAL_STEP, "phase2: checkpoint-%d is complete although rank %d was killed before it" %
          (FINAL_STEP, VICTIM))
    final_dir = h.ckpt(FINAL_STEP)
    check(os.path.isdir(final_dir), "phase2: the survivors left no %s" % final_dir)
    check(not os.path.exists(os.path.join(final_dir, "saved_signal_%d" % VICTIM)),
          "phase2: %s has the killed rank's signal" % final_dir)
    for rank in survivors:
        check(os.path.exists(os.path.join(final_dir, "saved_signal_%d" % rank)),
              "phase2: %s lacks saved_signal_%d of a rank that finished" % (final_dir, rank))
    h.verify_with_reader(latest)
    log("phase2: checkpoint-%d (LATEST) verified by the independent reader" % latest)

    # --- 3. resume all four ---------------------------------------------------------------------
    # The victim starts last: only its saves can complete the survivors' leftover checkpoints.
    procs = h.start_sims("phase3", FINAL_STEP, resume=True, step_ms=PHASE3_STEP_MS,
                         order=[r for r in range(WORLD) if r != VICTIM] + [VICTIM])
    results = h.wait_sims("phase3", procs)
    check_resumed("phase3", results, latest)
    check_finished("phase3", results, FINAL_STEP, saves_between(latest, FINAL_STEP))
    latest, complete = h.settled_state()
    check(latest == FINAL_STEP, "phase3: LATEST is %d, expected %d" % (latest, FINAL_STEP))
    for step in complete:
        h.verify_with_reader(step)
    log("phase3: complete checkpoints %s all verified by the independent reader" % complete)

    # --- 4. the operator CLI --------------------------------------------------------------------
    rc, out, err = h.cli("verify", h.ckpt(FINAL_STEP))
    check(rc == 0, "flashckpt verify %s exited %d:\n%s%s" % (h.ckpt(FINAL_STEP), rc, out, err))
    log("flashckpt verify accepts checkpoint-%d" % FINAL_STEP)

    bad_file = "optimizer.tp01_pp00_shard01.safetensors"
    rc = check_flipped_byte_is_caught(h, h.ckpt(FINAL_STEP), bad_file, "layers.2.weight.exp_avg")
    log("flashckpt verify rejects a flipped byte in %s (exit %d)" % (bad_file, rc))

    listing = h.cli_json("list", "--job", h.job)
    values = list(walk(listing))
    check(h.job in values, "list --json does not show job %s: %s" % (h.job, json.dumps(listing)[:2000]))
    steps = {as_int(d.get("step")) for d in values if isinstance(d, dict) and "step" in d}
    check(FINAL_STEP in steps and 10 in steps,
          "list --json shows steps %s, expected 10 and %d among them" % (sorted(s for s in steps if s is not None),
                                                                        FINAL_STEP))
    listing_all = h.cli_json("list")
    check(h.job in list(walk(listing_all)), "list --json (all jobs) does not show job %s" % h.job)
    status = h.cli_json("status")
    check(isinstance(status, dict), "status --json is not an object")
    log("list --json and status --json parse and show the job")

    # --- 5. clean shutdown ----------------------------------------------------------------------
    rc = h.stop_daemon()
    check(rc == 0, "flashckptd exited with %s on SIGTERM, expected 0" % rc)
    log("flashckptd stopped cleanly on SIGTERM")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True, help="folder with flashckptd, flashckpt-sim and flashckpt")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()

    return run_with_daemon_harness(run, "fc-it.", lambda h: [h.job], args.bin_dir, args.keep,
                                   errors=(TestFailure, reader.CheckpointError, subprocess.TimeoutExpired, OSError),
                                   harness=Harness)

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Memory checkpoints with real processes: a real flashckptd, four flashckpt-sim ranks (tp=2 x
shard=2, so replicas are held too) killed with SIGKILL, resumed from the daemon's memory.

  1. The ranks take a memory checkpoint every step and save to disk every 10
     (--memory-every 1 --save-every 10) and stop at step 27 (--hold-after 27); all four are
     SIGKILLed there. Checkpoint 20 is the newest on disk; 21..27 were never written.
  2. All four resume: each prints `resumed step=27 from=memory` and checks every element of its
     state against the formula of step 27; they run to step 30 and save it.
  3. They resume again: step 30 on disk is newer than any step in memory (29), so every rank
     resumes from disk at 30; they run on to 37 and are SIGKILLed there.
  4. One data byte of rank 1's slot holding step 37 is flipped in shared memory. The resume finds it
     by its checksums, never hands it over, and every rank resumes from disk at 30; the daemon's log
     says why.
  5. Every complete checkpoint is read back by the independent reader.
  6. The ranks resume (from disk at 40), run to 44 and are SIGKILLed there; then the daemon is
     SIGKILLed too and a new one started on the same socket and state directory. It adopts the
     memory checkpoints with the segments: every rank resumes at 44 from memory.
  7. They run to 47 and are SIGKILLed there; SIGTERM stops the daemon, which first writes the newest
     memory checkpoint (--persist-on-stop, the default): checkpoint-47 is complete on disk and the
     independent reader verifies it.
  8. A rank of one (no replica: its disk checkpoints double as memory ones) saves step 10 to disk;
     once the slot keeps it in memory the daemon is SIGKILLed and restarted while the rank still
     trains. The new daemon adopts step 10 as a memory checkpoint that is also on disk, and the
     rank's WaitPersisted(10), retried across the restart, succeeds (a memory-only step would be
     refused as never written).

    test_memory_tier.py --bin-dir build/bin [--keep]
"""

import argparse
import glob
import os
import re
import signal
import struct
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashckpt_reader as reader  # noqa: E402
from harness import SimPhases, TestFailure, check, log, run_with_daemon_harness, wait_for  # noqa: E402

WORLD, TP, SHARD = 4, 2, 2
LAYERS, HIDDEN = 4, 128
SLOTS = 2
SEGMENT_HEADER = 4096   # kSegmentHeaderBytes: the segment's header page, then the slots
SLOT_HEADER = 4096      # each slot starts with its header page (state u32, resident u32, step i64, ...)
STATE_FREE = 0
TIMEOUT_S = 120

DONE = re.compile(r"^done rank=(\d+) last_step=(\d+)", re.M)


class Harness(SimPhases):
    timeout_s = TIMEOUT_S

    def __init__(self, bin_dir, tmp):
        super().__init__(bin_dir, tmp)
        self.job = "memtier-%d" % os.getpid()
        self.single_job = "memtier1-%d" % os.getpid()
        self.job_dir = os.path.join(self.root, self.job)

    def start_sims(self, phase, steps, resume, hold_after=None):
        commands = {}
        for rank in range(WORLD):
            cmd = [self.binary("flashckpt-sim"), "--socket", self.sock, "--job", self.job,
                   "--rank", str(rank), "--world-size", str(WORLD), "--tp-degree", str(TP),
                   "--shard-degree", str(SHARD), "--layers", str(LAYERS), "--hidden", str(HIDDEN),
                   "--steps", str(steps), "--save-every", "10", "--memory-every", "1",
                   "--run-id", "%s-%s" % (self.job, phase)]
            if resume:
                cmd.append("--resume")
            if hold_after is not None:
                cmd += ["--hold-after", str(hold_after)]
            commands[rank] = cmd
        procs = self.spawn_sims(phase, commands)
        log("%s: started %d ranks (steps=%d resume=%s hold_after=%s)" % (phase, WORLD, steps, resume, hold_after))
        return procs

    def finish(self, phase, procs, last_step):
        deadline = time.monotonic() + TIMEOUT_S
        for rank, p in procs.items():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TestFailure("%s: rank %d still running after %ds" % (phase, rank, TIMEOUT_S))
            out = self.output(phase, rank)
            check(p.returncode == 0, "%s: rank %d exited with %d:\n%s" % (phase, rank, p.returncode, out[-3000:]))
            done = DONE.findall(out)
            check(done == [(str(rank), str(last_step))], "%s: rank %d: done lines %s" % (phase, rank, done))

    def complete_steps(self):
        return reader.complete_steps(self.job_dir)

    def segment(self, rank, job=None):
        """The /dev/shm path of the rank's slot segment (the job has no EMA: its only one)."""
        paths = glob.glob("/dev/shm/flashckpt.%s.%d.*" % (job or self.job, rank))
        check(len(paths) == 1, "rank %d: segments %s" % (rank, paths))
        return paths[0]


def kept_slot(path, step):
    """The offset of the FREE slot whose mirror says it holds memory checkpoint `step`, once there is one."""
    found = []

    def look():
        size = os.path.getsize(path)
        stride = (size - SEGMENT_HEADER) // SLOTS
        with open(path, "rb") as f:
            for slot in range(SLOTS):
                at = SEGMENT_HEADER + slot * stride
                f.seek(at)
                state, resident, held = struct.unpack("<IIq", f.read(16))
                if state == STATE_FREE and resident == 1 and held == step:
                    found.append(at)
                    return True
        return False

    wait_for(look, TIMEOUT_S, "a free slot of %s holding step %d" % (path, step))
    return found[0]


def flip_tensor_byte(path, slot):
    """Flips one bit of the first tensor of the slot's first file image (8-byte header length,
    the JSON header, then the data)."""
    with open(path, "r+b") as f:
        image = slot + SLOT_HEADER
        f.seek(image)
        (header,) = struct.unpack("<Q", f.read(8))
        at = image + 8 + header + 16
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def run(h):
    h.start_daemon(extra_args=["--slots", str(SLOTS)])

    # --- 1. memory every step, disk every 10; all killed at 27 ----------------------------------
    procs = h.start_sims("phase1", 100, resume=False, hold_after=27)
    h.hold_and_kill("phase1", procs, 27)
    wait_for(lambda: 20 in h.complete_steps(), TIMEOUT_S, "checkpoint-20 to complete")
    check(h.complete_steps() == [10, 20], "phase1: complete checkpoints %s" % h.complete_steps())
    check(not os.path.exists(os.path.join(h.job_dir, "checkpoint-27")), "phase1: step 27 was written")

    # --- 2. resumed from memory at 27 ------------------------------------------------------------
    procs = h.start_sims("phase2", 30, resume=True)
    h.check_all_resumed("phase2", procs, 27, "memory")
    h.finish("phase2", procs, 30)
    wait_for(lambda: 30 in h.complete_steps(), TIMEOUT_S, "checkpoint-30 to complete")

    # --- 3. disk 30 is newer than memory 29: from disk; run to 37 and kill ---------------------
    procs = h.start_sims("phase3", 100, resume=True, hold_after=37)
    h.check_all_resumed("phase3", procs, 30, "disk")
    h.hold_and_kill("phase3", procs, 37)

    # --- 4. a flipped byte in rank 1's memory checkpoint 37: everyone from disk at 30 ----------
    path = h.segment(1)
    slot = kept_slot(path, 37)
    flip_tensor_byte(path, slot)
    log("phase4: flipped one byte of rank 1's memory checkpoint 37 (%s, slot at %d)" % (path, slot))
    procs = h.start_sims("phase4", 40, resume=True)
    h.check_all_resumed("phase4", procs, 30, "disk")
    h.finish("phase4", procs, 40)
    with open(h.daemon_log, "r", errors="replace") as f:
        daemon_log = f.read()
    check("memory checkpoint failed its checksums" in daemon_log and "step=37" in daemon_log,
          "the daemon's log does not say why rank 1's memory checkpoint 37 was not used")
    log("phase4: the daemon logged the checksum failure and the job resumed from disk")

    # --- 5. the files ---------------------------------------------------------------------------
    wait_for(lambda: 40 in h.complete_steps(), TIMEOUT_S, "checkpoint-40 to complete")
    for step in h.complete_steps():
        try:
            s = reader.verify_checkpoint(os.path.join(h.job_dir, "checkpoint-%d" % step), layers=LAYERS,
                                         hidden=HIDDEN)
        except reader.CheckpointError as e:
            raise TestFailure("independent reader rejects checkpoint-%d: %s" % (step, e))
        check(s["step"] == step and s["world_size"] == WORLD, "checkpoint-%d: %s" % (step, s))
    log("complete checkpoints %s verified by the independent reader" % h.complete_steps())

    # --- 6. killed at 44, the daemon SIGKILLed and restarted: from memory at 44 ------------------
    procs = h.start_sims("phase6", 100, resume=True, hold_after=44)
    h.check_all_resumed("phase6", procs, 40, "disk")
    h.hold_and_kill("phase6", procs, 44)
    for rank in range(WORLD):
        kept_slot(h.segment(rank), 44)  # every rank's memory checkpoint 44 is kept (checksummed) first
    h.daemon.kill()
    h.daemon.wait(timeout=TIMEOUT_S)
    check(h.daemon.returncode == -signal.SIGKILL, "flashckptd exit status %s" % h.daemon.returncode)
    log("phase6: flashckptd SIGKILLed with memory step 44 held by every rank (disk's newest: 40)")
    h.daemon_log = os.path.join(h.tmp, "flashckptd.restarted.log")
    h.start_daemon(extra_args=["--slots", str(SLOTS)])
    procs = h.start_sims("phase7", 100, resume=True, hold_after=47)
    h.check_all_resumed("phase7", procs, 44, "memory")
    with open(h.daemon_log, "r", errors="replace") as f:
        adopted = f.read().count("step=44 tier=memory: kept before the restart")
    check(adopted == WORLD, "phase7: the restarted daemon logged %d adopted memory checkpoints, expected %d" %
          (adopted, WORLD))

    # --- 7. killed at 47 with disk at 40: a SIGTERM writes memory step 47 ------------------------
    h.hold_and_kill("phase7", procs, 47)
    check(47 not in h.complete_steps(), "phase7: step 47 was written before the stop")
    rc = h.stop_daemon()
    check(rc == 0, "flashckptd exited with %s on SIGTERM" % rc)
    check(47 in h.complete_steps(), "phase6: checkpoint-47 is not complete after the SIGTERM; complete: %s"
          % h.complete_steps())
    try:
        s = reader.verify_checkpoint(os.path.join(h.job_dir, "checkpoint-47"), layers=LAYERS, hidden=HIDDEN)
    except reader.CheckpointError as e:
        raise TestFailure("independent reader rejects checkpoint-47: %s" % e)
    check(s["step"] == 47 and s["world_size"] == WORLD, "checkpoint-47: %s" % s)
    log("phase7: the SIGTERM wrote memory step 47 of all %d ranks; the independent reader verifies it" % WORLD)

    # --- 8. a disk step kept in memory, the daemon SIGKILLed: WaitPersisted of it still succeeds --
    h.daemon_log = os.path.join(h.tmp, "flashckptd.phase8.log")
    h.start_daemon(extra_args=["--slots", str(SLOTS)])
    cmd = [h.binary("flashckpt-sim"), "--socket", h.sock, "--job", h.single_job, "--rank", "0", "--world-size", "1",
           "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--steps", "16", "--save-every", "10",
           "--memory-every", "1000", "--step-ms", "250", "--tolerate-daemon-restarts", "--run-id", h.single_job]
    path = os.path.join(h.tmp, "phase8.rank0.log")
    h.logs.append(path)
    with open(path, "wb") as out:
        sim = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    h.sims.append(sim)

    def output():
        with open(path, "r", errors="replace") as f:
            return f.read()
    wait_for(lambda: "saved step=10" in output() or sim.poll() is not None, TIMEOUT_S, "phase8: step 10 saved")
    kept_slot(h.segment(0, h.single_job), 10)  # written, and kept by its slot as a memory checkpoint
    check(sim.poll() is None and "done rank" not in output(), "phase8: the rank finished before the kill:\n"
          + output()[-2000:])
    h.daemon.kill()
    h.daemon.wait(timeout=TIMEOUT_S)
    h.daemon_log = os.path.join(h.tmp, "flashckptd.phase8.restarted.log")
    h.start_daemon(extra_args=["--slots", str(SLOTS)])
    log("phase8: flashckptd SIGKILLed with disk step 10 kept in memory, and restarted")
    sim.wait(timeout=TIMEOUT_S)
    check(sim.returncode == 0 and "done rank=0 last_step=16" in output(),
          "phase8: the rank failed across the restart (exit %s):\n%s" % (sim.returncode, output()[-3000:]))
    with open(h.daemon_log, "r", errors="replace") as f:
        restarted = f.read()
    check("step=10 tier=memory: kept before the restart (also on disk)" in restarted,
          "phase8: the restarted daemon did not adopt step 10 as a memory checkpoint also on disk")
    log("phase8: adopted as a memory checkpoint also on disk; the rank's WaitPersisted(10) succeeded")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True, help="folder with flashckptd and flashckpt-sim")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    return run_with_daemon_harness(run, "fc-mem.", lambda h: [h.job, h.single_job], args.bin_dir, args.keep,
                                   errors=(TestFailure, reader.CheckpointError, subprocess.TimeoutExpired, OSError),
                                   harness=Harness)


if __name__ == "__main__":
    sys.exit(main())

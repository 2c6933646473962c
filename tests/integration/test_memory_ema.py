#!/usr/bin/python3
"""Memory checkpoints of ranks with the daemon's EMA: a real flashckptd and two flashckpt-sim ranks
(tp=2, EMA decay 0.9 every step) that take a memory checkpoint every step and save to disk every 10.
Each memory checkpoint holds the EMA of its step, so a rank resumed from memory carries on the
average exactly where it was: every EMA below is compared, bit for bit, with the EMA of an
uninterrupted run of the same steps (a job of its own, --dump-ema at its last step).

  1. Uninterrupted references: steps 1..40 and 1..50.
  2. The job is SIGKILLed at step 27 (disk's newest: 20); it resumes from memory at 27
     (`resumed step=27 from=memory`), runs to 40 and dumps its EMA: equal to the reference's at 40.
  3. It resumes (from disk at 40), is SIGKILLed at 44, and so is the daemon. A new daemon on the same
     socket and state directory adopts the memory checkpoints with their EMA; the job resumes from
     memory at 44, runs to 50: its EMA equals the reference's at 50.
  4. It resumes from disk at 50, is SIGKILLed at 53, and SIGTERM stops the daemon, which writes
     memory step 53 (--persist-on-stop): checkpoint-53's EMA files hold the EMA of step 53, which a
     new run resumed from it carries on to 60, equal to a reference of 1..60.

    test_memory_ema.py --bin-dir build/bin [--keep]
"""

import argparse
import glob
import os
import re
import signal
import struct
import subprocess
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import SimPhases, TestFailure, check, log, run_with_daemon_harness, wait_for  # noqa: E402

WORLD, TP = 2, 2
LAYERS, HIDDEN = 2, 64
SLOTS = 3
SEGMENT_HEADER = 4096  # kSegmentHeaderBytes: the segment's header page, then the slots
STATE_FREE = 0
TIMEOUT_S = 120

EMA_LINE = re.compile(r"^ema step=(-?\d+) tensors=(\d+)$", re.M)


class Harness(SimPhases):
    timeout_s = TIMEOUT_S

    def __init__(self, bin_dir, tmp):
        super().__init__(bin_dir, tmp)
        self.job = "memema-%d" % os.getpid()
        self.refs = {}  # last step -> reference job name

    def jobs(self):
        return [self.job] + list(self.refs.values())

    def start_sims(self, job, phase, steps, resume=False, hold_after=None):
        commands = {}
        for rank in range(WORLD):
            dump = os.path.join(self.tmp, phase, "rank%d" % rank)
            os.makedirs(dump, exist_ok=True)
            cmd = [self.binary("flashckpt-sim"), "--socket", self.sock, "--job", job, "--rank", str(rank),
                   "--world-size", str(WORLD), "--tp-degree", str(TP), "--layers", str(LAYERS),
                   "--hidden", str(HIDDEN), "--steps", str(steps), "--save-every", "10", "--memory-every", "1",
                   "--ema-decay", "0.9", "--ema-interval", "1", "--dump-ema", dump,
                   "--run-id", "%s-%s" % (job, phase)]
            if resume:
                cmd.append("--resume")
            if hold_after is not None:
                cmd += ["--hold-after", str(hold_after)]
            commands[rank] = cmd
        procs = self.spawn_sims(phase, commands)
        log("%s: started %d ranks of %s (steps=%d resume=%s hold_after=%s)" %
            (phase, WORLD, job, steps, resume, hold_after))
        return procs

    def ema(self, phase, rank):
        """{tensor: bytes} of the EMA the rank dumped at its last step."""
        folder = os.path.join(self.tmp, phase, "rank%d" % rank)
        out = {}
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), "rb") as f:
                out[name] = f.read()
        return out

    def finish(self, phase, procs, last_step):
        for rank, p in procs.items():
            try:
                p.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise TestFailure("%s: rank %d still running after %ds" % (phase, rank, TIMEOUT_S))
            out = self.output(phase, rank)
            check(p.returncode == 0, "%s: rank %d exited with %d:\n%s" % (phase, rank, p.returncode, out[-3000:]))
            emas = EMA_LINE.findall(out)
            check(emas and int(emas[-1][0]) == last_step and int(emas[-1][1]) > 0,
                  "%s: rank %d dumped no EMA of step %d: %s" % (phase, rank, last_step, emas))

    def reference(self, steps):
        job = "memema-ref%d-%d" % (steps, os.getpid())
        self.refs[steps] = job
        phase = "ref%d" % steps
        self.finish(phase, self.start_sims(job, phase, steps), steps)
        return phase

    def check_same_ema(self, phase, ref_phase, step):
        for rank in range(WORLD):
            got, want = self.ema(phase, rank), self.ema(ref_phase, rank)
            check(sorted(got) == sorted(want) and got, "%s: rank %d dumped tensors %s, the reference %s" %
                  (phase, rank, sorted(got), sorted(want)))
            for name in want:
                check(got[name] == want[name], "%s: rank %d: the EMA of %s at step %d differs from the "
                      "uninterrupted run's" % (phase, rank, name, step))
        log("%s: the EMA at step %d equals the uninterrupted run's, bit for bit, on both ranks" % (phase, step))

    def segment(self, rank):
        """The /dev/shm path of the rank's slot segment (not its EMA segment)."""
        paths = [p for p in glob.glob("/dev/shm/flashckpt.%s.%d.*" % (self.job, rank)) if not p.endswith(".ema")]
        check(len(paths) == 1, "rank %d: segments %s" % (rank, paths))
        return paths[0]

    def step_dir(self, step):
        return os.path.join(self.root, self.job, "checkpoint-%d" % step)


def holds(path, step):
    """Whether a FREE slot of the segment at `path` mirrors holding memory checkpoint `step` (kept)."""
    stride = (os.path.getsize(path) - SEGMENT_HEADER) // SLOTS
    with open(path, "rb") as f:
        for slot in range(SLOTS):
            f.seek(SEGMENT_HEADER + slot * stride)
            state, resident, held = struct.unpack("<IIq", f.read(16))
            if state == STATE_FREE and resident == 1 and held == step:
                return True
    return False


def run(h):
    h.start_daemon(extra_args=["--slots", str(SLOTS)])

    # --- 1. the uninterrupted references ---------------------------------------------------------
    ref40, ref50, ref60 = h.reference(40), h.reference(50), h.reference(60)

    # --- 2. killed at 27, resumed from memory, on to 40 ------------------------------------------
    procs = h.start_sims(h.job, "kill27", 100, hold_after=27)
    h.hold_and_kill("kill27", procs, 27)
    procs = h.start_sims(h.job, "resume27", 40, resume=True)
    h.check_all_resumed("resume27", procs, 27, "memory")
    h.finish("resume27", procs, 40)
    h.check_same_ema("resume27", ref40, 40)

    # --- 3. killed at 44 with the daemon; the next daemon adopts memory step 44 with its EMA ---
    procs = h.start_sims(h.job, "kill44", 100, resume=True, hold_after=44)
    h.check_all_resumed("kill44", procs, 40, "disk")
    h.hold_and_kill("kill44", procs, 44)
    for rank in range(WORLD):
        wait_for(lambda: holds(h.segment(rank), 44), TIMEOUT_S, "rank %d's memory checkpoint 44 to be kept" % rank)
    h.daemon.kill()
    h.daemon.wait(timeout=TIMEOUT_S)
    check(h.daemon.returncode == -signal.SIGKILL, "flashckptd exit status %s" % h.daemon.returncode)
    h.daemon_log = os.path.join(h.tmp, "flashckptd.restarted.log")
    h.start_daemon(extra_args=["--slots", str(SLOTS)])
    procs = h.start_sims(h.job, "resume44", 50, resume=True)
    h.check_all_resumed("resume44", procs, 44, "memory")
    h.finish("resume44", procs, 50)
    h.check_same_ema("resume44", ref50, 50)

    # --- 4. killed at 53; the stop writes memory step 53 with its EMA ---------------------------
    procs = h.start_sims(h.job, "kill53", 100, resume=True, hold_after=53)
    h.check_all_resumed("kill53", procs, 50, "disk")
    h.hold_and_kill("kill53", procs, 53)
    for rank in range(WORLD):  # kept (checksummed) before the stop, as in part 3
        wait_for(lambda: holds(h.segment(rank), 53), TIMEOUT_S, "rank %d's memory checkpoint 53 to be kept" % rank)
    check(not os.path.exists(os.path.join(h.step_dir(53), "metadata.json")), "step 53 was written before the stop")
    rc = h.stop_daemon()
    check(rc == 0, "flashckptd exited with %s on SIGTERM" % rc)
    check(os.path.exists(os.path.join(h.step_dir(53), "metadata.json")),
          "checkpoint-53 is not complete after the SIGTERM (--persist-on-stop)")
    check(any(name.startswith("ema.") for name in os.listdir(h.step_dir(53))), "checkpoint-53 has no EMA file")
    h.daemon_log = os.path.join(h.tmp, "flashckptd.third.log")
    h.start_daemon(extra_args=["--slots", str(SLOTS)])
    procs = h.start_sims(h.job, "resume53", 60, resume=True)
    h.check_all_resumed("resume53", procs, 53, "disk")
    h.finish("resume53", procs, 60)
    h.check_same_ema("resume53", ref60, 60)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True, help="folder with flashckptd and flashckpt-sim")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    return run_with_daemon_harness(run, "fc-memema.", lambda h: h.jobs(), args.bin_dir, args.keep,
                                   errors=(TestFailure, subprocess.TimeoutExpired, OSError), harness=Harness)


if __name__ == "__main__":
    sys.exit(main())

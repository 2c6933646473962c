#!/usr/bin/python3
"""One daemon per socket and state directory: a second flashckptd started beside a live one exits
non-zero, names the process that holds the socket or the state directory, and touches nothing.

  A live daemon serves a flashckpt-sim trainer that saves every few steps for a while. Meanwhile:
  1. a second daemon with the same --socket and --root, and one with the same --socket and another
     --root: each is refused because the socket has a listener (its pid named);
  2. a daemon on another socket but with the live daemon's --state-dir and another --root: refused by
     the state directory's lock (the live daemon's pid named).
  After each: the live daemon's state directory and shared-memory segments are exactly as they
  were, the other root holds no checkpoint, and at the end the trainer finishes every save and exits
  0 (it never noticed).

    test_second_daemon.py --bin-dir build/bin [--keep]
"""

import argparse
import glob
import os
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (DaemonHarness, TestFailure, check, daemon_command, kill_processes, log,  # noqa: E402
                     run_with_daemon_harness, tail, wait_for)

JOB = "second%d" % os.getpid()
STEPS, SAVE_EVERY, STEP_MS = 400, 20, 25  # about 10 s of training, 20 saves


def state_files(h):
    return sorted(os.listdir(h.sock + ".state"))


def segments():
    return sorted(glob.glob("/dev/shm/flashckpt.%s.*" % JOB))


def second_daemon(h, name, args):
    """Runs flashckptd with args to its exit (30 s at most): (exit status, its output)."""
    out = os.path.join(h.tmp, name + ".log")
    h.logs.append(out)
    cmd = [h.binary("flashckptd"), "--max-host-memory", "1GiB", "--log-level", "info"] + args
    log("starting %s" % " ".join(cmd))
    with open(out, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=30).returncode
    with open(out, errors="replace") as f:
        return rc, f.read()


def check_untouched(h, before_state, before_segments, what):
    # The live daemon's records change as its trainer commits; the segments' records (.reg) and the
    # segments themselves must all still be there.
    regs = [n for n in before_state if n.endswith(".reg")]
    now = state_files(h)
    check(all(n in now for n in regs), "%s: segment records of the live daemon are gone: %s -> %s"
          % (what, before_state, now))
    check("daemon.lock" in now, "%s: the live daemon's lock file is gone: %s" % (what, now))
    check(segments() == before_segments, "%s: the live daemon's segments changed: %s -> %s"
          % (what, before_segments, segments()))


def run(h):
    h.start_daemon()
    sim_log = os.path.join(h.tmp, "sim.log")
    h.logs.append(sim_log)
    sim_cmd = [h.binary("flashckpt-sim"), "--socket", h.sock, "--job", JOB, "--rank", "0", "--world-size", "1",
               "--layers", "2", "--hidden", "64", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
               "--step-ms", str(STEP_MS), "--wait-timeout", "60"]
    with open(sim_log, "wb") as f:
        sim = subprocess.Popen(sim_cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    h.procs = [sim]
    try:
        wait_for(lambda: os.path.exists(os.path.join(h.root, JOB, "LATEST")), 60, "a first complete checkpoint")
        before_state, before_segments = state_files(h), segments()
        check(before_segments, "the live daemon has no segment of %s" % JOB)
        check("daemon.lock" in before_state, "the live daemon holds no daemon.lock: %s" % before_state)
        pid = str(h.daemon.pid)

        other_root = os.path.join(h.tmp, "other-root")
        for name, root in (("same-root", h.root), ("other-root", other_root)):
            rc, out = second_daemon(h, "second-" + name, ["--socket", h.sock, "--root", root])
            check(rc != 0, "a second daemon on the live socket (%s) exited 0:\n%s" % (name, out[-2000:]))
            check("another daemon (pid %s) is listening on %s" % (pid, h.sock) in out,
                  "the refusal does not name the live daemon (pid %s):\n%s" % (pid, out[-2000:]))
            check("adopted" not in out and "released segment" not in out,
                  "the refused daemon adopted or released segments:\n%s" % out[-2000:])
            check_untouched(h, before_state, before_segments, name)
            log("second daemon on the same socket (%s) refused, exit %d, nothing touched" % (name, rc))

        rc, out = second_daemon(h, "second-state-dir", ["--socket", os.path.join(h.tmp, "other.sock"),
                                                        "--state-dir", h.sock + ".state", "--root", other_root])
        check(rc != 0, "a second daemon on the live state directory exited 0:\n%s" % out[-2000:])
        check("another flashckptd (pid %s) owns the state directory" % pid in out,
              "the refusal does not name the live daemon (pid %s):\n%s" % (pid, out[-2000:]))
        check("adopted" not in out and "released segment" not in out,
              "the refused daemon adopted or released segments:\n%s" % out[-2000:])
        check_untouched(h, before_state, before_segments, "state-dir")
        written = glob.glob(os.path.join(other_root, JOB, "checkpoint-*"))
        check(not written, "the refused daemon wrote checkpoints into its root: %s" % written)
        log("second daemon on the live state directory refused, exit %d, nothing touched" % rc)

        rc = sim.wait(timeout=120)
        check(rc == 0, "the trainer of the live daemon failed (exit %d):\n%s" % (rc, tail(sim_log)))
        with open(os.path.join(h.root, JOB, "LATEST")) as f:
            latest = int(f.read().strip())
        check(latest == STEPS, "LATEST is %d, not the last save %d" % (latest, STEPS))
        log("the trainer finished every save (LATEST %d) and never noticed" % latest)
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait()


class Harness(DaemonHarness):
    def kill_all(self):
        kill_processes(getattr(self, "procs", []))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    return run_with_daemon_harness(run, "fc2nd", [JOB], args.bin_dir, keep=args.keep, harness=Harness)


if __name__ == "__main__":
    sys.exit(main())

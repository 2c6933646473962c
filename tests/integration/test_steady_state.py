#!/usr/bin/python3
"""Host memory stays flat: 1,000 save cycles leave the daemon's RSS and its /dev/shm use unchanged.

A real flashckptd (--keep 3, so retention runs after every save) and one flashckpt-sim rank with
EMA save and persist every step, 1,000 steps. The daemon's VmRSS (/proc/<pid>/status) and the
bytes of its shared-memory segments (/dev/shm/flashckpt.<job>.*, allocated pages) are sampled once
200 checkpoints are complete and again after the last one. /dev/shm use must be identical, and RSS
may grow by at most 1 MiB over the 800 saves (a leak of 1.3 KiB per save would pass that bound only
just; measured here: +276 KiB over 800 saves and +264 KiB over 7,000, i.e. allocator warm-up, not
growth per save). The test prints both samples and retention's result.

Under sanitizers (--sanitized) the allocator keeps freed memory in quarantine, so RSS is printed
but not bounded there.

    test_steady_state.py --bin-dir build/bin [--sanitized] [--keep]
"""

import argparse
import glob
import os
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import TestFailure, check, log, run_with_daemon_harness, tail  # noqa: E402

JOB = "steady-%d" % os.getpid()
STEPS, FIRST_SAMPLE = 1000, 200
MAX_RSS_GROWTH = 1 << 20


def rss_bytes(pid):
    for line in open("/proc/%d/status" % pid):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise TestFailure("no VmRSS for pid %d" % pid)


def shm_bytes():
    total = 0
    for path in glob.glob("/dev/shm/flashckpt.%s.*" % JOB):
        total += os.stat(path).st_blocks * 512
    return total


def latest(h):
    try:
        return int(open(os.path.join(h.root, JOB, "LATEST")).read())
    except (OSError, ValueError):
        return 0


def run(h, sanitized):
    h.start_daemon(extra_args=["--keep", "3"])
    pid = h.daemon.pid
    out = os.path.join(h.tmp, "sim.log")
    h.logs.append(out)
    sim = subprocess.Popen([h.binary("flashckpt-sim"), "--socket", h.sock, "--job", JOB, "--rank", "0",
                            "--world-size", "1", "--layers", "2", "--hidden", "64", "--steps", str(STEPS),
                            "--save-every", "1", "--ema-decay", "0.9", "--wait-timeout", "60"],
                           stdout=open(out, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while latest(h) < FIRST_SAMPLE:
        check(sim.poll() is None, "the simulator exited %s before step %d:\n%s" % (sim.returncode, FIRST_SAMPLE,
                                                                                   tail(out)))
        check(time.monotonic() < deadline, "step %d was not complete within 240 s" % FIRST_SAMPLE)
        time.sleep(0.01)
    step0, rss0, shm0 = latest(h), rss_bytes(pid), shm_bytes()
    try:
        rc = sim.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        sim.kill()
        raise TestFailure("the simulator did not finish %d steps within 240 s" % STEPS)
    check(rc == 0, "the simulator exited %d:\n%s" % (rc, tail(out)))
    check(latest(h) == STEPS, "LATEST is %d, not %d" % (latest(h), STEPS))
    rss1, shm1 = rss_bytes(pid), shm_bytes()
    saves = STEPS - step0
    kept = sorted(os.listdir(os.path.join(h.root, JOB)))
    log("after step %d: RSS %.1f MiB, /dev/shm %.1f MiB; after step %d: RSS %.1f MiB (%+d KiB, %+.1f bytes per save), "
        "/dev/shm %.1f MiB (%+d bytes); job directory: %s"
        % (step0, rss0 / 2**20, shm0 / 2**20, STEPS, rss1 / 2**20, (rss1 - rss0) // 1024,
           (rss1 - rss0) / saves, shm1 / 2**20, shm1 - shm0, " ".join(kept)))
    check(shm1 == shm0, "/dev/shm use moved from %d to %d bytes" % (shm0, shm1))
    check(sanitized or rss1 - rss0 <= MAX_RSS_GROWTH, "the daemon's RSS grew by %d KiB over %d saves" % ((rss1 - rss0) // 1024, saves))
    check(len([k for k in kept if k.startswith("checkpoint-")]) == 3, "retention kept %s" % kept)
    code = h.stop_daemon()
    check(code == 0, "flashckptd exited %s on SIGTERM" % code)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--sanitized", action="store_true", help="print RSS, do not bound it")
    args = ap.parse_args()
    return run_with_daemon_harness(lambda h: run(h, args.sanitized), "flashckpt-steady-", [JOB], args.bin_dir, args.keep)

if __name__ == "__main__":
    sys.exit(main())

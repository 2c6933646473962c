#!/usr/bin/python3
"""Memory comes back: a job whose ranks have all gone gives its shared memory back.

  1. `flashckpt release --job J` while J's trainer runs is refused (exit 2, "is connected") and
     touches nothing; once the trainer has exited it frees J's slot and EMA segments (exit 0), the
     status no longer lists J, and a second release says the daemon holds no such job (exit 2).
  2. Many short jobs with an EMA, one after another, under flashckptd --idle-release 2: each
     job's slot and EMA segments leave /dev/shm within a few seconds of its trainer's exit, and at
     the end the status lists none of them and the memory in use is 0. Their checkpoints stay.
  3. Memory checkpoints newer than the disk (steps 6 and 7 after disk step 5, trainer SIGKILLed)
     are never dropped in silence: `flashckpt release` writes step 7 first and says so, and the
     returning trainer resumes 7; `release --force` drops them and names them; idle release
     writes step 7 first and its log line names it.
  4. A job left behind by a daemon killed with SIGKILL is adopted by the next daemon and released
     by it once idle, EMA segment included. A daemon stopped with SIGTERM keeps only the EMA segment
     of a job with no rank connected (for a trainer that carries on), with a record; the next
     daemon unlinks it once idle.

    test_idle_release.py --bin-dir build/bin [--jobs N] [--keep]
"""

import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (DaemonHarness, check, kill_processes, log, run_with_daemon_harness, tail,  # noqa: E402
                     wait_for)

PREFIX = "idle%d" % os.getpid()
IDLE_S = 2


def segments(job):
    return sorted(glob.glob("/dev/shm/flashckpt.%s.*" % job))


def status(h):
    rc, out, err = h.cli("--socket", h.sock, "status", "--json")
    check(rc == 0, "flashckpt status failed (exit %d): %s" % (rc, err))
    return json.loads(out)


def listed(h, job):
    return any(j["job"] == job for j in status(h)["jobs"])


def sim(h, job, steps, step_ms=0, name=None):
    out = os.path.join(h.tmp, (name or job) + ".log")
    h.logs.append(out)
    cmd = [h.binary("flashckpt-sim"), "--socket", h.sock, "--job", job, "--rank", "0", "--world-size", "1",
           "--layers", "1", "--hidden", "64", "--steps", str(steps), "--save-every", "2", "--step-ms", str(step_ms),
           "--ema-decay", "0.9", "--wait-timeout", "60"]
    f = open(out, "wb")
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    f.close()
    h.procs.append(p)
    return p, out


def finish(p, out, what):
    rc = p.wait(timeout=120)
    check(rc == 0, "%s exited %d:\n%s" % (what, rc, tail(out)))


def operator_release(h):
    job = PREFIX + "-op"
    p, out = sim(h, job, steps=200, step_ms=20)
    wait_for(lambda: len(segments(job)) == 2, 60, "the slot and EMA segments of " + job)
    before = segments(job)
    rc, _, err = h.cli("--socket", h.sock, "release", "--job", job)
    check(rc == 2, "release of a job with a connected rank exited %d, not 2: %s" % (rc, err))
    check("rank 0 is connected" in err, "the refusal does not say why: %s" % err)
    check(segments(job) == before, "a refused release changed the segments: %s -> %s" % (before, segments(job)))
    log("release while the trainer runs: refused, exit 2 (%s)" % err.strip())
    finish(p, out, "the trainer of " + job)
    # The daemon sees the session end a moment after the trainer's exit.
    deadline = time.monotonic() + 10
    while True:
        rc, stdout, err = h.cli("--socket", h.sock, "release", "--job", job)
        if rc == 0 or "is connected" not in err or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    check(rc == 0, "release after the trainer's exit failed (exit %d): %s" % (rc, err))
    check(stdout.startswith("released job %s: 1 rank, " % job), "unexpected output: %r" % stdout)
    check(segments(job) == [], "segments left after the release: %s" % segments(job))
    check(not listed(h, job), "status still lists " + job)
    rc, _, err = h.cli("--socket", h.sock, "release", "--job", job)
    check(rc == 2 and "holds no job" in err, "a second release: exit %d: %s" % (rc, err))
    check(os.path.exists(os.path.join(h.root, job, "LATEST")), "the job's checkpoints are gone")
    log("release after the exit: %s" % stdout.strip())


def held_trainer(h, job, resume=False, steps=7):
    """A trainer that saves step 5 to disk, keeps 6 and 7 as memory checkpoints and waits at step 7
    to be killed; with resume, one that resumes and ends at `steps`."""
    out = os.path.join(h.tmp, "%s%s.log" % (job, "-resume" if resume else ""))
    h.logs.append(out)
    cmd = [h.binary("flashckpt-sim"), "--socket", h.sock, "--job", job, "--rank", "0", "--world-size", "1",
           "--layers", "1", "--hidden", "64", "--steps", str(steps), "--save-every", "5", "--memory-every", "1",
           "--wait-timeout", "60"]
    cmd += ["--resume"] if resume else ["--hold-after", "7"]
    with open(out, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    h.procs.append(p)
    if not resume:
        wait_for(lambda: "holding step=7" in open(out, errors="replace").read(), 60, job + " to hold at step 7")
        p.kill()
        p.wait(timeout=10)
    return p, out


def complete(h, job, step):
    return os.path.exists(os.path.join(h.root, job, "checkpoint-%d" % step, "metadata.json"))


def release_when_gone(h, job, *extra):
    """flashckpt release, again while the daemon has not yet seen the killed trainer's session end."""
    deadline = time.monotonic() + 10
    while True:
        rc, stdout, err = h.cli("--socket", h.sock, "release", "--job", job, *extra)
        if rc == 0 or "is connected" not in err or time.monotonic() > deadline:
            return rc, stdout, err
        time.sleep(0.05)


def memory_newer_than_disk_operator(h):
    """`flashckpt release` writes a memory checkpoint newer than the disk first; --force drops it."""
    job = PREFIX + "-memop"
    held_trainer(h, job)
    rc, stdout, err = release_when_gone(h, job)
    check(rc == 0, "release of %s: exit %d: %s" % (job, rc, err))
    check("memory checkpoint step 7 (newer than the disk's step 5) was written first" in stdout,
          "release does not say it wrote step 7 first: %r" % stdout)
    check(complete(h, job, 7), "checkpoint-7 of %s is not complete after the release" % job)
    p, out = held_trainer(h, job, resume=True, steps=8)
    finish(p, out, "the returning trainer of " + job)
    check("resumed step=7 " in open(out).read(), "the returning trainer did not resume step 7:\n" + tail(out))
    log("release: %s" % stdout.strip())

    job = PREFIX + "-memforce"
    held_trainer(h, job)
    rc, stdout, err = release_when_gone(h, job, "--force", "--json")
    check(rc == 0, "release --force of %s: exit %d: %s" % (job, rc, err))
    got = json.loads(stdout)
    check(got["dropped_steps"] == [7, 6] and got["disk_step"] == 5 and got["written_step"] is None,
          "release --force --json: %s" % got)
    check(not complete(h, job, 7) and not os.path.exists(os.path.join(h.root, job, "checkpoint-7")),
          "release --force wrote checkpoint-7")
    log("release --force: dropped %s (disk step %d)" % (got["dropped_steps"], got["disk_step"]))


def memory_newer_than_disk_idle(h):
    """Idle release writes the memory checkpoint newer than the disk first, and says so."""
    job = PREFIX + "-memidle"
    held_trainer(h, job)
    wait_for(lambda: not listed(h, job), IDLE_S + 20, job + " to be released once idle")
    check(complete(h, job, 7), "idle release of %s dropped memory step 7: checkpoint-7 is not complete" % job)
    # The job leaves the listing before its release is logged: the line may come a moment later.
    line = wait_for(lambda: [l for l in open(h.daemon_log, errors="replace") if "released job=%s " % job in l],
                    20, "the release's log line of " + job)
    check("written_step=7" in line[-1] and "disk_step=5" in line[-1],
          "the release's log line does not name the step written: %s" % line)
    p, out = held_trainer(h, job, resume=True, steps=8)
    finish(p, out, "the returning trainer of " + job)
    check("resumed step=7 " in open(out).read(), "the returning trainer did not resume step 7:\n" + tail(out))
    log("idle release wrote memory step 7 first: %s" % line[-1].strip())


def idle_jobs(h, count):
    jobs = ["%s-%d" % (PREFIX, i) for i in range(count)]
    start = time.monotonic()
    for i in range(0, count, 2):  # two trainers at a time
        running = [(job,) + sim(h, job, steps=4) for job in jobs[i:i + 2]]
        for job, p, out in running:
            finish(p, out, "the trainer of " + job)
    ran = time.monotonic() - start
    log("%d short jobs ran in %.1fs" % (count, ran))
    wait_for(lambda: not any(segments(job) for job in jobs), IDLE_S + 15,
             "every idle job's segments to leave /dev/shm")
    st = status(h)
    left = [j["job"] for j in st["jobs"] if j["job"].startswith(PREFIX)]
    check(not left, "status still lists jobs: %s" % left)
    check(st["host_memory_used"] == 0, "host memory in use: %d" % st["host_memory_used"])
    missing = [job for job in jobs if not os.path.exists(os.path.join(h.root, job, "LATEST"))]
    check(not missing, "jobs without their checkpoint: %s" % missing)
    log("%d idle jobs released: no segment, no status entry, 0 bytes in use" % count)


def after_restarts(h):
    job = PREFIX + "-crash"
    p, out = sim(h, job, steps=4)
    finish(p, out, "the trainer of " + job)
    check(len(segments(job)) == 2, "expected a slot and an EMA segment: %s" % segments(job))
    h.daemon.send_signal(signal.SIGKILL)
    h.daemon.wait()
    h.start_daemon(["--idle-release", str(IDLE_S)])
    check(listed(h, job), "the restarted daemon did not adopt " + job)
    wait_for(lambda: not segments(job), IDLE_S + 15, "the adopted job's segments to be released")
    check(not listed(h, job), "status still lists the adopted job")
    log("a job adopted after SIGKILL was released once idle, EMA segment included")

    job = PREFIX + "-term"
    # The EMA segment is flashckpt.<job>.<rank>.<scope>.ema, the scope the daemon's (16 hex digits).
    ema_name = re.compile(r"/dev/shm/flashckpt\.%s\.0\.[0-9a-f]{16}\.ema$" % re.escape(job))
    h.stop_daemon()
    h.start_daemon(["--idle-release", "0"])
    p, out = sim(h, job, steps=4)
    finish(p, out, "the trainer of " + job)
    check(len(segments(job)) == 2, "expected a slot and an EMA segment: %s" % segments(job))
    rc = h.stop_daemon()
    check(rc == 0, "the daemon's stop exited %s" % rc)
    # The EMA stays for a trainer that carries on after the restart, with a record for the next daemon.
    left = segments(job)
    check(len(left) == 1 and ema_name.match(left[0]),
          "after SIGTERM /dev/shm holds %s, expected only the EMA segment flashckpt.%s.0.<scope>.ema" % (left, job))
    kept = os.path.join(h.sock + ".state", os.path.basename(left[0]) + ".kept")
    check(os.path.exists(kept), "no record of the kept EMA segment: %s" % os.listdir(h.sock + ".state"))
    h.start_daemon(["--idle-release", str(IDLE_S)])
    wait_for(lambda: not segments(job), IDLE_S + 15, "the next daemon to release the kept EMA segment")
    wait_for(lambda: not os.path.exists(kept), 5, "the kept EMA's record to go with its segment")
    log("the EMA segment a stopped daemon kept for an idle job was released by the next daemon once idle")


def run(h, count):
    h.procs = []
    h.start_daemon(["--idle-release", "0"])
    operator_release(h)
    memory_newer_than_disk_operator(h)
    h.stop_daemon()
    h.start_daemon(["--idle-release", str(IDLE_S)])
    memory_newer_than_disk_idle(h)
    idle_jobs(h, count)
    after_restarts(h)


class Harness(DaemonHarness):
    def kill_all(self):
        kill_processes(getattr(self, "procs", []))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    def jobs(h):
        return ([PREFIX + "-op", PREFIX + "-crash", PREFIX + "-term", PREFIX + "-memop", PREFIX + "-memforce",
                 PREFIX + "-memidle"] + ["%s-%d" % (PREFIX, i) for i in range(args.jobs)])

    return run_with_daemon_harness(lambda h: run(h, args.jobs), "fcidle", jobs, args.bin_dir, keep=args.keep,
                                   harness=Harness)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Correct by default: a plain launch, with no run id anywhere, completes its checkpoints.

  1. Launches of 4 flashckpt-sim ranks of one job, started together on one daemon with no run id
     (no --run-id, no FLASHCKPT_RUN_ID, no launcher variables): every launch's ranks register in
     one run and its last step completes (metadata.json), --launches times (default 50), each into
     a job of its own.
  2. Launches into one job, one after the other, each resuming the previous one's checkpoint while
     the previous launch's ranks may still be ending: every one completes.
  3. Two explicit runs of one job at once (ranks 0,1 --run-id A, ranks 2,3 --run-id B): one of the
     runs is refused at registration with a message naming both runs; no rank of it saves.
  4. --log-file gets every line as it is written (a SIGKILL just after the start leaves the start's
     lines), gRPC's own messages included, and none of them goes to stderr.

    test_defaults.py --bin-dir build/bin [--launches N] [--keep]
"""

import argparse
import os
import re
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import check, log, run_with_daemon_harness, wait_daemon_ready  # noqa: E402

PREFIX = "dflt%d" % os.getpid()
RANKS = 4
STEPS = 4

# What a launcher or the user could set to name the run: none of it reaches the ranks here.
RUN_VARIABLES = ("FLASHCKPT_RUN_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID",
                 "SLURM_RESTART_COUNT", "PMIX_NAMESPACE", "OMPI_COMM_WORLD_SIZE", "FLASHCKPT_LAUNCH_ID")


def plain_env():
    env = dict(os.environ)
    for name in list(env):
        if name in RUN_VARIABLES or name.startswith(("SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_")):
            del env[name]
    return env


def launch(h, job, tag, extra=(), ranks=range(RANKS), per_rank=None, steps=STEPS, wait_s=60):
    """Starts the ranks of one launch at once: [(rank, Popen, log path)]."""
    env = plain_env()
    procs = []
    for r in ranks:
        out = os.path.join(h.tmp, "%s.%s.r%d.log" % (job, tag, r))
        h.logs.append(out)
        cmd = [h.binary("flashckpt-sim"), "--socket", h.sock, "--job", job, "--rank", str(r), "--world-size",
               str(RANKS), "--tp-degree", str(RANKS), "--layers", "1", "--hidden", "16", "--steps", str(steps),
               "--save-every", "2", "--wait-timeout", str(wait_s)] + list(extra) + list(per_rank(r) if per_rank else ())
        with open(out, "wb") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        h.procs.append(p)
        procs.append((r, p, out))
    return procs


def finish(procs, what):
    """Waits for every rank: {rank: (exit code, output)}."""
    got = {}
    for r, p, out in procs:
        rc = p.wait(timeout=180)
        with open(out, errors="replace") as f:
            got[r] = (rc, f.read())
    return got


def registered_runs(h, job):
    """The run each rank of `job` registered in, from the daemon's log: {rank: {run, ...}}."""
    runs = {}
    with open(h.daemon_log, errors="replace") as f:
        for line in f:
            m = re.search(r"registered job=(\S+) rank=(\d+) run=(\S+)", line)
            if m and m.group(1) == job:
                runs.setdefault(int(m.group(2)), set()).add(m.group(3))
    return runs


def complete(h, job, step):
    return os.path.exists(os.path.join(h.root, job, "checkpoint-%d" % step, "metadata.json"))


def separate_launches(h, launches):
    for i in range(launches):
        job = "%s-l%d" % (PREFIX, i)
        got = finish(launch(h, job, "a"), job)
        for r, (rc, out) in got.items():
            check(rc == 0, "launch %d: rank %d exited %d:\n%s" % (i, r, rc, out))
        runs = registered_runs(h, job)
        check(len(set().union(*runs.values())) == 1 and len(runs) == RANKS,
              "launch %d: the ranks registered in more than one run: %s" % (i, runs))
        check(complete(h, job, STEPS), "launch %d: checkpoint-%d of %s is not complete" % (i, STEPS, job))
    log("%d launches of %d ranks with no run id: every one in one run, every last step complete"
        % (launches, RANKS))


def consecutive_launches(h, count):
    job = PREFIX + "-same"
    for i in range(count):
        # Each launch starts while the previous one's processes may still be closing their sessions.
        extra = ["--resume"] if i else []
        procs = launch(h, job, "c%d" % i, extra=extra, steps=(i + 1) * STEPS)
        got = finish(procs, job)
        for r, (rc, out) in got.items():
            check(rc == 0, "consecutive launch %d: rank %d exited %d:\n%s" % (i, r, rc, out))
            if i:
                check("resumed step=%d" % (i * STEPS) in out,
                      "consecutive launch %d: rank %d did not resume step %d:\n%s" % (i, r, i * STEPS, out))
        check(complete(h, job, (i + 1) * STEPS), "consecutive launch %d: checkpoint-%d is not complete"
              % (i, (i + 1) * STEPS))
    log("%d launches into one job, each resuming the last: every one complete" % count)


def two_named_runs(h):
    job = PREFIX + "-two"
    # The accepted run's ranks save, then find their checkpoint cannot complete (half its ranks were
    # refused): they wait 12 s for it and fail too, saying so. (The refused run's ranks wait 5 s for the
    # live run to go before they give up: the accepted ranks outlive that.)
    procs = launch(h, job, "ab", per_rank=lambda r: ["--run-id", "runA" if r < 2 else "runB"], wait_s=12)
    got = finish(procs, job)
    failed = {r for r, (rc, out) in got.items() if rc != 0 and "flashckpt-sim: register:" in out}
    check(failed in ({0, 1}, {2, 3}), "two named runs at once: the registrations refused are %s, not one run's: %s"
          % (sorted(failed), {r: out.strip().splitlines()[-1:] for r, (rc, out) in got.items()}))
    for r in set(got) - failed:
        rc, out = got[r]
        check(rc != 0 and "saved step=%d" % STEPS in out and "not complete" in out,
              "rank %d of the accepted run: exit %d, expected its saves and a checkpoint that is not complete:\n%s"
              % (r, rc, out))
    for r in failed:
        out = got[r][1]
        check("runA" in out and "runB" in out and "register" in out,
              "rank %d's refusal does not name both runs at registration:\n%s" % (r, out))
        check("saved step=" not in out, "rank %d of the refused run saved:\n%s" % (r, out))
    log("two named runs at once: run %s refused at registration (%s)"
        % ("runA" if failed == {0, 1} else "runB", got[min(failed)][1].strip().splitlines()[-1]))


def log_file(h):
    """--log-file gets each line as it is written, gRPC's own lines included, and keeps them through a
    SIGKILL a moment after the start; nothing of gRPC's goes to stderr."""
    d = os.path.join(h.tmp, "logd")
    os.makedirs(d)
    sock, path, err_path = os.path.join(d, "s.sock"), os.path.join(d, "daemon.log"), os.path.join(d, "stderr")
    cmd = [h.binary("flashckptd"), "--socket", sock, "--root", os.path.join(d, "root"), "--max-host-memory", "1GiB",
           "--log-file", path, "--log-level", "debug"]
    with open(err_path, "wb") as err:
        p = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, GRPC_VERBOSITY="debug"))
    h.procs.append(p)
    try:
        wait_daemon_ready(p, sock)
        # A registration's line is in the file while the daemon runs, whole (the file ends with a newline).
        sim = [h.binary("flashckpt-sim"), "--socket", sock, "--job", PREFIX + "-log", "--rank", "0", "--world-size", "1",
               "--layers", "1", "--hidden", "16", "--steps", "2", "--save-every", "2"]
        subprocess.run(sim, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, check=True)
        text = open(path, errors="replace").read()
        check("registered job=%s-log" % PREFIX in text and text.endswith("\n"),
              "the registration's line is not in --log-file while the daemon runs:\n%s" % text[-2000:])
        check(" [grpc] " in text, "gRPC's own lines do not reach --log-file:\n%s" % text[-2000:])
    finally:
        p.kill()
        p.wait(timeout=10)
    stderr = open(err_path, errors="replace").read()
    check(not re.search(r"^[DIEW]\d{4} \d\d:\d\d", stderr, re.M), "gRPC wrote to stderr:\n%s" % stderr[-2000:])
    # Killed at once after its start: the lines of the start are there.
    os.unlink(path)
    with open(err_path, "wb") as err:
        p = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    h.procs.append(p)
    wait_daemon_ready(p, sock)
    p.kill()
    p.wait(timeout=10)
    text = open(path, errors="replace").read()
    # (its start line is logged before it listens; a block-buffered log would leave the file empty)
    check("started root=" in text and text.endswith("\n"), "a daemon SIGKILLed after its start left:\n%r" % text)
    log("--log-file: each line as it is written, gRPC's lines with them, kept through a SIGKILL")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--launches", type=int, default=50)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    def run(h):
        h.procs = []
        h.kill_all = lambda: [p.kill() for p in h.procs if p.poll() is None]
        h.start_daemon()
        t = time.monotonic()
        separate_launches(h, args.launches)
        log("separate launches took %.1fs" % (time.monotonic() - t))
        consecutive_launches(h, 5)
        two_named_runs(h)
        log_file(h)

    jobs = lambda h: (["%s-l%d" % (PREFIX, i) for i in range(args.launches)] +
                      [PREFIX + "-same", PREFIX + "-two", PREFIX + "-log"])
    return run_with_daemon_harness(run, PREFIX, jobs, args.bin_dir, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())

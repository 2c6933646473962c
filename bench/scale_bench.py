#!/usr/bin/python3
"""Many ranks on few daemons: what a checkpoint costs as the job grows, measured on one machine.

    bench/scale_bench.py --bin-dir build/bin [--ranks 64,256,1024] [--daemons 4] [--plan-ranks 4096]

For each rank count N, --daemons flashckptd run as simulated nodes (each in mount and PID namespaces
of its own, with a private /dev/shm; all write one root) and N flashckpt-sim ranks (tp 8 x shard
N/8, tiny tensors) run on them, N/daemons per node, from processes of up to 64 ranks each
(--ranks-per-process). Every job saves, completes, and is then resumed and checked element by
element by every rank. Printed per N:

- commit latency: from the step's last signal to metadata.json and LATEST durable, as the completing
  daemon logs it (`complete ... commit_ms=`), median over the steps of both jobs;
- file-system calls per checkpoint on the root (the daemons' flashckpt_root_io_calls_total, summed):
  a job of 1 save and a job of 11 saves are run, and a tenth of their difference is one checkpoint's
  share, registration and the ranks' final waits excluded; in total and per rank;
- the daemons' memory per registered rank (RssAnon of the daemon processes before and after the
  first job's ranks registered; the ranks' shared memory is not in it);
- `flashckpt status`, `list` and `inspect` times on the job.

Then plan_bench (from --bin-dir) builds the metadata of a --plan-ranks job (300 tensors per rank)
in another root and times reading it and planning a restore into another layout; `list --root` is
timed on that job too. Headline lines:
  RESULT commit_ms_64=X  RESULT commit_ms_1024=Y  (target Y <= 4X)
  RESULT root_calls_per_rank_64=...  RESULT root_calls_per_rank_1024=...
  RESULT plan_ms_4096=Z  (target Z <= 1000)
"""

import argparse
import ctypes
import os
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.dont_write_bytecode = True
PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)
COMPLETE = re.compile(r"\[catalog\] complete job=(\S+) step=(\d+) .*commit_ms=([-\d.]+) check_ms=([\d.]+) "
                      r"signals_ms=([\d.]+) headers_ms=([\d.]+) write_ms=([\d.]+)")
CALL = re.compile(r'^flashckpt_root_io_calls_total\{call="(\w+)"\} (\S+)$', re.M)
LAYERS, HIDDEN = 2, 64
MANY_SAVES = 11  # the saves of the second job: with the first job's one, the commit latencies sampled
# LeakSanitizer cannot read /proc of a process in another PID namespace: in a sanitized build the
# nodes' processes run without leak checks (address and undefined-behaviour checks stay on).
NODE_ENV = dict(os.environ, ASAN_OPTIONS=":".join(o for o in (os.environ.get("ASAN_OPTIONS", ""), "detect_leaks=0") if o))


def die_with_parent():
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Node:
    """A simulated node: mount + PID namespaces with a private /dev/shm, running one flashckptd."""

    def __init__(self, name, tmp, root, bin_dir, port):
        self.name, self.bin_dir, self.port = name, bin_dir, port
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir, exist_ok=True)
        self.sock = os.path.join(self.dir, "flashckptd.sock")
        self.log = os.path.join(self.dir, "flashckptd.log")
        self.init = subprocess.Popen(
            ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private", "--", "/bin/sh",
             "-c", "mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm && echo ready && exec sleep 86400"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        ready, _, _ = select.select([self.init.stdout], [], [], 30)
        if not ready or self.init.stdout.readline().decode().strip() != "ready":
            self.init.kill()
            sys.exit("node %s did not start (scale_bench needs root: unshare, mount)" % name)
        self.pid1 = child_of(self.init.pid)
        self.daemon = subprocess.Popen(
            self.enter() + [os.path.join(bin_dir, "flashckptd"), "--socket", self.sock, "--root", root,
                            "--node-name", name, "--metrics-listen", "127.0.0.1:%d" % port, "--log-file", self.log],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent, env=NODE_ENV)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.sock):
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                tail = open(self.log).read()[-2000:] if os.path.exists(self.log) else "(no log)"
                sys.exit("flashckptd of %s did not start:\n%s" % (name, tail))
            time.sleep(0.05)
        self.daemon_pid = child_of(self.daemon.pid)  # nsenter --pid forks the daemon

    def enter(self):
        return ["nsenter", "--target", str(self.pid1), "--mount", "--pid", "--"]

    def run(self, cmd, log):
        return subprocess.Popen(self.enter() + cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=die_with_parent, env=NODE_ENV)

    def calls(self):
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.port, timeout=30).read().decode()
        return {k: float(v) for k, v in CALL.findall(text)}

    def rss_anon_kib(self):
        with open("/proc/%d/status" % self.daemon_pid) as f:
            return int(re.search(r"^RssAnon:\s+(\d+) kB", f.read(), re.M).group(1))

    def stop(self):
        # SIGTERM to the daemon itself (nsenter does not pass it on), then wait until it is gone: the
        # next nodes take the same metrics ports.
        os.kill(self.daemon_pid, signal.SIGTERM)
        deadline = time.monotonic() + 120
        while os.path.exists("/proc/%d" % self.daemon_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.daemon.wait()
        self.init.kill()
        self.init.wait()


def child_of(pid):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
                kids = f.read().split()
            if kids:
                return int(kids[0])
        except OSError:
            pass
        time.sleep(0.01)
    sys.exit("no child of %d" % pid)


def run_job(nodes, bin_dir, tmp, job, ranks, steps, resume=False, step_ms=0):
    """Runs `ranks` ranks of `job` over the nodes; returns the ranks' output. Exits on a failed rank."""
    per_node = ranks // len(nodes)
    per_process = min(64, per_node)
    procs = []
    for k, node in enumerate(nodes):
        for first in range(k * per_node, (k + 1) * per_node, per_process):
            log = os.path.join(tmp, "%s-%d%s.log" % (job, first, "-resume" if resume else ""))
            cmd = [os.path.join(bin_dir, "flashckpt-sim"), "--socket", node.sock, "--job", job, "--rank", str(first),
                   "--ranks-per-process", str(per_process), "--world-size", str(ranks), "--tp-degree", "8",
                   "--shard-degree", str(ranks // 8), "--layers", str(LAYERS), "--hidden", str(HIDDEN),
                   "--steps", str(steps), "--save-every", "10", "--run-id", job + "-run", "--wait-timeout", "600",
                   "--step-ms", str(step_ms)]
            procs.append((node.run(cmd + (["--resume"] if resume else []), log), log))
    out = []
    for p, log in procs:
        rc = p.wait()
        text = open(log).read()
        if rc != 0:
            sys.exit("flashckpt-sim of %s exited %d:\n%s" % (job, rc, text[-3000:]))
        out.append(text)
    return "".join(out)


def completions(nodes, job):
    """Per step of `job`: (commit_ms, check_ms, signals_ms, headers_ms, write_ms) of its completion."""
    found = {}
    for node in nodes:
        for j, step, *ms in COMPLETE.findall(open(node.log).read()):
            if j == job:
                found[int(step)] = tuple(float(x) for x in ms)
    return found


def total_calls(nodes):
    total = {}
    for node in nodes:
        for k, v in node.calls().items():
            total[k] = total.get(k, 0) + v
    return total


def timed(cmd):
    start = time.monotonic()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    secs = time.monotonic() - start
    if r.returncode != 0:
        sys.exit("%s exited %d:\n%s" % (" ".join(cmd), r.returncode, r.stdout.decode()[-2000:]))
    return secs * 1000, r.stdout.decode()


def free_ports(n):
    """n TCP ports on 127.0.0.1 that nothing listens on now."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def bench_ranks(args, ranks, tmp):
    root = os.path.join(tmp, "root")
    ports = [args.port + k for k in range(args.daemons)] if args.port else free_ports(args.daemons)
    nodes = []
    try:
        for k in range(args.daemons):
            nodes.append(Node("node%d" % k, os.path.join(tmp, "n%d" % ranks), root, args.bin_dir, ports[k]))
        rss0 = sum(n.rss_anon_kib() for n in nodes)
        c0 = total_calls(nodes)
        one, many = "s%d-one" % ranks, "s%d-many" % ranks
        last = 10 * MANY_SAVES
        start = time.monotonic()
        run_job(nodes, args.bin_dir, tmp, one, ranks, 10, step_ms=args.step_ms)
        secs_one = time.monotonic() - start
        rss1 = sum(n.rss_anon_kib() for n in nodes)
        c1 = total_calls(nodes)
        run_job(nodes, args.bin_dir, tmp, many, ranks, last, step_ms=args.step_ms)
        c2 = total_calls(nodes)
        resumed = run_job(nodes, args.bin_dir, tmp, many, ranks, last, resume=True)
        ok = len(re.findall(r"^resumed step=%d from=\w+ verified_elements=[1-9]" % last, resumed, re.M))
        if ok != ranks:
            sys.exit("%d of %d ranks resumed step %d and verified it" % (ok, ranks, last))
        parts = list(completions(nodes, one).values()) + list(completions(nodes, many).values())
        latency = [p[0] for p in parts]
        by_save = ["%s@%d %.1f" % (j, step, ms[0]) for j in (one, many) for step, ms in sorted(completions(nodes, j).items())]
        if len(latency) != 1 + MANY_SAVES:
            sys.exit("expected %d completions of jobs %s and %s, the logs show %d" % (1 + MANY_SAVES, one, many,
                                                                                       len(latency)))
        per_ckpt = {k: (c2.get(k, 0) - c1.get(k, 0) - (c1.get(k, 0) - c0.get(k, 0))) / (MANY_SAVES - 1) for k in c2}
        # The same job on restarted nodes (their shared memory gone): every rank reads the last step from
        # the files.
        for n in nodes:
            n.stop()
        nodes = [Node("node%d" % k, os.path.join(tmp, "r%d" % ranks), root, args.bin_dir, ports[k])
                 for k in range(args.daemons)]
        start = time.monotonic()
        resumed = run_job(nodes, args.bin_dir, tmp, many, ranks, last, resume=True)
        disk_resume_s = time.monotonic() - start
        ok = len(re.findall(r"^resumed step=%d from=disk verified_elements=[1-9]" % last, resumed, re.M))
        if ok != ranks:
            sys.exit("%d of %d ranks resumed step %d from disk and verified it" % (ok, ranks, last))
        status_ms, _ = timed([os.path.join(args.bin_dir, "flashckpt"), "--socket", nodes[0].sock, "status"])
        print("RESULT disk_resume_s_%d=%.2f" % (ranks, disk_resume_s))
        list_ms, _ = timed([os.path.join(args.bin_dir, "flashckpt"), "--socket", nodes[0].sock, "list", "--job", many])
        inspect_ms, _ = timed([os.path.join(args.bin_dir, "flashckpt"), "inspect",
                               os.path.join(root, many, "checkpoint-%d" % last)])
        total = sum(per_ckpt.values())
        print("%d ranks on %d daemons: first job (1 save) %.1f s" % (ranks, args.daemons, secs_one))
        print("  commit latency ms: %s (median %.1f); by save: %s" % (
            " ".join("%.1f" % x for x in sorted(latency)), statistics.median(latency), ", ".join(by_save)))
        print("  of which (medians) the lock and look %.1f, reading the node parts and the signals %.1f, the files' headers %.1f, "
              "writing metadata.json and LATEST %.1f" % tuple(statistics.median(p[k] for p in parts) for k in range(1, 5)))
        print("  root calls per checkpoint: %d in all, %.2f per rank: %s" % (
            total, total / ranks, ", ".join("%s %d" % (k, v) for k, v in sorted(per_ckpt.items()) if v)))
        print("  every rank resumed step %d, and on restarted nodes from disk in %.1f s, and verified it" %
              (last, disk_resume_s))
        print("  daemon memory per registered rank: %.1f KiB (RssAnon, %d ranks per daemon)" %
              ((rss1 - rss0) / ranks, ranks // args.daemons))
        print("  flashckpt status %.0f ms (%d ranks on that daemon), list %.0f ms, inspect %.0f ms" %
              (status_ms, ranks // args.daemons, list_ms, inspect_ms))
        print("RESULT commit_ms_%d=%.1f" % (ranks, statistics.median(latency)))
        print("RESULT root_calls_per_rank_%d=%.2f" % (ranks, total / ranks))
        print("RESULT daemon_kib_per_rank_%d=%.1f" % (ranks, (rss1 - rss0) / ranks))
        sys.stdout.flush()
        return statistics.median(latency)
    finally:
        for n in nodes:
            n.stop()
        shutil.rmtree(root, ignore_errors=True)


def bench_plan(args, tmp):
    root = os.path.join(tmp, "plan-root")
    os.makedirs(root)
    r = subprocess.run([os.path.join(args.bin_dir, "plan_bench"), "--root", root, "--ranks", str(args.plan_ranks),
                        "--repeat", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    print(r.stdout.decode(), end="")
    if r.returncode != 0:
        sys.exit("plan_bench exited %d" % r.returncode)
    # `inspect` reads the files' headers too, which this metadata-only job does not have.
    list_ms, _ = timed([os.path.join(args.bin_dir, "flashckpt"), "list", "--root", root])
    print("  %d-rank job: flashckpt list --root %.0f ms" % (args.plan_ranks, list_ms))
    shutil.rmtree(root, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", required=True, help="where flashckptd, flashckpt, flashckpt-sim and plan_bench are")
    ap.add_argument("--ranks", default="64,256,1024")
    ap.add_argument("--daemons", type=int, default=4)
    ap.add_argument("--step-ms", type=int, default=300,
                    help="each rank's compute per step; with a save every 10 steps, the time between saves, so "
                         "that a checkpoint's completion is not timed while the next one is written")
    ap.add_argument("--plan-ranks", type=int, default=4096)
    ap.add_argument("--port", type=int, default=0,
                    help="first of --daemons metrics ports on 127.0.0.1 (default: free ports picked at start)")
    ap.add_argument("--dir", default=None, help="where the root goes (default: a temporary directory)")
    args = ap.parse_args()
    args.bin_dir = os.path.abspath(args.bin_dir)
    if os.geteuid() != 0:
        print("scale_bench needs root (mount namespaces for the simulated nodes): skipped")
        sys.exit(77)
    tmp = tempfile.mkdtemp(prefix="flashckpt-scale-", dir=args.dir)
    try:
        latency = {}
        for ranks in [int(x) for x in args.ranks.split(",")]:
            if ranks % (8 * args.daemons) != 0:
                sys.exit("--ranks must be multiples of 8 x --daemons")
            latency[ranks] = bench_ranks(args, ranks, tmp)
        if len(latency) > 1:
            lo, hi = min(latency), max(latency)
            print("commit latency at %d ranks is %.2fx that at %d (target <= 4x)" % (hi, latency[hi] / latency[lo], lo))
        if args.plan_ranks:
            bench_plan(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

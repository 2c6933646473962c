#!/usr/bin/python3
"""Many nodes, one shared root: simulated nodes, each its own mount and PID namespace with a private
tmpfs on /dev/shm (node-local shared memory that dies with the node), its own flashckptd (its own
--node-name, socket and state directory) and its own flashckpt-sim ranks; every node sees the same
checkpoint root. Killing a node is a SIGKILL of its namespace's first process: the kernel kills every
process of the node, and its /dev/shm goes with the last of them.

  1. 4 nodes x 2 ranks (world 8, tp 2, shard 4) save every step for 30 steps: every step is
     complete, `flashckpt verify` passes on each, the independent reader checks the last against
     the simulator's formula, and each rank's signal names its node.
     The same with no run id anywhere (no --run-id, no launcher variables): every step completes,
     and a relaunch that resumes is one new run.
  2. The job resumes bit-exact on 3 nodes x 2 ranks (tp 2, shard 3) and on 2 nodes x 4 ranks (tp 4,
     shard 2): every rank restores the newest step and checks every element it holds.
  3. A node is killed in the middle of a run that saves every step: LATEST stays on a complete step;
     `flashckpt list --root` names the missing ranks of the newest step and the killed node; the job
     then restarts on the 3 surviving nodes plus a fresh one and resumes bit-exact from LATEST.
  4. Every daemon restarted with --keep 2. A job saves on 2 nodes while a third node restores an older
     step that is falling out of retention, held in the middle of its read (its daemon stopped once
     its lease is in the root): the savers' retention skips that step, the restore then succeeds
     bit-exact, and the next save deletes the step. A node killed in the middle of a restore leaves
     its lease: the step stays while the lease lives and is deleted once it has expired.

Needs root (namespaces, mounts): otherwise it prints why and exits 77 (ctest: skipped).

    test_multinode.py --bin-dir build/bin [--keep]
"""

import argparse
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))
import flashckpt_reader  # noqa: E402
from harness import TestFailure, check, log, tail  # noqa: E402

SKIP = 77
PR_SET_PDEATHSIG = 1
# LeakSanitizer cannot stop the world from inside a PID namespace (it exits with "LeakSanitizer has
# encountered a fatal error"): in a sanitized build, processes on a simulated node run without leak
# checks (the other sanitized tests check leaks; address and undefined-behaviour checks stay on).
NODE_ENV = dict(os.environ, ASAN_OPTIONS=":".join(o for o in (os.environ.get("ASAN_OPTIONS", ""), "detect_leaks=0") if o))
# What names a run for ranks that give none (step 1b runs without): none of it reaches a node.
for _name in list(NODE_ENV):
    if _name in ("FLASHCKPT_RUN_ID", "PMIX_NAMESPACE", "JOBSET_NAME") or _name.startswith(("TORCHELASTIC_", "SLURM_",
                                                                                        "OMPI_")):
        del NODE_ENV[_name]
LAYERS, HIDDEN = 2, 64
JOB = "multinode-%d" % os.getpid()
# Step 4: a model large enough that a restore lasts a few milliseconds (27 MiB for one rank holding
# all of it), so that the harness sees its lease in the root and stops its daemon in the middle.
KEEP_JOB, KEEP_LAYERS, KEEP_HIDDEN = JOB + "-keep", 4, 768
NORUN_JOB = JOB + "-norun"  # ranks that name no run
# Far longer than the savers' steps while a restoring daemon is stopped (it cannot refresh its lease;
# seconds under AddressSanitizer on a loaded machine); the test waits it out once, for the expiry.
LEASE_TTL_S = 30
# The node that dies while restoring (step 4's end): its lease need only outlive one save of two
# ranks (about 0.2 s here), and the test waits it out, so it is short.
DEAD_LEASE_TTL_S = 5


LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent():
    """In the child, before exec: SIGKILL when the harness dies."""
    if LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


class Node:
    """A simulated node: a mount + PID namespace with a private /dev/shm, running one flashckptd.
    With net=True also a network namespace of its own (only its loopback until the test gives it an
    interface: test_replicas.py)."""

    def __init__(self, name, tmp, root, bin_dir, net=False):
        self.name, self.root, self.bin_dir, self.net = name, root, bin_dir, net
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir, exist_ok=True)
        self.sock = os.path.join(self.dir, "flashckptd.sock")
        self.logs = []
        # PID 1 of the node: mounts the node's own /dev/shm, then waits (sleep is killed with the node).
        # If the harness dies (a ctest timeout), unshare dies with it and takes the node's PID 1 along.
        self.init = subprocess.Popen(
            ["unshare", "--mount", "--pid"] + (["--net"] if net else []) +
            ["--fork", "--kill-child", "--propagation", "private", "--", "/bin/sh",
             "-c", "mount -t tmpfs -o size=512m,mode=1777 tmpfs /dev/shm && echo ready && exec sleep 86400"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        said = []
        deadline = time.monotonic() + 30
        while True:
            ready, _, _ = select.select([self.init.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.init.stdout.readline().decode() if ready else ""
            if line.strip() == "ready":
                break
            said.append(line)
            if not line or time.monotonic() > deadline:
                self.init.kill()
                raise TestFailure("node %s did not start: %s" % (name, "".join(said)))
        self.pid1 = self._child_of(self.init.pid)
        self.daemon = None
        self.starts = 0
        self.paused = False

    @staticmethod
    def _child_of(pid):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
                    kids = f.read().split()
                if kids:
                    return int(kids[0])
            except OSError:
                pass
            time.sleep(0.01)
        raise TestFailure("no child of unshare %d" % pid)

    def run(self, cmd, log_name):
        """Starts `cmd` inside the node (its mount and PID namespaces, and its network one)."""
        path = os.path.join(self.dir, log_name)
        self.logs.append(path)
        return subprocess.Popen(self.enter() + cmd,
                                stdout=open(path, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=NODE_ENV)

    def enter(self, pid=True):
        """The nsenter command line that runs a command inside the node."""
        return (["nsenter", "--target", str(self.pid1), "--mount"] + (["--pid"] if pid else []) +
                (["--net"] if self.net else []) + ["--"])

    def start_daemon(self, *extra, tuned=True):
        """flashckptd with what makes it this node's (socket, root, node name), the tests' budget and
        sweep interval unless tuned=False (a daemon's defaults), and `extra`."""
        self.starts += 1
        tuning = ["--max-host-memory", "256MiB", "--sweep-interval", "1"] if tuned else []
        self.daemon = self.run([os.path.join(self.bin_dir, "flashckptd"), "--socket", self.sock, "--root", self.root,
                                "--node-name", self.name] + tuning + list(extra), "flashckptd-%d.log" % self.starts)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.sock):
            check(self.daemon.poll() is None, "flashckptd of %s exited:\n%s" % (self.name, tail(self.logs[-1])))
            check(time.monotonic() < deadline, "flashckptd of %s did not open its socket" % self.name)
            time.sleep(0.05)

    def daemon_pid(self):
        """The daemon's pid as this machine sees it (the child of nsenter)."""
        with open("/proc/%d/task/%d/children" % (self.daemon.pid, self.daemon.pid)) as f:
            return int(f.read().split()[0])

    def pause_daemon(self):
        """SIGSTOP: the daemon stops where it is, in the middle of whatever it does (nsenter, its parent,
        then stops itself as well, and continues the daemon when it is continued)."""
        os.kill(self.daemon_pid(), signal.SIGSTOP)
        self.paused = True
        # Until nsenter has stopped too: continued before it stops itself, it would stop for good.
        deadline = time.monotonic() + 10
        while self._state(self.daemon.pid) != "T":
            check(time.monotonic() < deadline, "nsenter of %s's daemon did not stop with it" % self.name)
            time.sleep(0.001)

    def resume_daemon(self):
        self._continue()
        self.paused = False

    @staticmethod
    def _state(pid):
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def _continue(self):
        # nsenter first, whatever happens next: it continues the daemon itself.
        try:
            os.kill(self.daemon.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        try:
            os.kill(self.daemon_pid(), signal.SIGCONT)
        except (OSError, IndexError, ValueError):
            pass

    def stop_daemon(self):
        """SIGTERM to the daemon; it exits 0 within 30 s."""
        os.kill(self.daemon_pid(), signal.SIGTERM)
        rc = self.daemon.wait(timeout=30)
        check(rc == 0, "flashckptd of %s exited %d on SIGTERM:\n%s" % (self.name, rc, tail(self.logs[-1])))

    def shm(self):
        """The names in the node's own /dev/shm."""
        p = subprocess.run(["nsenter", "--target", str(self.pid1), "--mount", "--", "ls", "/dev/shm"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return p.stdout.decode().split()

    def kill(self):
        """The node dies: SIGKILL of its PID 1 takes every process of the node, and its /dev/shm."""
        if self.init.poll() is None:
            if self.paused:
                # A stopped daemon is killed first, directly: SIGKILL ends a stopped process without
                # any of its code running. Left to the namespace's teardown, which comes after PID 1's
                # death, it could be continued below first and finish what it was stopped in (a
                # restore that drops its lease).
                try:
                    os.kill(self.daemon_pid(), signal.SIGKILL)
                except (OSError, IndexError, ValueError):
                    pass
            try:
                os.kill(self.pid1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self.paused:
                # Its stopped parent must go on to reap it, or the node's PID namespace never empties.
                self._continue()
                self.paused = False
            self.init.wait(timeout=30)


def print_failure(error, tmp):
    """The failure, then the tail of every log of every node under tmp."""
    print("FAILED: %s" % error, flush=True)
    for name in sorted(os.listdir(tmp)):
        d = os.path.join(tmp, name)
        if os.path.isdir(d) and name.startswith("node"):
            for f in sorted(os.listdir(d)):
                if f.endswith(".log"):
                    print("---- %s/%s\n%s" % (name, f, tail(os.path.join(d, f))))


def kill_rank(p):
    """SIGKILL of a rank started with Node.run: the process inside the node (nsenter's child), then nsenter."""
    try:
        with open("/proc/%d/task/%d/children" % (p.pid, p.pid)) as f:
            for child in f.read().split():
                os.kill(int(child), signal.SIGKILL)
    except (OSError, ValueError):
        pass
    p.kill()
    p.wait()


def run_ranks(nodes, ranks_per_node, tp, steps, run_id, resume=False, step_ms=0, wait=True, job=JOB, layers=LAYERS,
              hidden=HIDDEN):
    """flashckpt-sim ranks of `job`, `ranks_per_node` on each node in order; rank r on node r // n."""
    world = len(nodes) * ranks_per_node
    procs = []
    for rank in range(world):
        node = nodes[rank // ranks_per_node]
        cmd = [os.path.join(node.bin_dir, "flashckpt-sim"), "--socket", node.sock, "--job", job, "--rank", str(rank),
               "--world-size", str(world), "--tp-degree", str(tp), "--shard-degree", str(world // tp),
               "--layers", str(layers), "--hidden", str(hidden), "--steps", str(steps), "--save-every", "1",
               "--wait-timeout", "60"] + (["--run-id", run_id] if run_id else [])
        if resume:
            cmd.append("--resume")
        if step_ms:
            cmd += ["--step-ms", str(step_ms)]
        procs.append((rank, node, node.run(cmd, "sim-%s-%s-rank%d.log" % (job, run_id or "norun", rank))))
    if not wait:
        return procs
    out = {}
    deadline = time.monotonic() + 180
    for rank, node, p in procs:
        try:
            rc = p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for _, _, q in procs:
                kill_rank(q)
            raise TestFailure("rank %d on %s did not finish within 180 s" % (rank, node.name))
        text = open(os.path.join(node.dir, "sim-%s-%s-rank%d.log" % (job, run_id or "norun", rank)),
                    errors="replace").read()
        check(rc == 0, "rank %d on %s exited %d:\n%s" % (rank, node.name, rc, text[-3000:]))
        out[rank] = text
    return out


def check_resumed(results, step):
    elements = 0
    for rank, text in results.items():
        line = next((l for l in text.splitlines() if l.startswith("resumed step=")), None)
        check(line is not None, "rank %d printed no resumed line:\n%s" % (rank, text[-2000:]))
        fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
        check(int(line.split()[1].split("=")[1]) == step, "rank %d resumed %s, expected step %d" % (rank, line, step))
        elements += int(fields.get("verified_elements", "0"))
    check(elements > 0, "no element was verified")
    return elements


def cli(bin_dir, *args):
    p = subprocess.run([os.path.join(bin_dir, "flashckpt")] + list(args), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=120)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def job_dir(root, job=JOB):
    return os.path.join(root, job)


def steps_on_disk(root, job):
    return sorted(int(n.split("-")[1]) for n in os.listdir(job_dir(root, job)) if n.startswith("checkpoint-"))


def lease_of(root, job, step, node):
    """The path of `node`'s lease on `step` of `job` in the root, or None."""
    d = os.path.join(job_dir(root, job), ".leases")
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return None
    prefix = "checkpoint-%d.%s." % (step, node)
    # Not a lease being written (WriteFileDurably's temporary "<name>.tmp.<pid>.<place>.<n>"): it protects nothing yet.
    return next((os.path.join(d, n) for n in names if n.startswith(prefix) and ".tmp." not in n), None)


def hold_restore(node, root, step):
    """One rank on `node` restores `step` of KEEP_JOB (all of it: world 1); its daemon is stopped (SIGSTOP)
    in the middle of the restore, once its lease on the step is in the root. Returns the rank's process
    and the lease. A restore that ends before it is stopped is run again (at most 5 times)."""
    cmd = [os.path.join(node.bin_dir, "flashckpt-sim"), "--socket", node.sock, "--job", KEEP_JOB, "--rank", "0",
           "--world-size", "1", "--layers", str(KEEP_LAYERS), "--hidden", str(KEEP_HIDDEN),
           "--steps", str(step), "--resume-step", str(step), "--wait-timeout", "180"]
    for attempt in range(5):
        p = node.run(cmd, "restore-%d-%d.log" % (step, attempt))
        lease = None
        deadline = time.monotonic() + 60
        while lease is None and p.poll() is None and time.monotonic() < deadline:
            lease = lease_of(root, KEEP_JOB, step, node.name)
            if lease is None:
                time.sleep(0.002)
        if lease is not None:
            node.pause_daemon()
            if os.path.exists(lease):
                return p, lease
            node.resume_daemon()  # the restore ended meanwhile: again
        rc = p.wait(timeout=60)
        check(rc == 0, "the restore of step %d on %s exited %d:\n%s" % (step, node.name, rc, tail(node.logs[-1])))
    raise TestFailure("no restore of step %d on %s could be stopped in its middle in 5 tries" % (step, node.name))


def latest(root):
    with open(os.path.join(job_dir(root), "LATEST")) as f:
        return int(f.read())


def run(tmp, bin_dir):
    root = os.path.join(tmp, "root")
    os.makedirs(root)
    nodes = [Node("node%d" % i, tmp, root, bin_dir) for i in range(4)]
    try:
        for n in nodes:
            n.start_daemon()
        log("4 nodes up, each with its own /dev/shm and daemon")

        # 1. 4 x 2 ranks save every step.
        run_ranks(nodes, 2, tp=2, steps=30, run_id="mn-train")
        for n in nodes:
            segments = n.shm()
            check(segments and all(s.startswith("flashckpt.") for s in segments),
                  "%s's /dev/shm: %s" % (n.name, segments))
        for step in range(1, 31):
            d = os.path.join(job_dir(root), "checkpoint-%d" % step)
            check(os.path.exists(os.path.join(d, "metadata.json")), "checkpoint-%d is not complete" % step)
            rc, out, err = cli(bin_dir, "verify", d)
            check(rc == 0, "verify checkpoint-%d: %d %s%s" % (step, rc, out, err))
        last = os.path.join(job_dir(root), "checkpoint-30")
        flashckpt_reader.verify_checkpoint(last, layers=LAYERS, hidden=HIDDEN)
        for rank in range(8):
            with open(os.path.join(last, "saved_signal_%d" % rank)) as f:
                sig = json.load(f)
            check(sig.get("node") == "node%d" % (rank // 2) and sig.get("world_size") == 8,
                  "saved_signal_%d: %s" % (rank, sig))
        check(latest(root) == 30, "LATEST is %d" % latest(root))
        log("4 nodes x 2 ranks: 30 steps complete, verified; each signal names its node")

        # 1b. The same with no run id anywhere (no --run-id, no launcher variables): the daemons agree
        # on the launch through the root, so every step completes; a relaunch that resumes is a new run.
        for launch, (first, last) in enumerate(((1, 20), (21, 30))):
            done = run_ranks(nodes, 2, tp=2, steps=last, run_id=None, job=NORUN_JOB, resume=launch > 0)
            if launch:
                check_resumed(done, first - 1)
            runs = set()
            for step in range(first, last + 1):
                d = os.path.join(job_dir(root, NORUN_JOB), "checkpoint-%d" % step)
                check(os.path.exists(os.path.join(d, "metadata.json")),
                      "no run id, launch %d: checkpoint-%d is not complete (%s)" % (launch, step, os.listdir(d)))
                with open(os.path.join(d, "metadata.json")) as f:
                    runs.add(json.load(f).get("run_id"))
            check(len(runs) == 1, "no run id, launch %d: its steps are of several runs: %s" % (launch, runs))
            log("no run id, launch %d: 4 nodes x 2 ranks, steps %d-%d all complete in run %s"
                % (launch, first, last, runs.pop()))

        # 2. Other node counts and layouts.
        done = check_resumed(run_ranks(nodes[:3], 2, tp=2, steps=30, run_id="mn-3x2", resume=True), 30)
        log("3 nodes x 2 ranks (tp 2, shard 3) resumed step 30 bit-exact (%d elements)" % done)
        done = check_resumed(run_ranks(nodes[:2], 4, tp=4, steps=30, run_id="mn-2x4", resume=True), 30)
        log("2 nodes x 4 ranks (tp 4, shard 2) resumed step 30 bit-exact (%d elements)" % done)

        # 3. A node dies while the job saves every step.
        procs = run_ranks(nodes, 2, tp=2, steps=400, run_id="mn-kill", resume=True, step_ms=20, wait=False)
        deadline = time.monotonic() + 60
        while latest(root) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        check(latest(root) >= 40, "the run did not get past step 40")
        nodes[3].kill()
        killed_at = latest(root)
        time.sleep(0.5)
        for _, node, p in procs:  # the job fails: its other ranks are stopped too
            kill_rank(p)
        time.sleep(1.5)  # a sweep interval: nothing left to complete
        named = latest(root)
        check(named >= killed_at, "LATEST moved back from %d to %d" % (killed_at, named))
        check(os.path.exists(os.path.join(job_dir(root), "checkpoint-%d" % named, "metadata.json")),
              "LATEST names an incomplete step")
        rc, out, err = cli(bin_dir, "list", "--root", root, "--job", JOB, "--json")
        check(rc == 0, "list --root: %d %s" % (rc, err))
        listed = json.loads(out)
        # What a resume restores: the newest complete step. LATEST names it, unless two daemons completed
        # steps at the same moment and the older one's LATEST landed last (the sweep moves it forward
        # while the job runs; this one was stopped).
        final = max(c["step"] for c in listed if c["complete"])
        check(final >= named, "LATEST %d names a step newer than the newest complete %d" % (named, final))
        newer = [c for c in listed if c["step"] > final]
        check(newer, "no step after LATEST %d was started: %s" % (final, [c["step"] for c in listed][-5:]))
        missing_nodes = {m["last_node"] for c in newer for m in c["missing"]}
        check("node3" in missing_nodes, "list does not name the killed node among the missing: %s" % missing_nodes)
        log("node3 killed at LATEST %d: LATEST stays %d (complete; newest complete %d); list names node3's ranks "
            "as missing" % (killed_at, named, final))

        nodes[3] = Node("node4", tmp, root, bin_dir)
        nodes[3].start_daemon()
        done = check_resumed(run_ranks(nodes, 2, tp=2, steps=final, run_id="mn-replaced", resume=True), final)
        log("3 surviving nodes + 1 fresh node resumed step %d bit-exact (%d elements)" % (final, done))

        # 4. --keep 2 on every daemon; a restore of a step falling out of retention; a dead node's lease.
        for n in nodes:
            n.stop_daemon()
            n.start_daemon("--keep", "2", "--lease-ttl", str(DEAD_LEASE_TTL_S if n is nodes[3] else LEASE_TTL_S))
        savers = nodes[:2]

        def save(steps):  # 2 nodes x 1 rank (shard 2) save up to `steps`, resuming from LATEST
            run_ranks(savers, 1, tp=1, steps=steps, run_id="mn-keep", resume=True, job=KEEP_JOB, layers=KEEP_LAYERS,
                      hidden=KEEP_HIDDEN)

        save(3)
        check(steps_on_disk(root, KEEP_JOB) == [2, 3], "--keep 2 left %s" % steps_on_disk(root, KEEP_JOB))
        reader, lease = hold_restore(nodes[2], root, 2)
        begun = time.monotonic()
        save(6)  # step 4 completes: retention would delete 2, which the stopped restore holds a lease on
        took = time.monotonic() - begun
        check(os.path.exists(lease), "the lease of the held restore is gone")
        with open(lease) as f:
            expires = json.load(f)["expires_unix_ms"] / 1000.0
        check(time.time() < expires, "steps 4-6 took %.1f s, past the stopped restore's lease (TTL %d s): the test "
              "shows nothing" % (took, LEASE_TTL_S))
        check(steps_on_disk(root, KEEP_JOB) == [2, 5, 6],
              "retention with a restore of step 2 in progress left %s" % steps_on_disk(root, KEEP_JOB))
        nodes[2].resume_daemon()
        check(reader.wait(timeout=120) == 0, "the held restore failed:\n%s" % tail(nodes[2].logs[-1]))
        check_resumed({0: open(nodes[2].logs[-1], errors="replace").read()}, 2)
        check(not os.path.exists(lease), "the restore left its lease")
        save(7)
        check(steps_on_disk(root, KEEP_JOB) == [6, 7],
              "after the restore, retention left %s" % steps_on_disk(root, KEEP_JOB))
        log("--keep 2 on every daemon: a restore of step 2 on node2, held while steps 4-6 completed (%.1f s), kept "
            "step 2 (its lease) and succeeded bit-exact; the next save deleted step 2" % took)

        reader, lease = hold_restore(nodes[3], root, 6)
        nodes[3].kill()  # the node dies in the middle of the restore; its lease stays in the root
        reader.wait(timeout=30)
        with open(lease) as f:
            expires = json.load(f)["expires_unix_ms"] / 1000.0
        begun = time.monotonic()
        save(8)
        check(time.time() < expires, "step 8 took %.1f s, past the dead node's lease (TTL %d s): the test shows "
              "nothing" % (time.monotonic() - begun, DEAD_LEASE_TTL_S))
        check(steps_on_disk(root, KEEP_JOB) == [6, 7, 8],
              "with a dead node's live lease on step 6, retention left %s" % steps_on_disk(root, KEEP_JOB))
        time.sleep(max(0.0, expires - time.time()) + 0.5)
        save(9)
        check(steps_on_disk(root, KEEP_JOB) == [8, 9],
              "after the dead node's lease expired, retention left %s" % steps_on_disk(root, KEEP_JOB))
        check(not os.path.exists(os.path.join(job_dir(root, KEEP_JOB), ".leases")), "the expired lease stayed")
        log("a node killed while restoring step 6: its lease kept step 6 until it expired (%d s), then retention "
            "deleted it" % DEAD_LEASE_TTL_S)
    finally:
        for n in nodes:  # every node, even when one of them fails to die
            try:
                n.kill()
            except (OSError, subprocess.SubprocessError) as e:
                log("node %s: %s" % (n.name, e))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    return run_on_nodes(lambda tmp: run(tmp, os.path.abspath(args.bin_dir)), "fcmultinode", args.keep)


def run_on_nodes(body, prefix, keep):
    """Runs body(tmp) of a test on simulated nodes, `tmp` a new folder under /tmp whose name starts
    with `prefix` (removed at the end unless `keep`); returns the exit status: 0 passed, 1 failed
    (the nodes' logs printed), SKIP where this machine cannot make the nodes (not root, no namespaces)."""
    if os.geteuid() != 0:
        print("SKIPPED: simulated nodes need root (mount and PID namespaces, a tmpfs per node)")
        return SKIP
    probe = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--", "true"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    if probe.returncode != 0:
        print("SKIPPED: cannot create namespaces here: %s" % probe.stdout.decode().strip())
        return SKIP
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        body(tmp)
    except (TestFailure, flashckpt_reader.CheckpointError, subprocess.TimeoutExpired) as e:
        print_failure(e, tmp)
        return 1
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())

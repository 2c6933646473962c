#!/usr/bin/python3
"""Erasure-coded peer memory between simulated nodes (flashckptd --ec-group, --ec-parity). Each node
is a mount, PID and network namespace of its own (a private tmpfs on /dev/shm, one veth interface on
a bridge this test creates), with its own flashckptd: --replica-listen on the node's address and
--ec-group listing every node's, mutual TLS with certificates made here by openssl. No node keeps a
full copy of another's checkpoints: each holds parity shares.

For G members and M parity (4 and 1, then 6 and 2, then 5 and 1 with the fifth member running no
ranks of the job), with 2 ranks per node:
  1. Every rank takes a memory checkpoint every step and saves to disk every 10, and holds at step
     17. Every member's status shows the parity shares it holds, all of step 17, and their bytes at
     most M / (G - M) of its own ranks' checkpoint plus a page per share. With 6 members one rank
     of a node to be lost starts only once the others hold at 17: its node's other rank coded its
     steps as the node's only one, and the late rank must neither take its place nor be left out.
  2. M nodes die (SIGKILL of their namespaces: daemons, ranks, /dev/shm); the other ranks are
     SIGKILLed too (the job restarts). Fresh nodes take the lost ones' places (same address and
     flags, nothing in memory), and every rank resumes the latest (--resume, no step given): step
     17, the lost nodes' ranks rebuilt from the survivors' blocks and parity (from=parity), the
     others from their memory, every element checked against the simulator's formula. Each rebuild
     is told by a parity-rebuilt event in the replacement daemon's log, once per rank.

Needs root (namespaces, mounts, a bridge): otherwise it prints why and exits 77 (ctest: skipped).

    test_parity.py --bin-dir build/bin [--keep]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))
from harness import TestFailure, check, log, tail  # noqa: E402
from test_multinode import SKIP, Node, print_failure  # noqa: E402
from test_replicas import (PER_NODE, PORT, Cluster, address, make_certificates, resumed, sh,  # noqa: E402
                           wait_holding)

TAG = "%05d" % (os.getpid() % 100000)
BRIDGE = "fcpb" + TAG
PAGE = 4096
METRICS_PORT = 9464


class Group(Cluster):
    """G nodes on the bridge, each daemon a member of one parity group of M."""

    def __init__(self, tmp, bin_dir, members, parity, job, idle_last=False):
        """`idle_last`: the last member runs no ranks of the job (the world is the others' ranks)."""
        super().__init__(tmp, bin_dir, members, job, BRIDGE, "fp")
        self.members, self.parity = members, parity
        self.idle = {members - 1} if idle_last else set()
        self.world = (members - len(self.idle)) * PER_NODE
        self.root = os.path.join(tmp, "root-%s" % job)
        self.certs = os.path.join(tmp, "certs-%s" % job)
        make_certificates(self.certs, members)
        self.daemon_logs = [None] * members

    def start_node(self, i):
        self.starts += 1
        name = "%s-node%d.%d" % (self.job, i, self.starts)
        node = Node(name, self.tmp, self.root, self.bin_dir, net=True)
        self.nodes[i] = node
        self.plug(node, i)
        group = ",".join("%s:%d" % (address(j), PORT) for j in range(self.members))
        flags = ["--replica-listen", "%s:%d" % (address(i), PORT),
                 "--ec-group", group, "--ec-parity", str(self.parity),
                 "--replica-tls-cert", os.path.join(self.certs, "node%d.pem" % i),
                 "--replica-tls-key", os.path.join(self.certs, "node%d.key" % i),
                 "--replica-tls-ca", os.path.join(self.certs, "ca.pem")]
        for j in range(self.members):
            flags += ["--replica-allow-name", "node%d" % j]
        flags += ["--metrics-listen", "127.0.0.1:%d" % METRICS_PORT]  # in the node's own network namespace
        flags += ["--log-level", "debug"]  # each block sent is logged: parity_report() shows them
        node.start_daemon(*flags)
        self.daemon_logs[i] = node.logs[-1]
        log("%s up at %s, member %d of %d (parity %d)" % (name, address(i), i, self.members, self.parity))

    def parity_report(self, step):
        """What each member says of its parity, and what its daemon logged of the blocks of `step`: for a
        share that does not complete, which block never came."""
        lines = []
        for i in range(self.members):
            try:
                s = self.status(i)
                lines.append("node%d: %d shares held (oldest step %s), %d sent, %d failed" %
                             (i, s["parity_shares_held"], s["parity_step"], s["parity_sent"], s["parity_failed"]))
            except (TestFailure, subprocess.SubprocessError, ValueError) as e:
                lines.append("node%d: no status: %s" % (i, e))
            with open(self.daemon_logs[i], errors="replace") as f:
                lines += ["  " + l.rstrip() for l in f if "[parity]" in l and
                          (" step=%d " % step in l or "warn" in l)]
        return "\n".join(lines)

    def wait_coded(self, step):
        """Until every member holds its shares of `step`: M stripes x PER_NODE positions each."""
        deadline = time.monotonic() + 120
        shares = self.parity * PER_NODE
        for i in range(self.members):
            while True:
                s = self.status(i)
                ranks = [r for j in s["jobs"] if j["job"] == self.job for r in j["ranks"]]
                if (len(ranks) == (0 if i in self.idle else PER_NODE) and
                        all(r["memory_step"] == step for r in ranks) and
                        s["parity_shares_held"] == shares and s["parity_step"] == step):
                    break
                if time.monotonic() >= deadline:
                    raise TestFailure("node%d: step %d not coded: ranks %s, %d shares of step %d held, %d sent, %d "
                                      "failed\n%s" % (i, step, [(r["rank"], r["memory_step"]) for r in ranks],
                                                       s["parity_shares_held"], s["parity_step"], s["parity_sent"],
                                                       s["parity_failed"], self.parity_report(step)))
                time.sleep(0.1)
            check(s["ec_group"] and s["ec_member"] == i and s["ec_members"] == self.members and
                  s["ec_parity"] == self.parity, "node%d's status: %s" % (i, s))
            check(s["replicas_held"] == 0, "node%d holds full replicas: %s" % (i, s["replicas_held"]))
            if i in self.idle:
                log("node%d runs no ranks of the job and holds %d parity shares of step %d (%d bytes)" %
                    (i, shares, step, s["parity_held_bytes"]))
                continue
            # What a checkpoint of the node's ranks takes: the memory checkpoints' bytes, one each.
            own = sum(r["memory_bytes"] // max(1, r["memory_checkpoints"]) for r in ranks)
            most = own * self.parity // (self.members - self.parity) + shares * PAGE
            check(0 < s["parity_held_bytes"] <= most,
                  "node%d holds %d bytes of parity; its own checkpoint is %d bytes, so at most %d (M/(G-M) of it)" %
                  (i, s["parity_held_bytes"], own, most))
            log("node%d holds %d parity shares of step %d: %d bytes for its own %d (%.2f; M/(G-M) = %.2f)" %
                (i, shares, step, s["parity_held_bytes"], own, s["parity_held_bytes"] / own,
                 self.parity / (self.members - self.parity)))
        text = subprocess.run([os.path.join(self.bin_dir, "flashckpt"), "status", "--socket", self.nodes[0].sock],
                              stdout=subprocess.PIPE, timeout=60).stdout.decode(errors="replace")
        lines = [l for l in text.splitlines() if l.startswith("parity ")]
        check(len(lines) == 1 and "member 0 of %d" % self.members in lines[0], "node0's status: %s" % text)
        inside = self.nodes[0].enter(pid=False)
        p = subprocess.run(inside + ["/usr/bin/python3", "-c", "import urllib.request; print(urllib.request.urlopen("
                                     "'http://127.0.0.1:%d/metrics', timeout=30).read().decode())" % METRICS_PORT],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        metrics = p.stdout.decode(errors="replace")
        shares = re.search(r"^flashckpt_parity_shares_held (\S+)$", metrics, re.M)
        sent = re.findall(r"^flashckpt_parity_sent_total\{member=\"[^\"]+\"\} (\S+)$", metrics, re.M)
        check(shares is not None and float(shares.group(1)) == self.parity * PER_NODE and len(sent) == self.members - 1
              and sum(float(v) for v in sent) > 0, "node0's metrics:\n%s" % metrics[-3000:])
        log("node0: %s; its metrics: %d shares held, %d checkpoints' blocks acknowledged by the members" %
            (lines[0], float(shares.group(1)), sum(float(v) for v in sent)))


def lose_and_rebuild(group, lost, late=()):
    """`late`: ranks started once the others hold at step 17."""
    first = ["--steps", "100", "--hold-after", "17"]
    procs = group.sims_run("first", first, [r for r in range(group.world) if r not in late])
    wait_holding(procs, 17)
    if late:
        log("ranks %s start now that the others hold at step 17" % list(late))
        procs.update(group.sims_run("first", first, late))
        wait_holding(procs, 17)
    group.wait_coded(17)

    group.kill_all_ranks()
    for i in lost:
        group.nodes[i].kill()
        log("node%d killed: its daemon, its ranks and its /dev/shm are gone" % i)
    for i in lost:
        group.start_node(i)
    procs = group.sims_run("second", ["--steps", "18", "--resume"])
    got = resumed(procs)
    for rank in range(group.world):
        want = (17, "parity" if rank // PER_NODE in lost else "memory")
        check(got[rank] == want, "rank %d resumed step=%d from=%s, expected step=%d from=%s" %
              ((rank,) + got[rank] + want))
    for rank, (node, p, path) in procs.items():
        check(p.wait(timeout=120) == 0, "rank %d on %s exited %s:\n%s" % (rank, node.name, p.returncode, tail(path)))
    for i in lost:
        daemon_log = group.daemon_logs[i]
        text = open(daemon_log, errors="replace").read()
        rebuilt = re.findall(r"parity rebuilt job=%s rank=(\d+) step=17 " % re.escape(group.job), text)
        # Once each: the resume plan's fetch and the rank's own restore do not both rebuild it.
        check(sorted(int(r) for r in rebuilt) == [i * PER_NODE + k for k in range(PER_NODE)],
              "node%d's replacement did not log exactly one rebuild of each of its ranks (%s):\n%s" %
              (i, rebuilt, tail(daemon_log)))
    log("%d members, parity %d: nodes %s lost; all %d ranks resumed step 17 bit-exact, the lost nodes' ranks "
        "rebuilt from the others' blocks and parity" % (group.members, group.parity, lost, group.world))


def release_everywhere(group):
    """`flashckpt release` of the job on every member that runs ranks of it: each tells the holders of
    its stripes, and once every member whose block is in a share has, no member holds any."""
    for i in range(group.members):
        if i in group.idle:
            continue
        # The daemon sees a session end a moment after its trainer's exit.
        deadline = time.monotonic() + 30
        while True:
            p = subprocess.run([os.path.join(group.bin_dir, "flashckpt"), "release", "--job", group.job, "--force",
                                "--socket", group.nodes[i].sock], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=120)
            out = p.stdout.decode(errors="replace")
            if p.returncode == 0 or "is connected" not in out or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        check(p.returncode == 0, "flashckpt release on node%d: %s" % (i, out))
    deadline = time.monotonic() + 60
    for i in range(group.members):
        while True:
            s = group.status(i)
            if s["parity_shares_held"] == 0 and s["parity_held_bytes"] == 0:
                break
            if time.monotonic() >= deadline:
                raise TestFailure("node%d still holds %d parity shares (%d bytes) of a job every member released\n%s" %
                                  (i, s["parity_shares_held"], s["parity_held_bytes"], group.parity_report(17)))
            time.sleep(0.1)
    # Each member's record of its release word (<state dir>/<job>.released) goes once every holder has it.
    for i in range(group.members):
        if i in group.idle:
            continue
        record = "%s.state/%s.released" % (group.nodes[i].sock, group.job)
        check(os.path.isdir(os.path.dirname(record)), "no state directory at %s" % os.path.dirname(record))
        while os.path.exists(record):
            if time.monotonic() >= deadline:
                raise TestFailure("node%d still keeps %s: a holder has not heard its release word" % (i, record))
            time.sleep(0.1)
        # And it was there: the daemon says so when it removes it.
        said = "parity release word job=%s no holder waits for any more" % group.job
        with open(group.daemon_logs[i], errors="replace") as f:
            check(any(said in line for line in f), "node%d never kept a record of its release word (no \"%s\" in its "
                  "log)\n%s" % (i, said, tail(group.daemon_logs[i])))
    log("%d members: the job released on every member that ran it; no member holds a parity share of it, and no "
        "member keeps a release word for a holder" % group.members)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("SKIPPED: simulated nodes need root (namespaces, mounts, a bridge)")
        return SKIP
    probe = subprocess.run(["unshare", "--mount", "--pid", "--net", "--fork", "--", "true"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    if probe.returncode != 0 or shutil.which("ip") is None or shutil.which("openssl") is None:
        print("SKIPPED: cannot create network namespaces, or no ip/openssl here: %s" % probe.stdout.decode().strip())
        return SKIP
    tmp = tempfile.mkdtemp(prefix="fcparity", dir="/tmp")
    started = time.monotonic()
    group = None
    try:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "link", "set", BRIDGE, "up")
        # Rank 8 is the first of node 4's ranks: started late, it comes before its node's other rank
        # in rank order. With 5 members the last one runs no ranks of the job: it tells the holders
        # of its stripes so, and their shares do not wait for blocks of it.
        for members, parity, lost, late, idle_last in ((4, 1, [2], (), False), (6, 2, [1, 4], (4 * PER_NODE,), False),
                                                       (5, 1, [1], (), True)):
            group = Group(tmp, os.path.abspath(args.bin_dir), members, parity, "parity%d-%d" % (members, os.getpid()),
                          idle_last)
            for i in range(members):
                group.start_node(i)
            lose_and_rebuild(group, lost, late)
            release_everywhere(group)
            group.close()
            group = None
    except (TestFailure, subprocess.TimeoutExpired) as e:
        print_failure(e, tmp)
        return 1
    finally:
        if group is not None:
            group.close()
        subprocess.run(["ip", "link", "del", BRIDGE], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print("PASSED in %.1f s" % (time.monotonic() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())

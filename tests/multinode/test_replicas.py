#!/usr/bin/python3
"""Peer replicas between simulated nodes. Each node is a mount, PID and network namespace of its own
(a private tmpfs on /dev/shm, and one veth interface with an address on a bridge this test creates:
the nodes reach each other only through it), with its own flashckptd: --replica-listen on the
node's address, --replicate-to the next node's (a ring, replication factor 1), mutual TLS with
certificates made here by openssl (a CA; one certificate per node, its name and its address).

  1. 4 nodes x 2 ranks (world 8, tp 2, shard 4) take a memory checkpoint every step and save to
     disk every 10; every rank holds at step 27. Every node's status shows its peer 0 steps behind
     once every rank's step 27 is kept, and the peer holds the replicas.
  2. Node 2 dies (SIGKILL of its namespace: its daemon, its ranks, its /dev/shm); the other ranks
     are SIGKILLed (the job restarts). A fresh node 2 (same address and flags, nothing in memory)
     joins, and all 8 ranks resume the latest (--resume, no step given): the daemons agree, through
     the shared root, on step 27, the newest every rank has a copy of here or on a peer (the disk's
     newest is 20): node 2's ranks from the peer's replicas (from=peer), the others from their
     node's memory, every element checked against the simulator's formula. They run on to step 33
     and hold there.
  3. Nodes 1 and 2 die together (node 2 held node 1's replicas, node 3 holds node 2's): node 1's
     ranks have no copy of a memory step anywhere, so the job falls back to the newest complete
     checkpoint on disk, 30, on every rank.
  4. Two unrelated jobs of one name: node 0 and node 1 each run a job named TWIN (their own roots and
     run ids, the same layout), both replicating to node 2. Node 0's job is on disk at 10 and in
     memory at 17, node 1's in memory at 30. Node 0 dies; its replacement (node 0's root) resumes
     its own 17 from the peer, never node 1's 30.

Needs root (namespaces, mounts, a bridge): otherwise it prints why and exits 77 (ctest: skipped).

    test_replicas.py --bin-dir build/bin [--keep]
"""

import argparse
import json
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
from test_multinode import SKIP, Node, kill_rank, print_failure  # noqa: E402

NODES, PER_NODE, TP = 4, 2, 2
WORLD = NODES * PER_NODE
LAYERS, HIDDEN = 2, 64
PORT = 7443  # the same on every node: each has its own network namespace
JOB = "replicas-%d" % os.getpid()
TAG = "%05d" % (os.getpid() % 100000)  # interface names: at most 15 characters
BRIDGE = "fcbr" + TAG
SUBNET = "10.213.%d" % (os.getpid() % 200 + 20)
RESUMED = re.compile(r"^resumed step=(\d+) from=(\w+) verified_elements=(\d+)", re.M)


def sh(*cmd):
    p = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    check(p.returncode == 0, "%s: %s" % (" ".join(cmd), p.stdout.decode(errors="replace")))


def address(i):
    return "%s.%d" % (SUBNET, i + 1)


def make_certificates(d, nodes=NODES):
    """A CA and, per node, a certificate of CN node<i> for its address (IP SAN)."""
    os.makedirs(d)
    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=flashckpt-test-ca",
       "-keyout", os.path.join(d, "ca.key"), "-out", os.path.join(d, "ca.pem"))
    for i in range(nodes):
        name = os.path.join(d, "node%d" % i)
        with open(name + ".ext", "w") as f:
            f.write("subjectAltName=IP:%s,DNS:node%d\n" % (address(i), i))
        sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=node%d" % i, "-keyout", name + ".key",
           "-out", name + ".csr")
        sh("openssl", "x509", "-req", "-days", "2", "-in", name + ".csr", "-CA", os.path.join(d, "ca.pem"), "-CAkey",
           os.path.join(d, "ca.key"), "-CAcreateserial", "-extfile", name + ".ext", "-out", name + ".pem")


class Cluster:
    """Simulated nodes on one bridge (test_multinode.Node, node i at address(i), with its daemon) and
    the flashckpt-sim ranks of one job on them, rank r on node r // PER_NODE. test_parity's Group is
    one too."""

    def __init__(self, tmp, bin_dir, nodes, job, bridge, veth):
        self.tmp, self.bin_dir, self.job, self.bridge, self.veth = tmp, bin_dir, job, bridge, veth
        self.world = nodes * PER_NODE
        self.nodes = [None] * nodes
        self.starts = 0
        self.sims = []

    def plug(self, node, i):
        """Joins `node` to the bridge at address(i) by a veth pair of its own (the pair goes with the
        node's network namespace)."""
        host_end, node_end = "%sH%s%d" % (self.veth, TAG, self.starts), "%sN%s%d" % (self.veth, TAG, self.starts)
        sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
        sh("ip", "link", "set", host_end, "master", self.bridge)
        sh("ip", "link", "set", host_end, "up")
        sh("ip", "link", "set", node_end, "netns", str(node.pid1))
        inside = node.enter(pid=False)
        sh(*inside, "ip", "link", "set", "lo", "up")
        sh(*inside, "ip", "addr", "add", address(i) + "/24", "dev", node_end)
        sh(*inside, "ip", "link", "set", node_end, "up")

    def sims_run(self, phase, extra, ranks=None):
        """One flashckpt-sim per rank (of `ranks`, default all): {rank: (node, process, log)}."""
        procs = {}
        for rank in range(self.world) if ranks is None else ranks:
            node = self.nodes[rank // PER_NODE]
            cmd = [os.path.join(self.bin_dir, "flashckpt-sim"), "--socket", node.sock, "--job", self.job, "--rank",
                   str(rank), "--world-size", str(self.world), "--tp-degree", str(TP), "--shard-degree",
                   str(self.world // TP), "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--save-every", "10",
                   "--memory-every", "1", "--run-id", "%s-%s" % (self.job, phase), "--wait-timeout", "60"] + extra
            name = "sim-%s-rank%d.log" % (phase, rank)
            p = node.run(cmd, name)
            self.sims.append(p)
            procs[rank] = (node, p, os.path.join(node.dir, name))
        return procs

    def status(self, i):
        p = subprocess.run([os.path.join(self.bin_dir, "flashckpt"), "status", "--json", "--socket", self.nodes[i].sock],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
        check(p.returncode == 0, "flashckpt status on node%d: %s" % (i, p.stderr.decode(errors="replace")))
        return json.loads(p.stdout)

    def kill_all_ranks(self):
        for p in self.sims:
            if p.poll() is None:
                kill_rank(p)
        self.sims = []

    def close(self):
        self.kill_all_ranks()
        for node in self.nodes:
            if node is not None:
                try:
                    node.kill()
                except (OSError, subprocess.SubprocessError) as e:
                    log("node %s: %s" % (node.name, e))


class Ring(Cluster):
    """The nodes of the replica ring, each daemon replicating to the next, their bridge and certificates."""

    def __init__(self, tmp, bin_dir):
        super().__init__(tmp, bin_dir, NODES, JOB, BRIDGE, "fc")
        self.root = os.path.join(tmp, "root")
        self.certs = os.path.join(tmp, "certs")
        make_certificates(self.certs)
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "link", "set", BRIDGE, "up")

    def start_node(self, i, root=None, replicate_to=None):
        """Node i: a fresh namespace joined to the bridge at address(i), and its daemon, with the ring's
        root and next node as its peer unless `root` and `replicate_to` (a node's index) say otherwise."""
        self.starts += 1
        name = "node%d" % i if self.nodes[i] is None else "node%d.%d" % (i, self.starts)  # a fresh one: its own logs
        node = Node(name, self.tmp, root or self.root, self.bin_dir, net=True)
        self.nodes[i] = node
        self.plug(node, i)
        peer = (i + 1) % NODES if replicate_to is None else replicate_to
        flags = ["--replica-listen", "%s:%d" % (address(i), PORT),
                 "--replicate-to", "%s:%d" % (address(peer), PORT),
                 "--replica-tls-cert", os.path.join(self.certs, "node%d.pem" % i),
                 "--replica-tls-key", os.path.join(self.certs, "node%d.key" % i),
                 "--replica-tls-ca", os.path.join(self.certs, "ca.pem")]
        for j in range(NODES):
            flags += ["--replica-allow-name", "node%d" % j]
        node.start_daemon(*flags)
        log("%s up at %s (its daemon replicates to %s)" % (name, address(i), address(peer)))

    def kill_node(self, i):
        self.nodes[i].kill()  # its veth pair goes with its network namespace
        log("node%d killed: its daemon, its ranks and its /dev/shm are gone" % i)

    def wait_replicated(self, step):
        """Until every rank's newest memory checkpoint is `step` and every node's peer has it."""
        deadline = time.monotonic() + 120
        for i in range(NODES):
            while True:
                s = self.status(i)
                ranks = [r for j in s["jobs"] if j["job"] == JOB for r in j["ranks"]]
                peers = s["replica_peers"]
                if (len(ranks) == PER_NODE and all(r["memory_step"] == step for r in ranks) and len(peers) == 1 and
                        peers[0]["lag_steps"] == 0):
                    break
                check(time.monotonic() < deadline, "node%d: step %d not replicated: ranks %s, peers %s" %
                      (i, step, [(r["rank"], r["memory_step"]) for r in ranks], peers))
                time.sleep(0.1)
        text = subprocess.run([os.path.join(self.bin_dir, "flashckpt"), "status", "--socket", self.nodes[0].sock],
                              stdout=subprocess.PIPE, timeout=60).stdout.decode(errors="replace")
        lines = [l for l in text.splitlines() if l.startswith("replica ")]
        check(len(lines) == 1 and " lag 0 step(s)" in lines[0], "node0's status: %s" % text)
        held = [l for l in text.splitlines() if l.startswith("held ")]
        check(len(held) == 1 and held[0].split()[1] == str(PER_NODE), "node0's status: %s" % text)
        for i in range(NODES):  # each node holds its predecessor's ranks
            s = self.status(i)
            check(s["replica_listening"] and s["replicas_held"] == PER_NODE and s["replica_held_bytes"] > 0,
                  "node%d holds %s replicas (%s bytes)" % (i, s["replicas_held"], s["replica_held_bytes"]))
        log("step %d replicated on every node; node0: %s; %s" % (step, lines[0], held[0]))

    def close(self):
        super().close()
        subprocess.run(["ip", "link", "del", BRIDGE], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_holding(procs, step):
    line = "holding step=%d" % step
    deadline = time.monotonic() + 180
    for rank, (node, p, path) in procs.items():
        while line not in open(path, errors="replace").read():
            check(p.poll() is None, "rank %d on %s exited %s before holding:\n%s" %
                  (rank, node.name, p.returncode, tail(path)))
            check(time.monotonic() < deadline, "rank %d on %s did not hold at step %d" % (rank, node.name, step))
            time.sleep(0.05)


def resumed(procs):
    """{rank: (step, from)} once every rank printed its resumed line (each verified elements)."""
    out = {}
    deadline = time.monotonic() + 180
    for rank, (node, p, path) in procs.items():
        while True:
            m = RESUMED.search(open(path, errors="replace").read())
            if m:
                break
            check(p.poll() is None, "rank %d on %s exited %s without resuming:\n%s" % (rank, node.name, p.returncode,
                                                                                        tail(path)))
            check(time.monotonic() < deadline, "rank %d on %s did not resume" % (rank, node.name))
            time.sleep(0.05)
        check(int(m.group(3)) > 0, "rank %d verified no element" % rank)
        out[rank] = (int(m.group(1)), m.group(2))
    return out


def run(ring):
    for i in range(NODES):
        ring.start_node(i)

    # --- 1. memory every step, disk every 10; every rank holds at 27 ---------------------------
    procs = ring.sims_run("first", ["--steps", "100", "--hold-after", "27"])
    wait_holding(procs, 27)
    ring.wait_replicated(27)

    # --- 2. node 2 dies; a fresh node 2; every rank resumes 27, node 2's from the peer ------------
    ring.kill_all_ranks()
    ring.kill_node(2)
    ring.start_node(2)
    procs = ring.sims_run("second", ["--steps", "100", "--resume", "--hold-after", "33"])
    got = resumed(procs)
    for rank in range(WORLD):
        want = (27, "peer" if rank // PER_NODE == 2 else "memory")
        check(got[rank] == want, "rank %d resumed step=%d from=%s, expected step=%d from=%s" %
              ((rank,) + got[rank] + want))
    log("all %d ranks resumed the latest, step 27, bit-exact: node2's from the peer's replicas, the others from "
        "memory" % WORLD)
    wait_holding(procs, 33)
    ring.wait_replicated(33)

    # --- 3. nodes 1 and 2 die together: node 1's ranks have no copy left; the disk's 30 ------------
    ring.kill_all_ranks()
    ring.kill_node(1)
    ring.kill_node(2)
    ring.start_node(1)
    ring.start_node(2)
    procs = ring.sims_run("third", ["--steps", "31", "--resume"])
    got = resumed(procs)
    for rank in range(WORLD):
        check(got[rank] == (30, "disk"), "rank %d resumed step=%d from=%s, expected the disk's 30" %
              ((rank,) + got[rank]))
    for rank, (node, p, path) in procs.items():
        check(p.wait(timeout=120) == 0, "rank %d on %s exited %s:\n%s" % (rank, node.name, p.returncode, tail(path)))
    log("nodes 1 and 2 lost together: all %d ranks resumed from the disk's step 30" % WORLD)

    # --- 4. two unrelated jobs of one name on nodes 0 and 1, one peer: each resumes its own --------
    roots = [os.path.join(ring.tmp, "twin-root-%d" % i) for i in range(2)]
    for i in range(2):
        ring.kill_node(i)
        ring.start_node(i, root=roots[i], replicate_to=2)
    twins = [twin_run(ring, 0, "twin-a", ["--steps", "100", "--save-every", "10", "--hold-after", "17"]),
             twin_run(ring, 1, "twin-b", ["--steps", "100", "--save-every", "1000", "--hold-after", "30"])]
    for (node, p, path), step in zip(twins, (17, 30)):
        wait_holding({0: (node, p, path)}, step)
    for i, step in ((0, 17), (1, 30)):
        wait_twin_replicated(ring, i, step)
    for node, p, path in twins:
        kill_rank(p)
    ring.kill_node(0)
    ring.start_node(0, root=roots[0], replicate_to=2)
    daemon_log = ring.nodes[0].logs[-1]
    node, p, path = twin_run(ring, 0, "twin-a2", ["--steps", "18", "--resume"])
    got = resumed({0: (node, p, path)})[0]
    check(got == (17, "peer"), "node 0's replacement resumed step=%d from=%s, expected its own 17 from the peer "
          "(node 1's unrelated job of the same name is at 30)" % got)
    check(p.wait(timeout=120) == 0, "the resumed rank exited %s:\n%s" % (p.returncode, tail(path)))
    check(re.search(r"replica of job=%s rank=0 step=30 .* not used: it was taken by run twin-b" % TWIN,
                    open(daemon_log, errors="replace").read()),
          "node 0's daemon did not say why node 1's replica was not used:\n%s" % tail(daemon_log))
    log("two jobs named %s on nodes 0 and 1, one peer: node 0's replacement resumed its own step 17 from the peer, "
        "not node 1's 30" % TWIN)


TWIN = "twin-%d" % os.getpid()


def twin_run(ring, i, run_id, extra):
    """One rank (world 1) of job TWIN on node i: (node, process, log)."""
    node = ring.nodes[i]
    cmd = [os.path.join(ring.bin_dir, "flashckpt-sim"), "--socket", node.sock, "--job", TWIN, "--rank", "0",
           "--world-size", "1", "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--memory-every", "1",
           "--run-id", run_id, "--wait-timeout", "60"] + extra
    name = "sim-%s.log" % run_id
    p = node.run(cmd, name)
    ring.sims.append(p)
    return node, p, os.path.join(node.dir, name)


def wait_twin_replicated(ring, i, step):
    """Until node i's rank of TWIN holds `step` in memory and its peer has it."""
    deadline = time.monotonic() + 120
    while True:
        s = ring.status(i)
        ranks = [r for j in s["jobs"] if j["job"] == TWIN for r in j["ranks"]]
        peers = s["replica_peers"]
        if ranks and ranks[0]["memory_step"] == step and len(peers) == 1 and peers[0]["lag_steps"] == 0:
            return
        check(time.monotonic() < deadline, "node%d: step %d of %s not replicated: ranks %s, peers %s" %
              (i, step, TWIN, [(r["rank"], r["memory_step"]) for r in ranks], peers))
        time.sleep(0.1)


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
    tmp = tempfile.mkdtemp(prefix="fcreplicas", dir="/tmp")
    ring = None
    started = time.monotonic()
    try:
        ring = Ring(tmp, os.path.abspath(args.bin_dir))
        run(ring)
    except (TestFailure, subprocess.TimeoutExpired) as e:
        print_failure(e, tmp)
        return 1
    finally:
        if ring is not None:
            ring.close()
        else:
            subprocess.run(["ip", "link", "del", BRIDGE], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print("PASSED in %.1f s" % (time.monotonic() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Peer replication between two network namespaces: push throughput against a plain TCP stream of
the same bytes in the same run, and a rank's recovery from the peer's replica against from disk.

Two namespaces (fcbA, fcbB) joined by a veth pair (10.215.0.1 and .2, the test's own addresses).
flashckptd in B holds replicas (--replica-listen, mutual TLS with certificates made here by
openssl); flashckptd in A sends them (--replicate-to). One rank (the flashckpt Python client, in
this process) registers STATE bytes of float32 with A and saves step 1 to disk, then takes memory
checkpoints 2, 3, ...: each push's rate is A's status `last_gbps` once B acknowledged it. The limit:
a plain TCP stream of the same number of bytes from A's namespace to B's (Python sockets, 4 MiB
sends, one connection), interleaved with the pushes.

Recovery: A's daemon is SIGKILLed and its shared memory removed (the node is lost); a fresh daemon
in A's namespace with the same flags and a fresh rank restore: the newest memory step (fetched from
B: tier peer), and, in another fresh daemon, step 1 from disk with the page cache dropped. Each is
timed around Client.restore.

Needs root (ip netns, drop_caches) and openssl.

    replica_netns_bench.py [--gib 0.5] [--repeats 3] [--bin-dir build/bin] [--python-dir build/python]
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS_A, NS_B = "fcbA%d" % (os.getpid() % 10000), "fcbB%d" % (os.getpid() % 10000)
ADDR_A, ADDR_B = "10.215.0.1", "10.215.0.2"
PORT, TCP_PORT = 7443, 7500
JOB = "replica-bench-%d" % os.getpid()

RECEIVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
for _ in range(int(sys.argv[4])):
    c, _ = s.accept(); left = int(sys.argv[3]); buf = bytearray(4 << 20)
    while left > 0:
        n = c.recv_into(buf, min(len(buf), left))
        if n == 0: break
        left -= n
    c.sendall(b"k"); c.close()
"""

SENDER = r"""
import socket, sys, time
n = int(sys.argv[3]); chunk = bytes(4 << 20)
t = time.perf_counter(); c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
left = n
while left > 0:
    k = min(len(chunk), left); c.sendall(memoryview(chunk)[:k]); left -= k
c.shutdown(socket.SHUT_WR); c.recv(1); print(time.perf_counter() - t)
"""


def sh(*cmd, check=True):
    p = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if check and p.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(cmd), p.stdout.decode(errors="replace")))
    return p.stdout.decode(errors="replace")


def make_certificates(d):
    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=bench-ca", "-keyout",
       os.path.join(d, "ca.key"), "-out", os.path.join(d, "ca.pem"))
    for name, addr in (("a", ADDR_A), ("b", ADDR_B)):
        base = os.path.join(d, name)
        with open(base + ".ext", "w") as f:
            f.write("subjectAltName=IP:%s,DNS:node-%s\n" % (addr, name))
        sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=node-" + name, "-keyout", base + ".key",
           "-out", base + ".csr")
        sh("openssl", "x509", "-req", "-days", "2", "-in", base + ".csr", "-CA", os.path.join(d, "ca.pem"), "-CAkey",
           os.path.join(d, "ca.key"), "-CAcreateserial", "-extfile", base + ".ext", "-out", base + ".pem")


class Bench:
    def __init__(self, args, tmp):
        self.args, self.tmp = args, tmp
        self.root = os.path.join(tmp, "root")
        self.procs = []
        self.starts = 0
        make_certificates(tmp)
        sh("ip", "netns", "add", NS_A)
        sh("ip", "netns", "add", NS_B)
        sh("ip", "link", "add", "fcbva", "netns", NS_A, "type", "veth", "peer", "name", "fcbvb", "netns", NS_B)
        for ns, dev, addr in ((NS_A, "fcbva", ADDR_A), (NS_B, "fcbvb", ADDR_B)):
            sh("ip", "-n", ns, "addr", "add", addr + "/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def tls(self, name):
        return ["--replica-tls-cert", os.path.join(self.tmp, name + ".pem"), "--replica-tls-key",
                os.path.join(self.tmp, name + ".key"), "--replica-tls-ca", os.path.join(self.tmp, "ca.pem")]

    def daemon(self, ns, flags):
        self.starts += 1
        sock = os.path.join(self.tmp, "d%d.sock" % self.starts)
        log = open(os.path.join(self.tmp, "d%d.log" % self.starts), "wb")
        p = subprocess.Popen(["ip", "netns", "exec", ns, os.path.join(self.args.bin_dir, "flashckptd"), "--socket", sock,
                              "--root", self.root, "--max-host-memory", "8GiB", "--state-dir", sock + ".state",
                              "--log-level", "warn"] + flags, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("flashckptd did not start: " + open(log.name, errors="replace").read()[-2000:])
            time.sleep(0.05)
        return p, sock

    def status(self, sock):
        out = sh(os.path.join(self.args.bin_dir, "flashckpt"), "status", "--json", "--socket", sock)
        return json.loads(out)

    def tcp_stream(self, nbytes):
        """Seconds to stream nbytes from A's namespace to B's over one plain TCP connection."""
        rx = subprocess.Popen(["ip", "netns", "exec", NS_B, sys.executable, "-c", RECEIVER, ADDR_B, str(TCP_PORT),
                               str(nbytes), "1"], stdout=subprocess.PIPE)
        rx.stdout.readline()
        out = sh("ip", "netns", "exec", NS_A, sys.executable, "-c", SENDER, ADDR_B, str(TCP_PORT), str(nbytes))
        rx.wait(timeout=120)
        return float(out.strip().splitlines()[-1])

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        for ns in (NS_A, NS_B):
            sh("ip", "netns", "del", ns, check=False)
        for seg in os.listdir("/dev/shm"):
            if seg.startswith("flashckpt." + JOB + "."):
                os.unlink(os.path.join("/dev/shm", seg))


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def run(b, args):
    sys.path.insert(0, args.python_dir)
    import numpy
    import flashckpt

    floats = int(args.gib * (1 << 30)) // 4
    state = {"w": numpy.arange(floats, dtype=numpy.float32)}
    b.daemon(NS_B, ["--replica-listen", "%s:%d" % (ADDR_B, PORT), "--replica-allow-name", "node-a"] + b.tls("b"))
    sender = ["--replicate-to", "%s:%d" % (ADDR_B, PORT)] + b.tls("a")
    a, sock = b.daemon(NS_A, sender)
    c = flashckpt.Client(sock, JOB, memory_checkpoints=False)
    c.register(state)
    c.snapshot(1, state)
    c.wait_persisted(1, timeout=300)

    pushes, streams = [], []
    for i in range(args.repeats):
        step = 2 + i
        state["w"][0] = step
        c.snapshot(step, state, tier="memory")
        deadline = time.monotonic() + 300
        while True:
            peer = b.status(sock)["replica_peers"][0]
            if peer["pushed"] >= i + 1 and peer["lag_steps"] == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("step %d not replicated: %s" % (step, peer))
            time.sleep(0.02)
        pushes.append(peer["last_gbps"])
        nbytes = int(peer["bytes"] / (i + 1))
        streams.append(nbytes / b.tcp_stream(nbytes) / 1e9)
    newest = 2 + args.repeats - 1
    c.close()

    # The node is lost: its daemon and its shared memory.
    a.kill()
    a.wait()
    for seg in os.listdir("/dev/shm"):
        if seg.startswith("flashckpt." + JOB + "."):
            os.unlink(os.path.join("/dev/shm", seg))

    def recover(step, tier_wanted):
        # The disk's daemon asks no peer: the figure of a node without replicas.
        _, fresh = b.daemon(NS_A, sender if tier_wanted == "peer" else [])
        r = flashckpt.Client(fresh, JOB)
        got = {"w": numpy.empty(floats, dtype=numpy.float32)}
        r.register(got)
        if tier_wanted == "disk":
            drop_caches()
        t = time.perf_counter()
        restored, _ = r.restore(got, step=step)
        seconds = time.perf_counter() - t
        tier = r.restored_tier
        ok = restored == step and got["w"][0] == (step if step > 1 else 0) and got["w"][1] == 1
        r.close()
        if tier != tier_wanted or not ok:
            raise RuntimeError("restore of step %d: tier %s, step %s, values ok %s" % (step, tier, restored, ok))
        return seconds

    peer_s = recover(newest, "peer")
    disk_s = recover(1, "disk")

    gib = floats * 4 / (1 << 30)
    print("replica push between namespaces (mutual TLS), %.2f GiB, %d pushes: %s GB/s (median %.2f)"
          % (gib, len(pushes), " ".join("%.2f" % g for g in pushes), statistics.median(pushes)))
    print("plain TCP stream of the same bytes, same namespaces, interleaved: %s GB/s (median %.2f)"
          % (" ".join("%.2f" % g for g in streams), statistics.median(streams)))
    print("push / TCP stream: %.2fx" % (statistics.median(pushes) / statistics.median(streams)))
    print("recovery of a rank on a fresh daemon: from the peer's replica %.3f s, from disk (cache dropped) %.3f s: "
          "%.2fx" % (peer_s, disk_s, disk_s / peer_s))
    print("RESULT replica_netns_push_gbps=%.3f" % statistics.median(pushes))
    print("RESULT replica_netns_tcp_gbps=%.3f" % statistics.median(streams))
    print("RESULT recovery_peer_seconds=%.3f" % peer_s)
    print("RESULT recovery_disk_seconds=%.3f" % disk_s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--python-dir", default=os.path.join(REPO, "build", "python"))
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("openssl") is None:
        print("needs root, ip and openssl")
        return 77
    tmp = tempfile.mkdtemp(prefix="fcrb", dir="/tmp")
    b = None
    try:
        b = Bench(args, tmp)
        run(b, args)
    finally:
        if b is not None:
            b.close()
        else:
            for ns in (NS_A, NS_B):
                sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

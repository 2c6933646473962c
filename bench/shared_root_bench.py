#!/usr/bin/python3
"""K flashckptd daemons persisting to one shared root at once, against K `dd oflag=direct` writers
at once on the same file system: the aggregate bandwidth of the many-node layout (docs/operating.md,
"Many nodes, one root"), measured on one machine.

    bench/shared_root_bench.py [--dir DIR] [--mib-per-rank 256] [--repeat 3] [--bin-dir build/bin]

For K = 1, 2, 4: K daemons (each its own socket and state directory, all with --root DIR/root) each
serve one rank of a job of world size K (tp K, so every rank holds the same bytes: its rows of the
weights and both Adam moments); every rank saves one step. A row's time is from the first rank's
persist start to the last one's end, from the daemons' `persisted ... bytes= secs=` log lines (the
write, checksums, fdatasync and renames; not registration or the copy into shared memory). The limit,
measured right before each row (interleaved, `--repeat` rounds), is K `dd if=/dev/zero bs=16M
oflag=direct conv=fsync` processes writing the same bytes each into DIR at once. Writeback is
settled (sync) before every timed run. Medians and best are printed; the ratio is of medians.
"""

import argparse
import datetime
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
PERSISTED = re.compile(r"^(\S+) info \[writer\] persisted job=(\S+) step=(\d+) rank=(\d+) bytes=.*? secs=([\d.]+)", re.M)
LAYERS = 4


def settle():
    subprocess.run(["sync"])


def dd_row(directory, k, bytes_per_writer):
    count = max(1, bytes_per_writer // (16 << 20))
    settle()
    start = time.monotonic()
    procs = [subprocess.Popen(["dd", "if=/dev/zero", "of=%s/dd.%d" % (directory, i), "bs=16M", "count=%d" % count,
                               "oflag=direct", "conv=fsync"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for i in range(k)]
    for p in procs:
        if p.wait() != 0:
            sys.exit("dd exited %d (a file system without O_DIRECT? use --dir on a disk)" % p.returncode)
    secs = time.monotonic() - start
    for i in range(k):
        os.unlink("%s/dd.%d" % (directory, i))
    return k * count * (16 << 20) / secs / 1e9


class Daemons:
    def __init__(self, bin_dir, tmp, root, k):
        self.procs, self.socks, self.logs = [], [], []
        for i in range(k):
            d = os.path.join(tmp, "d%d" % i)
            os.makedirs(d, exist_ok=True)
            sock, log = os.path.join(d, "flashckptd.sock"), os.path.join(d, "flashckptd.log")
            self.procs.append(subprocess.Popen(
                [os.path.join(bin_dir, "flashckptd"), "--socket", sock, "--root", root, "--node-name", "node%d" % i,
                 "--max-host-memory", "8GiB", "--log-file", log], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
            self.socks.append(sock)
            self.logs.append(log)
        deadline = time.monotonic() + 30
        for sock, p in zip(self.socks, self.procs):
            while not os.path.exists(sock):
                if p.poll() is not None or time.monotonic() > deadline:
                    sys.exit("flashckptd did not start; see %s" % self.logs[self.socks.index(sock)])
                time.sleep(0.05)

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=120)


def flashckpt_row(bin_dir, daemons, job, k, hidden, step):
    """Every rank saves `step`; the rate is read from the daemons' logs once they have stopped."""
    settle()
    procs = [subprocess.Popen([os.path.join(bin_dir, "flashckpt-sim"), "--socket", daemons.socks[r], "--job", job,
                               "--rank", str(r), "--world-size", str(k), "--tp-degree", str(k), "--layers",
                               str(LAYERS), "--hidden", str(hidden), "--steps", str(step), "--first-step", str(step),
                               "--save-every", "1", "--run-id", job + "-run", "--wait-timeout", "300"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in range(k)]
    for p in procs:
        if p.wait() != 0:
            sys.exit("flashckpt-sim exited %d: %s" % (p.returncode, p.stderr.read().decode()[-2000:]))


def persisted_rate(logs, root, job, k, step):
    """GB/s of `step` of `job`: its safetensors bytes over first persist start to last persist end."""
    spans = []
    for log in logs:
        with open(log) as f:
            for m in PERSISTED.finditer(f.read()):
                if m.group(2) == job and int(m.group(3)) == step:
                    end = datetime.datetime.fromisoformat(m.group(1)).timestamp()
                    spans.append((end - float(m.group(5)), end))
    if len(spans) != k:
        sys.exit("found %d persisted lines for step %d of %s, expected %d" % (len(spans), step, job, k))
    ckpt = os.path.join(root, job, "checkpoint-%d" % step)
    total = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    return total / (max(e for _, e in spans) - min(b for b, _ in spans)) / 1e9, total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp", help="a directory on the file system to measure (not tmpfs)")
    ap.add_argument("--mib-per-rank", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="flashckpt-shared-root-", dir=args.dir)
    root = os.path.join(tmp, "root")
    os.makedirs(root)
    print("shared root %s; %d MiB per rank (weights and two Adam moments in %d layers, tp K); %d rounds"
          % (root, args.mib_per_rank, LAYERS, args.repeat))
    print("%-3s %-28s %10s %10s %8s" % ("K", "row", "best GB/s", "median", "vs dd"))
    results = []
    try:
        for k in (1, 2, 4):
            # Per rank: LAYERS * (hidden * hidden / k) * 4 bytes * 3 (weights, exp_avg, exp_avg_sq).
            hidden = int(math.sqrt(args.mib_per_rank * (1 << 20) * k / (LAYERS * 4 * 3)))
            hidden -= hidden % k
            daemons = Daemons(os.path.abspath(args.bin_dir), tmp, root, k)
            limit, rows, total = [], [], 0
            try:
                for i in range(args.repeat):
                    limit.append(dd_row(tmp, k, args.mib_per_rank << 20))
                    flashckpt_row(os.path.abspath(args.bin_dir), daemons, "bench%d" % k, k, hidden, i + 1)
            finally:
                daemons.stop()  # its log is complete once it has stopped
            for i in range(args.repeat):
                rate, total = persisted_rate(daemons.logs, root, "bench%d" % k, k, i + 1)
                rows.append(rate)
            lim, row = statistics.median(limit), statistics.median(rows)
            print("%-3d %-28s %10.2f %10.2f %8s" % (k, "%d x dd oflag=direct (limit)" % k, max(limit), lim, "1.00x"))
            print("%-3d %-28s %10.2f %10.2f %7.2fx" % (k, "%d daemons, %.0f MiB each" % (k, total / k / 2**20),
                                                       max(rows), row, row / lim))
            results.append((k, lim, row))
            shutil.rmtree(os.path.join(root, "bench%d" % k), ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for k, lim, row in results:
        print("RESULT shared_root_k%d_gbps=%.3f dd_k%d_gbps=%.3f ratio=%.3f" % (k, row, k, lim, row / lim))


if __name__ == "__main__":
    main()

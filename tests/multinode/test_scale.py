#!/usr/bin/python3
"""A thousand ranks on one root: 4 simulated nodes (mount and PID namespaces, a private /dev/shm
each, their own flashckptd), 1024 flashckpt-sim ranks (tp 8 x shard 128, tiny tensors) run 64 to a
process with --ranks-per-process, launched with no run id and daemons with their defaults (only
each node's socket, the root and the node's name are given).

  1. Two saves (steps 10 and 20): both checkpoints are complete, `flashckpt verify` passes on the
     last, the independent reader checks it element by element against the simulator's formula, and
     each of the 1024 signals names the node its rank ran on.
  2. A relaunch resumes: every one of the 1024 ranks restores step 20 from the files (the ranks take
     no memory checkpoints) and checks every element it holds.

--ranks N runs N ranks instead: 32 to 256, a multiple of 32, or a multiple of 256. Needs root
(namespaces, mounts): otherwise it prints why and exits 77 (ctest: skipped).

    test_scale.py --bin-dir build/bin [--ranks 1024] [--keep]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))
import flashckpt_reader  # noqa: E402
from harness import TestFailure, check, log  # noqa: E402
from test_multinode import Node, cli, kill_rank, run_on_nodes  # noqa: E402

NODES, TP, PER_PROCESS = 4, 8, 64
LAYERS, HIDDEN = 2, 64
JOB = "scale-%d" % os.getpid()


def run_ranks(nodes, world, steps, resume=False):
    """`world` ranks of JOB, world / NODES on each node in order, up to PER_PROCESS ranks per
    flashckpt-sim process; returns each process's output, keyed by its first rank."""
    per_node = world // len(nodes)
    per_process = min(PER_PROCESS, per_node)
    procs = []
    for k, node in enumerate(nodes):
        for first in range(k * per_node, (k + 1) * per_node, per_process):
            cmd = [os.path.join(node.bin_dir, "flashckpt-sim"), "--socket", node.sock, "--job", JOB, "--rank",
                   str(first), "--ranks-per-process", str(per_process), "--world-size", str(world), "--tp-degree",
                   str(TP), "--shard-degree", str(world // TP), "--layers", str(LAYERS), "--hidden", str(HIDDEN),
                   "--steps", str(steps), "--save-every", "10", "--wait-timeout", "300"]
            name = "sim-%d%s.log" % (first, "-resume" if resume else "")
            procs.append((first, node, node.run(cmd + (["--resume"] if resume else []), name), name))
    out = {}
    deadline = time.monotonic() + 250  # two phases within ctest's 600 s
    for first, node, p, name in procs:
        try:
            rc = p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for _, _, q, _ in procs:
                kill_rank(q)
            raise TestFailure("ranks %d.. on %s did not finish within 250 s" % (first, node.name))
        text = open(os.path.join(node.dir, name), errors="replace").read()
        check(rc == 0, "ranks %d.. on %s exited %d:\n%s" % (first, node.name, rc, text[-3000:]))
        out[first] = text
    return out


def run(tmp, bin_dir, world):
    root = os.path.join(tmp, "root")
    os.makedirs(root)
    nodes = [Node("node%d" % i, tmp, root, bin_dir) for i in range(NODES)]
    try:
        for n in nodes:
            n.start_daemon(tuned=False)
        log("%d nodes up, each with its own /dev/shm and daemon" % NODES)

        # 1. Two saves of every rank.
        start = time.monotonic()
        run_ranks(nodes, world, steps=20)
        log("%d ranks in %d processes: 20 steps, 2 saves, in %.1f s"
            % (world, world // min(PER_PROCESS, world // NODES), time.monotonic() - start))
        job_dir = os.path.join(root, JOB)
        for step in (10, 20):
            d = os.path.join(job_dir, "checkpoint-%d" % step)
            check(os.path.exists(os.path.join(d, "metadata.json")), "checkpoint-%d is not complete" % step)
        with open(os.path.join(job_dir, "LATEST")) as f:
            check(f.read().strip() == "20", "LATEST does not name step 20")
        last = os.path.join(job_dir, "checkpoint-20")
        rc, out, err = cli(bin_dir, "verify", last)
        check(rc == 0, "verify checkpoint-20: %d %s%s" % (rc, out, err))
        flashckpt_reader.verify_checkpoint(last, layers=LAYERS, hidden=HIDDEN)
        per_node = world // NODES
        for rank in range(world):
            with open(os.path.join(last, "saved_signal_%d" % rank)) as f:
                sig = json.load(f)
            check(sig.get("node") == "node%d" % (rank // per_node) and sig.get("world_size") == world,
                  "saved_signal_%d: %s" % (rank, sig))
        log("both checkpoints complete; the last verified by flashckpt verify and the independent reader; "
            "every signal names its node")

        # 2. Every rank resumes the last step from the files and checks it.
        resumed = run_ranks(nodes, world, steps=20, resume=True)
        lines = re.findall(r"^resumed step=(\d+) from=(\w+) verified_elements=(\d+)", "".join(resumed.values()), re.M)
        check(len(lines) == world, "%d of %d ranks printed a resumed line" % (len(lines), world))
        wrong = [line for line in lines if line[0] != "20" or line[1] != "disk" or int(line[2]) == 0]
        check(not wrong, "ranks resumed otherwise than step 20 from disk with elements checked: %s" % wrong[:5])
        log("every one of the %d ranks resumed step 20 from disk and checked %d elements"
            % (world, sum(int(line[2]) for line in lines)))
    finally:
        for n in nodes:
            n.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--ranks", type=int, default=1024,
                    help="the job's world size: 32 to 256 and a multiple of 32, or a multiple of 256")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    per_node = args.ranks // NODES
    if args.ranks <= 0 or args.ranks % (NODES * TP) != 0 or per_node % min(PER_PROCESS, per_node) != 0:
        ap.error("--ranks must be 32 to 256 and a multiple of 32, or a multiple of 256")
    return run_on_nodes(lambda tmp: run(tmp, os.path.abspath(args.bin_dir), args.ranks), "fcscale", args.keep)


if __name__ == "__main__":
    sys.exit(main())

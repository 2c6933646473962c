#!/usr/bin/python3
"""Resharding on restore: a checkpoint saved with (tp, pp, shard) = (2, 2, 2) is resumed by real
flashckpt-sim ranks in other layouts, EMA included.

  1. Eight ranks save steps 10 and 20 of a job (layers 4, hidden 514 so that splits by 3 and 4 are
     uneven, EMA decay 0.9) to a daemon that records a checksum per 4 KiB chunk. The independent
     reader checks the checkpoint against the formula.
  2. For each layout (1,1,1), (4,1,1), (1,2,4), (2,1,3), (3,1,1) and back to (2,2,2), every rank
     resumes with --resume: the simulator checks every restored model and optimizer element bit for
     bit against the formula and exits non-zero on a mismatch. Each rank then dumps the EMA the
     daemon restored (--dump-ema), which must equal the saved EMA (read with flashckpt_reader.py)
     over that rank's own row block, bit for bit.
  3. The daemon's restore log lines give bytes needed and read per rank: a reshard restore reads
     only the checksum chunks it needs, so every rank reads at most 1.1x the bytes it needs.
  4. Offline: `flashckpt reshard` rewrites the checkpoint as (4, 1, 1). The rewritten directory
     passes `flashckpt verify` and the independent reader (formula and EMA), and, swapped in for the
     original, four ranks of that layout resume from it through the same-layout path (bytes read =
     bytes needed). A non-empty destination and an incomplete source are refused.

    test_reshard.py --bin-dir build/bin [--keep]
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import flashckpt_reader  # noqa: E402
from harness import TestFailure, check, log, run_with_daemon_harness  # noqa: E402

JOB = "reshard-%d" % os.getpid()
LAYERS, HIDDEN, STEPS = 4, 514, 20
CHECKSUM_CHUNK = 4096
MAX_READ_RATIO = 1.1
SAVED = (2, 2, 2)
LAYOUTS = [(1, 1, 1), (4, 1, 1), (1, 2, 4), (2, 1, 3), (3, 1, 1), (2, 2, 2)]
RESUMED = re.compile(r"^resumed step=(\d+) from=\w+ verified_elements=(\d+)", re.M)


def run_ranks(h, layout, resume, dump_root=None):
    t, p, d = layout
    world = t * p * d
    procs = {}
    for rank in range(world):
        cmd = [h.binary("flashckpt-sim"), "--socket", h.sock, "--job", JOB, "--rank", str(rank),
               "--world-size", str(world), "--tp-degree", str(t), "--pp-degree", str(p),
               "--shard-degree", str(d), "--layers", str(LAYERS), "--hidden", str(HIDDEN),
               "--steps", str(STEPS), "--save-every", "10", "--ema-decay", "0.9", "--wait-timeout", "60",
               # one run id for the ranks started together (a rank that starts after another has
               # finished would otherwise be a run of its own)
               "--run-id", "reshard-%d-%d-%d-%s" % (t, p, d, "resume" if resume else "fresh")]
        if resume:
            cmd.append("--resume")
        if dump_root:
            dump = os.path.join(dump_root, "rank%d" % rank)
            os.makedirs(dump, exist_ok=True)
            cmd += ["--dump-ema", dump]
        out = os.path.join(h.tmp, "sim-%d%d%d-%s-rank%d.log" % (t, p, d, "resume" if resume else "save", rank))
        h.logs.append(out)
        procs[rank] = (subprocess.Popen(cmd, stdout=open(out, "wb"), stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL), out)
    results = {}
    deadline = time.monotonic() + 120
    for rank, (proc, out) in procs.items():
        try:
            rc = proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs.values():
                q.kill()
            raise TestFailure("layout %s: rank %d did not finish within 120 s" % (layout, rank))
        text = open(out, errors="replace").read()
        check(rc == 0, "layout %s: rank %d exited %d:\n%s" % (layout, rank, rc, text))
        results[rank] = text
    return results


def rank_box(layout, rank):
    """(tp, pp, shard, first row, rows) of a rank, as flashckpt-sim lays it out."""
    t, p, _ = layout
    tp, pp, shard = rank % t, (rank // t) % p, rank // (t * p)
    block = (HIDDEN + t - 1) // t
    first = tp * block
    return tp, pp, shard, first, min(block, HIDDEN - first)


def check_resumed_ema(layout, dump_root, saved_ema):
    t, p, d = layout
    checked = 0
    for rank in range(t * p * d):
        tp, pp, shard, first, rows = rank_box(layout, rank)
        dumped = sorted(glob.glob(os.path.join(dump_root, "rank%d" % rank, "*.f32")))
        if shard != 0:
            check(not dumped, "layout %s: rank %d holds replicas only but dumped an EMA" % (layout, rank))
            continue
        want_layers = [l for l in range(LAYERS) if l % p == pp]
        names = sorted(os.path.basename(f)[:-4] for f in dumped)
        check(names == sorted("layers.%d.weight" % l for l in want_layers),
              "layout %s: rank %d dumped EMA tensors %s" % (layout, rank, names))
        for f in dumped:
            name = os.path.basename(f)[:-4]
            got = np.fromfile(f, dtype=np.float32).reshape(rows, HIDDEN)
            want = saved_ema[name][first:first + rows, :]
            check(np.array_equal(got.view(np.uint32), want.view(np.uint32)),
                  "layout %s: rank %d EMA of %s differs from the saved EMA of rows [%d, %d)"
                  % (layout, rank, name, first, first + rows))
            checked += got.size
    return checked


def run(h):
    h.start_daemon(extra_args=["--checksum-chunk", str(CHECKSUM_CHUNK)])
    log("saving with (tp, pp, shard) = %s" % (SAVED,))
    run_ranks(h, SAVED, resume=False)
    ckpt = os.path.join(h.root, JOB, "checkpoint-%d" % STEPS)
    check(os.path.exists(os.path.join(ckpt, "metadata.json")), "%s is not complete" % ckpt)
    flashckpt_reader.verify_checkpoint(ckpt, layers=LAYERS, hidden=HIDDEN)
    saved_ema = flashckpt_reader.read_ema(ckpt)
    check(sorted(saved_ema) == ["layers.%d.weight" % l for l in range(LAYERS)],
          "saved EMA tensors: %s" % sorted(saved_ema))

    for layout in LAYOUTS:
        dump_root = os.path.join(h.tmp, "ema-%d%d%d" % layout)
        results = run_ranks(h, layout, resume=True, dump_root=dump_root)
        elements = 0
        for rank, text in results.items():
            m = RESUMED.search(text)
            check(m is not None, "layout %s: rank %d printed no resumed line:\n%s" % (layout, rank, text))
            check(int(m.group(1)) == STEPS, "layout %s: rank %d resumed step %s" % (layout, rank, m.group(1)))
            elements += int(m.group(2))
        ema_elements = check_resumed_ema(layout, dump_root, saved_ema)
        log("layout %s: %d ranks resumed step %d, %d elements verified bit-exact, EMA %d elements equal"
            % (layout, len(results), STEPS, elements, ema_elements))

    restores = restore_lines(h)
    check(len(restores) == sum(t * p * d for t, p, d in LAYOUTS), "the daemon logged %d restore lines" % len(restores))
    total_needed = sum(r[1] for r in restores)
    total_read = sum(r[2] for r in restores)
    worst = max(r[3] for r in restores)
    log("%d restores: %.2f MiB needed, %.2f MiB read from disk (%.3fx); largest ratio of one rank %.3f "
        "(checksum chunks of %d bytes)" % (len(restores), total_needed / 2**20, total_read / 2**20,
                                           total_read / total_needed, worst, CHECKSUM_CHUNK))
    check(worst <= MAX_READ_RATIO, "a rank read %.3fx the bytes it needed (limit %.1fx)" % (worst, MAX_READ_RATIO))
    code = h.stop_daemon()
    check(code == 0, "flashckptd exited %s on SIGTERM" % code)
    offline_reshard(h, ckpt, saved_ema)


def restore_lines(h):
    """(rank, bytes needed, bytes read, read ratio) of every restore line of the daemon log."""
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    out = []
    for line in open(h.daemon_log, errors="replace"):
        m = re.search(r"restored job=%s rank=(\d+) .* bytes=([\d.]+) (\w+) read=([\d.]+) (\w+) read_ratio=([\d.]+)"
                      % JOB, line)
        if m:
            out.append((int(m.group(1)), float(m.group(2)) * units[m.group(3)],
                        float(m.group(4)) * units[m.group(5)], float(m.group(6))))
    return out


def offline_reshard(h, ckpt, saved_ema):
    layout = (4, 1, 1)
    out = os.path.join(h.tmp, "resharded", "checkpoint-%d" % STEPS)
    os.makedirs(os.path.dirname(out))
    degrees = ["--tp-degree", "4", "--pp-degree", "1", "--shard-degree", "1"]
    rc, stdout, stderr = h.cli("reshard", ckpt, out, *degrees, "--checksum-chunk", "4KiB")
    check(rc == 0, "flashckpt reshard exited %d:\n%s%s" % (rc, stdout, stderr))
    log("flashckpt reshard: %s" % stdout.strip().splitlines()[-1])
    rc, stdout, stderr = h.cli("verify", out)
    check(rc == 0, "flashckpt verify of the resharded checkpoint exited %d: %s" % (rc, stderr))
    summary = flashckpt_reader.verify_checkpoint(out, layers=LAYERS, hidden=HIDDEN)
    topo = json.load(open(os.path.join(out, "metadata.json")))["topology"]
    check((topo["tp_degree"], topo["pp_degree"], topo["shard_degree"]) == layout,
          "resharded metadata.json has topology %s" % topo)
    ema = flashckpt_reader.read_ema(out)
    check(sorted(ema) == sorted(saved_ema) and all(
        np.array_equal(ema[k].view(np.uint32), saved_ema[k].view(np.uint32)) for k in ema),
        "the resharded EMA differs from the saved one")
    log("resharded checkpoint verified by the independent reader: %s" % (summary,))

    rc, _, stderr = h.cli("reshard", ckpt, out, *degrees)
    check(rc != 0 and "not empty" in stderr, "reshard into a non-empty directory: exit %d, %s" % (rc, stderr))
    incomplete = os.path.join(h.tmp, "incomplete")
    shutil.copytree(ckpt, incomplete)
    os.unlink(os.path.join(incomplete, "metadata.json"))
    rc, _, stderr = h.cli("reshard", incomplete, os.path.join(h.tmp, "never"), *degrees)
    check(rc == 1 and "complete" in stderr, "reshard of an incomplete checkpoint: exit %d, %s" % (rc, stderr))
    check(not os.path.exists(os.path.join(h.tmp, "never")), "a refused reshard created its destination")

    os.rename(ckpt, ckpt + ".original")
    os.rename(out, ckpt)
    h.start_daemon(extra_args=["--checksum-chunk", str(CHECKSUM_CHUNK)])
    dump_root = os.path.join(h.tmp, "ema-offline")
    results = run_ranks(h, layout, resume=True, dump_root=dump_root)
    elements = sum(int(RESUMED.search(text).group(2)) for text in results.values())
    ema_elements = check_resumed_ema(layout, dump_root, saved_ema)
    restores = restore_lines(h)
    check(len(restores) == 4, "the daemon logged %d restore lines" % len(restores))
    for rank, needed, read, _ in restores:
        check(read == needed, "rank %d read %d bytes for %d needed: not the same-layout path" % (rank, read, needed))
    log("layout %s resumed from the offline-resharded files: %d elements bit-exact, EMA %d elements equal, "
        "bytes read = bytes needed on every rank" % (layout, elements, ema_elements))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    return run_with_daemon_harness(run, "flashckpt-reshard-", [JOB], args.bin_dir, args.keep, errors=(TestFailure, flashckpt_reader.CheckpointError))

if __name__ == "__main__":
    sys.exit(main())

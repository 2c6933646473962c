#!/usr/bin/python3
"""A 4-process DistributedDataParallel job's checkpoint: flashckpt against torch.save on rank 0 and
torch.distributed.checkpoint, per rank: how long the save blocks the training loop, and how long
until the checkpoint is durable.

    bench/torch_ddp_bench.py [--gib 1.0] [--ranks 4] [--repeats 3] [--dir DIR] [--bin-dir build/bin]

The state is a real one: an MLP of 4096x4096 fp32 layers wrapped in DDP, plus AdamW's two moments
(three times the parameter bytes, about --gib in all), alike on every rank. The ranks are gloo
processes on this machine, with one flashckptd.

  flashckpt    Checkpointer.save() on every rank: each copies its share of the state (about 1/ranks:
               DDP replicas are written once, spread over the ranks) into the daemon's shared memory
               and goes on; durable when wait_persisted() returns on every rank (the whole checkpoint
               written, fdatasynced, renamed), counted from the start of save().
  torch.save   rank 0 serialises and writes the whole state, then fsyncs it; the other ranks wait
               for it at the next collective (a barrier here), so every rank is blocked that long.
  dcp          torch.distributed.checkpoint.save_state_dict, where it imports.

Limits measured in the same run: a copy of one rank's share of the bytes into preallocated memory on
one thread (what a rank's save cannot beat), and dd oflag=direct of one copy of the state into the
same directory (the disk). Medians over --repeats saves after one warm-up each.
"""

import argparse
import faulthandler
import json
import os
import socket as socketlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(REPO, "bench"))
from torch_save_bench import LAYER, fsync_path, ms, start_daemon, stop_daemon  # noqa: E402


def worker(args):
    import datetime

    import torch
    import torch.distributed as dist

    from flashckpt.torch import Checkpointer

    rank = args.rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % args.port, rank=rank,
                            world_size=args.ranks, timeout=datetime.timedelta(seconds=600))
    layers = max(1, round(args.gib * 1024 / 3 / 64))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER) for _ in range(layers)]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates exp_avg and exp_avg_sq: the state a real run saves
    tensors = list(model.state_dict().values()) + [t for s in optimizer.state.values() for t in s.values()]
    total = sum(t.numel() * t.element_size() for t in tensors)
    out = {"rank": rank, "total": total, "layers": layers}

    # The limit: one thread copies this rank's share of the bytes into touched memory.
    share = [t.view(-1)[: max(1, t.numel() // args.ranks)] for t in tensors]
    dst = [torch.empty_like(t) for t in share]
    for d in dst:
        d.zero_()
    copies = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for d, t in zip(dst, share):
            d.copy_(t)
        copies.append(time.perf_counter() - started)
    out["share_copy"] = statistics.median(copies)
    del dst

    def timed(save, durable=None):
        block, done = [], []
        for i in range(args.repeats + 1):
            dist.barrier()
            started = time.perf_counter()
            save(i)
            blocked = time.perf_counter() - started
            if durable is not None:
                durable(i)
            dist.barrier()
            finished = time.perf_counter() - started
            if i > 0:  # the first is the warm-up
                block.append(blocked)
                done.append(finished)
        return statistics.median(block), statistics.median(done)

    with Checkpointer(model, optimizer, socket=args.socket, job=args.job) as ck:
        out["flashckpt"] = timed(lambda i: ck.save(i + 1), lambda i: ck.wait_persisted(i + 1, timeout=600))

    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    os.makedirs(os.path.join(args.work, "torch"), exist_ok=True)

    def torch_save(i):
        if rank == 0:
            path = os.path.join(args.work, "torch", "checkpoint-%d.pt" % i)
            torch.save(state, path)
            fsync_path(path)
            fsync_path(os.path.dirname(path), directory=True)
            os.unlink(path)
        dist.barrier()  # the other ranks' next collective waits for rank 0

    out["torch.save"] = timed(torch_save)

    try:
        import torch.distributed.checkpoint as dcp
        save_state_dict = dcp.save_state_dict
    except Exception as e:  # noqa: BLE001 - any import failure is reported as such
        out["dcp"] = "%s: %s" % (type(e).__name__, e)
    else:
        def dcp_save(i):
            path = os.path.join(args.work, "dcp", "checkpoint-%d" % i)
            save_state_dict(state, dcp.FileSystemWriter(path))
        out["dcp"] = timed(dcp_save)
    with open(args.out, "w") as f:
        json.dump(out, f)
    # Ends here, with the state and the process group still held, and without Python's finalization
    # (tests/python/harness.py, end_worker): torch 1.13 frees a gloo process group while holding the
    # GIL and waits for gloo's threads, which may need the GIL to release a tensor.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="approximate state size in GiB (default 1)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", help="directory all write into (default: a new one under /var/tmp)")
    p.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    p.add_argument("--python-dir", default=os.path.join(REPO, "build", "python"))
    p.add_argument("--keep", action="store_true", help="keep the directory and the daemon log")
    # Set by main() for the rank processes it starts.
    for name in ("--rank", "--port"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    for name in ("--socket", "--job", "--work", "--out"):
        p.add_argument(name, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, args.python_dir)
    if args.rank is not None:
        faulthandler.enable()  # an abort prints every thread's Python stack into the worker's log
        worker(args)  # does not return

    work = args.dir or tempfile.mkdtemp(prefix="fc-bench.", dir="/var/tmp")
    os.makedirs(work, exist_ok=True)
    sock_dir = tempfile.mkdtemp(prefix="fc-bench.", dir="/tmp")  # a socket path must stay short
    sock = os.path.join(sock_dir, "flashckptd.sock")
    job = "torch-ddp-bench-%d" % os.getpid()
    log = os.path.join(work, "flashckptd.log")
    state_bytes = int(args.gib * 2**30)
    budget = "%dMiB" % (2 * state_bytes // 2**20 + 1024)  # two slots of every share, and headroom

    # The disk's limit: dd of one copy of the state with O_DIRECT, then fsync.
    blocks = max(1, state_bytes // (16 << 20))
    dd = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", "of=%s/dd.bin" % work, "bs=16M", "count=%d" % blocks,
                        "oflag=direct", "conv=fsync", "status=none"], check=True)
        dd.append(time.perf_counter() - started)
        os.unlink(os.path.join(work, "dd.bin"))
    dd_seconds = statistics.median(dd) * state_bytes / (blocks * (16 << 20))

    daemon = start_daemon(args.bin_dir, sock, os.path.join(work, "flashckpt"), budget, log)
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs, procs = [], []
    try:
        env = dict(os.environ, PYTHONPATH=args.python_dir)
        for rank in range(args.ranks):
            out = os.path.join(work, "rank%d.json" % rank)
            outs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--gib", str(args.gib), "--ranks", str(args.ranks),
                 "--repeats", str(args.repeats), "--python-dir", args.python_dir, "--rank", str(rank),
                 "--port", str(port), "--socket", sock, "--job", job, "--work", work, "--out", out], env=env))
        codes = [proc.wait(timeout=3600) for proc in procs]
        if any(codes):
            sys.exit("a rank failed: exit codes %s" % codes)
        # The bytes each rank persisted, from the files of the last step.
        root = os.path.join(work, "flashckpt", job)
        last = max((d for d in os.listdir(root) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))
        persisted = []
        for rank in range(args.ranks):
            n = 0
            for f in os.listdir(os.path.join(root, last)):
                if f.endswith("_shard%02d.safetensors" % rank):
                    with open(os.path.join(root, last, f), "rb") as fh:
                        size = int.from_bytes(fh.read(8), "little")
                        header = json.loads(fh.read(size))
                    n += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                             if k != "__metadata__")
            persisted.append(n)
        results = []
        for out in outs:
            with open(out) as f:
                results.append(json.load(f))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        stop_daemon(daemon, job, sock_dir, None if args.keep or args.dir else work)

    total = results[0]["total"]
    print("state: %.1f MiB per rank (%d layers of %dx%d: model + AdamW moments), %d DDP ranks (gloo), %d cores"
          % (total / 2**20, results[0]["layers"], LAYER, LAYER, args.ranks, os.cpu_count()))
    print("bytes persisted per rank by flashckpt: %s (one copy of the state: %d; largest share / mean %.3f)"
          % (persisted, total, max(persisted) / (sum(persisted) / len(persisted))))
    print()
    print("%-12s %-44s %s" % ("", "blocks the loop, per rank (median)", "durable after (slowest rank)"))
    rows = {}
    for name in ("flashckpt", "torch.save", "dcp"):
        value = results[0].get(name)
        if isinstance(value, str):
            print("%-12s not measured: torch.distributed.checkpoint does not import here (%s)" % (name, value))
            continue
        block = [r[name][0] for r in results]
        durable = max(r[name][1] for r in results)
        rows[name] = (max(block), durable)
        print("%-12s %s   %s" % (name, " ".join(ms(b).strip().rjust(10) for b in block), ms(durable)))
    share_copy = max(r["share_copy"] for r in results)
    print("%-12s %s" % ("memcpy", "one rank's share on one thread: %s" % ms(share_copy).strip()))
    print("%-12s %s" % ("dd", "one copy of the state, O_DIRECT + fsync: %s" % ms(dd_seconds).strip()))
    print()
    fb, fd = rows["flashckpt"]
    tb, td = rows["torch.save"]
    print("torch.save on rank 0 blocks the job %.1fx longer than flashckpt (slowest rank each)" % (tb / fb))
    print("flashckpt blocks for %.2fx a copy of a rank's share on one thread" % (fb / share_copy))
    print("until durable: torch.save / flashckpt = %.2fx; flashckpt / dd of one copy = %.2fx" % (td / fd, fd / dd_seconds))
    print("SUMMARY\t5. DDP blocking: torch.save on rank 0 / flashckpt\t%.2fx\t>= 10.00x\t%s"
          % (tb / fb, "met" if tb / fb >= 10 else "NOT met"))
    if args.keep:
        print("kept %s" % work)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""One state, four checkpoint systems, one machine: flashckpt against torch.distributed.checkpoint's
async_save, DLRover's Flash Checkpoint and torch.save + fsync.

    bench/peers_bench.py --bin-dir DIR --python-dir DIR [--gib 1.1] [--rounds 5] [--dir DIR]

Run it with the torch 2 environment's python (scripts/deps.sh: torch, dlrover). The state is an MLP
of 4096 x 4096 fp32 layers with AdamW's two moments after one step (three times the parameter bytes,
at least --gib GiB in all), in one process. Each round runs, for each system in turn (interleaved,
so that the page cache and the other load on the machine fall on all of them alike), a fresh trainer
process that builds the state, saves it and exits, then a fresh process that builds a model and
optimizer of other values and gets the state back; its bytes must equal the saved ones (a digest
of every tensor), else the run fails. Medians over --rounds rounds; one line per system:

    RESULT peer=<flashckpt|dcp|dlrover|torch_save> blocking_ms=X durable_ms=Y resume_ms=Z

  blocking_ms  how long the save call keeps the training loop from its next step.
  durable_ms   from the start of the save until the checkpoint is on disk, fsynced, as the system
               reports it (flashckpt: wait_persisted, the checkpoint complete; dcp: the future of
               async_save, whose FileSystemWriter fsyncs; dlrover: wait_latest_checkpoint, the
               step recorded by its saver process; torch_save: torch.save then fsync).
  resume_ms    in the restarted process, from the load call until the state is in the model and
               optimizer: from memory where the system keeps the state past the process's end
               (flashckpt: a memory checkpoint, Checkpointer.resume()), else from the files (with
               the page cache as the save left it).

flashckpt saves a disk checkpoint (blocking_ms, durable_ms), then a memory checkpoint of the next
step (INFO line: its blocking time), and the restarted process resumes the newest, from memory.
DLRover's Flash Checkpoint is driven as its documentation says for a script not started by
dlrover-run: DdpCheckpointer starts its saver process (a child of the trainer), save_checkpoint
copies into its shared memory, the saver writes; that saver ends with the trainer, so the restarted
process reads the disk (its memory restore needs the dlrover-run agent, which outlives trainers).
dcp uses async_save with DCP's default stager; pinned memory staging only where CUDA is available.
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
LAYER = 4096  # 4096 x 4096 fp32 = 64 MiB per layer
PEERS = ("flashckpt", "dcp", "dlrover", "torch_save")


def build(layers, seed):
    """An MLP and AdamW after one step with seeded gradients: every tensor's value depends on `seed`."""
    import torch
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    return model, optimizer


def digest(model, optimizer):
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        for field in ("step", "exp_avg", "exp_avg_sq"):
            h.update(optimizer.state[p][field].numpy().tobytes())
    return h.hexdigest()


def fsync_tree(path):
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def train(args):
    """A trainer of `args.peer`: builds the state of round args.round, saves it; prints JSON."""
    import torch
    torch.set_num_threads(1)
    model, optimizer = build(args.layers, 1000 + args.round)
    out = {"digest": digest(model, optimizer)}
    step = args.round + 1
    where = os.path.join(args.work, args.peer)
    if args.peer == "flashckpt":
        from flashckpt.torch import Checkpointer
        ck = Checkpointer(model, optimizer, socket=args.socket, job="peers-%d" % args.round, memory_checkpoints=True)
        t0 = time.perf_counter()
        ck.save(10 * step)
        out["blocking_ms"] = (time.perf_counter() - t0) * 1e3
        ck.wait_persisted(10 * step, timeout=600)
        out["durable_ms"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        ck.save(10 * step + 1, tier="memory")
        out["memory_blocking_ms"] = (time.perf_counter() - t0) * 1e3
        print(json.dumps(out), flush=True)
        os._exit(0)  # as a crash: no close(), the daemon keeps the memory checkpoint
    elif args.peer == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        pinned = torch.cuda.is_available()
        stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=False))
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=os.path.join(where, "step-%d" % step), async_stager=stager)
        out["blocking_ms"] = (time.perf_counter() - t0) * 1e3
        fut.result()
        out["durable_ms"] = (time.perf_counter() - t0) * 1e3
        out["pinned"] = pinned
    elif args.peer == "dlrover":
        try:
            from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
            from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer
        except ImportError as e:  # dlrover 0.6.1 imports grpc without declaring it
            print(json.dumps({"unavailable": "dlrover does not import: %s" % e}), flush=True)
            return
        ck = DdpCheckpointer(where)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        t0 = time.perf_counter()
        ck.save_checkpoint(step, state, os.path.join(where, "step-%d.pt" % step), storage_type=StorageType.DISK)
        out["blocking_ms"] = (time.perf_counter() - t0) * 1e3
        ck.wait_latest_checkpoint(timeout=600)
        out["durable_ms"] = (time.perf_counter() - t0) * 1e3
    else:
        os.makedirs(where, exist_ok=True)
        path = os.path.join(where, "step-%d.pt" % step)
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, path)
        fsync_tree(where)
        out["blocking_ms"] = out["durable_ms"] = (time.perf_counter() - t0) * 1e3
    print(json.dumps(out), flush=True)


def resume(args):
    """A restarted process of `args.peer`: a model and optimizer of other values, then the state of
    round args.round back in them; prints JSON with the digest it has then."""
    import torch
    torch.set_num_threads(1)
    model, optimizer = build(args.layers, 7)  # other values, and AdamW state to load into
    step = args.round + 1
    where = os.path.join(args.work, args.peer)
    out = {}
    if args.peer == "flashckpt":
        from flashckpt.torch import Checkpointer
        ck = Checkpointer(model, optimizer, socket=args.socket, job="peers-%d" % args.round, memory_checkpoints=True)
        t0 = time.perf_counter()
        got = ck.resume()
        out["resume_ms"] = (time.perf_counter() - t0) * 1e3
        out["tier"], out["step"] = ck.resumed_tier, got
        ck.close()
    elif args.peer == "dcp":
        import torch.distributed.checkpoint as dcp
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=os.path.join(where, "step-%d" % step))
        optimizer.load_state_dict(state["optim"])
        out["resume_ms"] = (time.perf_counter() - t0) * 1e3
    elif args.peer == "dlrover":
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer
        ck = DdpCheckpointer(where)
        t0 = time.perf_counter()
        state = ck.load_checkpoint(os.path.join(where, "step-%d.pt" % step))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        out["resume_ms"] = (time.perf_counter() - t0) * 1e3
    else:
        t0 = time.perf_counter()
        state = torch.load(os.path.join(where, "step-%d.pt" % step), map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        out["resume_ms"] = (time.perf_counter() - t0) * 1e3
    out["digest"] = digest(model, optimizer)
    print(json.dumps(out), flush=True)
    os._exit(0)  # DLRover's saver child and DCP's threads: nothing to wait for


def run_role(args, role, peer, rnd, env):
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--peer", peer, "--round", str(rnd),
           "--layers", str(args.layers), "--work", args.work, "--socket", args.socket,
           "--bin-dir", args.bin_dir, "--python-dir", args.python_dir]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=900)
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit("%s %s round %d failed (exit %d):\n%s" % (peer, role, rnd, proc.returncode,
                                                           proc.stderr.decode(errors="replace")[-4000:]))
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True, help="the directory of flashckptd")
    ap.add_argument("--python-dir", required=True, help="the directory that holds the flashckpt package")
    ap.add_argument("--gib", type=float, default=1.1, help="state size: parameters and AdamW's two moments")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir under /tmp)")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--role", choices=("main", "train", "resume"), default="main", help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, args.python_dir)
    if args.role == "train":
        return train(args)
    if args.role == "resume":
        return resume(args)

    args.layers = max(1, -(-int(args.gib * 1024) // (3 * 64)))  # ceil: at least --gib GiB
    gib = args.layers * 3 * (LAYER * LAYER + LAYER) * 4 / 2**30
    base = tempfile.mkdtemp(prefix="fc-peers.", dir=args.dir or "/tmp")
    args.work = os.path.join(base, "work")
    args.socket = os.path.join(base, "flashckptd.sock")
    budget = "%dGiB" % (int(gib * 2) + 2)  # a disk and a memory checkpoint of a round's job
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=args.python_dir, LOCAL_RANK="0", RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", PYTHONWARNINGS="ignore")
    daemon = subprocess.Popen([os.path.join(args.bin_dir, "flashckptd"), "--socket", args.socket, "--root",
                               os.path.join(base, "root"), "--max-host-memory", budget, "--idle-release", "60"],
                              stdout=open(os.path.join(base, "flashckptd.log"), "wb"), stderr=subprocess.STDOUT)
    peers = [p for p in args.peers.split(",") if p]
    results = {p: [] for p in peers}
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(args.socket):
            if daemon.poll() is not None or time.monotonic() > deadline:
                sys.exit("flashckptd did not start: see %s" % os.path.join(base, "flashckptd.log"))
            time.sleep(0.05)
        print("state: %d layers of %dx%d fp32 with AdamW = %.2f GiB; %d rounds; checkpoints under %s"
              % (args.layers, LAYER, LAYER, gib, args.rounds, base), flush=True)
        for rnd in range(args.rounds):
            for peer in peers:
                saved = run_role(args, "train", peer, rnd, env)
                if "unavailable" in saved:
                    print("round %d %-10s not run: %s" % (rnd, peer, saved["unavailable"]), flush=True)
                    results[peer].append(saved)
                    continue
                got = run_role(args, "resume", peer, rnd, env)
                if got["digest"] != saved["digest"]:
                    sys.exit("%s round %d: the resumed state differs from the saved one" % (peer, rnd))
                saved.update(resume_ms=got["resume_ms"], tier=got.get("tier"))
                results[peer].append(saved)
                print("round %d %-10s blocking %8.1f ms  durable %8.1f ms  resume %8.1f ms%s" % (
                    rnd, peer, saved["blocking_ms"], saved["durable_ms"], saved["resume_ms"],
                    "  (memory save %.1f ms, resumed from %s)" % (saved["memory_blocking_ms"], saved["tier"])
                    if peer == "flashckpt" else ""), flush=True)
                shutil.rmtree(os.path.join(args.work, peer), ignore_errors=True)  # the disk stays the same size
        for peer in peers:
            if any("unavailable" in r for r in results[peer]):
                print("RESULT peer=%s blocking_ms=nan durable_ms=nan resume_ms=nan" % peer, flush=True)
                print("INFO peer=%s not_run=%r" % (peer, results[peer][0]["unavailable"]), flush=True)
                continue
            med = {k: statistics.median(r[k] for r in results[peer]) for k in ("blocking_ms", "durable_ms", "resume_ms")}
            print("RESULT peer=%s blocking_ms=%.1f durable_ms=%.1f resume_ms=%.1f"
                  % (peer, med["blocking_ms"], med["durable_ms"], med["resume_ms"]), flush=True)
            if peer == "flashckpt":
                print("INFO peer=flashckpt memory_blocking_ms=%.1f resumed_from=%s" % (
                    statistics.median(r["memory_blocking_ms"] for r in results[peer]),
                    ",".join(sorted({str(r["tier"]) for r in results[peer]}))), flush=True)
            if peer == "dcp":
                print("INFO peer=dcp pinned_staging=%s" % results[peer][0].get("pinned"), flush=True)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        for name in os.listdir("/dev/shm"):
            if name.startswith("flashckpt.peers-"):
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""torch.save and a plain writer against flashckpt: how long each blocks the training loop, and how
long until durable.

    bench/torch_save_bench.py [--gib 1.0] [--repeats 5] [--dir DIR] [--bin-dir build/bin]

The state is a real one: an MLP of 4096x4096 fp32 layers plus AdamW's two moments (three times the
parameter bytes, about --gib in all). Both write into the same directory (--dir: torch.save files
and the daemon's --root side by side).

  torch.save   blocks the loop for the whole serialisation and write; durable once the file and its
               directory are fsynced as well.
  tofile       a plain writer: each tensor's bytes with numpy.ndarray.tofile into one file; durable
               after fsync of the file and its directory.
  flashckpt    blocks for Checkpointer.save(): flattening the state dicts and copying the tensors
               into the daemon's shared memory; durable when wait_persisted() returns (the daemon
               has written, fdatasynced and renamed the files), counted from the start of save().

Medians over --repeats saves after one warm-up each; flashckpt's first save (registration and the
first touch of fresh shared memory) is shown on its own. The limit measured in the same run is a
plain copy of the same tensors into preallocated memory, on as many threads as flashckpt copies with
(min(cores, 8)): since a snapshot of CPU tensors is complete when save() returns, torch.save / memcpy
bounds the ratio on a machine. The
target is flashckpt blocking at least 10x less than both torch.save and tofile.
"""

import argparse
import os
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LAYER = 4096  # 4096 x 4096 fp32 = 64 MiB per layer


def ms(seconds):
    return "%9.1f ms" % (seconds * 1e3)


def fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def start_daemon(bin_dir, socket, root, budget, log):
    binary = os.path.join(bin_dir, "flashckptd")
    if not os.access(binary, os.X_OK):
        sys.exit("%s is missing: build it first (ninja -C build flashckptd flashckpt_python)" % binary)
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, "--socket", socket, "--root", root, "--max-host-memory", budget],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (os.path.exists(socket) and stat.S_ISSOCK(os.stat(socket).st_mode)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit("flashckptd did not start; its log:\n" + open(log).read())
        time.sleep(0.02)
    return proc


def stop_daemon(daemon, job, sock_dir, work=None):
    """SIGTERM (SIGKILL after 60 s), then removes the job's segments, the socket directory and `work`."""
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=60)
    except subprocess.TimeoutExpired:
        daemon.kill()
    for name in os.listdir("/dev/shm"):
        if name.startswith("flashckpt.%s." % job):
            os.unlink(os.path.join("/dev/shm", name))
    shutil.rmtree(sock_dir, ignore_errors=True)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="approximate state size in GiB (default 1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", help="directory both write into (default: a new one under /var/tmp)")
    p.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    p.add_argument("--python-dir", default=os.path.join(REPO, "build", "python"))
    p.add_argument("--keep", action="store_true", help="keep the directory and the daemon log")
    args = p.parse_args()
    sys.path.insert(0, args.python_dir)
    import torch
    from flashckpt.torch import Checkpointer

    torch.set_num_threads(1)
    layers = max(1, round(args.gib * 1024 / 3 / 64))
    model = torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p_ in model.parameters():
        p_.grad = torch.zeros_like(p_)
    optimizer.step()  # creates exp_avg and exp_avg_sq: the state a real run saves
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    tensors = list(model.state_dict().values()) + [t for s in optimizer.state.values() for t in s.values()]
    total = sum(t.numel() * t.element_size() for t in tensors)

    work = args.dir or tempfile.mkdtemp(prefix="fc-bench.", dir="/var/tmp")
    os.makedirs(work, exist_ok=True)
    sock_dir = tempfile.mkdtemp(prefix="fc-bench.", dir="/tmp")  # a socket path must stay short
    socket = os.path.join(sock_dir, "flashckptd.sock")
    root = os.path.join(work, "flashckpt")
    job = "torch-save-bench-%d" % os.getpid()
    log = os.path.join(work, "flashckptd.log")
    budget = "%dMiB" % (2 * total // 2**20 + 512)  # two slots and headroom
    print("state: %.1f MiB (%d layers of %dx%d: model %.1f MiB + AdamW moments), directory %s, %d cores"
          % (total / 2**20, layers, LAYER, LAYER, total / 3 / 2**20, work, os.cpu_count()), flush=True)

    # The limit: one copy of the same bytes into memory that is already allocated and touched.
    dst = [torch.empty_like(t) for t in tensors]
    for d in dst:
        d.zero_()
    copies = []
    trainer_threads = torch.get_num_threads()
    torch.set_num_threads(min(os.cpu_count() or 1, 8))  # the threads flashckpt's client copies with
    for _ in range(args.repeats):
        started = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        copies.append(time.perf_counter() - started)
    torch.set_num_threads(trainer_threads)
    del dst
    memcpy = statistics.median(copies)

    # torch.save, to a new file each time (as a training run does).
    ts_block, ts_durable = [], []
    os.makedirs(os.path.join(work, "torch"), exist_ok=True)
    for i in range(args.repeats + 1):
        path = os.path.join(work, "torch", "checkpoint-%d.pt" % i)
        started = time.perf_counter()
        torch.save(state, path)
        blocked = time.perf_counter() - started
        fsync_path(path)
        fsync_path(os.path.dirname(path), directory=True)
        durable = time.perf_counter() - started
        if i > 0:  # the first is the warm-up
            ts_block.append(blocked)
            ts_durable.append(durable)
        os.unlink(path)

    # A plain writer: each tensor's bytes with numpy.ndarray.tofile into one file, then fsync.
    np_block, np_durable = [], []
    os.makedirs(os.path.join(work, "numpy"), exist_ok=True)
    for i in range(args.repeats + 1):
        path = os.path.join(work, "numpy", "checkpoint-%d.bin" % i)
        started = time.perf_counter()
        with open(path, "wb") as f:
            for t in tensors:
                t.detach().numpy().tofile(f)
        blocked = time.perf_counter() - started
        fsync_path(path)
        fsync_path(os.path.dirname(path), directory=True)
        durable = time.perf_counter() - started
        if i > 0:
            np_block.append(blocked)
            np_durable.append(durable)
        os.unlink(path)

    daemon = start_daemon(args.bin_dir, socket, root, budget, log)
    try:
        fc_block, fc_durable = [], []
        with Checkpointer(model, optimizer, socket=socket, job=job) as ck:
            for step in range(1, args.repeats + 2):
                started = time.perf_counter()
                ck.save(step)
                blocked = time.perf_counter() - started
                ck.wait_persisted(step, timeout=600)
                durable = time.perf_counter() - started
                if step == 1:
                    first = blocked
                else:
                    fc_block.append(blocked)
                    fc_durable.append(durable)
    finally:
        stop_daemon(daemon, job, sock_dir, None if args.keep or args.dir else work)

    tb, td = statistics.median(ts_block), statistics.median(ts_durable)
    fb, fd = statistics.median(fc_block), statistics.median(fc_durable)
    gbps = total / 1e9
    print()
    print("%-12s %20s %20s" % ("", "blocks the loop", "durable after"))
    print("%-12s %12s %5.2f GB/s %12s %5.2f GB/s" % ("torch.save", ms(tb), gbps / tb, ms(td), gbps / td))
    nb, nd = statistics.median(np_block), statistics.median(np_durable)
    print("%-12s %12s %5.2f GB/s %12s %5.2f GB/s" % ("tofile", ms(nb), gbps / nb, ms(nd), gbps / nd))
    print("%-12s %12s %5.2f GB/s %12s %5.2f GB/s" % ("flashckpt", ms(fb), gbps / fb, ms(fd), gbps / fd))
    print("%-12s %12s %5.2f GB/s" % ("memcpy", ms(memcpy), gbps / memcpy))
    print()
    ratio = tb / fb
    print("torch.save blocks %.1fx longer than flashckpt (target: at least 10x: %s)"
          % (ratio, "met" if ratio >= 10 else "NOT met"))
    # A CPU snapshot is complete when save() returns, so it cannot block for less than a copy of the bytes.
    print("tofile blocks %.1fx longer than flashckpt (target: at least 10x: %s)"
          % (nb / fb, "met" if nb / fb >= 10 else "NOT met"))
    print("the most this machine allows: torch.save / memcpy = %.1fx" % (tb / memcpy))
    print("flashckpt blocks for %.2fx a memcpy of the same bytes on the same number of threads" % (fb / memcpy))
    print("until durable: torch.save + fsync / flashckpt = %.2fx (the daemon writes while the loop trains on)"
          % (td / fd))
    print("flashckpt's first save (registration, fresh shared memory): %s" % ms(first).strip())
    # Rows for the table scripts/bench.sh prints at the end.
    for row, value in (("5. blocking: torch.save / flashckpt", ratio), ("5. blocking: tofile / flashckpt", nb / fb)):
        print("SUMMARY\t%s\t%.2fx\t>= 10.00x\t%s" % (row, value, "met" if value >= 10 else "NOT met"))
    if args.keep:
        print("kept %s" % work)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""The memory checkpoint tier for a PyTorch state: how long a memory checkpoint blocks the loop, how
soon a restarted trainer has its state back, and what that is worth against disk checkpoints alone.

    bench/torch_memory_bench.py [--gib 1.0] [--repeats 5] [--dir DIR] [--bin-dir build/bin]
                                [--step-ms 1000] [--disk-every 100] [--mtbf-hours 4]

The state is a real one: an MLP of 4096x4096 fp32 layers plus AdamW's two moments (three times the
parameter bytes, about --gib in all), saved by flashckpt.torch.Checkpointer (no EMA) through a real
flashckptd started here with --slots 3.

1. Blocking. The time Checkpointer.save(step, tier="memory") blocks the loop (flattening the state
   dicts and copying the tensors into the daemon's shared memory), and save(step) to disk for the
   goodput below. The limit is a plain copy of the same tensors into preallocated, touched memory on
   as many threads as flashckpt copies with (min(cores, 8)): a snapshot of CPU tensors is complete
   when save() returns, so no save can block for less. Target: memory save / copy <= 1.1x. Each save
   is timed once the daemon has checksummed (memory) or written (disk) the previous one, as in a loop
   whose steps are longer than that (the time is printed: it is what a step must at least last).
2. Recovery, restart to state ready. Each restore runs in a fresh child process (this interpreter,
   this file with --child): it imports torch and flashckpt, builds the model and a fresh AdamW, as a
   restarted trainer does, and then times only what gets its state back:
     from memory      Checkpointer(...) + resume() of a job whose daemon holds memory checkpoints
                      101..103 newer than its disk checkpoint 100 (resumed_tier must be "memory");
     from disk, cold  the same for a second job that has only the disk checkpoint, after its files'
                      pages were dropped (os.sync, then POSIX_FADV_DONTNEED on every file under the
                      daemon's root; resumed_tier must be "disk");
     torch.load, cold torch.load of a torch.save file of the same state dicts, dropped the same way,
                      then load_state_dict of the model and the optimizer.
   Each child also checks that it got the step it should (a marker in the first weight). The limit
   is the copy of section 1 (same bytes, same threads), measured in this process before each round.
   Target: restore from memory >= 0.8x of that copy, with the checksums verified (every chunk is
   verified before the trainer has its state). A restore into a fresh optimizer also writes its
   moments into fresh memory (first touch), which costs more in a fresh process than in one that
   has just freed memory (on a VM whose freed pages go back to the host, much more), so each child
   then times a copy of the tensors it restored into fresh memory, in the same process: the limit
   of the second target, restore from memory at most 2x that copy (RESULT
   memory_restore_fresh_ratio, the restore's time over the copy's). On this VM a first touch costs
   from 0.2 to 1.2 s per GB from one copy to the next, by chance (freed pages go back to the host:
   free page reporting), so the child times two such copies of the same number of bytes, one before
   the timed part (the parameters, three times over) and one after it (the tensors restored), and
   the faster is the limit: a restore that paid the slow rate by chance is compared with a copy
   that did not. The columns from the spawn leave the copy before the timed part out. The child's fixed cost (process start, imports, model
   built) is measured by a child that does only that, and each row shows the whole restart (spawn
   to state ready) as well as the timed part; nothing is subtracted.
3. Goodput. From the figures measured above and the parameters --step-ms (the compute of one step;
   nothing sleeps), --disk-every and --mtbf-hours: policy A, a memory checkpoint every step and a
   disk one every --disk-every steps, against policy B, the disk checkpoint alone. Per step each
   blocks for its saves; per failure A loses half a step plus a restart from memory, B half a disk
   interval plus a restart from disk, cold. A failure that takes the node (and the daemon's memory)
   with it costs A what it costs B (--node-loss-share). The break-even failure rate needs no MTBF.

Medians over --repeats (each save series and each round of children after a warm-up). Everything
created (the directory unless --dir or --keep, the daemon, its socket and state directory, the jobs'
shared-memory segments, child processes) is removed at exit, on SIGINT and SIGTERM too.
"""

import argparse
import json
import os
import re
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
CHILDREN = []  # child processes alive, killed at exit


def ms(seconds):
    return "%9.1f ms" % (seconds * 1e3)


def copy_threads():
    return min(os.cpu_count() or 1, 8)  # the threads flashckpt's client copies with (copy_threads=0)


def build_state(torch, layers):
    model = torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


# --- the child: a restarted trainer ------------------------------------------------------------

def child(spec):
    """Runs in a fresh process: imports, builds the model and a fresh optimizer, then (timed) gets the
    state back as spec["mode"] says; prints one JSON line of CLOCK_MONOTONIC instants (system-wide on
    Linux, so the parent can count from before it spawned this process)."""
    started = time.monotonic()
    sys.path.insert(0, spec["python_dir"])
    import torch
    from flashckpt.torch import Checkpointer
    imported = time.monotonic()
    torch.set_num_threads(spec["threads"])
    model, optimizer = build_state(torch, spec["layers"])
    mode = spec["mode"]
    before = 0.0
    if mode != "fixed":
        # The limit's first sample (see the module's doc): the parameters, as many times as the state
        # holds their bytes (the model and AdamW's two moments), copied into fresh memory.
        before = time_copy(torch, None, [p.detach() for p in model.parameters()] * 3)
    built = time.monotonic()
    out = {"started": started, "imported": imported, "built": built, "ready": built, "limit_sample": before}
    profiler = None
    if spec.get("profile") and mode != "fixed":
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    if mode == "flashckpt":
        ck = Checkpointer(model, optimizer, socket=spec["socket"], job=spec["job"], ema_decay=None,
                          memory_checkpoints=spec["memory_checkpoints"])
        step = ck.resume()
        out["ready"] = time.monotonic()
        out.update(step=step, tier=ck.resumed_tier)
        ck.close()
    elif mode == "torch.load":
        state = torch.load(spec["path"])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        out["ready"] = time.monotonic()
        out["step"] = spec["expect_step"]
    if profiler is not None:
        import pstats
        profiler.disable()
        sys.stderr.write("--- profile of the child (%s, job %s), by cumulative time:\n" % (mode, spec.get("job")))
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
    if mode != "fixed":
        # The #49 limit, in this process: a copy of the same tensors into fresh memory (first touch).
        restored = list(model.state_dict().values()) + [t for st in optimizer.state.values() for t in st.values()
                                                        if torch.is_tensor(t) and t.dim() > 0]
        out["fresh_copy"] = min(before, time_copy(torch, None, restored))
        out["marker"] = model[0].weight.data.view(-1)[0].item()
        out["optimizer_tensors"] = sum(len(s) for s in optimizer.state.values())
    print(json.dumps(out), flush=True)


def run_child(spec, log_hint):
    """Spawns a child with `spec`; returns its report with "spawned" added. Exits, naming what went
    wrong, when it fails or restored something else than spec asks for."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    spawned = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    CHILDREN.append(proc)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        CHILDREN.remove(proc)
    what = "child (%s%s)" % (spec["mode"], ", job %s" % spec["job"] if "job" in spec else "")
    if proc.returncode != 0:
        sys.exit("%s failed with exit status %d; its stderr:\n%s\n%s" % (what, proc.returncode, err.decode(), log_hint))
    report = json.loads(out.decode().strip().splitlines()[-1])
    report["spawned"] = spawned
    if spec.get("profile"):
        print(err.decode(), flush=True)
    if spec["mode"] == "fixed":
        return report
    want_tier, want_step = spec.get("expect_tier"), spec["expect_step"]
    if want_tier is not None and report.get("tier") != want_tier:
        sys.exit("%s resumed from tier %r, expected %r (step %r)\n%s" % (what, report.get("tier"), want_tier,
                                                                        report.get("step"), log_hint))
    if report.get("step") != want_step or report.get("marker") != float(want_step):
        sys.exit("%s resumed step %r holding the state of step %r, expected step %d\n%s"
                 % (what, report.get("step"), report.get("marker"), want_step, log_hint))
    if report["optimizer_tensors"] == 0:
        sys.exit("%s restored no optimizer state" % what)
    return report


# --- the daemon and the page cache -------------------------------------------------------------

def start_daemon(bin_dir, socket, root, budget, log):
    binary = os.path.join(bin_dir, "flashckptd")
    if not os.access(binary, os.X_OK):
        sys.exit("%s is missing: build it first (ninja -C build flashckptd flashckpt_python)" % binary)
    # --slots 3: a memory checkpoint can be taken while a disk one is written; nothing is written at
    # stop and no job's memory is given back while the children come and go.
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, "--socket", socket, "--root", root, "--max-host-memory", budget,
                                 "--slots", "3", "--no-persist-on-stop", "--idle-release", "0"],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (os.path.exists(socket) and stat.S_ISSOCK(os.stat(socket).st_mode)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            sys.exit("flashckptd did not start; its log:\n" + open(log).read())
        time.sleep(0.02)
    return proc


def stop_daemon(daemon, shm_prefix):
    """SIGTERM (SIGKILL after 60 s), then removes the segments whose names start with shm_prefix."""
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    for name in os.listdir("/dev/shm"):
        if name.startswith(shm_prefix):
            os.unlink(os.path.join("/dev/shm", name))


def drop_cache(paths):
    """Writes back dirty pages, then drops the cached pages of every file under `paths`."""
    os.sync()
    files = []
    for path in paths:
        if os.path.isfile(path):
            files.append(path)
        for top, _, names in os.walk(path):
            files.extend(os.path.join(top, n) for n in names)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def settle(ck, timeout=600.0):
    """Waits until the daemon has checksummed (memory) or written (disk) every snapshot of the
    Checkpointer's job; returns the seconds waited."""
    started = time.monotonic()
    while True:
        jobs = [j for j in ck.status().get("jobs", []) if j.get("job") == ck.client.job]
        if not any(s.get("state") in ("committed", "persisting")
                   for j in jobs for r in j.get("ranks", []) for s in r.get("slots", [])):
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            sys.exit("job %s still has snapshots committed but not checksummed or written after %.0f s"
                     % (ck.client.job, timeout))
        time.sleep(0.001)


# --- the measurements --------------------------------------------------------------------------

def time_copy(torch, dst, tensors):
    """Seconds of one copy of `tensors` into `dst` (allocated when None) on flashckpt's copy threads."""
    trainer_threads = torch.get_num_threads()
    torch.set_num_threads(copy_threads())
    started = time.perf_counter()
    if dst is None:
        dst = [torch.empty_like(t) for t in tensors]
    for d, t in zip(dst, tensors):
        d.copy_(t)
    seconds = time.perf_counter() - started
    torch.set_num_threads(trainer_threads)
    return seconds


def save_series(ck, steps, tier, mark):
    """Blocking seconds of ck.save(step, tier=tier) for each step, and the seconds each then took to be
    checksummed (memory) or durable (disk)."""
    blocked, after = [], []
    for step in steps:
        mark(step)
        started = time.perf_counter()
        ck.save(step, tier=tier)
        blocked.append(time.perf_counter() - started)
        if tier == "disk":
            ck.wait_persisted(step, timeout=600)
            after.append(time.perf_counter() - started)
        else:
            after.append(blocked[-1] + settle(ck))
    return blocked, after


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="approximate state size in GiB (default 1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", help="directory for the daemon's root and the torch.save file (default: a new one "
                                 "under /var/tmp)")
    p.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    p.add_argument("--python-dir", default=os.path.join(REPO, "build", "python"))
    p.add_argument("--step-ms", type=float, default=1000.0, help="compute time of one training step, for the "
                                                                 "goodput (a parameter: nothing sleeps)")
    p.add_argument("--disk-every", type=int, default=100, help="disk checkpoint interval in steps (both policies)")
    p.add_argument("--mtbf-hours", type=float, default=4.0, help="mean time between the job's failures, for the "
                                                                 "goodput (a parameter)")
    p.add_argument("--node-loss-share", type=float, default=0.0,
                   help="share of failures that lose the node and its daemon's memory (policy A then restarts "
                        "from disk too)")
    p.add_argument("--keep", action="store_true", help="keep the directory and the daemon log")
    p.add_argument("--profile", action="store_true", help="profile each child's timed part (cProfile) and print "
                                                          "the top functions; the times then include its cost")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.repeats < 1 or args.repeats > 45:
        p.error("--repeats must lie in 1..45 (the saves take steps 1..2*repeats+2 before disk step 100)")
    if args.disk_every < 2 or not 0.0 <= args.node_loss_share <= 1.0:
        p.error("--disk-every must be at least 2 and --node-loss-share in 0..1")
    sys.path.insert(0, args.python_dir)
    import torch
    from flashckpt.torch import Checkpointer

    torch.set_num_threads(1)
    layers = max(1, round(args.gib * 1024 / 3 / 64))
    model, optimizer = build_state(torch, layers)
    for p_ in model.parameters():
        p_.grad = torch.zeros_like(p_)
    optimizer.step()  # creates exp_avg and exp_avg_sq: the state a real run saves
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    tensors = list(model.state_dict().values()) + [t for s in optimizer.state.values() for t in s.values()]
    total = sum(t.numel() * t.element_size() for t in tensors)
    marker = model[0].weight.data.view(-1)  # element 0 holds the step saved: the children check it

    def mark(step):
        marker[0] = float(step)

    # Steps of the series (increasing within a session), then the state the children restore.
    disk_steps = list(range(1, args.repeats + 2))
    memory_steps = list(range(args.repeats + 2, 2 * args.repeats + 3))
    final_disk, final_memory = 100, [101, 102, 103]

    jobs = "torch-memory-bench-%d-" % os.getpid()
    job_memory, job_disk = jobs + "memory", jobs + "disk"
    # Two jobs of three slots each, and headroom.
    budget = "%dMiB" % (6 * total // 2**20 + 512)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # runs the clean-up below
    daemon = sock_dir = None
    work = args.dir
    made_work = work is None or not os.path.exists(work)  # removed at exit (unless --keep) when made here
    try:
        if work is None:
            work = tempfile.mkdtemp(prefix="fc-bench.", dir="/var/tmp")
        os.makedirs(work, exist_ok=True)
        sock_dir = tempfile.mkdtemp(prefix="fc-bench.", dir="/tmp")  # a socket path must stay short
        socket = os.path.join(sock_dir, "flashckptd.sock")  # the daemon's state directory goes beside it
        root = os.path.join(work, "flashckpt-%d" % os.getpid())
        torch_file = os.path.join(work, "torch-%d.pt" % os.getpid())
        log = os.path.join(work, "flashckptd-%d.log" % os.getpid())
        log_hint = "the daemon's log: %s" % log
        print("state: %.1f MiB (%d layers of %dx%d: model %.1f MiB + AdamW moments), directory %s, %d cores, "
              "copy threads %d" % (total / 2**20, layers, LAYER, LAYER, total / 3 / 2**20, work, os.cpu_count(),
                                   copy_threads()), flush=True)

        # The limit: one copy of the same bytes into memory that is already allocated and touched.
        dst = [torch.empty_like(t) for t in tensors]
        for d in dst:
            d.zero_()
        copies = [time_copy(torch, dst, tensors) for _ in range(args.repeats)]

        daemon = start_daemon(args.bin_dir, socket, root, budget, log)

        # 1. Blocking, job "memory": disk saves, memory saves, then disk step 100 and memory 101..103.
        with Checkpointer(model, optimizer, socket=socket, job=job_memory, ema_decay=None,
                          memory_checkpoints=True) as ck:
            disk_block, disk_durable = save_series(ck, disk_steps, "disk", mark)
            first_disk = disk_block.pop(0)  # registration and the first touch of fresh shared memory
            disk_durable.pop(0)
            mem_block, mem_checksummed = save_series(ck, memory_steps, "memory", mark)
            first_memory = mem_block.pop(0)
            mem_checksummed.pop(0)
            save_series(ck, [final_disk], "disk", mark)
            save_series(ck, final_memory, "memory", mark)
        # Job "disk": the same state with its disk checkpoint alone.
        with Checkpointer(model, optimizer, socket=socket, job=job_disk, ema_decay=None) as ck:
            save_series(ck, [final_disk], "disk", mark)
        mark(final_disk)
        torch.save(state, torch_file)

        mb, md = statistics.median(mem_block), statistics.median(disk_block)
        memcpy = statistics.median(copies)
        gb = total / 1e9
        print()
        print("1. Blocking: how long save() holds the loop (median of %d after a warm-up)" % args.repeats)
        print("  %-34s %12s %6.2f GB/s   checksummed after %s" % ('save(step, tier="memory")', ms(mb), gb / mb,
                                                                    ms(statistics.median(mem_checksummed)).strip()))
        print("  %-34s %12s %6.2f GB/s   durable after %s" % ("save(step) (disk)", ms(md), gb / md,
                                                                ms(statistics.median(disk_durable)).strip()))
        print("  %-34s %12s %6.2f GB/s" % ("copy, %d threads (limit)" % copy_threads(), ms(memcpy), gb / memcpy))
        print("  first saves (registration, fresh shared memory): disk %s, memory %s"
              % (ms(first_disk).strip(), ms(first_memory).strip()))
        ratio = mb / memcpy
        print("  a memory save blocks for %.2fx a copy of the same bytes on the same threads (target <= 1.1x: %s)"
              % (ratio, "met" if ratio <= 1.1 else "NOT met"))
        print("RESULT memory_save_ratio=%.3f" % ratio, flush=True)

        # 2. Recovery: rounds of children, the limit measured before each.
        base = {"python_dir": args.python_dir, "layers": layers, "threads": copy_threads(), "profile": args.profile}
        memory_spec = dict(base, mode="flashckpt", socket=socket, job=job_memory, memory_checkpoints=True,
                           expect_tier="memory", expect_step=final_memory[-1])
        disk_spec = dict(base, mode="flashckpt", socket=socket, job=job_disk, memory_checkpoints=False,
                         expect_tier="disk", expect_step=final_disk)
        load_spec = dict(base, mode="torch.load", path=torch_file, expect_step=final_disk)
        fixed_spec = dict(base, mode="fixed")
        run_child(fixed_spec, log_hint)  # warm-up: the interpreter's and torch's files into the page cache
        rows = {"fixed": [], "memory": [], "disk": [], "load": []}
        limits, fresh = [], []
        for _ in range(args.repeats):
            limits.append(time_copy(torch, dst, tensors))
            fresh.append(time_copy(torch, None, tensors))
            rows["fixed"].append(run_child(fixed_spec, log_hint))
            rows["memory"].append(run_child(memory_spec, log_hint))
            drop_cache([root])
            rows["disk"].append(run_child(disk_spec, log_hint))
            drop_cache([torch_file])
            rows["load"].append(run_child(load_spec, log_hint))
        del dst
        verify = [float(v) for v in re.findall(r"restored job=%s rank=0 step=%d tier=memory bytes=[^=]+ "
                                               r"verify_secs=([0-9.]+)" % (re.escape(job_memory), final_memory[-1]),
                                               open(log).read())]
    finally:
        for proc in list(CHILDREN):
            proc.kill()
            proc.wait()
        if daemon is not None:
            stop_daemon(daemon, "flashckpt." + jobs)
        if sock_dir is not None:
            shutil.rmtree(sock_dir, ignore_errors=True)
        if work is not None and not args.keep:
            if made_work:
                shutil.rmtree(work, ignore_errors=True)
            elif sock_dir is not None:  # a directory given with --dir: what this run put there
                shutil.rmtree(root, ignore_errors=True)
                for path in (torch_file, log):
                    if os.path.exists(path):
                        os.unlink(path)

    def med(key, begin, end):
        """Median seconds from `begin` to `end`, without the limit's sample a child times before
        its timed part (it lies between spawned and built)."""
        return statistics.median(r[end] - r[begin] - (r["limit_sample"] if begin == "spawned" and end != "imported"
                                                      else 0.0) for r in rows[key])

    limit = statistics.median(limits)
    limit_gbps = gb / limit
    print()
    print("2. Recovery, restart to state ready (fresh child processes, median of %d rounds)" % args.repeats)
    print("  %-26s %34s %34s %26s" % ("", "timed: restore until loaded", "whole restart: spawn to ready",
                                      "copy into fresh, same child"))
    results = {}
    for key, name, result in (("memory", "from memory", "memory_restore_ratio"),
                              ("disk", "from disk, cold cache", "disk_cold_restore_ratio"),
                              ("load", "torch.load, cold cache", "torch_load_ratio")):
        timed, whole = med(key, "built", "ready"), med(key, "spawned", "ready")
        results[key] = (timed, whole)
        child_copy = statistics.median(r["fresh_copy"] for r in rows[key])
        results[key] += (child_copy,)
        print("  %-26s %12s %6.2f GB/s %5.2fx copy %12s (start+import+build %s) %12s: restore %.2fx"
              % (name, ms(timed), gb / timed, (gb / timed) / limit_gbps, ms(whole),
                 ms(med(key, "spawned", "built")).strip(), ms(child_copy), timed / child_copy))
    print("  %-26s %12s %6.2f GB/s" % ("copy, %d threads (limit)" % copy_threads(), ms(limit), limit_gbps))
    fr = statistics.median(fresh)
    print("  %-26s %12s %6.2f GB/s   (first touch, as a fresh optimizer's moments)"
          % ("copy into fresh memory", ms(fr), gb / fr))
    fixed_whole, fixed_import = med("fixed", "spawned", "built"), med("fixed", "spawned", "imported")
    print("  child's fixed cost, a child that only imports and builds: %s (process start + imports %s, model and "
          "optimizer built %s)" % (ms(fixed_whole).strip(), ms(fixed_import).strip(),
                                   ms(med("fixed", "imported", "built")).strip()))
    if verify:
        print("  the daemon's checksum verification of a memory restore (its log, verify_secs): median %s"
              % ms(statistics.median(verify)).strip())
    mem_ratio = (gb / results["memory"][0]) / limit_gbps
    print("  restore from memory: %.2fx a copy of the same bytes, checksums verified (target >= 0.8x: %s)"
          % (mem_ratio, "met" if mem_ratio >= 0.8 else "NOT met"))
    print("RESULT memory_restore_ratio=%.3f" % mem_ratio)
    fresh_ratio = results["memory"][0] / results["memory"][2]
    print("  restore from memory: %.2fx the time of a copy of the same tensors into fresh memory in the same process "
          "(target <= 2x: %s)" % (fresh_ratio, "met" if fresh_ratio <= 2.0 else "NOT met"))
    print("RESULT memory_restore_fresh_ratio=%.3f" % fresh_ratio)
    print("RESULT disk_cold_restore_ratio=%.3f" % ((gb / results["disk"][0]) / limit_gbps))
    print("RESULT torch_load_ratio=%.3f" % ((gb / results["load"][0]) / limit_gbps))

    # 3. Goodput: each figure below is a measurement above or a parameter, printed with it.
    step = args.step_ms / 1e3
    n = args.disk_every
    share = args.node_loss_share
    block_a = (mb * (n - 1) + md) / n  # a disk save replaces the memory save every n-th step
    block_b = md / n
    restart_memory, restart_disk = results["memory"][1], results["disk"][1]
    lost_a = (1 - share) * (0.5 * (step + block_a) + restart_memory) + share * (n / 2 * (step + block_a) + restart_disk)
    lost_b = n / 2 * (step + block_b) + restart_disk
    rate = 1.0 / (args.mtbf_hours * 3600)

    def goodput(block, lost):
        return step / (step + block) * max(0.0, 1 - rate * lost)

    good_a, good_b = goodput(block_a, lost_a), goodput(block_b, lost_b)
    print()
    print("3. Goodput, %.1f MiB state: step %.0f ms (parameter), disk every %d steps, MTBF %.1f h (parameter), "
          "node-loss share %.2f (parameter)" % (total / 2**20, args.step_ms, n, args.mtbf_hours, share))
    print("  measured: memory save blocks %s, disk save %s; restart to ready from memory %s, from disk cold %s"
          % (ms(mb).strip(), ms(md).strip(), ms(restart_memory).strip(), ms(restart_disk).strip()))
    print("  %-44s %16s %16s %16s %9s" % ("policy", "blocks per step", "steps lost", "lost per failure",
                                          "goodput"))
    steps_a = (1 - share) * 0.5 + share * n / 2
    print("  %-44s %16s %16.1f %13.1f s %8.4f" % ("A: memory every step + disk every %d" % n, ms(block_a), steps_a,
                                                  lost_a, good_a))
    print("  %-44s %16s %16.1f %13.1f s %8.4f" % ("B: disk every %d" % n, ms(block_b), n / 2, lost_b, good_b))
    print("  goodput = step / (step + blocking) x (1 - lost per failure / MTBF); lost per failure = steps lost x "
          "(step + blocking) + the restart to ready")
    print("  goodput A / B = %.4f" % (good_a / good_b if good_b > 0 else float("inf")))
    print("RESULT goodput_ratio=%.4f" % (good_a / good_b if good_b > 0 else float("inf")))
    # The failure rate at which both are equal: A pays more per step, B more per failure.
    a, c = 1 / (step + block_a), 1 / (step + block_b)
    if c <= a:
        print("  A blocks no more per step than B: A is ahead at every failure rate")
    elif c * lost_b - a * lost_a <= 0:
        print("  A loses no less per failure than B: B is ahead at every failure rate")
    else:
        print("  break-even: A is ahead when the job fails more often than once every %.1f h"
              % ((c * lost_b - a * lost_a) / (c - a) / 3600))
    # Rows for the table scripts/bench.sh prints at the end.
    print("SUMMARY\tmemory tier: save blocking / copy\t%.2fx\t<= 1.10x\t%s"
          % (ratio, "met" if ratio <= 1.1 else "NOT met"))
    print("SUMMARY\tmemory tier: restore from memory / copy\t%.2fx\t>= 0.80x\t%s"
          % (mem_ratio, "met" if mem_ratio >= 0.8 else "NOT met"))
    print("SUMMARY\tmemory tier: restore time / copy into fresh memory, same process\t%.2fx\t<= 2.00x\t%s"
          % (fresh_ratio, "met" if fresh_ratio <= 2.0 else "NOT met"))
    if args.keep:
        print("kept %s" % work)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""One state, four checkpoint systems, one machine: flashckpt against torch.distributed.checkpoint's
async_save, DLRover's Flash Checkpoint and torch.save + fsync.

    bench/peers_bench.py --bin-dir DIR --python-dir DIR [--gib 1.1] [--rounds 5] [--steps 4] [--dir DIR]
                         [--device cuda]

Run it with the torch 2 environment's python (scripts/deps.sh: torch, dlrover). The state is an MLP
of 4096 x 4096 fp32 layers with AdamW's two moments after one step (three times the parameter bytes,
at least --gib GiB in all), in one process. Each round runs, for each system in turn (interleaved,
so that the page cache and the other load on the machine fall on all of them alike), a fresh trainer
process that builds the state, makes its checkpointer, trains --steps AdamW steps (a job's first
save comes some steps after its start) and saves three times, then a fresh process that builds a
model and optimizer of other values and gets the state back; its bytes must equal the saved ones (a
digest of every tensor), else the run fails. The first two saves of a trainer are a warm-up, as a
training job saves many times: they pay what a system does once per process (flashckpt registers
the state with the daemon, which creates its shared memory, after the optimizer's first step, and
maps its slots' pages on a thread from then on, or else on the first save into each slot; DLRover
creates its shared memory; DCP sets up its stager and thread) and are reported apart, on an INFO
line (first_save_*, second_save_*, first_save_over_measured, and step_ms: the median time of each
training step before the first save). The
trainer waits until each warm-up save is durable, then takes the measured save of the same state,
which shows the steady state of a job that saves every so often.
Medians over --rounds rounds (at least 5 for figures to quote); one line per system:

    RESULT peer=<flashckpt|dcp|dlrover|torch_save> blocking_ms=X durable_ms=Y resume_ms=Z

  blocking_ms  how long the save call keeps the training loop from its next step.
  durable_ms   from the start of the save until the checkpoint is on disk, fsynced (flashckpt:
               wait_persisted, the checkpoint complete; dcp: the future of async_save, whose
               FileSystemWriter fsyncs; dlrover: its saver has recorded the step in its tracker
               file, then the bench fsyncs the checkpoint file, which DLRover writes with
               torch.save and does not fsync (INFO: tracker_ms, without that fsync); torch_save:
               torch.save then fsync).
  resume_ms    in the restarted process, from the load call until the state is in the model and
               optimizer: from memory where the system keeps the state past the process's end
               (flashckpt: a memory checkpoint, Checkpointer.resume(); dlrover: its agent's
               shared memory), else from the files (with the page cache as the save left it).

After the resume the restarted process takes one AdamW step and then resumes the same way again,
as a restart after a second crash would: INFO resumed_again_saved=K/N counts the rounds in which
that second resume took the same step from the same tier (memory or the files; dlrover: memory when
the tensors it returns lie in its shared memory) and gave the saved state back, i.e. the checkpoint
resumed from was not changed by the training that followed it.

flashckpt: the warm-up saves and the measured save go to disk, then a memory checkpoint of the next step
(INFO: its blocking time), and the restarted process resumes the newest, from memory.
DLRover's Flash Checkpoint runs as its documentation says for a restartable job: the trainer is
started by `dlrover-run` (--nnodes=1 --nproc-per-node=1 --max-restarts=1), whose agent holds the
checkpoint saver and its shared memory; DdpCheckpointer.save_checkpoint(storage_type=DISK) copies
the state into that memory and the saver writes it. The trainer then exits with an error, the agent
restarts it, and the restarted trainer's load_checkpoint() reads the agent's memory. `dlrover-run
--standalone` cannot start its job master with torch >= 2.8 (dlrover 0.6.1 calls torch's
SubprocessHandler without its numa_options argument), so the bench starts that master itself, with
the command line --standalone uses (python -m dlrover.python.master.main --platform local), and
points dlrover-run at it (DLROVER_MASTER_ADDR): the same processes as --standalone.
dcp uses async_save with a DefaultStager (the same stager for both saves), staging into pinned memory
where CUDA is available. Where that stager fails on the state (torch 2.11 on a GPU: KeyError on a
tensor), DCP's other pinned stager takes its place, BlockingAsyncStager(cache_staged_state_dict=True):
a pinned copy of the state made at the first save and copied into at each save. The INFO line names
the stager (staging=) and the leaf the first one failed on.

--device cuda puts the state in GPU memory (the trainer's and the restarted process's). flashckpt's
blocking_ms then includes wait_copied(), the wait for the device-to-host copies into the daemon's
pinned slot (the training loop must not update the weights before it); save() alone is on the INFO
line (save_call_ms). DCP's stager copies into pinned memory, torch.save writes from device tensors,
and every resume loads into device tensors.
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


def warm_up_and_measured(step):
    """The saves of a trainer as (result key prefix, step): two warm-ups, then the measured one."""
    return (("first_", step), ("second_", step + 1), ("", step + 2))


def build(layers, seed, device="cpu"):
    """An MLP and AdamW after one step with seeded gradients: every tensor's value depends on `seed`."""
    import torch
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    return model, optimizer


def train_steps(model, optimizer, steps, out):
    """`steps` AdamW steps with fixed gradients, as the training between a trainer's start and its
    first save; their times go to out["step_ms"] (flashckpt's first step registers the state and
    starts mapping its slots, Checkpointer.prepare())."""
    import torch
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    times = []
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        optimizer.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    for p in model.parameters():
        p.grad = None
    out["step_ms"] = times
    out["digest"] = digest(model, optimizer)


def digest(model, optimizer):
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
        for field in ("step", "exp_avg", "exp_avg_sq"):
            h.update(optimizer.state[p][field].cpu().numpy().tobytes())
    return h.hexdigest()


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def dlrover_wait_step(where, step, timeout=600):
    """DLRover's wait_latest_checkpoint, polled every 10 ms instead of every 3 s and tolerant of a
    tracker file not written yet (0.6.1's opens it unguarded): until its saver has committed `step`."""
    tracker = os.path.join(where, "dlrover_latest.txt")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(tracker) as f:
                if f.read().strip() == str(step):
                    return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("DLRover's saver did not commit step %d in %d s" % (step, timeout))
        time.sleep(0.01)


def stager_refuses(stager, state):
    """None when DCP's `stager` stages each leaf of `state` on its own; else "KEY (TYPE): ERROR" for
    the first leaf it fails on (torch 2.11's pinned-memory stager fails on some objects)."""
    def leaves(obj, path):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from leaves(v, path + [str(k)])
        elif isinstance(obj, (list, tuple)) and not all(isinstance(v, (int, float, bool)) for v in obj):
            for i, v in enumerate(obj):
                yield from leaves(v, path + [str(i)])
        else:
            yield "/".join(path), obj
    for path, leaf in leaves(state, []):
        try:
            stager.stage({"leaf": leaf})
        except Exception as e:  # the report names it; the bench goes on with the default staging
            return "%s (%s): %r" % (path, type(leaf).__name__, e)
    return None


def train(args):
    """A trainer of `args.peer`: builds the state of round args.round and saves it three times (two
    warm-ups, then the measured save); returns what it measured."""
    import torch
    torch.set_num_threads(1)
    model, optimizer = build(args.layers, 1000 + args.round, args.device)
    out = {"digest": digest(model, optimizer)}
    step = 10 * (args.round + 1)  # the warm-up is step and step + 1; the measured save is step + 2
    where = os.path.join(args.work, args.peer)

    def timed(save, durable):
        t0 = time.perf_counter()
        save()
        blocking = (time.perf_counter() - t0) * 1e3
        durable()
        return blocking, (time.perf_counter() - t0) * 1e3

    if args.peer == "flashckpt":
        from flashckpt.torch import Checkpointer
        ck = Checkpointer(model, optimizer, socket=args.socket, job="peers-%d" % args.round, memory_checkpoints=True)
        train_steps(model, optimizer, args.steps, out)
        calls = []

        def save(s):  # the loop may go on once the tensors have left (at once for CPU tensors)
            t0 = time.perf_counter()
            ck.save(s)
            calls.append((time.perf_counter() - t0) * 1e3)
            ck.wait_copied()
        for key, s in warm_up_and_measured(step):
            out[key + "blocking_ms"], out[key + "durable_ms"] = timed(
                lambda: save(s), lambda: ck.wait_persisted(s, timeout=600))
        out["save_call_ms"] = calls[-1]
        t0 = time.perf_counter()
        ck.save(step + 3, tier="memory")
        ck.wait_copied()
        out["memory_blocking_ms"] = (time.perf_counter() - t0) * 1e3
    elif args.peer == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        pinned = torch.cuda.is_available()
        stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=False))
        train_steps(model, optimizer, args.steps, out)
        # Plain dicts: torch 2.11's pinned-memory stager cannot copy an OrderedDict (KeyError: <class 'type'>).
        state = {"model": dict(model.state_dict()), "optim": optimizer.state_dict()}
        staging = "DefaultStager(pinned)" if pinned else "DefaultStager"
        if pinned:
            refused = stager_refuses(stager, state)
            if refused:  # DCP's other pinned stager: a pinned copy of the state, made once, copied into
                from torch.distributed.checkpoint.staging import BlockingAsyncStager
                print("dcp: DefaultStager's pinned memory fails on %s; using BlockingAsyncStager(cache_staged_"
                      "state_dict=True)" % refused, file=sys.stderr, flush=True)
                stager = BlockingAsyncStager(cache_staged_state_dict=True)
                staging = "BlockingAsyncStager(cache_staged_state_dict)"
                out["pinned_refused"] = refused
        for key, s in warm_up_and_measured(step):
            fut = []
            out[key + "blocking_ms"], out[key + "durable_ms"] = timed(
                lambda: fut.append(dcp.async_save(state, checkpoint_id=os.path.join(where, "step-%d" % s),
                                                  async_stager=stager)),
                lambda: fut[0].result())
        out["staging"] = staging
    elif args.peer == "dlrover":
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer
        ck = DdpCheckpointer(where)
        train_steps(model, optimizer, args.steps, out)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        for key, s in warm_up_and_measured(step):
            path = os.path.join(where, str(s), "rank_0.pt")  # DdpCheckpointer's own layout
            t0 = time.perf_counter()
            ck.save_checkpoint(s, state, path, storage_type=StorageType.DISK)
            out[key + "blocking_ms"] = (time.perf_counter() - t0) * 1e3
            dlrover_wait_step(where, s)
            out[key + "tracker_ms"] = (time.perf_counter() - t0) * 1e3
            fsync_file(path)
            out[key + "durable_ms"] = (time.perf_counter() - t0) * 1e3
    else:
        os.makedirs(where, exist_ok=True)
        train_steps(model, optimizer, args.steps, out)
        for key, s in warm_up_and_measured(step):
            path = os.path.join(where, "step-%d.pt" % s)
            out[key + "blocking_ms"] = out[key + "durable_ms"] = timed(
                lambda: (torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, path),
                         fsync_file(path)), lambda: None)[0]
    return out


def resume(args):
    """A restarted process of `args.peer`: a model and optimizer of other values, then the state of
    round args.round (its measured save, or flashckpt's newer memory checkpoint) back in them;
    returns the time and the digest it has then. Then one training step and the same resume again:
    its tier, step and digest say whether the checkpoint the system resumed from still holds the
    saved state once the resumed process has trained on (a second crash would resume from it)."""
    import torch
    torch.set_num_threads(1)
    model, optimizer = build(args.layers, 7, args.device)  # other values, and AdamW state to load into
    step = 10 * (args.round + 1) + 2  # the measured save of train()
    where = os.path.join(args.work, args.peer)
    out = {}
    ck = None
    if args.peer == "flashckpt":
        from flashckpt.torch import Checkpointer
        ck = Checkpointer(model, optimizer, socket=args.socket, job="peers-%d" % args.round, memory_checkpoints=True)

        def load():
            got = ck.resume()
            return ck.resumed_tier, got
    elif args.peer == "dcp":
        import torch.distributed.checkpoint as dcp

        def load():
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            dcp.load(state, checkpoint_id=os.path.join(where, "step-%d" % step))
            optimizer.load_state_dict(state["optim"])
            return "disk", step
    elif args.peer == "dlrover":
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer
        ck = DdpCheckpointer(where)

        def load():
            state = ck.load_checkpoint()  # the agent's memory, else the newest step its tracker names
            # From memory, the tensors it returns are views of the agent's shared memory.
            shm = ck._engine._shm_handler.shared_memory
            first = next(iter(state["model"].values()))
            in_shm = False
            if shm is not None:
                base = torch.frombuffer(shm.buf, dtype=torch.uint8).data_ptr()
                in_shm = base <= first.data_ptr() < base + shm.size
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])
            return "memory" if in_shm else "disk", step
    else:
        def load():
            state = torch.load(os.path.join(where, "step-%d.pt" % step), map_location=args.device)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])
            return "disk", step
    t0 = time.perf_counter()
    out["tier"], out["step"] = load()
    out["resume_ms"] = (time.perf_counter() - t0) * 1e3
    out["digest"] = digest(model, optimizer)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # writes every parameter, both moments and the step counts
    out["tier_again"], out["step_again"] = load()
    out["digest_again"] = digest(model, optimizer)
    if args.peer == "flashckpt":
        ck.close()
    return out


def dlrover_worker(args):
    """The trainer process that dlrover-run starts: the first time it trains, saves and fails (as a
    crash would, with an error status), the second time (the agent's restart) it resumes."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    role, status = (train, 1) if restart == 0 else (resume, 0)
    out = role(args)
    with open(os.path.join(args.out, "%s.json" % role.__name__), "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(status)  # no interpreter teardown: DLRover's threads and sockets


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_args(args, peer, rnd):
    return ["--peer", peer, "--round", str(rnd), "--layers", str(args.layers), "--steps", str(args.steps),
            "--work", args.work,
            "--socket", args.socket, "--bin-dir", args.bin_dir, "--python-dir", args.python_dir,
            "--device", args.device]


def run_role(args, role, peer, rnd, env):
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role] + worker_args(args, peer, rnd)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=900)
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit("%s %s round %d failed (exit %d):\n%s" % (peer, role, rnd, proc.returncode,
                                                           proc.stderr.decode(errors="replace")[-4000:]))
    return json.loads(lines[-1])


def run_dlrover_round(args, rnd, env):
    """One round of DLRover: its job master, then dlrover-run with the trainer; returns the trainer's
    and the restarted trainer's results."""
    job = "fc-peers-%d-%d" % (os.getpid(), rnd)  # names DLRover's shared memory and socket folder
    out = os.path.join(args.base, "dlrover-%d" % rnd)
    os.makedirs(out)
    log_path = os.path.join(args.base, "dlrover-%d.log" % rnd)
    port = free_port()
    env = dict(env, ELASTIC_JOB_NAME=job, DLROVER_MASTER_ADDR="127.0.0.1:%d" % port)
    with open(log_path, "wb") as log:
        master = subprocess.Popen([sys.executable, "-u", "-m", "dlrover.python.master.main", "--port", str(port),
                                   "--node_num", "1", "--job_name", job, "--platform", "local"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            run = os.path.join(os.path.dirname(sys.executable), "dlrover-run")
            cmd = [run, "--nnodes=1", "--nproc-per-node=1", "--max-restarts=1", os.path.abspath(__file__),
                   "--role", "dlrover-worker", "--out", out] + worker_args(args, "dlrover", rnd)
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
        finally:
            master.terminate()
            try:
                master.wait(timeout=30)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait()
            # DLRover's agent leaves its shared memory and sockets behind when the job ends.
            for name in os.listdir("/dev/shm"):
                if name.startswith(job + "_"):
                    os.unlink(os.path.join("/dev/shm", name))
            shutil.rmtree(os.path.join("/tmp/ckpt_sock", job), ignore_errors=True)
    try:
        with open(os.path.join(out, "train.json")) as f:
            saved = json.load(f)
        with open(os.path.join(out, "resume.json")) as f:
            got = json.load(f)
    except OSError:
        with open(log_path, errors="replace") as f:
            sys.exit("dlrover round %d failed (dlrover-run exit %d):\n%s" % (rnd, proc.returncode, f.read()[-4000:]))
    return saved, got


def dlrover_unavailable(env):
    """Why DLRover's Flash Checkpoint cannot run in this environment, or None."""
    probe = subprocess.run([sys.executable, "-c", "import dlrover.trainer.torch.flash_checkpoint.ddp, "
                            "dlrover.python.master.main"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if probe.returncode != 0:
        return "dlrover does not import: %s" % probe.stderr.decode(errors="replace").strip().splitlines()[-1]
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "dlrover-run")):
        return "no dlrover-run beside %s" % sys.executable
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True, help="the directory of flashckptd")
    ap.add_argument("--python-dir", required=True, help="the directory that holds the flashckpt package")
    ap.add_argument("--gib", type=float, default=1.1, help="state size: parameters and AdamW's two moments")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir under /tmp)")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the state lives")
    ap.add_argument("--steps", type=int, default=4,
                    help="training steps (AdamW) between the trainer's start, its checkpointer made, and its first save")
    ap.add_argument("--role", choices=("main", "train", "resume", "dlrover-worker"), default="main",
                    help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, args.python_dir)
    if args.role == "dlrover-worker":
        return dlrover_worker(args)
    if args.role in ("train", "resume"):
        out = (train if args.role == "train" else resume)(args)
        print(json.dumps(out), flush=True)
        os._exit(0)  # as a crash: no close(), flashckpt's daemon keeps the memory checkpoint

    args.layers = max(1, -(-int(args.gib * 1024) // (3 * 64)))  # ceil: at least --gib GiB
    gib = args.layers * 3 * (LAYER * LAYER + LAYER) * 4 / 2**30
    args.base = base = tempfile.mkdtemp(prefix="fc-peers.", dir=args.dir or "/tmp")
    args.work = os.path.join(base, "work")
    args.socket = os.path.join(base, "flashckptd.sock")
    budget = "%dGiB" % (int(gib * 2) + 2)  # two checkpoints of a round's job
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=args.python_dir, PYTHONWARNINGS="ignore")
    daemon = subprocess.Popen([os.path.join(args.bin_dir, "flashckptd"), "--socket", args.socket, "--root",
                               os.path.join(base, "root"), "--max-host-memory", budget, "--idle-release", "60"],
                              stdout=open(os.path.join(base, "flashckptd.log"), "wb"), stderr=subprocess.STDOUT)
    peers = [p for p in args.peers.split(",") if p]
    results = {p: [] for p in peers}
    unavailable = {}
    if "dlrover" in peers:
        why = dlrover_unavailable(env)
        if why:
            unavailable["dlrover"] = why
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(args.socket):
            if daemon.poll() is not None or time.monotonic() > deadline:
                sys.exit("flashckptd did not start: see %s" % os.path.join(base, "flashckptd.log"))
            time.sleep(0.05)
        print("state: %d layers of %dx%d fp32 with AdamW = %.2f GiB on %s; %d rounds; checkpoints under %s; load %s"
              % (args.layers, LAYER, LAYER, gib, args.device, args.rounds, base,
                 "%.1f %.1f %.1f" % os.getloadavg()), flush=True)
        for peer, why in unavailable.items():
            print("%-10s not run: %s" % (peer, why), flush=True)
        for rnd in range(args.rounds):
            for peer in peers:
                if peer in unavailable:
                    continue
                if peer == "dlrover":
                    saved, got = run_dlrover_round(args, rnd, env)
                else:
                    saved = run_role(args, "train", peer, rnd, env)
                    got = run_role(args, "resume", peer, rnd, env)
                if got["digest"] != saved["digest"]:
                    sys.exit("%s round %d: the resumed state differs from the saved one" % (peer, rnd))
                # Kept: the second resume found the same checkpoint where the first did, with the saved state.
                saved.update(resume_ms=got["resume_ms"], tier=got.get("tier"), tier_again=got["tier_again"],
                             kept=(got["digest_again"] == saved["digest"] and got["tier_again"] == got["tier"]
                                   and got["step_again"] == got["step"]))
                results[peer].append(saved)
                print("round %d %-10s first save %8.1f ms (durable %8.1f)  second %8.1f ms  blocking %8.1f ms"
                      "  durable %8.1f ms  resume %8.1f ms from %s, resumed again from %s: %s%s" % (
                          rnd, peer, saved["first_blocking_ms"], saved["first_durable_ms"],
                          saved["second_blocking_ms"], saved["blocking_ms"],
                          saved["durable_ms"], saved["resume_ms"], saved["tier"], saved["tier_again"],
                          "the saved state" if saved["kept"] else "NOT the saved state",
                          "  (memory save %.1f ms)" % saved["memory_blocking_ms"] if peer == "flashckpt" else ""),
                      flush=True)
                shutil.rmtree(os.path.join(args.work, peer), ignore_errors=True)  # the disk stays the same size
                if peer == "flashckpt":
                    # The round's job gives its memory back now, not after --idle-release: the next
                    # round's job needs the budget.
                    subprocess.run([os.path.join(args.bin_dir, "flashckpt"), "--socket", args.socket, "release",
                                    "--job", "peers-%d" % rnd, "--force"], check=True, stdout=subprocess.DEVNULL)

        def med(peer, key):
            return statistics.median(r[key] for r in results[peer])

        for peer in peers:
            if peer in unavailable:
                print("RESULT peer=%s blocking_ms=nan durable_ms=nan resume_ms=nan" % peer, flush=True)
                print("INFO peer=%s not_run=%r" % (peer, unavailable[peer]), flush=True)
                continue
            print("RESULT peer=%s blocking_ms=%.1f durable_ms=%.1f resume_ms=%.1f"
                  % (peer, med(peer, "blocking_ms"), med(peer, "durable_ms"), med(peer, "resume_ms")), flush=True)
            info = ("first_save_blocking_ms=%.1f first_save_durable_ms=%.1f second_save_blocking_ms=%.1f "
                    "second_save_durable_ms=%.1f first_save_over_measured=%.2f step_ms=%s "
                    "resumed_from=%s resumed_again_saved=%d/%d") % (
                med(peer, "first_blocking_ms"), med(peer, "first_durable_ms"), med(peer, "second_blocking_ms"),
                med(peer, "second_durable_ms"), med(peer, "first_blocking_ms") / med(peer, "blocking_ms"),
                ",".join("%.0f" % statistics.median(r["step_ms"][i] for r in results[peer])
                         for i in range(args.steps)),
                ",".join(sorted({str(r["tier"]) for r in results[peer]})),
                sum(r["kept"] for r in results[peer]), len(results[peer]))
            if peer == "flashckpt":
                info += " memory_blocking_ms=%.1f save_call_ms=%.1f" % (
                    med(peer, "memory_blocking_ms"), med(peer, "save_call_ms"))
            if peer == "dcp":
                info += " staging=%s" % results[peer][0].get("staging")
                if results[peer][0].get("pinned_refused"):
                    info += " pinned_stager_failed_on=%r" % results[peer][0]["pinned_refused"]
            if peer == "dlrover":
                info += " tracker_ms=%.1f" % med(peer, "tracker_ms")
            print("INFO peer=%s %s" % (peer, info), flush=True)
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

#!/usr/bin/python3
"""Train a small MLP through flashckptd: AdamW, dropout, an EMA kept by the daemon, exact resume.

    PYTHONPATH=build/python examples/train_mlp.py --socket /tmp/fc/flashckptd.sock --job mlp

The run always starts with ck.resume(): on a fresh job it trains from step 1, after a crash it
continues from the latest complete checkpoint with the same weights, optimizer moments, RNG state
(dropout) and data position, so its losses are bit-identical to a run that never stopped.

Every --save-every steps the state is checkpointed (persisted by the daemon in the background);
every --ema-every step in between it is handed to the daemon for the EMA only. With --memory-every
M, every M-th step in between is a memory checkpoint instead (kept by the daemon with the EMA of its
step, never written): a trainer killed and restarted resumes from the newest one. At the end the script
prints the eval loss of the final and the EMA weights, the time the loop was blocked in save() and
what torch.save of the same state takes. --log writes one JSON line per step ({"step", "loss"} with
the loss as float.hex), --summary a JSON summary; --step-delay slows the loop down so that a demo
or a test can kill it mid-run.

--device cuda trains on the GPU (the Checkpointer copies device tensors straight into the daemon's
pinned memory); --hidden and --depth size the model (2048 and 6 give about 240 MiB of weights and
AdamW moments). The summary reports the mean and median step time (a save's copies are waited for
by the next optimizer.step()); a run with --save-every above --steps and --no-ema is the same loop
without saving.
"""

import argparse
import copy
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "python"))
from flashckpt.torch import Checkpointer  # noqa: E402

FEATURES, CLASSES = 32, 10
BATCH, TRAIN_SAMPLES, EVAL_SAMPLES = 64, 8192, 2048


def make_data(seed):
    """A fixed synthetic task: inputs ~ N(0, 1), labels from a random 'teacher' network."""
    g = torch.Generator().manual_seed(seed)
    teacher = [torch.randn(FEATURES, 64, generator=g), torch.randn(64, CLASSES, generator=g)]
    x = torch.randn(TRAIN_SAMPLES + EVAL_SAMPLES, FEATURES, generator=g)
    y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(dim=1)
    return (x[:TRAIN_SAMPLES], y[:TRAIN_SAMPLES]), (x[TRAIN_SAMPLES:], y[TRAIN_SAMPLES:])


def batch_at(train, pos, seed):
    """The batch that starts at sample `pos` of the stream (a fresh shuffle every epoch): a pure
    function of pos, so the data position is all a checkpoint needs to keep."""
    epoch, offset = divmod(pos, TRAIN_SAMPLES)
    order = torch.randperm(TRAIN_SAMPLES, generator=torch.Generator().manual_seed(seed * 1000003 + epoch))
    idx = order[offset:offset + BATCH]
    return train[0][idx], train[1][idx]


def make_model(hidden, depth):
    """`depth` hidden layers of `hidden` units (GELU, dropout) between the inputs and the classes."""
    layers = [torch.nn.Linear(FEATURES, hidden), torch.nn.GELU(), torch.nn.Dropout(0.1)]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Dropout(0.1)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, CLASSES))


@torch.no_grad()
def eval_loss(model, data):
    model.eval()
    loss = F.cross_entropy(model(data[0]), data[1]).item()
    model.train()
    return loss


def digest(state):
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def time_torch_save(state, directory, repeats=3):
    """Median seconds torch.save of `state` takes into `directory` (the file is removed after each)."""
    times = []
    for i in range(repeats):
        path = os.path.join(directory, "torch_save.%d.pt" % os.getpid())
        started = time.perf_counter()
        torch.save(state, path)
        times.append(time.perf_counter() - started)
        os.unlink(path)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", required=True, help="flashckptd's UNIX socket")
    p.add_argument("--job", required=True, help="job name ([A-Za-z0-9._-])")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=50, help="persist a checkpoint every N steps")
    p.add_argument("--ema-every", type=int, default=1, help="EMA-only snapshot every N steps in between")
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--no-ema", action="store_true", help="no EMA")
    p.add_argument("--memory-every", type=int, default=0,
                   help="a memory checkpoint (kept by the daemon, never written) every N steps between the "
                        "saves; a restart resumes from the newest one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (deterministic kernels)")
    p.add_argument("--hidden", type=int, default=128, help="units per hidden layer")
    p.add_argument("--depth", type=int, default=2, help="hidden layers")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--log", help="append one JSON line per step here")
    p.add_argument("--summary", help="write a JSON summary here at the end")
    p.add_argument("--torch-save-dir", help="where to time torch.save of the same state (default: a temp dir)")
    p.add_argument("--quiet", action="store_true", help="no per-step lines on stdout")
    p.add_argument("--fresh", action="store_true",
                   help="start over: do not resume; the first save deletes the job's earlier checkpoints")
    args = p.parse_args()

    torch.set_num_threads(1)  # deterministic and fast enough on a small machine
    device = torch.device(args.device)
    if device.type == "cuda":
        # The same losses on every run of the same steps: cuBLAS with a fixed workspace, and no
        # kernel that sums in a varying order (warn, rather than fail, where torch has none).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(args.seed)
    train, held_out = make_data(1234)
    held_out = (held_out[0].to(device), held_out[1].to(device))
    model = make_model(args.hidden, args.depth).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    ck = Checkpointer(model, optimizer, socket=args.socket, job=args.job,
                      ema_decay=None if args.no_ema else args.ema_decay, ema_interval=args.ema_every,
                      overwrite=args.fresh, memory_checkpoints=bool(args.memory_every))

    began = time.perf_counter()
    start = None if args.fresh else ck.resume()
    resume_secs = time.perf_counter() - began
    pos = ck.extra["data_pos"] if start is not None else 0
    print("resumed step=%s from=%s in %.3f s" % (start, ck.resumed_tier, resume_secs) if start is not None
          else "fresh start: no checkpoint of job %r" % args.job, flush=True)
    log = open(args.log, "a") if args.log else None
    losses = {}
    persist_blocked = []
    step_secs = []
    last_saved = None
    for step in range((start or 0) + 1, args.steps + 1):
        step_began = time.perf_counter()
        x, y = batch_at(train, pos, args.seed)
        x, y = x.to(device), y.to(device)
        pos += BATCH
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        ck.wait_copied()        # the last snapshot has left the weights: safe to update them
        optimizer.step()
        if step % args.save_every == 0:
            snap = ck.save(step, extra={"data_pos": pos}, loss=loss.item())
            persist_blocked.append(snap.seconds)
            last_saved = step
        elif args.memory_every and step % args.memory_every == 0:
            ck.save(step, extra={"data_pos": pos}, tier="memory")
        elif step % args.ema_every == 0 and not args.no_ema:
            ck.save(step, persist=False, loss=loss.item())
        losses[step] = loss.item()  # waits for the step's kernels
        step_secs.append(time.perf_counter() - step_began)
        if log:
            log.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
            log.flush()
        if not args.quiet:
            print("step %4d loss %.6f" % (step, loss.item()), flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)
    if last_saved is not None:
        ck.wait_persisted(last_saved, timeout=600)

    ema_model = copy.deepcopy(model)
    ema = {}
    if not args.no_ema:
        ema = ck.ema_state_dict()
        ema_model.load_state_dict(ema)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if args.torch_save_dir:
        torch_save = time_torch_save(state, args.torch_save_dir)
    else:
        with tempfile.TemporaryDirectory() as d:
            torch_save = time_torch_save(state, d)
    summary = {
        "job": args.job, "resumed_step": start, "resumed_tier": ck.resumed_tier,
        "resume_seconds": resume_secs if start is not None else None, "last_step": args.steps,
        "losses": {str(k): v.hex() for k, v in losses.items()},
        "eval_loss": eval_loss(model, held_out), "ema_eval_loss": eval_loss(ema_model, held_out),
        "ema_step": ck.ema_step, "saves": ck.saves, "persisted_saves": len(persist_blocked),
        "blocked_ms_total": ck.blocked_seconds * 1e3,
        "blocked_ms_per_persisted_save": statistics.mean(persist_blocked) * 1e3 if persist_blocked else None,
        "blocked_ms_median_persisted_save": statistics.median(persist_blocked) * 1e3 if persist_blocked else None,
        "torch_save_ms": torch_save * 1e3, "device": args.device,
        "step_ms_mean": statistics.mean(step_secs) * 1e3 if step_secs else None,
        "step_ms_median": statistics.median(step_secs) * 1e3 if step_secs else None,
        "state_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values())
        + sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
              if torch.is_tensor(t)),
        "params_sha256": digest(model.state_dict()), "ema_sha256": digest(ema),
        "optimizer_sha256": digest({"state.%d.%s" % (i, field): v for i, p in enumerate(model.parameters())
                                    for field, v in optimizer.state[p].items() if torch.is_tensor(v)}),
    }
    print("eval loss: final weights %.6f, EMA weights (decay %g, step %s) %.6f"
          % (summary["eval_loss"], args.ema_decay, ck.ema_step, summary["ema_eval_loss"]))
    if persist_blocked:
        print("blocked in save(): %.2f ms per persisted save (median %.2f; the first registers the state), "
              "%.1f ms in all over %d saves; torch.save of the same state (%.2f MiB): %.2f ms"
              % (summary["blocked_ms_per_persisted_save"], summary["blocked_ms_median_persisted_save"],
                 summary["blocked_ms_total"], ck.saves,
                 summary["state_bytes"] / 2**20, summary["torch_save_ms"]))
    if step_secs:
        print("step time: mean %.2f ms, median %.2f ms over %d steps (%d saves)"
              % (summary["step_ms_mean"], summary["step_ms_median"], len(step_secs), ck.saves))
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=1)
    ck.close()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Train a small Paddle MLP through flashckptd: AdamW with a decaying learning rate, dropout, an EMA
kept by the daemon, exact resume.

    PYTHONPATH=build/python ~/.cache/flashckpt/venv/bin/python examples/train_paddle.py \\
        --socket /tmp/fc/flashckptd.sock --job paddle-mlp

The run always starts with ck.resume(): on a fresh job it trains from step 1, after a crash it
continues from the newest checkpoint with the same weights, optimizer moments, learning-rate
schedule, RNG state (dropout) and data position, so its losses are bit-identical to a run that never
stopped. Every --save-every steps the state is checkpointed; every --ema-every step in between it is
handed to the daemon for the EMA only, or, with --memory-every M, every M-th step in between is a
memory checkpoint. --log writes one JSON line per step ({"step", "loss"}, the loss as float.hex),
--summary a JSON summary (final weights' and EMA's digests, eval losses). flashckpt.paddle.export
turns any of its checkpoints into Paddle's own model.pdparams / model.pdopt.

Data parallel: started by `python -m paddle.distributed.launch --nproc_per_node N --devices "" --
examples/train_paddle.py ...` (gloo on the CPU; the `--` keeps the launcher from taking --log), each rank trains a paddle.DataParallel model on its own part of every global
batch (rank r takes samples r*BATCH.. of the N*BATCH the step reads) and checkpoints through its
Checkpointer; --log and --summary then get ".rank<R>" appended. --no-ema leaves the EMA out, so that
the ranks split the writing of their common state. --sharding makes it a fleet job of sharding
stage 1 instead (sharding_degree N: each rank's DygraphShardingOptimizer updates its own parameters
and holds their optimizer state).
"""

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np
import paddle
import paddle.nn.functional as F

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "python"))
from flashckpt.paddle import Checkpointer  # noqa: E402

FEATURES, HIDDEN, CLASSES = 32, 128, 10
BATCH, TRAIN_SAMPLES, EVAL_SAMPLES = 64, 8192, 2048


def make_data(seed):
    """A fixed synthetic task: inputs ~ N(0, 1), labels from a random 'teacher' network."""
    rng = np.random.default_rng(seed)
    teacher = [rng.standard_normal((FEATURES, 64)).astype("float32"),
               rng.standard_normal((64, CLASSES)).astype("float32")]
    x = rng.standard_normal((TRAIN_SAMPLES + EVAL_SAMPLES, FEATURES)).astype("float32")
    y = (np.tanh(x @ teacher[0]) @ teacher[1]).argmax(axis=1).astype("int64")
    return (x[:TRAIN_SAMPLES], y[:TRAIN_SAMPLES]), (x[TRAIN_SAMPLES:], y[TRAIN_SAMPLES:])


def batch_at(train, pos, seed):
    """The batch that starts at sample `pos` of the stream (a fresh shuffle every epoch): a pure
    function of pos, so the data position is all a checkpoint needs to keep."""
    epoch, offset = divmod(pos, TRAIN_SAMPLES)
    order = np.random.default_rng(seed * 1000003 + epoch).permutation(TRAIN_SAMPLES)
    idx = order[offset:offset + BATCH]
    return paddle.to_tensor(train[0][idx]), paddle.to_tensor(train[1][idx])


def make_model():
    return paddle.nn.Sequential(
        paddle.nn.Linear(FEATURES, HIDDEN), paddle.nn.GELU(), paddle.nn.Dropout(0.1),
        paddle.nn.Linear(HIDDEN, HIDDEN), paddle.nn.GELU(), paddle.nn.Dropout(0.1),
        paddle.nn.Linear(HIDDEN, CLASSES))


def make_optimizer(model):
    schedule = paddle.optimizer.lr.ExponentialDecay(learning_rate=3e-3, gamma=0.995)
    return paddle.optimizer.AdamW(learning_rate=schedule, parameters=model.parameters(), weight_decay=0.01), schedule


@paddle.no_grad()
def eval_loss(model, data):
    model.eval()
    loss = float(F.cross_entropy(model(paddle.to_tensor(data[0])), paddle.to_tensor(data[1])))
    model.train()
    return loss


def digest(state):
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(np.ascontiguousarray(state[k].numpy()).tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", required=True, help="flashckptd's UNIX socket")
    p.add_argument("--job", required=True, help="job name ([A-Za-z0-9._-])")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=50, help="persist a checkpoint every N steps")
    p.add_argument("--ema-every", type=int, default=1, help="EMA-only snapshot every N steps in between")
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--no-ema", action="store_true", help="no EMA")
    p.add_argument("--sharding", action="store_true", help="under paddle.distributed.launch: sharding stage 1")
    p.add_argument("--memory-every", type=int, default=0,
                   help="a memory checkpoint (kept by the daemon, never written) every N steps between the saves")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--log", help="append one JSON line per step here")
    p.add_argument("--summary", help="write a JSON summary here at the end")
    p.add_argument("--quiet", action="store_true", help="no per-step lines on stdout")
    args = p.parse_args()

    paddle.set_device("cpu")
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    rank = 0
    if world > 1 and args.sharding:
        from paddle.distributed import fleet
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": world}
        fleet.init(is_collective=True, strategy=strategy)
    elif world > 1:
        paddle.distributed.init_parallel_env()
    if world > 1:
        rank = paddle.distributed.get_rank()
        args.log = args.log and "%s.rank%d" % (args.log, rank)
        args.summary = args.summary and "%s.rank%d" % (args.summary, rank)
    paddle.seed(args.seed)
    train, held_out = make_data(1234)
    model = make_model()
    optimizer, schedule = make_optimizer(model)
    if world > 1 and args.sharding:
        model = fleet.distributed_model(model)
        optimizer = fleet.distributed_optimizer(optimizer)
    elif world > 1:
        model = paddle.DataParallel(model)
    ck = Checkpointer(model, optimizer, socket=args.socket, job=args.job,
                      ema_decay=None if args.no_ema else args.ema_decay, ema_interval=args.ema_every,
                      memory_checkpoints=bool(args.memory_every))

    began = time.perf_counter()
    start = ck.resume()
    resume_secs = time.perf_counter() - began
    pos = ck.extra["data_pos"] if start is not None else 0
    print("resumed step=%s from=%s in %.3f s" % (start, ck.resumed_tier, resume_secs) if start is not None
          else "fresh start: no checkpoint of job %r" % args.job, flush=True)
    log = open(args.log, "a") if args.log else None
    last_saved = None
    for step in range((start or 0) + 1, args.steps + 1):
        x, y = batch_at(train, pos + rank * BATCH, args.seed)
        pos += BATCH * world
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        ck.wait_copied()        # the last snapshot has left the weights: safe to update them
        optimizer.step()
        optimizer.clear_grad()
        schedule.step()
        value = float(loss)
        if step % args.save_every == 0:
            ck.save(step, extra={"data_pos": pos}, loss=value)
            last_saved = step
        elif args.memory_every and step % args.memory_every == 0:
            ck.save(step, extra={"data_pos": pos}, tier="memory")
        elif step % args.ema_every == 0 and not args.no_ema:
            ck.save(step, persist=False, loss=value)
        if log:
            log.write(json.dumps({"step": step, "loss": value.hex()}) + "\n")
            log.flush()
        if not args.quiet:
            print("step %4d loss %.6f lr %.6f" % (step, value, schedule.get_lr()), flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)
    if last_saved is not None:
        ck.wait_persisted(last_saved, timeout=600)

    ema = {} if args.no_ema else ck.ema_state_dict()
    ema_model = make_model()
    if ema:
        ema_model.set_state_dict(ema)
    summary = {
        "job": args.job, "resumed_step": start, "resumed_tier": ck.resumed_tier,
        "resume_seconds": resume_secs if start is not None else None, "last_step": args.steps,
        "eval_loss": eval_loss(model, held_out), "ema_eval_loss": eval_loss(ema_model, held_out),
        "ema_step": ck.ema_step, "saves": ck.saves, "blocked_ms_total": ck.blocked_seconds * 1e3,
        "lr": schedule.get_lr(), "params_sha256": digest(getattr(model, "_layers", model).state_dict()),
        "ema_sha256": digest(ema),
        "optimizer_sha256": digest({k: v for k, v in optimizer.state_dict().items() if isinstance(v, paddle.Tensor)}),
    }
    print("eval loss: final weights %.6f, EMA weights (decay %g, step %s) %.6f"
          % (summary["eval_loss"], args.ema_decay, ck.ema_step, summary["ema_eval_loss"]))
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=1)
    ck.close()


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""A 4-process DDP job with one rank SIGKILLed resumes as torch.save/torch.load would have.

For DDP + AdamW and for DDP + ZeroRedundancyOptimizer(AdamW), four gloo processes train an MLP
against one real flashckptd, saving every 5 steps (each rank writes its share of the state); with
ZeRO also with a memory checkpoint every step in between (each rank's holds its optimizer partition):
  1. rank 1 SIGKILLs itself at a random step; the others fail in their next collective and are
     killed too;
  2. four fresh processes resume from the newest complete checkpoint (step S; with memory
     checkpoints, the step rank 1 died at, from the daemon's memory, after the daemon too was
     SIGKILLed and restarted: the new one adopts the memory checkpoints) and train to the end;
  3. the reference: the same job trained to step S and stopped after torch.save (for ZeRO, of the
     state consolidated on rank 0), then four fresh processes that torch.load it and train to the end.
The losses of every rank after S in 2 must equal those of 3 bit for bit. (A run that never stopped
is not the standard: DDP rebuilds its gradient buckets after a restart, which by itself moves some
losses by an ulp.) The random kill step comes from FLASHCKPT_TEST_SEED when set (it is printed).
"""

import faulthandler
import json
import os
import random
import signal
import sys
import time
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

WORLD, STEPS, SAVE_EVERY = 4, 24, 5
DEADLINE = 150  # seconds one group of workers may take



def worker(optim, mode, rank, rendezvous, sock, job, out, arg):
    """mode: flashckpt (train from the newest checkpoint, or from scratch; rank 1 SIGKILLs itself at
    step `arg` when it is > 0), torch_stop (train from scratch to step `arg`, torch.save, stop) or
    torch_resume (torch.load the state of step `arg` and train to the end)."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from flashckpt.torch import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    if optim.startswith("zero"):
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    reference = os.path.join(os.path.dirname(out), "torch-%s-%s.pt" % (optim, job))

    start = 0
    ck = None
    if mode == "flashckpt":
        ck = Checkpointer(model, optimizer, socket=sock, job=job)
        start = ck.resume() or 0
    elif mode == "torch_resume":
        state = torch.load(reference)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = arg
    last = arg if mode == "torch_stop" else STEPS

    log = open(out, "a")
    last_disk = None  # the last step saved to disk (the others are memory checkpoints)
    for step in range(start + 1, last + 1):
        g = torch.Generator().manual_seed(1000 * rank + step)  # the same batch whatever restarted
        x = torch.randn(32, 16, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        optimizer.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        log.write(json.dumps({"step": step, "loss": loss.item().hex(), "start": start}) + "\n")
        log.flush()
        if ck is not None and step % SAVE_EVERY == 0:
            ck.save(step)
            last_disk = step
        elif ck is not None and optim == "zero-memory":
            ck.save(step, tier="memory")
        if mode == "flashckpt" and rank == 1 and step == arg:
            if ck is not None and ck.last_snapshot is not None:
                ck.wait_copied()
            os.kill(os.getpid(), signal.SIGKILL)
    if mode == "torch_stop":
        if optim.startswith("zero"):
            optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, reference)
        dist.barrier()
    if ck is not None:
        if last_disk is not None:
            ck.wait_persisted(last_disk, timeout=60)
        ck.close()
    harness.end_worker()  # with the model and the process group still held: see end_worker


def read_losses(path):
    """{step: loss hex} of the lines that were written whole, and the step the run started after."""
    losses, start = {}, None
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    r = json.loads(line)
                    losses[r["step"]] = r["loss"]
                    start = r["start"] if start is None else start
    return losses, start


class DistributedSigkillTest(harness.DaemonTestCase):
    def group(self, optim, mode, job, name, arg, expect_kill=False):
        rendezvous = harness.rendezvous(self.daemon.tmp)
        procs, logs = [], []
        for rank in range(WORLD):
            out = os.path.join(self.daemon.tmp, "%s.%d.jsonl" % (name, rank))
            logs.append(out + ".log")
            procs.append(harness.spawn(os.path.abspath(__file__), ["worker", optim, mode, rank, rendezvous,
                                                                   self.daemon.socket, job, out, arg], log=out + ".log"))
        deadline = time.monotonic() + DEADLINE
        if expect_kill:
            # Rank 1 kills itself; the others then fail in a collective (or are stopped here).
            procs[1].wait(timeout=DEADLINE)
            time.sleep(1.0)
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if not harness.wait_all(procs, deadline):
            self.fail("%s did not finish within %d s:\n%s" % (name, DEADLINE, self.tails(logs)))
        if expect_kill:
            self.assertEqual(procs[1].returncode, -signal.SIGKILL, self.tails(logs))
        else:
            self.assertEqual([p.returncode for p in procs], [0] * WORLD, self.tails(logs))
        return [os.path.join(self.daemon.tmp, "%s.%d.jsonl" % (name, r)) for r in range(WORLD)]

    def tails(self, logs):
        text = []
        for path in logs:
            try:
                with open(path, errors="replace") as f:
                    text.append("%s:\n%s" % (path, f.read()[-2500:]))
            except OSError:
                pass
        return "\n".join(text)

    def run_case(self, optim, memory=False):
        seed = int(os.environ.get("FLASHCKPT_TEST_SEED", random.randrange(1 << 30)))
        kill_step = random.Random(seed).randrange(SAVE_EVERY + 2, STEPS - 2)
        if memory and kill_step % SAVE_EVERY == 0:
            kill_step -= 1  # a step kept in memory only, not one the disk has too
        print("%s: FLASHCKPT_TEST_SEED=%d kills rank 1 at step %d" % (optim, seed, kill_step))
        job = self.daemon.job("sigkill-" + optim)
        self.group(optim, "flashckpt", job, "%s-killed" % optim, kill_step, expect_kill=True)
        if memory:
            # Once every rank's memory checkpoint of the kill step is checksummed (restorable() waits
            # for that), the daemon is SIGKILLed and a new one adopts them.
            import flashckpt
            for rank in range(WORLD):
                with flashckpt.Client(self.daemon.socket, job, rank=rank, world_size=WORLD) as c:
                    self.assertEqual(c.restorable(timeout=30)[0][0], kill_step, "rank %d" % rank)
            self.daemon.proc.kill()
            self.daemon.proc.wait(timeout=30)
            self.daemon.start()
        resumed = self.group(optim, "flashckpt", job, "%s-resumed" % optim, 0)
        runs = [read_losses(p) for p in resumed]
        start = runs[0][1]
        self.assertTrue(all(r[1] == start for r in runs), [r[1] for r in runs])  # every rank resumed at S
        self.assertIsNotNone(start)
        if memory:
            self.assertEqual(start, kill_step)  # every rank's memory checkpoint of the step rank 1 died at
        else:
            self.assertGreaterEqual(start, SAVE_EVERY)
            self.assertEqual(start % SAVE_EVERY, 0)
            self.assertLessEqual(start, kill_step)
        self.group(optim, "torch_stop", job, "%s-torch-stop" % optim, start)
        reference = self.group(optim, "torch_resume", job, "%s-torch-resumed" % optim, start)
        for rank in range(WORLD):
            got, want = runs[rank][0], read_losses(reference[rank])[0]
            self.assertEqual(sorted(got), list(range(start + 1, STEPS + 1)))
            for step in sorted(want):
                self.assertEqual(got[step], want[step], "rank %d, step %d (resumed after step %d)" % (rank, step, start))
        print("%s: resumed at step %d after the kill at step %d; losses of steps %d-%d equal torch.save/torch.load's "
              "on all %d ranks" % (optim, start, kill_step, start + 1, STEPS, WORLD))

    def test_ddp_adamw(self):
        self.run_case("adamw")

    def test_ddp_zero(self):
        self.run_case("zero")

    def test_ddp_zero_memory_checkpoints(self):
        self.run_case("zero-memory", memory=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        faulthandler.enable()  # an abort prints every thread's Python stack into the worker's log
        _, _, optim, mode, rank, rendezvous, sock, job, out, arg = sys.argv
        worker(optim, mode, int(rank), rendezvous, sock, job, out, int(arg))
    else:
        unittest.main(verbosity=2)

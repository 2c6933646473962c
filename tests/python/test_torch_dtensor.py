#!/usr/bin/python3
"""Checkpointer with DTensor states (torch 2): FSDP2 and tensor parallelism, 2 processes, gloo on the CPU.

Runs in the torch 2 environment (scripts/deps.sh; ctest runs it with FLASHCKPT_TORCH2_PYTHON); with
a Python whose torch has no DTensor it prints why and exits 77 (ctest: skipped). Each case runs real
worker processes (this file, run with "worker") against one real flashckptd:
- an MLP under fully_shard (FSDP2; a layer that does not split evenly over 2 ranks, so its last
  shards are smaller) with AdamW saves step 3: every global element of every tensor is in the
  files exactly once (the independent reader: AdamW's step counts, alike on both ranks, are
  written by one), and two fresh processes (other initial weights, an
  optimizer without state) resume it: parameters and AdamW moments equal the saved ones bit for
  bit (as full tensors), stay DTensors placed as before, and the next two steps' losses equal the
  uninterrupted run's bit for bit;
- the same checkpoint resumes into tensor parallelism (parallelize_module: the first layer
  column-wise, the second row-wise, whose bias is replicated) on 2 processes and into a plain model
  in one process: every parameter and moment equal the saved full tensors;
- the tensor-parallel job saves in turn: its replicated bias (and the moments of it) is written by
  one rank only, and the FSDP2 job resumes that checkpoint with the tensor-parallel job's values.
"""

import json
import os
import socket
import subprocess
import sys
import time
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(HERE, "..", "integration"))  # flashckpt_reader; harness is ours


def _why_skip():
    try:
        import torch
        from torch.distributed.tensor import DTensor  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return "no torch with DTensor and FSDP2 (%s)" % e
    return None


SKIP = _why_skip() if __name__ == "__main__" and sys.argv[1:2] != ["worker"] else None
if SKIP is not None:
    print("SKIP: %s in %s. Run scripts/deps.sh (it makes the torch 2 environment at "
          "${FLASHCKPT_VENV:-~/.cache/flashckpt/venv}), then cmake again so that FLASHCKPT_TORCH2_PYTHON finds "
          "it, or run this file with that environment's python." % (SKIP, sys.executable))
    sys.exit(77)

import harness  # noqa: E402

WORKER_DEADLINE = 180  # seconds a set of workers may take, whatever happens
STEPS_BEFORE, STEPS_AFTER = 3, 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(case, rank, world, port, sock, job, out):
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from flashckpt.torch import Checkpointer

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
    parallel = case.split("_")[0]  # fsdp, tp or plain
    torch.manual_seed(0 if case.endswith("save") else 7)  # a resume starts from other weights
    # 6 rows and columns split evenly over 2 ranks (as torch's tensor parallelism needs); FSDP2's
    # shards of the second layer's 3 rows do not (2 and 1).
    model = torch.nn.Sequential(torch.nn.Linear(7, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    if parallel == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    elif parallel == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def batch(step):
        # FSDP2 ranks train on batches of their own; tensor-parallel ranks all see the same one.
        g = torch.Generator().manual_seed(1000 * step + (rank if parallel == "fsdp" else 0))
        return torch.randn(4, 7, generator=g)

    def train(steps):
        losses = []
        for step in steps:
            optimizer.zero_grad()
            loss = model(batch(step)).pow(2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    def dump():
        """Every parameter and AdamW state as a full tensor, by state-dict key, and whether each is a DTensor."""
        tensors, kinds = {}, {}
        for name, p in model.named_parameters():
            tensors["param." + name] = full(p.detach()).clone()
            kinds["param." + name] = [type(p).__name__, [repr(x) for x in getattr(p, "placements", ())]]
            for field, v in optimizer.state.get(p, {}).items():
                tensors["state.%s.%s" % (name, field)] = full(v).clone()
                kinds["state.%s.%s" % (name, field)] = [type(v).__name__, [repr(x) for x in getattr(v, "placements", ())]]
        return tensors, kinds

    result = {"rank": rank}
    with Checkpointer(model, optimizer, socket=sock, job=job) as ck:
        if case.endswith("save"):
            train(range(1, STEPS_BEFORE + 1))
            ck.save(STEPS_BEFORE, extra={"parallel": parallel})
            ck.wait_persisted(STEPS_BEFORE, timeout=60)
            # Whether this rank holds each tensor as a replica (written by another rank).
            result["replica"] = {n: bool(ck._layout.spec(n, shape).get("replica"))
                                 for n, (_, shape) in ck.client.registered.items()}
        else:
            result["step"] = ck.resume()
            result["extra"] = ck.extra
    tensors, result["kinds"] = dump()
    if rank == 0:
        torch.save(tensors, out + ".pt")
    if parallel == "fsdp" or world == 1:
        result["losses"] = train(range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1))
    with open(out, "w") as f:
        json.dump(result, f)
    harness.end_worker()


class DTensorTest(harness.DaemonTestCase):
    def run_case(self, case, job, world):
        """Runs `world` workers of `case`; returns their results (rank order) and rank 0's tensors."""
        import torch
        port = free_port()
        outs = [os.path.join(self.daemon.tmp, "%s-%s-%d.json" % (job, case, r)) for r in range(world)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", case, str(r), str(world),
                                   str(port), self.daemon.socket, job, outs[r]], env=env)
                 for r in range(world)]
        self.assertTrue(harness.wait_all(procs, time.monotonic() + WORKER_DEADLINE),
                        "%s workers still running after %d s" % (case, WORKER_DEADLINE))
        for r, p in enumerate(procs):
            self.assertEqual(p.returncode, 0, "%s rank %d exited %d" % (case, r, p.returncode))
        results = []
        for path in outs:
            with open(path) as f:
                results.append(json.load(f))
        return results, torch.load(outs[0] + ".pt")

    def assert_tensors_equal(self, got, want, what):
        import torch
        self.assertEqual(sorted(got), sorted(want), what)
        for name, t in want.items():
            self.assertEqual((got[name].dtype, tuple(got[name].shape)), (t.dtype, tuple(t.shape)), "%s: %s" % (what, name))
            self.assertTrue(torch.equal(got[name], t), "%s: %s differs" % (what, name))

    def test_fsdp2_saves_once_and_resumes_on_fsdp2_tp_and_one_process(self):
        import flashckpt_reader as reader
        job = self.daemon.job("fsdp")
        saved, want = self.run_case("fsdp_save", job, 2)
        ckpt = os.path.join(self.daemon.job_dir(job), "checkpoint-%d" % STEPS_BEFORE)
        summary = reader.verify_checkpoint(ckpt, formula=False)  # every global element exactly once
        self.assertEqual(summary["elements"], sum(t.numel() for t in want.values()))
        for kinds in (r["kinds"] for r in saved):
            self.assertEqual(kinds["param.0.weight"], ["DTensor", ["Shard(dim=0)"]])
            self.assertEqual(kinds["state.2.weight.exp_avg"], ["DTensor", ["Shard(dim=0)"]])

        resumed, got = self.run_case("fsdp_resume", job, 2)
        for r in resumed:
            self.assertEqual((r["step"], r["extra"]), (STEPS_BEFORE, {"parallel": "fsdp"}))
            self.assertEqual(r["kinds"], saved[r["rank"]]["kinds"])  # DTensors, placed as before
            self.assertEqual(r["losses"], saved[r["rank"]]["losses"], "rank %d's losses after the resume" % r["rank"])
        self.assert_tensors_equal(got, want, "FSDP2 -> FSDP2")

        resumed, got = self.run_case("tp_resume", job, 2)
        self.assertEqual([r["step"] for r in resumed], [STEPS_BEFORE] * 2)
        self.assertEqual(resumed[0]["kinds"]["param.2.bias"], ["DTensor", ["Replicate()"]])
        self.assert_tensors_equal(got, want, "FSDP2 -> tensor parallel")

        resumed, got = self.run_case("plain_resume", job, 1)
        self.assertEqual(resumed[0]["step"], STEPS_BEFORE)
        self.assertEqual(resumed[0]["kinds"]["param.0.weight"], ["Parameter", []])
        self.assert_tensors_equal(got, want, "FSDP2 -> one process")

    def test_tp_writes_replicated_boxes_once_and_resumes_on_fsdp2(self):
        import flashckpt_reader as reader
        job = self.daemon.job("tp")
        saved, want = self.run_case("tp_save", job, 2)
        ckpt = os.path.join(self.daemon.job_dir(job), "checkpoint-%d" % STEPS_BEFORE)
        summary = reader.verify_checkpoint(ckpt, formula=False)
        self.assertEqual(summary["elements"], sum(t.numel() for t in want.values()))
        # The replicated bias and its moments: each written by one of the two ranks.
        for name in ("model.2.bias", "optimizer.state.3.exp_avg", "optimizer.state.3.exp_avg_sq"):
            self.assertEqual(sorted(r["replica"][name] for r in saved), [False, True], name)

        resumed, got = self.run_case("fsdp_resume", job, 2)
        self.assertEqual([r["step"] for r in resumed], [STEPS_BEFORE] * 2)
        self.assert_tensors_equal(got, want, "tensor parallel -> FSDP2")


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        case, rank, world, port, sock, job, out = sys.argv[2:9]
        worker(case, int(rank), int(world), int(port), sock, job, out)
    else:
        unittest.main(verbosity=2)

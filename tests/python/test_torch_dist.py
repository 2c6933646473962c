#!/usr/bin/python3
"""Checkpointer.resume() in a 2-process torch.distributed (gloo) job agrees on one step, or fails on every rank.

Each case runs two real worker processes (this file, run with "worker") against one real flashckptd:
- a DDP job saves steps 2 and 4; two fresh processes resume and both restore step 4, with the
  parameters and the optimizer state bit-identical to the saved ones;
- rank 1's optimizer has another structure (SGD where AdamW was saved): rank 1 raises
  StructureMismatchError, and rank 0, whose own restore would have worked, raises
  FailedPreconditionError naming rank 1 and its reason, and loads nothing;
- DDP (with a BatchNorm, whose statistics differ per rank: rank 0's are written, which DDP
  broadcasts) + AdamW over 4 ranks writes one copy of the state, each rank about a quarter (the bytes per
  rank, from the files, are printed: largest share <= 1.25x the mean), whole tensors and flat
  ranges of those that cross a share's end; 4 and then 2 fresh processes resume it bit for bit;
- DDP + ZeroRedundancyOptimizer over 4 ranks, one parameter frozen and one layer unused: each
  trainable parameter's AdamW state is in exactly one file;
  2 processes resume it, each rank gets the state of its new partition bit for bit, and train on;
- a job of more ranks than saved: DDP + AdamW and DDP + ZeroRedundancyOptimizer saved by 2
  processes are resumed by 4; ranks 2 and 3, which have no part of the checkpoint, get rank 0's,
  the DDP ranks all restore the parameters, buffers and AdamW state bit for bit, and the ZeRO
  ranks each the state of their new partition, every parameter's state on exactly one rank;
- a hand-written tensor-parallel MLP (fc1 column-parallel, fc2 row-parallel over gloo), tp 2 x dp 2,
  saved with shard_specs, restores as tp 1 x dp 2 (every rank the full tensors) and as tp 2 x dp 1
  (each rank its part), parameters and AdamW moments equal bit for bit to the saved ones, into a
  fresh optimizer; training goes on;
- rank 0 asks for step 2 and rank 1 for step 4: both raise ValueError naming what each asked for;
- rank 1 dies before resume(): rank 0's resume() raises instead of waiting for it, well within the
  test's deadline.
"""

import faulthandler
import json
import math
import os
import signal
import sys
import time
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

WORKER_DEADLINE = 120  # seconds a pair of workers may take, whatever happens


def safetensors_keys(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return sorted(k for k in json.loads(f.read(n)) if k != "__metadata__")


def tensor_bytes(path):
    """The bytes of the tensors of a safetensors file, from its header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")



def worker(case, rank, world, rendezvous, sock, job, out):
    import datetime

    import torch
    import torch.distributed as dist

    import flashckpt
    from flashckpt.torch import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))

    def make(sgd=False, seed=0):
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
        if sgd:
            return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def digest(model, optimizer):
        tensors = list(model.state_dict().values())
        for s in optimizer.state.values():
            tensors += [v for v in s.values() if torch.is_tensor(v)]
        return [t.double().sum().item() for t in tensors] + [t.flatten()[:4].tolist() for t in tensors]

    def train_and_save(model, optimizer, ck):
        """Four steps on this rank's batches, saving steps 2 and 4; returns once step 4 is complete."""
        g = torch.Generator().manual_seed(rank)
        for step in range(1, 5):
            optimizer.zero_grad()
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            optimizer.step()
            if step % 2 == 0:
                ck.save(step, extra={"rank": rank, "step": step})
        ck.wait_persisted(4, timeout=60)
        result["draw"] = torch.rand(1).item()  # from the RNG state saved with step 4

    result = {"rank": rank}
    if case == "save":
        model, optimizer = make()
        with Checkpointer(model, optimizer, socket=sock, job=job) as ck:
            train_and_save(model, optimizer, ck)
        result["digest"] = digest(model, optimizer)
    elif case == "resume":
        model, optimizer = make(seed=7)
        with Checkpointer(model, optimizer, socket=sock, job=job) as ck:
            result["step"] = ck.resume()
        result["digest"] = digest(model, optimizer)
    elif case == "resume_error":
        model, optimizer = make(seed=7)
        with Checkpointer(model, optimizer, socket=sock, job=job) as ck:
            try:
                result["step"] = ck.resume()
                result["error"] = None
            except flashckpt.FlashckptError as e:
                result["error"] = [type(e).__name__, str(e)]
    elif case == "mismatch":
        model, optimizer = make(sgd=(rank == 1), seed=7)
        before = digest(model, optimizer)
        with Checkpointer(model, optimizer, socket=sock, job=job) as ck:
            try:
                ck.resume()
                result["error"] = None
            except flashckpt.FlashckptError as e:
                result["error"] = [type(e).__name__, str(e)]
        result["untouched"] = digest(model, optimizer) == before
    elif case == "different_steps":
        model, optimizer = make(seed=7)
        with Checkpointer(model, optimizer, socket=sock, job=job) as ck:
            try:
                ck.resume(step=2 if rank == 0 else 4)
                result["error"] = None
            except ValueError as e:
                result["error"] = [type(e).__name__, str(e)]
    elif case in ("ddp_save", "ddp_resume", "ddp_memory_save", "ddp_memory_resume"):
        torch.manual_seed(0 if case.endswith("save") else 9)
        # Tensors of very different sizes: the 64 x 64 weight and its moments are larger than a
        # rank's share, so they are written as flat ranges by several ranks.
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, 4)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        memory = case.startswith("ddp_memory")
        ck = Checkpointer(model, optimizer, socket=sock, job=job, memory_checkpoints=memory)
        if case == "ddp_save":
            train_and_save(model, optimizer, ck)
        elif case == "ddp_memory_save":
            # A memory checkpoint every step, disk at step 3; the ranks die right after step 5's.
            g = torch.Generator().manual_seed(rank)
            for step in range(1, 6):
                optimizer.zero_grad()
                model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
                optimizer.step()
                ck.save(step, tier="disk" if step == 3 else "memory")
                if step == 3:
                    ck.wait_persisted(3, timeout=60)
            full = list(model.state_dict().values()) + [v for f in optimizer.state.values() for v in f.values()]
            result["full_numel"] = sum(t.numel() for t in full if torch.is_tensor(t))
            result["registered_numel"] = sum(math.prod(shape) for _, shape in ck.client.registered.values())
        else:
            torch.manual_seed(100 + rank)  # kept by a rank the saving job did not have
            result["step"] = ck.resume()
            result["tier"] = ck.resumed_tier
            result["extra"] = ck.extra
            result["draw"] = torch.rand(1).item()
        dump = {"param.%s" % n: p.detach().clone() for n, p in model.named_parameters()}
        dump.update({"buffer.%s" % n: b.clone() for n, b in model.named_buffers()})
        for i, p in enumerate(model.parameters()):
            for field, v in optimizer.state.get(p, {}).items():
                dump["state.%d.%s" % (i, field)] = v.clone()
        torch.save(dump, out + ".pt")
        if case == "ddp_memory_save":
            with open(out, "w") as f:
                json.dump(result, f)
            os.kill(os.getpid(), signal.SIGKILL)  # no close(): the daemon keeps the memory checkpoints
        ck.close()
    elif case in ("zero_save", "zero_resume"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        torch.manual_seed(0 if case == "zero_save" else 9)
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                                torch.nn.ReLU(), torch.nn.Linear(16, 4))
                self.unused = torch.nn.Linear(16, 16)  # no gradient reaches it: no optimizer state

            def forward(self, x):
                return self.body(x)

        net = Net()
        net.body[0].bias.requires_grad_(False)  # a frozen parameter has no optimizer state
        model = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)

        def train(g, steps):
            for _ in range(steps):
                optimizer.zero_grad()
                model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
                optimizer.step()

        with Checkpointer({"model": model, "optim": optimizer}, socket=sock, job=job) as ck:
            if case == "zero_save":
                train(torch.Generator().manual_seed(rank), 3)
                ck.save(3)
                ck.wait_persisted(3, timeout=60)
            else:
                result["step"] = ck.resume()
        index = optimizer._param_to_index
        dump = {"param.%s" % n: p.detach().clone() for n, p in model.named_parameters()}
        for p, fields in optimizer.optim.state.items():
            for field, v in fields.items():
                dump["state.%d.%s" % (index[p], field)] = v.clone()
        torch.save(dump, out + ".pt")
        if case == "zero_resume":
            train(torch.Generator().manual_seed(50 + rank), 1)  # training goes on
            result["after_step_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    elif case == "peer_dies":
        model, optimizer = make(seed=7)
        if rank == 1:
            os._exit(3)
        started = time.monotonic()
        with Checkpointer(model, optimizer, socket=sock, job=job) as ck:
            try:
                ck.resume()
                result["error"] = None
            except Exception as e:  # gloo reports the lost peer as a RuntimeError
                result["error"] = [type(e).__name__, str(e)]
        result["seconds"] = time.monotonic() - started
    with open(out, "w") as f:
        json.dump(result, f)
    harness.end_worker()  # with the model and the process group still held: see end_worker


# --- tensor parallelism ----------------------------------------------------------------------------
# A hand-written tensor-parallel MLP: fc1 column-parallel (rows of its weight and its bias split over
# the tp ranks), fc2 row-parallel (columns of its weight split; its output summed over the tp group,
# its bias whole). Data-parallel ranks average their gradients. rank = tp_rank + tp_degree * dp_rank.
D, H, O = 8, 16, 4


def full_tensors():
    g = __import__("torch").Generator().manual_seed(11)
    torch = __import__("torch")
    return {"fc1_w": torch.randn(H, D, generator=g), "fc1_b": torch.randn(H, generator=g),
            "fc2_w": torch.randn(O, H, generator=g), "fc2_b": torch.randn(O, generator=g)}


SPLIT_DIM = {"fc1_w": 0, "fc1_b": 0, "fc2_w": 1}


def tp_worker(case, rank, world, rendezvous, sock, job, out):
    import datetime

    import torch
    import torch.distributed as dist

    from flashckpt.torch import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    tp_degree = {"tp_save": 2, "tp_resume_tp1": 1, "tp_resume_tp2": 2}[case]
    dp_degree = world // tp_degree
    tp, dp = rank % tp_degree, rank // tp_degree
    tp_groups = [dist.new_group([d * tp_degree + t for t in range(tp_degree)]) for d in range(dp_degree)]
    dp_groups = [dist.new_group([d * tp_degree + t for d in range(dp_degree)]) for t in range(tp_degree)]
    tp_group, dp_group = tp_groups[dp], dp_groups[tp]

    class ReduceFromTp(torch.autograd.Function):
        """Sums the row-parallel layer's partial outputs over the tp group; the gradient passes as is."""

        @staticmethod
        def forward(ctx, x):
            y = x.clone()
            if tp_degree > 1:
                dist.all_reduce(y, group=tp_group)
            return y

        @staticmethod
        def backward(ctx, grad):
            return grad

    class TpMlp(torch.nn.Module):
        def __init__(self, full):
            super().__init__()
            for name, t in full.items():
                if name in SPLIT_DIM:
                    t = t.chunk(tp_degree, dim=SPLIT_DIM[name])[tp]
                setattr(self, name, torch.nn.Parameter(t.clone().contiguous()))

        def forward(self, x):
            h = torch.relu(x @ self.fc1_w.t() + self.fc1_b)
            return ReduceFromTp.apply(h @ self.fc2_w.t()) + self.fc2_b

    full = full_tensors()
    if case != "tp_save":
        full = {k: torch.zeros_like(v) for k, v in full.items()}  # resume must bring the weights back
    model = TpMlp(full)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    specs = {name: (dim, tp, tp_degree) for name, dim in SPLIT_DIM.items()} if tp_degree > 1 else None
    result = {"rank": rank, "tp": tp, "dp": dp}

    def tensors():
        """The rank's parameters and their AdamW moments, by parameter name."""
        out = {}
        for name, p in model.named_parameters():
            out[name] = p.detach().clone()
            for field in ("exp_avg", "exp_avg_sq"):
                if field in optimizer.state.get(p, {}):
                    out["%s.%s" % (field, name)] = optimizer.state[p][field].clone()
        return out

    with Checkpointer({"model": model, "optim": optimizer}, socket=sock, job=job, tp_rank=tp, tp_degree=tp_degree,
                      shard_specs=specs) as ck:
        if case == "tp_save":
            g = torch.Generator().manual_seed(100 + dp)  # one batch per data-parallel rank
            for step in range(1, 4):
                optimizer.zero_grad()
                model(torch.randn(6, D, generator=g)).pow(2).mean().backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad /= dp_degree
                optimizer.step()
            ck.save(3)
            ck.wait_persisted(3, timeout=60)
            state = tensors()
        else:
            result["step"] = ck.resume()
            state = tensors()
            # Training goes on from the restored state.
            optimizer.zero_grad()
            model(torch.randn(6, D, generator=torch.Generator().manual_seed(7))).pow(2).mean().backward()
            optimizer.step()
            result["after_step_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    torch.save(state, out + ".pt")
    with open(out, "w") as f:
        json.dump(result, f)
    harness.end_worker()  # with the model and the process groups still held: see end_worker


class DistributedResumeTest(harness.DaemonTestCase):
    def run_pair(self, case, job, world=2):
        rendezvous = harness.rendezvous(self.daemon.tmp)
        procs, outs = [], []
        for rank in range(world):
            out = os.path.join(self.daemon.tmp, "%s.%s.%d.json" % (job, case, rank))
            open(out + ".log", "wb").close()
            procs.append(harness.spawn(os.path.abspath(__file__), ["worker", case, rank, world, rendezvous,
                                                                   self.daemon.socket, job, out], log=out + ".log"))
            outs.append(out)
        if not harness.wait_all(procs, time.monotonic() + WORKER_DEADLINE):
            self.fail("the %s workers did not finish within %d s:\n%s" % (case, WORKER_DEADLINE, self.logs(outs)))
        results = []
        for out in outs:
            if os.path.exists(out):
                with open(out) as f:
                    results.append(json.load(f))
            else:
                results.append(None)
        return results, procs, outs

    def saved_group(self, case, job, world):
        """Runs `case` in `world` workers, which must all succeed; the tensors each dumped."""
        import torch

        self.last_results, procs, outs = self.run_pair(case, job, world=world)
        self.assertEqual([p.returncode for p in procs], [0] * world, self.logs(outs))
        return [torch.load(out + ".pt") for out in outs]

    def logs(self, outs):
        text = []
        for out in outs:
            try:
                with open(out + ".log", errors="replace") as f:
                    text.append(f.read()[-3000:])
            except OSError:
                pass
        return "\n".join(text)

    def test_ranks_resume_the_same_step(self):
        job = self.daemon.job("dist")
        saved, procs, outs = self.run_pair("save", job)
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        self.assertEqual(saved[0]["digest"], saved[1]["digest"])  # DDP keeps the replicas equal
        resumed, procs, outs = self.run_pair("resume", job)
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        for r in resumed:
            self.assertEqual(r["step"], 4)
            self.assertEqual(r["digest"], saved[0]["digest"])

    def test_a_rank_that_cannot_restore_fails_every_rank(self):
        job = self.daemon.job("distmis")
        _, procs, outs = self.run_pair("save", job)
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        results, procs, outs = self.run_pair("mismatch", job)
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        self.assertEqual(results[1]["error"][0], "StructureMismatchError")
        self.assertEqual(results[0]["error"][0], "FailedPreconditionError")
        self.assertIn("rank 1 of the process group", results[0]["error"][1])
        self.assertIn("StructureMismatchError", results[0]["error"][1])
        self.assertTrue(results[0]["untouched"], "rank 0 restored although rank 1 could not")
        print("rank 0: %s" % results[0]["error"][1])

    def test_ranks_asking_for_different_steps_all_raise(self):
        job = self.daemon.job("diststeps")
        _, procs, outs = self.run_pair("save", job)
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        results, procs, outs = self.run_pair("different_steps", job)
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        for r in results:
            self.assertIsNotNone(r["error"], r)
            self.assertIn("rank 0: 2, rank 1: 4", r["error"][1])

    def test_ddp_job_writes_one_copy_spread_over_its_ranks(self):
        import torch

        job = self.daemon.job("ddp")
        saved = self.saved_group("ddp_save", job, 4)
        for part in saved[1:]:
            for name, t in part.items():
                if not name.startswith("buffer."):  # BatchNorm statistics differ per rank
                    self.assertTrue(torch.equal(t, saved[0][name]), name)  # DDP keeps the replicas alike
        one_copy = sum(t.numel() * t.element_size() for t in saved[0].values())

        step_dir = os.path.join(self.daemon.job_dir(job), "checkpoint-4")
        shares = []
        for rank in range(4):
            files = [f for f in os.listdir(step_dir)
                     if f.endswith("_shard%02d.safetensors" % rank) and not f.startswith("ema")]
            shares.append(sum(tensor_bytes(os.path.join(step_dir, f)) for f in files))
        mean = sum(shares) / len(shares)
        print("bytes persisted per rank: %s; one copy of the state: %d; largest share / mean: %.3f"
              % (shares, one_copy, max(shares) / mean))
        self.assertEqual(sum(shares), one_copy)
        self.assertLessEqual(max(shares), 1.25 * mean)

        for world in (4, 2):
            results, procs, outs = self.run_pair("ddp_resume", job, world=world)
            self.assertEqual([p.returncode for p in procs], [0] * world, self.logs(outs))
            for r, out in zip(results, outs):
                self.assertEqual(r["step"], 4)
                got = torch.load(out + ".pt")
                self.assertEqual(sorted(got), sorted(saved[0]))
                for name, t in saved[0].items():  # buffers: rank 0's, which DDP broadcasts
                    self.assertTrue(torch.equal(got[name], t), "%d ranks: %s" % (world, name))

    def check_zero_resume(self, job, saved_world, resume_world):
        """Saves a ZeroRedundancyOptimizer job of `saved_world` ranks (each optimizer state tensor in
        exactly one file) and resumes it with `resume_world` ranks: the parameters equal, and the new
        partitions together hold every saved state tensor once, bit for bit."""
        import torch

        saved = self.saved_group("zero_save", job, saved_world)
        full = {}
        for part in saved:
            for name, t in part.items():
                if name.startswith("state."):
                    self.assertNotIn(name, full, "two ranks hold the state of one parameter")
                    full[name] = t
        self.assertEqual(len({n.split(".")[1] for n in full}), 5)  # every used trainable parameter has its state

        step_dir = os.path.join(self.daemon.job_dir(job), "checkpoint-3")
        written = []
        for f in sorted(os.listdir(step_dir)):
            if f.startswith("optimizer.") and f.endswith(".safetensors"):
                written += [k for k in safetensors_keys(os.path.join(step_dir, f)) if k.startswith("optim.state.")]
        self.assertEqual(sorted(written), sorted("optim." + n for n in full))

        results, procs, outs = self.run_pair("zero_resume", job, world=resume_world)
        self.assertEqual([p.returncode for p in procs], [0] * resume_world, self.logs(outs))
        resumed_states = {}
        new_ranks_states = 0
        for rank, (r, out) in enumerate(zip(results, outs)):
            self.assertEqual(r["step"], 3)
            self.assertTrue(r["after_step_finite"])
            got = torch.load(out + ".pt")
            for name, t in got.items():
                if name.startswith("param."):
                    self.assertTrue(torch.equal(t, saved[0][name]), "rank %d of %d: %s" % (rank, resume_world, name))
                else:
                    self.assertNotIn(name, resumed_states, "two ranks restored the state of one parameter")
                    resumed_states[name] = t
                    new_ranks_states += rank >= saved_world
        if resume_world > saved_world:
            self.assertGreater(new_ranks_states, 0, "the ranks the saving job did not have hold no optimizer "
                               "state: the case is not tested")
        self.assertEqual(sorted(resumed_states), sorted(full))  # the new partitions cover every parameter
        for name, t in full.items():
            self.assertTrue(torch.equal(resumed_states[name], t), name)

    def test_zero_optimizer_state_is_written_once_and_resumes_into_another_world_size(self):
        self.check_zero_resume(self.daemon.job("zero"), 4, 2)

    def test_a_ddp_job_resumes_from_memory_each_rank_holding_its_share(self):
        import torch

        job = self.daemon.job("ddpmem")
        saved, procs, outs = self.run_pair("ddp_memory_save", job, world=2)
        self.assertEqual([p.returncode for p in procs], [-signal.SIGKILL] * 2, self.logs(outs))
        for r in saved:  # each rank's memory checkpoints hold about half of the state: its share
            self.assertLess(r["registered_numel"], 0.6 * r["full_numel"], r)
        saved = [torch.load(out + ".pt") for out in outs]
        results, procs, outs = self.run_pair("ddp_memory_resume", job, world=2)
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        for rank, (r, out) in enumerate(zip(results, outs)):
            self.assertEqual((r["step"], r["tier"]), (5, "memory"), r)  # not step 3 from disk
            got = torch.load(out + ".pt")
            self.assertEqual(sorted(got), sorted(saved[0]))
            for name, t in saved[0].items():  # buffers: rank 0's, which DDP broadcasts
                self.assertTrue(torch.equal(got[name], t), "rank %d: %s" % (rank, name))

    def test_a_job_of_more_ranks_resumes_a_ddp_checkpoint(self):
        import torch

        job = self.daemon.job("ddpmore")
        saved = self.saved_group("ddp_save", job, 2)
        draws = [r["draw"] for r in self.last_results]
        for name, t in saved[1].items():
            if not name.startswith("buffer."):  # BatchNorm statistics differ per rank
                self.assertTrue(torch.equal(t, saved[0][name]), name)
        step_dir = os.path.join(self.daemon.job_dir(job), "checkpoint-4")
        self.assertEqual(sorted(f for f in os.listdir(step_dir) if f.startswith("extra.rank")),
                         ["extra.rank00000.json", "extra.rank00001.json"])  # ranks 2 and 3 have no part

        results, procs, outs = self.run_pair("ddp_resume", job, world=4)
        self.assertEqual([p.returncode for p in procs], [0] * 4, self.logs(outs))
        for rank, (r, out) in enumerate(zip(results, outs)):
            self.assertEqual(r["step"], 4)
            # A rank the saving job did not have takes rank 0's extra but keeps its own RNG state.
            self.assertEqual(r["extra"], {"rank": rank if rank < 2 else 0, "step": 4})
            if rank < 2:
                self.assertEqual(r["draw"], draws[rank])
            else:
                torch.manual_seed(100 + rank)
                self.assertEqual(r["draw"], torch.rand(1).item())
            got = torch.load(out + ".pt")
            self.assertEqual(sorted(got), sorted(saved[0]))
            for name, t in saved[0].items():  # buffers: rank 0's, which DDP broadcasts
                self.assertTrue(torch.equal(got[name], t), "rank %d of 4: %s" % (rank, name))

    def test_a_job_of_more_ranks_resumes_a_zero_optimizer_checkpoint(self):
        self.check_zero_resume(self.daemon.job("zeromore"), 2, 4)

    def test_a_checkpoint_missing_a_ranks_part_fails_every_rank(self):
        job = self.daemon.job("distlost")
        saved, procs, outs = self.run_pair("save", job)
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        os.unlink(os.path.join(self.daemon.job_dir(job), "checkpoint-4", "extra.rank00001.json"))
        results, procs, outs = self.run_pair("resume_error", job)
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        for r in results:  # not rank 0's part handed to rank 1, as for a rank the saving job did not have
            self.assertIsNotNone(r["error"], r)
            self.assertEqual(r["error"][0], "FailedPreconditionError")
            self.assertIn("saved by 2 ranks but holds no part of rank 1", r["error"][1])

    def test_tensor_parallel_checkpoint_restores_into_other_splits(self):
        import torch

        job = self.daemon.job("tp")
        parts = self.saved_group("tp_save", job, 4)
        # The full tensors, from the tp ranks of data-parallel rank 0 (rank = tp + 2 * dp).
        whole = {}
        for name in parts[0]:
            base = name.split(".")[-1]
            whole[name] = (torch.cat([parts[0][name], parts[1][name]], dim=SPLIT_DIM[base])
                           if base in SPLIT_DIM else parts[0][name])
            self.assertTrue(torch.equal(parts[2][name], parts[0][name]), name)  # dp replicas agree
            if base not in SPLIT_DIM:
                self.assertTrue(torch.equal(parts[1][name], parts[0][name]), name)
        self.assertIn("exp_avg.fc2_w", whole)

        results, procs, outs = self.run_pair("tp_resume_tp1", job, world=2)  # tp 1 x dp 2
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        for r, out in zip(results, outs):
            self.assertEqual(r["step"], 3)
            self.assertTrue(r["after_step_finite"])
            got = torch.load(out + ".pt")
            self.assertEqual(sorted(got), sorted(whole))
            for name, t in whole.items():
                self.assertTrue(torch.equal(got[name], t), "tp 1: %s" % name)

        results, procs, outs = self.run_pair("tp_resume_tp2", job, world=2)  # tp 2 x dp 1
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        for tp, (r, out) in enumerate(zip(results, outs)):
            self.assertEqual(r["step"], 3)
            got = torch.load(out + ".pt")
            self.assertEqual(sorted(got), sorted(parts[tp]))
            for name, t in parts[tp].items():
                self.assertTrue(torch.equal(got[name], t), "tp 2, rank %d: %s" % (tp, name))

    def test_a_dead_peer_fails_resume_instead_of_hanging(self):
        job = self.daemon.job("distdead")
        _, procs, outs = self.run_pair("save", job)
        self.assertEqual([p.returncode for p in procs], [0, 0], self.logs(outs))
        results, procs, outs = self.run_pair("peer_dies", job)
        self.assertEqual(procs[1].returncode, 3)
        self.assertIsNotNone(results[0], self.logs(outs))
        self.assertIsNotNone(results[0]["error"], "resume() returned although its peer was gone")
        self.assertLess(results[0]["seconds"], 60, results[0])
        print("rank 0 without its peer: %s after %.1f s" % (results[0]["error"], results[0]["seconds"]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        faulthandler.enable()  # an abort prints every thread's Python stack into the worker's log
        # A worker still running shortly before the test gives up on it prints every thread's Python
        # stack into its log and goes on, so that the test can also print its native stacks.
        faulthandler.dump_traceback_later(WORKER_DEADLINE - 15)
        _, _, case, rank, world, rendezvous, sock, job, out = sys.argv
        if case.startswith("tp_"):
            tp_worker(case, int(rank), int(world), rendezvous, sock, job, out)
        else:
            worker(case, int(rank), int(world), rendezvous, sock, job, out)
    else:
        unittest.main(verbosity=2)

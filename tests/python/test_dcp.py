#!/usr/bin/python3
"""torch.distributed.checkpoint (DCP) through flashckptd (flashckpt.dcp), and the Checkpointer with
DCP's state-dict helpers (torch 2, gloo on the CPU).

Runs in the torch 2 environment (scripts/deps.sh; ctest runs it with FLASHCKPT_TORCH2_PYTHON); with
a Python whose torch has no DTensor, FSDP2 or DCP it prints why and exits 77 (ctest: skipped).
Each case runs real worker processes (this file, run with "worker") against one real flashckptd:
- an MLP under FSDP2 (fully_shard on 2 ranks; a layer whose rows do not split evenly) with AdamW
  and a dict of plain values saves step 3 with dcp.save(storage_writer=FlashckptWriter(...)) and,
  for reference, with DCP's own FileSystemWriter. The checkpoint's files pass the independent
  reader (checksums; every global element written once); two fresh processes (other initial
  weights, an optimizer without state) dcp.load it with FlashckptReader and the latest step: every
  parameter and AdamW moment equals the saved one bit for bit, the plain values come back, and the
  next two steps' losses equal the uninterrupted run's. The same checkpoint loads on 4 ranks (one
  of which holds an empty shard) with the losses that DCP's own load of its own checkpoint gives
  on 4 ranks, bit for bit, and into a plain model in one process with every tensor equal;
- dcp.async_save(storage_writer=FlashckptWriter(...)) on a gloo group of its own returns once the
  tensors are in the daemon; the ranks take their next optimizer step at once, before the
  future completes; the future completes with the checkpoint complete on disk, and a load gives
  the state of the step saved, not of the one after;
- the Checkpointer given a Stateful that uses get_state_dict / set_state_dict (DCP's state-dict
  helpers) saves an FSDP2 job and resumes it in two fresh processes with the uninterrupted losses;
- in one process: the writer's EMA (ema_decay 0.5) after two saves is 0.5 * w1 + 0.5 * w2 of the
  saved weights; a load from a job with no checkpoint raises NOT_FOUND; a checkpoint_id that
  names no step is a ValueError.
"""

import json
import os
import sys
import time
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(HERE, "..", "integration"))  # flashckpt_reader; harness is ours


def _why_skip():
    try:
        import torch  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: F401
        from torch.distributed.checkpoint.staging import AsyncStager  # noqa: F401
    except ImportError as e:
        return "no torch with DTensor, FSDP2 and DCP's async_save (%s)" % e
    return None


SKIP = _why_skip() if __name__ == "__main__" and sys.argv[1:2] != ["worker"] else None
if SKIP is not None:
    print("SKIP: %s in %s. Run scripts/deps.sh (it makes the torch 2 environment at "
          "${FLASHCKPT_VENV:-~/.cache/flashckpt/venv}), then cmake again so that FLASHCKPT_TORCH2_PYTHON finds "
          "it, or run this file with that environment's python." % (SKIP, sys.executable))
    sys.exit(77)

import harness  # noqa: E402

WORKER_DEADLINE = 180  # seconds a set of workers may take, whatever happens
STEP, STEPS_AFTER = 3, 2



def worker(case, world, rank, rendezvous, sock, job, out):
    """One rank of `case` on `world` ranks (FSDP2 over all of them; 1: a plain model):
    "save" (dcp.save through flashckpt and through FileSystemWriter), "async_save", "load" (dcp.load
    through flashckpt), "fs_load" (DCP's own load of its FileSystemWriter checkpoint), "ck_save" and
    "ck_resume" (the Checkpointer with get_state_dict / set_state_dict)."""
    import datetime
    import warnings

    # Not ours: torch's deprecation notes (DCP's use of TypedStorage, the pynvml that dlrover brings).
    warnings.filterwarnings("ignore", message=".*(TypedStorage|pynvml).*")

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from flashckpt.dcp import FlashckptReader, FlashckptWriter
    from flashckpt.torch import Checkpointer

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0 if "save" in case else 7)  # a load starts from other weights
    # The second layer's 3 rows split 2 + 1 on 2 ranks and 1 + 1 + 1 + 0 on 4 (an empty shard).
    model = torch.nn.Sequential(torch.nn.Linear(7, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    if world > 1:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def batch(step):
        g = torch.Generator().manual_seed(1000 * step + rank)
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
        tensors = {}
        for name, p in model.named_parameters():
            tensors["param." + name] = full(p.detach()).clone()
            for field, v in optimizer.state.get(p, {}).items():
                tensors["state.%s.%s" % (name, field)] = full(v).clone()
        return tensors

    class App(Stateful):
        """What DCP's tutorials checkpoint: the model and optimizer through DCP's state-dict helpers."""

        def state_dict(self):
            model_sd, optim_sd = get_state_dict(model, optimizer)
            return {"model": model_sd, "optim": optim_sd}

        def load_state_dict(self, sd):
            set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    fs_dir = os.path.join(os.path.dirname(out), job + ".fs")  # DCP's own checkpoint of the same step
    result = {"rank": rank}
    saved = None
    if case in ("save", "async_save", "ck_save"):
        train(range(1, STEP + 1))
    if case == "save":
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "data": {"pos": 100 + rank, "epoch": 2}}
        writer = FlashckptWriter(socket=sock, job=job, durable=True)
        dcp.save(state, storage_writer=writer, checkpoint_id=STEP)
        dcp.save(state, checkpoint_id=fs_dir)
    elif case == "async_save":
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "data": {"pos": 100 + rank, "epoch": 2}}
        # The state dict holds the parameters' own memory, so a save that read it late would see step 4.
        local = model_sd["0.weight"]
        local = local.to_local() if isinstance(local, DTensor) else local
        first = model[0].weight
        first = first.to_local() if isinstance(first, DTensor) else first
        result["aliases"] = local.data_ptr() == first.data_ptr()
        group = dist.new_group(backend="gloo") if world > 1 else None
        writer = FlashckptWriter(socket=sock, job=job)
        saved = dump()
        future = dcp.async_save(state, storage_writer=writer, checkpoint_id="/ckpt/step_%d" % STEP,
                                process_group=group)
        result["losses"] = train([STEP + 1])  # the next step, while DCP's thread plans the save
        result["done_before_result"] = future.done()
        future.result(timeout=120)
        result["blocked_ms"] = writer.blocked_seconds * 1e3
        result["losses"] += train(range(STEP + 2, STEP + STEPS_AFTER + 1))
    elif case in ("load", "fs_load"):
        model_sd, optim_sd = get_state_dict(model, optimizer)  # gives the fresh optimizer its state
        state = {"model": model_sd, "optim": optim_sd, "data": {"pos": -1, "epoch": -1}}
        if case == "load":
            reader = FlashckptReader(socket=sock, job=job)
            dcp.load(state, storage_reader=reader)  # the latest: the ranks agree on it
            result["step"] = reader.step
        else:
            dcp.load(state, checkpoint_id=fs_dir)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        result["data"] = state["data"]
    elif case == "ck_save":
        with Checkpointer({"app": App()}, socket=sock, job=job) as ck:
            ck.save(STEP, extra={"note": "app"})
            ck.wait_persisted(STEP, timeout=60)
    elif case == "ck_resume":
        with Checkpointer({"app": App()}, socket=sock, job=job) as ck:
            result["step"] = ck.resume()
            result["extra"] = ck.extra
    if saved is None:
        saved = dump()
    if rank == 0:
        torch.save(saved, out + ".pt")
    if "losses" not in result:
        result["losses"] = train(range(STEP + 1, STEP + STEPS_AFTER + 1))
    with open(out, "w") as f:
        json.dump(result, f)
    harness.end_worker()


class DcpTest(harness.DaemonTestCase):
    def run_case(self, case, world, job):
        """Runs `case` on `world` worker processes; returns their results (rank order) and rank 0's
        full tensors."""
        import torch
        rendezvous = harness.rendezvous(self.daemon.tmp)
        outs = [os.path.join(self.daemon.tmp, "%s-%s-%d-%d.json" % (job, case, world, r)) for r in range(world)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [harness.spawn(os.path.abspath(__file__), ["worker", case, world, r, rendezvous, self.daemon.socket,
                                                           job, outs[r]], env=env)
                 for r in range(world)]
        self.assertTrue(harness.wait_all(procs, time.monotonic() + WORKER_DEADLINE),
                        "%s on %d workers still running after %d s" % (case, world, WORKER_DEADLINE))
        for r, p in enumerate(procs):
            self.assertEqual(p.returncode, 0, "%s on %d: rank %d exited %d" % (case, world, r, p.returncode))
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

    def verify_files(self, job):
        """The independent reader: checksums, and every global element of every tensor written once."""
        import flashckpt_reader as reader
        ckpt = os.path.join(self.daemon.job_dir(job), "checkpoint-%d" % STEP)
        summary = reader.verify_checkpoint(ckpt, formula=False)
        self.assertEqual(summary["step"], STEP)
        return summary

    def test_save_loads_on_the_same_mesh_on_four_ranks_and_in_one_process(self):
        job = self.daemon.job("dcp")
        saved, want = self.run_case("save", 2, job)
        self.verify_files(job)  # durable=True: complete when dcp.save returned

        loaded, got = self.run_case("load", 2, job)
        self.assert_tensors_equal(got, want, "dcp.load on 2 ranks")
        for r in loaded:
            self.assertEqual(r["step"], STEP)
            # One rank's plain values, as DCP keeps one copy of a value every rank has.
            self.assertEqual(r["data"]["epoch"], 2)
            self.assertIn(r["data"]["pos"], (100, 101))
            self.assertEqual(r["losses"], saved[r["rank"]]["losses"], "rank %d's losses after the load" % r["rank"])

        # On 4 ranks the losses differ from the 2-rank run's (other batches per rank): they must
        # equal those of DCP's own load of its own checkpoint on 4 ranks, bit for bit.
        ours, got = self.run_case("load", 4, job)
        self.assert_tensors_equal(got, want, "dcp.load on 4 ranks")
        reference, _ = self.run_case("fs_load", 4, job)
        for r, ref in zip(ours, reference):
            self.assertEqual(r["losses"], ref["losses"], "4 ranks, rank %d: losses after flashckpt's load and DCP's"
                             % r["rank"])
            self.assertEqual(r["data"], ref["data"], "4 ranks, rank %d: the plain values" % r["rank"])
        _, got = self.run_case("load", 1, job)
        self.assert_tensors_equal(got, want, "dcp.load into a plain model")

    def test_async_save_stages_before_the_next_step(self):
        job = self.daemon.job("async")
        saved, want = self.run_case("async_save", 2, job)
        for r in saved:
            self.assertTrue(r["aliases"], "the state dict must share the parameters' memory for this test to mean much")
        self.verify_files(job)  # the future completed: the checkpoint is complete on disk
        loaded, got = self.run_case("load", 2, job)
        self.assert_tensors_equal(got, want, "the load of an async_save")
        for r in loaded:
            self.assertEqual(r["step"], STEP)
            self.assertEqual(r["losses"], saved[r["rank"]]["losses"], "rank %d's losses after the load" % r["rank"])

    def test_checkpointer_with_state_dict_helpers(self):
        job = self.daemon.job("helpers")
        saved, want = self.run_case("ck_save", 2, job)
        resumed, got = self.run_case("ck_resume", 2, job)
        self.assert_tensors_equal(got, want, "Checkpointer resume through set_state_dict")
        for r in resumed:
            self.assertEqual((r["step"], r["extra"]), (STEP, {"note": "app"}))
            self.assertEqual(r["losses"], saved[r["rank"]]["losses"], "rank %d's losses after the resume" % r["rank"])

    def test_ema_missing_checkpoint_and_bad_ids_in_one_process(self):
        import warnings
        warnings.filterwarnings("ignore", message=".*(TypedStorage|pynvml).*")
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from flashckpt.dcp import FlashckptReader, FlashckptWriter

        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        job = self.daemon.job("ema")
        writer = FlashckptWriter(socket=self.daemon.socket, job=job, ema_decay=0.5)
        try:
            w1 = {k: v.clone() for k, v in model.state_dict().items()}
            dcp.save({"model": model.state_dict()}, storage_writer=writer, checkpoint_id=1)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-3.0).add_(0.25)
            w2 = {k: v.clone() for k, v in model.state_dict().items()}
            dcp.save({"model": model.state_dict()}, storage_writer=writer, checkpoint_id="step_2")
            writer.wait_persisted(2, timeout=60)
            ema = writer.ema_state_dict()
            self.assertEqual(writer.ema_step, 2)
            self.assertEqual(sorted(ema), ["model.bias", "model.weight"])
            for k in w1:
                want = w1[k] * 0.5 + w2[k] * 0.5
                self.assertTrue(torch.allclose(ema["model." + k], want, rtol=0, atol=1e-6), k)
                self.assertFalse(torch.allclose(ema["model." + k], w2[k]), k)  # not merely the last weights
            with self.assertRaisesRegex(ValueError, "checkpoint_id is the step"):
                dcp.save({"model": model.state_dict()}, storage_writer=writer, checkpoint_id="/ckpt/latest")
        finally:
            writer.close()
        empty_job = self.daemon.job("none")
        empty = FlashckptReader(socket=self.daemon.socket, job=empty_job)
        try:
            # DCP drops read_metadata's error; the reader warns with it first.
            with self.assertRaises(CheckpointException):
                with self.assertWarnsRegex(RuntimeWarning, "NOT_FOUND.*job '%s' has no complete checkpoint" % empty_job):
                    dcp.load({"model": model.state_dict()}, storage_reader=empty)
        finally:
            empty.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        case, world, rank, rendezvous, sock, job, out = sys.argv[2:9]
        worker(case, int(world), int(rank), rendezvous, sock, job, out)
    else:
        unittest.main(verbosity=2)

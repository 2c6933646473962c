#!/usr/bin/python3
"""Checkpointer with DTensor states (torch 2): FSDP2, tensor parallelism and both, gloo on the CPU.

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
  one rank only, and the FSDP2 job resumes that checkpoint with the tensor-parallel job's values;
- 4 processes on a 2 x 2 mesh (tensor parallelism inside, FSDP2 across) save once through
  flashckpt and once through torch.distributed.checkpoint (DCP, the reference); flashckpt's
  checkpoint resumes on 2 x 2 with the uninterrupted run's losses, and on 4 x 1 (FSDP2 alone, one
  rank's shard of a layer empty) and 1 x 4 (tensor parallelism alone) with every tensor equal to the
  saved one and the next steps' losses equal, bit for bit, to those after DCP's load of its own
  checkpoint into the same mesh;
- an FSDP2 job that takes memory checkpoints (the disk's at step 2) and is SIGKILLed after step 3's,
  and then the daemon too, resumes step 3 from memory on both ranks (the new daemon adopted them),
  with the uninterrupted run's losses and the EMA of step 3 (the daemon's, decay 0.5);
- the daemon's EMA on a 2 x 2 mesh: every rank's ema_state_dict() holds every parameter's EMA as a
  DTensor placed like the parameter, the replicated bias (averaged by the daemon of the one rank that
  writes it) included, equal bit for bit to the EMA the worker computes from the full weights; the
  checkpoint resumes on 4 x 1 and 1 x 4 with that EMA, and the next update carries on from it;
- DCP with memory checkpoints on 2 x 2 (FlashckptWriter's tier: dcp.save of memory step 1 and disk
  step 2, dcp.async_save of memory step 3): after the processes die, every rank's daemon holds
  memory steps 3 and 1, and dcp.load with FlashckptReader (the latest) loads step 3 from memory on
  every rank (the replicated bias a rank does not write, and its own plain value, included), with
  the uninterrupted run's losses.
"""

import json
import os
import signal
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



def worker(case, layout, rank, world, rendezvous, sock, job, out):
    """One rank of `case` ("save", "resume" or "dcp_resume": the same resume through
    torch.distributed.checkpoint; "memory_save": memory checkpoints, the last kept in the daemon as
    the process dies, and "memory_resume") on mesh `layout`, "DxT": FSDP2 over D ranks, tensor
    parallelism over T ("1x1": a plain model in one process)."""
    import datetime
    import warnings

    # Not ours: torch's deprecation notes (DCP's use of TypedStorage, the pynvml that dlrover brings).
    warnings.filterwarnings("ignore", message=".*(TypedStorage|pynvml).*")

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from flashckpt.torch import Checkpointer

    torch.set_num_threads(1)
    dp, tp = (int(x) for x in layout.split("x"))
    assert dp * tp == world, (layout, world)
    if world > 1:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0 if case.endswith("save") else 7)  # a resume starts from other weights
    # 8 rows and columns split evenly over 2 and 4 tensor-parallel ranks (as torch's tensor
    # parallelism needs); FSDP2's shards of the second layer's 3 rows do not (2 + 1 on 2 ranks,
    # 1 + 1 + 1 + 0 on 4: one rank holds an empty shard).
    model = torch.nn.Sequential(torch.nn.Linear(7, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if dp > 1:
        fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank = rank // tp

    def batch(step):
        # Each data-parallel rank trains on batches of its own; its tensor-parallel ranks see the same.
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
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

    def placed(t):
        return [type(t).__name__, [repr(x) for x in getattr(t, "placements", ())]]

    def ema_full(ck, result, what):
        """ck.ema_state_dict() as full tensors; result[what] says whether every parameter's EMA is a
        tensor placed like the parameter, and which names it holds."""
        ema = ck.ema_state_dict()
        params = dict(model.named_parameters())
        result[what] = {"names": sorted(ema), "placed_as_params": all(placed(ema[n]) == placed(params[n].detach())
                                                                      for n in ema)}
        return {n: full(t) for n, t in ema.items()}

    def same(got, want):
        return sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)

    def ema_update(ema):
        """The daemon's EMA update (decay 0.5, the first update copies) applied to full tensors."""
        for n, p in model.named_parameters():
            w = full(p.detach()).float()
            ema[n] = w.clone() if n not in ema else 0.5 * ema[n] + 0.5 * w

    dcp_dir = os.path.join(os.path.dirname(out), job + ".dcp")  # the reference: DCP's checkpoint of the same step
    result = {"rank": rank}
    if case == "ema_save":
        # The EMA of steps 1..3 (decay 0.5; steps 1 and 2 are EMA updates only): every rank gets it
        # whole, replicated boxes included, from ema_state_dict().
        with Checkpointer(model, optimizer, socket=sock, job=job, ema_decay=0.5) as ck:
            want = {}
            for step in range(1, STEPS_BEFORE + 1):
                train([step])
                ck.save(step, persist=step == STEPS_BEFORE, extra={"layout": layout})
                ema_update(want)
            ck.wait_persisted(STEPS_BEFORE, timeout=60)
            got = ema_full(ck, result, "ema")
            result["ema_equal"] = same(got, want)
            if rank == 0:
                torch.save(got, out + ".ema.pt")
    elif case == "ema_resume":
        # The saved EMA comes back on this mesh (rank 0 keeps it in out.ema.pt) and carries on: step
        # 4's update is 0.5 * the restored EMA + 0.5 * step 4's weights.
        with Checkpointer(model, optimizer, socket=sock, job=job, ema_decay=0.5) as ck:
            result["step"] = ck.resume()
            want = ema_full(ck, result, "ema")
            if rank == 0:
                torch.save(want, out + ".ema.pt")
            train([STEPS_BEFORE + 1])
            ck.save(STEPS_BEFORE + 1, persist=False)
            ema_update(want)
            result["ema_equal"] = same(ema_full(ck, result, "ema_after"), want)
    elif case == "dcp_memory_save":
        # DCP through flashckpt with memory checkpoints: dcp.save at steps 1 (memory) and 2 (disk),
        # dcp.async_save at step 3 (memory); the process dies after step 3, the daemon keeps it.
        from flashckpt.dcp import FlashckptWriter
        writer = FlashckptWriter(socket=sock, job=job, memory_checkpoints=True)
        group = dist.new_group(backend="gloo")
        for step in range(1, STEPS_BEFORE + 1):
            train([step])
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "data": {"pos": 100 + rank}}
            writer.tier = "disk" if step == 2 else "memory"
            if step < STEPS_BEFORE:
                dcp.save(state, storage_writer=writer, checkpoint_id=step)
            else:
                dcp.async_save(state, storage_writer=writer, checkpoint_id=step, process_group=group).result(timeout=60)
            if step == 2:
                writer.wait_persisted(2, timeout=60)
    elif case == "dcp_memory_load":
        from flashckpt.dcp import FlashckptReader
        model_sd, optim_sd = get_state_dict(model, optimizer)  # gives the fresh optimizer its state
        state = {"model": model_sd, "optim": optim_sd, "data": {"pos": -1}}
        reader = FlashckptReader(socket=sock, job=job)
        dcp.load(state, storage_reader=reader)  # the latest: memory step 3, newer than the disk's 2
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        result.update(step=reader.step, tier=reader.tier, data=state["data"])
    elif case == "dcp_resume":
        model_sd, optim_sd = get_state_dict(model, optimizer)  # gives the fresh optimizer its state
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=dcp_dir)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    elif case == "memory_save":
        # Memory checkpoints every step but the disk's step 2; the process dies after step 3's, so
        # that the daemon keeps it.
        # The daemon's EMA (decay 0.5) is updated by every save; rank 0 keeps the EMA it computed
        # itself in out.ema.pt.
        ck = Checkpointer(model, optimizer, socket=sock, job=job, memory_checkpoints=True, ema_decay=0.5)
        want = {}
        for step in range(1, STEPS_BEFORE + 1):
            train([step])
            ck.save(step, extra={"layout": layout}, tier="disk" if step == 2 else "memory")
            ema_update(want)
            if step == 2:
                ck.wait_persisted(2, timeout=60)
        if rank == 0:
            torch.save(want, out + ".ema.pt")
    else:
        memory = case.startswith("memory")
        with Checkpointer(model, optimizer, socket=sock, job=job, memory_checkpoints=memory,
                          ema_decay=0.5 if memory else None) as ck:
            if case == "save":
                train(range(1, STEPS_BEFORE + 1))
                ck.save(STEPS_BEFORE, extra={"layout": layout})
                ck.wait_persisted(STEPS_BEFORE, timeout=60)
                # Whether this rank holds each tensor as a replica (written by another rank).
                result["replica"] = {n: bool(ck._layout.spec(n, shape).get("replica"))
                                     for n, (_, shape) in ck.client.registered.items()}
                if world > 1:
                    model_sd, optim_sd = get_state_dict(model, optimizer)
                    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=dcp_dir)
            else:
                result["step"] = ck.resume()
                result["extra"] = ck.extra
                result["tier"] = ck.resumed_tier
                if memory:  # the EMA of the memory checkpoint's step
                    ema = ema_full(ck, result, "ema")
                    if rank == 0:
                        torch.save(ema, out + ".ema.pt")
    tensors, result["kinds"] = dump()
    if rank == 0:
        torch.save(tensors, out + ".pt")
    if not case.startswith("ema"):
        result["losses"] = train(range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1))
    with open(out, "w") as f:
        json.dump(result, f)
    if case in ("memory_save", "dcp_memory_save"):
        os.kill(os.getpid(), signal.SIGKILL)  # no close(): the daemon keeps the memory checkpoints
    harness.end_worker()


class DTensorTest(harness.DaemonTestCase):
    def run_case(self, case, layout, job):
        """Runs the workers of `case` on mesh `layout` ("DxT"); returns their results (rank order)
        and rank 0's full tensors."""
        import torch
        dp, tp = (int(x) for x in layout.split("x"))
        world = dp * tp
        rendezvous = harness.rendezvous(self.daemon.tmp)
        outs = [os.path.join(self.daemon.tmp, "%s-%s-%s-%d.json" % (job, case, layout, r)) for r in range(world)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [harness.spawn(os.path.abspath(__file__), ["worker", case, layout, r, world, rendezvous,
                                                           self.daemon.socket, job, outs[r]], env=env)
                 for r in range(world)]
        self.assertTrue(harness.wait_all(procs, time.monotonic() + WORKER_DEADLINE),
                        "%s %s workers still running after %d s" % (case, layout, WORKER_DEADLINE))
        for r, p in enumerate(procs):
            want_rc = -signal.SIGKILL if case in ("memory_save", "dcp_memory_save") else 0
            self.assertEqual(p.returncode, want_rc, "%s %s rank %d exited %d" % (case, layout, r, p.returncode))
        results = []
        for path in outs:
            with open(path) as f:
                results.append(json.load(f))
        return results, torch.load(outs[0] + ".pt")

    def save(self, layout, job):
        """Runs the save on `layout`; checks the files hold every global element once; returns
        (results, full tensors)."""
        import flashckpt_reader as reader
        saved, want = self.run_case("save", layout, job)
        ckpt = os.path.join(self.daemon.job_dir(job), "checkpoint-%d" % STEPS_BEFORE)
        summary = reader.verify_checkpoint(ckpt, formula=False)  # raises for an element saved twice
        self.assertEqual(summary["elements"], sum(t.numel() for t in want.values()))
        return saved, want

    def resume(self, layout, job, want, case="resume"):
        resumed, got = self.run_case(case, layout, job)
        if case != "dcp_resume":
            for r in resumed:
                self.assertEqual(r["step"], STEPS_BEFORE)
        self.assert_tensors_equal(got, want, "%s on %s" % (case, layout))
        return resumed

    def assert_tensors_equal(self, got, want, what):
        import torch
        self.assertEqual(sorted(got), sorted(want), what)
        for name, t in want.items():
            self.assertEqual((got[name].dtype, tuple(got[name].shape)), (t.dtype, tuple(t.shape)), "%s: %s" % (what, name))
            self.assertTrue(torch.equal(got[name], t), "%s: %s differs" % (what, name))

    def test_fsdp2_saves_once_and_resumes_on_fsdp2_tp_and_one_process(self):
        job = self.daemon.job("fsdp")
        saved, want = self.save("2x1", job)
        for kinds in (r["kinds"] for r in saved):
            self.assertEqual(kinds["param.0.weight"], ["DTensor", ["Shard(dim=0)"]])
            self.assertEqual(kinds["state.2.weight.exp_avg"], ["DTensor", ["Shard(dim=0)"]])
        # AdamW's step counts, alike on both ranks, are each written by one.
        self.assertEqual(sorted(r["replica"]["optimizer.state.0.step"] for r in saved), [False, True])

        resumed = self.resume("2x1", job, want)
        for r in resumed:
            self.assertEqual(r["extra"], {"layout": "2x1"})
            self.assertEqual(r["kinds"], saved[r["rank"]]["kinds"])  # DTensors, placed as before
            self.assertEqual(r["losses"], saved[r["rank"]]["losses"], "rank %d's losses after the resume" % r["rank"])

        resumed = self.resume("1x2", job, want)
        self.assertEqual(resumed[0]["kinds"]["param.2.bias"], ["DTensor", ["Replicate()"]])
        resumed = self.resume("1x1", job, want)
        self.assertEqual(resumed[0]["kinds"]["param.0.weight"], ["Parameter", []])

    def test_tp_writes_replicated_boxes_once_and_resumes_on_fsdp2(self):
        job = self.daemon.job("tp")
        saved, want = self.save("1x2", job)
        # The replicated bias and its moments: each written by one of the two ranks.
        for name in ("model.2.bias", "optimizer.state.3.exp_avg", "optimizer.state.3.exp_avg_sq"):
            self.assertEqual(sorted(r["replica"][name] for r in saved), [False, True], name)
        self.resume("2x1", job, want)

    def test_memory_checkpoint_of_fsdp2(self):
        # Each rank's memory checkpoint holds its shards (and the step counts it does not write): the
        # ranks agree on the newest step all hold, newer than the disk's, and restore it from memory.
        job = self.daemon.job("memory")
        saved, want = self.run_case("memory_save", "2x1", job)
        # Once both ranks' memory checkpoints of the step are checksummed (restorable() waits for
        # that), the daemon is SIGKILLed too; the new one adopts them.
        import flashckpt
        for rank in range(2):
            with flashckpt.Client(self.daemon.socket, job, rank=rank, world_size=2) as c:
                self.assertEqual(c.restorable(timeout=30)[0][:1], [STEPS_BEFORE], "rank %d" % rank)
        self.daemon.proc.kill()
        self.daemon.proc.wait(timeout=30)
        self.daemon.start()
        resumed = self.resume("2x1", job, want, case="memory_resume")
        for r in resumed:
            self.assertEqual((r["tier"], r["extra"]), ("memory", {"layout": "2x1"}))
            self.assertEqual(r["losses"], saved[r["rank"]]["losses"], "rank %d's losses after the resume" % r["rank"])
            self.assertEqual(r["ema"], {"names": ["0.bias", "0.weight", "2.bias", "2.weight"],
                                        "placed_as_params": True}, "rank %d" % r["rank"])
        # The memory checkpoint held the EMA of its step (the daemon's, through a SIGKILL of it).
        self.assert_tensors_equal(self.ema_of("memory_resume", "2x1", job), self.ema_of("memory_save", "2x1", job),
                                  "the EMA resumed from memory")

    def test_dcp_memory_checkpoints_of_a_2d_mesh(self):
        # dcp.save / dcp.async_save with FlashckptWriter(tier) on 2 x 2: memory steps 1 and 3, the
        # disk's 2. Each rank's memory checkpoint holds all it loads (the replicated bias it does
        # not write, its own plain values); after the processes die, dcp.load with FlashckptReader
        # loads step 3 from memory on every rank, with the uninterrupted run's losses.
        job = self.daemon.job("dcpmem")
        saved, want = self.run_case("dcp_memory_save", "2x2", job)
        import flashckpt
        for rank in range(4):
            with flashckpt.Client(self.daemon.socket, job, rank=rank, world_size=4) as c:
                self.assertEqual(c.restorable(timeout=30), ([STEPS_BEFORE, 1], 2), "rank %d" % rank)
        loaded, got = self.run_case("dcp_memory_load", "2x2", job)
        self.assert_tensors_equal(got, want, "dcp.load from memory")
        for r in loaded:
            what = "rank %d" % r["rank"]
            self.assertEqual((r["step"], r["tier"]), (STEPS_BEFORE, "memory"), what)
            self.assertEqual(r["data"], {"pos": 100 + r["rank"]}, what)  # its own, kept in its memory
            self.assertEqual(r["losses"], saved[r["rank"]]["losses"], what + "'s losses after the load")

    def ema_of(self, case, layout, job):
        """Rank 0's full EMA tensors, as its worker of `case` kept them."""
        import torch
        return torch.load(os.path.join(self.daemon.tmp, "%s-%s-%s-0.json.ema.pt" % (job, case, layout)))

    def test_ema_is_placed_like_the_model_and_resumes_on_other_meshes(self):
        # FSDP2 over tensor parallelism on 2 x 2: the second layer's bias is replicated over the
        # tensor-parallel ranks and written (and averaged by the daemon) by one of them; every rank's
        # ema_state_dict() holds it all the same, as DTensors placed like the parameters.
        job = self.daemon.job("ema")
        names = ["0.bias", "0.weight", "2.bias", "2.weight"]
        saved, _ = self.run_case("ema_save", "2x2", job)
        for r in saved:
            self.assertEqual(r["ema"], {"names": names, "placed_as_params": True}, "rank %d" % r["rank"])
            self.assertTrue(r["ema_equal"], "rank %d: the EMA differs from the one it computed" % r["rank"])
        want = self.ema_of("ema_save", "2x2", job)
        for layout in ("4x1", "1x4"):
            resumed, _ = self.run_case("ema_resume", layout, job)
            for r in resumed:
                what = "%s rank %d" % (layout, r["rank"])
                self.assertEqual(r["step"], STEPS_BEFORE, what)
                self.assertEqual(r["ema"], {"names": names, "placed_as_params": True}, what)
                self.assertEqual(r["ema_after"], r["ema"], what)
                self.assertTrue(r["ema_equal"], "%s: the EMA did not carry on from the restored one" % what)
            self.assert_tensors_equal(self.ema_of("ema_resume", layout, job), want, "the EMA restored on " + layout)

    def test_2d_mesh_resumes_on_other_meshes_as_dcp_does(self):
        # FSDP2 over tensor parallelism on a 2 x 2 mesh, saved at once by flashckpt and by DCP.
        job = self.daemon.job("mesh2d")
        saved, want = self.save("2x2", job)
        resumed = self.resume("2x2", job, want)
        for r in resumed:
            self.assertEqual(r["kinds"], saved[r["rank"]]["kinds"])
            self.assertEqual(r["losses"], saved[r["rank"]]["losses"], "rank %d's losses after the resume" % r["rank"])
        # On another mesh the losses differ from the uninterrupted run's (other reductions): they must
        # equal those of the same resume done with torch.distributed.checkpoint, bit for bit.
        for layout in ("4x1", "1x4"):
            ours = self.resume(layout, job, want)
            reference = self.resume(layout, job, want, case="dcp_resume")
            for r, ref in zip(ours, reference):
                self.assertEqual(r["losses"], ref["losses"], "%s rank %d: losses after flashckpt's resume and DCP's"
                                 % (layout, r["rank"]))
                self.assertEqual(r["kinds"], ref["kinds"], "%s rank %d" % (layout, r["rank"]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        case, layout, rank, world, rendezvous, sock, job, out = sys.argv[2:10]
        worker(case, layout, int(rank), int(world), rendezvous, sock, job, out)
    else:
        unittest.main(verbosity=2)

#!/usr/bin/python3
"""flashckpt.torch.Checkpointer against a real flashckptd, in one process.

- the EMA returned by ema_state_dict() equals an EMA computed here over the same steps (numpy,
  fp32, the daemon's formula), bit for bit, with persisted and EMA-only saves and an interval; it
  also comes back for a model with an empty floating buffer (no address) and a 0-d parameter;
- parameters and optimizer moments modified right after save() returns do not change the saved
  checkpoint (the copy is done when save returns for CPU tensors);
- the layout is re-registered when Adam's state appears, and resume() into a fresh optimizer
  restores everything;
- with torch 2's optimizer step hooks, the optimizer's first step registers the layout with its
  Adam state and the client maps the slots' pages on its thread (smaps' Rss of the segment), so the
  first save registers nothing new; with two optimizers, once both have stepped; the hooks go with
  close() or with a Checkpointer dropped without it; a daemon gone by then makes that step warn, not
  raise, and the first save raises;
- a state dict whose structure changed between save and resume is a StructureMismatchError naming
  the first differing key, and leaves the model untouched;
- a non-contiguous parameter and an unsupported dtype are refused naming the state-dict key;
- a memory checkpoint with one byte flipped in shared memory is listed by resume()'s unverified
  restorable() but never handed over: the restore's own verification finds it, and resume() falls
  back to the disk checkpoint with a warning (the checkpoint is verified once, by the restore);
- resume(step) of a step the daemon holds in memory only restores it from there; of a step
  neither has, NotFoundError;
- a root that cannot be read makes resume() raise (IO_ERROR naming the path), never return None;
- wait_persisted() of one rank returns only once every rank's part is durable, and its timeout
  names the rank it waits for;
- a dict of states (a module under another key than "model", an optimizer, an LR scheduler, a
  GradScaler, a Stateful object of mixed types, a plain dict) is saved and resumed: training goes on
  with bit-identical losses, every value comes back with its type, the plain dict in place, the
  module's tensors in the model_state file and the others in the optimizer file.
"""

import gc
import glob
import json

import os
import sys
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import flashckpt  # noqa: E402
from flashckpt.torch import Checkpointer  # noqa: E402

torch.set_num_threads(1)


def mlp(hidden=16, extra_layer=False, seed=0):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4)]
    if extra_layer:
        layers += [torch.nn.ReLU(), torch.nn.Linear(4, 4)]
    return torch.nn.Sequential(*layers)


def step_once(model, optimizer, g):
    optimizer.zero_grad()
    loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def most_resident_shm(prefix):
    """(Rss, file bytes, path) of the mapping in this process of a /dev/shm file whose name starts with
    `prefix` that has the most bytes in its page tables ((-1, 0, None) when there is none)."""
    most, current = (-1, 0, None), None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line: range ... path
                path = fields[5] if len(fields) > 5 else ""
                current = path if path.startswith("/dev/shm/" + prefix) else None
            elif current and fields[0] == "Rss:":
                found = (int(fields[1]) * 1024, os.path.getsize(current) if os.path.exists(current) else 0, current)
                most = max(most, found, key=lambda m: m[0])
    return most


class CheckpointerTest(harness.DaemonTestCase):
    def checkpointer(self, model, optimizer, job, **kwargs):
        return Checkpointer(model, optimizer, socket=self.daemon.socket, job=job, **kwargs)

    def test_ema_matches_reference(self):
        decay, interval = 0.95, 2
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(0)
        ref = None
        d = np.float32(decay)
        with self.checkpointer(model, optimizer, self.daemon.job("ema"), ema_decay=decay, ema_interval=interval) as ck:
            with self.assertRaises(flashckpt.FailedPreconditionError):
                ck.ema_state_dict()  # no update yet
            for step in range(1, 16):
                step_once(model, optimizer, g)
                if step % 5 == 0:
                    ck.save(step, extra={"step": step})
                else:
                    ck.save(step, persist=False)
                if step % interval == 0:
                    x = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
                    ref = x if ref is None else {k: d * ref[k] + (np.float32(1) - d) * x[k] for k in ref}
            ema = ck.ema_state_dict()
            self.assertEqual(ck.ema_step, 14)
        self.assertEqual(sorted(ema), sorted(model.state_dict()))
        for k, v in ema.items():
            self.assertEqual(v.dtype, torch.float32)
            np.testing.assert_array_equal(v.numpy(), ref[k], err_msg=k)

    def test_ema_of_a_model_with_empty_and_0d_tensors(self):
        # An empty floating buffer has an EMA tensor of 0 bytes (torch gives it no address) and a 0-d
        # parameter one of 4: ema_state_dict() returns both, with the values of the other tensors.
        model = mlp()
        model.register_buffer("nothing", torch.zeros(0, 3))
        model.register_parameter("scale", torch.nn.Parameter(torch.tensor(0.25)))
        with self.checkpointer(model, None, self.daemon.job("emaempty"), ema_decay=0.5) as ck:
            ck.save(1)
            ema = ck.ema_state_dict()
        self.assertEqual(sorted(ema), sorted(model.state_dict()))
        self.assertEqual(tuple(ema["nothing"].shape), (0, 3))
        for k, v in model.state_dict().items():
            self.assertTrue(torch.equal(ema[k], v), k)  # the first update copies the weights

    def test_wait_persisted_waits_for_every_rank(self):
        # Two ranks of one job (each holding the whole model, as data-parallel ranks do today):
        # rank 0's wait_persisted is answered only when rank 1's part is written too, and its
        # timeout names the rank it waits for.
        job = self.daemon.job("waitall")
        models = [mlp(seed=1), mlp(seed=1)]
        cks = [self.checkpointer(m, None, job, rank=r, world_size=2, run_id="waitall-run")
               for r, m in enumerate(models)]
        try:
            cks[0].save(1)
            with self.assertRaises(flashckpt.DeadlineExceededError) as cm:
                cks[0].wait_persisted(1, timeout=0.5)
            self.assertIn("waiting for rank(s) 1", cm.exception.message)
            meta = os.path.join(self.daemon.job_dir(job), "checkpoint-1", "metadata.json")
            self.assertFalse(os.path.exists(meta))
            cks[1].save(1)
            cks[0].wait_persisted(1, timeout=30)
            self.assertTrue(os.path.exists(meta))
        finally:
            for ck in cks:
                ck.close()

    def test_modified_right_after_save(self):
        job = self.daemon.job("mutate")
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        with self.checkpointer(model, optimizer, job) as ck:
            self.assertIsNone(ck.resume())
            step_once(model, optimizer, g)
            ck.save(1)
            step_once(model, optimizer, g)
            expect_model = {k: v.clone() for k, v in model.state_dict().items()}
            expect_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()}
            ck.save(2)
            with torch.no_grad():  # the very next thing after save() returns
                for p in model.parameters():
                    p.add_(100.0)
                for s in optimizer.state.values():
                    s["exp_avg"].fill_(-1.0)
            ck.wait_persisted(2, timeout=30)
        model2 = mlp(seed=5)
        optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
        with self.checkpointer(model2, optimizer2, job) as ck2:
            self.assertEqual(ck2.resume(), 2)
        for k, v in model2.state_dict().items():
            self.assertTrue(torch.equal(v, expect_model[k]), k)
        for i, s in optimizer2.state_dict()["state"].items():
            for k, v in s.items():
                self.assertTrue(torch.equal(v, expect_opt[i][k]), "%s.%s" % (i, k))

    def test_structure_changed_names_first_key(self):
        job = self.daemon.job("structure")
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with self.checkpointer(model, optimizer, job) as ck:
            step_once(model, optimizer, torch.Generator().manual_seed(2))
            ck.save(1)
            ck.wait_persisted(1, timeout=30)

        def resume(model):
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            with self.checkpointer(model, opt, job) as ck:
                with self.assertRaises(flashckpt.StructureMismatchError) as cm:
                    ck.resume()
            for k, v in model.state_dict().items():
                self.assertTrue(torch.equal(v, before[k]), "model changed by a failed resume: %s" % k)
            return cm.exception

        e = resume(mlp(extra_layer=True))              # one more layer at the end
        self.assertEqual(e.key, "model.4.weight")
        self.assertIn("'model.4.weight'", str(e))
        self.assertIn("not in the checkpoint", str(e))
        self.assertIsInstance(e, ValueError)
        e = resume(mlp(hidden=32))                     # the first tensor changed shape
        self.assertEqual(e.key, "model.0.weight")
        self.assertIn("'model.0.weight'", str(e))
        # Same model, other optimizer: the optimizer's param_groups differ.
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        step_once(model, opt, torch.Generator().manual_seed(3))
        with self.checkpointer(model, opt, job) as ck:
            with self.assertRaises(flashckpt.StructureMismatchError) as cm:
                ck.resume()
        self.assertTrue(cm.exception.key.startswith("optimizer.state.0."), cm.exception.key)

    def test_reregisters_and_resumes_fresh_optimizer(self):
        job = self.daemon.job("fresh")
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with self.checkpointer(model, optimizer, job) as ck:
            ck.save(1)                       # before the first step: no Adam state yet
            n_before = len(ck.client.registered)
            step_once(model, optimizer, torch.Generator().manual_seed(4))
            ck.save(2)                       # exp_avg, exp_avg_sq and step appeared: new layout
            self.assertEqual(len(ck.client.registered), n_before + 3 * len(list(model.parameters())))
            ck.wait_persisted(2, timeout=30)
        model2 = mlp(seed=1)
        optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        with self.checkpointer(model2, optimizer2, job) as ck2:
            self.assertEqual(ck2.resume(), 2)
            self.assertEqual(optimizer2.param_groups[0]["lr"], 1e-2)
            self.assertEqual(len(optimizer2.state), len(list(model2.parameters())))
            ck2.save(3)                      # same layout as restored: no re-registration needed
        for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
            self.assertTrue(torch.equal(a, b), k)

    def test_the_first_step_prepares_the_first_save(self):
        if not hasattr(torch.optim.Optimizer, "register_step_post_hook"):
            self.skipTest("this torch has no optimizer step hooks (torch 2 has them)")
        job = self.daemon.job("prepared")
        model = mlp(hidden=4096)  # 0.6 MiB of weights and moments a slot: many pages
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(5)
        with self.checkpointer(model, optimizer, job) as ck:
            self.assertEqual(ck.client.registered, {})  # nothing to register before Adam's state exists
            step_once(model, optimizer, g)
            registered = ck.client.registered
            self.assertIn("optimizer.state.0.exp_avg", registered)
            self.assertIsNone(ck.prepare_error)
            self.assertIsNotNone(most_resident_shm("flashckpt.%s.0." % job)[2])  # mapped by the registration
            harness.wait_for(lambda: most_resident_shm("flashckpt.%s.0." % job)[0] >=
                             0.9 * most_resident_shm("flashckpt.%s.0." % job)[1], 20,
                             "the client's thread mapping the slots' pages (Rss, file bytes): %s"
                             % (most_resident_shm("flashckpt.%s.0." % job),))
            segment = most_resident_shm("flashckpt.%s.0." % job)[2]
            step_once(model, optimizer, g)
            ck.save(2)
            self.assertEqual(ck.client.registered, registered)
            self.assertEqual(most_resident_shm("flashckpt.%s.0." % job)[2], segment)  # the same segment
            ck.wait_persisted(2, timeout=30)
        self.assertEqual(len(optimizer._optimizer_step_post_hooks), 0)  # close() took the hook off

    def test_two_optimizers_prepare_once_both_stepped_and_the_hooks_hold_the_checkpointer_weakly(self):
        if not hasattr(torch.optim.Optimizer, "register_step_post_hook"):
            self.skipTest("this torch has no optimizer step hooks (torch 2 has them)")
        model = mlp()
        first = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
        second = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(7)
        with Checkpointer({"model": model, "first": first, "second": second}, socket=self.daemon.socket,
                          job=self.daemon.job("two-optimizers")) as ck:
            model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
            first.step()
            self.assertEqual(ck.client.registered, {})  # the second has no state yet: its layout would change
            second.step()
            self.assertIn("first.state.0.exp_avg", ck.client.registered)
            self.assertIn("second.state.0.exp_avg", ck.client.registered)
            self.assertIsNone(ck.prepare_error)
        self.assertEqual(len(first._optimizer_step_post_hooks), 0)
        # Dropped without close(): the optimizers do not keep it, and its hooks go with it.
        dropped = Checkpointer({"model": model, "first": first, "second": second}, socket=self.daemon.socket,
                               job=self.daemon.job("dropped"))
        self.assertEqual(len(first._optimizer_step_post_hooks), 1)
        del dropped
        gc.collect()
        self.assertEqual(len(first._optimizer_step_post_hooks), 0)
        self.assertEqual(len(second._optimizer_step_post_hooks), 0)

    def test_a_daemon_gone_before_the_first_step_warns_there_and_the_save_raises(self):
        if not hasattr(torch.optim.Optimizer, "register_step_post_hook"):
            self.skipTest("this torch has no optimizer step hooks (torch 2 has them)")
        with harness.Daemon() as daemon:
            model = mlp()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            ck = Checkpointer(model, optimizer, socket=daemon.socket, job=daemon.job("gone"), connect_timeout=0.5,
                              rpc_timeout=2.0)
            daemon.stop()
            with self.assertWarnsRegex(RuntimeWarning, "preparing the first save"):
                step_once(model, optimizer, torch.Generator().manual_seed(6))
            self.assertIsInstance(ck.prepare_error, flashckpt.FlashckptError)
            with self.assertRaises(flashckpt.FlashckptError):
                ck.save(1)
            ck.close()

    def test_a_corrupt_memory_checkpoint_is_found_by_the_restore_and_the_disk_used(self):
        job = self.daemon.job("memcorrupt")
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step_once(model, optimizer, torch.Generator().manual_seed(4))
        weight = model[0].weight
        with self.checkpointer(model, optimizer, job, memory_checkpoints=True) as ck:
            with torch.no_grad():
                weight.fill_(1.5)
            ck.save(1)
            ck.wait_persisted(1, timeout=30)
            with torch.no_grad():
                weight.fill_(2.5)
            ck.save(2, tier="memory")
            self.assertEqual(ck.client.restorable(timeout=30), ([2, 1], 1))  # checksummed, so kept
        # Flip one byte of step 2's weight (2.5 everywhere, found by its bytes) in the segment.
        pattern = np.full(weight.numel(), 2.5, np.float32).tobytes()
        segments = glob.glob("/dev/shm/flashckpt.%s.*" % job)
        self.assertEqual(len(segments), 1, segments)
        with open(segments[0], "r+b") as f:
            data = f.read()
            at = data.find(pattern)
            self.assertGreater(at, 0, "step 2's weight is not in the segment")
            self.assertEqual(data.find(pattern, at + 1), -1, "step 2's weight is in the segment twice")
            f.seek(at + 5)
            f.write(bytes([data[at + 5] ^ 0x01]))
        model2 = mlp(seed=1)
        optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        with self.checkpointer(model2, optimizer2, job, memory_checkpoints=True) as ck2:
            # Listed without being read; the verified listing drops it (and the rank's others).
            self.assertEqual(ck2.client.restorable(timeout=30, verify=False)[0], [2, 1])
            with self.assertWarnsRegex(RuntimeWarning, "memory checkpoint step 2 failed"):
                self.assertEqual(ck2.resume(), 1)
            self.assertEqual(ck2.resumed_tier, "disk")
            self.assertTrue(torch.equal(model2[0].weight, torch.full_like(weight, 1.5)))
            self.assertEqual(ck2.client.restorable(timeout=30, verify=False)[0], [])
        with open(self.daemon.log, errors="replace") as f:
            self.assertIn("failed its checksums", f.read())

    def test_resume_of_a_step_held_in_memory_only(self):
        job = self.daemon.job("memstep")
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(5)
        saved = {}
        with self.checkpointer(model, optimizer, job, memory_checkpoints=True) as ck:
            for step in (1, 2, 3):
                step_once(model, optimizer, g)
                ck.save(step, tier="disk" if step == 1 else "memory")
                saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            ck.wait_persisted(1, timeout=30)
        model2 = mlp(seed=1)
        optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        with self.checkpointer(model2, optimizer2, job, memory_checkpoints=True) as ck2:
            self.assertEqual(ck2.resume(step=2), 2)  # not on disk: from the daemon's memory
            self.assertEqual(ck2.resumed_tier, "memory")
            for k, v in model2.state_dict().items():
                self.assertTrue(torch.equal(v, saved[2][k]), k)
            with self.assertRaises(flashckpt.NotFoundError):
                ck2.resume(step=5)  # neither in memory nor on disk

    def test_unreadable_root_raises_instead_of_starting_over(self):
        job = self.daemon.job("unreadable")
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with self.checkpointer(model, optimizer, job) as ck:
            ck.save(1)
            ck.wait_persisted(1, timeout=30)
        # The job directory is replaced by a file (ENOTDIR below it): resume() must raise naming the
        # path, not return None (which a training script takes as "start from step 0").
        job_dir = self.daemon.job_dir(job)
        os.rename(job_dir, job_dir + ".moved")
        with open(job_dir, "w") as f:
            f.write("not a directory")
        model2 = mlp(seed=1)
        before = {k: v.clone() for k, v in model2.state_dict().items()}
        with self.checkpointer(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2), job) as ck2:
            with self.assertRaises(flashckpt.FlashckptError) as raised:
                ck2.resume()
        self.assertEqual(raised.exception.code, "IO_ERROR")
        self.assertIn(job_dir, raised.exception.message)
        for k, v in model2.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)  # nothing restored

    def test_bad_tensors_name_the_key(self):
        model = mlp()
        with torch.no_grad():
            model[0].weight.data = model[0].weight.data.t().contiguous().t()   # same shape, transposed strides
        with self.checkpointer(model, None, self.daemon.job("badparam")) as ck:
            with self.assertRaisesRegex(ValueError, r"tensor 'model\.0\.weight' is not contiguous"):
                ck.save(1)
        model = mlp()
        model.register_buffer("phase", torch.zeros(3, dtype=torch.complex64))
        with self.checkpointer(model, None, self.daemon.job("baddtype")) as ck:
            with self.assertRaisesRegex(TypeError, r"tensor 'model\.phase' has dtype complex64"):
                ck.save(1)


class Counter:
    """A Stateful object holding a mix of types, as a data loader's or a trainer's own state does."""

    def __init__(self, seed):
        self.seen, self.mean, self.window, self.history = seed, float(seed) / 3, (seed, "x"), torch.full((3,), seed)

    def state_dict(self):
        return {"seen": self.seen, "mean": self.mean, "window": self.window, "history": self.history}

    def load_state_dict(self, state):
        self.seen, self.mean, self.window = state["seen"], state["mean"], state["window"]
        self.history = state["history"]


def safetensors_keys(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return sorted(k for k in json.loads(f.read(n)) if k != "__metadata__")


class StatesTest(harness.DaemonTestCase):
    def states(self, seed):
        model = mlp(seed=seed)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2 * (seed + 1))
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
        return {"net": model, "optim": optim, "sched": sched,
                "scaler": torch.cuda.amp.GradScaler(enabled=False), "counter": Counter(seed),
                "data": {"epoch": seed, "order": (seed, 1, 2), "perm": torch.arange(5) * seed}}

    def train(self, states, g, steps):
        losses = []
        for _ in range(steps):
            losses.append(step_once(states["net"], states["optim"], g))
            states["sched"].step()
            states["counter"].seen += 1
            states["data"]["epoch"] += 1
        return losses

    def test_dict_of_states_resumes_every_value(self):
        job = self.daemon.job("states")
        states = self.states(seed=0)
        g = torch.Generator().manual_seed(5)
        with Checkpointer(states, socket=self.daemon.socket, job=job, ema_decay=0.5) as ck:
            self.assertIs(ck.model, states["net"])
            self.assertIs(ck.optimizer, states["optim"])
            self.train(states, g, 4)
            states["counter"].window = (7, "y")
            ck.save(4)
            ck.wait_persisted(4, timeout=30)
            self.assertEqual(sorted(ck.ema_state_dict()), sorted(states["net"].state_dict()))
        saved_generator = g.get_state()
        reference = self.train(states, g, 3)

        fresh = self.states(seed=1)
        data = fresh["data"]
        with Checkpointer(fresh, socket=self.daemon.socket, job=job) as ck2:
            self.assertEqual(ck2.resume(), 4)
        self.assertIs(fresh["data"], data)  # the plain dict is refilled in place
        self.assertEqual(data["epoch"], 4)
        self.assertEqual(data["order"], (0, 1, 2))
        self.assertTrue(torch.equal(data["perm"], torch.arange(5) * 0))
        c = fresh["counter"]
        self.assertEqual((c.seen, c.mean, c.window), (4, 0.0, (7, "y")))
        self.assertIsInstance(c.window, tuple)
        self.assertEqual(fresh["sched"].state_dict(), {**states["sched"].state_dict(), "last_epoch": 4,
                                                       "_step_count": 5, "_last_lr": [2.5e-3]})
        g.set_state(saved_generator)
        self.assertEqual(self.train(fresh, g, 3), reference)  # bit-identical losses

        step_dir = os.path.join(self.daemon.job_dir(job), "checkpoint-4")
        files = sorted(os.listdir(step_dir))
        model_file = next(f for f in files if f.startswith("model_state."))
        optim_file = next(f for f in files if f.startswith("optimizer."))
        self.assertEqual(safetensors_keys(os.path.join(step_dir, model_file)),
                         sorted("net." + k for k in states["net"].state_dict()))
        optim_keys = safetensors_keys(os.path.join(step_dir, optim_file))
        self.assertIn("counter.history", optim_keys)
        self.assertIn("data.perm", optim_keys)
        self.assertIn("optim.state.0.exp_avg", optim_keys)

    def test_dict_of_states_bad_arguments(self):
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with self.assertRaisesRegex(TypeError, "inside the dict of states"):
            Checkpointer({"model": model}, optimizer, socket=self.daemon.socket, job=self.daemon.job("bad1"))
        with self.assertRaisesRegex(ValueError, "without '.'"):
            Checkpointer({"my.model": model}, socket=self.daemon.socket, job=self.daemon.job("bad2"))
        with self.assertRaisesRegex(ValueError, "empty"):
            Checkpointer({}, socket=self.daemon.socket, job=self.daemon.job("bad3"))
        with Checkpointer({"model": model, "fn": {"f": len}}, socket=self.daemon.socket,
                          job=self.daemon.job("bad4")) as ck:
            with self.assertRaisesRegex(TypeError, "fn.f"):
                ck.save(1)
        with Checkpointer(model, optimizer, socket=self.daemon.socket, job=self.daemon.job("bad5"),
                          shard_specs={"module.0.weight": (0, 0, 2)}) as ck:
            with self.assertRaisesRegex(ValueError, "shard_specs names 'module.0.weight', which is no model state-dict "
                                                    "key \\(they are like '0.bias'\\)"):
                ck.save(1)


if __name__ == "__main__":
    unittest.main(verbosity=2)

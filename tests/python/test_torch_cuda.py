#!/usr/bin/python3
"""flashckpt.torch.Checkpointer with CUDA tensors, against a real flashckptd (ctest label gpu).

Skipped, saying why, where torch sees no CUDA device or libflashckpt has no CUDA compiled in. On a
GPU machine:
- a model and AdamW on the device, beside a CPU tensor among the states, are saved and resumed into
  fresh device tensors bit for bit, and stay on the device;
- save() returns while a long kernel queued before it on torch's current stream is still running,
  and the checkpoint holds the values that kernel's stream wrote (the copies wait for that work,
  the caller does not);
- a restore of the model kind only, with a CPU tensor of another kind before the CUDA one, fills
  the CUDA tensor and leaves the CPU one alone;
- ema_state_dict() comes back in device memory, equal to the weights after the first update.
"""

import os
import sys
import time
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import torch  # noqa: E402

from flashckpt.torch import Checkpointer  # noqa: E402

SKIP = harness.cuda_skip_reason()


def host(tensors):
    return {k: v.detach().cpu().clone() for k, v in tensors.items()}


def full_state(model, optimizer):
    out = {"param." + n: p for n, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for field, v in optimizer.state.get(p, {}).items():
            if torch.is_tensor(v):
                out["state.%d.%s" % (i, field)] = v
    return out


@unittest.skipIf(SKIP is not None, SKIP or "")
class CudaCheckpointTest(harness.DaemonTestCase):
    def make(self, seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(self, model, optimizer, steps):
        g = torch.Generator(device="cuda").manual_seed(3)
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(32, 256, device="cuda", generator=g)).pow(2).mean().backward()
            optimizer.step()

    def test_device_state_saves_and_resumes_bit_exact(self):
        job = self.daemon.job("cuda")
        model, optimizer = self.make(0)
        table = torch.arange(1000, dtype=torch.int64)  # a CPU tensor among the states
        self.train(model, optimizer, 2)
        with Checkpointer({"model": model, "optim": optimizer, "table": table}, socket=self.daemon.socket,
                          job=job) as ck:
            snap = ck.save(2)
            self.assertTrue(snap.on_device)
            ck.wait_copied()
            saved = host(full_state(model, optimizer))
            devices = {k: v.device.type for k, v in full_state(model, optimizer).items()}
            self.train(model, optimizer, 1)  # changes the device tensors once the copies are done
            ck.wait_persisted(2, timeout=60)

        fresh, fresh_opt = self.make(1)
        states = {"model": fresh, "optim": fresh_opt, "table": torch.zeros(1000, dtype=torch.int64)}
        with Checkpointer(states, socket=self.daemon.socket, job=job) as ck:
            self.assertEqual(ck.resume(), 2)
            restored_table = ck.states["table"]
        got = full_state(fresh, fresh_opt)
        self.assertEqual(sorted(got), sorted(saved))
        self.assertIn("cuda", devices.values())
        for name, t in got.items():
            self.assertEqual(t.device.type, devices[name], name)  # Adam's step counts stay on the CPU
            self.assertTrue(torch.equal(t.cpu(), saved[name]), name)
        self.assertEqual(restored_table.device.type, "cpu")
        self.assertTrue(torch.equal(restored_table, table))

    def test_save_returns_before_the_queued_kernel_and_copies_what_it_wrote(self):
        job = self.daemon.job("overlap")
        x = torch.zeros(16 << 20, device="cuda")  # 64 MiB
        a = torch.randn(4096, 4096, device="cuda")
        with Checkpointer({"x": x}, socket=self.daemon.socket, job=job) as ck:
            ck.save(1)  # registers the layout and pins the slots
            ck.wait_copied()
            torch.cuda.synchronize()

            def kernel():
                for _ in range(100):
                    a.copy_(torch.tanh(a @ a))
            started = time.perf_counter()
            kernel()
            torch.cuda.synchronize()
            alone = time.perf_counter() - started

            kernel()
            x.fill_(7.0)  # queued behind the kernel
            started = time.perf_counter()
            snap = ck.save(2)
            blocked = time.perf_counter() - started
            still_running = not torch.cuda.current_stream().query()
            ck.wait_copied()
            copied = time.perf_counter() - started
            ck.wait_persisted(2, timeout=60)
            print("kernel alone %.1f ms; save() blocked %.3f ms, copies done after %.1f ms"
                  % (alone * 1e3, blocked * 1e3, copied * 1e3))
            self.assertTrue(still_running, "save() returned only after the kernel queued before it had finished "
                            "(blocked %.1f ms, kernel %.1f ms)" % (blocked * 1e3, alone * 1e3))
            self.assertLess(snap.seconds, alone)
        back = torch.zeros_like(x)
        with Checkpointer({"x": back}, socket=self.daemon.socket, job=job) as ck:
            self.assertEqual(ck.resume(), 2)
            back = ck.states["x"]
        self.assertEqual(back.device.type, "cuda")
        self.assertTrue(bool((back == 7.0).all()), "the checkpoint does not hold what the stream wrote before save()")

    def test_a_restore_of_some_kinds_copies_each_tensor_where_it_lives(self):
        import flashckpt
        job = self.daemon.job("kinds")
        opt = torch.arange(4096, dtype=torch.float32)
        weight = torch.arange(8192, dtype=torch.float32, device="cuda") * 3
        specs = {"a_opt": {"kind": "optimizer"}, "b_model": {"kind": "model"}}
        with flashckpt.Client(self.daemon.socket, job=job) as c:
            c.register({"a_opt": opt, "b_model": weight}, specs)
            c.snapshot(1, {"a_opt": opt, "b_model": weight}).wait_copied()
            c.wait_persisted(1, timeout=60)
        opt_back = torch.full_like(opt, -1.0)
        weight_back = torch.zeros_like(weight)
        with flashckpt.Client(self.daemon.socket, job=job) as c:
            c.register({"a_opt": opt_back, "b_model": weight_back}, specs)
            step, _ = c.restore({"a_opt": opt_back, "b_model": weight_back}, kinds=["model"])
        self.assertEqual(step, 1)
        self.assertTrue(torch.equal(weight_back, weight))
        self.assertTrue(bool((opt_back == -1.0).all()), "a tensor of another kind was overwritten")

    def test_ema_comes_back_in_device_memory(self):
        job = self.daemon.job("ema")
        model, optimizer = self.make(0)
        self.train(model, optimizer, 1)
        with Checkpointer(model, optimizer, socket=self.daemon.socket, job=job, ema_decay=0.5) as ck:
            ck.save(1)
            ck.wait_persisted(1, timeout=60)
            ema = ck.ema_state_dict()
        weights = model.state_dict()
        self.assertEqual(sorted(ema), sorted(weights))
        for name, t in ema.items():
            self.assertEqual(t.device, weights[name].device, name)
            self.assertTrue(torch.equal(t, weights[name].float()), name)  # the first update copies the weights


if __name__ == "__main__":
    unittest.main(verbosity=2)

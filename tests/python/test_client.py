#!/usr/bin/python3
"""flashckpt.Client against a real flashckptd: numpy and torch tensors, every dtype, bad input.

- snapshot + restore round-trip every supported dtype (numpy and torch, 0-d and empty tensors) and
  the extra state;
- a tensor modified right after snapshot() returns does not change the snapshot;
- the daemon's EMA equals one computed here in numpy, bit for bit;
- a non-contiguous tensor and an unsupported dtype are refused with errors naming the tensor; a
  daemon that is not running is a DaemonUnavailableError naming the socket, within the deadline;
  unregistered tensors, changed shapes, a closed client are clear errors; status() is a dict;
- a save that fails on disk (a directory where a file must go: rename fails with EISDIR) raises from
  wait_persisted() naming step, file and errno; by default snapshots go on, with
  fatal_persist_errors=True the next snapshot() raises that error;
- run_id is recorded in metadata.json; a new run that does not restore may not save into a job with
  another run's checkpoints unless overwrite=True; wait_complete() waits for the whole checkpoint;
- tier="memory": a memory checkpoint outlives its trainer, restorable() and memory_extra() list it
  before register(), restore() serves it (restored_tier "memory"), and a disk step newer than it wins;
  memory_checkpoints=True is refused at register() where the daemon cannot keep them (EMA tensors).
"""

import array
import os
import sys
import time
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import flashckpt  # noqa: E402


class ClientTest(harness.DaemonTestCase):
    def client(self, name, **kwargs):
        return flashckpt.Client(self.daemon.socket, self.daemon.job(name), **kwargs)

    def test_memory_checkpoints_outlive_the_trainer(self):
        job = self.daemon.job("memory")
        w = np.zeros(1000, np.float32)
        with flashckpt.Client(self.daemon.socket, job) as c:
            c.register({"w": w})
            with self.assertRaisesRegex(ValueError, "tier"):
                c.snapshot(1, {"w": w}, tier="ram")
            w[:] = 1
            c.snapshot(1, {"w": w})
            c.wait_persisted(1, timeout=30)
            for step in (2, 3):
                w[:] = step
                snap = c.snapshot(step, {"w": w}, extra={"step": step}, tier="memory")
                self.assertEqual(snap.tier, "memory")
            with self.assertRaises(flashckpt.FailedPreconditionError):
                c.wait_persisted(3, timeout=30)  # never written
        self.assertFalse(os.path.exists(os.path.join(self.daemon.job_dir(job), "checkpoint-3")))
        with flashckpt.Client(self.daemon.socket, job) as c:
            self.assertEqual(c.restorable(timeout=30), ([3, 2], 1))  # before register()
            self.assertEqual(c.memory_extra(2, timeout=30), b'{"step":2}')
            self.assertIsNone(c.memory_extra(1, timeout=30))  # on disk only
            out = np.zeros(1000, np.float32)
            c.register({"w": out})
            self.assertEqual(c.restore({"w": out}), (3, b'{"step":3}'))
            self.assertEqual(c.restored_tier, "memory")
            np.testing.assert_array_equal(out, np.full(1000, 3, np.float32))
            self.assertEqual(c.restore({"w": out}, step=1)[0], 1)
            self.assertEqual(c.restored_tier, "disk")
        # A rank with the daemon's EMA takes them too, each with the EMA of its step: restoring step 1
        # brings back step 1's EMA (the first update copies the weights), not step 2's (0.5*1 + 0.5*3).
        ema_job = self.daemon.job("memory-ema")
        with flashckpt.Client(self.daemon.socket, ema_job, ema_decay=0.5, memory_checkpoints=True) as c:
            c.register({"w": w})
            for step, value in ((1, 1), (2, 3)):
                w[:] = value
                c.snapshot(step, {"w": w}, tier="memory")
        with flashckpt.Client(self.daemon.socket, ema_job, ema_decay=0.5, memory_checkpoints=True) as c:
            c.register({"w": w})
            self.assertEqual(c.restore({"w": w}, step=1)[0], 1)
            self.assertEqual(c.restored_tier, "memory")
            step, ema = c.ema({"w": np.zeros(1000, np.float32)}, timeout=30)
            self.assertEqual(step, 1)
            np.testing.assert_array_equal(ema["w"], np.full(1000, 1, np.float32))

    def test_every_dtype_round_trips(self):
        rng = np.random.default_rng(1)
        tensors = {
            "np.f64": rng.standard_normal((3, 5)),
            "np.f32": rng.standard_normal((7,)).astype(np.float32),
            "np.f16": rng.standard_normal((2, 2)).astype(np.float16),
            "np.i64": rng.integers(-2**40, 2**40, (4,)),
            "np.i32": rng.integers(-1000, 1000, (2, 3), dtype=np.int32),
            "np.i16": rng.integers(-1000, 1000, (5,), dtype=np.int16),
            "np.i8": rng.integers(-100, 100, (6,), dtype=np.int8),
            "np.u8": rng.integers(0, 255, (9,), dtype=np.uint8),
            "np.bool": rng.integers(0, 2, (4,)).astype(bool),
            "np.scalar": np.array(3.25, dtype=np.float32),
            "np.empty": np.zeros((0, 4), np.float32),
            "torch.bf16": torch.randn(3, 4).to(torch.bfloat16),
            "torch.f32": torch.randn(2, 3, 4),
            "torch.bool": torch.tensor([True, False, True]),
            "torch.i64": torch.arange(10),
            "torch.scalar": torch.tensor(7, dtype=torch.int32),
            "buffer.f32": array.array("f", [1.5, -2.0, 3.25]),   # the buffer protocol, no DLPack
        }
        with self.client("dtypes") as c:
            c.register(tensors, specs={"torch.f32": {"kind": "optimizer"}})
            self.assertEqual(c.registered["torch.bf16"], ("BF16", (3, 4)))
            self.assertEqual(c.restore(tensors), (None, None))  # no checkpoint yet: untouched
            c.snapshot(1, tensors, extra={"epoch": 3, "name": "x"})
            c.wait_persisted(1, timeout=30)
            out = {n: (np.zeros_like(t) if isinstance(t, np.ndarray) else
                       array.array(t.typecode, bytes(len(t) * t.itemsize)) if isinstance(t, array.array) else
                       torch.zeros_like(t))
                   for n, t in tensors.items()}
            step, extra = c.restore(out)
        self.assertEqual(step, 1)
        self.assertEqual(extra, b'{"epoch":3,"name":"x"}')
        for n, t in tensors.items():
            if isinstance(t, (np.ndarray, array.array)):
                np.testing.assert_array_equal(out[n], t, err_msg=n)
            else:
                self.assertTrue(torch.equal(out[n], t), n)

    def test_restore_narrows_fp32_to_bf16_and_fp16_only_when_asked(self):
        w = torch.randn(64, 33) * 1000   # fp32 values that bf16 and fp16 must round
        w[0, :4] = torch.tensor([float("inf"), float("nan"), 1e6, -0.0])  # fp16 overflow: inf
        job = self.daemon.job("narrow")
        with flashckpt.Client(self.daemon.socket, job) as c:
            c.register({"w": w})
            c.snapshot(1, {"w": w})
            c.wait_persisted(1, timeout=30)
        for dtype in (torch.bfloat16, torch.float16):
            with flashckpt.Client(self.daemon.socket, job) as c:
                out = torch.zeros(64, 33, dtype=dtype)
                c.register({"w": out})
                with self.assertRaises(flashckpt.FlashckptError) as err:
                    c.restore({"w": out})
                self.assertIn("dtype conversion", str(err.exception))
                self.assertEqual(c.restore({"w": out}, convert_dtype=True)[0], 1)
            # torch's own conversion rounds to nearest even too: the bits must agree.
            want = w.to(dtype)
            same = (out.view(torch.int16) == want.view(torch.int16)) | (out.isnan() & want.isnan())
            self.assertTrue(bool(same.all()), dtype)

    def test_tensor_modified_after_snapshot_returns(self):
        a = np.full((1 << 20,), 1.5, np.float32)   # 4 MiB
        b = torch.full((1 << 19,), 2.5, dtype=torch.float64)
        with self.client("mutate") as c:
            c.register({"a": a, "b": b})
            for step in (1, 2):
                snap = c.snapshot(step, {"a": a, "b": b})
                snap.wait_copied()
                expect_a, expect_b = a.copy(), b.clone()
                a += 1.0       # the very next thing after snapshot() returns
                b.mul_(-1)
                c.wait_persisted(step, timeout=30)
                ra, rb = np.zeros_like(a), torch.zeros_like(b)
                self.assertEqual(c.restore({"a": ra, "b": rb}, step=step)[0], step)
                np.testing.assert_array_equal(ra, expect_a)
                self.assertTrue(torch.equal(rb, expect_b))

    def test_ema_matches_numpy(self):
        decay, interval = 0.9, 2
        w = np.zeros((64, 33), np.float32)
        m = torch.zeros(17)                      # fp32 model tensor: averaged too
        ids = np.zeros(5, np.int64)              # not a float: no EMA
        rng = np.random.default_rng(3)
        with self.client("ema", ema_decay=decay, ema_interval=interval) as c:
            c.register({"w": w, "m": m, "ids": ids})
            self.assertEqual(sorted(c.ema_names), ["m", "w"])
            step, _ = c.ema()
            self.assertIsNone(step)
            ref = None
            d = np.float32(decay)
            for step in range(1, 12):
                w[:] = rng.standard_normal(w.shape).astype(np.float32)
                m.copy_(torch.randn(17))
                c.snapshot(step, {"w": w, "m": m, "ids": ids}, persist=step == 6)
                if step % interval == 0:
                    x = {"w": w.copy(), "m": m.numpy().copy()}
                    if ref is None:
                        ref = x  # ema_init="first"
                    else:
                        ref = {k: d * ref[k] + (np.float32(1) - d) * x[k] for k in ref}
            step, ema = c.ema()
        self.assertEqual(step, 10)
        np.testing.assert_array_equal(ema["w"], ref["w"])
        np.testing.assert_array_equal(ema["m"], ref["m"])

    def test_non_contiguous_is_refused(self):
        with self.client("noncontig") as c:
            with self.assertRaisesRegex(ValueError, r"tensor 'wt' is not contiguous .*\.contiguous\(\)"):
                c.register({"wt": torch.zeros(4, 6).t()})
            with self.assertRaisesRegex(ValueError, r"tensor 'strided' is not contiguous"):
                c.register({"strided": np.zeros((4, 6), np.float32)[:, ::2]})
            good = torch.zeros(6, 4)
            c.register({"w": good})
            with self.assertRaisesRegex(ValueError, r"tensor 'w' is not contiguous"):
                c.snapshot(1, {"w": torch.zeros(4, 6).t()})

    def test_unsupported_dtype_is_refused(self):
        with self.client("dtype") as c:
            for name, t, dtype in [("c64", torch.zeros(3, dtype=torch.complex64), "complex64"),
                                   ("u16", np.zeros(3, np.uint16), "uint16"),
                                   ("c128", np.zeros(3, np.complex128), "complex128")]:
                with self.assertRaisesRegex(TypeError, r"tensor '%s' has dtype %s, which flashckpt does not store"
                                            % (name, dtype)):
                    c.register({name: t})
            with self.assertRaisesRegex(TypeError, r"tensor 'x': object of type list is not a tensor"):
                c.register({"x": [1, 2]})

    def test_one_version_everywhere(self):
        """The package, flashckptd and the flashckpt CLI report the project's one version string."""
        import re
        import subprocess
        with open(os.path.join(harness.REPO, "CMakeLists.txt")) as f:
            project = re.search(r"project\(flashckpt VERSION (\S+)", f.read()).group(1)
        self.assertEqual(flashckpt.__version__, project)
        for program in ("flashckptd", "flashckpt"):
            out = subprocess.run([os.path.join(harness.BIN_DIR, program), "--version"], stdout=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, timeout=30).stdout.decode()
            self.assertTrue(out.startswith("%s %s (" % (program, project)), out)

    def test_daemon_not_running(self):
        missing = os.path.join(self.daemon.tmp, "nobody-here.sock")
        started = time.monotonic()
        with self.assertRaises(flashckpt.DaemonUnavailableError) as cm:
            flashckpt.Client(missing, "nobody", connect_timeout=1.0)
        elapsed = time.monotonic() - started
        self.assertIn(missing, str(cm.exception))
        self.assertIn("no socket file exists", str(cm.exception))
        self.assertIsInstance(cm.exception, ConnectionError)
        self.assertLess(elapsed, 5.0)

    def test_layout_errors(self):
        w = np.zeros((2, 3), np.float32)
        with self.client("layout") as c:
            with self.assertRaisesRegex(ValueError, "register"):
                c.snapshot(1, {"w": w})
            c.register({"w": w, "b": np.zeros(3, np.float32)})
            with self.assertRaisesRegex(ValueError, r"tensor 'zz' given to snapshot\(\) was not registered"):
                c.snapshot(1, {"w": w, "zz": w})
            with self.assertRaisesRegex(ValueError, r"tensor 'w' given to snapshot\(\) is float32 \(3, 2\) but was "
                                                    r"registered as float32 \(2, 3\)"):
                c.snapshot(1, {"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32)})
            with self.assertRaisesRegex(ValueError, r"tensor 'b' is registered but was not given to snapshot\(\)"):
                c.snapshot(1, {"w": w})
            with self.assertRaisesRegex(ValueError, "read-only"):
                ro = np.zeros(3, np.float32)
                ro.flags.writeable = False
                c.restore({"w": w, "b": ro})
            with self.assertRaisesRegex(ValueError, "kind must be one of"):
                c.register({"w": w}, specs={"w": {"kind": "weights"}})
            with self.assertRaises(flashckpt.InvalidArgumentError):
                c.register({"bad\"name": w})

    def failing_save(self, c, step):
        """Saves `step` with a directory where the rank's signal file must go: the save fails."""
        blocker = os.path.join(self.daemon.job_dir(c.job), "checkpoint-%d" % step, "saved_signal_0", "x")
        os.makedirs(blocker)
        t = {"w": np.full(4, step, np.float32)}
        c.snapshot(step, t)
        with self.assertRaises(flashckpt.FlashckptError) as cm:
            c.wait_persisted(step, timeout=30)
        e = cm.exception
        self.assertEqual(e.code, "IO_ERROR")
        self.assertIn("saving step %d of job '%s' failed" % (step, c.job), e.message)
        self.assertIn("/checkpoint-%d/saved_signal_0" % step, e.message)
        self.assertIn("Is a directory (errno 21)", e.message)
        self.assertEqual(sorted(os.listdir(os.path.dirname(os.path.dirname(blocker)))), ["saved_signal_0"],
                         "the rank's other files of the step were removed")
        return e

    def test_failed_save_is_reported_and_snapshots_go_on(self):
        w = np.zeros(4, np.float32)
        with self.client("failed-save") as c:
            c.register({"w": w})
            c.snapshot(1, {"w": w})
            c.wait_persisted(1, timeout=30)
            self.failing_save(c, 2)
            rank = c.status()["jobs"]
            rank = [j for j in rank if j["job"] == c.job][0]["ranks"][0]
            self.assertEqual(rank["failures"], "1")  # 64-bit integers are JSON strings
            self.assertIn("step 2: IO_ERROR: rename ", rank["last_error"])
            self.assertEqual(rank["oldest_write_seconds"], 0)  # nothing being written
            c.snapshot(3, {"w": w})
            c.wait_persisted(3, timeout=30)

    def test_fatal_persist_errors_stop_snapshots_after_a_failed_save(self):
        w = np.zeros(4, np.float32)
        with self.client("fatal", fatal_persist_errors=True) as c:
            c.register({"w": w})
            c.snapshot(1, {"w": w})
            c.wait_persisted(1, timeout=30)
            self.failing_save(c, 2)
            for step in (3, 4):
                with self.assertRaises(flashckpt.FlashckptError) as cm:
                    c.snapshot(step, {"w": w})
                self.assertEqual(cm.exception.code, "IO_ERROR")
                self.assertIn("saving step 2 of job '%s' failed" % c.job, cm.exception.message)
                self.assertIn("Is a directory (errno 21)", cm.exception.message)
                self.assertIn("fatal_persist_errors", cm.exception.message)
            self.assertFalse(os.path.exists(os.path.join(self.daemon.job_dir(c.job), "checkpoint-3")))

    def test_runs_lineage_and_wait_complete(self):
        w = np.full(4, 1.0, np.float32)
        with self.client("lineage", run_id="sched-41") as c:
            c.register({"w": w})
            self.assertEqual(c.run_id, "sched-41")
            c.snapshot(1, {"w": w})
            c.wait_complete(1, timeout=30)
            meta = os.path.join(self.daemon.job_dir(c.job), "checkpoint-1", "metadata.json")
            with open(meta) as f:
                self.assertIn('"run_id":"sched-41"', f.read().replace(" ", ""))
            job = c.job
        # A new run (the daemon draws its id) that does not restore is refused, naming the way out.
        with flashckpt.Client(self.daemon.socket, job) as fresh:
            fresh.register({"w": w})
            self.assertNotIn(fresh.run_id, ("", "sched-41"))
            with self.assertRaises(flashckpt.FailedPreconditionError) as cm:
                fresh.snapshot(2, {"w": w})
            self.assertIn("already has complete checkpoints", cm.exception.message)
            self.assertIn("overwrite=True", cm.exception.message)
        # overwrite=True starts a new lineage: the other run's checkpoint goes.
        with flashckpt.Client(self.daemon.socket, job, overwrite=True) as over:
            over.register({"w": w})
            over.snapshot(2, {"w": w})
            over.wait_complete(2, timeout=30)
            self.assertFalse(os.path.exists(os.path.join(self.daemon.job_dir(job), "checkpoint-1")))
        with self.assertRaises(flashckpt.FlashckptError):
            self.client("bad-run", run_id="not a run id").register({"w": w})

    def test_a_split_step_is_raised_at_the_next_save_and_wait(self):
        # Two tp ranks of one run save step 5; rank 1 restores it and both save step 10 again: the
        # step's ranks are in different attempts, it never completes, and both hear it.
        job = self.daemon.job("split")
        halves = [np.full(4, float(r + 1), np.float32) for r in range(2)]
        spec = lambda r: {"w": {"global_shape": [8], "box_offset": [4 * r]}}  # noqa: E731
        clients = [flashckpt.Client(self.daemon.socket, job, rank=r, world_size=2, tp_rank=r, tp_degree=2,
                                    run_id="split-run") for r in range(2)]
        try:
            for r, c in enumerate(clients):
                c.register({"w": halves[r]}, spec(r))
            for r, c in enumerate(clients):
                c.snapshot(5, {"w": halves[r]})
            for c in clients:
                c.wait_complete(5, timeout=30)
            clients[1].restore({"w": halves[1]})
            for r, c in enumerate(clients):
                c.snapshot(10, {"w": halves[r]})
            for c in clients:
                with self.assertRaises(flashckpt.FailedPreconditionError) as cm:
                    c.wait_persisted(10, timeout=30)
                self.assertIn("is split", cm.exception.message)
                with self.assertRaises(flashckpt.FailedPreconditionError) as cm:
                    c.snapshot(15, {"w": halves[0]})
                self.assertIn("checkpoint-10 of job '%s' is split" % job, cm.exception.message)
        finally:
            for c in clients:
                c.close()

    def test_status_and_close(self):
        c = self.client("status")
        c.register({"w": np.zeros(4, np.float32)})
        status = c.status()
        self.assertEqual(status["root"], self.daemon.root)
        jobs = {j["job"]: j for j in status["jobs"]}
        self.assertIn(c.job, jobs)
        self.assertTrue(jobs[c.job]["ranks"][0]["connected"])
        c.close()
        c.close()  # idempotent
        with self.assertRaises(flashckpt.CancelledError):
            c.snapshot(1, {"w": np.zeros(4, np.float32)})


if __name__ == "__main__":
    unittest.main(verbosity=2)

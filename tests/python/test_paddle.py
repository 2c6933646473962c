#!/usr/bin/python3
"""flashckpt.paddle against a real flashckptd: a Paddle training run SIGKILLed and resumed is
bit-identical to one never stopped, and its checkpoints load in a Paddle job without flashckpt.

examples/train_paddle.py (an MLP with dropout, AdamW with a decaying learning rate, the daemon's EMA)
runs against one real flashckptd:
  1. job A, uninterrupted, to the last step;
  2. job B, SIGKILLed at a random step after its first complete checkpoint, then started again: it
     resumes and trains to the last step. Every loss B logged (before the kill and after the resume)
     equals A's at the same step bit for bit, and so do the final weights, the EMA, the eval losses
     and the learning rate;
  3. the same with memory checkpoints at every step between the disk saves: the restarted run
     resumes from the newest memory checkpoint (tier memory), with the EMA of that step.
Then flashckpt.paddle.export writes A's last checkpoint as model.pdparams / model.pdopt: paddle.load +
set_state_dict into a fresh model and optimizer gives the logits of the model Checkpointer.resume()
restores, bit for bit, before and after one more optimizer step (its moments, beta powers and
schedule). A model of another structure is
refused by resume() with StructureMismatchError, before a tensor is touched.
Skipped (exit 77) where paddle cannot be imported (scripts/deps.sh installs it into the venv).
The random kill step comes from FLASHCKPT_TEST_SEED when set (the seed is printed).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

np, paddle = harness.import_or_skip("numpy", "paddle")

STEPS, SAVE_EVERY = 120, 30
MEMORY_SAVE_EVERY = 20  # with a memory checkpoint at every step in between
EXAMPLE = os.path.join(harness.REPO, "examples", "train_paddle.py")
SUMMARY_KEYS = ("params_sha256", "ema_sha256", "eval_loss", "ema_eval_loss", "ema_step", "lr")


def load_example():
    """examples/train_paddle.py as a module (its model, optimizer and data)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_paddle", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class PaddleCheckpointerTest(unittest.TestCase):
    def setUp(self):
        self.daemon = harness.Daemon().__enter__()
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        self.daemon.cleanup()

    def trainer(self, job, name, step_delay=0.0, memory=False):
        log = os.path.join(self.daemon.tmp, name + ".jsonl")
        out = open(os.path.join(self.daemon.tmp, name + ".out"), "wb")
        env = dict(os.environ, PYTHONPATH=harness.PYTHON_DIR, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
        cmd = [sys.executable, EXAMPLE, "--socket", self.daemon.socket, "--job", job, "--steps", str(STEPS),
               "--quiet", "--log", log, "--summary", os.path.join(self.daemon.tmp, name + ".json"),
               "--step-delay", str(step_delay), "--ema-decay", "0.9"]
        if memory:
            cmd += ["--save-every", str(MEMORY_SAVE_EVERY), "--memory-every", "1"]
        else:
            cmd += ["--save-every", str(SAVE_EVERY), "--ema-every", "1"]
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        out.close()
        self.procs.append(p)
        return p, log

    def finish(self, proc, name):
        rc = proc.wait(timeout=180)
        with open(os.path.join(self.daemon.tmp, name + ".out"), errors="replace") as f:
            output = f.read()
        self.assertEqual(rc, 0, "%s exited with %s:\n%s\ndaemon log:\n%s" % (name, rc, output, self.daemon.log_tail()))
        with open(os.path.join(self.daemon.tmp, name + ".json")) as f:
            return json.load(f)

    def kill_and_resume(self, tag, kill_after, memory):
        job_a, job_b = self.daemon.job(tag + "ref"), self.daemon.job(tag + "killed")
        ref_proc, ref_log = self.trainer(job_a, tag + "reference", memory=memory)
        ref = self.finish(ref_proc, tag + "reference")
        ref_losses = harness.read_loss_log(ref_log)
        self.assertEqual(sorted(ref_losses), list(range(1, STEPS + 1)))
        self.assertIsNone(ref["resumed_step"])

        victim, victim_log = self.trainer(job_b, tag + "victim", step_delay=0.01, memory=memory)
        latest = os.path.join(self.daemon.job_dir(job_b), "LATEST")

        def due():
            if victim.poll() is not None:
                raise AssertionError("the trainer exited (%s) before the kill" % victim.returncode)
            logged = harness.read_loss_log(victim_log)
            return (memory or os.path.exists(latest)) and logged and max(logged) >= kill_after
        harness.wait_for(due, 90, "step %d" % kill_after, poll=0.002)
        victim.send_signal(signal.SIGKILL)
        self.assertEqual(victim.wait(timeout=10), -signal.SIGKILL)
        killed_losses = harness.read_loss_log(victim_log)
        killed_at = max(killed_losses)
        self.assertLess(killed_at, STEPS)

        resumed_proc, resumed_log = self.trainer(job_b, tag + "resumed", memory=memory)
        resumed = self.finish(resumed_proc, tag + "resumed")
        start, tier = resumed["resumed_step"], resumed["resumed_tier"]
        print("killed at step %d, resumed step %s from %s" % (killed_at, start, tier), flush=True)
        self.assertIsNotNone(start)
        resumed_losses = harness.read_loss_log(resumed_log)
        self.assertEqual(sorted(resumed_losses), list(range(start + 1, STEPS + 1)))
        for step, loss in sorted(killed_losses.items()):
            self.assertEqual(loss, ref_losses[step], "killed run, step %d" % step)
        for step, loss in sorted(resumed_losses.items()):
            self.assertEqual(loss, ref_losses[step], "resumed run, step %d (resumed from %d)" % (step, start))
        for key in SUMMARY_KEYS:
            self.assertEqual(resumed[key], ref[key], key)
        return start, tier, killed_at, job_a

    def test_sigkill_at_random_step_then_resume(self):
        seed = int(os.environ.get("FLASHCKPT_TEST_SEED", time.time_ns() % 100000))
        kill_after = random.Random(seed).randint(SAVE_EVERY + 1, STEPS - 20)
        print("\nFLASHCKPT_TEST_SEED=%d: SIGKILL once step %d is logged" % (seed, kill_after), flush=True)
        start, tier, killed_at, job_a = self.kill_and_resume("d", kill_after, memory=False)
        self.assertEqual(tier, "disk")
        self.assertEqual(start % SAVE_EVERY, 0)
        self.assertTrue(SAVE_EVERY <= start <= killed_at, start)
        self.check_export(job_a)

    def test_sigkill_resumes_from_the_last_memory_checkpoint(self):
        seed = int(os.environ.get("FLASHCKPT_TEST_SEED", time.time_ns() % 100000))
        rng = random.Random(seed + 1)
        kill_after = rng.randint(1, 3) * MEMORY_SAVE_EVERY + rng.randint(3, MEMORY_SAVE_EVERY - 6)
        print("\nFLASHCKPT_TEST_SEED=%d: SIGKILL once step %d is logged" % (seed, kill_after), flush=True)
        start, tier, killed_at, _ = self.kill_and_resume("m", kill_after, memory=True)
        # Each step is logged after its memory checkpoint: the newest one is at least the last step logged.
        self.assertGreaterEqual(start, killed_at)
        self.assertEqual(tier, "memory")

    def check_export(self, job):
        """A's last checkpoint, exported to Paddle's files and loaded without flashckpt, is the
        model and optimizer Checkpointer.resume() restores."""
        sys.path.insert(0, harness.PYTHON_DIR)
        from flashckpt.paddle import Checkpointer, export
        from flashckpt.errors import StructureMismatchError
        ex = load_example()
        paddle.set_device("cpu")
        out = os.path.join(self.daemon.tmp, "exported")
        written = export(os.path.join(self.daemon.job_dir(job), "checkpoint-%d" % STEPS), out)
        self.assertEqual(sorted(os.listdir(out)), ["model.pdopt", "model.pdparams"])

        with paddle.utils.unique_name.guard():  # the parameter names of a fresh process
            plain = ex.make_model()
            plain_opt, plain_schedule = ex.make_optimizer(plain)
        plain.set_state_dict(paddle.load(written["pdparams"]))
        plain_opt.set_state_dict(paddle.load(written["pdopt"]))

        with paddle.utils.unique_name.guard():
            model = ex.make_model()
            opt, schedule = ex.make_optimizer(model)
        with Checkpointer(model, opt, socket=self.daemon.socket, job=job) as ck:
            self.assertEqual(ck.resume(), STEPS)
        x = paddle.to_tensor(ex.make_data(1234)[1][0][:256])
        model.eval()
        plain.eval()
        self.assertTrue(np.array_equal(model(x).numpy(), plain(x).numpy()), "logits differ")
        self.assertEqual(plain_schedule.last_epoch, STEPS)
        self.assertEqual(schedule.last_epoch, STEPS)
        self.assertEqual(plain_schedule.get_lr(), schedule.get_lr())
        # One more step on each (dropout off) with the same batch: the same moments, beta powers and
        # learning rate give the same weights.
        xb, yb = ex.batch_at(ex.make_data(1234)[0], 0, 0)
        for m, o in ((model, opt), (plain, plain_opt)):
            paddle.nn.functional.cross_entropy(m(xb), yb).backward()
            with paddle.utils.unique_name.guard():  # the accumulators get the names of a fresh process
                o.step()
            o.clear_grad()
        self.assertTrue(np.array_equal(model(x).numpy(), plain(x).numpy()), "logits differ after a step")
        print("exported checkpoint-%d: %s; logits identical to the resumed model's" % (STEPS, written), flush=True)

        with paddle.utils.unique_name.guard():
            other = paddle.nn.Sequential(paddle.nn.Linear(ex.FEATURES, 16), paddle.nn.Linear(16, ex.CLASSES))
        before = [p.numpy().copy() for p in other.parameters()]
        with Checkpointer(other, None, socket=self.daemon.socket, job=job) as ck:
            with self.assertRaises(StructureMismatchError) as caught:
                ck.resume()
        print("another model: %s" % caught.exception, flush=True)
        for p, was in zip(other.parameters(), before):
            self.assertTrue(np.array_equal(p.numpy(), was), "a refused resume changed a tensor")


if __name__ == "__main__":
    unittest.main(verbosity=2)

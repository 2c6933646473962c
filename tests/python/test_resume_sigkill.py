#!/usr/bin/python3
"""A real training run SIGKILLed at a random step and resumed is bit-identical to one never stopped.

examples/train_mlp.py (an MLP with dropout, AdamW, the daemon's EMA) runs three times against one
real flashckptd:
  1. job A, uninterrupted, to the last step;
  2. job B, SIGKILLed at a random step after its first complete checkpoint;
  3. job B again: it resumes from the latest complete checkpoint and trains to the last step.
Every loss job B logged (before the kill and after the resume) must equal job A's loss at the same
step bit for bit, and the final weights, the EMA and the eval losses must be identical too.
The same again with memory checkpoints (--memory-every 1, disk every 20, the EMA every step): the
resumed run starts from the last step that reached the daemon's memory, not from the disk checkpoint
before it, with the EMA of that step, so its EMA too ends identical to the uninterrupted run's.
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

STEPS, SAVE_EVERY = 160, 40
MEMORY_SAVE_EVERY = 20  # with a memory checkpoint at every step in between
EXAMPLE = os.path.join(harness.REPO, "examples", "train_mlp.py")


class ResumeAfterSigkillTest(unittest.TestCase):
    TRAINER_ARGS = []  # the model and device (test_torch_cuda_sigkill: a larger model on the GPU)
    MAX_HOST_MEMORY = "1GiB"

    def setUp(self):
        self.daemon = harness.Daemon(max_host_memory=self.MAX_HOST_MEMORY).__enter__()
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        self.daemon.cleanup()

    def trainer(self, job, name, step_delay=0.0, memory=False):
        log = os.path.join(self.daemon.tmp, name + ".jsonl")
        summary = os.path.join(self.daemon.tmp, name + ".json")
        out = open(os.path.join(self.daemon.tmp, name + ".out"), "wb")
        env = dict(os.environ, PYTHONPATH=harness.PYTHON_DIR)
        cmd = [sys.executable, EXAMPLE, "--socket", self.daemon.socket, "--job", job, "--steps", str(STEPS),
               "--quiet", "--log", log, "--summary", summary, "--step-delay", str(step_delay)] + self.TRAINER_ARGS
        if memory:
            cmd += ["--save-every", str(MEMORY_SAVE_EVERY), "--memory-every", "1"]
        else:
            cmd += ["--save-every", str(SAVE_EVERY), "--ema-every", "1"]
        cmd += ["--ema-decay", "0.9"]
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        out.close()
        self.procs.append(p)
        return p, log, summary

    def finish(self, proc, name):
        rc = proc.wait(timeout=120)
        with open(os.path.join(self.daemon.tmp, name + ".out"), errors="replace") as f:
            output = f.read()
        self.assertEqual(rc, 0, "%s exited with %s:\n%s\ndaemon log:\n%s" % (name, rc, output, self.daemon.log_tail()))
        with open(os.path.join(self.daemon.tmp, name + ".json")) as f:
            return json.load(f)

    def check_identical(self, ref, ref_losses, killed_losses, resumed, resumed_log, keys):
        """The killed and the resumed run logged exactly the reference's losses, and ended alike."""
        start = resumed["resumed_step"]
        resumed_losses = harness.read_loss_log(resumed_log)
        self.assertEqual(sorted(resumed_losses), list(range(start + 1, STEPS + 1)))
        for step, loss in sorted(killed_losses.items()):
            self.assertEqual(loss, ref_losses[step], "killed run, step %d" % step)
        for step, loss in sorted(resumed_losses.items()):
            self.assertEqual(loss, ref_losses[step], "resumed run, step %d (resumed from %d)" % (step, start))
        for key in keys:
            self.assertEqual(resumed[key], ref[key], key)

    def test_sigkill_at_random_step_then_resume(self):
        seed = int(os.environ.get("FLASHCKPT_TEST_SEED", time.time_ns() % 100000))
        kill_after = random.Random(seed).randint(SAVE_EVERY + 1, STEPS - 25)
        print("\nFLASHCKPT_TEST_SEED=%d: SIGKILL once step %d is logged" % (seed, kill_after), flush=True)

        job_a, job_b = self.daemon.job("ref"), self.daemon.job("killed")
        ref_proc, ref_log, _ = self.trainer(job_a, "reference")
        ref = self.finish(ref_proc, "reference")
        ref_losses = harness.read_loss_log(ref_log)
        self.assertEqual(sorted(ref_losses), list(range(1, STEPS + 1)))
        self.assertIsNone(ref["resumed_step"])

        victim, victim_log, _ = self.trainer(job_b, "victim", step_delay=0.01)
        latest = os.path.join(self.daemon.job_dir(job_b), "LATEST")

        def due():
            if victim.poll() is not None:
                raise AssertionError("the trainer exited (%s) before the kill" % victim.returncode)
            logged = harness.read_loss_log(victim_log)
            return os.path.exists(latest) and logged and max(logged) >= kill_after
        harness.wait_for(due, 60, "step %d and a complete checkpoint" % kill_after, poll=0.002)
        victim.send_signal(signal.SIGKILL)
        self.assertEqual(victim.wait(timeout=10), -signal.SIGKILL)
        killed_losses = harness.read_loss_log(victim_log)
        killed_at = max(killed_losses)
        with open(latest) as f:
            print("killed at step %d; LATEST=%s" % (killed_at, f.read().strip()), flush=True)
        self.assertLess(killed_at, STEPS)

        resumed_proc, resumed_log, _ = self.trainer(job_b, "resumed")
        resumed = self.finish(resumed_proc, "resumed")
        start = resumed["resumed_step"]
        print("resumed from checkpoint-%s" % start, flush=True)
        self.assertIsNotNone(start)
        self.assertEqual(start % SAVE_EVERY, 0)
        self.assertTrue(SAVE_EVERY <= start <= killed_at, start)
        self.check_identical(ref, ref_losses, killed_losses, resumed, resumed_log,
                             ("params_sha256", "ema_sha256", "eval_loss", "ema_eval_loss", "ema_step"))


    def test_sigkill_resumes_from_the_last_memory_checkpoint(self):
        seed = int(os.environ.get("FLASHCKPT_TEST_SEED", time.time_ns() % 100000))
        rng = random.Random(seed + 1)
        # Between the disk saves (a kill right after one would resume from disk, which is right too).
        kill_after = rng.randint(1, 3) * MEMORY_SAVE_EVERY + rng.randint(3, MEMORY_SAVE_EVERY - 6)
        print("\nFLASHCKPT_TEST_SEED=%d: SIGKILL once step %d is logged" % (seed, kill_after), flush=True)

        job_a, job_b = self.daemon.job("mref"), self.daemon.job("mkilled")
        ref_proc, ref_log, _ = self.trainer(job_a, "mreference", memory=True)
        ref = self.finish(ref_proc, "mreference")
        ref_losses = harness.read_loss_log(ref_log)
        self.assertEqual(sorted(ref_losses), list(range(1, STEPS + 1)))

        victim, victim_log, _ = self.trainer(job_b, "mvictim", step_delay=0.01, memory=True)

        def due():
            if victim.poll() is not None:
                raise AssertionError("the trainer exited (%s) before the kill" % victim.returncode)
            logged = harness.read_loss_log(victim_log)
            return logged and max(logged) >= kill_after
        harness.wait_for(due, 60, "step %d" % kill_after, poll=0.002)
        victim.send_signal(signal.SIGKILL)
        self.assertEqual(victim.wait(timeout=10), -signal.SIGKILL)
        killed_losses = harness.read_loss_log(victim_log)
        killed_at = max(killed_losses)
        with open(os.path.join(self.daemon.job_dir(job_b), "LATEST")) as f:
            disk = f.read().strip()
        print("killed at step %d; LATEST=%s" % (killed_at, disk), flush=True)

        resumed_proc, resumed_log, _ = self.trainer(job_b, "mresumed", memory=True)
        resumed = self.finish(resumed_proc, "mresumed")
        start, tier = resumed["resumed_step"], resumed["resumed_tier"]
        print("resumed from step %s (%s)" % (start, tier), flush=True)
        # Each step is logged after its memory checkpoint: the newest one is at least the last step logged.
        self.assertIsNotNone(start)
        self.assertGreaterEqual(start, killed_at)
        if start % MEMORY_SAVE_EVERY != 0:
            self.assertEqual(tier, "memory")
        self.check_identical(ref, ref_losses, killed_losses, resumed, resumed_log,
                             ("params_sha256", "ema_sha256", "eval_loss", "ema_eval_loss", "ema_step"))


if __name__ == "__main__":
    unittest.main(verbosity=2)

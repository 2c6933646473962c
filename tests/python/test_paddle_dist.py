#!/usr/bin/python3
"""flashckpt.paddle in a data-parallel Paddle job: 2 processes started by paddle.distributed.launch
(gloo on the CPU), each a paddle.DataParallel trainer (examples/train_paddle.py) with its own
Checkpointer, against one real flashckptd.

  1. Written once: the job's checkpoint holds one copy of the model and optimizer, split between the
     ranks (the tensor bytes of both ranks' files add up to the state's bytes, and each rank writes
     about half), read with the safetensors package.
  2. SIGKILL: the whole job (launcher and both ranks) is killed at a random step after its first
     complete checkpoint and launched again: both ranks resume the same step, and every loss each
     rank logged, before the kill and after, and the final weights, equal those of an uninterrupted
     job bit for bit.
  3. The same with a memory checkpoint at every step between the disk saves: the ranks resume the
     newest memory checkpoint (tier memory on both), each restoring its share and receiving the
     other's.
  4. Another world size: one process without paddle.distributed resumes the 2-rank job's last
     checkpoint, with the uninterrupted job's final weights; flashckpt.paddle.export writes it as
     model.pdparams with those weights.
  5. Sharding stage 1 (fleet, sharding_degree 2: each rank's DygraphShardingOptimizer holds the
     state of its own parameters), with the daemon's EMA: the job SIGKILLed and launched again
     resumes bit-exact (losses, weights, EMA); one process with a plain AdamW (sharding degree 1)
     resumes its last checkpoint with the job's final weights and EMA, and an optimizer state that
     is the union of both ranks' (read from their files with safetensors); its export holds those
     weights and that optimizer state.
  6. Tensor parallelism (fleet, mp_degree 2) is refused on every rank with a ValueError.
Skipped (exit 77) where paddle cannot be imported. FLASHCKPT_TEST_SEED fixes the kill steps.
"""

import glob
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

paddle, _ = harness.import_or_skip("paddle", "safetensors")
from safetensors import safe_open  # noqa: E402

RANKS, STEPS, SAVE_EVERY, MEMORY_SAVE_EVERY = 2, 60, 20, 20
EXAMPLE = os.path.join(harness.REPO, "examples", "train_paddle.py")


class PaddleDataParallelTest(unittest.TestCase):
    def setUp(self):
        self.daemon = harness.Daemon().__enter__()
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                for pid in descendants(p.pid) + [p.pid]:
                    os.kill(pid, signal.SIGKILL)
                p.wait(timeout=10)
        self.daemon.cleanup()

    def env(self):
        return dict(os.environ, PYTHONPATH=harness.PYTHON_DIR, OMP_NUM_THREADS="1", GLOG_minloglevel="2",
                    PYTHONWARNINGS="ignore")

    def launch(self, job, name, memory=False, step_delay=0.0, sharding=False):
        """The job's 2 ranks under paddle.distributed.launch, in a process group of their own."""
        log = os.path.join(self.daemon.tmp, name + ".jsonl")
        out = open(os.path.join(self.daemon.tmp, name + ".out"), "wb")
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(RANKS), "--devices", "",
               "--start_port", str(free_ports(RANKS)),
               # "--": the launcher's own options would take the trainer's by prefix (--log).
               "--log_dir", os.path.join(self.daemon.tmp, name + ".launch"), "--", EXAMPLE,
               "--socket", self.daemon.socket, "--job", job, "--steps", str(STEPS), "--quiet",
               "--sharding" if sharding else "--no-ema",
               "--log", log, "--summary", os.path.join(self.daemon.tmp, name + ".json"),
               "--step-delay", str(step_delay)]
        cmd += ["--save-every", str(MEMORY_SAVE_EVERY), "--memory-every", "1"] if memory else \
            ["--save-every", str(SAVE_EVERY)]
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env(),
                             start_new_session=True)
        out.close()
        self.procs.append(p)
        return p, log

    def launch_logs(self, name):
        with open(os.path.join(self.daemon.tmp, name + ".out"), errors="replace") as f:
            text = f.read()[-3000:]
        for path in sorted(glob.glob(os.path.join(self.daemon.tmp, name + ".launch", "*"))):
            with open(path, errors="replace") as f:
                text += "--- %s\n%s" % (os.path.basename(path), f.read()[-3000:])
        return text

    def finish(self, proc, name):
        """Every rank's summary, once the job exited 0."""
        rc = proc.wait(timeout=240)
        self.assertEqual(rc, 0, "%s exited with %s:\n%s\ndaemon log:\n%s"
                         % (name, rc, self.launch_logs(name), self.daemon.log_tail()))
        out = []
        for r in range(RANKS):
            with open(os.path.join(self.daemon.tmp, "%s.json.rank%d" % (name, r))) as f:
                out.append(json.load(f))
        return out

    def losses(self, log):
        return [harness.read_loss_log("%s.rank%d" % (log, r)) for r in range(RANKS)]

    def kill_job(self, proc, log, after, latest=None):
        """SIGKILL of the launcher and both ranks once every rank logged step `after` (and the file
        `latest` exists)."""
        def due():
            if proc.poll() is not None:
                raise AssertionError("the job exited (%s) before the kill" % proc.returncode)
            return all(logged and max(logged) >= after for logged in self.losses(log)) and \
                (latest is None or os.path.exists(latest))
        harness.wait_for(due, 120, "step %d on every rank" % after, poll=0.005)
        # The launcher starts each rank in a session of its own: every process of the job is killed.
        job = descendants(proc.pid) + [proc.pid]
        for pid in job:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
        harness.wait_for(lambda: not any(os.path.exists("/proc/%d/status" % pid) and not zombie(pid) for pid in job),
                         10, "the job's processes to die")
        return self.losses(log)

    def check_identical(self, ref_losses, ref, killed, resumed_log, resumed):
        start = resumed[0]["resumed_step"]
        self.assertIsNotNone(start)
        self.assertEqual({s["resumed_step"] for s in resumed}, {start}, "the ranks resumed different steps")
        for r in range(RANKS):
            after = harness.read_loss_log("%s.rank%d" % (resumed_log, r))
            self.assertEqual(sorted(after), list(range(start + 1, STEPS + 1)))
            for step, loss in list(killed[r].items()) + list(after.items()):
                self.assertEqual(loss, ref_losses[r][step], "rank %d, step %d (resumed from %d)" % (r, step, start))
            self.assertEqual(resumed[r]["params_sha256"], ref[r]["params_sha256"], "rank %d" % r)
            self.assertEqual(resumed[r]["eval_loss"], ref[r]["eval_loss"], "rank %d" % r)
        return start

    def reference(self, memory=False, sharding=False):
        job = self.daemon.job("dpref")
        proc, log = self.launch(job, "reference", memory=memory, sharding=sharding)
        ref = self.finish(proc, "reference")
        self.assertEqual(len({s["params_sha256"] for s in ref}), 1, "the ranks' weights differ")
        return job, ref, self.losses(log)

    def resume_in_one_process(self, job):
        summary = os.path.join(self.daemon.tmp, "single.json")
        run = subprocess.run([sys.executable, EXAMPLE, "--socket", self.daemon.socket, "--job", job, "--steps",
                              str(STEPS), "--quiet", "--no-ema", "--summary", summary], env=self.env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
        self.assertEqual(run.returncode, 0, run.stdout.decode(errors="replace")[-3000:])
        with open(summary) as f:
            return json.load(f)

    def test_written_once_killed_and_resumed_then_resumed_by_one_process(self):
        seed = int(os.environ.get("FLASHCKPT_TEST_SEED", time.time_ns() % 100000))
        kill_after = random.Random(seed).randint(SAVE_EVERY + 1, STEPS - 8)
        print("\nFLASHCKPT_TEST_SEED=%d: SIGKILL once step %d is logged" % (seed, kill_after), flush=True)
        job_a, ref, ref_losses = self.reference()

        # 1. One copy of the state, split between the ranks' files.
        ckpt = os.path.join(self.daemon.job_dir(job_a), "checkpoint-%d" % STEPS)
        per_rank = []
        for r in range(RANKS):
            total = 0
            for kind in ("model_state", "optimizer"):
                path = os.path.join(ckpt, "%s.tp00_pp00_shard%02d.safetensors" % (kind, r))
                if os.path.exists(path):  # a rank whose share holds none of the kind writes no file of it
                    with safe_open(path, "np") as f:
                        total += sum(f.get_tensor(k).nbytes for k in f.keys())
            per_rank.append(total)
        print("tensor bytes per rank: %s" % per_rank, flush=True)
        example = load_example()
        model = example.make_model()
        state_bytes = sum(int(t.size) * t.element_size() for t in model.state_dict().values())
        # AdamW: two moments per parameter, and two beta powers (4 bytes each) per parameter.
        params = len(model.parameters())
        self.assertEqual(sum(per_rank), 3 * state_bytes + params * 2 * 4)
        self.assertLess(max(per_rank), sum(per_rank) * 0.51)

        # 2. The job killed and launched again.
        job_b = self.daemon.job("dpkilled")
        victim, victim_log = self.launch(job_b, "victim", step_delay=0.02)
        latest = os.path.join(self.daemon.job_dir(job_b), "LATEST")
        killed = self.kill_job(victim, victim_log, kill_after, latest)
        resumed_proc, resumed_log = self.launch(job_b, "resumed")
        resumed = self.finish(resumed_proc, "resumed")
        start = self.check_identical(ref_losses, ref, killed, resumed_log, resumed)
        print("killed after step %d; both ranks resumed checkpoint-%d" % (kill_after, start), flush=True)
        self.assertEqual(start % SAVE_EVERY, 0)

        # 4. One process (no paddle.distributed) resumes the 2-rank job's last checkpoint, and
        # flashckpt.paddle.export writes it as Paddle's own files with the same weights.
        single = self.resume_in_one_process(job_a)
        self.assertEqual(single["resumed_step"], STEPS)
        exported = export_and_load(ckpt, os.path.join(self.daemon.tmp, "export"))
        self.assertEqual(digest_arrays(exported["pdparams"]), ref[0]["params_sha256"])
        self.assertEqual(single["params_sha256"], ref[0]["params_sha256"])

    def test_sharding_stage1_with_ema_killed_and_resumed_then_at_degree_1(self):
        seed = int(os.environ.get("FLASHCKPT_TEST_SEED", time.time_ns() % 100000))
        kill_after = random.Random(seed + 2).randint(SAVE_EVERY + 1, STEPS - 8)
        print("\nFLASHCKPT_TEST_SEED=%d: SIGKILL once step %d is logged" % (seed, kill_after), flush=True)
        job_a, ref, ref_losses = self.reference(sharding=True)
        self.assertEqual(len({s["ema_sha256"] for s in ref}), 1, "the ranks' EMAs differ")
        self.assertNotEqual(ref[0]["optimizer_sha256"], ref[1]["optimizer_sha256"], "the optimizer is not sharded")

        job_b = self.daemon.job("shkilled")
        victim, victim_log = self.launch(job_b, "victim", step_delay=0.02, sharding=True)
        killed = self.kill_job(victim, victim_log, kill_after, os.path.join(self.daemon.job_dir(job_b), "LATEST"))
        resumed_proc, resumed_log = self.launch(job_b, "resumed", sharding=True)
        resumed = self.finish(resumed_proc, "resumed")
        start = self.check_identical(ref_losses, ref, killed, resumed_log, resumed)
        for r in range(RANKS):
            self.assertEqual(resumed[r]["ema_sha256"], ref[r]["ema_sha256"], "rank %d's EMA" % r)
            self.assertEqual(resumed[r]["optimizer_sha256"], ref[r]["optimizer_sha256"], "rank %d's optimizer" % r)
        print("killed after step %d; both sharding ranks resumed checkpoint-%d" % (kill_after, start), flush=True)

        # Sharding degree 1: one process, a plain AdamW, the daemon's EMA.
        summary = os.path.join(self.daemon.tmp, "single.json")
        run = subprocess.run([sys.executable, EXAMPLE, "--socket", self.daemon.socket, "--job", job_a, "--steps",
                              str(STEPS), "--quiet", "--summary", summary], env=self.env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
        self.assertEqual(run.returncode, 0, run.stdout.decode(errors="replace")[-3000:])
        with open(summary) as f:
            single = json.load(f)
        self.assertEqual(single["resumed_step"], STEPS)
        self.assertEqual(single["params_sha256"], ref[0]["params_sha256"])
        self.assertEqual(single["ema_sha256"], ref[0]["ema_sha256"])
        union = {}
        ckpt = os.path.join(self.daemon.job_dir(job_a), "checkpoint-%d" % STEPS)
        for r in range(RANKS):
            with safe_open(os.path.join(ckpt, "optimizer.tp00_pp00_shard%02d.safetensors" % r), "np") as f:
                mine = {k[len("optimizer."):]: f.get_tensor(k) for k in f.keys()}
            self.assertTrue(mine and not set(mine) & set(union), "rank %d's optimizer file" % r)
            union.update(mine)
        print("optimizer tensors per parameter: %d" % (len(union) // len(load_example().make_model().parameters())),
              flush=True)
        self.assertEqual(single["optimizer_sha256"], digest_arrays(union))
        # Exported as Paddle's own files: the weights, and every rank's optimizer state.
        exported = export_and_load(ckpt, os.path.join(self.daemon.tmp, "export"))
        self.assertEqual(digest_arrays(exported["pdparams"]), ref[0]["params_sha256"])
        self.assertEqual(digest_arrays(exported["pdopt"]), digest_arrays(union))

    def test_tensor_parallelism_is_refused(self):
        """fleet with mp_degree 2: the ranks hold different tensors under the same names, which this
        version cannot save: every rank's Checkpointer raises a ValueError that says so."""
        out = os.path.join(self.daemon.tmp, "mp")
        log = open(out + ".out", "wb")
        p = subprocess.Popen([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(RANKS),
                              "--devices", "", "--start_port", str(free_ports(RANKS)), "--log_dir", out + ".launch",
                              "--", os.path.abspath(__file__), "mp-worker", self.daemon.socket,
                              self.daemon.job("mp"), out],
                             stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)
        log.close()
        self.procs.append(p)
        self.assertEqual(p.wait(timeout=120), 0, self.launch_logs("mp"))
        for r in range(RANKS):
            with open("%s.rank%d" % (out, r)) as f:
                said = f.read()
            self.assertIn("not a model wrapped in TensorParallel", said, "rank %d" % r)

    def test_killed_and_resumed_from_memory(self):
        seed = int(os.environ.get("FLASHCKPT_TEST_SEED", time.time_ns() % 100000))
        rng = random.Random(seed + 1)
        kill_after = rng.randint(1, STEPS // MEMORY_SAVE_EVERY - 1) * MEMORY_SAVE_EVERY + rng.randint(3, 12)
        print("\nFLASHCKPT_TEST_SEED=%d: SIGKILL once step %d is logged" % (seed, kill_after), flush=True)
        _, ref, ref_losses = self.reference(memory=True)
        job = self.daemon.job("dpmem")
        victim, victim_log = self.launch(job, "mvictim", memory=True, step_delay=0.02)
        killed = self.kill_job(victim, victim_log, kill_after)
        resumed_proc, resumed_log = self.launch(job, "mresumed", memory=True)
        resumed = self.finish(resumed_proc, "mresumed")
        start = self.check_identical(ref_losses, ref, killed, resumed_log, resumed)
        tiers = [s["resumed_tier"] for s in resumed]
        print("killed after step %d; resumed step %d from %s" % (kill_after, start, tiers), flush=True)
        self.assertGreaterEqual(start, kill_after)
        self.assertEqual(tiers, ["memory"] * RANKS)


def export_and_load(checkpoint, out):
    """flashckpt.paddle.export of `checkpoint` into `out`, read back with paddle.load: {"pdparams":
    {key: array}, "pdopt": {key: array}} (the optimizer's tensors only)."""
    sys.path.insert(0, harness.PYTHON_DIR)
    from flashckpt.paddle import export
    paths = export(checkpoint, out)
    return {kind: {k: v.numpy() for k, v in paddle.load(paths[kind]).items() if isinstance(v, paddle.Tensor)}
            for kind in ("pdparams", "pdopt")}


def digest_arrays(arrays):
    """examples/train_paddle.py's digest of a state dict, over numpy arrays."""
    import hashlib
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(k.encode())
        h.update(arrays[k].tobytes())
    return h.hexdigest()[:16]


def free_ports(n):
    """The first of `n` consecutive TCP ports that are free on 127.0.0.1 now (the launcher gives the
    ranks start_port, start_port + 1, ...; its default, 6070, may be taken)."""
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(20000, 50000)
        held = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise AssertionError("no %d consecutive free ports" % n)


def descendants(pid):
    """The processes below `pid` (from /proc's children lists), deepest last."""
    out = []
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return out
    for child in children:
        out += [child] + descendants(child)
    return out


def zombie(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def load_example():
    """examples/train_paddle.py as a module (its model)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_paddle", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mp_worker(socket, job, out):
    """A rank of a fleet job with mp_degree 2: makes a Checkpointer, writes what it raised to OUT.rank<R>."""
    from paddle.distributed import fleet
    from flashckpt.paddle import Checkpointer
    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": RANKS, "pp_degree": 1, "sharding_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    model = fleet.distributed_model(paddle.nn.Linear(8, 8))
    optimizer = fleet.distributed_optimizer(paddle.optimizer.AdamW(parameters=model.parameters()))
    try:
        Checkpointer(model, optimizer, socket=socket, job=job)
        said = "accepted"
    except ValueError as e:
        said = str(e)
    with open("%s.rank%d" % (out, paddle.distributed.get_rank()), "w") as f:
        f.write(said)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "mp-worker":
        sys.path.insert(0, harness.PYTHON_DIR)
        mp_worker(*sys.argv[2:])
        sys.exit(0)
    unittest.main(verbosity=2)

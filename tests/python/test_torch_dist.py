#!/usr/bin/python3
"""Checkpointer.resume() in a 2-process torch.distributed (gloo) job agrees on one step, or fails on every rank.

Each case runs two real worker processes (this file, run with "worker") against one real flashckptd:
- a DDP job saves steps 2 and 4; two fresh processes resume and both restore step 4, with the
  parameters and the optimizer state bit-identical to the saved ones;
- rank 1's optimizer has another structure (SGD where AdamW was saved): rank 1 raises
  StructureMismatchError, and rank 0, whose own restore would have worked, raises
  FailedPreconditionError naming rank 1 and its reason, and loads nothing;
- rank 0 asks for step 2 and rank 1 for step 4: both raise ValueError naming what each asked for;
- rank 1 dies before resume(): rank 0's resume() raises instead of waiting for it, well within the
  test's deadline.
"""

import json
import os
import socket
import subprocess
import sys
import time
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

WORKER_DEADLINE = 120  # seconds a pair of workers may take, whatever happens


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(case, rank, port, sock, job, out):
    import datetime

    import torch
    import torch.distributed as dist

    import flashckpt
    from flashckpt.torch import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=2,
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

    result = {"rank": rank}
    if case == "save":
        model, optimizer = make()
        g = torch.Generator().manual_seed(rank)
        with Checkpointer(model, optimizer, socket=sock, job=job) as ck:
            for step in range(1, 5):
                optimizer.zero_grad()
                model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
                optimizer.step()
                if step % 2 == 0:
                    ck.save(step)
            ck.wait_persisted(4, timeout=60)
        result["digest"] = digest(model, optimizer)
    elif case == "resume":
        model, optimizer = make(seed=7)
        with Checkpointer(model, optimizer, socket=sock, job=job) as ck:
            result["step"] = ck.resume()
        result["digest"] = digest(model, optimizer)
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
    if case != "peer_dies":
        dist.destroy_process_group()


class DistributedResumeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = harness.Daemon().__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.cleanup()

    def run_pair(self, case, job):
        port = free_port()
        procs, outs = [], []
        for rank in range(2):
            out = os.path.join(self.daemon.tmp, "%s.%s.%d.json" % (job, case, rank))
            env = dict(os.environ, PYTHONPATH=harness.PYTHON_DIR)
            with open(out + ".log", "wb") as log:
                procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", case, str(rank),
                                               str(port), self.daemon.socket, job, out],
                                              stdout=log, stderr=subprocess.STDOUT, env=env))
            outs.append(out)
        deadline = time.monotonic() + WORKER_DEADLINE
        for p in procs:
            try:
                p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                    q.wait()
                self.fail("the %s workers did not finish within %d s:\n%s" % (case, WORKER_DEADLINE, self.logs(outs)))
        results = []
        for out in outs:
            if os.path.exists(out):
                with open(out) as f:
                    results.append(json.load(f))
            else:
                results.append(None)
        return results, procs, outs

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
        _, _, case, rank, port, sock, job, out = sys.argv
        worker(case, int(rank), int(port), sock, job, out)
    else:
        unittest.main(verbosity=2)

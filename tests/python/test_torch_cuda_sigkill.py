#!/usr/bin/python3
"""A GPU training run SIGKILLed and resumed is bit-identical to one never stopped (ctest label gpu).

test_resume_sigkill's two tests (a kill between disk checkpoints, and one between memory
checkpoints) with examples/train_mlp.py on CUDA: 6 hidden layers of 2048 units, about 240 MiB of
weights and AdamW moments, deterministic kernels. The losses of the killed and the resumed run, the
final weights and the daemon's EMA equal the uninterrupted run's bit for bit. One more test reads the
last checkpoint of an uninterrupted run with the `safetensors` package (safe_open over every file):
the model_state, optimizer and ema files hold exactly the trainer's final weights, AdamW state and EMA
(digests the trainer computed from its device tensors).

Skipped, saying why, where torch sees no CUDA device or libflashckpt has no CUDA compiled in.
"""

import os
import sys
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import test_resume_sigkill as base  # noqa: E402

SKIP = harness.cuda_skip_reason()


def digest_file_tensors(path, prefix):
    """train_mlp's digest of the tensors of one safetensors file, their names without `prefix`."""
    from safetensors import safe_open
    tensors = {}
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            assert name.startswith(prefix), (path, name)
            tensors[name[len(prefix):]] = f.get_tensor(name)
    sys.path.insert(0, os.path.join(harness.REPO, "examples"))
    import train_mlp
    return train_mlp.digest(tensors), len(tensors)


@unittest.skipIf(SKIP is not None, SKIP or "")
class CudaResumeAfterSigkillTest(base.ResumeAfterSigkillTest):
    TRAINER_ARGS = ["--device", "cuda", "--hidden", "2048", "--depth", "6"]
    MAX_HOST_MEMORY = "4GiB"

    def test_last_checkpoint_read_by_safetensors_holds_the_final_state(self):
        job = self.daemon.job("readback")
        proc, _, _ = self.trainer(job, "readback")
        summary = self.finish(proc, "readback")
        self.assertEqual(summary["device"], "cuda")
        self.assertGreater(summary["state_bytes"], 200 * 2**20)
        self.assertEqual(base.STEPS % base.SAVE_EVERY, 0)  # the last step is a checkpoint
        ckpt = os.path.join(self.daemon.job_dir(job), "checkpoint-%d" % base.STEPS)
        for kind, prefix, key in (("model_state", "model.", "params_sha256"),
                                  ("optimizer", "optimizer.", "optimizer_sha256"),
                                  ("ema", "model.", "ema_sha256")):
            got, count = digest_file_tensors(os.path.join(ckpt, kind + ".tp00_pp00_shard00.safetensors"), prefix)
            print("%s: %d tensors, digest %s" % (kind, count, got), flush=True)
            self.assertGreater(count, 0, kind)
            self.assertEqual(got, summary[key], kind)


if __name__ == "__main__":
    unittest.main(verbosity=2)

#!/usr/bin/python3
"""What flashckpt writes, read by readers nobody here wrote: the `safetensors` library and `transformers`.

Runs in the torch 2 environment (scripts/deps.sh; ctest runs it with FLASHCKPT_TORCH2_PYTHON). With a
Python that lacks torch 2, safetensors or transformers it prints why and exits 77 (ctest: skipped).

- A model with fp32, fp16, bf16, int64 and bool tensors, an empty one and 0-d ones (a parameter, an
  int64 buffer, AdamW's `step`), trained a few steps with AdamW and saved through the Checkpointer
  with an EMA: safetensors' `load_file` and `safe_open` read every file of the checkpoint
  (model_state, optimizer, ema) with the names, dtypes, shapes and bytes that the independent reader
  (tests/integration/flashckpt_reader.py) sees, and the same __metadata__; the values are the
  tensors that were saved (the state dicts at the save; for the EMA of every floating tensor, fp16
  and bf16 included, an average computed here and the daemon's own, ck.ema_state_dict()); flashckpt's own readers agree: resume() into a fresh
  model and optimizer, and `flashckpt export` of the model and of the EMA, read again by `load_file`.
- A transformers Llama (tiny config, random weights) saved through the Checkpointer, exported with
  `flashckpt export --strip-prefix model.` (as saved, and as bf16) and loaded by
  LlamaForCausalLM.from_pretrained (no key missing or unexpected) gives logits equal (torch.equal)
  to the model's; so does its EMA against a model that holds the daemon's EMA.
- A Llama written by save_pretrained (in several files with an index), imported with
  `flashckpt import --add-prefix model.` and loaded into a model of other weights by
  Checkpointer.load_pretrained(job=...) gives the logits of the model that was saved.
"""

import copy
import os
import subprocess
import sys
import tempfile
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(HERE, "..", "integration"))  # flashckpt_reader; harness is ours
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the Hub
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _why_skip():
    try:
        import torch
    except ImportError as e:
        return "no torch (%s)" % e
    if int(torch.__version__.split(".")[0]) < 2:
        return "torch %s: this test needs torch 2" % torch.__version__
    for module in ("safetensors", "transformers"):
        try:
            __import__(module)
        except ImportError as e:
            return "no %s (%s)" % (module, e)
    return None


SKIP = _why_skip()
if SKIP is not None:
    print("SKIP: %s in %s. Run scripts/deps.sh (it makes the torch 2 environment at "
          "${FLASHCKPT_VENV:-~/.cache/flashckpt/venv}), then cmake again so that FLASHCKPT_TORCH2_PYTHON finds "
          "it, or run this file with that environment's python." % (SKIP, sys.executable))
    sys.exit(77)

import harness  # noqa: E402
import flashckpt_reader as reader  # noqa: E402  the independent reader: no flashckpt code

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from flashckpt.torch import Checkpointer  # noqa: E402

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

# safetensors' dtype names (the independent reader's) for the torch dtypes used here.
ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
            torch.bool: "BOOL"}


def raw_bytes(t):
    """The bytes of a tensor in memory order (also for 0-d, empty and bool tensors)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def cli(*args):
    """Runs the flashckpt command; fails the test with its output when it exits non-zero."""
    out = subprocess.run([os.path.join(harness.BIN_DIR, "flashckpt")] + [str(a) for a in args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    if out.returncode != 0:
        raise AssertionError("flashckpt %s exited %d:\n%s" % (" ".join(map(str, args)), out.returncode,
                                                              out.stdout.decode(errors="replace")))
    return out.stdout.decode(errors="replace")


def snapshot(state):
    """A deep copy of a state dict's tensors, {key: tensor}, for the values saved."""
    return {k: v.detach().clone() for k, v in state.items()}


def optimizer_tensors(optimizer, prefix="optimizer"):
    """The tensors of optimizer.state_dict() under the names the Checkpointer gives them."""
    out = {}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out["%s.state.%d.%s" % (prefix, index, key)] = value.detach().clone()
    return out


class Mixed(torch.nn.Module):
    """Every kind of tensor a checkpoint must carry: fp32, fp16 and bf16 parameters, a 0-d parameter,
    int64 buffers (one 0-d), a bool buffer and an empty fp32 buffer."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(6, 5)
        self.w16 = torch.nn.Parameter(torch.randn(5, 3).to(torch.float16))
        self.wbf = torch.nn.Parameter(torch.randn(3).to(torch.bfloat16))
        self.gain = torch.nn.Parameter(torch.tensor(1.5) + torch.rand(()))
        self.register_buffer("seen", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("ids", torch.randint(-1000, 1000, (4,), dtype=torch.int64))
        self.register_buffer("mask", torch.rand(7) > 0.5)
        self.register_buffer("nothing", torch.zeros(0, 4))

    def forward(self, x):
        self.seen += 1
        h = self.fc(x) @ self.w16.float()
        return (h * self.wbf.float()).sum(-1) * self.gain


class SafetensorsReadsEveryFileTest(harness.DaemonTestCase):
    def test_every_file_every_dtype(self):
        decay = 0.75
        model = Mixed(seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(3)
        ema_ref = None
        job = self.daemon.job("readers")
        with Checkpointer(model, optimizer, socket=self.daemon.socket, job=job, ema_decay=decay,
                          ema_model_params="all") as ck:  # "all": the fp16 and bf16 weights too
            for step in range(1, 4):
                optimizer.zero_grad()
                model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
                optimizer.step()
                ck.save(step, persist=(step == 3))
                x = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()
                     if v.is_floating_point()}
                d = np.float32(decay)
                ema_ref = x if ema_ref is None else {k: d * ema_ref[k] + (np.float32(1) - d) * x[k] for k in x}
            saved_model = {"model." + k: v for k, v in snapshot(model.state_dict()).items()}
            saved_optim = optimizer_tensors(optimizer)
            ck.wait_persisted(3, timeout=60)
            daemon_ema = ck.ema_state_dict()

        # The state has what this test is about, so that a change of the model cannot make it vacuous.
        dtypes = {v.dtype for v in list(saved_model.values()) + list(saved_optim.values())}
        self.assertEqual(dtypes, set(ST_DTYPE))
        self.assertTrue(any(v.dim() == 0 for v in saved_model.values()))
        self.assertTrue(any(v.dim() == 0 for v in saved_optim.values()))  # AdamW's step
        self.assertTrue(any(v.numel() == 0 for v in saved_model.values()))

        ckpt = os.path.join(self.daemon.job_dir(job), "checkpoint-3")
        reader.verify_checkpoint(ckpt, formula=False)
        files = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
        by_kind = {"model_state": {}, "optimizer": {}, "ema": {}}
        for fname in files:
            path = os.path.join(ckpt, fname)
            theirs = load_file(path)
            ours = reader.read_safetensors(path)
            with self.subTest(file=fname):
                self.assertEqual(sorted(theirs), sorted(ours.tensors))
                with safe_open(path, framework="pt") as f:
                    self.assertEqual(sorted(f.keys()), sorted(ours.tensors))
                    self.assertEqual(f.metadata(), ours.metadata)
                    for name, t in theirs.items():
                        entry = ours.tensors[name]
                        self.assertEqual(ST_DTYPE[t.dtype], entry.dtype, name)
                        self.assertEqual(list(t.shape), entry.shape, name)
                        self.assertEqual(raw_bytes(t), bytes(ours.tensor_bytes(name)), name)
                        again = f.get_tensor(name)
                        self.assertEqual(again.dtype, t.dtype, name)
                        self.assertTrue(torch.equal(again, t), name)
            by_kind[fname.split(".")[0]].update(theirs)

        self.assert_same(by_kind["model_state"], saved_model, "model_state files")
        self.assert_same(by_kind["optimizer"], saved_optim, "optimizer files")
        # The EMA: of every floating model tensor, in fp32, as computed here, as the daemon says and as
        # the independent reader assembles it.
        ema_files = by_kind["ema"]
        self.assertEqual(sorted(ema_files), sorted("model." + k for k in ema_ref))
        for name, t in ema_files.items():
            key = name[len("model."):]
            self.assertEqual(t.dtype, torch.float32, name)
            self.assertTrue(np.array_equal(t.numpy(), ema_ref[key]), name)
            self.assertTrue(torch.equal(t, daemon_ema[key]), name)
        independent_ema = reader.read_ema(ckpt)
        self.assertEqual(sorted(independent_ema), sorted(ema_files))
        for name, t in ema_files.items():
            self.assertTrue(np.array_equal(independent_ema[name], t.numpy()), name)

        # flashckpt's own readers: resume into a fresh model and optimizer (other weights), and export.
        fresh = Mixed(seed=1)
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        with Checkpointer(fresh, fresh_optim, socket=self.daemon.socket, job=job) as ck:
            self.assertEqual(ck.resume(), 3)
        self.assert_same({"model." + k: v for k, v in fresh.state_dict().items()}, by_kind["model_state"],
                         "resumed model")
        self.assert_same(optimizer_tensors(fresh_optim), by_kind["optimizer"], "resumed optimizer")

        for weights, expected in (("model", saved_model), ("ema", ema_files)):
            out = tempfile.mkdtemp(prefix="fc-readers-export.", dir=self.daemon.tmp)
            os.rmdir(out)
            cli("export", ckpt, out, "--weights", weights, "--strip-prefix", "model.")
            exported = {}
            for fname in os.listdir(out):
                if fname.endswith(".safetensors"):
                    exported.update(load_file(os.path.join(out, fname)))
            want = {k[len("model."):]: v for k, v in expected.items()}
            if weights == "ema":
                # The EMA is exported under the parameters' names; tensors without an EMA (integer
                # and bool buffers) are not in it, nor are they in `expected`.
                self.assertEqual(sorted(exported), sorted(want))
            self.assert_same(exported, want, "export --weights %s" % weights)

    def assert_same(self, got, want, what):
        """Same names, and for each the same dtype, shape and values (torch.equal)."""
        self.assertEqual(sorted(got), sorted(want), what)
        for name, t in want.items():
            g = got[name]
            self.assertEqual((g.dtype, tuple(g.shape)), (t.dtype, tuple(t.shape)), "%s: %s" % (what, name))
            self.assertTrue(torch.equal(g, t), "%s: %s differs" % (what, name))


def tiny_llama_config():
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def tiny_llama(seed):
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


class TransformersTest(harness.DaemonTestCase):
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(7))

    def from_pretrained(self, path, **kwargs):
        model, info = LlamaForCausalLM.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                                       **kwargs)
        for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            self.assertFalse(info[what], "%s: %s" % (what, info[what]))
        return model.eval()

    def export(self, ckpt, *flags):
        out = tempfile.mkdtemp(prefix="fc-readers-hf.", dir=self.daemon.tmp)
        os.rmdir(out)  # export wants a new (or empty) directory; config.json comes after
        cli("export", ckpt, out, "--strip-prefix", "model.", *flags)
        tiny_llama_config().save_pretrained(out)
        return out

    def test_export_loads_with_from_pretrained(self):
        model = tiny_llama(seed=0).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        job = self.daemon.job("llama-export")
        g = torch.Generator().manual_seed(1)
        with Checkpointer(model, optimizer, socket=self.daemon.socket, job=job, ema_decay=0.5) as ck:
            for step in (1, 2):  # trained, so that no weight is still at its initial value (norms: ones)
                optimizer.zero_grad()
                batch = torch.randint(0, 96, (4, 9), generator=g)
                model(batch, labels=batch).loss.backward()
                optimizer.step()
                ck.save(step)
            ck.wait_persisted(2, timeout=60)
            ema = ck.ema_state_dict()
        model.eval()
        want = logits(model, self.ids)
        ckpt = os.path.join(self.daemon.job_dir(job), "checkpoint-2")

        exported = self.export(ckpt)
        loaded = self.from_pretrained(exported)
        self.assertEqual(loaded.dtype, torch.float32)
        self.assertTrue(torch.equal(logits(loaded, self.ids), want), "logits of the exported model differ")

        # --dtype bf16: the weights are the model's rounded to bf16 (as torch rounds), and the logits those
        # of transformers' own conversion of the fp32 export (model.to(bfloat16) would also round the
        # rotary embedding's inv_freq buffer, which from_pretrained keeps in fp32).
        bf16 = self.from_pretrained(self.export(ckpt, "--dtype", "bf16"), dtype=torch.bfloat16)
        self.assertEqual(bf16.dtype, torch.bfloat16)
        rounded = copy.deepcopy(model).to(torch.bfloat16).state_dict()
        for name, t in bf16.state_dict().items():
            self.assertEqual(t.dtype, torch.bfloat16, name)
            self.assertTrue(torch.equal(t, rounded[name]), name)
        self.assertTrue(torch.equal(logits(bf16, self.ids),
                                    logits(self.from_pretrained(exported, dtype=torch.bfloat16), self.ids)),
                        "logits of the bf16 export differ from those of the fp32 export loaded as bf16")

        averaged = tiny_llama(seed=0)
        averaged.load_state_dict(ema)
        self.assertFalse(torch.equal(logits(averaged, self.ids), want))  # the EMA is not the weights
        loaded_ema = self.from_pretrained(self.export(ckpt, "--weights", "ema"))
        self.assertTrue(torch.equal(logits(loaded_ema, self.ids), logits(averaged, self.ids)),
                        "logits of the exported EMA differ")

    def test_save_pretrained_imports_and_loads(self):
        source = tiny_llama(seed=1)
        hf = tempfile.mkdtemp(prefix="fc-readers-pretrained.", dir=self.daemon.tmp)
        source.save_pretrained(hf, max_shard_size="40KB")  # several files and an index
        self.assertTrue(os.path.exists(os.path.join(hf, "model.safetensors.index.json")), sorted(os.listdir(hf)))
        pretrained = self.daemon.job("pretrained")
        cli("import", hf, "--root", self.daemon.root, "--job", pretrained, "--add-prefix", "model.")

        want = logits(source, self.ids)
        target = tiny_llama(seed=2)
        self.assertFalse(torch.equal(logits(target, self.ids), want))
        optimizer = torch.optim.AdamW(target.parameters(), lr=1e-3)
        with Checkpointer(target, optimizer, socket=self.daemon.socket, job=self.daemon.job("finetune")) as ck:
            self.assertEqual(ck.load_pretrained(job=pretrained), 0)
        self.assertTrue(torch.equal(logits(target, self.ids), want), "logits after load_pretrained differ")
        for name, t in source.state_dict().items():
            self.assertTrue(torch.equal(target.state_dict()[name], t), name)


if __name__ == "__main__":
    unittest.main(verbosity=2)

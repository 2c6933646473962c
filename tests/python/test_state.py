#!/usr/bin/python3
"""Flattening real optimizer state dicts, and their round trip through a real flashckptd.

- flatten/unflatten of AdamW (amsgrad) and SGD (momentum, and momentum=0 whose state holds None)
  state dicts gives back the same structure, the same Python types (tuples, ints vs floats, None,
  bools) and equal tensors, survives JSON, and loads into a fresh optimizer that then steps
  identically;
- odd leaves (nan, inf, bytes, int keys) round-trip; unsupported ones are a TypeError naming the key;
- first_difference names the first differing key;
- save through the daemon and resume into a fresh model/optimizer: identical state dicts.
"""

import collections
import json
import math
import os
import sys
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import torch  # noqa: E402

from flashckpt import _state  # noqa: E402
from flashckpt.torch import Checkpointer  # noqa: E402

torch.set_num_threads(1)


def make(opt, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    if opt == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), amsgrad=True)
    elif opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # momentum 0: state holds None
    return model, optimizer


def train(model, optimizer, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


class Same:
    """Asserts two state trees are equal in structure, types and values."""

    def __init__(self, test):
        self.test = test

    def __call__(self, a, b, path="state"):
        t = self.test
        if torch.is_tensor(a):
            t.assertTrue(torch.is_tensor(b), path)
            t.assertEqual(a.dtype, b.dtype, path)
            t.assertEqual(a.shape, b.shape, path)
            t.assertTrue(torch.equal(a, b), path)
            return
        if isinstance(a, dict):
            t.assertIsInstance(b, dict, path)
            t.assertEqual(list(a.keys()), list(b.keys()), path)
            for k in a:
                self(a[k], b[k], "%s.%s" % (path, k))
            return
        t.assertIs(type(a), type(b), "%s: %r vs %r" % (path, a, b))
        if isinstance(a, (list, tuple)):
            t.assertEqual(len(a), len(b), path)
            for i, (x, y) in enumerate(zip(a, b)):
                self(x, y, "%s.%d" % (path, i))
        elif isinstance(a, float) and math.isnan(a):
            t.assertTrue(math.isnan(b), path)
        else:
            t.assertEqual(a, b, path)


class FlattenTest(unittest.TestCase):
    def roundtrip(self, opt):
        model, optimizer = make(opt)
        train(model, optimizer, 3)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        tree, tensors = _state.flatten(state)
        tree = json.loads(json.dumps(tree))  # it travels as JSON
        back = _state.unflatten(tree, {n: t.clone() for n, t in tensors.items()})
        Same(self)(state, back)
        return model, optimizer, tensors, back

    def test_adamw_roundtrip(self):
        model, optimizer, tensors, back = self.roundtrip("adamw")
        names = list(tensors)
        self.assertEqual(names[0], "model.0.weight")
        self.assertIn("model.1.num_batches_tracked", names)
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
            self.assertIn("optimizer.state.0.%s" % k, names)
        self.assertIs(type(back["optimizer"]["param_groups"][0]["betas"]), tuple)
        self.assertIs(type(back["optimizer"]["param_groups"][0]["amsgrad"]), bool)
        self.assertIs(type(back["optimizer"]["param_groups"][0]["params"][0]), int)
        self.assertEqual(sorted(back["optimizer"]["state"].keys()), list(range(6)))

        # The unflattened state loads into a fresh optimizer, which then steps exactly like the original.
        model2, optimizer2 = make("adamw", seed=7)
        model2.load_state_dict(back["model"])
        optimizer2.load_state_dict(back["optimizer"])
        train(model, optimizer, 2, seed=5)
        train(model2, optimizer2, 2, seed=5)
        Same(self)(model.state_dict(), model2.state_dict())
        Same(self)(optimizer.state_dict(), optimizer2.state_dict())

    def test_sgd_roundtrip(self):
        _, _, tensors, back = self.roundtrip("sgd")
        self.assertIn("optimizer.state.0.momentum_buffer", tensors)
        self.assertIs(back["optimizer"]["param_groups"][0]["nesterov"], True)

    def test_sgd_without_momentum_keeps_none(self):
        _, optimizer, tensors, back = self.roundtrip("sgd0")
        self.assertNotIn("optimizer.state.0.momentum_buffer", tensors)
        if optimizer.state_dict()["state"]:  # torch 1.13 keeps a None buffer per parameter
            self.assertIsNone(back["optimizer"]["state"][0]["momentum_buffer"])
        else:  # torch 2 keeps no state at all for them
            self.assertEqual(back["optimizer"]["state"], {})
        self.assertIsNone(back["optimizer"]["param_groups"][0]["foreach"])

    def test_odd_leaves(self):
        state = collections.OrderedDict([
            ("nan", float("nan")), ("inf", [float("inf"), float("-inf")]), ("bytes", b"\x00\xff"),
            (3, {"int key": (1, 2.0, None, True, "s")}), ("big", 2**70), ("t", torch.arange(4)),
            ("empty", torch.zeros(0, 3)), ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ])
        tree, tensors = _state.flatten(state)
        self.assertEqual(list(tensors), ["t", "empty", "scalar"])
        back = _state.unflatten(json.loads(json.dumps(tree)), tensors)
        Same(self)(dict(state), back)

    def test_unsupported_leaf_names_the_key(self):
        with self.assertRaisesRegex(TypeError, r"'optimizer\.param_groups\.0\.fn'.*function"):
            _state.flatten({"optimizer": {"param_groups": [{"fn": lambda: 0}]}})
        with self.assertRaisesRegex(TypeError, r"'a': key .* of type tuple"):
            _state.flatten({"a": {(1, 2): 3}})

    def test_name_collision(self):
        with self.assertRaisesRegex(ValueError, "'a.b'"):
            _state.flatten({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}})

    def test_first_difference(self):
        saved, _ = _state.flatten({"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}, "n": 1})
        same, _ = _state.flatten({"model": {"w": torch.ones(2, 3), "b": torch.ones(3)}, "n": 5})
        self.assertIsNone(_state.first_difference(saved, same))
        shape, _ = _state.flatten({"model": {"w": torch.zeros(3, 3), "b": torch.zeros(3)}, "n": 1})
        self.assertEqual(_state.first_difference(saved, shape)[0], "model.w")
        dtype, _ = _state.flatten({"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.half)}, "n": 1})
        self.assertEqual(_state.first_difference(saved, dtype)[0], "model.b")
        extra, _ = _state.flatten({"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3), "c": 1}, "n": 1})
        key, why = _state.first_difference(saved, extra)
        self.assertEqual(key, "model.c")
        self.assertIn("not in the checkpoint", why)


class DaemonRoundTripTest(harness.DaemonTestCase):
    """Save through flashckptd, resume into a fresh model and optimizer: the same state dicts."""

    def check(self, opt):
        job = self.daemon.job(opt)
        model, optimizer = make(opt)
        train(model, optimizer, 3)
        with Checkpointer(model, optimizer, socket=self.daemon.socket, job=job) as ck:
            self.assertIsNone(ck.resume())
            ck.save(3, extra={"epoch": 1, "note": "three"})
            ck.wait_persisted(3, timeout=30)
        model2, optimizer2 = make(opt, seed=9)
        with Checkpointer(model2, optimizer2, socket=self.daemon.socket, job=job) as ck2:
            self.assertEqual(ck2.resume(), 3)
            self.assertEqual(ck2.extra, {"epoch": 1, "note": "three"})
        Same(self)(model.state_dict(), model2.state_dict())
        Same(self)(optimizer.state_dict(), optimizer2.state_dict())

    def test_adamw(self):
        self.check("adamw")

    def test_sgd(self):
        self.check("sgd")

    def test_sgd_without_momentum(self):
        self.check("sgd0")


if __name__ == "__main__":
    unittest.main(verbosity=2)

"""PyTorch integration: checkpoint a model and its optimizer through flashckptd, resume exactly.

    from flashckpt.torch import Checkpointer

    ck = Checkpointer(model, optimizer, socket="/run/flashckpt/flashckptd.sock", job="mlp",
                      ema_decay=0.999, ema_interval=1)
    start = ck.resume()                 # None: no checkpoint; else model, optimizer, RNG and EMA are restored
    pos = ck.extra["data_pos"] if start is not None else 0
    for step in range((start or 0) + 1, n + 1):
        loss = train_step()             # forward / backward
        ck.wait_copied()                # before optimizer.step(): the last snapshot has left the weights
        optimizer.step()
        if step % save_every == 0:
            ck.save(step, extra={"data_pos": pos}, loss=loss.item())   # persisted in the background
        elif step % ema_every == 0:
            ck.save(step, persist=False)                                # EMA update only
    ck.wait_persisted(step, timeout=600)
    ema = ck.ema_state_dict()           # {parameter name: fp32 tensor}: the daemon's EMA

What a checkpoint holds: every tensor of model.state_dict() ("model.<key>", kind model) and of
optimizer.state_dict() ("optimizer.state.<i>.<name>", kind optimizer), copied once into the
daemon's shared memory; and, in the rank's extra.rankNNNNN.json, the structure of both state dicts
with their non-tensor leaves (hyper-parameters, step counters: they come back with their types),
the RNG state (torch's CPU generator, and CUDA's when CUDA is initialised) and the `extra` given to
save(). The daemon keeps an fp32 EMA of the model's floating tensors (parameters and floating
buffers) when ema_decay is set.

The layout is registered with the daemon on the first save and again whenever the set, dtype or
shape of the tensors changes (Adam's state appears only after its first step).

Resume restores the latest complete checkpoint in place into the model's tensors; the optimizer
gets its state through optimizer.load_state_dict() (its fresh state may be empty). A checkpoint
whose structure differs from the current model/optimizer raises StructureMismatchError naming the
first differing key, and leaves the model untouched when the difference is known before loading.

Tensors must be contiguous CPU tensors of a supported dtype: a non-contiguous one raises a
ValueError naming it (fix: p.data = p.data.contiguous()), never a silent copy. The Python package
copies host memory only, with or without CUDA compiled into libflashckpt; CUDA tensors raise a
ValueError.
"""

import base64
import json
import time

import torch

from . import _state
from . import _tensors
from .client import Client
from .errors import FailedPreconditionError, NotFoundError, StructureMismatchError

_FORMAT = "flashckpt.torch"
_VERSION = 1
_TORCH_DTYPES = {k: getattr(torch, v) for k, v in _tensors.DTYPE_NAMES.items()}


def _distributed_rank_and_size():
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _rng_state():
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii")}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state):
    def tensor(text):
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
    torch.set_rng_state(tensor(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])


class Checkpointer:
    """Checkpoints `model` (an nn.Module, or anything with state_dict/load_state_dict) and `optimizer`.

    Keyword arguments are those of flashckpt.Client (socket, job, ema_*, backpressure,
    fatal_persist_errors, timeouts).
    rank and world_size default to torch.distributed's when it is initialised, else 0 and 1; unless
    given, shard_degree = world_size / (tp_degree * pp_degree) and shard_rank = rank // (tp_degree *
    pp_degree), i.e. data-parallel ranks are shards. rng=False leaves the RNG state out.

    Attributes: extra (the `extra` of the resumed checkpoint), resumed_step, saves, blocked_seconds
    (total time save() blocked the caller), last_snapshot, ema_step (step of the EMA last read).
    """

    def __init__(self, model, optimizer=None, *, socket, job, rank=None, world_size=None, tp_rank=0, tp_degree=1,
                 pp_rank=0, pp_degree=1, shard_rank=None, shard_degree=None, rng=True, **client_options):
        if rank is None or world_size is None:
            dist_rank, dist_size = _distributed_rank_and_size()
            rank = dist_rank if rank is None else rank
            world_size = dist_size if world_size is None else world_size
        group = tp_degree * pp_degree
        if shard_degree is None:
            shard_degree = max(1, world_size // group)
        if shard_rank is None:
            shard_rank = rank // group
        self.model = model
        self.optimizer = optimizer
        self.rng = rng
        self.client = Client(socket, job, rank=rank, world_size=world_size, tp_rank=tp_rank, tp_degree=tp_degree,
                             pp_rank=pp_rank, pp_degree=pp_degree, shard_rank=shard_rank, shard_degree=shard_degree,
                             **client_options)
        self.ema_enabled = client_options.get("ema_decay") is not None
        self.extra = None
        self.resumed_step = None
        self.ema_step = None
        self.saves = 0
        self.blocked_seconds = 0.0
        self.last_snapshot = None
        self._layout_key = None

    # --- state ---------------------------------------------------------------------------------

    def _state(self):
        state = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        return _state.flatten(state)

    @staticmethod
    def _kind(name):
        return "model" if name.startswith("model.") else "optimizer"

    def _register(self, tensors):
        key = tuple((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
        if key != self._layout_key:
            self.client.register(tensors, specs={n: {"kind": self._kind(n)} for n in tensors})
            self._layout_key = key

    # --- save ----------------------------------------------------------------------------------

    def save(self, step, extra=None, loss=None, persist=True):
        """Snapshots the model and optimizer as `step`; returns once the copy is done (a Snapshot whose
        `seconds` is how long this call blocked).

        persist=True: the daemon writes a checkpoint in the background (wait_persisted() waits for
        it); persist=False: EMA update only. `extra` (JSON-serialisable) comes back as ck.extra on
        resume; `loss` feeds the EMA's loss gate.
        """
        started = time.perf_counter()
        tree, tensors = self._state()
        self._register(tensors)
        payload = None
        if persist:
            payload = {"format": _FORMAT, "version": _VERSION, "state": tree, "user": extra}
            if self.rng:
                payload["rng"] = _rng_state()
        snap = self.client.snapshot(step, tensors, persist=persist, loss=loss, extra=payload)
        snap.seconds = time.perf_counter() - started  # all of save(), flattening included
        self.last_snapshot = snap
        self.saves += 1
        self.blocked_seconds += snap.seconds
        return snap

    def wait_copied(self):
        """Returns once the last snapshot has left the tensors (call it before optimizer.step())."""
        if self.last_snapshot is not None:
            self.last_snapshot.wait_copied()

    def wait_persisted(self, step, timeout=600.0):
        """Blocks until checkpoint `step` is complete: every rank's part of it durable (wait_complete)."""
        self.client.wait_complete(step, timeout)

    # --- resume --------------------------------------------------------------------------------

    def _settle(self, timeout):
        """Waits until no rank of the job has a snapshot committed but not yet persisted.

        A restarted trainer must not pick the latest complete checkpoint while its predecessor's last
        save is still being written: that one would complete later and refuse to be saved again.
        """
        deadline = time.monotonic() + timeout
        while True:
            jobs = [j for j in self.client.status().get("jobs", []) if j.get("job") == self.client.job]
            busy = any(s.get("state") in ("committed", "persisting")
                       for j in jobs for r in j.get("ranks", []) for s in r.get("slots", []))
            if not busy or time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def resume(self, step=None, timeout=600.0):
        """Restores checkpoint `step` (None: the latest complete one); returns its step, or None if there is none.

        Loads the model in place, the optimizer (through load_state_dict), the RNG state and the
        daemon's EMA as of that step, and sets self.extra. Raises StructureMismatchError naming the
        first differing key when the checkpoint's state dicts differ in structure from the current ones.
        """
        self._settle(min(timeout, 60.0))
        tree, tensors = self._state()
        if not tensors:
            raise ValueError("the model and optimizer hold no tensors; there is nothing to resume")

        # 1. Probe with one tensor (into scratch memory) to learn the checkpoint's structure.
        first = next(iter(tensors))
        scratch = torch.empty_like(tensors[first])
        self.client._register({first: scratch}, {first: {"kind": self._kind(first)}}, with_ema=False)
        self._layout_key = None
        try:
            found, extra = self.client.restore({first: scratch}, step=step, timeout=timeout)
        except (NotFoundError, FailedPreconditionError) as e:
            if "'%s'" % first not in e.message:
                raise
            raise StructureMismatchError(
                "the checkpoint does not match the current state; first differing key '%s': %s"
                % (first, e.message), key=first) from None
        if found is None:
            return None
        try:
            blob = json.loads(extra.decode("utf-8")) if extra else None
        except ValueError:
            blob = None
        if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
            raise StructureMismatchError("checkpoint-%d was not written by flashckpt.torch.Checkpointer (its extra "
                                         "state has no state-dict structure); restore it with flashckpt.Client" % found)
        saved = blob["state"]

        # 2. Compare structures. A fresh optimizer (no state yet) takes the checkpoint's state.
        skip = ()
        if self.optimizer is not None and len(self.optimizer.state) == 0:
            skip = (("optimizer", "state"),)
        diff = _state.first_difference(saved, tree, skip=skip)
        if diff:
            key, why = diff
            raise StructureMismatchError("checkpoint-%d does not match the current state; first differing key '%s': %s"
                                         % (found, key, why), key=key)

        # 3. Register the checkpoint's layout and restore: in place where the tensor exists now.
        targets = {}
        for leaf in _state.tensor_leaves(saved):
            name, shape, dtype = leaf["t"], tuple(leaf["shape"]), _TORCH_DTYPES[leaf["dtype"]]
            t = tensors.get(name)
            if t is None or t.dtype != dtype or tuple(t.shape) != shape:
                t = torch.empty(shape, dtype=dtype)
            targets[name] = t
        self._register(targets)
        got, extra = self.client.restore(targets, step=found, timeout=timeout)
        if got != found:
            raise FailedPreconditionError("FAILED_PRECONDITION", "asked for checkpoint-%d, the daemon restored %s"
                                          % (found, got))
        state = _state.unflatten(saved, targets)

        model_tree = _state.subtree(saved, ("model",))
        in_place = all(leaf["t"] in tensors for leaf in _state.tensor_leaves(model_tree))
        if not in_place or any("t" not in n for n in _leaves(model_tree)):
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.rng and "rng" in blob:
            _set_rng_state(blob["rng"])
        self.extra = blob.get("user")
        self.resumed_step = found
        return found

    def load_pretrained(self, step=None, job=None, timeout=600.0):
        """Loads the model weights only, in place, from checkpoint `step` (None: the latest complete
        one) of `job` (None: this Checkpointer's own); the optimizer is left as it is.

        For pretrained weights in Hugging Face safetensors: `flashckpt import HF_DIR --root ROOT
        --job JOB --add-prefix model.` makes the Hugging Face names this Checkpointer's
        `model.<state-dict key>`. Every model tensor must be in the checkpoint with its shape and
        dtype (NotFoundError / FailedPreconditionError name the first that is not). A checkpoint of
        another job starts no attempt of this one: the next save() is that of a fresh start.
        Returns the step loaded, or None when the job has no complete checkpoint.
        """
        _, tensors = self._state()
        if not any(n.startswith("model.") for n in tensors):
            raise ValueError("the model holds no tensors; there is nothing to load")
        self._register(tensors)
        source = None if job is None or job == self.client.job else job
        got, _ = self.client.restore(tensors, step=step, timeout=timeout, kinds=["model"], job=source)
        return got

    # --- EMA -----------------------------------------------------------------------------------

    def ema_state_dict(self, timeout=60.0):
        """The daemon's current EMA as {model state-dict key: fp32 tensor}, as of the last save().

        Raises FailedPreconditionError when no EMA update has been applied yet.
        """
        if not self.ema_enabled:
            raise ValueError("this Checkpointer was created without ema_decay; there is no EMA")
        self._register(self._state()[1])
        shapes = self.client.registered
        out = {}
        for name in self.client.ema_names:
            out[name] = torch.empty(shapes[name][1], dtype=torch.float32)
        step, _ = self.client.ema(out, timeout=timeout)
        if step is None:
            raise FailedPreconditionError("FAILED_PRECONDITION", "the EMA has no update yet: save() a step that is a "
                                          "multiple of ema_interval first")
        self.ema_step = step
        return {name[len("model."):] if name.startswith("model.") else name: t for name, t in out.items()}

    # --- misc ----------------------------------------------------------------------------------

    def status(self):
        """The daemon's status (see flashckpt.Client.status)."""
        return self.client.status()

    def close(self):
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _leaves(tree):
    """Every leaf node of `tree` (tensor or value)."""
    if tree is None:
        return
    for kind in ("d", "l", "u"):
        if kind in tree:
            for c in tree[kind]:
                yield from _leaves(c[1] if kind == "d" else c)
            return
    yield tree

"""Paddle integration: checkpoint a dygraph model and its optimizer through flashckptd, resume exactly.

    from flashckpt.paddle import Checkpointer

    ck = Checkpointer(model, optimizer, socket="/run/flashckpt/flashckptd.sock", job="mlp",
                      ema_decay=0.999, ema_interval=1)
    start = ck.resume()                 # None: no checkpoint; else model, optimizer, LR scheduler, RNG, EMA
    for step in range((start or 0) + 1, n + 1):
        loss = train_step()             # forward / backward
        ck.wait_copied()                # before optimizer.step(): the last snapshot has left the weights
        optimizer.step()
        optimizer.clear_grad()
        if step % save_every == 0:
            ck.save(step, extra={"data_pos": pos}, loss=float(loss))   # persisted in the background
        elif step % ema_every == 0:
            ck.save(step, persist=False)                               # EMA update only
    ck.wait_persisted(step, timeout=600)
    ema = ck.ema_state_dict()           # {parameter name: fp32 paddle.Tensor}: the daemon's EMA

What a checkpoint holds: every tensor of model.state_dict() ("model.<name>", kind model: the
model_state files and the daemon's EMA) and of optimizer.state_dict() ("optimizer.<accumulator
name>": the moments, the beta powers, master weights; kind optimizer), each handed to the daemon
through DLPack and copied once into its shared memory (no extra copy in Python). In the rank's
extra.rankNNNNN.json: the structure of both state dicts with their non-tensor values (the LR
scheduler's state, which Paddle keeps in the optimizer's state dict under "LR_Scheduler"), Paddle's
RNG state (the generator behind dropout; its own tuple of seed, offset and engine state, never a
pickle) and the `extra` given to save().

Resume restores the newest checkpoint (a memory checkpoint when it is the newest, else the latest
complete one on disk) in place into the model's tensors, gives the optimizer its state through
set_state_dict() (Paddle keeps it for accumulators that do not exist yet and uses it on the first
step), restores the RNG state, and the daemon loads the EMA of that step. A checkpoint whose model
structure differs from the current model raises StructureMismatchError naming the first differing
key, before any tensor is touched.

Memory checkpoints: save(step, tier="memory") keeps the snapshot in the daemon's memory only (never
written); a restarted trainer's resume() prefers it when it is the newest. resumed_tier says "memory"
or "disk".

This version serves one rank per job (world_size 1): a Paddle job of several ranks (data parallel,
sharding) is refused with a ValueError rather than saved incompletely.

export(checkpoint_dir, out_dir) writes Paddle's own files (model.pdparams, model.pdopt) from a
complete checkpoint, so a Paddle job without flashckpt loads it with paddle.load and set_state_dict.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List, Literal, Optional, Tuple, Union, cast

import paddle

from . import _state
from . import offline
from .client import Client, Snapshot
from .errors import CorruptionError, FailedPreconditionError, NotFoundError, StructureMismatchError

FORMAT = "flashckpt.paddle"
VERSION = 1
_MODEL, _OPTIMIZER = "model", "optimizer"
# Safetensors dtype names and Paddle's.
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def rng_state() -> List[List[Any]]:
    """Paddle's generator states (paddle.get_rng_state()), each as its own state tuple made JSON:
    [device, seed, offset, engine state as a list of ints]."""
    out = []
    for g in paddle.get_rng_state():
        device, seed, offset, engine = g.__getstate__()
        out.append([int(device), int(seed), int(offset), [int(c) for c in engine]])
    return out


def set_rng_state(state: object) -> None:
    """Puts back what rng_state() returned; a ValueError for anything that is not such a list."""
    from paddle.base.libpaddle import GeneratorState
    ok = isinstance(state, list) and all(
        isinstance(s, list) and len(s) == 4 and all(isinstance(v, int) for v in s[:3]) and isinstance(s[3], list)
        and all(isinstance(c, int) and 0 <= c < 256 for c in s[3]) for s in state)
    if not ok:
        raise CorruptionError("CORRUPTION", "the checkpoint's Paddle RNG state is not the list of generator states "
                              "flashckpt.paddle writes")
    states = []
    for device, seed, offset, engine in cast(List[List[Any]], state):
        g = GeneratorState.__new__(GeneratorState)
        g.__setstate__((device, seed, offset, engine))
        states.append(g)
    paddle.set_rng_state(states)


def _states(model: Any, optimizer: Any) -> Dict[str, Any]:
    # A parameter that requires gradients refuses DLPack; detach() shares its memory (no copy), so
    # a save reads and a resume writes the parameter itself.
    states = {_MODEL: {k: v.detach() if isinstance(v, paddle.Tensor) and not v.stop_gradient else v
                       for k, v in model.state_dict().items()}}
    if optimizer is not None:
        states[_OPTIMIZER] = optimizer.state_dict()
    return states


def _read_blob(extra: Optional[bytes], what: str) -> Dict[str, Any]:
    try:
        blob = json.loads(extra.decode("utf-8")) if extra else None
    except ValueError:
        blob = None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise FailedPreconditionError("FAILED_PRECONDITION", "%s was not saved by flashckpt.paddle (its extra state "
                                      "is not a %s record)" % (what, FORMAT))
    if blob.get("version") != VERSION:
        raise FailedPreconditionError("FAILED_PRECONDITION", "%s is of flashckpt.paddle version %r; this one reads "
                                      "version %d" % (what, blob.get("version"), VERSION))
    if not isinstance(blob.get("state"), dict):
        raise CorruptionError("CORRUPTION", "%s: its extra state has no state tree" % what)
    return blob


class Checkpointer:
    """Checkpoints a Paddle dygraph `model` (a paddle.nn.Layer) and `optimizer` (paddle.optimizer.*,
    its LR scheduler included) through flashckptd.

    Keyword arguments are those of flashckpt.Client (socket, job, ema_decay, ema_interval,
    backpressure, fatal_persist_errors, memory_checkpoints, timeouts). rng=False leaves the RNG
    state out.

    Attributes: model, optimizer, extra (the `extra` of the resumed checkpoint), resumed_step,
    resumed_tier ("memory" or "disk"), saves, blocked_seconds (total time save() blocked the
    caller), last_snapshot, ema_step (step of the EMA last read).
    """

    def __init__(self, model: Any, optimizer: Optional[Any] = None, *, socket: Union[str, os.PathLike[str]],
                 job: str, rng: bool = True, **client_options: Any) -> None:
        if not isinstance(model, paddle.nn.Layer):
            raise TypeError("model must be a paddle.nn.Layer, got %s" % type(model).__name__)
        world = paddle.distributed.get_world_size() if paddle.distributed.is_initialized() else 1
        if world != 1 or "world_size" in client_options or "rank" in client_options:
            raise ValueError("flashckpt.paddle serves jobs of one rank in this version; this one has %d" % world)
        self.model = model
        self.optimizer = optimizer
        self.rng = rng
        self.client = Client(socket, job, **client_options)
        self.ema_enabled = client_options.get("ema_decay") is not None
        self._registered: Optional[Tuple[Tuple[str, str, Tuple[int, ...]], ...]] = None
        self.extra: Any = None
        self.resumed_step: Optional[int] = None
        self.resumed_tier: Optional[str] = None
        self.ema_step: Optional[int] = None
        self.saves = 0
        self.blocked_seconds = 0.0
        self.last_snapshot: Optional[Snapshot] = None

    # --- registration --------------------------------------------------------------------------

    @staticmethod
    def _kind(name: str) -> str:
        return "model" if name.startswith(_MODEL + ".") else "optimizer"

    def _register(self, tensors: Dict[str, Any]) -> None:
        """Registers `tensors` unless the daemon has their names, dtypes and shapes already (the
        optimizer's state appears with its first step)."""
        key = tuple((n, str(t.dtype), tuple(t.shape)) for n, t in tensors.items())
        if key == self._registered:
            return
        self.client.register(tensors, {n: {"kind": self._kind(n)} for n in tensors})
        self._registered = key

    # --- save ----------------------------------------------------------------------------------

    def save(self, step: int, extra: object = None, loss: Optional[float] = None, persist: bool = True,
             tier: str = "disk") -> Snapshot:
        """Snapshots the model and the optimizer as `step`; returns once the copy is done (the
        returned Snapshot's `seconds` is how long this call blocked).

        persist=True: the daemon writes a checkpoint in the background (wait_persisted() waits for
        it); persist=False: EMA update only. `extra` (JSON-serialisable) comes back as ck.extra on
        resume; `loss` feeds the EMA's loss gate. tier="memory": a memory checkpoint, kept by the
        daemon and never written.
        """
        if tier not in ("disk", "memory"):
            raise ValueError("tier must be 'disk' or 'memory', got %r" % (tier,))
        if tier == "memory" and not persist:
            raise ValueError("tier='memory' keeps a full checkpoint; persist=False (an EMA update only) cannot be one")
        started = time.perf_counter()
        tree, tensors = _state.flatten(_states(self.model, self.optimizer))
        self._register(tensors)
        payload: Optional[Dict[str, Any]] = None
        if persist:
            payload = {"format": FORMAT, "version": VERSION, "state": tree, "user": extra}
            if self.rng:
                payload["rng"] = rng_state()
        snap = self.client.snapshot(step, tensors, persist=persist, loss=loss, extra=payload, tier=tier)
        snap.seconds = time.perf_counter() - started
        self.last_snapshot = snap
        self.saves += 1
        self.blocked_seconds += snap.seconds
        return snap

    def wait_copied(self) -> None:
        """Returns once the last snapshot has left the tensors (call it before optimizer.step());
        at once for CPU tensors. Raises the daemon's refusal of the commit."""
        if self.last_snapshot is not None:
            self.last_snapshot.wait_copied()
            self.last_snapshot.wait_committed()

    def wait_persisted(self, step: int, timeout: float = 600.0) -> None:
        """Blocks until checkpoint `step` is complete and durable."""
        self.client.wait_complete(step, timeout)

    # --- resume --------------------------------------------------------------------------------

    def _newest(self, step: Optional[int], timeout: float) -> Tuple[Optional[int], Optional[bytes]]:
        """(step, extra) of the checkpoint to restore: `step`, or the newest memory checkpoint
        when it is not older than the disk's, else the disk's; (None, None) when there is none."""
        if step is not None:
            extra = self.client.memory_extra(step, timeout, verify=False)
            if extra is None:
                found, extra = self.client.disk_extra(step, timeout)
                if found is None:
                    raise NotFoundError("NOT_FOUND", "job '%s' has no checkpoint of step %d, in memory or complete "
                                        "on disk" % (self.client.job, step))
            return step, extra
        memory, disk = self.client.restorable(timeout, verify=False)
        if memory and (disk is None or memory[0] >= disk):
            return memory[0], self.client.memory_extra(memory[0], timeout, verify=False)
        if disk is None:
            return None, None
        return self.client.disk_extra(disk, timeout)

    def resume(self, step: Optional[int] = None, timeout: float = 600.0) -> Optional[int]:
        """Restores checkpoint `step` (None: the newest, memory or disk); returns its step, or None
        when the job has none (nothing is changed then).

        The model's tensors are filled in place, the optimizer gets its state (and its LR
        scheduler's) through set_state_dict(), the RNG state is put back, the daemon loads its EMA
        of that step, and self.extra is set. StructureMismatchError, before any tensor is touched,
        when the checkpoint's model or optimizer state differs in structure from the current one
        (an optimizer without state yet takes any).
        """
        found, extra = self._newest(step, timeout)
        if found is None:
            return None
        what = "checkpoint %d of job '%s'" % (found, self.client.job)
        blob = _read_blob(extra, what)
        saved: Dict[str, Any] = blob["state"]
        current, current_tensors = _state.flatten(_states(self.model, self.optimizer))
        for key in (_MODEL, _OPTIMIZER):
            saved_part, current_part = _state.subtree(saved, (key,)), _state.subtree(current, (key,))
            if current_part is None:
                continue
            if saved_part is None:
                raise StructureMismatchError("%s holds no %s state" % (what, key))
            if key == _OPTIMIZER and not any(True for _ in _state.tensor_leaves(current_part)):
                continue  # a fresh optimizer: it takes the saved state whole
            diff = _state.first_difference(saved_part, current_part)
            if diff is not None:
                raise StructureMismatchError("%s does not fit the current %s: '%s': %s"
                                             % (what, key, diff[0], diff[1]), key=diff[0])
        # The tensors to restore into: the model's own (in place), the optimizer's where it has them
        # with the saved dtype and shape, else new ones.
        targets: Dict[str, Any] = {}
        for leaf in _state.tensor_leaves(saved):
            name, dtype, shape = leaf["t"], leaf["dtype"], [int(d) for d in leaf["shape"]]
            if dtype not in _DTYPES:
                raise CorruptionError("CORRUPTION", "%s: tensor '%s' has dtype %r" % (what, name, dtype))
            have = current_tensors.get(name)
            if have is not None and list(have.shape) == shape and str(have.dtype).split(".")[-1] == _DTYPES[dtype]:
                targets[name] = have
            elif name.startswith(_MODEL + "."):
                raise StructureMismatchError("%s: model tensor '%s' is not in the current "
                                             "model with its dtype and shape" % (what, name))
            else:
                targets[name] = paddle.empty(shape, dtype=_DTYPES[dtype])
        if self.optimizer is not None:
            self._check_accumulator_names(saved, what)
        self._register(targets)
        got, _ = self.client.restore(targets, step=found, timeout=timeout)
        if got != found:
            raise FailedPreconditionError("FAILED_PRECONDITION", "asked the daemon for step %d, it restored %s"
                                          % (found, got))
        restored = _state.unflatten(saved, targets)
        if self.optimizer is not None and _OPTIMIZER in restored:
            self.optimizer.set_state_dict(restored[_OPTIMIZER])
        if self.rng and "rng" in blob:
            set_rng_state(blob["rng"])
        self.extra = blob.get("user")
        self.resumed_step = found
        self.resumed_tier = self.client.restored_tier
        return found

    def _check_accumulator_names(self, saved: Dict[str, Any], what: str) -> None:
        """Paddle names an optimizer's accumulators after its parameters' unique names
        ("linear_0.w_0_moment1_0") and set_state_dict() skips those it has no parameter for: a
        saved accumulator of a parameter this optimizer lacks is an error here, not a silent skip."""
        part = _state.subtree(saved, (_OPTIMIZER,))
        params = [p.name for p in getattr(self.optimizer, "_parameter_list", None) or []]
        if part is None or "d" not in part or not params:
            return
        for key, node in part["d"]:
            if "t" not in node or not isinstance(key, str):
                continue
            if not any(key.startswith(p + "_") for p in params):
                raise StructureMismatchError(
                    "%s: optimizer state '%s' belongs to no parameter of this optimizer (%s, "
                    "...): Paddle names the state after the parameters' unique names, which follow the order the "
                    "layers were built in; build the model as the run that saved it did" % (what, key, params[0]))

    # --- EMA -----------------------------------------------------------------------------------

    def ema_state_dict(self, timeout: float = 60.0) -> Dict[str, Any]:
        """The daemon's current EMA as {model state-dict key: fp32 paddle.Tensor}, as of the last
        save(). FailedPreconditionError when no EMA update has been applied yet."""
        if not self.ema_enabled:
            raise ValueError("this Checkpointer was created without ema_decay; there is no EMA")
        _, tensors = _state.flatten(_states(self.model, self.optimizer))
        self._register(tensors)
        shapes = self.client.registered
        out = {name: paddle.empty(list(shapes[name][1]), dtype="float32") for name in self.client.ema_names}
        step, _ = self.client.ema(out, timeout=timeout)
        if step is None:
            raise FailedPreconditionError("FAILED_PRECONDITION", "the EMA has no update yet: save() a step that is a "
                                          "multiple of ema_interval first")
        self.ema_step = step
        prefix = _MODEL + "."
        return {name[len(prefix):]: t for name, t in out.items()}

    # --- misc ----------------------------------------------------------------------------------

    def status(self) -> Dict[str, Any]:
        """The daemon's status (see flashckpt.Client.status)."""
        return self.client.status()

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False


def _rank0_blob(checkpoint_dir: str) -> Dict[str, Any]:
    """The flashckpt.paddle record in rank 0's extra state of a complete checkpoint directory."""
    if not os.path.exists(os.path.join(checkpoint_dir, "metadata.json")):
        raise NotFoundError("NOT_FOUND", "%s is not a complete checkpoint (no metadata.json)" % checkpoint_dir)
    path = os.path.join(checkpoint_dir, "extra.rank00000.json")
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(1 << 26).decode("utf-8"))
    except FileNotFoundError:
        raise NotFoundError("NOT_FOUND", "%s has no extra state of rank 0" % checkpoint_dir) from None
    except ValueError as e:
        raise CorruptionError("CORRUPTION", "%s is not JSON: %s" % (path, e)) from None
    if not isinstance(record, dict) or record.get("format") != "flashckpt-extra" or record.get("encoding") != "json":
        raise CorruptionError("CORRUPTION", "%s is not a flashckpt extra state in JSON" % path)
    return _read_blob(json.dumps(record.get("data")).encode("utf-8"), checkpoint_dir)


def export(checkpoint_dir: Union[str, os.PathLike[str]], out_dir: Union[str, os.PathLike[str]],
           name: str = "model") -> Dict[str, str]:
    """Writes a checkpoint saved by flashckpt.paddle as Paddle's own files: <name>.pdparams (the
    model's state dict, under its parameters' names) and, when it holds an optimizer, <name>.pdopt
    (the optimizer's state dict: its accumulators and LR scheduler state), both with paddle.save.

    A Paddle job without flashckpt then loads it with model.set_state_dict(paddle.load(...)) and
    optimizer.set_state_dict(paddle.load(...)). Every tensor is read through flashckpt's export,
    merged from any layout and verified against the checkpoint's checksums. out_dir is created if
    needed; the files appear whole (written beside and renamed). Returns {"pdparams": path,
    "pdopt": path or ""}.
    """
    from safetensors.paddle import load_file  # paddlepaddle depends on safetensors

    src, out = os.fspath(checkpoint_dir), os.fspath(out_dir)
    blob = _rank0_blob(src)
    tree = blob["state"]
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".flashckpt-export-", dir=out)
    try:
        written: Dict[str, str] = {"pdparams": "", "pdopt": ""}
        for key, suffix in ((_MODEL, "pdparams"), (_OPTIMIZER, "pdopt")):
            part = _state.subtree(tree, (key,))
            if part is None:
                continue
            leaves = list(_state.tensor_leaves(part))
            tensors: Dict[str, Any] = {}
            if leaves:
                staged = os.path.join(work, key)
                offline.export(src, staged, weights=key, max_shard_size="1000GB")
                arrays = load_file(os.path.join(staged, "model.safetensors"))
                for leaf in leaves:
                    if leaf["t"] not in arrays:
                        raise CorruptionError("CORRUPTION", "%s: tensor '%s' of the state tree is not in the "
                                              "checkpoint" % (src, leaf["t"]))
                    tensors[leaf["t"]] = arrays[leaf["t"]]
            state = _state.unflatten(part, tensors)
            path = os.path.join(out, "%s.%s" % (name, suffix))
            tmp = os.path.join(work, os.path.basename(path))
            paddle.save(state, tmp)
            os.replace(tmp, path)
            written[suffix] = path
        return written
    finally:
        shutil.rmtree(work, ignore_errors=True)

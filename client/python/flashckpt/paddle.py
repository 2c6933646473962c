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

Data parallel: in a job started with paddle.distributed (init_parallel_env(); 2 to 4 processes with
gloo on the CPU are tested), every rank makes a Checkpointer, and rank and world size come from
paddle.distributed. The ranks hold the same model and optimizer state, so it is written once: its
bytes are cut into equal shares, one per rank (whole tensors, and flat ranges of those that cross a
cut, as flashckpt.torch does for DDP; the model's buffers are rank 0's: paddle.DataParallel syncs
them only when it wraps the model, so after a resume every rank has rank 0's BatchNorm statistics). With the daemon's EMA every
rank writes the whole state instead (each daemon's EMA covers what its rank registers), as
flashckpt.torch does. resume() is collective: every rank calls it and all restore the same step
(the newest memory checkpoint every rank holds, else the oldest of the latest complete checkpoints
the ranks see), a failure on any rank raises on every rank, and after a memory restore the ranks
broadcast their shares to each other. A job of another world size resumes a disk checkpoint (a rank
the saving job did not have takes rank 0's part, without its RNG state).

Sharding stage 1: in a fleet job with sharding_degree equal to its world size, each rank's
DygraphShardingOptimizer updates its own parameters and holds their optimizer state. Each rank writes
that state whole (and its share of the model, or the whole model with the EMA), and records in its
part the structure of every rank's optimizer state (each parameter's accumulators, named after it, as
the rank's own are), so that a job of another sharding degree, or one process with a plain
optimizer, resumes it: each rank restores the accumulators of the parameters it updates now, and
set_state_dict() gives them to its optimizer; the EMA comes back with the step. Other sharding
optimizers (DygraphShardingOptimizerV2, GroupShardedOptimizerStage2/3, which Paddle runs on GPUs
only) are refused with a ValueError. A parallel wrapper's "_layers." prefix is not part of the keys.

export(checkpoint_dir, out_dir) writes Paddle's own files (model.pdparams, model.pdopt) from a
complete checkpoint, so a Paddle job without flashckpt loads it with paddle.load and set_state_dict.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from typing import Any, Dict, List, Literal, Optional, Tuple, Union, cast

import paddle

from . import _agree
from . import _state
from . import offline
from . import _shares
from ._shares import owners
from .client import Client, Snapshot
from .errors import (CorruptionError, FailedPreconditionError, FlashckptError, NotFoundError,
                     StructureMismatchError)

FORMAT = "flashckpt.paddle"
VERSION = 1
_MODEL, _OPTIMIZER = "model", "optimizer"
# A model's trainable parameters are EagerParamBase with trainable set; its other tensors (BatchNorm's
# statistics, which are EagerParamBase too, and frozen parameters) count as buffers.
_PARAMETER = paddle.base.framework.EagerParamBase
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


class _PaddleGroup(_agree.Collective):
    """The job's paddle.distributed ranks, for _agree (the default group; gloo or NCCL bound the waits)."""

    def gather(self, value: object) -> List[Any]:
        out: List[Any] = []
        paddle.distributed.all_gather_object(out, value)
        return out

    def broadcast(self, value: object, source: int) -> Any:
        box = [value]
        paddle.distributed.broadcast_object_list(box, src=source)
        return box[0]


def _sharding_optimizer(optimizer: Any) -> Optional[Any]:
    """`optimizer`, or the one a hybrid-parallel wrapper holds, when it is one of Paddle's sharding
    optimizers, else None."""
    for opt in (optimizer, getattr(optimizer, "_inner_opt", None)):
        name = type(opt).__name__
        if "Sharding" in name or "Sharded" in name:
            return opt
    return None


def _prune(tree: Dict[str, Any], keep: Any) -> Dict[str, Any]:
    """`tree` without the dict entries whose tensor leaf is not named in `keep`."""
    if "d" in tree:
        return {"d": [[k, _prune(c, keep)] for k, c in tree["d"] if "t" not in c or c["t"] in keep]}
    if "l" in tree or "u" in tree:
        key = "l" if "l" in tree else "u"
        return {key: [_prune(c, keep) for c in tree[key]]}
    return tree


def _wrappers() -> Tuple[type, ...]:
    """paddle.DataParallel and fleet's parallel wrappers (MetaParallelBase), which hold the model."""
    out: List[type] = [paddle.DataParallel]
    try:
        from paddle.distributed.fleet.meta_parallel.meta_parallel_base import MetaParallelBase
        out.append(MetaParallelBase)
    except ImportError:
        pass
    return tuple(out)


def _unwrapped(model: Any) -> Any:
    """The layer a parallel wrapper holds (fleet's distributed_model prefixes its state-dict keys
    with "_layers."), so that a checkpoint's keys do not depend on how the job was parallel."""
    wrappers = _wrappers()
    while isinstance(model, wrappers) and isinstance(getattr(model, "_layers", None), paddle.nn.Layer):
        model = model._layers
    return model


def _unsupported_parallelism(model: Any) -> Optional[str]:
    """Why a job's parallelism is one flashckpt.paddle cannot save, or None: tensor or pipeline
    parallelism (fleet's mp_degree or pp_degree above 1), or a group-sharded model (stages 2 and 3),
    whose ranks hold different tensors under the same names."""
    name = type(model).__name__
    if any(word in name for word in ("TensorParallel", "PipelineParallel", "SegmentParallel", "GroupSharded")):
        return "a model wrapped in %s" % name
    try:
        from paddle.distributed import fleet
        hcg = fleet.get_hybrid_communicate_group()
    except Exception:  # fleet not initialised: no hybrid parallelism
        return None
    if hcg is None:
        return None
    mp, pp = hcg.get_model_parallel_world_size(), hcg.get_pipe_parallel_world_size()
    if mp > 1 or pp > 1:
        return "fleet's mp_degree %d and pp_degree %d (tensor and pipeline parallelism)" % (mp, pp)
    return None


def _states(model: Any, optimizer: Any) -> Dict[str, Any]:
    # A parameter that requires gradients refuses DLPack; detach() shares its memory (no copy), so
    # a save reads and a resume writes the parameter itself.
    states = {_MODEL: {k: v.detach() if isinstance(v, paddle.Tensor) and not v.stop_gradient else v
                       for k, v in _unwrapped(model).state_dict().items()}}
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
        if any(k in client_options for k in ("rank", "world_size", "shard_rank", "shard_degree")):
            raise ValueError("flashckpt.paddle takes the rank and world size from paddle.distributed")
        unsupported = _unsupported_parallelism(model)
        if unsupported:
            raise ValueError("flashckpt.paddle saves one rank, data parallelism and sharding stage 1, not %s"
                             % unsupported)
        distributed = paddle.distributed.is_initialized()
        self._world = paddle.distributed.get_world_size() if distributed else 1
        self._rank = paddle.distributed.get_rank() if distributed else 0
        # Sharding stage 1 (fleet's DygraphShardingOptimizer): each rank holds the optimizer state of
        # its own parameters, whole.
        self._sharding = _sharding_optimizer(optimizer)
        if self._sharding is not None:
            name = type(self._sharding).__name__
            if name != "DygraphShardingOptimizer" or getattr(self._sharding, "_sharding_world_size", 0) != self._world:
                raise ValueError("flashckpt.paddle saves sharding stage 1 (DygraphShardingOptimizer, its sharding "
                                 "degree the job's world size), not %s: its ranks hold parts of the optimizer state "
                                 "it does not save yet" % name)
        self._group: Optional[_PaddleGroup] = _PaddleGroup() if self._world > 1 else None
        self.model = model
        self.optimizer = optimizer
        self.rng = rng
        self.client = Client(socket, job, rank=self._rank, world_size=self._world, shard_rank=self._rank,
                             shard_degree=self._world, **client_options)
        self.ema_enabled = client_options.get("ema_decay") is not None
        # Data-parallel shares: each byte of the replicated state written by one rank.
        self._shares = self._world > 1 and not self.ema_enabled
        self._registered: Optional[Tuple[Any, ...]] = None
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

    def _register(self, tensors: Dict[str, Any], specs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Registers `tensors` (with `specs`, a share's flat ranges) unless the daemon has that layout
        already (the optimizer's state appears with its first step)."""
        specs = specs or {}
        key = (tuple((n, str(t.dtype), tuple(t.shape)) for n, t in tensors.items()),
               tuple(sorted((n, repr(v)) for n, v in specs.items())))
        if key == self._registered:
            return
        self.client.register(tensors, {n: dict(specs.get(n, {}), kind=self._kind(n)) for n in tensors})
        self._registered = key

    def _replicated(self, tensors: Dict[str, Any]) -> Tuple[List[str], List[str]]:
        """(replicated, buffers): the names of the tensors alike on every data-parallel rank (the
        model's parameters, and the optimizer's state unless it is sharded), in state order, and the
        model's buffers. Any other tensor (a sharding rank's optimizer state) is the rank's own."""
        params = {_MODEL + "." + k for k, v in _unwrapped(self.model).state_dict().items()
                  if isinstance(v, _PARAMETER) and getattr(v, "trainable", False)}
        buffers = [n for n in tensors if n.startswith(_MODEL + ".") and n not in params]
        if self._sharding is not None:
            return [n for n in tensors if n in params], buffers
        return [n for n in tensors if n not in buffers], buffers

    def _owned(self, key: str) -> bool:
        """Whether optimizer state `key` (an accumulator, named after its parameter) belongs to this
        rank: every key without a sharding optimizer, else those of the parameters it updates."""
        if self._sharding is None:
            return True
        mine = [p.name for p in self._sharding._rank2params[self._sharding._sharding_rank]]
        return any(key.startswith(n + "_") for n in mine) or not any(
            key.startswith(p.name + "_") for p in self._all_params())

    def _all_params(self) -> List[Any]:
        """Every sharding rank's trainable parameters (a frozen one has no optimizer state)."""
        assert self._sharding is not None
        return [p for r in sorted(self._sharding._rank2params) for p in self._sharding._rank2params[r]
                if not p.stop_gradient]

    def _whole_optimizer(self, tree: Dict[str, Any]) -> Dict[str, Any]:
        """A sharding rank's `tree` with the structure of every other rank's optimizer state added
        (leaves of the accumulators of the parameters it does not update, which their owners write):
        a job of another sharding degree then finds every accumulator in any rank's part. Each
        parameter has the accumulators this rank's have, named after it, of its shape where theirs
        are of their parameter's (moments), else of the same shape (beta powers)."""
        part = _state.subtree(tree, (_OPTIMIZER,))
        if self._sharding is None or part is None or "d" not in part:
            return tree
        if "master_weights" in dict((k, c) for k, c in part["d"]):
            raise ValueError("flashckpt.paddle does not yet save a sharding optimizer's master weights "
                             "(multi_precision): another sharding degree could not resume them")
        # The template: an own parameter of more than one element (so that state of its shape is
        # told from state of shape [1], the beta powers), else any own one.
        mine = sorted((p for p in self._sharding._rank2params[self._sharding._sharding_rank] if not p.stop_gradient),
                      key=lambda p: int(p.size) <= 1)
        entries = dict((k, c) for k, c in part["d"])
        template: List[Tuple[str, str, Optional[List[int]]]] = []
        for p in mine:
            own = [(k, c) for k, c in part["d"] if isinstance(k, str) and "t" in c and k.startswith(p.name + "_")]
            if own:
                of_param = [int(d) for d in p.shape]
                template = [(k[len(p.name):], c["dtype"], None if c["shape"] == of_param else c["shape"])
                            for k, c in own]
                break
        if not template:
            if self._all_params():
                raise ValueError("sharding rank %d has no optimizer state of its own to describe the other ranks' "
                                 "by (no step taken yet, or no trainable parameter of its own): save after the "
                                 "first optimizer step, with a sharding degree that gives every rank a "
                                 "parameter" % self._rank)
            return tree
        added = []
        for p in self._all_params():
            for suffix, dtype, shape in template:
                key = p.name + suffix
                if key not in entries:
                    leaf = {"t": "%s.%s" % (_OPTIMIZER, key), "dtype": dtype,
                            "shape": [int(d) for d in p.shape] if shape is None else shape}
                    added.append([key, leaf])
        whole = {"d": list(part["d"]) + added}
        return {"d": [[k, whole if k == _OPTIMIZER else c] for k, c in tree["d"]]}

    def _split(self, tensors: Dict[str, Any], rank: Optional[int] = None
               ) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
        """(tensors, specs): what data-parallel `rank` (this one by default) writes of `tensors`:
        its share of the replicated tensors (_shares.share_ranges), and the buffers on rank 0."""
        if not self._shares:
            return tensors, {}
        in_order, buffers = self._replicated(tensors)
        # A view: DLPack hands the daemon the parameter's own memory.
        return _shares.split(tensors, in_order, buffers, self._rank if rank is None else rank, self._world,
                             numel=lambda t: int(t.size), flat_slice=lambda t, first, end: t.reshape([-1])[first:end],
                             shape=lambda t: [int(d) for d in t.shape])

    def _spread_plan(self, targets: Dict[str, Any]) -> List[Dict[str, List[Tuple[str, int, int]]]]:
        """Per rank, by dtype, the pieces (name, first, end) of `targets` it broadcasts in _spread:
        its share of the replicated tensors, and for rank 0 the buffers."""
        in_order, buffers = self._replicated(targets)
        sizes = [(n, int(targets[n].size), targets[n].element_size()) for n in in_order]
        plan = []
        for r, ranges in enumerate(owners(sizes, self._world)):
            pieces = [(n, a, b) for n, (a, b) in ranges.items() if b > a]
            if r == 0:
                pieces += [(n, 0, int(targets[n].size)) for n in buffers if int(targets[n].size) > 0]
            by_dtype: Dict[str, List[Tuple[str, int, int]]] = {}
            for piece in pieces:
                by_dtype.setdefault(str(targets[piece[0]].dtype), []).append(piece)
            plan.append(by_dtype)
        return plan

    def _spread(self, targets: Dict[str, Any]) -> None:
        """After each rank restored its share of `targets` from its memory checkpoint, every rank
        broadcasts its share (one flat tensor per dtype) and the others copy it in; rank 0 sends the
        buffers too. Every rank makes the same broadcasts in the same order (the ranks compared the
        plans' digests first)."""
        for r, by_dtype in enumerate(self._spread_plan(targets)):
            for dtype in sorted(by_dtype):
                group = by_dtype[dtype]
                if r == self._rank:
                    flat = paddle.concat([targets[n].reshape([-1])[a:b] for n, a, b in group])
                else:
                    flat = paddle.empty([sum(b - a for _, a, b in group)], dtype=targets[group[0][0]].dtype)
                paddle.distributed.broadcast(flat, src=r)
                if r != self._rank:
                    at = 0
                    for n, a, b in group:
                        targets[n].reshape([-1])[a:b] = flat[at:at + b - a]
                        at += b - a

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
        mine, specs = self._split(tensors)
        self._register(mine, specs)
        payload: Optional[Dict[str, Any]] = None
        if persist:
            payload = {"format": FORMAT, "version": VERSION, "state": self._whole_optimizer(tree), "user": extra,
                       "world_size": self._world}
            if self.rng:
                payload["rng"] = rng_state()
        snap = self.client.snapshot(step, mine, persist=persist, loss=loss, extra=payload, tier=tier)
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

    def resume(self, step: Optional[int] = None, timeout: float = 600.0) -> Optional[int]:
        """Restores checkpoint `step` (None: the newest, memory or disk); returns its step, or None
        when the job has none (nothing is changed then).

        The model's tensors are filled in place, the optimizer gets its state (and its LR
        scheduler's) through set_state_dict(), the RNG state is put back, the daemon loads its EMA
        of that step, and self.extra is set. StructureMismatchError, before any tensor is touched,
        when the checkpoint's model or optimizer state differs in structure from the current one
        (an optimizer without state yet takes any). In a job of several ranks every rank calls it
        and all restore the same step; a failure on one raises on every rank.
        """
        group = self._group
        if group is not None:
            _agree.same_step(group, step)
        memory_failed: Optional[str] = None
        if step is None:
            memory = self._memory_step(timeout)
            if memory is not None:
                memory_failed = self._from_memory(memory, timeout)
                if memory_failed is None:
                    return memory
                warnings.warn("%s; every rank restores from disk instead" % memory_failed, RuntimeWarning)
        return self._from_disk(step, timeout, memory_failed)

    def _memory_step(self, timeout: float) -> Optional[int]:
        """The memory checkpoint every rank restores: the newest all hold, unless a complete disk
        checkpoint is newer; None: the disk path."""
        mine: Optional[Tuple[List[int], Optional[int]]] = None
        error: Optional[BaseException] = None
        try:
            _agree.settle(self.client, min(timeout, 60.0))  # the last save of the trainer that died counts too
            mine = self.client.restorable(min(timeout, 60.0), verify=False)
        except FlashckptError as e:
            warnings.warn("rank %d cannot list its memory checkpoints (%s); resuming from disk" % (self._rank, e),
                          RuntimeWarning)
        except BaseException as e:  # reported to the other ranks before it is raised
            error = e
        return _agree.memory_step(self._group, error, mine)

    def _from_memory(self, step: int, timeout: float) -> Optional[str]:
        """Restores memory checkpoint `step` on every rank: None once every rank has, else why not
        (a daemon's error on some rank), and every rank reads the disk instead."""
        error: Optional[BaseException] = None
        restored: Optional[Tuple[Dict[str, Any], Dict[str, Any]]] = None
        digest: Optional[str] = None
        try:
            what = "memory checkpoint step %d of job '%s'" % (step, self.client.job)
            extra = self.client.memory_extra(step, min(timeout, 60.0), verify=False)
            if extra is None:
                raise FailedPreconditionError("FAILED_PRECONDITION", "rank %d no longer holds %s" % (self._rank, what))
            blob = _read_blob(extra, what)
            if blob.get("world_size", 1) != self._world:
                raise FailedPreconditionError("FAILED_PRECONDITION", "%s was taken by a job of %s ranks, this one has "
                                              "%d" % (what, blob.get("world_size"), self._world))
            targets = self._targets(blob, what)
            # The layout save() registers: the daemon keeps the segment that holds the checkpoint.
            self._restore_into(step, *self._split(targets), timeout=timeout)
            restored = (blob, targets)
            if self._shares:  # the broadcasts of _spread must pair up on every rank
                digest = hashlib.sha256(repr(self._spread_plan(targets)).encode("utf-8")).hexdigest()
        except BaseException as e:  # reported to the other ranks before anything is raised
            error = e
        failed = _agree.memory_failure(self._group, step, error, digest)
        if failed is not None:
            return "the restore of memory checkpoint step %d failed on rank %d (%s)" % (step, failed[0], failed[1])
        assert restored is not None
        mblob, mtargets = restored
        if self._shares:
            self._spread(mtargets)
        _agree.stage(self._group, "load memory checkpoint step %d" % step,
                     lambda: self._hand_over(step, mblob, mtargets))
        return None

    def _from_disk(self, step: Optional[int], timeout: float, memory_failed: Optional[str]) -> Optional[int]:
        """Restores checkpoint `step` (None: the latest complete one) after the ranks agree on it."""
        group = self._group

        def read() -> Tuple[Optional[int], Optional[Dict[str, Any]]]:
            _agree.settle(self.client, min(timeout, 60.0))
            return self._probe(step, timeout)
        found, blob = _agree.stage(group, "read its checkpoint", read)
        if group is not None:
            agreed = _agree.common_step(group, found, self.client.job)
            if agreed is not None:
                found, blob = _agree.stage(group, "read checkpoint-%d" % agreed,
                                           lambda: (found, blob) if agreed == found else self._probe(agreed, timeout))
        if found is None:
            if memory_failed is not None:
                raise FailedPreconditionError("FAILED_PRECONDITION", "%s and job '%s' has no complete checkpoint on "
                                              "disk to restore instead; restart every rank of the job"
                                              % (memory_failed, self.client.job))
            return None
        chosen: int = found
        if group is not None:
            blob, _ = _agree.borrow_part(group, self._rank, chosen, blob)
        elif blob is None:
            raise FailedPreconditionError("FAILED_PRECONDITION", "checkpoint-%d holds no part of rank %d: it was saved "
                                          "by fewer ranks (a job of more ranks resumes it under paddle.distributed) "
                                          "or not by flashckpt.paddle" % (chosen, self._rank))
        part: Dict[str, Any] = blob
        what = "checkpoint %d of job '%s'" % (chosen, self.client.job)
        targets = _agree.stage(group, "match %s" % what, lambda: self._targets(part, what))

        def restore() -> None:
            self._restore_into(chosen, targets, {}, timeout=timeout)
            self._hand_over(chosen, part, targets)
        _agree.stage(group, "restore %s" % what, restore)
        return chosen

    def _probe(self, step: Optional[int], timeout: float) -> Tuple[Optional[int], Optional[Dict[str, Any]]]:
        """(step, blob) of checkpoint `step` (None: the newest complete one on disk) from this rank's
        extra state (no tensor is read); blob None when the checkpoint holds no part of this rank;
        (None, None) when there is none."""
        what = "checkpoint %s of job '%s'" % ("latest" if step is None else step, self.client.job)
        held = None if step is None else self.client.memory_extra(step, min(timeout, 60.0), verify=False)
        if held is not None:
            return step, _read_blob(held, what)
        found, extra = self.client.disk_extra(step, min(timeout, 60.0))
        if found is None:
            if step is not None:
                raise NotFoundError("NOT_FOUND", "job '%s' has no checkpoint of step %d, in memory or complete on disk"
                                    % (self.client.job, step))
            return None, None
        return found, (_read_blob(extra, "checkpoint %d of job '%s'" % (found, self.client.job)) if extra else None)

    def _targets(self, blob: Dict[str, Any], what: str) -> Dict[str, Any]:
        """The tensors to restore checkpoint `blob` into, by name: the model's own (in place), the
        optimizer's where it has them with the saved dtype and shape, else new ones.
        StructureMismatchError, before any tensor is touched, when the saved model or optimizer state
        differs in structure from the current one (an optimizer without state yet takes any)."""
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
        targets: Dict[str, Any] = {}
        for leaf in _state.tensor_leaves(saved):
            name, dtype, shape = leaf["t"], leaf["dtype"], [int(d) for d in leaf["shape"]]
            if not name.startswith(_MODEL + ".") and not self._owned(name[len(_OPTIMIZER) + 1:]):
                continue  # another sharding rank's: it restores it
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
        return targets

    def _restore_into(self, step: int, tensors: Dict[str, Any], specs: Dict[str, Dict[str, Any]],
                      timeout: float) -> None:
        self._register(tensors, specs)
        got, _ = self.client.restore(tensors, step=step, timeout=timeout)
        if got != step:
            raise FailedPreconditionError("FAILED_PRECONDITION", "asked the daemon for step %d, it restored %s"
                                          % (step, got))

    def _hand_over(self, step: int, blob: Dict[str, Any], targets: Dict[str, Any]) -> None:
        """Gives the optimizer its restored state, puts the RNG state back and sets extra."""
        restored = _state.unflatten(_prune(blob["state"], targets), targets)
        if self.optimizer is not None and _OPTIMIZER in restored:
            self.optimizer.set_state_dict(restored[_OPTIMIZER])
        if self.rng and "rng" in blob:
            set_rng_state(blob["rng"])
        self.extra = blob.get("user")
        self.resumed_step = step
        self.resumed_tier = self.client.restored_tier

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

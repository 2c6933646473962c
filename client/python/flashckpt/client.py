"""flashckpt.Client: one trainer rank's connection to the local flashckptd.

    import numpy as np, flashckpt
    w = np.zeros((1024, 1024), np.float32)
    with flashckpt.Client("/run/flashckpt/flashckptd.sock", job="llama", ema_decay=0.999) as c:
        c.register({"w": w})
        step, extra = c.restore({"w": w})         # (None, None) when the job has no checkpoint
        for step in range(step or 0, 1000):
            ...                                   # train
            c.snapshot(step, {"w": w}, persist=step % 100 == 0, extra={"data_pos": step})
        c.wait_persisted(900, timeout=600)

Tensors are given as a mapping of name -> tensor, where a tensor is anything with ``__dlpack__`` or
the buffer protocol (numpy arrays, torch tensors). snapshot() copies each tensor once, straight into
the daemon's shared memory, and returns when the copy is done, so the caller may modify the tensors
as soon as it returns. There is no other copy.

CUDA tensors (where libflashckpt has CUDA compiled in: _flashckpt.WITH_CUDA) are copied by the
library's device path: snapshot() returns once the device-to-host copies are queued, after the work
queued so far on the stream the tensors are computed on (`cuda_stream`; by default torch's current
stream of their device for torch tensors, else the legacy default stream), and the returned Snapshot's
wait_copied() waits for them: call it before anything writes the tensors (the optimizer step, a
forward pass that updates buffers such as BatchNorm's running statistics). restore()
and ema() copy into device memory and return once the copies are complete. A snapshot's device
tensors must all be on one device; host and device tensors may be mixed.

Tensors must be contiguous (C order) tensors of a supported dtype (float64, float32, float16,
bfloat16, int64, int32, int16, int8, uint8, bool). A non-contiguous tensor is refused with a
ValueError that names it, not copied silently; an unsupported dtype is a TypeError.

Errors from the daemon are flashckpt.FlashckptError subclasses (flashckpt.errors). Every call has a
deadline. A Client may be used from one thread at a time; the GIL is released while it copies or
waits.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import time
from typing import (Any, ContextManager, Dict, Iterable, List, Literal, Mapping, Optional, Set, Tuple, TypeVar, Union,
                    overload)

from . import _flashckpt
from . import _tensors
from ._tensors import Shape, Tensors
from .errors import DaemonUnavailableError

_TensorsT = TypeVar("_TensorsT", bound=Tensors)

_KINDS = ("model", "optimizer", "master_weight")
_SPEC_KEYS = ("kind", "param", "replica", "global_shape", "box_offset", "box_shape", "flat_range")


class Snapshot:
    """A snapshot handed to the daemon by Client.snapshot().

    For host tensors the copy is complete and the commit answered when snapshot() returns, so both
    waits return at once. With CUDA tensors the device-to-host copies may still be in flight:
    wait_copied() is the call to make before mutating the tensors (the optimizer step). Until then
    the Snapshot holds the tensors, so that their memory is not reused under the copies.
    """

    __slots__ = ("step", "persist", "seconds", "tier", "on_device", "_handle", "_keep", "_answered")

    step: int
    persist: bool
    seconds: float
    tier: str
    on_device: bool

    def __init__(self, step: int, persist: bool, seconds: float, tier: str = "disk",
                 handle: Optional[_flashckpt.Snapshot] = None, keep: Optional[List[object]] = None,
                 on_device: bool = False) -> None:
        self.step = step
        self.persist = persist
        self.seconds = seconds  # how long snapshot() blocked the caller
        self.tier = tier  # "disk" (written by the daemon) or "memory" (kept in its memory only)
        self.on_device = on_device  # some of its tensors are CUDA device memory
        self._handle = handle
        self._keep = keep
        self._answered = handle is None or not on_device  # the commit's answer was raised or seen

    def wait_copied(self) -> None:
        """Returns once the snapshot's tensors may be modified (at once for host tensors); raises
        the copies' error (the save then fails too)."""
        if self._handle is not None:
            self._handle.wait_copied()
        self._keep = None

    def wait_committed(self) -> None:
        """Returns once the daemon has accepted the commit (at once for host tensors); raises its
        refusal. It does not wait for the files (Client.wait_persisted does). A refusal not seen
        through it is raised by the client's next snapshot()."""
        self._answered = True
        if self._handle is not None:
            self._handle.wait_committed()

    def __repr__(self) -> str:
        return "Snapshot(step=%d, persist=%s, tier=%s, blocked=%.3f ms)" % (self.step, self.persist, self.tier,
                                                                             self.seconds * 1e3)


def _on_device(views: List[_tensors.View], what: str, cuda_stream: Optional[int]) -> Tuple[int, ContextManager[Any]]:
    """(cuda_stream, context) for a call with `views`: the stream the device tensors are computed on
    (`cuda_stream` if given; for torch tensors torch's current stream of their device; else 0, the
    legacy default stream) and a context that makes their device the current one. (0, a null context)
    without device tensors."""
    devices = sorted({v.device for v in views if v.device >= 0})
    if not devices:
        return 0, contextlib.nullcontext()
    if len(devices) > 1:
        raise ValueError("the tensors given to %s() are on CUDA devices %s; one call takes the tensors of one device "
                         "(and host tensors)" % (what, ", ".join("cuda:%d" % d for d in devices)))
    torch = sys.modules.get("torch")
    if torch is None or not any(isinstance(v.keep, torch.Tensor) for v in views if v.device >= 0):
        return (cuda_stream or 0), contextlib.nullcontext()
    device = torch.device("cuda", devices[0])
    if cuda_stream is None:
        cuda_stream = int(torch.cuda.current_stream(device).cuda_stream)
    return cuda_stream, torch.cuda.device(device)


def encode_extra(extra: object) -> bytes:
    """bytes for the daemon: None -> b"", bytes as is, str as UTF-8, anything else as JSON."""
    if extra is None:
        return b""
    if isinstance(extra, (bytes, bytearray, memoryview)):
        return bytes(extra)
    if isinstance(extra, str):
        return extra.encode("utf-8")
    return json.dumps(extra, separators=(",", ":")).encode("utf-8")


class Client:
    """One rank's session with flashckptd. See the module docstring for an example.

    Arguments:
      socket, job, rank: the daemon's UNIX socket, the job name ([A-Za-z0-9._-]{1,128}), this rank.
      world_size, tp_*, pp_*, shard_*: the rank's place in the job's parallel layout
        (world_size = tp_degree * pp_degree * shard_degree).
      ema_decay: keep an fp32 EMA of the weights in the daemon (0 < decay < 1); None: no EMA.
      ema_interval: update the EMA on snapshots whose step is a multiple of it.
      ema_init: "first" (the first update copies the weights) or "zeros".
      ema_model_params: "fp32" (EMA of fp32 model tensors and master weights) or "all" (bf16/fp16 too).
      ema_loss_threshold: skip EMA updates of snapshots whose loss is above it.
      backpressure: "wait" for a free slot (up to slot_timeout) or "skip" (ResourceExhaustedError).
      fatal_persist_errors: False (default): a save that fails in the background (full disk, I/O
        error) raises from wait_persisted() and shows in status(), and snapshots go on. True: every
        later snapshot() raises that save's error too (its code; the message names the step, the
        file and the errno text), so training stops instead of going on without checkpoints.
      run_id: this run's id ([A-Za-z0-9._:-]{1,64}, the same on every rank of one attempt, e.g. a
        scheduler's job id with its restart count); None: from the environment (FLASHCKPT_RUN_ID,
        torchrun's TORCHELASTIC_RUN_ID and restart count, Slurm's SLURM_JOB_ID and restart count),
        else the daemon picks (the run of the job's live ranks, or a new one). Ranks on several
        daemons (nodes) need one of the first two. See the run_id property. An EMA another run left
        is not continued.
      overwrite: a run that does not restore may not save into a job with complete checkpoints of
        another run (FailedPreconditionError at the first snapshot); overwrite=True starts a new
        lineage instead: the first snapshot deletes the job's checkpoints of other runs.
      memory_checkpoints: this rank takes memory checkpoints (snapshot(..., tier="memory")):
        register() then raises FailedPreconditionError when the daemon cannot keep them (--slots
        below 2), instead of the first memory snapshot failing mid-run.
      connect_timeout, rpc_timeout, slot_timeout: deadlines in seconds.
      copy_threads: threads copying large tensors (0: min(cores, 8)).

    Raises DaemonUnavailableError (naming the socket) when no daemon answers within connect_timeout.
    """

    def __init__(self, socket: Union[str, os.PathLike[str]], job: str, rank: int = 0, world_size: int = 1,
                 tp_rank: int = 0, tp_degree: int = 1, pp_rank: int = 0, pp_degree: int = 1, shard_rank: int = 0,
                 shard_degree: int = 1, ema_decay: Optional[float] = None, ema_interval: int = 1,
                 ema_init: str = "first", ema_model_params: str = "fp32", ema_loss_threshold: Optional[float] = None,
                 backpressure: str = "wait", *, connect_timeout: float = 10.0, rpc_timeout: float = 30.0,
                 slot_timeout: float = 60.0, copy_threads: int = 0, fatal_persist_errors: bool = False,
                 run_id: Optional[str] = None, overwrite: bool = False, memory_checkpoints: bool = False) -> None:
        if ema_init not in ("first", "zeros"):
            raise ValueError("ema_init must be 'first' or 'zeros', got %r" % (ema_init,))
        if ema_model_params not in ("fp32", "all"):
            raise ValueError("ema_model_params must be 'fp32' or 'all', got %r" % (ema_model_params,))
        if backpressure not in ("wait", "skip"):
            raise ValueError("backpressure must be 'wait' or 'skip', got %r" % (backpressure,))
        if ema_decay is not None and not 0.0 < float(ema_decay) < 1.0:
            raise ValueError("ema_decay must lie strictly between 0 and 1, got %r" % (ema_decay,))
        if int(ema_interval) < 1:
            raise ValueError("ema_interval must be at least 1, got %r" % (ema_interval,))
        self.socket = os.fspath(socket)
        self.job = job
        self.rank = int(rank)
        self.topology: Tuple[int, ...] = tuple(int(x) for x in (world_size, tp_rank, tp_degree, pp_rank,
                                                                pp_degree, shard_rank, shard_degree))
        self._ema: Optional[Dict[str, object]] = None
        if ema_decay is not None:
            self._ema = {"decay": float(ema_decay), "interval": int(ema_interval), "init_zeros": ema_init == "zeros",
                         "all_float_params": ema_model_params == "all",
                         "loss_threshold": None if ema_loss_threshold is None else float(ema_loss_threshold)}
        self._layout: Optional[Dict[str, Tuple[str, Shape]]] = None  # name -> (dtype, shape), as registered
        self._replicas: Set[str] = set()
        self._ema_shapes: Dict[str, Shape] = {}  # EMA tensor name -> shape
        self._impl: Optional[_flashckpt.Client] = None
        # The last snapshot: it holds its device tensors until its copies are done (the C++ client's
        # next call waits for them), and the next snapshot() raises its commit's refusal if nothing
        # has asked for it (wait_committed).
        self._last: Optional[Snapshot] = None
        # Where the last restore() that found a checkpoint got it: "memory" or "disk" (None before).
        self.restored_tier: Optional[str] = None
        started = time.monotonic()
        try:
            self._impl = _flashckpt.Client(self.socket, job, self.rank, float(rpc_timeout), float(connect_timeout),
                                           float(slot_timeout), backpressure == "skip", int(copy_threads),
                                           bool(fatal_persist_errors), "" if run_id is None else str(run_id),
                                           bool(overwrite), bool(memory_checkpoints))
        except DaemonUnavailableError as e:
            hint = ("no socket file exists at %s" % self.socket if not os.path.exists(self.socket)
                    else "the socket %s exists but nothing answers on it" % self.socket)
            raise DaemonUnavailableError(
                e.code, "%s; %s after %.1f s: is flashckptd running (flashckptd --socket %s --root DIR)?"
                % (e.message, hint, time.monotonic() - started, self.socket)) from None

    # --- layout --------------------------------------------------------------------------------

    def register(self, tensors: Tensors, specs: Optional[Mapping[str, Mapping[str, Any]]] = None) -> None:
        """Declares this rank's tensors (a mapping name -> tensor); the daemon creates their shared memory.

        `specs` optionally maps a name to its options: kind ("model" (default), "optimizer",
        "master_weight"), param (for a master weight: the model parameter it is the fp32 copy of),
        replica (held here but saved by another rank), and for sharded tensors global_shape,
        box_offset, box_shape, flat_range=(begin, end). Registering again with a different set,
        dtype or shape of tensors replaces the layout.
        """
        self._register(tensors, specs, with_ema=True)

    def _register(self, tensors: Tensors, specs: Optional[Mapping[str, Mapping[str, Any]]], with_ema: bool) -> None:
        specs = specs or {}
        pairs = _tensors.items(tensors)
        names = {name for name, _ in pairs}
        for name in specs:
            if name not in names:
                raise ValueError("specs names tensor '%s', which is not among the tensors registered" % name)
        out: List[_flashckpt.Spec] = []
        layout: Dict[str, Tuple[str, Shape]] = {}
        replicas: Set[str] = set()
        ema_shapes: Dict[str, Shape] = {}
        for name, obj in pairs:
            v = _tensors.view(name, obj)
            opts = dict(specs.get(name, {}))
            unknown = set(opts) - set(_SPEC_KEYS)
            if unknown:
                raise ValueError("tensor '%s': unknown spec option(s) %s; known: %s"
                                 % (name, ", ".join(sorted(unknown)), ", ".join(_SPEC_KEYS)))
            s = _flashckpt.Spec()
            s.name = name
            s.kind = opts.get("kind", "model")
            if s.kind not in _KINDS:
                raise ValueError("tensor '%s': kind must be one of %s, got %r" % (name, ", ".join(_KINDS), s.kind))
            s.dtype = v.dtype
            s.shape = list(v.shape)
            s.global_shape = list(opts.get("global_shape", ()))
            s.box_offset = list(opts.get("box_offset", ()))
            s.box_shape = list(opts.get("box_shape", ()))
            fr = opts.get("flat_range")
            s.flat_range = None if fr is None else (int(fr[0]), int(fr[1]))
            s.replica = bool(opts.get("replica", False))
            s.param = str(opts.get("param", ""))
            out.append(s)
            layout[name] = (v.dtype, v.shape)
            if s.replica:
                replicas.add(name)
            ema_shapes[s.param or name] = v.shape
        self._live().register(self.topology, out, self._ema if with_ema else None)
        self._layout, self._replicas, self._ema_shapes = layout, replicas, ema_shapes

    def populate(self) -> None:
        """Maps the pages of every slot for writing on a client thread and returns at once, so the
        first snapshot into each slot does not take the first-touch faults of fresh shared memory
        (about as long as the copy itself). Call it after register() when the first snapshot is some
        steps away; the first snapshot starts it when it has not run. Raises FailedPreconditionError
        before register()."""
        self._live().populate()

    @property
    def registered(self) -> Dict[str, Tuple[str, Shape]]:
        """name -> (dtype, shape) of the registered tensors (dtype as safetensors names it: F32, BF16, ...)."""
        return dict(self._layout or {})

    def _buffers(self, tensors: Tensors, writable: bool, what: str, include_replicas: bool) -> List[_tensors.View]:
        if self._layout is None:
            raise ValueError("register() the rank's tensors before calling %s()" % what)
        views: List[_tensors.View] = []
        seen: Set[str] = set()
        for name, obj in _tensors.items(tensors):
            want = self._layout.get(name)
            if want is None:
                raise ValueError("tensor '%s' given to %s() was not registered; register() again when the set of "
                                 "tensors changes" % (name, what))
            v = _tensors.view(name, obj, writable=writable)
            if (v.dtype, v.shape) != want:
                raise ValueError("tensor '%s' given to %s() is %s but was registered as %s; register() again when "
                                 "shapes or dtypes change" % (name, what, _tensors.describe(v.dtype, v.shape),
                                                               _tensors.describe(*want)))
            if name in self._replicas and not include_replicas:
                continue
            seen.add(name)
            views.append(v)
        for name in self._layout:
            if name not in seen and (include_replicas or name not in self._replicas):
                raise ValueError("tensor '%s' is registered but was not given to %s()" % (name, what))
        return views

    # --- save ----------------------------------------------------------------------------------

    def snapshot(self, step: int, tensors: Tensors, persist: bool = True, loss: Optional[float] = None,
                 extra: object = None, tier: str = "disk", cuda_stream: Optional[int] = None) -> Snapshot:
        """Copies `tensors` (every registered, non-replica tensor) into a free slot and commits it as `step`.

        Returns a Snapshot once the copy is done: the tensors may be modified right away. With CUDA
        tensors it returns once the copies are queued; call its wait_copied() before anything writes
        them (the optimizer step, and a forward pass that updates buffers such as BatchNorm's running
        statistics). cuda_stream: the cudaStream_t (an int) the device tensors are computed on;
        default: torch's current stream of their device for torch tensors, else the legacy default
        stream. Device tensors that are not torch's must be on the current device. With CUDA tensors
        only, the client's commit thread takes the slot too: the daemon's refusal of the snapshot is
        raised by its wait_committed() (or this client's next snapshot()), not by this call. The daemon
        persists it in the background (persist=False: EMA only, no files). `loss` feeds the EMA's loss
        gate; `extra` (bytes, str, or a JSON-serialisable object) is saved as extra.rankNNNNN.json
        (at most 4 MiB). Steps must increase within a session.

        tier="memory": a memory checkpoint of every tensor (replicas included) that the daemon keeps
        in its shared memory, checksummed in the background, and never writes; a later restore() of
        this rank (a restarted trainer) is served from it (restored_tier says so). Needs the daemon's
        --slots >= 2 and a rank without EMA.
        """
        if tier not in ("disk", "memory"):
            raise ValueError("tier must be 'disk' or 'memory', got %r" % (tier,))
        if tier == "memory" and not persist:
            raise ValueError("tier='memory' keeps a full checkpoint; persist=False (an EMA update only) cannot be one")
        started = time.perf_counter()
        views = self._buffers(tensors, writable=False, what="snapshot", include_replicas=tier == "memory")
        data = encode_extra(extra)
        stream, device = _on_device(views, "snapshot", cuda_stream)
        last = self._last
        if last is not None and not last._answered:
            last.wait_committed()  # a refusal of the last device snapshot is raised, not lost
        with device:
            handle = self._live().snapshot(int(step), [v.buffer() for v in views], bool(persist),
                                           None if loss is None else float(loss), data, tier, stream)
        keep = [v.keep for v in views if v.device >= 0]
        snap = Snapshot(int(step), bool(persist), time.perf_counter() - started, tier, handle, keep or None, bool(keep))
        self._last = snap
        return snap

    def wait_persisted(self, step: int, timeout: float = 600.0) -> None:
        """Blocks until this rank's files of `step` (or a later step) are durable.

        Raises DeadlineExceededError after `timeout` seconds, or the error of a failed save.
        """
        self._live().wait_persisted(int(step), float(timeout))

    def wait_complete(self, step: int, timeout: float = 600.0) -> None:
        """Blocks until checkpoint `step` is complete: every rank's part durable, metadata.json written.

        Raises this rank's save error; FailedPreconditionError when the step can never complete (its
        ranks saved it in different attempts; the message names them); DeadlineExceededError naming
        the ranks whose part is missing after `timeout` seconds.
        """
        self._live().wait_complete(int(step), float(timeout))

    @property
    def run_id(self) -> str:
        """The run this session belongs to (given, or the daemon's choice); "" before register()."""
        return self._live().run_id()

    # --- restore -------------------------------------------------------------------------------

    def restore(self, tensors: Tensors, step: Optional[int] = None, timeout: float = 600.0,
                convert_dtype: bool = False, kinds: Optional[Iterable[str]] = None,
                job: Optional[str] = None, cuda_stream: Optional[int] = None) -> Tuple[Optional[int], Optional[bytes]]:
        """Restores checkpoint `step` (None: the latest complete one) into `tensors`, in place.

        `tensors` must hold every registered tensor (replicas included). Returns (step, extra): the
        step restored and this rank's extra as bytes (a JSON value comes back as JSON text), or
        (None, None) when the job has no complete checkpoint yet, leaving the tensors untouched.
        The daemon verifies checksums before any byte reaches the tensors, and loads the
        checkpoint's EMA, so the average continues from the restored step. The checkpoint may have
        been saved in another parallel layout. With convert_dtype=True, bfloat16/float16 tensors
        are filled from float32 saved ones (rounded to nearest even).

        kinds: None restores every tensor; a list of "model", "optimizer", "master_weight" restores
        only the tensors registered with those kinds (the others are left as they are, and the EMA
        is not loaded): kinds=["model"] starts from pretrained weights with a fresh optimizer. A
        kind the checkpoint holds no tensor of raises FailedPreconditionError naming it.
        job: read the checkpoint of this job (under the same daemon root) instead of this client's
        own, e.g. one made by `flashckpt import`; needs kinds. It starts no attempt of this job.
        CUDA tensors are filled after the work queued so far on their stream (torch's current
        stream, or `cuda_stream`), and the copies are complete when restore() returns.
        """
        if kinds is not None:
            kinds = [str(k) for k in kinds]
            bad = [k for k in kinds if k not in ("model", "optimizer", "master_weight")]
            if bad or not kinds:
                raise ValueError("kinds must be a non-empty list of 'model', 'optimizer', 'master_weight', got %r"
                                 % (kinds,))
        if job is not None and kinds is None:
            raise ValueError("a restore from another job needs kinds (e.g. kinds=['model'])")
        views = self._buffers(tensors, writable=True, what="restore", include_replicas=True)
        stream, device = _on_device(views, "restore", cuda_stream)
        with device:
            found, got, extra, _, tier = self._live().restore(None if step is None else int(step),
                                                              [v.buffer() for v in views], float(timeout),
                                                              bool(convert_dtype), kinds or [],
                                                              "" if job is None else str(job), stream)
        if not found:
            return None, None
        self.restored_tier = tier
        return got, (extra or None)

    def restorable(self, timeout: float = 60.0, verify: bool = True) -> Tuple[List[int], Optional[int]]:
        """(memory steps, disk step): this rank's memory checkpoints on its daemon, each verified now,
        newest first, and the job's newest complete checkpoint on disk (None: none).

        The ranks of a job exchange these, agree on a step (the newest every rank holds in memory,
        unless the disk has a newer one) and restore() it. Works before register(). `timeout` bounds
        the wait for the checksums of the last memory checkpoints. verify=False lists them without
        reading them against their checksums: restore() verifies the one it restores anyway (and
        falls back to the files when it fails), so a resume reads its checkpoint once.
        """
        steps, disk, _ = self._live().restorable(float(timeout), verify=bool(verify))
        return list(steps), disk

    def memory_extra(self, step: int, timeout: float = 60.0, verify: bool = True) -> Optional[bytes]:
        """The extra state of this rank's memory checkpoint `step` (its bytes verified unless
        verify=False), or None when it does not hold it: what to register before restoring it. Works
        before register()."""
        steps, _, extra = self._live().restorable(float(timeout), int(step), bool(verify))
        return extra if int(step) in steps else None

    def disk_extra(self, step: Optional[int] = None, timeout: float = 60.0) -> Tuple[Optional[int], Optional[bytes]]:
        """(step, extra) of this rank's part of complete checkpoint `step` on disk (None: the newest),
        read from its files without reading a tensor: what to register before restoring it. Works
        before register(). (None, None) when there is no such checkpoint; extra is None when the
        checkpoint holds no part of this rank (a job of fewer ranks saved it) or no extra state."""
        found, extra = self._live().disk_extra(None if step is None else int(step), float(timeout))
        if found is None:
            return None, None
        return found, (extra or None)

    # --- EMA -----------------------------------------------------------------------------------

    @property
    def ema_names(self) -> List[str]:
        """Names of this rank's EMA tensors (each is float32 with the shape of the tensor it tracks)."""
        return list(self._live().ema_names())

    @overload
    def ema(self, tensors: None = None, timeout: float = 60.0) -> Tuple[Optional[int], Dict[str, Any]]: ...

    @overload
    def ema(self, tensors: _TensorsT, timeout: float = 60.0) -> Tuple[Optional[int], _TensorsT]: ...

    def ema(self, tensors: Optional[Tensors] = None, timeout: float = 60.0) -> Tuple[Optional[int], Tensors]:
        """Copies the daemon's current EMA into `tensors` (name -> float32 tensor, every EMA name).

        With tensors=None, numpy float32 arrays are allocated. The copy is as of the last snapshot
        committed. Returns (step, tensors): step is that of the last EMA update, None (tensors
        untouched) when no update has been applied yet. CUDA tensors are written once the work
        queued on torch's current stream is done (it is synchronised first), and the copies are
        complete when ema() returns.
        """
        if tensors is None:
            import numpy as np
            tensors = {n: np.empty(self._ema_shapes[n], dtype=np.float32) for n in self.ema_names}
        views: List[_tensors.View] = []
        for name, obj in _tensors.items(tensors):
            v = _tensors.view(name, obj, writable=True)
            if v.dtype != "F32" or (name in self._ema_shapes and v.shape != tuple(self._ema_shapes[name])):
                raise ValueError("EMA tensor '%s' needs a float32 tensor of shape %s, got %s"
                                 % (name, tuple(self._ema_shapes.get(name, ())), _tensors.describe(v.dtype, v.shape)))
            views.append(v)
        _, device = _on_device(views, "ema", None)
        torch = sys.modules.get("torch")
        with device:
            if torch is not None and any(v.device >= 0 and isinstance(v.keep, torch.Tensor) for v in views):
                # The library copies on the legacy default stream, which does not wait for torch's
                # non-blocking streams: work still queued there may be using this memory.
                torch.cuda.current_stream().synchronize()
            buffers = [v.buffer() for v in views]
            initialized, step = self._live().ema(buffers, float(timeout))
        return (step if initialized else None), tensors

    # --- operators -----------------------------------------------------------------------------

    def status(self) -> Dict[str, Any]:
        """The daemon's status as a dict (GetStatus in protobuf's JSON mapping: 64-bit integers are strings)."""
        status: Dict[str, Any] = json.loads(self._live().status_json())
        return status

    def close(self) -> None:
        """Closes the session; later calls raise CancelledError. Idempotent."""
        if self._impl is not None:
            self._impl.close()
        self._last = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

    def _live(self) -> _flashckpt.Client:
        if self._impl is None:
            raise RuntimeError("the client is not connected")
        return self._impl

    def __repr__(self) -> str:
        return "flashckpt.Client(socket=%r, job=%r, rank=%d, tensors=%d)" % (
            self.socket, self.job, self.rank, len(self._layout or {}))

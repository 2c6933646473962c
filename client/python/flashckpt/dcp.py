"""torch.distributed.checkpoint (DCP) through flashckptd: a storage writer and a storage reader.

DCP users switch with one argument:

    import torch.distributed.checkpoint as dcp
    from flashckpt.dcp import FlashckptReader, FlashckptWriter

    writer = FlashckptWriter(socket="/run/flashckpt/flashckptd.sock", job="llama")
    dcp.save(state_dict, storage_writer=writer, checkpoint_id=step)          # returns once staged
    future = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=step,
                            process_group=gloo_group)                        # returns once staged too
    ...
    reader = FlashckptReader(client=writer.client)     # the same session: see "Runs" below
    dcp.load(state_dict, storage_reader=reader, checkpoint_id=step)  # checkpoint_id None: the latest

checkpoint_id is the step: an int, or a name or path ending in it ("step_300", "/ckpt/checkpoint-300").

What goes where. Each rank copies the tensors it writes straight into the daemon's shared memory
(Client.snapshot: one copy, checksummed there) and goes on; the daemon writes safetensors files in the
background (with its EMA of the model tensors when ema_decay is set) and commits the checkpoint once
every rank's part is durable. A DTensor is saved as its local box of the global tensor; any other
tensor is taken to be alike on every rank, as DCP takes it, and one rank writes it; other values are
pickled with torch.save and written as bytes by one rank. Each rank also writes a description of its
part, from which FlashckptReader builds DCP's Metadata (one chunk per tensor, its whole extent): the
daemon assembles any box a loading rank asks for, so a checkpoint loads on another mesh or world size.

When it returns. dcp.save: once every rank's part is in the daemon's memory (durable=True: once the
checkpoint is complete on disk). dcp.async_save: stage() copies this rank's tensors into the daemon on
the calling thread and returns; the future completes once the checkpoint is complete on disk
(durable=False: once planned). Give async_save a process group of its own (a gloo group from
torch.distributed.new_group), as DCP asks. writer.wait_persisted(step) waits at any time. The writers
of all ranks are given the same steps.

Runs. A process that saves into a job which already has checkpoints must have restored from it in
the same flashckpt session, or pass overwrite=True (see flashckpt.Client's run_id and overwrite):
give the reader and the writer one Client (FlashckptReader(client=writer.client)).

Memory checkpoints. FlashckptWriter(tier="memory"), or writer.tier = "memory" before a save (and
"disk" before another; give memory_checkpoints=True from the start then): the daemon keeps the step
in its memory, checksummed, and never writes it. Each rank's memory checkpoint holds all the rank
loads (the boxes it holds as replicas and its own non-tensor values too) and the registration a
restarted process needs. FlashckptReader loads the newest step every rank holds in memory unless
the disk has a newer complete checkpoint, as flashckpt.torch.Checkpointer.resume() picks it, on the
mesh that took it; a failed restore on any rank sends every rank to the disk.

The writer's ema_state_dict() gives the EMA of this rank's written tensors (a DTensor's: its box);
`flashckpt export --weights ema` gives the whole EMA of a checkpoint, and the Checkpointer's
ema_state_dict() DTensors placed like the parameters.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
import time
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import _tensors
from . import _torch_agree
from . import _torch_dtensor
from .client import Client
from .errors import DeadlineExceededError, FailedPreconditionError, FlashckptError, NotFoundError

try:  # the function DCP's planners flatten state dicts with, so that both name values alike
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
except ImportError:  # pragma: no cover - every torch with DCP's async_save has it
    flatten_state_dict = None

__all__ = ["FlashckptWriter", "FlashckptReader", "step_of"]

FORMAT = "flashckpt.dcp"
VERSION = 1
# Names of the tensors that are not the state dict's: each rank's description of what it wrote
# (a header of 4 int64: version, world size, description length, capacity; then the JSON
# description, padded to its capacity) and the pickled values. '@' cannot start a DCP name of
# ours: the daemon refuses it, so these start with a prefix no state-dict key is likely to have.
PREFIX = "__flashckpt_dcp__."
_TORCH_DTYPES = {k: getattr(torch, v) for k, v in _tensors.DTYPE_NAMES.items()}


def _header_name(rank: int) -> str:
    return "%srank%05d.header" % (PREFIX, rank)


def _description_name(rank: int) -> str:
    return "%srank%05d.description" % (PREFIX, rank)


def _bytes_name(fqn: str) -> str:
    return PREFIX + "bytes." + fqn


def _capacity(n: int) -> int:
    """Room for n bytes, rounded up to a power of two (at least 256), so that a value that grows a
    little does not change the registered layout (a new registration) at every save."""
    return max(256, 1 << max(0, n - 1).bit_length())


def step_of(checkpoint_id: Union[int, str, os.PathLike, None]) -> Optional[int]:
    """The step a checkpoint_id names: an int, or the number that ends the last component of a name
    or path ("step_300", "/ckpt/checkpoint-300", "300"); None for None. ValueError otherwise."""
    if checkpoint_id is None:
        return None
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        if checkpoint_id < 0:
            raise ValueError("a flashckpt checkpoint_id is a step, at least 0; got %d" % checkpoint_id)
        return checkpoint_id
    if isinstance(checkpoint_id, bool):
        raise ValueError("a flashckpt checkpoint_id is a step, not %r" % (checkpoint_id,))
    text = os.path.basename(str(os.fspath(checkpoint_id)).rstrip("/"))
    m = re.search(r"(\d+)$", text)
    if m is None:
        raise ValueError("a flashckpt checkpoint_id is the step: an int, or a name or path whose last component ends "
                         "in it ('step_300', '/ckpt/checkpoint-300'); got %r" % (checkpoint_id,))
    return int(m.group(1))


class _Session:
    """The flashckpt.Client of a writer or reader: given, or made on first use with the rank and
    world size of torch.distributed (0 and 1 without it)."""

    def __init__(self, client: Optional[Client], socket: Optional[Union[str, os.PathLike]], job: Optional[str],
                 options: Mapping[str, Any]) -> None:
        if client is None and (socket is None or job is None):
            raise ValueError("give socket= and job= (the daemon's socket and the job's name), or client=")
        if client is not None and (socket is not None or job is not None or options):
            raise ValueError("client= comes with its own socket, job and options; give either client= or those")
        self._client = client
        self._socket, self._job, self._options = socket, job, dict(options)
        # A Client serves one thread at a time: async_save's thread waits for durability while the
        # training thread may stage the next step.
        self.lock = threading.Lock()

    @property
    def client(self) -> Client:
        if self._client is None:
            rank, world = _torch_agree.rank_and_size()
            assert self._socket is not None and self._job is not None
            self._client = Client(self._socket, self._job, rank=rank, world_size=world, shard_rank=rank,
                                  shard_degree=world, **self._options)
        return self._client


class _Part:
    """What one rank writes of one step: its tensors (name -> contiguous host tensor) with their
    registration specs, and the description the reader builds DCP's Metadata from."""

    def __init__(self, rank: int, world_size: int, model_prefixes: Sequence[str]) -> None:
        self.rank, self.world_size = rank, world_size
        self.model_prefixes = tuple(model_prefixes)
        self.tensors: Dict[str, torch.Tensor] = {}
        self.specs: Dict[str, Dict[str, Any]] = {}
        self.described: Dict[str, Dict[str, Any]] = {}  # fqn -> {"dtype", "size", "requires_grad"}
        self.values: Dict[str, Dict[str, Any]] = {}  # fqn -> {"tensor", "length"}: the values it writes
        self.held: Dict[str, Dict[str, Any]] = {}  # fqn -> {"tensor", "length"}: every value it holds
        self.planner_data: Any = None
        self.nbytes: Dict[str, int] = {}  # fqn -> bytes written (WriteResult.size_in_bytes)

    def kind(self, fqn: str) -> str:
        return "model" if fqn.startswith(self.model_prefixes) else "optimizer"

    def describe(self, fqn: str, t: torch.Tensor, size: Sequence[int]) -> None:
        dtype = _tensors.dtype_and_shape(fqn, t)[0]
        self.described[fqn] = {"dtype": dtype, "size": [int(s) for s in size], "requires_grad": bool(t.requires_grad),
                               "kind": self.kind(fqn)}

    def add_tensor(self, fqn: str, t: torch.Tensor, size: Sequence[int], offset: Sequence[int],
                   replica: bool = False) -> None:
        """This rank writes `t`, the box at `offset` of global tensor `fqn` of shape `size` (replica:
        holds it in its memory checkpoints, another rank writes it)."""
        if fqn.startswith(PREFIX):
            raise ValueError("state-dict key '%s' starts with '%s', which flashckpt.dcp keeps for its own tensors"
                             % (fqn, PREFIX))
        if fqn in self.tensors:
            raise ValueError("state-dict key '%s' has more than one chunk on rank %d; flashckpt.dcp saves one box per "
                             "tensor and rank (DTensors, plain tensors), not ShardedTensors of several local shards"
                             % (fqn, self.rank))
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()  # without CUDA in libflashckpt: a host copy (the Checkpointer copies device tensors itself)
        if not t.is_contiguous():
            t = t.contiguous()  # DCP hands out views; flashckpt copies one block per tensor
        self.describe(fqn, t, size)
        spec: Dict[str, Any] = {"kind": self.kind(fqn)}
        if list(t.shape) != list(size):
            spec.update({"global_shape": list(size), "box_offset": list(offset), "box_shape": list(t.shape)})
        if replica:
            spec["replica"] = True
        self.tensors[fqn] = t
        self.specs[fqn] = spec
        if not replica:
            self.nbytes[fqn] = t.numel() * t.element_size()

    def add_value(self, fqn: str, data: bytes, replica: bool = False) -> None:
        """This rank writes the pickled value `data` of `fqn` (replica: holds it in its memory
        checkpoints, another rank writes its own)."""
        name = _bytes_name(fqn)
        buf = torch.zeros(_capacity(len(data)), dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.tensors[name] = buf
        self.specs[name] = {"kind": "optimizer", "replica": True} if replica else {"kind": "optimizer"}
        self.held[fqn] = {"tensor": name, "length": len(data)}
        if not replica:
            self.values[fqn] = self.held[fqn]
            self.nbytes[fqn] = len(data)

    def add_state(self, flat: Mapping[str, Any], holds_all: bool) -> None:
        """Adds what this rank writes of a flattened state dict: each DTensor's box (a Replicate box
        by one of the ranks that hold it, as flashckpt.torch does), every other value by one rank,
        the ranks taking turns in the state dict's order, which is the same on every rank of an
        SPMD program. holds_all: also what other ranks write, as replicas (a memory checkpoint
        holds all the rank needs to load on its own)."""
        ordinal = 0
        for fqn, value in flat.items():
            if _torch_dtensor.is_dtensor(value):
                piece = _torch_dtensor.Piece(fqn, value, ordinal)
                ordinal += 1
                self.describe(fqn, piece.local, piece.global_shape)
                if piece.writer or holds_all:
                    self.add_tensor(fqn, piece.local, piece.global_shape, piece.box_offset, replica=not piece.writer)
                continue
            writes = ordinal % self.world_size == self.rank
            ordinal += 1
            if isinstance(value, torch.Tensor):
                self.describe(fqn, value, list(value.shape))
                if writes or holds_all:
                    self.add_tensor(fqn, value, list(value.shape), [0] * value.dim(), replica=not writes)
            elif writes or holds_all:
                buf = io.BytesIO()
                torch.save(value, buf)  # as DCP's planner turns a value into bytes
                self.add_value(fqn, buf.getvalue(), replica=not writes)

    def registration(self) -> Dict[str, Any]:
        """What a reader registers to restore this part from a memory checkpoint (kept with it as its
        extra state): every tensor's dtype, shape and registration spec."""
        return {"format": FORMAT + ".registration", "version": VERSION, "rank": self.rank,
                "world_size": self.world_size, "tensors": {n: [_tensors.dtype_and_shape(n, t)[0], list(t.shape), self.specs[n]]
                            for n, t in self.tensors.items()}}

    def finish(self, step: int, capacity: int) -> int:
        """Adds the header and the description; returns the description's capacity (kept across
        saves while the description fits, so that the layout stays registered)."""
        text = json.dumps({"format": FORMAT, "version": VERSION, "rank": self.rank, "world_size": self.world_size,
                           "step": step, "tensors": self.described, "values": self.values, "held": self.held,
                           "planner_data": self.planner_data}, separators=(",", ":")).encode("utf-8")
        if len(text) > capacity:
            capacity = _capacity(len(text))
        description = torch.zeros(capacity, dtype=torch.uint8)
        description[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        header = torch.tensor([VERSION, self.world_size, len(text), capacity], dtype=torch.int64)
        for name, t in ((_header_name(self.rank), header), (_description_name(self.rank), description)):
            self.tensors[name] = t
            self.specs[name] = {"kind": "optimizer"}
        return capacity


def _plain_paths(mappings: Any) -> Any:
    """DCP's flatten mappings (fqn -> path tuple) as JSON."""
    if not isinstance(mappings, dict):
        return None
    return {str(k): list(v) for k, v in mappings.items()}


class FlashckptWriter(StorageWriter, AsyncStager):
    """A DCP StorageWriter (and AsyncStager) that saves through flashckptd. See the module docstring.

    Arguments:
      client: a flashckpt.Client to use (shared with a FlashckptReader); else socket and job (and
        any other flashckpt.Client keyword: ema_decay, ema_interval, fatal_persist_errors,
        overwrite, run_id, timeouts) make one on first use, with torch.distributed's rank and world
        size.
      durable: True: dcp.save returns, and async_save's future completes, once the checkpoint is
        complete on disk; False: once every rank's part is in the daemon's memory (save) or once
        DCP's planning is done (async_save). None (default): False for dcp.save, True for
        async_save.
      model_prefixes: state-dict keys that are model state (the daemon's EMA and the model_state
        files); the others are training state. Default: keys under "model.".
      timeout: seconds durable waits and snapshots may take.
      tier: "disk" (default) or "memory": the saves are memory checkpoints, kept in the daemon's
        memory and never written (see the module docstring). The attribute may change between
        saves; give memory_checkpoints=True too when the first saves are the disk's, so that the
        layout registered first already holds what a memory checkpoint needs.

    Attributes: client, step (of the last save), tier, blocked_seconds (how long the last stage()
    or write_data() copied).
    """

    _synchronize_after_execute = False  # stage() has copied everything by the time it returns

    def __init__(self, client: Optional[Client] = None, *, socket: Optional[Union[str, os.PathLike]] = None,
                 job: Optional[str] = None, durable: Optional[bool] = None, model_prefixes: Sequence[str] = ("model.",),
                 timeout: float = 600.0, tier: str = "disk", **client_options: Any) -> None:
        super().__init__()
        if tier not in ("disk", "memory"):
            raise ValueError("tier must be 'disk' or 'memory', got %r" % (tier,))
        if tier == "memory" and client is None:
            client_options.setdefault("memory_checkpoints", True)
        self._session = _Session(client, socket, job, client_options)
        self.durable = durable
        self.tier = tier
        # Whether this rank registers what other ranks write too (as replicas): a memory checkpoint
        # holds all the rank needs. Kept once set, so that disk and memory saves share one layout.
        self._holds_all = tier == "memory" or bool(client_options.get("memory_checkpoints"))
        self._saved_tier = tier  # of the step saved last
        self.model_prefixes = tuple(model_prefixes)
        self.timeout = float(timeout)
        self.step: Optional[int] = None
        self.blocked_seconds = 0.0
        self._staged: Optional[int] = None  # the step stage() snapshotted (async_save)
        self._written: Dict[str, int] = {}  # fqn -> bytes of the staged step, for WriteResults
        self._capacity = 0
        self._registered: Optional[Tuple[Any, ...]] = None
        self._is_coordinator = False
        self.ema_step: Optional[int] = None

    @property
    def client(self) -> Client:
        return self._session.client

    # --- DCP's StorageWriter ---------------------------------------------------------------------

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        step = step_of(checkpoint_id)
        if step != self.step:  # async_save resets before stage() and again in its thread
            self._staged = None
        self.step = step

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[List[WriteResult]]:
        step = self._need_step()
        if self._staged != step and self._holding_all():
            # The rank holds its whole state dict (a memory checkpoint needs it), not only the items
            # DCP's plan gives it to write: taken from the planner, as async_save's stage() takes it.
            flat = getattr(planner, "state_dict", None)
            if not isinstance(flat, dict) or not getattr(planner, "flatten_state_dict", False):
                raise ValueError("a memory checkpoint through dcp.save needs DCP's DefaultSavePlanner (which keeps the "
                                 "flattened state dict); with another planner use dcp.async_save")
            part = self._part()
            part.planner_data = _plain_paths(getattr(planner, "mappings", None))
            part.add_state(flat, True)
            self._snapshot(step, part)
        elif self._staged != step:
            part = self._part()
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    part.add_value(item.index.fqn, data.getvalue())
                else:
                    td = item.tensor_data
                    part.add_tensor(item.index.fqn, data, list(td.size), list(td.chunk.offsets))
            part.planner_data = _plain_paths(getattr(planner, "mappings", None))
            self._snapshot(step, part)
        results = [WriteResult(index=item.index, size_in_bytes=self._written.get(item.index.fqn, 0), storage_data=None)
                   for item in plan.items]
        fut: Future[List[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        durable = self.durable if self.durable is not None else self._staged == self.step
        if durable and self._saved_tier == "disk":  # a memory checkpoint is never written
            self.wait_persisted(self._need_step(), self.timeout)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        try:
            return step_of(checkpoint_id) is not None
        except ValueError:
            return False

    # --- DCP's AsyncStager -----------------------------------------------------------------------

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """dcp.async_save's staging: copies this rank's tensors into the daemon's memory and commits
        the step, on the calling thread; returns `state_dict` as it is (DCP's thread then plans
        the save, and write_data() finds the step staged). What each rank writes: _Part.add_state."""
        step = self._need_step()
        if flatten_state_dict is None:
            raise RuntimeError("this torch has no torch.distributed.checkpoint._nested_dict.flatten_state_dict; "
                               "use dcp.save with FlashckptWriter instead of async_save")
        flat, mappings = flatten_state_dict(state_dict)
        part = self._part()
        part.planner_data = _plain_paths(mappings)
        part.add_state(flat, self._holding_all())
        self._snapshot(step, part)
        self._staged = step
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for: stage() returns once the copy is done."""

    # --- flashckpt ---------------------------------------------------------------------------------

    def wait_persisted(self, step: int, timeout: float = 600.0) -> None:
        """Blocks until checkpoint `step` is complete (every rank's part durable). It waits in short
        slices, so that a save staged meanwhile by another thread (async_save) is not held up."""
        deadline = time.monotonic() + timeout
        while True:
            with self._session.lock:
                try:
                    self.client.wait_complete(step, timeout=min(0.05, max(0.0, deadline - time.monotonic())))
                    return
                except DeadlineExceededError:
                    if time.monotonic() >= deadline:
                        raise
            time.sleep(0.005)

    def ema_state_dict(self, timeout: float = 60.0) -> Dict[str, torch.Tensor]:
        """The daemon's EMA of the model tensors this rank writes, {state-dict key: fp32 tensor}
        (a DTensor's: its box), as of the last save (the writer needs ema_decay)."""
        with self._session.lock:
            step, arrays = self.client.ema(timeout=timeout)
        if step is None:
            raise NotFoundError("NOT_FOUND", "the EMA has no update yet: save a step that is a multiple of ema_interval")
        self.ema_step = step
        return {name: torch.from_numpy(a) for name, a in arrays.items()}

    def close(self) -> None:
        self.client.close()

    def _need_step(self) -> int:
        if self.step is None:
            raise ValueError("FlashckptWriter needs the step: pass checkpoint_id=step (an int, or a name ending in "
                             "it) to dcp.save / dcp.async_save")
        return self.step

    def _part(self) -> _Part:
        c = self.client
        return _Part(c.rank, c.topology[0], self.model_prefixes)

    def _holding_all(self) -> bool:
        """Whether this rank registers what other ranks write too: from its first memory checkpoint
        on (or from the start with memory_checkpoints=True). Checks `tier`."""
        if self.tier not in ("disk", "memory"):
            raise ValueError("FlashckptWriter.tier must be 'disk' or 'memory', got %r" % (self.tier,))
        self._holds_all = self._holds_all or self.tier == "memory"
        return self._holds_all

    def _snapshot(self, step: int, part: _Part) -> None:
        started = time.monotonic()
        tier = self.tier
        self._capacity = part.finish(step, self._capacity)
        key = tuple((n, t.dtype, tuple(t.shape), repr(part.specs[n])) for n, t in part.tensors.items())
        with self._session.lock:
            if key != self._registered:
                self.client.register(part.tensors, specs=part.specs)
                self._registered = key
            self.client.snapshot(step, part.tensors, persist=True, tier=tier,
                                 extra=part.registration() if self._holds_all else None)
        self._saved_tier = tier
        self._written = part.nbytes
        self.blocked_seconds = time.monotonic() - started


class FlashckptReader(StorageReader):
    """A DCP StorageReader that loads a checkpoint FlashckptWriter saved, through flashckptd (which
    verifies every checksum before a byte reaches the tensors). See the module docstring.

    Arguments: client, or socket and job (and flashckpt.Client options), as FlashckptWriter.
    process_group: with checkpoint_id None (the latest), the ranks that agree on one step (default:
    the default group when torch.distributed is initialised with more than one rank); each rank
    restores the newest step all of them see complete.

    Attributes: client, step (restored, once read_metadata() has found it), tier ("memory",
    "peer", "parity" or "disk": where the daemon found it).
    """

    def __init__(self, client: Optional[Client] = None, *, socket: Optional[Union[str, os.PathLike]] = None,
                 job: Optional[str] = None, process_group: Optional[Any] = None, timeout: float = 600.0,
                 **client_options: Any) -> None:
        super().__init__()
        self._session = _Session(client, socket, job, client_options)
        self.process_group = process_group
        self.timeout = float(timeout)
        self._asked: Optional[int] = None
        self.step: Optional[int] = None
        self._tensors: Dict[str, Dict[str, Any]] = {}
        self._values: Dict[str, Dict[str, Any]] = {}
        self.tier: Optional[str] = None
        # A memory checkpoint restored by read_metadata(): its tensors, their registration specs,
        # and this rank's description of it (read_data() copies from them).
        self._held: Optional[Dict[str, torch.Tensor]] = None
        self._held_specs: Dict[str, Dict[str, Any]] = {}
        self._held_part: Dict[str, Any] = {}

    @property
    def client(self) -> Client:
        return self._session.client

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        self._asked = step_of(checkpoint_id)
        self.step = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            return self._read_metadata()
        except Exception as e:
            # DCP's load takes an error here for "no global metadata" and drops it (it then fails
            # on an assertion): the reason is shown as a warning first.
            warnings.warn("flashckpt.dcp could not read the checkpoint's description: %s: %s"
                          % (type(e).__name__, e), RuntimeWarning)
            raise

    def _read_metadata(self) -> Metadata:
        group = self._group()
        self._held, self.tier = None, None
        held = self._from_memory(group)
        if held is not None:
            return self._metadata(held)
        found, parts = _torch_agree.stage(group, "read its checkpoint's description", lambda: self._describe(self._asked))
        if group is not None and self._asked is None:
            agreed = _torch_agree.common_step(group, found, self.client.job)
            found, parts = _torch_agree.stage(group, "read checkpoint-%s" % agreed,
                                              lambda: (found, parts) if agreed == found else self._describe(agreed))
        if found is None:
            raise NotFoundError("NOT_FOUND", "job '%s' has no complete checkpoint%s" % (
                self.client.job, "" if self._asked is None else " at step %d" % self._asked))
        self.step = found
        self.tier = "disk"
        return self._metadata(parts)

    def _metadata(self, parts: List[Dict[str, Any]]) -> Metadata:
        """DCP's Metadata of a checkpoint from every saving rank's description of it."""
        md: Dict[str, Any] = {}
        planner_data: Dict[str, Any] = {}
        self._tensors, self._values = {}, {}
        for part in parts:
            for fqn, t in part["tensors"].items():
                self._tensors.setdefault(fqn, t)
            for fqn, v in part["values"].items():
                self._values.setdefault(fqn, v)
            for fqn, path in (part.get("planner_data") or {}).items():
                planner_data.setdefault(fqn, tuple(path))
        for fqn, t in self._tensors.items():
            size = torch.Size(t["size"])
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_TORCH_DTYPES[t["dtype"]], requires_grad=t.get("requires_grad", False)),
                size=size, chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)])
        for fqn in self._values:
            md[fqn] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md, planner_data=planner_data or None)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Restores every item of `plan` in one call to the daemon: each tensor item as the box of
        its global tensor it covers (straight into the planner's tensor where that is a contiguous
        host tensor of the saved dtype), each value as its pickled bytes."""
        if self.step is None:
            raise RuntimeError("read_metadata() finds the step; DCP calls it before read_data()")
        if self._held is not None:
            self._read_held(plan, planner)
            fut_held: Future[None] = Future()
            fut_held.set_result(None)
            return fut_held
        rounds: List[Dict[str, Any]] = [{}]  # name -> (item, buffer); a name may appear once per restore
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                v = self._values[fqn]
                name, buf = v["tensor"], torch.empty(_capacity(v["length"]), dtype=torch.uint8)
                spec: Dict[str, Any] = {"kind": "optimizer"}
            else:
                t = self._tensors[fqn]
                size, lengths = list(t["size"]), [int(n) for n in item.lengths]
                offset = [int(a) + int(b) for a, b in zip(item.storage_index.offset or [0] * len(size),
                                                          item.storage_offsets)]
                name, buf = fqn, torch.empty(lengths, dtype=_TORCH_DTYPES[t["dtype"]])
                spec = {"kind": t.get("kind", "optimizer")}
                if lengths != size:
                    spec.update({"global_shape": size, "box_offset": offset, "box_shape": lengths})
            for r in rounds:
                if name not in r:
                    break
            else:
                r = {}
                rounds.append(r)
            r[name] = (item, buf, spec)
        for r in rounds:
            if not r:
                continue
            targets: Dict[str, Any] = {}
            direct: Dict[str, Any] = {}
            for name, (item, buf, spec) in r.items():
                if item.type != LoadItemType.BYTE_IO:
                    dest = planner.resolve_tensor(item)
                    if (dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == buf.dtype
                            and tuple(dest.shape) == tuple(buf.shape)):
                        buf = dest  # restored in place: no second copy
                        direct[name] = dest
                targets[name] = buf
            with self._session.lock:
                self.client.register(targets, specs={n: spec for n, (_, _, spec) in r.items()})
                got, _ = self.client.restore(targets, step=self.step, timeout=self.timeout)
            if got != self.step:
                raise NotFoundError("NOT_FOUND", "asked the daemon for checkpoint-%d, it restored %s" % (self.step, got))
            for name, (item, _, _) in r.items():
                if item.type == LoadItemType.BYTE_IO:
                    length = self._values[item.storage_index.fqn]["length"]
                    planner.load_bytes(item, io.BytesIO(targets[name][:length].numpy().tobytes()))
                    continue
                dest = direct.get(name)
                if dest is None:
                    dest = planner.resolve_tensor(item)
                    dest.copy_(targets[name])
                planner.commit_tensor(item, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return FlashckptWriter.validate_checkpoint_id(checkpoint_id)

    def close(self) -> None:
        self.client.close()

    # --- memory checkpoints ---------------------------------------------------------------------

    def _from_memory(self, group: Optional[Any]) -> Optional[List[Dict[str, Any]]]:
        """Restores the memory checkpoint every rank loads, as Checkpointer.resume() picks it: the
        newest step all ranks hold in their daemons' memory unless the disk has a newer complete
        checkpoint (with a checkpoint_id: that step, if all ranks hold it). Returns every saving
        rank's description of it (the ranks exchange theirs), its tensors kept for read_data();
        None: the disk path (no such step, or its restore failed on some rank: a warning says so)."""
        mine: Optional[Tuple[List[int], Optional[int]]] = None
        error: Optional[BaseException] = None
        try:
            with self._session.lock:
                # Unverified: the restore verifies the one the ranks pick, so it is read once.
                steps, disk = self.client.restorable(min(self.timeout, 60.0), verify=False)
            mine = (steps, disk) if self._asked is None else ([s for s in steps if s == self._asked], None)
        except FlashckptError as e:
            warnings.warn("rank %d cannot list its memory checkpoints (%s); loading from disk"
                          % (self.client.rank, e), RuntimeWarning)
        except BaseException as e:  # reported to the other ranks before it is raised
            error = e
        memory = _torch_agree.memory_step(group, error, mine)
        if memory is None:
            return None
        description: Optional[Dict[str, Any]] = None
        try:
            description = self._restore_memory(memory, 1 if group is None else dist.get_world_size(group))
        except BaseException as e:  # reported to the other ranks before anything is raised
            error = e
        failed = _torch_agree.memory_failure(group, memory, error, None)
        if failed is not None:
            self._held = None
            warnings.warn("the restore of memory checkpoint step %d failed on rank %d (%s); every rank loads from "
                          "disk instead" % (memory, failed[0], failed[1]), RuntimeWarning)
            return None
        self.step = memory
        assert description is not None  # memory_failure() reported a failed restore
        return [description] if group is None else _torch_agree.gather(group, description)

    def _restore_memory(self, step: int, world: int) -> Dict[str, Any]:
        """Restores this rank's memory checkpoint `step` into fresh tensors, registered as the writer
        registered them (from the extra state kept with it, so the daemon keeps the segment that
        holds it); returns this rank's description of it."""
        rank = self.client.rank
        with self._session.lock:
            extra = self.client.memory_extra(step, timeout=min(self.timeout, 60.0), verify=False)
        if extra is None:
            raise FailedPreconditionError("FAILED_PRECONDITION", "rank %d no longer holds memory checkpoint step %d"
                                          % (rank, step))
        try:
            registration = json.loads(extra.decode("utf-8"))
        except ValueError:
            registration = None
        if not isinstance(registration, dict) or registration.get("format") != FORMAT + ".registration":
            raise FailedPreconditionError("FAILED_PRECONDITION", "memory checkpoint step %d of rank %d was not taken "
                                          "by flashckpt.dcp.FlashckptWriter" % (step, rank))
        if registration.get("world_size") != world:
            # Checked before anything is registered: another layout would replace the memory checkpoints.
            raise FailedPreconditionError("FAILED_PRECONDITION", "memory checkpoint step %d was taken by a job of %s "
                                          "ranks, this one has %d: load it from disk" % (step,
                                                                                         registration.get("world_size"),
                                                                                         world))
        tensors: Dict[str, torch.Tensor] = {}
        specs: Dict[str, Dict[str, Any]] = {}
        for name, (dtype, shape, spec) in registration["tensors"].items():
            tensors[name] = torch.empty([int(n) for n in shape], dtype=_TORCH_DTYPES[dtype])
            specs[name] = dict(spec)
        with self._session.lock:
            self.client.register(tensors, specs=specs)
            got, _ = self.client.restore(tensors, step=step, timeout=self.timeout)
            self.tier = self.client.restored_tier
        if got != step:
            raise NotFoundError("NOT_FOUND", "asked the daemon for memory checkpoint step %d, it restored %s"
                                % (step, got))
        header = tensors[_header_name(rank)]
        text = tensors[_description_name(rank)][:int(header[2])].numpy().tobytes()
        description = json.loads(text.decode("utf-8"))
        self._held, self._held_specs, self._held_part = tensors, specs, description
        return cast(Dict[str, Any], description)

    def _read_held(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """read_data() from the memory checkpoint read_metadata() restored: each item from the box
        this rank held (a memory checkpoint loads on the mesh that took it)."""
        assert self._held is not None
        held, step, rank = self._held, self.step, self.client.rank
        assert step is not None
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                v = self._held_part.get("held", {}).get(fqn)
                if v is None:
                    raise NotFoundError("NOT_FOUND", "memory checkpoint step %d of rank %d holds no value '%s'"
                                        % (step, rank, fqn))
                planner.load_bytes(item, io.BytesIO(held[v["tensor"]][:int(v["length"])].numpy().tobytes()))
                continue
            src = held.get(fqn)
            if src is None:
                raise NotFoundError("NOT_FOUND", "memory checkpoint step %d of rank %d holds no tensor '%s'"
                                    % (step, rank, fqn))
            at = [int(n) for n in self._held_specs[fqn].get("box_offset", [0] * src.dim())]
            lengths = [int(n) for n in item.lengths]
            want = [int(a) + int(b) for a, b in zip(item.storage_index.offset or [0] * src.dim(), item.storage_offsets)]
            rel = [w - a for w, a in zip(want, at)]
            if any(r < 0 or r + n > size for r, n, size in zip(rel, lengths, src.shape)):
                raise FailedPreconditionError(
                    "FAILED_PRECONDITION", "memory checkpoint step %d of rank %d holds the box at %s of shape %s of "
                    "'%s'; the load asks for %s at %s: a memory checkpoint loads on the mesh that took it"
                    % (step, rank, at, list(src.shape), fqn, lengths, want))
            dest = planner.resolve_tensor(item)
            dest.copy_(src[tuple(slice(r, r + n) for r, n in zip(rel, lengths))])
            planner.commit_tensor(item, dest)
        self._held = None  # loaded: its memory is given back

    def _group(self) -> Optional[Any]:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _restore(self, tensors: Dict[str, torch.Tensor], step: Optional[int]) -> Optional[int]:
        with self._session.lock:
            self.client._register(tensors, {n: {"kind": "optimizer"} for n in tensors}, with_ema=False)
            got, _ = self.client.restore(tensors, step=step, timeout=self.timeout)
        return got

    def _describe(self, step: Optional[int]) -> Tuple[Optional[int], List[Dict[str, Any]]]:
        """(step, every saving rank's description) of checkpoint `step` (None: the latest complete
        one), read through the daemon in three small restores: rank 0's header, which gives the
        saving job's world size; every rank's header; every rank's description."""
        header = torch.zeros(4, dtype=torch.int64)
        found = self._restore({_header_name(0): header}, step)
        if found is None:
            return None, []
        version, world = int(header[0]), int(header[1])
        if version != VERSION:
            raise NotFoundError("NOT_FOUND", "checkpoint-%d holds flashckpt.dcp format version %d, this reader reads "
                                "version %d" % (found, version, VERSION))
        headers = {_header_name(r): torch.zeros(4, dtype=torch.int64) for r in range(world)}
        self._restore(headers, found)
        descriptions = {_description_name(r): torch.zeros(int(headers[_header_name(r)][3]), dtype=torch.uint8)
                        for r in range(world)}
        self._restore(descriptions, found)
        parts = []
        for r in range(world):
            length = int(headers[_header_name(r)][2])
            part = json.loads(descriptions[_description_name(r)][:length].numpy().tobytes().decode("utf-8"))
            if part.get("format") != FORMAT:
                raise NotFoundError("NOT_FOUND", "checkpoint-%d: rank %d's description is not flashckpt.dcp's" % (found, r))
            parts.append(part)
        return found, parts


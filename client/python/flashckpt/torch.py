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

More than a model and an optimizer: the first argument may be a dict of states, as in
torch.distributed.checkpoint's Stateful protocol:

    ck = Checkpointer({"model": model, "optim": optimizer, "sched": lr_scheduler, "scaler": scaler,
                       "data": {"epoch": 0, "pos": 0}}, socket=..., job=...)

Each value with state_dict()/load_state_dict() is saved through them; any other value (a dict of
counters, a tensor, a list) is saved as it is, and resume() puts the saved one back: a dict in
place (cleared and refilled, so references to it see the restored contents), anything else as the
new value of ck.states[key]. Checkpointer(model, optimizer) is Checkpointer({"model": model,
"optimizer": optimizer}).

What a checkpoint holds: every tensor of every state ("<key>.<state-dict key>", e.g.
"model.fc1.weight", "optimizer.state.0.exp_avg"), copied once into the daemon's shared memory. The
tensors of nn.Module values and of the value named "model" are model state (kind model: the
model_state files, and the daemon's EMA); all others are training state (kind optimizer: the
optimizer files). In the rank's extra.rankNNNNN.json: the structure of every state with its
non-tensor leaves (hyper-parameters, step counters: they come back with their types), the RNG state
(torch's CPU generator, and CUDA's when CUDA is initialised) and the `extra` given to save(). The
daemon keeps an fp32 EMA of the model's floating tensors (parameters and floating buffers) when
ema_decay is set.

The layout is registered with the daemon on the first save and again whenever the set, dtype or
shape of the tensors changes (Adam's state appears only after its first step). Where torch has
optimizer step hooks (torch 2), the Checkpointer registers it once every optimizer among the states
has taken its first step, in that step's hook, and has the client map its slots' memory on a thread
(prepare()), so that the first save, some steps later, costs what a later one does instead of
waiting for the kernel to fault in fresh shared memory. That registration runs on the training
thread: with the daemon away it waits up to connect_timeout there (then warns; the first save
raises), and a save() on another thread must not run beside that step (a Client is used by one
thread at a time).

Resume restores the latest complete checkpoint in place into the model's tensors; the optimizer
gets its state through optimizer.load_state_dict() (its fresh state may be empty). A checkpoint
whose structure differs from the current model/optimizer raises StructureMismatchError naming the
first differing key, and leaves the model untouched when the difference is known before loading.

A torch.distributed.optim.ZeroRedundancyOptimizer is saved without consolidating: each rank writes
the state of its own partition (under the global parameter indices of ZeRO's consolidated
state_dict), and a job of any number of ranks resumes it, each rank taking its new partition's
state.

DTensor states (torch 2: FSDP2's fully_shard, tensor parallelism's parallelize_module) are saved as
each rank's local tensors, each the box of its global tensor that its placements give (Shard(dim) as
torch.chunk splits, so last shards may be smaller or empty); a box that several ranks hold
(Replicate) is written by one of them, the ranks taking turns per tensor, and so is each of the
job's other tensors (step counts, buffers: alike on every rank). A checkpoint resumes on another
mesh or parallelism, or into a plain model. resume() first gives an optimizer of DTensor parameters
that has no state yet its state, as DTensors (one step with zero gradients and a learning rate of
0, as torch.distributed.checkpoint does), and restores into it in place. Memory checkpoints work
as for other jobs (each rank's holds its boxes, the replicas too). With ema_decay the daemon
averages the boxes each rank writes; ema_state_dict() is then a collective (every rank calls it)
that returns DTensors placed like the parameters, a replicated box's average passed from the rank
that writes it to the others; resume() restores the EMA into the new mesh's boxes.

Memory checkpoints: save(step, tier="memory") keeps the snapshot in the daemon's memory only
(checksummed in the background, never written), so a trainer can save every step and write a disk
checkpoint every few hundred. resume() of the latest first asks every rank's daemon which memory
checkpoints the rank holds (Client.restorable()) and restores the newest step every rank holds,
unless a complete disk checkpoint is newer; resumed_tier says "memory" or "disk" ("peer" when the
rank's daemon fetched the memory checkpoint from a peer daemon's replica: flashckptd
--replicate-to; "parity" when it rebuilt it from its parity group: flashckptd --ec-group). The restore verifies the checkpoint against its checksums as it copies it, once. A
memory restore that fails on any rank (a checkpoint dropped meanwhile or corrupt) falls back to the disk
on every rank, with a warning. A job of several ranks needs a process group for this (without one
its ranks could not agree on a step). In a job that splits the writing of its replicated tensors
over its data-parallel ranks, a rank's memory checkpoint holds its share of them: each rank restores
its share from memory and the ranks broadcast theirs to each other. With a ZeroRedundancyOptimizer
each rank's holds its partition of the optimizer state, which a job of the same world size (the same
partitions) restores from memory.

In a torch.distributed job (a process group of world_size ranks), every rank restores the same
step: resume() gathers what each rank found (all_gather_object on the group; the group's timeout
bounds the wait) and takes the newest step every rank sees complete. A rank that fails makes every
rank raise, the others with a FailedPreconditionError naming it and its reason. A job of more ranks
than the one that saved resumes it too: a rank whose number had no part in that job takes rank 0's
part (the structure, the non-tensor values and `extra`; not the RNG state, which stays its own),
handed on over the group, and restores every tensor it holds from whichever files hold them.

Tensors must be contiguous tensors of a supported dtype: a non-contiguous one raises a ValueError
naming it (fix: p.data = p.data.contiguous()), never a silent copy.

CUDA tensors (where libflashckpt has CUDA compiled in; else they raise a ValueError) go through the
library's device path: save() queues their device-to-host copies after the work queued so far on
torch.cuda.current_stream() and returns; wait_copied() waits for them. Call it before anything
writes the saved tensors: optimizer.step(), and a forward pass that updates buffers (BatchNorm's
running statistics, DDP's broadcast_buffers), which would otherwise race with the copies.
resume() and ema_state_dict() copy into device memory after the work queued on the current stream
and return once the copies are complete. CPU and CUDA tensors may be mixed; the CUDA ones on one
device. Without a device, CPU tensors work as they always do.
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Set, Tuple, Union

import torch

from . import _torch_agree
from . import _torch_dtensor
from . import _torch_resume
from . import _torch_shares
from . import _torch_state
from .client import Client, Snapshot
from .errors import FailedPreconditionError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# How tensor parallelism splits one model tensor: (dim, tp_rank, tp_degree), {"dim", "rank",
# "degree"}, or None (whole); shard_specs maps a model state-dict key to one, or is a function.
ShardSpec = _torch_state.ShardSpec
ShardSpecs = _torch_state.ShardSpecs


def _remove_hooks(handles: List[Any]) -> None:
    for handle in handles:
        handle.remove()


class Checkpointer:
    """Checkpoints a dict of states ({"model": model, "optim": optimizer, ...}), or `model` (an
    nn.Module, or anything with state_dict/load_state_dict) and `optimizer`.

    Keyword arguments are those of flashckpt.Client (socket, job, ema_*, backpressure,
    fatal_persist_errors, memory_checkpoints, timeouts).
    rank and world_size default to torch.distributed's when it is initialised, else 0 and 1; unless
    given, shard_degree = world_size / (tp_degree * pp_degree) and shard_rank = rank // (tp_degree *
    pp_degree), i.e. data-parallel ranks are shards. rng=False leaves the RNG state out.
    replicated: whether the parameters of the job's modules, and their optimizer state (not a
    ZeroRedundancyOptimizer's, whose ranks hold different state), are alike on every rank of the
    process group, so that each of their bytes is written by one rank: the ranks split them
    evenly, whole tensors and flat ranges of the ones that cross a share's end. None (default): the
    DistributedDataParallel modules' parameters and their optimizer state, when the job has no
    tensor or pipeline parallelism and no EMA. Those modules' buffers are written by rank 0 (DDP
    broadcasts rank 0's), every other tensor by every rank. Resume reads the tensors from whichever files hold them.
    process_group: the group whose ranks agree on the step resume() restores (default: the default
    group, when torch.distributed is initialised and has this Checkpointer's world_size ranks).
    shard_specs: how tensor parallelism splits the model's tensors, a mapping (or a callable) from a
    model state-dict key ("fc1.weight", without the "<key>." of the dict of states) to (dim, tp_rank,
    tp_degree) or {"dim": .., "rank": .., "degree": ..}, or None for a tensor every tp rank holds
    whole. The rank's tensor is then part tp_rank of tp_degree equal parts along dim of the full
    tensor (as Megatron's column- and row-parallel layers split weights), and so is the optimizer
    state of the same shape as its parameter. A checkpoint restores into any other split of the
    same full tensors (another tp_degree, or none).

    Attributes: states (the dict of states), model and optimizer (the first nn.Module and optimizer
    among them, or None), extra (the `extra` of the resumed checkpoint), resumed_step, resumed_tier
    ("memory" or "disk": where resume() got it), saves,
    blocked_seconds (total time save() blocked the caller), last_snapshot, ema_step (step of the EMA
    last read), prepare_error (what preparing the first save after an optimizer's first step raised,
    or None; see prepare()).
    """

    def __init__(self, model: object, optimizer: Optional[object] = None, *, socket: Union[str, os.PathLike[str]],
                 job: str, rank: Optional[int] = None, world_size: Optional[int] = None, tp_rank: int = 0,
                 tp_degree: int = 1, pp_rank: int = 0, pp_degree: int = 1, shard_rank: Optional[int] = None,
                 shard_degree: Optional[int] = None, rng: bool = True, process_group: Optional[ProcessGroup] = None,
                 shard_specs: Optional[ShardSpecs] = None, replicated: Optional[bool] = None,
                 **client_options: Any) -> None:
        self._layout = _torch_state.Layout(_torch_state.states_of(model, optimizer), shard_specs)
        if replicated and (client_options.get("ema_decay") is not None or shard_specs is not None
                           or tp_degree * pp_degree != 1):
            raise ValueError("replicated=True (each tensor written by one data-parallel rank) is for data-parallel "
                             "jobs without tensor or pipeline parallelism and without the daemon's EMA")
        self.model: Any = next((self.states[k] for k in self._layout.model_keys), None)
        self.optimizer: Any = next((v for v in self.states.values() if _torch_state.is_optimizer(v)), None)
        if rank is None or world_size is None:
            dist_rank, dist_size = _torch_agree.rank_and_size()
            rank = dist_rank if rank is None else rank
            world_size = dist_size if world_size is None else world_size
        group = tp_degree * pp_degree
        if shard_degree is None:
            shard_degree = max(1, world_size // group)
        if shard_rank is None:
            shard_rank = rank // group
        self.rng = rng
        self.client = Client(socket, job, rank=rank, world_size=world_size, tp_rank=tp_rank, tp_degree=tp_degree,
                             pp_rank=pp_rank, pp_degree=pp_degree, shard_rank=shard_rank, shard_degree=shard_degree,
                             **client_options)
        self._process_group = process_group
        self._world_size = world_size
        self._layout.rank, self._layout.world_size = rank, world_size
        self.ema_enabled = client_options.get("ema_decay") is not None
        self._shares = _torch_shares.Shares(self._layout, replicated, self.ema_enabled, tp_degree * pp_degree,
                                            process_group, world_size)
        self.extra: Any = None
        self.resumed_step: Optional[int] = None
        self.resumed_tier: Optional[str] = None
        self.ema_step: Optional[int] = None
        self.saves = 0
        self.blocked_seconds = 0.0
        self.last_snapshot: Optional[Snapshot] = None
        self.prepare_error: Optional[Exception] = None
        self._resuming = False
        self._stepped: Set[int] = set()  # id() of the hooked optimizers that have taken a step
        self._prepared = False
        # The hooks hold the Checkpointer weakly (an optimizer outlives it); they go with close() or
        # when the Checkpointer is collected.
        self._step_hooks: Dict[int, Any] = {}
        this = weakref.ref(self)

        def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            ck = this()
            if ck is not None:
                ck._after_step(optimizer)
        for opt in self.states.values():
            if _torch_state.is_optimizer(opt) and hasattr(opt, "register_step_post_hook"):
                try:
                    self._step_hooks[id(opt)] = opt.register_step_post_hook(after_step)
                except (AttributeError, RuntimeError):  # a wrapper without Optimizer's hook tables
                    pass
        self._unhook = weakref.finalize(self, _remove_hooks, list(self._step_hooks.values()))

    @property
    def states(self) -> Dict[str, Any]:
        """The dict of states: the one given, else {"model": model}, with "optimizer" when one is given."""
        return self._layout.states

    @states.setter
    def states(self, states: Dict[str, Any]) -> None:
        self._layout.states = states

    # --- save ----------------------------------------------------------------------------------

    def save(self, step: int, extra: object = None, loss: Optional[float] = None, persist: bool = True,
             tier: str = "disk") -> Snapshot:
        """Snapshots every state as `step`; returns once the copy is done, or for CUDA tensors once
        it is queued (a Snapshot whose `seconds` is how long this call blocked; call wait_copied()
        before changing the tensors).

        persist=True: the daemon writes a checkpoint in the background (wait_persisted() waits for
        it); persist=False: EMA update only. `extra` (JSON-serialisable) comes back as ck.extra on
        resume; `loss` feeds the EMA's loss gate. tier="memory": a memory checkpoint, kept by the
        daemon and never written (resume() of a restarted trainer prefers it when it is newest). In
        a job that splits its replicated tensors, each rank's memory checkpoint holds its share, and
        resume() hands the shares on; with a ZeroRedundancyOptimizer each rank's holds its partition,
        which a job of the same world size resumes.
        """
        if tier not in ("disk", "memory"):
            raise ValueError("tier must be 'disk' or 'memory', got %r" % (tier,))
        if tier == "memory" and not persist:
            raise ValueError("tier='memory' keeps a full checkpoint; persist=False (an EMA update only) cannot be one")
        started = time.perf_counter()
        tree, tensors = self._register_current()
        payload: Optional[Dict[str, Any]] = None
        if persist:
            payload = {"format": _torch_state.FORMAT, "version": _torch_state.VERSION, "state": tree, "user": extra,
                       "world_size": self._world_size}
            if self._layout.zero_records:
                payload["zero"] = self._layout.zero_records
            if self.rng:
                payload["rng"] = _torch_state.rng_state()
        snap = self.client.snapshot(step, tensors, persist=persist, loss=loss, extra=payload, tier=tier)
        snap.seconds = time.perf_counter() - started  # all of save(), flattening included
        self.last_snapshot = snap
        self.saves += 1
        self.blocked_seconds += snap.seconds
        return snap

    def prepare(self) -> None:
        """Registers the states' current layout with the daemon, unless it is registered already, and
        has the client map the pages of the rank's slots for writing on a thread (Client.populate),
        then returns: the first save afterwards finds its slot's memory faulted in. The Checkpointer
        calls it once every optimizer among its states has taken its first step (torch 2); call it
        yourself when the state is complete some steps before the first save and no optimizer step
        comes between (a model without an optimizer). Raises what registration raises (save() would
        raise the same)."""
        self._register_current()
        self.client.populate()

    def _register_current(self) -> Tuple[Any, Dict[str, Any]]:
        """(tree, tensors) of the states as they are, this rank's share of them registered (again
        only when the layout changed)."""
        tree, tensors = self._layout.flatten()
        tensors, specs = self._shares.split(tensors)
        self._layout.register(self.client, tensors, specs)
        return tree, tensors

    def _after_step(self, optimizer: Any) -> None:
        """Step hook: once every hooked optimizer has taken a step, their state exists and the layout
        a save registers is known; that step prepares the first save, and later ones return at once
        (torch iterates its hooks while this runs, so they are removed only by close()). A failure is
        warned about and kept in prepare_error; the first save registers again and raises it."""
        if self._prepared or self._resuming:  # resume() steps a fresh DTensor optimizer once
            return
        self._stepped.add(id(optimizer))
        if not self._stepped.issuperset(self._step_hooks):
            return
        self._prepared = True
        try:
            self.prepare()
        except Exception as e:  # the first save registers again and raises it
            self.prepare_error = e
            try:
                warnings.warn("flashckpt: preparing the first save after the optimizer's first step failed (the "
                              "first save registers again): %s: %s" % (type(e).__name__, e), RuntimeWarning)
            except Exception:  # warnings turned into errors: prepare_error and the first save say it
                pass

    def wait_copied(self) -> None:
        """Returns once the last snapshot has left the tensors (call it before optimizer.step(), and
        before a forward pass that updates buffers such as BatchNorm's running statistics); at once
        for CPU tensors. Raises the device copies' error, or the daemon's refusal of the commit."""
        if self.last_snapshot is not None:
            self.last_snapshot.wait_copied()
            self.last_snapshot.wait_committed()

    def wait_persisted(self, step: int, timeout: float = 600.0) -> None:
        """Blocks until checkpoint `step` is complete: every rank's part of it durable (wait_complete)."""
        self.client.wait_complete(step, timeout)

    # --- resume --------------------------------------------------------------------------------

    def resume(self, step: Optional[int] = None, timeout: float = 600.0) -> Optional[int]:
        """Restores checkpoint `step` (None: the latest complete one); returns its step, or None if there is none.

        Loads every state (modules in place, the others through load_state_dict), the RNG state and
        the daemon's EMA as of that step, and sets self.extra. Raises StructureMismatchError naming the
        first differing key when the checkpoint's state dicts differ in structure from the current ones.

        In a torch.distributed job every rank of the process group restores the same step: the
        newest that every rank sees complete when step is None. A rank that cannot restore it makes
        every rank raise (the others a FailedPreconditionError naming that rank and its reason), and
        None is returned only when no rank has a checkpoint. Every rank must call resume(), with the
        same `step` (ranks that ask for different steps all raise ValueError). The gathers use the
        group's backend: with NCCL, set the rank's device (torch.cuda.set_device) first; with gloo a
        peer that died makes them fail at once, with NCCL only the group's timeout ends the wait.
        A memory checkpoint of a job that splits its replicated tensors is restored share by share:
        once every rank has its own, the ranks broadcast theirs; a rank that fails in the middle of
        those broadcasts leaves the others waiting until the group's timeout, and a failure after
        them makes every rank raise (the state is then partly restored: resume again).

        The checkpoint may have been saved by fewer ranks: a rank whose number that job did not
        have gets rank 0's part of it (structure, non-tensor values and self.extra; its RNG state
        is left as it is) and restores everything it holds (the replicated model and optimizer, or
        its new ZeroRedundancyOptimizer partition) from whichever files hold it. Its state must
        have rank 0's structure (data and tensor parallelism; not another pipeline stage).
        """
        # An optimizer of DTensor parameters that has no state yet gets it, as DTensors placed like
        # its parameters, for the checkpoint's to be restored into in place; it is taken back when
        # there is no checkpoint, so that a fresh start stays fresh.
        fresh = [obj for obj in self.states.values() if isinstance(obj, torch.optim.Optimizer)
                 and not obj.state and _torch_dtensor.has_dtensor_params(obj)]
        self._resuming = True  # that step is not the training's first: the step hook lets it be
        try:
            for optimizer in fresh:
                _torch_dtensor.init_optimizer_state(optimizer)
        finally:
            self._resuming = False
        resume = _torch_resume.Resume(self.client, self._layout, self._shares, self._world_size, self.rng,
                                      self.extra, self.resumed_tier)
        try:
            found = resume.run(_torch_agree.process_group(self._process_group, self._world_size), step, timeout)
        finally:
            # `extra` and the tier as far as it got, also when it raised part way (states partly restored).
            self.extra, self.resumed_tier = resume.extra, resume.tier
        if found is not None:
            self.resumed_step = found
        else:
            for optimizer in fresh:
                optimizer.state.clear()
        return found

    def load_pretrained(self, step: Optional[int] = None, job: Optional[str] = None,
                        timeout: float = 600.0) -> Optional[int]:
        """Loads the model weights only, in place, from checkpoint `step` (None: the latest complete
        one) of `job` (None: this Checkpointer's own); the optimizer is left as it is.

        For pretrained weights in Hugging Face safetensors: `flashckpt import HF_DIR --root ROOT
        --job JOB --add-prefix model.` makes the Hugging Face names this Checkpointer's
        `model.<state-dict key>` (the model given as `model`, or under "model" in the dict of
        states; a module under another key has that key as its prefix). Every model tensor must be in the checkpoint with its shape and
        dtype (NotFoundError / FailedPreconditionError name the first that is not). A checkpoint of
        another job starts no attempt of this one: the next save() is that of a fresh start.
        Returns the step loaded, or None when the job has no complete checkpoint.
        """
        _, tensors = self._layout.flatten()
        if not any(self._layout.kind(n) == "model" for n in tensors):
            raise ValueError("the model holds no tensors; there is nothing to load")
        self._layout.register(self.client, tensors)
        source = None if job is None or job == self.client.job else job
        got, _ = self.client.restore(tensors, step=step, timeout=timeout, kinds=["model"], job=source)
        return got

    # --- EMA -----------------------------------------------------------------------------------

    def ema_state_dict(self, timeout: float = 60.0) -> Dict[str, torch.Tensor]:
        """The daemon's current EMA as {model state-dict key: fp32 tensor}, as of the last save().
        With several modules among the states the keys keep their "<key>." prefix.

        Raises FailedPreconditionError when no EMA update has been applied yet.
        """
        if not self.ema_enabled:
            raise ValueError("this Checkpointer was created without ema_decay; there is no EMA")
        model_keys = self._layout.model_keys
        if not model_keys:
            raise ValueError("no module among the states (nor a state named 'model'); the EMA covers model tensors")
        tensors = self._layout.flatten()[1]
        self._layout.register(self.client, tensors)
        shapes = self.client.registered
        out: Dict[str, torch.Tensor] = {}
        for name in self.client.ema_names:
            tracked = tensors.get(name)  # each EMA tensor has the name of the tensor it tracks
            device = tracked.device if isinstance(tracked, torch.Tensor) else None
            out[name] = torch.empty(shapes[name][1], dtype=torch.float32, device=device)

        def copy() -> Optional[int]:
            if not out and self._layout.dtensors:
                return None  # every tensor of this rank is written by another: no EMA of its own
            step, _ = self.client.ema(out, timeout=timeout)
            if step is None:
                raise FailedPreconditionError("FAILED_PRECONDITION", "the EMA has no update yet: save() a step that is "
                                              "a multiple of ema_interval first")
            return step

        if not self._layout.dtensors:
            self.ema_step = copy()
        else:
            # A collective: every rank learns whether any failed (and raises), and that all hold
            # the EMA of one step, before the boxes are exchanged.
            group = _torch_agree.process_group(self._process_group, self._world_size)
            step = _torch_agree.stage(group, "copy the daemon's EMA", copy)
            steps = {s for s in (_torch_agree.gather(group, step) if group is not None else [step]) if s is not None}
            if len(steps) > 1:
                raise FailedPreconditionError("FAILED_PRECONDITION", "the ranks' EMAs are of different steps (%s): "
                                              "save() the same steps on every rank (the loss gate, ema_loss_threshold, "
                                              "is decided per rank)" % sorted(steps))
            self.ema_step = next(iter(steps), None)
            out = _torch_dtensor.ema_of_holders(out, self._layout.dtensors, self._layout.others, tensors, group)
        if len(model_keys) != 1:
            return out
        prefix = model_keys[0] + "."
        return {name[len(prefix):] if name.startswith(prefix) else name: t for name, t in out.items()}

    # --- misc ----------------------------------------------------------------------------------

    def status(self) -> Dict[str, Any]:
        """The daemon's status (see flashckpt.Client.status)."""
        return self.client.status()

    def close(self) -> None:
        self._unhook()
        self.client.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

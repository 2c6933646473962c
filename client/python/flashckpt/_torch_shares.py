"""Data-parallel shares in flashckpt.torch: each byte of the replicated state written by one rank.

In a job whose data-parallel ranks hold alike tensors (the parameters of DistributedDataParallel
modules and their optimizer state, or every module's with replicated=True), the ranks split the
writing: the replicated tensors, in state order, are one stream of bytes cut into equal shares, one
per rank, and each rank registers only its share (whole tensors, and flat ranges of those that cross
a cut). A rank's memory checkpoint then holds its share alone, so after a memory restore the ranks
broadcast their shares to each other (spread).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Set, Tuple

import torch

from . import _torch_agree
from . import _torch_zero
from . import _shares
from ._tensors import Shape
from ._torch_state import Layout, is_optimizer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class Shares:
    """Who writes which bytes of `layout`'s tensors. `replicated` is the Checkpointer's argument:
    True, False, or None (DDP modules' state, when the job has no tensor or pipeline parallelism
    and no EMA: `ema` and `model_parallel`, tp_degree * pp_degree). The ranks that split the
    writing are those of the resume process group (`process_group`, `world_size`: see
    _torch_agree.process_group)."""

    def __init__(self, layout: Layout, replicated: Optional[bool], ema: bool, model_parallel: int,
                 process_group: Optional[ProcessGroup], world_size: int) -> None:
        self._layout = layout
        self._replicated = replicated
        self._ema = ema
        self._model_parallel = model_parallel
        self._process_group = process_group
        self._world_size = world_size

    def ranks(self) -> Optional[Tuple[int, int]]:
        """(rank, ranks) of this rank among the replicas that split the writing, or None."""
        if self._replicated is False:
            return None
        group = _torch_agree.process_group(self._process_group, self._world_size)
        if group is None:
            if self._replicated:
                raise ValueError("replicated=True needs a torch.distributed process group of the job's world size")
            return None
        if self._replicated is None:
            ddp = any(isinstance(v, torch.nn.parallel.DistributedDataParallel) for v in self._layout.states.values())
            if not ddp or self._ema or self._layout.shard_specs is not None or self._model_parallel != 1:
                return None
        return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)

    def split(self, tensors: Dict[str, Any],
              of_rank: Optional[int] = None) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
        """(tensors, specs): what this rank (or data-parallel rank `of_rank`) writes. The replicated
        tensors, in state order, are cut into shares as _shares.share_ranges says. The buffers of
        replicated modules are rank 0's; every other tensor is written by the rank that holds it."""
        dp = self.ranks()
        if dp is None:
            return tensors, {}
        in_order, buffers = self.replicated_names(tensors)
        # A non-contiguous tensor is written whole: register() refuses it, naming it.
        return _shares.split(tensors, in_order, buffers, dp[0] if of_rank is None else of_rank, dp[1],
                             numel=lambda t: int(t.numel()),
                             flat_slice=lambda t, first, end: t.view(-1)[first:end] if t.is_contiguous() else None,
                             shape=lambda t: list(t.shape))

    def replicated_names(self, tensors: Mapping[str, Any]) -> Tuple[List[str], Set[str]]:
        """(replicated, buffers): the names of `tensors` alike on every data-parallel rank, in state
        order, and those of the replicated modules' buffers (which are not among them)."""
        # The parameters of the replicated modules (DDP's; every module with replicated=True) and
        # the optimizer state of those parameters. Their buffers are rank 0's alone: DDP broadcasts
        # rank 0's before each forward, which then updates them on each rank (BatchNorm statistics).
        ddp = torch.nn.parallel.DistributedDataParallel
        states = self._layout.states
        params: Set[str] = set()
        buffers: Set[str] = set()
        storage: Set[Tuple[int, Shape]] = set()
        for key in self._layout.model_keys:
            module = states[key]
            if isinstance(module, torch.nn.Module) and (self._replicated or isinstance(module, ddp)):
                for n, p in module.named_parameters():
                    params.add("%s.%s" % (key, n))
                    storage.add((p.data_ptr(), tuple(p.shape)))
                buffers.update("%s.%s" % (key, n) for n, _ in module.named_buffers())

        def alike(name: str) -> bool:
            t = tensors[name]
            if name in params or (t.data_ptr(), tuple(t.shape)) in storage:  # a tied parameter's second name too
                return True
            owner = states.get(name.split(".", 1)[0])
            if not is_optimizer(owner) or _torch_zero.is_zero(owner):
                return False
            param = self._layout.param_of(name)
            return param is not None and param[0] in params

        in_order = [n for n in tensors if alike(n)]
        return in_order, buffers - set(in_order)

    def spread(self, group: ProcessGroup, targets: Dict[str, Any]) -> None:
        """After each data-parallel rank restored its own share of `targets` (its memory checkpoint
        holds no more), hands every share to every rank: each rank broadcasts its part of the
        replicated tensors, and rank 0 the buffers. The other tensors are each rank's own. Every
        rank of the group makes the same broadcasts, in the same order."""
        dp = self.ranks()
        if dp is None:
            return
        staging = (torch.device("cuda", torch.cuda.current_device())
                   if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu"))
        for r, tensors in enumerate(self._plan(targets)):
            source = torch.distributed.get_global_rank(group, r)
            # One broadcast per dtype of rank r's share, through a flat buffer of that share's size,
            # on the device the group's backend communicates from (the tensors may be on the CPU
            # and a GPU both: Adam keeps its step counts on the CPU).
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for dtype, ts in by_dtype.items():
                if r == dp[0]:
                    flat = torch.cat([t.reshape(-1).to(staging) for t in ts])
                else:
                    flat = torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=staging)
                torch.distributed.broadcast(flat, src=source, group=group)
                if r != dp[0]:
                    at = 0
                    for t in ts:
                        t.copy_(flat[at:at + t.numel()].view_as(t))
                        at += t.numel()

    def _plan(self, targets: Dict[str, Any]) -> List[List[torch.Tensor]]:
        """Per data-parallel rank, the tensors (views of `targets`) that it broadcasts in spread():
        its part of the replicated tensors, and for rank 0 also the buffers."""
        dp = self.ranks()
        if dp is None:
            return []
        in_order, buffers = self.replicated_names(targets)
        spread = set(in_order) | buffers
        return [[t for name, t in self.split(targets, of_rank=r)[0].items() if name in spread and t.numel() > 0]
                for r in range(dp[1])]

    def digest(self, targets: Dict[str, Any]) -> str:
        """What spread() will broadcast (dtypes and sizes, in order): every rank must compute the
        same, else the broadcasts would not pair up."""
        plan = [[(str(t.dtype), t.numel()) for t in tensors] for tensors in self._plan(targets)]
        return hashlib.sha256(repr(plan).encode("utf-8")).hexdigest()

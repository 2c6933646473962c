"""DTensors in flashckpt.torch: the state of FSDP2 (fully_shard), tensor parallelism
(parallelize_module) and both on a 2-D mesh.

A DTensor among the states is saved as its local tensor, a box of the global tensor: the offset and
shape that its placements give on its mesh (Shard(dim) splits as torch.chunk does, so the last
shards may be smaller, or empty; Replicate holds the whole extent). The daemon restores any box of a
global tensor from whichever files hold it, so a checkpoint resumes on another mesh. A box that
several ranks hold (a Replicate placement) is written by one of them, chosen per tensor so that
those ranks share the writing; the others register it as a replica (held, restored, not written).
Partial placements (pending reductions) are refused.

The daemon's EMA follows the writing: each rank's daemon averages the boxes the rank writes. ema()
hands every rank the EMA of all it holds, placed like the tensors, by passing each replicated box's
average from its writer to the other holders (ema_of_holders).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

import torch

from ._tensors import Shape

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

try:  # torch 2: public since 2.4, under torch.distributed._tensor before
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # torch 1.13, or a build without torch.distributed
    DTensor = None
    compute_local_shape_and_global_offset = None
try:
    from torch.distributed.tensor import Partial
except ImportError:  # before torch 2.5 (no Partial: no DTensor either before 2.4)
    Partial = None


def is_dtensor(x: object) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


class Piece:
    """This rank's part of DTensor `dt` (the `ordinal`-th DTensor of the states): its local tensor
    (`local`, sharing the DTensor's memory), the box in the global tensor, and whether this rank
    writes it (`writer`) or holds a replica that another rank writes."""

    def __init__(self, name: str, dt: Any, ordinal: int) -> None:
        self.dtensor = dt
        placements = tuple(dt.placements)
        partial = [p for p in placements if p.is_partial()]
        if partial:
            raise ValueError("DTensor '%s' has a Partial placement (%s): its values are pending a reduction; save "
                             "it after the reduction (redistribute to Shard or Replicate)" % (name, partial[0]))
        with torch.no_grad():
            self.local: torch.Tensor = dt.to_local().detach()
        mesh = dt.device_mesh
        self.global_shape: List[int] = list(dt.shape)
        shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
        self.box_shape: List[int] = list(shape)
        self.box_offset: List[int] = list(offset)
        if tuple(self.local.shape) != tuple(shape):
            raise ValueError("DTensor '%s': its local tensor has shape %s, its placements %s on mesh %s give %s"
                             % (name, list(self.local.shape), placements, tuple(mesh.shape), list(shape)))
        # The ranks of the Replicate mesh dimensions hold the same box: the one at index ordinal % n
        # among them writes it.
        coordinate = mesh.get_coordinate()
        replicate = [d for d, p in enumerate(placements) if p.is_replicate()]
        holders = math.prod(mesh.size(d) for d in replicate)
        index = 0
        for d in replicate:
            index = index * mesh.size(d) + (coordinate[d] if coordinate is not None else 0)
        self.writer: bool = ordinal % holders == index

    def spec(self) -> Dict[str, Any]:
        spec: Dict[str, Any] = {"global_shape": self.global_shape, "box_offset": self.box_offset,
                                "box_shape": self.box_shape}
        if not self.writer:
            spec["replica"] = True
        return spec

    def wrap(self, local: torch.Tensor) -> Any:
        """`local` (a tensor of this piece's box) as a DTensor of this piece's mesh and placements."""
        if local is self.local:
            return self.dtensor
        dt = self.dtensor
        return DTensor.from_local(local, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape,
                                  stride=dt.stride())

    def wrap_from_writer(self, local: Optional[torch.Tensor], like: torch.Tensor) -> Any:
        """A DTensor of this piece's placements whose box, on every rank holding it, is the writer's
        `local` (a collective over the piece's Replicate mesh dimensions; the other holders pass
        None). Each holder adds its box to the writer's, the others' zeros: the sum is the writer's
        values exactly. `like`: a tensor of the dtype and device wanted."""
        dt = self.dtensor
        placements = tuple(dt.placements)
        if not any(p.is_replicate() for p in placements):
            assert local is not None, "a box no other rank holds is written by its holder"
            return self.wrap(local)
        if local is None or not self.writer:
            local = torch.zeros(self.box_shape, dtype=like.dtype, device=like.device)
        summed = tuple(Partial("sum") if p.is_replicate() else p for p in placements)
        pending = DTensor.from_local(local, dt.device_mesh, summed, run_check=False, shape=dt.shape,
                                     stride=dt.stride())
        return pending.redistribute(dt.device_mesh, placements)


def pieces(tensors: Dict[str, Any]) -> Dict[str, Piece]:
    """{name: Piece} of the DTensors among `tensors`, whose values it replaces by their local
    tensors (in place: `tensors` then holds what this rank registers and copies)."""
    out: Dict[str, Piece] = {}
    for name, t in list(tensors.items()):
        if is_dtensor(t):
            piece = Piece(name, t, len(out))
            out[name] = piece
            tensors[name] = piece.local
    return out


def box(piece: Optional[Piece]) -> Optional[Dict[str, List[int]]]:
    if piece is None:
        return None
    return {"global_shape": piece.global_shape, "box_offset": piece.box_offset, "box_shape": piece.box_shape}


def local_shape(piece: Piece, whole: Shape) -> Optional[Shape]:
    return tuple(piece.box_shape) if tuple(piece.global_shape) == tuple(whole) else None


def has_dtensor_params(optimizer: Any) -> bool:
    return any(is_dtensor(p) for g in getattr(optimizer, "param_groups", []) for p in g["params"])


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Gives a fresh optimizer (no state yet) whose parameters are DTensors its state, as DTensors
    placed like their parameters, so that resume() restores into them in place: one step with zero
    gradients and a learning rate of 0, as torch.distributed.checkpoint.state_dict does. The
    parameters do not change; the restored state replaces the step counts."""
    if optimizer.state or any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    saved_lrs: List[Tuple[Dict[str, Any], Any]] = []
    for g in optimizer.param_groups:
        if "lr" in g:
            saved_lrs.append((g, g["lr"]))
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in saved_lrs:
            g["lr"] = lr
        for p in params:
            p.grad = None


def ema_of_holders(ema: Dict[str, torch.Tensor], dtensors: Mapping[str, Piece], others: Mapping[str, int],
                   tracked: Mapping[str, Any], group: Optional[ProcessGroup]) -> Dict[str, Any]:
    """Every rank's EMA of every tensor it holds, from `ema`: the EMA of what this rank writes
    ({name: fp32 tensor}, the daemon's). A DTensor's comes back as a DTensor placed like it; a
    replicated box's from the rank that writes it; a tensor of `others` (alike on every rank,
    written by rank others[name] % world size of `group`) broadcast from that rank. `tracked`: the
    tensors the EMA tracks, by name. A collective over `group` (the job's ranks, None in one
    process): every rank calls it."""
    import torch.distributed as dist
    names = set(ema)
    if group is not None:
        gathered: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, sorted(ema), group=group)
        names = set().union(*gathered)
    out: Dict[str, Any] = {}
    for name in sorted(names):  # the same order on every rank: the collectives pair up
        piece = dtensors.get(name)
        mine = ema.get(name)
        like = tracked.get(name)
        device = like.device if isinstance(like, torch.Tensor) else None
        if piece is not None:
            out[name] = piece.wrap_from_writer(mine, torch.empty(0, dtype=torch.float32, device=device))
        elif group is not None and name in others and like is not None:
            writer = dist.get_global_rank(group, others[name] % dist.get_world_size(group))
            if mine is None:
                mine = torch.empty(like.shape, dtype=torch.float32, device=device)
            dist.broadcast(mine, src=writer, group=group)
            out[name] = mine
        elif mine is not None:
            out[name] = mine
    return out

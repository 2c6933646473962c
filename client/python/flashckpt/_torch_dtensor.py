"""DTensors in flashckpt.torch: the state of FSDP2 (fully_shard), tensor parallelism
(parallelize_module) and both on a 2-D mesh.

A DTensor among the states is saved as its local tensor, a box of the global tensor: the offset and
shape that its placements give on its mesh (Shard(dim) splits as torch.chunk does, so the last
shards may be smaller, or empty; Replicate holds the whole extent). The daemon restores any box of a
global tensor from whichever files hold it, so a checkpoint resumes on another mesh. A box that
several ranks hold (a Replicate placement) is written by one of them, chosen per tensor so that
those ranks share the writing; the others register it as a replica (held, restored, not written).
Partial placements (pending reductions) are refused.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._tensors import Shape

try:  # torch 2: public since 2.4, under torch.distributed._tensor before
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # torch 1.13, or a build without torch.distributed
    DTensor = None
    compute_local_shape_and_global_offset = None


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

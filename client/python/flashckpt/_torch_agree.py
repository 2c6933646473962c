"""A Checkpointer's place in torch.distributed, and how its ranks agree while resuming.

rank_and_size and process_group say which ranks a Checkpointer works with. The agreement during
resume() is _agree's (with a process group, an all_gather_object per stage, and a
broadcast_object_list in borrow_part; the group's timeout, init_process_group(timeout=), bounds the
wait for a rank that never gets there); its functions are re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# The agreement itself is framework-neutral (_agree); flashckpt.torch's modules call it through here.
from ._agree import (agree, borrow_part, common_step, gather, memory_failure, memory_step,  # noqa: F401
                     raise_fatal, reports, same_step, stage)


def rank_and_size() -> Tuple[int, int]:
    """(rank, world size) of torch.distributed when it is initialised, else (0, 1)."""
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def process_group(given: Optional[ProcessGroup], world_size: int) -> Optional[ProcessGroup]:
    """The process group whose ranks agree on the resumed step, or None (one process, or no group):
    `given` (which must have `world_size` ranks), else the default group when it has world_size ranks."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    if given is not None:
        if dist.get_world_size(given) != world_size:
            raise ValueError("process_group has %d ranks, this Checkpointer's job has world_size %d"
                             % (dist.get_world_size(given), world_size))
        return given
    if world_size == 1 or dist.get_world_size() != world_size:
        return None
    return dist.group.WORLD

"""Data-parallel shares, for any framework: which bytes of the replicated state each rank writes.

The replicated tensors, in state order, are one stream of bytes cut into equal shares, one per
rank. An element belongs to the share its first byte is in, so a tensor that crosses a cut is
written as flat ranges (elements first..end of the flattened tensor) by the ranks whose shares it
crosses; an empty tensor goes to the rank whose share its position falls in (the last rank at the
very end). flashckpt.torch (_torch_shares) and flashckpt.paddle cut the same way.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Tuple


def share_ranges(sizes: Sequence[Tuple[str, int, int]], rank: int, ranks: int) -> Dict[str, Tuple[int, int]]:
    """{name: (first, end)}: the elements of each replicated tensor that `rank` of `ranks` writes,
    given (name, elements, bytes per element) of every replicated tensor in state order. A tensor
    this rank writes none of is absent; (0, elements) is the whole tensor."""
    total = sum(numel * size for _, numel, size in sizes)
    lo, hi = total * rank // ranks, total * (rank + 1) // ranks
    out: Dict[str, Tuple[int, int]] = {}
    pos = 0
    for name, numel, size in sizes:
        if numel == 0:
            if lo <= pos < hi or (pos == total and rank == ranks - 1):
                out[name] = (0, 0)
            continue
        first = max(0, -(-(lo - pos) // size))
        end = min(numel, -(-(hi - pos) // size))
        pos += numel * size
        if first < end:
            out[name] = (first, end)
    return out


def owners(sizes: Sequence[Tuple[str, int, int]], ranks: int) -> List[Dict[str, Tuple[int, int]]]:
    """share_ranges of every rank, in rank order."""
    return [share_ranges(sizes, r, ranks) for r in range(ranks)]


def split(tensors: Mapping[str, Any], in_order: Sequence[str], buffers: Collection[str], rank: int, ranks: int,
          numel: Callable[[Any], int], flat_slice: Callable[[Any, int, int], Optional[Any]],
          shape: Callable[[Any], List[int]]) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """(tensors, specs): what data-parallel `rank` of `ranks` writes of `tensors`. The replicated
    ones (`in_order`, in state order) are cut as share_ranges says, each part a view of the tensor's
    own memory (`flat_slice(t, first, end)`; None: written whole, as for a tensor that has no flat
    view) with its spec; the buffers of the replicated modules (`buffers`) are rank 0's; every other
    tensor is this rank's own (a sharding rank's optimizer state)."""
    ranges = share_ranges([(n, numel(tensors[n]), tensors[n].element_size()) for n in in_order], rank, ranks)
    out: Dict[str, Any] = {}
    specs: Dict[str, Dict[str, Any]] = {}
    replicated = set(in_order)
    for name, t in tensors.items():
        if name in buffers:
            if rank == 0:
                out[name] = t
        elif name not in replicated:
            out[name] = t
        elif name in ranges:
            first, end = ranges[name]
            part = None if (first, end) in ((0, numel(t)), (0, 0)) else flat_slice(t, first, end)
            if part is None:
                out[name] = t
            else:
                out[name] = part
                specs[name] = {"box_shape": shape(t), "flat_range": (first, end)}
    return out, specs

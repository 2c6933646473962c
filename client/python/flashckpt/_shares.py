"""Data-parallel shares, for any framework: which bytes of the replicated state each rank writes.

The replicated tensors, in state order, are one stream of bytes cut into equal shares, one per
rank. An element belongs to the share its first byte is in, so a tensor that crosses a cut is
written as flat ranges (elements first..end of the flattened tensor) by the ranks whose shares it
crosses; an empty tensor goes to the rank whose share its position falls in (the last rank at the
very end). flashckpt.torch (_torch_shares) and flashckpt.paddle cut the same way.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple


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

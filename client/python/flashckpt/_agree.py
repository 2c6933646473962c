"""How the ranks of a job agree while resuming, for any framework's group of ranks.

During resume() every rank restores the same step, and a failure on any rank raises on every rank.
Each function below that takes a `group` is a collective when the group is not None: every rank of
the group calls it, in the same order (one gather each), and the framework's timeout bounds the
wait for a rank that never gets there. With group None (one process, or no group) they decide from
this rank's view alone. A group is a torch.distributed process group (flashckpt.torch) or a
Collective (flashckpt.paddle's over paddle.distributed).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, TypeVar, cast

from .errors import FailedPreconditionError, FlashckptError, StructureMismatchError

_T = TypeVar("_T")
# A torch.distributed ProcessGroup or a Collective (typed loosely: torch need not be importable).
Group = Any
# One rank's report: (failure, value), failure None or (fatal, text) where fatal means an error
# other than the daemon's.
Report = Tuple[Optional[Tuple[bool, str]], Any]


class Collective:
    """A framework's group of ranks, for the functions here: gather() returns every rank's value in
    rank order (every rank calls it, in the same order), bounded by the framework's own timeout."""

    def gather(self, value: object) -> List[Any]:
        raise NotImplementedError

    def broadcast(self, value: object, source: int) -> Any:
        """The `value` of the group's rank `source`, on every rank."""
        raise NotImplementedError


def gather(group: Group, value: object) -> List[Any]:
    """Every rank's `value`, in rank order: through the Collective, or a torch.distributed process
    group (all_gather_object; the group's timeout, init_process_group(timeout=), bounds the wait for
    a rank that never gets here)."""
    if isinstance(group, Collective):
        return group.gather(value)
    import torch
    out: List[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, value, group=group)
    return out


def settle(client: Any, timeout: float) -> None:
    """Waits (up to `timeout` seconds) until no rank of `client`'s job has a snapshot committed but
    not yet persisted: a restarted trainer must not pick the latest complete checkpoint while its
    predecessor's last save is still being written (that one would complete later and refuse to be
    saved again)."""
    deadline = time.monotonic() + timeout
    while True:
        jobs = [j for j in client.status().get("jobs", []) if j.get("job") == client.job]
        busy = any(s.get("state") in ("committed", "persisting")
                   for j in jobs for r in j.get("ranks", []) for s in r.get("slots", []))
        if not busy or time.monotonic() > deadline:
            return
        time.sleep(0.02)


def broadcast(group: Group, value: object, source: int) -> Any:
    """The `value` of the group's rank `source` (its index in the group), on every rank."""
    if isinstance(group, Collective):
        return group.broadcast(value, source)
    import torch
    box: List[Any] = [value]
    torch.distributed.broadcast_object_list(box, src=torch.distributed.get_global_rank(group, source), group=group)
    return box[0]


def agree(group: Group, what: str, error: Optional[BaseException]) -> None:
    """Raises on every rank when some rank failed `what` (`error`: this rank's exception or None)."""
    reports = gather(group, None if error is None else "%s: %s" % (type(error).__name__, error))
    if error is not None:
        raise error
    failed = [(r, why) for r, why in enumerate(reports) if why is not None]
    if failed:
        rank, why = failed[0]
        raise FailedPreconditionError("FAILED_PRECONDITION", "rank %d of the process group could not %s "
                                      "(every rank raises): %s" % (rank, what, why))


def stage(group: Optional[Group], what: str, fn: Callable[[], _T]) -> _T:
    """fn()'s result; with a group, every rank learns whether fn failed on any rank, and raises then."""
    if group is None:
        return fn()
    result: Optional[_T] = None
    error: Optional[BaseException] = None
    try:
        result = fn()
    except BaseException as e:  # reported to the other ranks (an interrupt too), then raised here
        error = e
    agree(group, what, error)
    return cast(_T, result)  # agree() raised unless fn() returned


def reports(group: Optional[Group], error: Optional[BaseException], value: object = None) -> List[Report]:
    """Every rank's (failure, value), in rank order (one gather, which every rank makes): failure is
    None, or (fatal, text) where fatal means an error other than the daemon's."""
    failure = None if error is None else (not isinstance(error, FlashckptError),
                                          "%s: %s" % (type(error).__name__, error))
    mine = (failure, value)
    return [mine] if group is None else cast(List[Report], gather(group, mine))


def raise_fatal(reports: List[Report], what: str) -> None:
    """Raises, on every rank, when a rank failed `what` with an error other than the daemon's."""
    for rank, (failure, _) in enumerate(reports):
        if failure is not None and failure[0]:
            raise FailedPreconditionError("FAILED_PRECONDITION", "rank %d of the process group could not %s "
                                          "(every rank raises): %s" % (rank, what, failure[1]))


def same_step(group: Group, step: Optional[int]) -> None:
    """Raises ValueError on every rank when the ranks asked resume() for different steps."""
    asked = gather(group, step)
    if len(set(asked)) != 1:
        raise ValueError("the ranks of the process group asked resume() for different steps (%s); every "
                         "rank must ask for the same one" % ", ".join(
                             "rank %d: %s" % (r, "latest" if s is None else s) for r, s in enumerate(asked)))


def common_step(group: Group, found: Optional[int], job: str) -> Optional[int]:
    """The step every rank restores, given the checkpoint each found of `job` (`found`, this rank's):
    the oldest step found, since a newer one that completed while the ranks looked is not yet seen
    by all; None when no rank found one. Raises on every rank when some found one and others none."""
    steps = gather(group, found)
    if any(s is None for s in steps) and any(s is not None for s in steps):
        rank = steps.index(None)
        have = next(s for s in steps if s is not None)
        raise FailedPreconditionError("FAILED_PRECONDITION", "rank %d of the process group finds no "
                                      "complete checkpoint of job '%s' while another rank finds step %d "
                                      "(every rank raises)" % (rank, job, have))
    return None if found is None else min(steps)


def memory_step(group: Optional[Group], error: Optional[BaseException],
                mine: Optional[Tuple[List[int], Optional[int]]]) -> Optional[int]:
    """The memory checkpoint every rank restores, from what each listed (`mine`: this rank's
    (memory steps, disk step), None when its daemon cannot tell; `error`: this rank's failure to
    list them): the newest step all of them hold, if no rank sees a newer complete checkpoint on
    disk; None: the disk path. A rank that cannot tell sends the others to the disk too."""
    views = reports(group, error, mine)
    if error is not None:
        raise error
    raise_fatal(views, "list its memory checkpoints")
    held = [value for _, value in views]
    if any(v is None for v in held):
        return None
    common: Set[int] = {int(s) for s in held[0][0]}
    for steps, _ in held[1:]:
        common &= {int(s) for s in steps}
    disks = [int(disk) for _, disk in held if disk is not None]
    if not common or (disks and max(common) < max(disks)):
        return None
    return max(common)


def memory_failure(group: Optional[Group], memory: int, error: Optional[BaseException],
                   digest: Optional[str]) -> Optional[Tuple[int, str]]:
    """(rank, why) of the first rank whose restore of memory checkpoint `memory` failed with the
    daemon's error, or whose shares do not pair up with rank 0's (`digest`: what this rank's
    shares will broadcast); None when every rank restored it. An error other than the daemon's
    raises on every rank (this rank's own `error` as it is)."""
    views = reports(group, error, digest)
    if error is not None and not isinstance(error, FlashckptError):
        raise error
    raise_fatal(views, "restore memory checkpoint step %d" % memory)
    failed = [(r, failure[1]) for r, (failure, _) in enumerate(views) if failure is not None]
    digests = [value for _, value in views]
    if not failed and len(set(digests)) > 1:
        first = next(r for r, d in enumerate(digests) if d != digests[0])
        failed = [(first, "its share of the replicated tensors does not pair up with rank 0's (the "
                          "ranks' replicated state differs)")]
    return failed[0] if failed else None


def borrow_part(group: Group, rank: int, found: int, blob: Any) -> Tuple[Dict[str, Any], bool]:
    """(blob, borrowed): this rank's part of checkpoint `found` (`blob`, as the probe read it), or,
    on a rank whose number (`rank`, the job's) the job that saved it did not have (`blob` is None),
    a copy of rank 0's part without its RNG state, handed on by the group's rank that read it
    (borrowed=True). Each part records the saving job's world size; the ranks below it must all
    have their part (without that record, from before it was kept: the parts must be those of
    ranks 0 .. n-1), else every rank raises. Every rank makes the same calls: one gather, and a
    broadcast when some rank has no part."""
    saved_world = blob.get("world_size") if isinstance(blob, dict) else None
    have = cast(List[Tuple[int, bool, Optional[int]]], gather(group, (rank, blob is not None, saved_world)))
    if all(has for _, has, _ in have):
        return blob, False
    holders = sorted(r for r, has, _ in have if has)
    missing = sorted(r for r, has, _ in have if not has)
    if not holders:
        raise StructureMismatchError("checkpoint-%d was not written by a flashckpt Checkpointer (it holds the "
                                     "extra state of none of the %d ranks); restore it with flashckpt.Client"
                                     % (found, len(have)))
    worlds = {w for _, has, w in have if has and isinstance(w, int)}
    if worlds:
        saved = max(worlds)
        lost = [r for r in missing if r < saved]
        if lost:
            raise FailedPreconditionError("FAILED_PRECONDITION", "checkpoint-%d was saved by %d ranks but holds "
                                          "no part of rank %d (its extra.rank%05d.json is gone; every rank "
                                          "raises)" % (found, saved, lost[0], lost[0]))
    elif holders != list(range(len(holders))):
        raise FailedPreconditionError("FAILED_PRECONDITION", "checkpoint-%d holds no part of rank %d but one of "
                                      "rank %d: it was not written by the ranks 0 to n-1 of a "
                                      "flashckpt Checkpointer job (every rank raises)"
                                      % (found, missing[0], holders[-1]))
    # Rank 0's part, from the group's rank that restores rank 0 (its tree describes the whole
    # state of a data-parallel job, and, for a ZeroRedundancyOptimizer, its structure).
    source = next(g for g, (r, _, _) in enumerate(have) if r == 0)
    zero = broadcast(group, blob if rank == 0 else None, source)
    if blob is not None:
        return blob, False
    part = dict(cast(Dict[str, Any], zero))
    part.pop("rng", None)  # rank 0's random streams: this rank keeps its own
    return part, True

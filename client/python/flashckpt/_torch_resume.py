"""How flashckpt.torch.Checkpointer.resume() restores a checkpoint into the states, in stages.

    0. memory     with step=None: the newest memory checkpoint every rank holds (unless a complete
                  disk checkpoint is newer); each rank restores its own (a ZeroRedundancyOptimizer
                  its partition, the same at the same world size), and in a job that splits its
                  replicated tensors the ranks then broadcast their shares. A daemon's error on any
                  rank sends every rank to the disk.
    1. probe      read the checkpoint's structure (the extra state each rank saved with it, from
                  its files: no tensor is read, nothing registered); the ranks agree on the step,
                  and a rank whose number the saving job did not have borrows rank 0's part.
    2. match      compare the saved structure with the current states on every rank, before any
                  rank loads anything; a ZeroRedundancyOptimizer takes its new partition's state.
    3. restore    register the checkpoint's layout and restore its tensors, in place where the
                  tensor exists now.
    4. hand over  give each state its part (through load_state_dict, unless it is a module
                  restored wholly in place; a dict is refilled), the RNG state and the saved `extra`.

With a process group each stage ends in a gather (_torch_agree), so a failure on any rank raises
on every rank.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

import torch

from . import _agree
from . import _state
from . import _torch_agree
from . import _torch_zero
from ._state import Node
from ._torch_shares import Shares
from ._torch_state import TORCH_DTYPES, Layout, is_optimizer, read_blob, set_rng_state
from .client import Client
from .errors import FailedPreconditionError, FlashckptError, StructureMismatchError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# What a rank restored of a memory checkpoint when it holds only its share: (blob, targets, tensors).
MemoryShare = Tuple[Dict[str, Any], Dict[str, torch.Tensor], Dict[str, Any]]


class Resume:
    """One resume() of a Checkpointer: its client, its states (`layout`), who writes what (`shares`),
    the job's world size and whether to restore the RNG state (`rng`). `extra` and `tier` start as
    the Checkpointer's and become the restored checkpoint's `extra` and the tier the daemon
    restored it from, once each is known."""

    def __init__(self, client: Client, layout: Layout, shares: Shares, world_size: int, rng: bool,
                 extra: Any, tier: Optional[str]) -> None:
        self._client = client
        self._layout = layout
        self._shares = shares
        self._world_size = world_size
        self._rng = rng
        self.extra = extra
        self.tier = tier

    def run(self, group: Optional[ProcessGroup], step: Optional[int], timeout: float) -> Optional[int]:
        """Restores checkpoint `step` (None: the latest) agreeing with the ranks of `group`; returns
        its step, or None when there is none (see Checkpointer.resume)."""
        if group is not None:
            _torch_agree.same_step(group, step)
        # 0. The latest may be a memory checkpoint: the newest step every rank holds in its daemon's
        # memory, unless a complete disk checkpoint is newer.
        memory_failed: Optional[str] = None  # why a memory restore failed, when the disk path follows it
        if step is None:
            memory = self._memory_step(group, timeout)
            if memory is not None:
                memory_failed = self._from_memory(group, memory, timeout)
                if memory_failed is None:
                    return memory
                warnings.warn("%s; every rank restores from disk instead" % memory_failed, RuntimeWarning)
        return self._from_disk(group, step, timeout, memory_failed)

    # --- memory ----------------------------------------------------------------------------------

    def _memory_step(self, group: Optional[ProcessGroup], timeout: float) -> Optional[int]:
        """The memory checkpoint every rank restores: the newest step all of them hold (verified by
        their daemons), if no rank sees a newer complete checkpoint on disk; None: the disk path.
        A rank whose daemon cannot tell (an older daemon, say) sends the others to the disk too.
        A job of several ranks without a process group cannot agree on one: the disk path."""
        if group is None and self._world_size > 1:
            return None
        mine: Optional[Tuple[List[int], Optional[int]]] = None
        error: Optional[BaseException] = None
        try:
            _agree.settle(self._client, min(timeout, 60.0))  # the last disk save of the trainer that died counts too
            # Unverified: the restore verifies the one every rank picks (a failure sends them all to
            # the disk), so the checkpoint is read once.
            mine = self._client.restorable(min(timeout, 60.0), verify=False)
        except FlashckptError as e:
            warnings.warn("rank %d cannot list its memory checkpoints (%s); resuming from disk"
                          % (self._client.rank, e), RuntimeWarning)
        except BaseException as e:  # reported to the other ranks before it is raised
            error = e
        return _torch_agree.memory_step(group, error, mine)

    def _from_memory(self, group: Optional[ProcessGroup], memory: int, timeout: float) -> Optional[str]:
        """Restores memory checkpoint `memory` on every rank: None once every rank has, else why
        not (a daemon's error on some rank), and every rank then reads the disk instead."""
        error: Optional[BaseException] = None
        restored: Optional[MemoryShare] = None
        digest: Optional[str] = None
        try:
            restored = self._restore_memory(memory, timeout)
            if restored is not None:
                digest = self._shares.digest(restored[1])
        except BaseException as e:  # reported to the other ranks before anything is raised
            error = e
        failed = _torch_agree.memory_failure(group, memory, error, digest)
        if failed is None:
            if group is not None and restored is not None:
                # Each data-parallel rank restored its own share: the ranks hand theirs on.
                mblob, targets, mtensors = restored
                self._shares.spread(group, targets)
                _torch_agree.stage(group, "load memory checkpoint step %d" % memory,
                                   lambda: self._hand_over(mblob, targets, mtensors))
            return None
        # The daemon's errors (a checkpoint dropped meanwhile, say): every rank reads the disk,
        # which overwrites whatever the others restored.
        return "the restore of memory checkpoint step %d failed on rank %d (%s)" % (memory, failed[0], failed[1])

    def _restore_memory(self, step: int, timeout: float) -> Optional[MemoryShare]:
        """Restores this rank's memory checkpoint `step`: its structure from the extra state the
        daemon keeps with it, then the tensors, registered as save() registered them (so the daemon
        keeps the segment that holds it). A rank of a job that splits its replicated tensors holds
        only its share of them: it returns (blob, targets, tensors) for Shares.spread and
        _hand_over, which every rank calls once every rank has restored its share; None otherwise."""
        tree, tensors = self._layout.flatten()
        extra = self._client.memory_extra(step, timeout=min(timeout, 60.0), verify=False)
        if extra is None:
            raise FailedPreconditionError("FAILED_PRECONDITION", "rank %d no longer holds memory checkpoint step %d"
                                          % (self._client.rank, step))
        blob = read_blob(extra)
        if blob is None:
            raise StructureMismatchError("memory checkpoint step %d was not taken by flashckpt.torch.Checkpointer"
                                         % step)
        self._check_structure(step, blob, tree)
        saved_world = blob.get("world_size", self._world_size)
        if saved_world != self._world_size:
            # Checked before anything is registered: a layout of other shares would replace the
            # segment, and the memory checkpoints in it.
            raise FailedPreconditionError("FAILED_PRECONDITION", "memory checkpoint step %d was taken by a job of %s "
                                          "ranks, this one has %d" % (step, saved_world, self._world_size))
        if self._layout.has_zero():
            # The same world size, so the same partitions: this rank's own part describes the state
            # of every parameter it holds, and the saved tree is cut down to those (as save()
            # registered them, which is what the memory checkpoint holds).
            _torch_zero.take_partitions(self._layout.states, blob,
                                        [_torch_zero.resume_part(self._layout.states, blob, False)])
        shares = self._shares.ranks() is not None
        targets = self._restore_tensors(step, blob, tensors, timeout, shares=shares)
        if self._client.restored_tier not in ("memory", "peer", "parity"):
            # The daemon no longer held it and read a disk checkpoint of the same step: the same state.
            warnings.warn("memory checkpoint step %d was gone; rank %d restored it from disk"
                          % (step, self._client.rank), RuntimeWarning)
        if shares:
            return blob, targets, tensors
        self._hand_over(blob, targets, tensors)
        return None

    # --- disk ------------------------------------------------------------------------------------

    def _from_disk(self, group: Optional[ProcessGroup], step: Optional[int], timeout: float,
                   memory_failed: Optional[str]) -> Optional[int]:
        """Restores checkpoint `step` (None: the latest complete one) from the daemon's tiers after
        the probe; None when there is none. `memory_failed`: why the memory path failed before."""
        # 1. Probe: the checkpoint's structure from the extra state saved with it, and agree on the step.
        tree, tensors, found, blob = _torch_agree.stage(group, "read its checkpoint",
                                                        lambda: self._read(group, step, timeout))
        if group is not None:
            agreed = _torch_agree.common_step(group, found, self._client.job)
            if agreed is not None:
                # Every rank takes part in this stage, also those that found it already.
                found, blob = _torch_agree.stage(
                    group, "read checkpoint-%d" % agreed,
                    lambda: (found, blob) if agreed == found else self._probe(agreed, timeout))
        if found is None:
            if memory_failed is not None:
                # Some ranks may hold the memory checkpoint's state, others their own: no common start.
                raise FailedPreconditionError("FAILED_PRECONDITION", "%s and job '%s' has no complete checkpoint on "
                                              "disk to restore instead; restart every rank of the job"
                                              % (memory_failed, self._client.job))
            return None
        chosen: int = found  # for the closures below, which do not see `found` narrowed
        # A rank whose number the saving job did not have takes rank 0's part (a job of more ranks).
        borrowed = False
        if group is not None:
            blob, borrowed = _torch_agree.borrow_part(group, self._client.rank, chosen, blob)

        # 2. Compare structures on every rank before any rank loads anything, then restore.
        _torch_agree.stage(group, "match checkpoint-%d" % chosen,
                           lambda: self._check_structure(chosen, blob, tree, borrowed))
        if self._layout.has_zero():
            # What each rank of the saving job recorded of its partition (those of this group's ranks:
            # one gather, on every rank alike), then this rank's new partition.
            records = [_torch_zero.resume_part(self._layout.states, blob, borrowed)]
            if group is not None:
                records = _torch_agree.gather(group, records[0])
            _torch_agree.stage(group, "take its optimizer partition",
                               lambda: _torch_zero.take_partitions(self._layout.states, blob, records))
        _torch_agree.stage(group, "restore checkpoint-%d" % chosen,
                           lambda: self._restore_found(chosen, blob, tensors, timeout))
        return chosen

    def _read(self, group: Optional[ProcessGroup], step: Optional[int],
              timeout: float) -> Tuple[Node, Dict[str, Any], Optional[int], Any]:
        """(tree, tensors, step, blob): the current states, flattened, and what _probe finds of
        checkpoint `step`, once no save of the job is still being written."""
        _agree.settle(self._client, min(timeout, 60.0))
        tree, tensors = self._layout.flatten()
        if not tensors:
            raise ValueError("the states hold no tensors; there is nothing to resume")
        probed = self._probe(step, timeout)
        if probed[0] is not None and probed[1] is None and group is None:
            # Without a group no other rank can hand its part on (_torch_agree.borrow_part).
            raise FailedPreconditionError("FAILED_PRECONDITION", "checkpoint-%d holds no part of rank %d: it was "
                                          "saved by fewer ranks (a job of more ranks resumes it in a "
                                          "torch.distributed process group, whose ranks hand rank 0's part on) "
                                          "or not by flashckpt.torch.Checkpointer" % (probed[0], self._client.rank))
        return (tree, tensors) + probed

    def _probe(self, step: Optional[int], timeout: float) -> Tuple[Optional[int], Any]:
        """(step, blob) of checkpoint `step` (None: the newest complete one on disk), from the extra
        state this rank saved with it: the daemon's record of a memory checkpoint of that step it
        holds, else read from the files (no tensor is read, so none is read twice, and nothing is
        registered); (None, None) when there is none. The blob (a dict parsed from JSON) holds the
        saved tree; it is None when the checkpoint holds no extra state of this rank (a rank number
        the job that saved it did not have: see _torch_agree.borrow_part)."""
        held = None if step is None else self._client.memory_extra(step, timeout=min(timeout, 60.0), verify=False)
        if held is not None:  # restore() takes it from memory too
            found, extra = step, (held or None)
        else:
            found, extra = self._client.disk_extra(step, timeout=min(timeout, 60.0))
        if found is None:
            return None, None
        if extra is None:
            return found, None
        blob = read_blob(extra)
        if blob is None:
            raise StructureMismatchError("checkpoint-%d was not written by flashckpt.torch.Checkpointer (its extra "
                                         "state has no state-dict structure); restore it with flashckpt.Client" % found)
        return found, blob

    def _check_structure(self, found: int, blob: Dict[str, Any], tree: Node, borrowed: bool = False) -> None:
        """Raises StructureMismatchError naming the first key where the saved states differ from the
        current ones. A fresh optimizer (no state yet) takes the checkpoint's state. `borrowed`: the
        saved states are rank 0's (_torch_agree.borrow_part), and the message says so."""
        skip = tuple((key, "state") for key, obj in self._layout.states.items()
                     if _torch_zero.is_zero(obj) or (is_optimizer(obj) and len(obj.state) == 0))
        diff = _state.first_difference(blob["state"], tree, skip=skip)
        if diff:
            key, why = diff
            if borrowed:
                raise StructureMismatchError(
                    "checkpoint-%d was saved by fewer ranks: rank %d has no part of it and takes rank 0's, whose "
                    "state differs from this rank's (a rank must hold what rank 0 holds: data or tensor "
                    "parallelism, not another pipeline stage); first differing key '%s': %s"
                    % (found, self._client.rank, key, why), key=key)
            raise StructureMismatchError("checkpoint-%d does not match the current state; first differing key '%s': %s"
                                         % (found, key, why), key=key)

    # --- restore ---------------------------------------------------------------------------------

    def _restore_found(self, found: int, blob: Dict[str, Any], tensors: Mapping[str, Any], timeout: float) -> None:
        self._hand_over(blob, self._restore_tensors(found, blob, tensors, timeout), tensors)

    def _restore_tensors(self, found: int, blob: Dict[str, Any], tensors: Mapping[str, Any], timeout: float,
                         shares: bool = False) -> Dict[str, torch.Tensor]:
        """The tensors of checkpoint `found` (by name), restored in place where the tensor exists now.
        shares=True: only this rank's data-parallel share is restored (Shares.split), in the layout
        save() registers, which is what its memory checkpoint holds; Shares.spread fills in the rest."""
        saved = blob["state"]

        # 3. Register the checkpoint's layout and restore: in place where the tensor exists now.
        targets: Dict[str, torch.Tensor] = {}
        for leaf in _state.tensor_leaves(saved):
            name, dtype = leaf["t"], TORCH_DTYPES[leaf["dtype"]]
            whole = tuple(leaf.get("global_shape", leaf["shape"]))
            t = tensors.get(name)
            if t is None or t.dtype != dtype or self._layout.global_shape(name, t.shape) != whole:
                t = torch.empty(self._layout.local_shape(name, whole), dtype=dtype)
            targets[name] = t
        # With shares=True, or without data-parallel shares, this is the layout save() registers:
        # the daemon keeps the segment, and the memory checkpoints in it.
        wanted: Dict[str, Any] = dict(targets)
        specs: Dict[str, Dict[str, Any]] = {}
        if shares:
            wanted, specs = self._shares.split(wanted)
        self._layout.register(self._client, wanted, specs)
        got, _ = self._client.restore(wanted, step=found, timeout=timeout)
        self.tier = self._client.restored_tier
        if got != found:
            raise FailedPreconditionError("FAILED_PRECONDITION", "asked for checkpoint-%d, the daemon restored %s"
                                          % (found, got))
        return targets

    def _hand_over(self, blob: Dict[str, Any], targets: Dict[str, torch.Tensor], tensors: Mapping[str, Any]) -> None:
        """Hands each state its part of the restored `targets`, and sets the RNG state and self.extra."""
        # 4. Hand each state its part.
        self._layout.load(blob["state"], targets, tensors)
        if self._rng and "rng" in blob:
            set_rng_state(blob["rng"])
        self.extra = blob.get("user")

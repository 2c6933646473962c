"""torch.distributed.optim.ZeroRedundancyOptimizer in flashckpt.torch: saved without consolidating.

Each rank writes the state of its own partition, under the global parameter indices of ZeRO's
consolidated state_dict (state_dict), and describes the state of the other ranks' trainable
parameters as structure only (describe_partitions), so that a job of any number of ranks finds the
state of its new partition in its own part of the checkpoint. On resume, take_partitions cuts the
saved state down to the parameters the rank holds now.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Mapping, Set, Tuple

from . import _state
from ._state import Node
from ._tensors import Shape
from .errors import FailedPreconditionError


def is_zero(obj: object) -> bool:
    """torch.distributed.optim.ZeroRedundancyOptimizer: each rank holds the state of its partition."""
    # Looked up, not imported: a job that made one has imported it, and importing it costs a save.
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(obj, module.ZeroRedundancyOptimizer)


def any_zero(states: Mapping[str, Any]) -> bool:
    """Whether a ZeroRedundancyOptimizer is among `states`."""
    return any(is_zero(v) for v in states.values())


def state_dict(zero: Any) -> Dict[str, Any]:
    """What zero.state_dict() gives after consolidation, restricted to this rank's partition: the
    state of the rank's parameters under their global indices, and every parameter group (hyper-
    parameters, global indices). No collective: every rank writes only the state it holds."""
    index = zero._param_to_index
    state: Dict[int, Dict[str, Any]] = {}
    for param, fields in zero.optim.state.items():
        state[index[param]] = dict(fields)
    groups: List[Dict[str, Any]] = []
    for g in zero.param_groups:
        group = {k: v for k, v in g.items() if k != "params"}
        group["params"] = [index[p] for p in g["params"]]
        groups.append(group)
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def describe_partitions(states: Mapping[str, Any], tree: Node) -> Dict[str, Dict[str, Any]]:
    """Adds to `tree` (the flattened `states`) the state of the trainable parameters that other ranks'
    ZeroRedundancyOptimizer partitions hold, as structure only (each rank writes the tensors of
    its own partition): the fields of a parameter of the same group here that is not a scalar,
    tensors of that parameter's shape taking the other's. A rank of a later job with fewer ranks
    then finds its partition's state in its own part of the checkpoint. Returns, per optimizer,
    this rank's partition ("held") and which of its parameters have state ("stateful"), which
    save() records beside the tree: a described parameter that its owner held without state is
    not read on resume. Another rank's parameter that no gradient reached (while gradients are
    kept, i.e. not set to None before the save) is not described."""
    records: Dict[str, Dict[str, Any]] = {}
    for key, zero in states.items():
        if not is_zero(zero):
            continue
        node = _state.subtree(tree, (key, "state"))
        own = dict((i, n) for i, n in (node or {}).get("d", []))
        index = zero._param_to_index
        params = [p for g in zero.param_groups for p in g["params"]]
        group_of = {index[p]: gi for gi, g in enumerate(zero.param_groups) for p in g["params"]}
        held = sorted(index[p] for p, r in zero._param_to_rank.items() if r == zero.rank)
        records[key] = {"held": held, "stateful": sorted(own)}
        if node is None or not own:
            continue
        # group -> (its parameter's shape, its state node), a parameter of rank > 0 first
        example: Dict[int, Tuple[Shape, Node]] = {}
        for i, n in sorted(own.items(), key=lambda item: bool(params[item[0]].dim() == 0)):
            example.setdefault(group_of[i], (tuple(params[i].shape), n))
        mine = set(held)
        # Gradients are visible on every rank (DDP reduces them everywhere): while they are kept,
        # a parameter without one (unused by the forward) has no state on its owner either.
        grads_kept = any(p.grad is not None for p in params)
        # With gradients kept and an example of every group, every parameter with state is in
        # this tree: one it does not describe has none.
        records[key]["describes_all"] = grads_kept
        entries = []
        for i, p in enumerate(params):
            if i in own:
                entries.append([i, own[i]])
                continue
            if i in mine or not p.requires_grad or (grads_kept and p.grad is None):
                continue  # without state: this rank's, a frozen one, or one no gradient reached
            if group_of[i] not in example or (len(example[group_of[i]][0]) == 0 and p.dim() > 0):
                records[key]["describes_all"] = False
                continue  # no example of its group here: resume raises if it needs one
            shape, n = example[group_of[i]]
            fields = []
            for field, leaf in n["d"]:
                leaf = dict(leaf)
                if "t" in leaf:
                    leaf["t"] = "%s.state.%d.%s" % (key, i, field)
                    if len(shape) > 0 and tuple(leaf["shape"]) == shape:
                        leaf["shape"] = list(p.shape)
                    leaf.pop("global_shape", None)
                fields.append([field, leaf])
            entries.append([i, {"d": fields}])
        node["d"] = entries
    return records


def resume_part(states: Mapping[str, Any], blob: Dict[str, Any], borrowed: bool) -> Dict[str, Any]:
    """What this rank read of its saving rank's partitions, for the other ranks of the group: the
    records save() kept beside its tree (see describe_partitions) and the saved state tree of each
    ZeroRedundancyOptimizer. A rank that borrowed rank 0's part adds nothing: rank 0 sends it."""
    if borrowed:
        return {"records": None, "trees": {}}
    return {"records": blob.get("zero"),
            "trees": {k: _state.subtree(blob["state"], (k, "state")) for k, v in states.items() if is_zero(v)}}


def take_partitions(states: Mapping[str, Any], blob: Dict[str, Any], records: List[Dict[str, Any]]) -> None:
    """Cuts the saved state of each ZeroRedundancyOptimizer in `blob` down to the parameters this
    rank holds now. The job may have fewer or more ranks than the one that saved: this rank's
    saved tree (rank 0's on a rank the saving job did not have) describes the state of every
    trainable parameter it could (see describe_partitions), and `records`, the parts of the
    saving job's ranks that this group's ranks read (their descriptions, from resume_part; the
    partition each held and which of its parameters had state), fill in what this rank's tree
    does not describe and say which parameters had no state."""
    for key, zero in states.items():
        if not is_zero(zero):
            continue
        node = _state.subtree(blob["state"], (key, "state"))
        saved: Dict[int, Node] = {}
        stateless: Set[int] = set()
        known: Set[int] = set()
        described_all = False
        for part in records:  # this rank's own first
            for i, n in ((part.get("trees") or {}).get(key) or {}).get("d", []):
                saved.setdefault(i, n)
            record = (part.get("records") or {}).get(key)
            if isinstance(record, dict):
                held = set(record.get("held", ()))
                known |= held
                stateless |= held - set(record.get("stateful", ()))
                described_all = described_all or bool(record.get("describes_all"))
        for i, n in (node or {}).get("d", []):
            saved[i] = n
        # The whole state is described: this tree is a plain optimizer's, or a rank of the saving
        # job described every parameter with state.
        complete = blob.get("zero") is None or described_all
        index = zero._param_to_index
        mine = sorted((index[p], p) for p, r in zero._param_to_rank.items() if r == zero.rank)
        take = []
        for i, p in mine:
            if i in stateless or (not p.requires_grad and i not in saved):
                continue  # no state when it was saved (no gradient yet, or frozen): starts fresh, as in torch
            if i in saved:
                take.append(i)
            elif not complete:
                why = ("its state is in no part of the checkpoint this rank can read" if i not in known else
                       "its owner had state for it but this rank's part does not describe it")
                raise FailedPreconditionError(
                    "FAILED_PRECONDITION", "the optimizer '%s' of this rank holds parameter %d: %s (resume with "
                    "the world size that saved the checkpoint)" % (key, i, why))
        if node is not None:
            node["d"] = [[i, saved[i]] for i in take]

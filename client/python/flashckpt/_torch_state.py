"""What a flashckpt.torch.Checkpointer's states hold, and where each tensor sits in the job's layout.

Layout wraps the dict of states: it flattens them into named tensors plus the JSON tree of
everything else (flatten), says which tensors are model state and which training state (kind),
maps an optimizer's state to the parameter it belongs to (param_of), turns shard_specs, or a
DTensor's placements (_torch_dtensor), into the box of each tensor in its full tensor (tensor
parallelism, FSDP2: spec, global_shape, local_shape), registers
the tensors with the daemon when their layout changes (register), and hands restored tensors back
to each state (load). The RNG state and the JSON blob saved beside the tensors are here too.
"""

from __future__ import annotations

import base64
import collections.abc
import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch

from . import _state
from . import _tensors
from . import _torch_dtensor
from . import _torch_zero
from ._state import Node
from ._tensors import Shape
from .client import Client

# How tensor parallelism splits one model tensor: (dim, tp_rank, tp_degree), {"dim", "rank",
# "degree"}, or None (whole); shard_specs maps a model state-dict key to one, or is a function.
ShardSpec = Union[Sequence[int], Mapping[str, int], None]
ShardSpecs = Union[Mapping[str, ShardSpec], Callable[[str], ShardSpec]]

# The "format" and "version" of the JSON blob saved as each rank's extra state.
FORMAT = "flashckpt.torch"
VERSION = 1
TORCH_DTYPES = {k: getattr(torch, v) for k, v in _tensors.DTYPE_NAMES.items()}


def rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii")}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
    torch.set_rng_state(tensor(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])


def read_blob(extra: bytes) -> Optional[Dict[str, Any]]:
    """The JSON blob a Checkpointer saved as a rank's extra state, or None when `extra` is not one."""
    try:
        blob = json.loads(extra.decode("utf-8"))
    except ValueError:
        return None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        return None
    return blob


def is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def is_optimizer(obj: object) -> bool:
    """An optimizer-like state: its state_dict has the per-parameter `state` that is empty until its first step."""
    return isinstance(obj, torch.optim.Optimizer) or (
        is_stateful(obj) and hasattr(obj, "param_groups") and isinstance(getattr(obj, "state", None), dict))


def states_of(model: object, optimizer: Optional[object]) -> Dict[str, Any]:
    """The dict of states of Checkpointer(model, optimizer): `model` itself when it is a dict of
    states (the caller's own, which resume() refills), else {"model": model, "optimizer": optimizer}."""
    if isinstance(model, collections.abc.Mapping) and not is_stateful(model):
        if optimizer is not None:
            raise TypeError("pass the optimizer inside the dict of states (e.g. {'model': model, 'optim': "
                            "optimizer}), not as a second argument")
        if not model:
            raise ValueError("the dict of states is empty; there is nothing to checkpoint")
        for key in model:
            if not isinstance(key, str) or not key or "." in key:
                raise ValueError("the keys of the dict of states name its tensors ('<key>.<state-dict key>'): "
                                 "each must be a non-empty str without '.', got %r" % (key,))
        return cast(Dict[str, Any], model)
    states: Dict[str, Any] = {"model": model}
    if optimizer is not None:
        states["optimizer"] = optimizer
    return states


class Layout:
    """The dict of states of a Checkpointer and what it holds. `model_keys` are the keys of the
    model states (nn.Module values, and the one named "model"): their tensors are kind "model", all
    others "optimizer". With `shard_specs` (see Checkpointer), a model tensor, and the optimizer
    state of its parameter's shape, is a box in a full tensor larger than this rank's; so is a
    DTensor, by its placements."""

    def __init__(self, states: Dict[str, Any], shard_specs: Optional[ShardSpecs]) -> None:
        self.states = states
        self.model_keys = [k for k, v in states.items() if k == "model" or isinstance(v, torch.nn.Module)]
        if shard_specs is not None and not (callable(shard_specs) or isinstance(shard_specs, collections.abc.Mapping)):
            raise TypeError("shard_specs must be a mapping or a callable from a model state-dict key to "
                            "(dim, tp_rank, tp_degree), got %s" % type(shard_specs).__name__)
        self.shard_specs = shard_specs
        self._specs_checked = False
        # Per ZeroRedundancyOptimizer, what flatten() recorded of this rank's partition (_torch_zero).
        self.zero_records: Dict[str, Dict[str, Any]] = {}
        self._param_map: Optional[Dict[Tuple[str, int], Tuple[str, Shape]]] = None
        self._layout_key: Optional[Tuple[object, ...]] = None
        # The DTensors of the last flatten(), by tensor name (their local tensors are in its tensors),
        # and, in a job that has them, the order of the other tensors (see spec()).
        self.dtensors: Dict[str, _torch_dtensor.Piece] = {}
        self._others: Dict[str, int] = {}
        # This rank and the job's world size (the Checkpointer's).
        self.rank, self.world_size = 0, 1

    def has_zero(self) -> bool:
        """Whether a ZeroRedundancyOptimizer is among the states."""
        return _torch_zero.any_zero(self.states)

    def flatten(self) -> Tuple[Node, Dict[str, Any]]:
        """(tree, tensors) of every state (see flashckpt._state.flatten), each through its
        state_dict() where it has one; a tensor split by shard_specs carries its full shape, and a
        DTensor is its local tensor, with its full shape."""
        state: Dict[str, Any] = {}
        for key, obj in self.states.items():
            if _torch_zero.is_zero(obj):
                state[key] = _torch_zero.state_dict(obj)
            else:
                state[key] = obj.state_dict() if is_stateful(obj) else obj
        tree, tensors = _state.flatten(state)
        self._param_map = None
        self.dtensors = _torch_dtensor.pieces(tensors)
        self._others = {n: i for i, n in enumerate(n for n in tensors if n not in self.dtensors)} if self.dtensors else {}
        if self.dtensors and self.shard_specs is not None:
            raise ValueError("shard_specs and DTensors ('%s') do not go together: a DTensor's placements say how it "
                             "is split" % next(iter(self.dtensors)))
        self._check_shard_specs(tensors)
        self.zero_records = _torch_zero.describe_partitions(self.states, tree)
        if self.shard_specs is not None or self.dtensors:
            for leaf in _state.tensor_leaves(tree):
                piece = self.dtensors.get(leaf["t"])
                if piece is not None:
                    leaf["shape"] = list(piece.box_shape)
                box = self._box(leaf["t"], tuple(leaf["shape"]))
                if box:
                    leaf["global_shape"] = box["global_shape"]
        return tree, tensors

    @property
    def others(self) -> Dict[str, int]:
        """In a job of DTensors, the other tensors (alike on every rank) by name: their index among
        them, whose value modulo the world size is the rank that writes each. Empty without DTensors."""
        return self._others

    def kind(self, name: str) -> str:
        return "model" if name.split(".", 1)[0] in self.model_keys else "optimizer"

    # --- tensor parallelism ----------------------------------------------------------------------

    def _split(self, key: str, shape: Sequence[int]) -> Optional[Tuple[int, int, int]]:
        """(dim, rank, degree) of model state-dict key `key` (a tensor of local shape `shape`), or None."""
        specs = cast(ShardSpecs, self.shard_specs)  # set: _box() asks only then
        spec: Any = specs(key) if callable(specs) else specs.get(key)
        if spec is None:
            return None
        if isinstance(spec, collections.abc.Mapping):
            spec = (spec.get("dim"), spec.get("rank"), spec.get("degree"))
        try:
            dim, rank, degree = (int(v) for v in spec)
        except (TypeError, ValueError):
            raise ValueError("shard_specs['%s'] must be (dim, tp_rank, tp_degree) or {'dim', 'rank', 'degree'}, got %r"
                             % (key, spec)) from None
        if not (0 <= dim < len(shape)) or degree < 1 or not (0 <= rank < degree):
            raise ValueError("shard_specs['%s'] = (dim %d, tp_rank %d, tp_degree %d) does not fit a tensor of shape %s"
                             % (key, dim, rank, degree, list(shape)))
        return dim, rank, degree

    def _param_names(self) -> Dict[Tuple[str, int], Tuple[str, Shape]]:
        """{(optimizer key, parameter index): (model tensor name, local shape)}, built once per layout."""
        if self._param_map is None:
            names: Dict[int, Tuple[str, Shape]] = {}
            for key in self.model_keys:
                module = self.states[key]
                if isinstance(module, torch.nn.Module):
                    for pname, p in module.named_parameters():
                        names.setdefault(id(p), ("%s.%s" % (key, pname), tuple(p.shape)))
            self._param_map = {}
            for okey, opt in self.states.items():
                if is_optimizer(opt):
                    params = [p for g in opt.param_groups for p in g["params"]]
                    for i, p in enumerate(params):
                        if id(p) in names:
                            self._param_map[(okey, i)] = names[id(p)]
        return self._param_map

    def param_of(self, name: str) -> Optional[Tuple[str, Shape]]:
        """(model tensor name, local shape) of the parameter whose optimizer state `name` is
        ("<optimizer key>.state.<i>.<field>"), or None."""
        parts = name.split(".")
        if len(parts) < 4 or parts[1] != "state" or not parts[2].isdigit():
            return None
        return self._param_names().get((parts[0], int(parts[2])))

    def _check_shard_specs(self, tensors: Mapping[str, Any]) -> None:
        """A mapping that names no model tensor is a mistake (a DDP-wrapped model's keys start with
        "module."): raise, naming the first such key."""
        if self.shard_specs is None or callable(self.shard_specs) or self._specs_checked:
            return
        keys = {n.split(".", 1)[1] for n in tensors if "." in n and self.kind(n) == "model"}
        unknown = [k for k in self.shard_specs if k not in keys]
        if unknown:
            raise ValueError("shard_specs names '%s', which is no model state-dict key (they are like '%s')"
                             % (unknown[0], next(iter(sorted(keys)), "")))
        self._specs_checked = True

    def _box(self, name: str, shape: Sequence[int]) -> Optional[Dict[str, List[int]]]:
        """The box spec (global_shape, box_offset, box_shape) of tensor `name` of local shape `shape`
        under shard_specs or its DTensor's placements, or None for a whole tensor."""
        if name in self.dtensors:
            return _torch_dtensor.box(self.dtensors[name])
        if self.shard_specs is None:
            return None
        if self.kind(name) != "model":
            param = self.param_of(name)
            if param is None:
                return None
            if param[1] != tuple(shape):
                pkey = param[0].split(".", 1)[1]
                if len(shape) > 0 and self._split(pkey, param[1]) is not None:
                    raise ValueError("optimizer state '%s' of shape %s belongs to the split parameter '%s' of shape "
                                     "%s: only state of the parameter's shape (split alike) or scalars are supported"
                                     % (name, list(shape), param[0], list(param[1])))
                return None  # a scalar (a step count): whole
            name = param[0]
        key = name.split(".", 1)[1] if "." in name else name
        split = self._split(key, shape)
        if split is None:
            return None
        dim, rank, degree = split
        global_shape, offset = list(shape), [0] * len(shape)
        global_shape[dim] *= degree
        offset[dim] = rank * shape[dim]
        return {"global_shape": global_shape, "box_offset": offset, "box_shape": list(shape)}

    def global_shape(self, name: str, shape: Sequence[int]) -> Shape:
        box = self._box(name, tuple(shape))
        return tuple(box["global_shape"]) if box else tuple(shape)

    def local_shape(self, name: str, whole: Shape) -> Shape:
        """This rank's shape of a tensor it does not hold yet (a fresh optimizer's state) whose full
        shape is `whole`: its parameter's, when that one is split and of the same full shape."""
        if name in self.dtensors:
            return _torch_dtensor.local_shape(self.dtensors[name], whole) or whole
        if self.shard_specs is not None and self.kind(name) != "model":
            param = self.param_of(name)
            if param is not None and self.global_shape(param[0], param[1]) == whole:
                return param[1]
        return whole

    def spec(self, name: str, shape: Sequence[int]) -> Dict[str, Any]:
        spec: Dict[str, Any] = {"kind": self.kind(name)}
        piece = self.dtensors.get(name)
        if piece is not None and tuple(piece.box_shape) == tuple(shape):
            spec.update(piece.spec())
        else:
            spec.update(self._box(name, tuple(shape)) or {})
        if name in self._others and self._others[name] % self.world_size != self.rank:
            # In a job of DTensors the other tensors (step counts, buffers) are alike on every rank,
            # as the SPMD program makes them: each is written by one rank, the ranks taking turns.
            spec["replica"] = True
        return spec

    # --- the daemon's view -----------------------------------------------------------------------

    def register(self, client: Client, tensors: Mapping[str, Any],
                 specs: Optional[Mapping[str, Mapping[str, Any]]] = None) -> None:
        """Registers `tensors` (with `specs` added to their own) unless that layout is registered already."""
        key = (tuple((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()),
               tuple(sorted((n, repr(v)) for n, v in (specs or {}).items())))
        if key != self._layout_key:
            all_specs = {n: self.spec(n, t.shape) for n, t in tensors.items()}
            for n, extra in (specs or {}).items():
                all_specs[n].update(extra)
            client.register(tensors, specs=all_specs)
            self._layout_key = key

    def forget_registered(self) -> None:
        """Another layout was registered past register(): the next register() registers again."""
        self._layout_key = None

    def load(self, saved: Node, targets: Mapping[str, torch.Tensor], tensors: Mapping[str, Any]) -> None:
        """Hands each state its part of the saved tree `saved`, with its tensors from `targets` (the
        restored tensors, by name): a module whose every leaf is one of its `tensors` was restored in
        place; other modules and stateful values get load_state_dict(); a dict is refilled in place;
        any other value is replaced. A DTensor's restored local tensor goes back as that DTensor."""
        if self.dtensors:
            targets = {n: self.dtensors[n].wrap(t) if n in self.dtensors else t for n, t in targets.items()}
        state = _state.unflatten(saved, targets)
        for key, obj in self.states.items():
            if key not in state:
                continue
            if isinstance(obj, torch.nn.Module):
                subtree = cast(Node, _state.subtree(saved, (key,)))  # key is in state, so in saved
                in_place = all(leaf["t"] in tensors for leaf in _state.tensor_leaves(subtree))
                if not in_place or any("t" not in n for n in _state.leaves(subtree)):
                    obj.load_state_dict(state[key])
            elif is_stateful(obj):
                obj.load_state_dict(state[key])
            elif isinstance(obj, dict) and isinstance(state[key], dict):
                obj.clear()
                obj.update(state[key])
            else:
                self.states[key] = state[key]

"""Flattening of state dicts into named tensors plus a JSON tree of everything else.

flatten({"model": model.state_dict(), "optimizer": opt.state_dict()}) walks nested dicts, lists and
tuples. Each tensor becomes a named entry ("optimizer.state.0.exp_avg": the path joined with dots)
and a leaf {"t": name, "dtype": "F32", "shape": [...]} of the tree; every other leaf stays in the
tree with its type, so unflatten() gives back the same structure with the same Python types:

    {"d": [[key, node], ...]}     dict (keys are str or int, kept as such; order kept)
    {"l": [node, ...]}            list
    {"u": [node, ...]}            tuple
    {"t": name, "dtype", "shape", "global_shape"}
                                  a tensor split by tensor parallelism (flashckpt.torch adds the
                                  full shape, which structures are compared by)
    {"v": value}                  None, bool, int (64-bit), float (finite) or str
    {"i": "<decimal>"}            an int beyond 64 bits
    {"f": "nan" | "inf" | "-inf"} a non-finite float
    {"b": "<base64>"}             bytes

Subclasses of int and float (numpy.float64, IntEnum) come back as plain int and float; anything else
(a lambda in a scheduler state, a numpy.int64, a set, ...) is a TypeError naming its key.
The tree is plain JSON, so it travels in the checkpoint's extra.rankNNNNN.json.
"""

from __future__ import annotations

import base64
import math
import sys
from typing import Any, Collection, Dict, Iterable, Iterator, Mapping, Optional, Tuple, Union

from . import _tensors

# A node of the tree: a JSON object as the module docstring describes.
Node = Dict[str, Any]
Key = Union[str, int]
Path = Tuple[Key, ...]


def _is_tensor(x: object) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return True
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(x, np.ndarray):
            return True
        if isinstance(x, np.generic):  # a numpy scalar is a value, not a tensor to restore into
            return False
    return hasattr(x, "__dlpack__")


def _key_text(path: Iterable[object]) -> str:
    return ".".join(str(p) for p in path)


def flatten(state: object, prefix: Iterable[Key] = ()) -> Tuple[Node, Dict[str, Any]]:
    """(tree, tensors): the JSON tree of `state` and an ordered dict name -> tensor."""
    tensors: Dict[str, Any] = {}

    def walk(x: object, path: Path) -> Node:
        if _is_tensor(x):
            name = _key_text(path)
            if not name:
                raise ValueError("a tensor needs a name: flatten a dict of tensors, not a bare tensor")
            if name in tensors:
                raise ValueError("two entries of the state both flatten to the tensor name '%s'; rename one of the "
                                 "keys (names are key paths joined with '.')" % name)
            dtype, shape = _tensors.dtype_and_shape(name, x)
            tensors[name] = x
            return {"t": name, "dtype": dtype, "shape": list(shape)}
        if isinstance(x, dict):
            out = []
            for k, child in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError("'%s': key %r of type %s cannot be checkpointed; keys must be str or int"
                                    % (_key_text(path), k, type(k).__name__))
                out.append([k, walk(child, path + (k,))])
            return {"d": out}
        if isinstance(x, list):
            return {"l": [walk(c, path + (i,)) for i, c in enumerate(x)]}
        if isinstance(x, tuple):
            return {"u": [walk(c, path + (i,)) for i, c in enumerate(x)]}
        if x is None or isinstance(x, (bool, str)):
            return {"v": x}
        if isinstance(x, int):
            x = int(x)
            # JSON readers (the daemon's too) keep integers exact only within 64 bits.
            return {"v": x} if -2**63 <= x < 2**63 else {"i": str(x)}
        if isinstance(x, float):  # numpy.float64 too (a float subclass): it comes back as a float
            x = float(x)
            if math.isfinite(x):
                return {"v": x}
            return {"f": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
        if isinstance(x, bytes):
            return {"b": base64.b64encode(x).decode("ascii")}
        raise TypeError("'%s': a value of type %s cannot be checkpointed; state dicts may hold tensors, dict, list, "
                        "tuple, None, bool, int, float, str and bytes" % (_key_text(path), type(x).__name__))

    return walk(state, tuple(prefix)), tensors


def unflatten(tree: Node, tensors: Mapping[str, Any]) -> Any:
    """The state `tree` describes, with each tensor leaf taken from `tensors` (name -> tensor)."""
    if "t" in tree:
        return tensors[tree["t"]]
    if "d" in tree:
        return {k: unflatten(c, tensors) for k, c in tree["d"]}
    if "l" in tree:
        return [unflatten(c, tensors) for c in tree["l"]]
    if "u" in tree:
        return tuple(unflatten(c, tensors) for c in tree["u"])
    if "v" in tree:
        return tree["v"]
    if "f" in tree:
        return float(tree["f"])
    if "i" in tree:
        return int(tree["i"])
    if "b" in tree:
        return base64.b64decode(tree["b"])
    raise ValueError("malformed state tree node with keys %s" % sorted(tree))


def tensor_leaves(tree: Node) -> Iterator[Node]:
    """The tensor leaves of `tree`, in order."""
    if "t" in tree:
        yield tree
    elif "d" in tree:
        for _, c in tree["d"]:
            yield from tensor_leaves(c)
    elif "l" in tree or "u" in tree:
        for c in tree.get("l", tree.get("u")):
            yield from tensor_leaves(c)


def leaves(tree: Optional[Node]) -> Iterator[Node]:
    """Every leaf node of `tree` (tensor or value), in order; none of None."""
    if tree is None:
        return
    for kind in ("d", "l", "u"):
        if kind in tree:
            for c in tree[kind]:
                yield from leaves(c[1] if kind == "d" else c)
            return
    yield tree


def subtree(tree: Node, path: Iterable[Key]) -> Optional[Node]:
    """The node at `path` (a tuple of keys), or None."""
    for key in path:
        if "d" not in tree:
            return None
        for k, c in tree["d"]:
            if k == key:
                tree = c
                break
        else:
            return None
    return tree


def _what(node: Node) -> str:
    if "t" in node:
        if "global_shape" in node:
            return "a tensor %s (part of %s)" % (_tensors.describe(node["dtype"], node["shape"]),
                                                 _tensors.describe(node["dtype"], node["global_shape"]))
        return "a tensor %s" % _tensors.describe(node["dtype"], node["shape"])
    if "d" in node:
        return "a dict of %d" % len(node["d"])
    if "l" in node:
        return "a list of %d" % len(node["l"])
    if "u" in node:
        return "a tuple of %d" % len(node["u"])
    return "a value"


def first_difference(saved: Node, current: Node, skip: Collection[Path] = (),
                     path: Path = ()) -> Optional[Tuple[str, str]]:
    """(key, explanation) of the first place where the structures differ, or None.

    Structure is: dict keys (in order), list/tuple lengths, tensor vs non-tensor, tensor dtype and
    shape. Values of non-tensor leaves (lr, step counters) are not structure. Subtrees at a path in
    `skip` are not compared.
    """
    if path in skip:
        return None
    key = _key_text(path) or "(top level)"
    kinds = [next(iter(k for k in ("t", "d", "l", "u") if k in n), "leaf") for n in (saved, current)]
    if kinds[0] != kinds[1]:
        return key, "the checkpoint has %s, the current state %s" % (_what(saved), _what(current))
    kind = kinds[0]
    if kind == "t":
        # A tensor split by tensor parallelism compares by its full shape: a checkpoint restores into
        # another split of the same tensors.
        whole = [list(n.get("global_shape", n["shape"])) for n in (saved, current)]
        if saved["dtype"] != current["dtype"] or whole[0] != whole[1]:
            return key, "the checkpoint has %s, the current state %s" % (_what(saved), _what(current))
        return None
    if kind == "d":
        skeys = [k for k, _ in saved["d"]]
        ckeys = [k for k, _ in current["d"]]
        for i in range(max(len(skeys), len(ckeys))):
            sk = skeys[i] if i < len(skeys) else None
            ck = ckeys[i] if i < len(ckeys) else None
            if sk != ck:
                if sk is not None and sk not in ckeys:
                    return _key_text(path + (sk,)), "it is in the checkpoint but not in the current state"
                if ck is not None and ck not in skeys:
                    return _key_text(path + (ck,)), "it is in the current state but not in the checkpoint"
                return _key_text(path + (sk,)), "the keys are in a different order than in the checkpoint"
            d = first_difference(saved["d"][i][1], current["d"][i][1], skip, path + (sk,))
            if d:
                return d
        return None
    if kind in ("l", "u"):
        s, c = saved[kind], current[kind]
        for i in range(min(len(s), len(c))):
            d = first_difference(s[i], c[i], skip, path + (i,))
            if d:
                return d
        if len(s) != len(c):
            return _key_text(path + (min(len(s), len(c)),)), (
                "the checkpoint has %s, the current state %s" % (_what(saved), _what(current)))
        return None
    return None

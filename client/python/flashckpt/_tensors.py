"""How flashckpt sees a tensor: its address, dtype, shape, and whether its bytes are one block.

A tensor is anything with ``__dlpack__`` or the Python buffer protocol (numpy arrays, torch tensors,
array.array, ...). torch tensors are read through their own attributes (fast, and torch 1.13 does
not export bool tensors through DLPack); everything else goes through ``_flashckpt.inspect``.

A tensor is host memory or, where libflashckpt has CUDA compiled in (``_flashckpt.WITH_CUDA``), CUDA
device memory: its View says which device (``device``, -1 for host memory), and the C++ client copies
it with cudaMemcpyAsync (flashckpt/client.h). Other devices are refused.

Non-contiguous tensors are refused, never copied behind the caller's back: flashckpt copies each
tensor as one block of bytes straight into shared memory (and restores in place), so a hidden
contiguous copy would cost a second copy on every save and break in-place restore. The error says
how to fix it (``t.contiguous()``; for a parameter ``p.data = p.data.contiguous()``).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _flashckpt

# What the package accepts as "tensors": a mapping name -> tensor, or (name, tensor) pairs. A tensor
# is anything with __dlpack__ or the buffer protocol (numpy arrays, torch tensors), hence Any.
Tensors = Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]
Shape = Tuple[int, ...]

# Safetensors dtype names, as the daemon stores them, and the name users know them by.
DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
SUPPORTED = ", ".join(DTYPE_NAMES.values())

_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_HOST = 1, 2, 3
_torch_dtypes: Optional[Dict[Any, str]] = None  # torch.dtype -> safetensors name, built on first use


class View:
    """One tensor as the C++ client needs it. ``keep`` holds whatever keeps ``address`` valid;
    ``device`` is the CUDA device the memory is on, -1 for host memory."""

    __slots__ = ("name", "address", "nbytes", "dtype", "shape", "keep", "device")

    name: str
    address: int
    nbytes: int
    dtype: str
    shape: Shape
    keep: object
    device: int

    def __init__(self, name: str, address: int, nbytes: int, dtype: str, shape: Shape, keep: object,
                 device: int = -1) -> None:
        self.name = name
        self.address = address
        self.nbytes = nbytes
        self.dtype = dtype
        self.shape = shape
        self.keep = keep
        self.device = device

    def buffer(self) -> Tuple[str, int, int, bool]:
        return (self.name, self.address, self.nbytes, self.device >= 0)


def describe(dtype: str, shape: Iterable[int]) -> str:
    """'float32 (64, 32)'"""
    return "%s %s" % (DTYPE_NAMES.get(dtype, dtype), tuple(shape))


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _is_row_major(shape: Sequence[int], strides: Optional[Sequence[int]]) -> bool:
    if strides is None or _numel(shape) == 0:
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _unsupported_dtype(name: str, found: str) -> TypeError:
    return TypeError("tensor '%s' has dtype %s, which flashckpt does not store; supported dtypes: %s"
                     % (name, found, SUPPORTED))


def _not_contiguous(name: str, shape: Iterable[int], strides: Iterable[int]) -> ValueError:
    return ValueError(
        "tensor '%s' is not contiguous (shape %s, strides %s): flashckpt copies each tensor as one block "
        "of bytes and makes no hidden copies; pass t.contiguous() instead (for a parameter: "
        "p.data = p.data.contiguous())" % (name, tuple(shape), tuple(strides)))


def _not_copyable(name: str, where: str) -> ValueError:
    if where.startswith("cuda"):
        return ValueError("tensor '%s' is on %s, but libflashckpt was built without CUDA and copies host memory "
                          "only; build it with CUDA (-DFLASHCKPT_WITH_CUDA=ON) or save a CPU copy" % (name, where))
    return ValueError("tensor '%s' is on %s; flashckpt copies host memory and CUDA device memory only" % (name, where))


def _device_of(name: str, where: str, cuda_index: Optional[int]) -> int:
    """The View.device of a tensor on `where` ("cpu", "cuda:N", ...): -1 for host memory."""
    if where == "cpu":
        return -1
    if cuda_index is None or not _flashckpt.WITH_CUDA:
        raise _not_copyable(name, where)
    return cuda_index


def _torch_dtype_names(torch: ModuleType) -> Dict[Any, str]:
    global _torch_dtypes
    if _torch_dtypes is None:
        _torch_dtypes = {getattr(torch, v): k for k, v in DTYPE_NAMES.items()}
    return _torch_dtypes


def _torch_view(name: str, t: Any, torch: ModuleType) -> View:
    if t.layout != torch.strided:
        raise TypeError("tensor '%s' has layout %s; flashckpt stores dense (strided) tensors only" % (name, t.layout))
    dtype = _torch_dtype_names(torch).get(t.dtype)
    if dtype is None:
        raise _unsupported_dtype(name, str(t.dtype).replace("torch.", ""))
    device = t.device
    on = _device_of(name, str(device), None if device.type != "cuda" else (device.index or 0))
    if not t.is_contiguous():
        raise _not_contiguous(name, t.shape, t.stride())
    shape = tuple(t.shape)
    return View(name, t.data_ptr(), t.numel() * t.element_size(), dtype, shape, t, on)


def dtype_and_shape(name: str, obj: Any) -> Tuple[str, Shape]:
    """(dtype, shape) of a tensor: cheap for torch tensors, whose other checks wait for view()."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        dtype = _torch_dtype_names(torch).get(obj.dtype)
        if dtype is not None:
            return dtype, tuple(obj.shape)
    v = view(name, obj)
    return v.dtype, v.shape


def view(name: str, obj: Any, writable: bool = False) -> View:
    """The View of `obj`, or a ValueError/TypeError naming `name` and what is wrong with it."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_view(name, obj, torch)
    try:
        address, dtype, shape, strides, device_type, device_id, readonly, keep = _flashckpt.inspect(obj)
    except TypeError as e:
        raise TypeError("tensor '%s': %s" % (name, e)) from None
    if dtype.startswith("?"):
        raise _unsupported_dtype(name, dtype[1:])
    if device_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
        on = -1
    elif device_type == _DLPACK_CUDA:
        on = _device_of(name, "cuda:%d" % device_id, device_id)
    else:
        raise _not_copyable(name, "DLPack device type %d" % device_type)
    if strides is not None and not _is_row_major(shape, strides):
        raise _not_contiguous(name, shape, strides)
    if writable and readonly:
        raise ValueError("tensor '%s' is read-only; flashckpt restores into tensors in place" % name)
    return View(name, address, _numel(shape) * ITEMSIZE[dtype], dtype, tuple(shape), (obj, keep), on)


def items(tensors: Tensors) -> List[Tuple[str, Any]]:
    """(name, tensor) pairs of a mapping or an iterable of pairs, names checked to be strings."""
    pairs = list(tensors.items()) if hasattr(tensors, "items") else list(tensors)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError("tensors must be a mapping (or (name, tensor) pairs) with string names, got an "
                            "item of type %s" % type(pair).__name__)
    return pairs

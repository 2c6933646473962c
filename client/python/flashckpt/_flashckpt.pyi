# Types of the extension module _flashckpt (client/python/bindings.cc): what its PYBIND11_MODULE
# exports, with the argument names and defaults it declares. Arguments that bindings.cc converts to
# std::vector or std::tuple accept any sequence (not str or bytes) and are typed Sequence here.

from typing import Dict, List, Optional, Sequence, Tuple

# (name, address, bytes, on_device) of one tensor, as flashckpt/_tensors.py builds them.
_Buffer = Tuple[str, int, int, bool]

WITH_CUDA: bool
__version__: str

def cuda_info() -> str: ...

# -> (tensors, bytes, files, index)
def export_checkpoint(
    dir: str, out: str, weights: str, dtype: str, max_shard_size: str, strip_prefix: str, threads: int, /
) -> Tuple[int, int, List[str], bool]: ...

# -> (address, dtype, shape, strides or None, device_type, device_id, readonly, keepalive)
def inspect(
    obj: object,
) -> Tuple[int, str, Tuple[int, ...], Optional[Tuple[int, ...]], int, int, bool, object]: ...

class Spec:
    name: str
    kind: str
    dtype: str
    shape: List[int]
    global_shape: List[int]
    box_offset: List[int]
    box_shape: List[int]
    flat_range: Optional[Tuple[int, int]]
    replica: bool
    param: str
    def __init__(self) -> None: ...

# Returned by Client.snapshot; it has no constructor of its own (pybind11's default raises).
class Snapshot:
    def __init__(self, *args: object, **kwargs: object) -> None: ...
    def wait_copied(self) -> None: ...
    def wait_committed(self) -> None: ...

class Client:
    def __init__(
        self,
        socket: str,
        job: str,
        rank: int,
        rpc_timeout: float,
        connect_timeout: float,
        slot_timeout: float,
        skip_when_busy: bool,
        copy_threads: int,
        fatal_persist_errors: bool = False,
        run_id: str = "",
        overwrite: bool = False,
        memory_checkpoints: bool = False,
    ) -> None: ...
    # topology: (world_size, tp_rank, tp_degree, pp_rank, pp_degree, shard_rank, shard_degree);
    # ema: decay, interval, init_zeros, all_float_params, loss_threshold (None: no gate).
    def register(self, topology: Sequence[int], specs: Sequence[Spec], ema: Optional[Dict[str, object]]) -> None: ...
    # cuda_stream: the cudaStream_t (as an int; 0: the legacy default stream) the device tensors are
    # computed on.
    def snapshot(
        self, step: int, buffers: Sequence[_Buffer], persist: bool, loss: Optional[float], extra: bytes,
        tier: str = "disk", cuda_stream: int = 0,
    ) -> Snapshot: ...
    def wait_persisted(self, step: int, timeout: float) -> None: ...
    def wait_complete(self, step: int, timeout: float) -> None: ...
    def run_id(self) -> str: ...
    # -> (found, step, extra, bytes, tier)
    def restore(
        self,
        step: Optional[int],
        buffers: Sequence[_Buffer],
        timeout: float,
        convert_dtype: bool = False,
        kinds: Sequence[str] = [],
        source_job: str = "",
        cuda_stream: int = 0,
    ) -> Tuple[bool, int, bytes, int, str]: ...
    # -> (memory steps newest first, newest disk step or None, extra state of extra_of)
    def restorable(self, timeout: float, extra_of: Optional[int] = None,
                   verify: bool = True) -> Tuple[List[int], Optional[int], bytes]: ...
    def disk_extra(self, step: Optional[int], timeout: float) -> Tuple[Optional[int], bytes]: ...
    def ema_names(self) -> List[str]: ...
    # -> (initialized, step)
    def ema(self, buffers: Sequence[_Buffer], timeout: float) -> Tuple[bool, int]: ...
    def populate(self) -> None: ...
    def status_json(self) -> str: ...
    def close(self) -> None: ...

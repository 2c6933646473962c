"""flashckpt: asynchronous checkpoints through the node's flashckptd.

    flashckpt.Client             one rank's session: register, snapshot, wait_persisted, restore, ema
    flashckpt.torch.Checkpointer PyTorch model + optimizer: save, resume (exactly), ema_state_dict
    flashckpt.export             a checkpoint's model or EMA weights as Hugging Face safetensors (offline)
    flashckpt.dcp                torch.distributed.checkpoint's storage writer and reader (torch 2)

Tensors are copied once, straight into the daemon's shared memory; the daemon persists them as
safetensors files in the background and keeps an fp32 EMA of the weights. Tensors must be
contiguous host tensors (float64/32/16, bfloat16, int64/32/16/8, uint8, bool); a non-contiguous
tensor is refused with a ValueError that names it rather than copied behind your back.
"""

from .client import Client, Snapshot
from .offline import export
from .errors import (CancelledError, CorruptionError, DaemonUnavailableError, DeadlineExceededError,
                     FailedPreconditionError, FlashckptError, InvalidArgumentError, NotFoundError,
                     ResourceExhaustedError, StructureMismatchError)

from ._flashckpt import __version__ as __version__  # the project's one version string (common/base/version.h)

__all__ = [
    "Client", "Snapshot", "export", "FlashckptError", "InvalidArgumentError", "NotFoundError", "FailedPreconditionError",
    "ResourceExhaustedError", "DeadlineExceededError", "DaemonUnavailableError", "CorruptionError",
    "CancelledError", "StructureMismatchError",
]

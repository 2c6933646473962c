"""The exceptions flashckpt raises.

Every failure that comes from the daemon or the C++ client is a :class:`FlashckptError` carrying the
status code (``err.code``, e.g. ``"UNAVAILABLE"``) and the message. The common codes have their own
subclass, which also derives from the matching built-in exception so that generic handlers work::

    try:
        client = flashckpt.Client("/run/flashckpt/flashckptd.sock", job="llama")
    except flashckpt.DaemonUnavailableError as e:   # also a ConnectionError
        ...

Bad arguments found in Python (a non-contiguous tensor, an unsupported dtype, a tensor that is not
registered) raise the built-in ``ValueError`` / ``TypeError`` directly; a checkpoint whose structure
does not match the state being resumed raises :class:`StructureMismatchError` (a ``ValueError``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Type


class FlashckptError(RuntimeError):
    """A failed flashckpt operation. ``code`` is the status code name, ``message`` the text."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__("%s: %s" % (code, message))
        self.code = code
        self.message = message

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        # Pickled with its own arguments (the text alone would not call __init__ right): the
        # exceptions cross processes, e.g. in torch.distributed.checkpoint's gather of failures.
        return type(self), (self.code, self.message)


class InvalidArgumentError(FlashckptError, ValueError):
    """The daemon or the client refused an argument (INVALID_ARGUMENT)."""


class NotFoundError(FlashckptError, LookupError):
    """A job, checkpoint or tensor does not exist (NOT_FOUND)."""


class FailedPreconditionError(FlashckptError):
    """The call is valid but not in this state, e.g. before register() (FAILED_PRECONDITION)."""


class ResourceExhaustedError(FlashckptError):
    """Host-memory budget exceeded, or no free slot under backpressure="skip" (RESOURCE_EXHAUSTED)."""


class DeadlineExceededError(FlashckptError, TimeoutError):
    """A wait ran out of time (DEADLINE_EXCEEDED)."""


class DaemonUnavailableError(FlashckptError, ConnectionError):
    """flashckptd cannot be reached or is shutting down (UNAVAILABLE)."""


class CorruptionError(FlashckptError):
    """Bytes on disk or in memory fail validation (CORRUPTION)."""


class CancelledError(FlashckptError):
    """The client was closed or the session ended (CANCELLED)."""


class StructureMismatchError(FlashckptError, ValueError):
    """The checkpoint's state-dict structure differs from the state being resumed into."""

    def __init__(self, message: str, key: Optional[str] = None) -> None:
        super().__init__("FAILED_PRECONDITION", message)
        self.key = key

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return type(self), (self.message, self.key)


_BY_CODE: Dict[str, Type[FlashckptError]] = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "NOT_FOUND": NotFoundError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "UNAVAILABLE": DaemonUnavailableError,
    "CORRUPTION": CorruptionError,
    "CANCELLED": CancelledError,
}


def from_status(code: str, message: str) -> FlashckptError:
    """The exception for a non-ok status (used by the C++ bridge)."""
    return _BY_CODE.get(code, FlashckptError)(code, message)

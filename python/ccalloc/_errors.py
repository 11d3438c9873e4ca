"""ccalloc's exceptions: one class per C status (include/ccalloc/ccalloc.h),
each carrying the library's message. Re-exported by the package."""

from __future__ import annotations

from . import _lib


class CcallocError(RuntimeError):
    """A ccalloc call failed; ``status`` is the C status code."""

    status = _lib.ERROR_INTERNAL


class InvalidArgumentError(CcallocError, ValueError):
    """Bad argument: unknown pointer, device out of range, fraction outside [0, 1]."""

    status = _lib.ERROR_INVALID_ARGUMENT


class OutOfMemoryError(CcallocError, MemoryError):
    """The device could not provide the memory even after the cache was freed."""

    status = _lib.ERROR_OUT_OF_MEMORY


class ConfigError(CcallocError, ValueError):
    """A configuration string has a bad key or value (the message names them)."""

    status = _lib.ERROR_CONFIG


class BackendError(CcallocError):
    """The device backend failed (a CUDA error, an unsupported operation)."""

    status = _lib.ERROR_BACKEND


_ERRORS = {cls.status: cls for cls in (InvalidArgumentError, OutOfMemoryError, ConfigError, BackendError)}


def _check(status: int) -> None:
    if status != _lib.OK:
        message = _lib.lib().ccalloc_last_error().decode(errors="replace")
        raise _ERRORS.get(status, CcallocError)(message)

"""ccalloc: a stream-ordered caching allocator for CUDA device memory.

This package is Python over libccalloc.so's C API (ctypes), plus a C++
PyTorch integration built against the installed torch; see
python/README.md. Three ways to use it:

- ``ccalloc.torch.install()`` before CUDA is initialized makes ccalloc
  PyTorch's CUDA allocator; torch.cuda's memory functions then report it
  (``ccalloc.torch.memory_stats()`` and friends also on the pluggable
  fallback).
- ``ccalloc.cupy.install()`` makes ccalloc CuPy's allocator.
- ``ccalloc.Allocator`` is an allocator object of its own (for example on a
  simulated device of a chosen size); the module-level functions below act
  on the process-wide allocator, the one PyTorch and CuPy use.

Units: bytes everywhere; devices are indices; streams are ints (a
cudaStream_t's value, 0 = the legacy default stream) or objects with a
``cuda_stream`` (torch) or ``ptr`` (CuPy) attribute.

Errors: every failure raises a subclass of ``CcallocError`` carrying the
library's message (``.status`` has the C status code).

History and snapshots (SPEC F13-F16, E4) live in ``ccalloc.snapshot``.
Private pools (SPEC F20, F21, E5): ``Allocator.create_pool`` and friends,
``nccl_segment_allocator()`` for pools of NCCL memory, and
``ccalloc.torch.MemPool`` / ``use_mem_pool`` for PyTorch.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Optional

# The package is split in modules (errors, NCCL discovery, Allocator); the
# public names, and the private helpers the submodules and tests use, stay
# reachable as ccalloc.NAME.
from . import _lib
from ._allocator import (MAX_DEVICE_COUNT, Allocator, IpcHandle, _flag, _function_address, _names, _pool_id,  # noqa: F401
                         _shown, _stream, _text, receive_ipc_handle, send_ipc_handle)
from ._errors import (BackendError, CcallocError, ConfigError, InvalidArgumentError,  # noqa: F401
                      OutOfMemoryError, _check, _ERRORS)
from ._nccl import _nccl_libraries, _nccl_wheel_dirs, nccl_segment_allocator  # noqa: F401

__all__ = [
    "Allocator",
    "BackendError",
    "CcallocError",
    "ConfigError",
    "InvalidArgumentError",
    "IpcHandle",
    "MAX_DEVICE_COUNT",
    "OutOfMemoryError",
    "built_with_cuda",
    "current_tag",
    "dump_snapshot",
    "empty_cache",
    "get_config",
    "get_memory_fraction",
    "library_path",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "nccl_segment_allocator",
    "pause",
    "process_allocator",
    "receive_ipc_handle",
    "record_history",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "resume",
    "send_ipc_handle",
    "set_config",
    "set_memory_fraction",
    "stats",
    "tag",
    "tag_usage",
    "version",
]


_process: Optional[Allocator] = None
# How the module-level functions choose a device when none is given;
# ccalloc.torch.install() makes it torch.cuda.current_device.
_default_device: Callable[[], int] = lambda: process_allocator().current_device


def process_allocator() -> Allocator:
    """The process-wide allocator (what PyTorch and CuPy use once installed)."""
    global _process
    if _process is None:
        _process = Allocator.process_wide()
    return _process


def _device(device) -> int:
    if device is None:
        return _default_device()
    if isinstance(device, (str, bytes)):
        raise InvalidArgumentError(f"ccalloc: device must be an int or a torch.device, not the string {_shown(device)}")
    if hasattr(device, "index") and hasattr(device, "type"):  # torch.device
        return 0 if device.index is None else device.index
    return device  # checked (an int in range) by the Allocator method


def library_path() -> str:
    """The path of the loaded libccalloc.so."""
    return _lib.path()


def version() -> str:
    return _lib.lib().ccalloc_version().decode()


def built_with_cuda() -> bool:
    return bool(_lib.lib().ccalloc_built_with_cuda())


def memory_stats(device=None) -> "collections.OrderedDict[str, int]":
    """The process-wide allocator's statistics for ``device`` (default: the
    current device) with torch.cuda.memory_stats()'s flat keys."""
    return process_allocator().memory_stats(_device(device))


stats = memory_stats


def memory_allocated(device=None) -> int:
    """Bytes allocated now (torch.cuda.memory_allocated)."""
    return process_allocator().stat("allocated_bytes.all.current", _device(device))


def max_memory_allocated(device=None) -> int:
    return process_allocator().stat("allocated_bytes.all.peak", _device(device))


def memory_reserved(device=None) -> int:
    """Bytes in segments now (torch.cuda.memory_reserved)."""
    return process_allocator().stat("reserved_bytes.all.current", _device(device))


def max_memory_reserved(device=None) -> int:
    return process_allocator().stat("reserved_bytes.all.peak", _device(device))


def reset_peak_memory_stats(device=None) -> None:
    process_allocator().reset_peak_stats(_device(device))


def reset_accumulated_memory_stats(device=None) -> None:
    process_allocator().reset_accumulated_stats(_device(device))


def empty_cache() -> None:
    process_allocator().empty_cache()


def set_memory_fraction(fraction: float, device=None) -> None:
    process_allocator().set_memory_fraction(fraction, _device(device))


def get_memory_fraction(device=None) -> float:
    return process_allocator().get_memory_fraction(_device(device))


def set_config(text: str) -> None:
    process_allocator().set_config(text)


def record_history(enabled: bool = True, max_entries: int = 100000, **kwargs) -> None:
    """Allocator.record_history on the process-wide allocator (context=,
    when=, clear=, skip_actions= as there)."""
    process_allocator().record_history(enabled, max_entries, **kwargs)


def memory_snapshot(include_traces: bool = True) -> dict:
    """Allocator.snapshot on the process-wide allocator (the submodule
    ccalloc.snapshot converts snapshot JSON files)."""
    return process_allocator().snapshot(include_traces)


def dump_snapshot(path: str) -> None:
    """Allocator.dump_snapshot on the process-wide allocator."""
    process_allocator().dump_snapshot(path)


def get_config() -> str:
    return process_allocator().get_config()


# ---- sleep and wake (SPEC S1-S5; docs/sleep-wake.md) ----------------------------------------


class tag:
    """``with ccalloc.tag("weights"):`` the allocations this thread makes
    inside carry the tag (nests; "default" outside every scope). A tag's
    memory can then be paused and resumed as one.

    The scope is the calling thread's: leave it on the thread that entered
    it (InvalidArgumentError otherwise; the scope stays open there). Scopes
    may close out of order: a generator or coroutine that leaves its
    ``with`` while its caller is inside another scope closes its own scope,
    not the caller's (ccalloc_tag_end_named), and the thread's tag is the
    innermost one still open. One object may be entered on several threads
    at once, but once at a time per thread."""

    def __init__(self, name: str):
        if not isinstance(name, str):
            raise InvalidArgumentError(f"ccalloc.tag: the name must be a str, not {type(name).__name__}")
        self.name = name
        self._entered = threading.local()  # .open: whether this thread is inside

    def __enter__(self) -> "tag":
        if getattr(self._entered, "open", False):
            raise InvalidArgumentError(f"ccalloc.tag({self.name!r}) is already entered on this thread")
        _check(_lib.lib().ccalloc_tag_begin(_text(self.name, "tag")))
        self._entered.open = True
        return self

    def __exit__(self, *exc) -> None:
        if not getattr(self._entered, "open", False):
            raise InvalidArgumentError(
                f"ccalloc.tag({self.name!r}) is not entered on this thread: a scope is left on the thread that "
                f"entered it (a generator resumed on another thread cannot close it)")
        _check(_lib.lib().ccalloc_tag_end_named(_text(self.name, "tag")))
        self._entered.open = False


def current_tag() -> str:
    """The calling thread's tag ("default" outside every scope)."""
    return _lib.lib().ccalloc_current_tag().decode()


def pause(tags, keep_contents: bool = False, device=-1) -> dict:
    """Pauses ``tags`` on the process-wide allocator (Allocator.pause)."""
    return process_allocator().pause(tags, keep_contents, -1 if device == -1 else _device(device))


def resume(tags, device=-1) -> dict:
    """Resumes ``tags`` on the process-wide allocator (Allocator.resume)."""
    return process_allocator().resume(tags, -1 if device == -1 else _device(device))


def tag_usage(tag_name: str, device=None) -> dict:
    """What ``tag_name`` holds on ``device`` (Allocator.tag_usage)."""
    return process_allocator().tag_usage(tag_name, _device(device))

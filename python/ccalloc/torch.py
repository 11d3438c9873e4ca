"""ccalloc as PyTorch's CUDA allocator (SPEC E2).

Usage, first thing in the program, before anything touches CUDA::

    import ccalloc.torch
    ccalloc.torch.install()
    import torch
    x = torch.empty(1 << 20, device="cuda")   # served by ccalloc
    print(ccalloc.torch.memory_stats()["allocated_bytes.all.current"])

``install()`` hands libccalloc.so to ``torch.cuda.memory.CUDAPluggableAllocator``
with ccalloc's entry points and hooks, so that these PyTorch calls reach
ccalloc: allocation and free of every CUDA tensor, ``Tensor.record_stream``,
``torch.cuda.empty_cache()``, ``torch.cuda.set_per_process_memory_fraction()``,
and the base-allocation lookup used by CUDA IPC. PyTorch answers the
statistics calls (``torch.cuda.memory_stats()``, ``max_memory_reserved()``,
``reset_peak_memory_stats()``, ``get_per_process_memory_fraction()``) with an
error for every pluggable allocator; use this module's functions of the same
names instead. They act on the process-wide allocator, and ``device=None``
means ``torch.cuda.current_device()``.

An allocation that fails raises ``RuntimeError`` with ccalloc's out-of-memory
message (not ``torch.OutOfMemoryError``: PyTorch converts the C++ exception
of a pluggable allocator to a plain RuntimeError).

The allocator is chosen once per process: PyTorch refuses to swap it after
its own allocator was initialized (when CUDA was first used), so
``install()`` then raises RuntimeError saying so.
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import ccalloc as _ccalloc

from . import _lib

__all__ = [
    "empty_cache",
    "get_per_process_memory_fraction",
    "install",
    "is_installed",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
]

_installed: Optional[Any] = None  # the CUDAPluggableAllocator, kept alive


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - message only
        raise ImportError("ccalloc.torch needs PyTorch (import torch failed: %s)" % e) from e
    return torch


def is_installed() -> bool:
    """Whether install() made ccalloc PyTorch's CUDA allocator in this process."""
    return _installed is not None


def install(config: Optional[str] = None) -> None:
    """Makes ccalloc PyTorch's CUDA allocator; call it before CUDA is used.

    ``config``: an optional configuration string in PyTorch's syntax applied
    to the process-wide allocator (else ``CCALLOC_CONF`` is used).
    Calling install() again after it succeeded does nothing. Raises
    RuntimeError when torch.cuda is already initialized (PyTorch's own
    allocator is in use then and cannot be swapped), OSError when
    libccalloc.so cannot be loaded, ImportError without PyTorch, ConfigError
    for a bad ``config``.
    """
    global _installed
    if _installed is not None:
        if config is not None:
            _ccalloc.set_config(config)
        return
    torch = _torch()
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "ccalloc.torch.install() must run before CUDA is initialized in this process, but torch.cuda "
            "is already initialized, so PyTorch's own allocator is in use and cannot be replaced. Call "
            "install() first thing in the program (before creating CUDA tensors or calling torch.cuda "
            "functions that initialize CUDA).")
    path = _lib.path()
    if config is not None:
        _ccalloc.set_config(config)  # raises ConfigError before anything is swapped
    allocator = torch.cuda.memory.CUDAPluggableAllocator(path, _lib.TORCH_ALLOC, _lib.TORCH_FREE)
    native = allocator.allocator()
    for setter, function in _lib.TORCH_HOOKS.items():
        set_fn = getattr(native, setter, None)
        if set_fn is not None:  # older PyTorch lacks some setters: those calls then do nothing
            set_fn(_lib.function_address(function))
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as e:
        raise RuntimeError(
            "ccalloc.torch.install(): PyTorch refused to swap its CUDA allocator (%s). It must run "
            "before CUDA is first used in this process." % e) from e
    _installed = allocator
    _ccalloc._default_device = torch.cuda.current_device


def _device(device) -> int:
    if device is None:
        return _torch().cuda.current_device()
    return _ccalloc._device(device)


def memory_stats(device=None) -> "collections.OrderedDict[str, int]":
    """ccalloc's statistics with the keys of torch.cuda.memory_stats()."""
    return _ccalloc.process_allocator().memory_stats(_device(device))


def memory_allocated(device=None) -> int:
    return _ccalloc.memory_allocated(_device(device))


def max_memory_allocated(device=None) -> int:
    return _ccalloc.max_memory_allocated(_device(device))


def memory_reserved(device=None) -> int:
    return _ccalloc.memory_reserved(_device(device))


def max_memory_reserved(device=None) -> int:
    return _ccalloc.max_memory_reserved(_device(device))


def reset_peak_memory_stats(device=None) -> None:
    _ccalloc.reset_peak_memory_stats(_device(device))


def reset_accumulated_memory_stats(device=None) -> None:
    _ccalloc.reset_accumulated_memory_stats(_device(device))


def empty_cache() -> None:
    """The same as torch.cuda.empty_cache() once installed."""
    _ccalloc.empty_cache()


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    _ccalloc.set_memory_fraction(fraction, _device(device))


def get_per_process_memory_fraction(device=None) -> float:
    return _ccalloc.get_memory_fraction(_device(device))

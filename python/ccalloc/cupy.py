"""ccalloc as CuPy's device memory allocator (SPEC E3).

Usage::

    import cupy, ccalloc.cupy
    ccalloc.cupy.install()
    x = cupy.arange(1 << 20)               # served by ccalloc
    print(ccalloc.memory_stats(0)["allocation.all.current"])

``install()`` calls ``cupy.cuda.set_allocator`` with a function that
allocates from the process-wide allocator on CuPy's current device and
current stream and wraps the memory in ``cupy.cuda.UnownedMemory``; the
memory goes back to ccalloc (on the stream it was allocated on) when CuPy
drops its last reference. ``uninstall()`` restores the allocator CuPy had.
Install it before creating arrays: memory CuPy took from its own pool stays
there.

An allocation that fails raises ``ccalloc.OutOfMemoryError`` (a
``MemoryError``) with ccalloc's message.
"""

from __future__ import annotations

from typing import Any, Optional

import ccalloc as _ccalloc

__all__ = ["install", "is_installed", "malloc", "uninstall"]

_previous: Any = None
_installed = False


def _cupy():
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - message only
        raise ImportError("ccalloc.cupy needs CuPy (import cupy failed: %s)" % e) from e
    return cupy


class _Owner:
    """Frees one ccalloc allocation when CuPy drops the memory that refers to it."""

    __slots__ = ("ptr", "allocator")

    def __init__(self, ptr: int, allocator: "_ccalloc.Allocator"):
        self.ptr = ptr
        self.allocator = allocator

    def __del__(self):
        if self.ptr:
            try:
                self.allocator.free(self.ptr)
            except Exception as e:  # a free has no caller to raise to
                import sys

                print("ccalloc.cupy: %s" % e, file=sys.stderr)
            self.ptr = 0


def malloc(size: int):
    """The function install() gives to cupy.cuda.set_allocator: ``size``
    bytes on CuPy's current device and stream, as a cupy.cuda.MemoryPointer."""
    cupy = _cupy()
    device = cupy.cuda.runtime.getDevice()
    stream = cupy.cuda.get_current_stream().ptr
    allocator = _ccalloc.process_allocator()
    ptr = allocator.malloc(size, device, stream)
    memory = cupy.cuda.UnownedMemory(ptr, size, _Owner(ptr, allocator), device)
    return cupy.cuda.MemoryPointer(memory, 0)


def is_installed() -> bool:
    return _installed


def install() -> None:
    """Makes ccalloc CuPy's allocator (again: no-op)."""
    global _previous, _installed
    if _installed:
        return
    cupy = _cupy()
    get_allocator = getattr(cupy.cuda, "get_allocator", None)
    _previous = get_allocator() if get_allocator is not None else None
    cupy.cuda.set_allocator(malloc)
    _installed = True


def uninstall() -> None:
    """Gives CuPy back the allocator it had before install() (its default
    memory pool when that is unknown). Arrays made meanwhile still free
    through ccalloc."""
    global _previous, _installed
    if not _installed:
        return
    cupy = _cupy()
    previous: Optional[Any] = _previous
    if previous is None:
        previous = cupy.get_default_memory_pool().malloc
    cupy.cuda.set_allocator(previous)
    _previous = None
    _installed = False

"""ccalloc as PyTorch's CUDA allocator (SPEC E2).

Usage, first thing in the program, before anything touches CUDA::

    import ccalloc.torch
    ccalloc.torch.install()
    import torch
    x = torch.empty(1 << 20, device="cuda")   # served by ccalloc
    print(ccalloc.torch.memory_stats()["allocated_bytes.all.current"])

``install()`` makes ccalloc PyTorch's allocator through the C++ integration
(``ccalloc/csrc/torch_allocator.cpp``: PyTorch's ``CUDAAllocator``
interface over ccalloc's C API, built at ``pip install`` or on first use),
so unchanged PyTorch code works: ``torch.cuda.memory_stats()`` and friends,
``torch.cuda.OutOfMemoryError``, CUDA graphs and graph trees,
``torch.cuda.MemPool``, memory history and snapshots. Where it cannot be
built it falls back, with a warning, to ``torch.cuda.memory.CUDAPluggableAllocator``
with ccalloc's entry points and hooks (allocation, free,
``Tensor.record_stream``, ``empty_cache``, ``set_per_process_memory_fraction``,
the base-allocation lookup); PyTorch's statistics calls then fail, and this
module's functions of the same names (which act on the process-wide
allocator; ``device=None`` means ``torch.cuda.current_device()``) work on
either route. python/README.md has the details and the differences.

The allocator is chosen once per process: PyTorch refuses to swap it after
its own allocator was initialized (when CUDA was first used), so
``install()`` then raises RuntimeError saying so.

Private pools (SPEC F20, E5) on either route, mirroring ``torch.cuda.MemPool``
and ``torch.cuda.use_mem_pool``::

    pool = ccalloc.torch.MemPool(segment_allocator=ccalloc.nccl_segment_allocator())
    with ccalloc.torch.use_mem_pool(pool):
        buf = torch.empty(1 << 24, device="cuda")   # a segment from ncclMemAlloc
    dist.all_reduce(buf)
"""

from __future__ import annotations

import collections
import contextlib
import os
import warnings
from typing import Any, Iterator, Optional

import ccalloc as _ccalloc

from . import _lib

__all__ = [
    "MemPool",
    "empty_cache",
    "get_per_process_memory_fraction",
    "install",
    "integration",
    "is_installed",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "pause",
    "region",
    "reset_accumulated_memory_stats",
    "resume",
    "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
    "use_mem_pool",
]

_installed: Optional[Any] = None  # the native module or the CUDAPluggableAllocator, kept alive
_integration: Optional[str] = None


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - message only
        raise ImportError("ccalloc.torch needs PyTorch (import torch failed: %s)" % e) from e
    return torch


def is_installed() -> bool:
    """Whether install() made ccalloc PyTorch's CUDA allocator in this process."""
    return _installed is not None


def integration() -> Optional[str]:
    """How ccalloc is PyTorch's allocator in this process: ``"native"`` (the
    C++ integration: every torch.cuda memory function works),
    ``"pluggable"`` (PyTorch's CUDAPluggableAllocator: allocation, free and
    a few hooks only), or None before install()."""
    return _integration


def _apply_pytorch_conf() -> None:
    """PYTORCH_CUDA_ALLOC_CONF applies to ccalloc when CCALLOC_CONF is not
    set: ccalloc reads PyTorch's syntax and keys (docs/config.md); a key or
    value it rejects raises ConfigError naming it and this variable."""
    if os.environ.get("CCALLOC_CONF") is not None:
        return
    text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if not text:
        return
    try:
        _ccalloc.set_config(text)
    except _ccalloc.ConfigError as e:
        raise _ccalloc.ConfigError(
            f"ccalloc.torch.install(): PYTORCH_CUDA_ALLOC_CONF={text!r} (used because CCALLOC_CONF is not set) "
            f"is not accepted: {e}. Set CCALLOC_CONF to the settings ccalloc should use (\"\" for its "
            f"defaults).") from None


def _snapshot(arg=None) -> dict:
    """torch._C._cuda_memorySnapshot over ccalloc: arg None (everything),
    or (first, second, include_traces) with pool id (0, 0) for every pool."""
    include_traces, pool = True, (0, 0)
    if arg is not None:
        pool, include_traces = (int(arg[0]), int(arg[1])), _ccalloc._flag(arg[2], "include_traces") if len(arg) > 2 else True
    out = _ccalloc.process_allocator().snapshot(include_traces=include_traces)
    if pool != (0, 0):
        out["segments"] = [s for s in out["segments"] if tuple(s.get("segment_pool_id", (0, 0))) == pool]
    return out


def install(config: Optional[str] = None, integration: Optional[str] = None) -> str:
    """Makes ccalloc PyTorch's CUDA allocator; call it before CUDA is used.
    Returns how (see ``integration()``).

    ``config``: an optional configuration string in PyTorch's syntax applied
    to the process-wide allocator; else ``CCALLOC_CONF`` is used, else
    ``PYTORCH_CUDA_ALLOC_CONF`` (ccalloc reads PyTorch's keys).
    ``integration``: ``"native"``, ``"pluggable"`` or ``"auto"`` (default:
    ``$CCALLOC_TORCH_INTEGRATION``, else ``"auto"``): auto uses the C++
    integration (built at ``pip install``, else built now into
    ``~/.cache/ccalloc``) and, when it cannot be built or loaded, falls back
    to the pluggable route with a warning naming what is missing.

    Calling install() again after it succeeded does nothing (a ``config`` is
    still applied). Raises RuntimeError when torch.cuda is already
    initialized (PyTorch's own allocator is in use then and cannot be
    swapped), or when ``"native"`` was asked for and is not available;
    OSError when libccalloc.so cannot be loaded; ImportError without
    PyTorch; ConfigError for a bad ``config`` or PYTORCH_CUDA_ALLOC_CONF.
    """
    global _installed, _integration
    if _installed is not None:
        if config is not None:
            _ccalloc.set_config(config)
        return _integration
    mode = integration or os.environ.get("CCALLOC_TORCH_INTEGRATION") or "auto"
    if mode not in ("auto", "native", "pluggable"):
        raise ValueError(f"ccalloc.torch.install(): integration must be auto, native or pluggable, got {mode!r}")
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
    else:
        _apply_pytorch_conf()
    if mode != "pluggable":
        try:
            from . import _build
            native = _build.load(torch)
        except Exception as e:  # no compiler, unknown torch, a failed build: say so, then fall back
            if mode == "native":
                raise RuntimeError(f"ccalloc.torch.install(integration='native'): {e}") from e
            warnings.warn(f"ccalloc.torch.install(): the C++ integration is not available ({e}); using PyTorch's "
                          "CUDAPluggableAllocator instead, so torch.cuda.memory_stats(), memory history, "
                          "torch.cuda.MemPool, CUDA graph trees and torch.cuda.OutOfMemoryError do not work "
                          "(ccalloc.torch.memory_stats() does)", RuntimeWarning, stacklevel=2)
        else:
            try:
                native.install(path)
            except RuntimeError as e:
                raise RuntimeError(
                    "ccalloc.torch.install(): PyTorch refused to swap its CUDA allocator (%s). It must run "
                    "before CUDA is first used in this process." % e) from e
            torch._C._cuda_memorySnapshot = _snapshot
            _installed, _integration = native, "native"
            _ccalloc._default_device = torch.cuda.current_device
            return _integration
    allocator = torch.cuda.memory.CUDAPluggableAllocator(path, _lib.TORCH_ALLOC, _lib.TORCH_FREE)
    hooks = allocator.allocator()
    for setter, function in _lib.TORCH_HOOKS.items():
        set_fn = getattr(hooks, setter, None)
        if set_fn is not None:  # older PyTorch lacks some setters: those calls then do nothing
            set_fn(_lib.function_address(function))
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as e:
        raise RuntimeError(
            "ccalloc.torch.install(): PyTorch refused to swap its CUDA allocator (%s). It must run "
            "before CUDA is first used in this process." % e) from e
    _installed, _integration = allocator, "pluggable"
    _ccalloc._default_device = torch.cuda.current_device
    return _integration


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


# ---- sleep and wake (SPEC S5): torch_memory_saver's and vLLM's shapes --------------------------
#
# torch_memory_saver                         ccalloc.torch
#   with saver.region(tag="kv",                with region(tag="kv", keep_contents=False):
#                     enable_cpu_backup=False):
#   saver.pause(tag=None)                      pause(tag=None)
#   saver.resume(tag=None)                     resume(tag=None)
# vLLM: llm.sleep(level=1) keeps the weights and drops the KV cache: region(tag="weights",
# keep_contents=True) and region(tag="kv_cache") around their creation, then pause(); level 2
# is pause(keep_contents=False) for both.

# The tags entered with region(), each with the keep_contents it was given
# (the last one wins): pause(tag=None) pauses them all, each as it asked.
_regions: "collections.OrderedDict[str, bool]" = collections.OrderedDict()


@contextlib.contextmanager
def region(tag: str = "default_region", keep_contents: bool = False) -> Iterator[str]:
    """Tensors created inside carry ``tag`` (this thread only); pause() then
    releases their device memory and resume() gives it back at the same
    addresses, with their contents when ``keep_contents`` (copied to pinned
    host memory in between; otherwise the bytes after resume are undefined).
    CUDA graphs captured over them replay after resume."""
    keep_contents = _ccalloc._flag(keep_contents, "keep_contents")
    with _ccalloc.tag(tag):
        _regions[tag] = keep_contents
        yield tag


def _tags_of(tag: Optional[str]) -> list:
    if tag is None:
        return list(_regions)
    if not isinstance(tag, str):
        raise _ccalloc.InvalidArgumentError(f"tag must be a str or None, not {_ccalloc._shown(tag)}")
    return [tag]


def pause(tag: Optional[str] = None, keep_contents: Optional[bool] = None) -> dict:
    """Pauses ``tag`` (None: every tag a region() used), on every device;
    ``keep_contents`` None: what region() was given for each tag. Returns
    the summed figures (bytes, host_time_us)."""
    total: dict = {}
    for t in _tags_of(tag):
        keep = _regions.get(t, False) if keep_contents is None else _ccalloc._flag(keep_contents, "keep_contents")
        for k, v in _ccalloc.pause(t, keep).items():
            total[k] = total.get(k, 0) + v
    return total


def resume(tag: Optional[str] = None) -> dict:
    """Resumes ``tag`` (None: every tag a region() used), on every device."""
    tags = _tags_of(tag)
    return _ccalloc.resume(tags) if tags else {}


# ---- private pools (SPEC F20, F21, E5) -----------------------------------------------------------

class MemPool:
    """A private pool of ccalloc's process-wide allocator, for PyTorch
    tensors (mirrors ``torch.cuda.MemPool``; SPEC F20, E5).

    ``MemPool(segment_allocator=None, device=None)`` creates the pool on
    ``device`` (default: torch's current device) with a fresh id ``(n, 0)``
    and use count 1. ``segment_allocator``: None (ccalloc's own segments) or
    ``(malloc_address, free_address)`` of C functions shaped as cudaMalloc /
    cudaFree, e.g. ``ccalloc.nccl_segment_allocator()`` (ncclMemAlloc /
    ncclMemFree); see ``ccalloc.Allocator.create_pool``.

    Tensors allocated inside ``use_mem_pool(pool)`` take their memory from
    the pool's segments and return it there when freed. ``close()`` (also at
    garbage collection) releases the pool: its cached segments go back at
    the next ``empty_cache()`` (PyTorch's MemPool empties them at once), once
    no tensor of the pool is alive. Thread safety: as the allocator's; do not
    close a pool while another thread allocates into it.
    """

    def __init__(self, segment_allocator=None, device=None):
        self._allocator = _ccalloc.process_allocator()
        self._device = _device(device)
        self._id = self._allocator.new_pool_id()
        self._open = False
        self._allocator.create_pool(self._id, self._device, segment_allocator)
        self._open = True

    @property
    def id(self) -> tuple:
        """The pool id, ``(n, 0)`` (PyTorch: MemPool.id)."""
        return self._id

    @property
    def device(self) -> int:
        """The device the pool's segments are on."""
        return self._device

    def use_count(self) -> int:
        """The pool's use count: 1 while open, 0 after close() (PyTorch: MemPool.use_count)."""
        return self._allocator.pool_use_count(self._id, self._device)

    def usage(self) -> dict:
        """Bytes and blocks the pool holds now (``segment_count``,
        ``reserved_bytes``, ``allocated_bytes``, ``active_bytes``,
        ``allocation_count``, ``use_count``); see
        ccalloc.Allocator.pool_usage. InvalidArgumentError once the pool is
        closed and holds no segment (it is gone then)."""
        return self._allocator.pool_usage(self._id, self._device)

    def snapshot(self) -> list:
        """The pool's segments in the layout of ``torch.cuda.memory_snapshot()``
        (``address``, ``total_size``, ``allocated_size``, ``blocks``, ...;
        PyTorch: MemPool.snapshot). Walks every segment of the process."""
        return [s for s in _ccalloc.process_allocator().snapshot(include_traces=False)["segments"]
                if s["device"] == self._device and tuple(s["segment_pool_id"]) == self._id]

    def close(self) -> None:
        """Releases the pool (use count 1 -> 0); again: no-op."""
        if self._open:
            self._open = False
            self._allocator.release_pool(self._id, self._device)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass

    def __repr__(self) -> str:
        state = "open" if self._open else "closed"
        return f"ccalloc.torch.MemPool(id={self._id}, device={self._device}, {state})"


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device=None) -> Iterator[MemPool]:
    """Inside the ``with`` block, CUDA tensors allocated on the current
    stream of ``device`` (as it is at entry) come from ``pool`` (mirrors
    ``torch.cuda.use_mem_pool``). ``device``: default the pool's device,
    which it must equal. Unlike PyTorch's, which routes the calling
    thread's allocations on any stream, ccalloc routes by stream: tensors
    made on other streams, including a ``torch.cuda.stream(...)`` entered
    inside the block, use the default pool, and so do those of other
    threads on other streams (other threads on the same stream use the pool).

    While the block runs, the device follows CUDA graph capture rules, as
    with PyTorch's: no event is waited for and no cached memory is returned,
    even on out of memory. Nests with itself. Raises RuntimeError when
    ccalloc is not PyTorch's allocator (install() first), ValueError for
    another device than the pool's, and what begin_allocate_to_pool raises
    (a closed pool)."""
    torch = _torch()
    if not is_installed():
        raise RuntimeError("ccalloc.torch.use_mem_pool: ccalloc is not PyTorch's allocator in this process, so "
                           "tensors would not come from the pool; call ccalloc.torch.install() first")
    dev = pool.device if device is None else _device(device)
    if dev != pool.device:
        raise ValueError(f"ccalloc.torch.use_mem_pool: {pool!r} is on device {pool.device}, not device {dev}")
    stream = torch.cuda.current_stream(dev).cuda_stream
    allocator = _ccalloc.process_allocator()
    allocator.begin_allocate_to_pool(pool.id, dev, stream=stream)
    try:
        yield pool
    finally:
        allocator.end_allocate_to_pool(pool.id, dev)

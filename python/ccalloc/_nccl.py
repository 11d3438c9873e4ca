"""Finding NCCL's ncclMemAlloc / ncclMemFree for pools of NCCL memory
(SPEC E5). Re-exported by the package as ccalloc.nccl_segment_allocator."""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

from . import _lib


def nccl_segment_allocator(library: str = "libnccl.so.2") -> tuple:
    """``(address of ncclMemAlloc, address of ncclMemFree)`` for
    ``create_pool(..., segment_allocator=...)`` and
    ``ccalloc.torch.MemPool(segment_allocator=...)`` (SPEC E5): a pool whose
    segments NCCL can use for zero-copy / NVLS collectives (NCCL >= 2.19).

    ``library`` is a file name or path. After ``import torch`` the name
    finds the NCCL that PyTorch loaded (one copy in the process); otherwise
    the copy of the ``nvidia-nccl`` wheel next to the torch package
    (``site-packages/nvidia/nccl/lib``) is tried first, then the dynamic
    linker's search path. The library stays loaded. Raises OSError naming
    every place tried when none has the two functions."""
    candidates = []
    if os.sep in library:
        candidates.append(library)
    else:
        if "torch" in sys.modules:
            candidates.append(library)  # the soname of the copy torch loaded
        candidates.extend(str(d / library) for d in _nccl_wheel_dirs())
        candidates.append(library)
    def has_mem_alloc(nccl) -> Optional[str]:
        ok = hasattr(nccl, "ncclMemAlloc") and hasattr(nccl, "ncclMemFree")
        return None if ok else "no ncclMemAlloc/ncclMemFree (NCCL older than 2.19)"

    nccl, _, tried = _lib.load_first(candidates, has_mem_alloc)
    if nccl is not None:
        _nccl_libraries.append(nccl)
        return (ctypes.cast(nccl.ncclMemAlloc, ctypes.c_void_p).value,
                ctypes.cast(nccl.ncclMemFree, ctypes.c_void_p).value)
    raise OSError("ccalloc: nccl_segment_allocator: cannot find ncclMemAlloc and ncclMemFree; pass the path of "
                  "libnccl.so.2 (NCCL >= 2.19), or import torch first. Tried: " + "; ".join(tried))


_nccl_libraries: list = []  # kept loaded: pools hold their function addresses


def _nccl_wheel_dirs() -> list:
    """Where pip's nvidia-nccl wheel puts libnccl: site-packages/nvidia/nccl/lib
    next to the torch package, and in each path of the ``nvidia`` namespace."""
    import importlib.util
    from pathlib import Path

    dirs = []
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        dirs.append(Path(spec.origin).resolve().parent.parent / "nvidia" / "nccl" / "lib")
    try:
        nvidia = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        nvidia = None
    if nvidia is not None:
        dirs.extend(Path(base) / "nccl" / "lib" for base in nvidia.submodule_search_locations or [])
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]

"""Building and loading ccalloc's PyTorch integration (csrc/torch_allocator.cpp).

The integration implements PyTorch's C++ allocator interface
(c10::cuda::CUDACachingAllocator::CUDAAllocator), so it is compiled against
the PyTorch it runs with, by torch.utils.cpp_extension (a C++17 compiler,
ninja, CUDA's headers). It is looked for, in order:

1. ``ccalloc/_torch/<key>/`` inside the package: built by ``pip install``
   when torch was importable then (setup.py calls ``build()``);
2. ``$CCALLOC_CACHE_DIR`` (default ``$XDG_CACHE_HOME/ccalloc``, else
   ``~/.cache/ccalloc``) ``/torch/<key>/``: built there on first use. A
   build that fails leaves ``FAILED`` there with the reason, so later
   processes fall back at once instead of compiling again.

``<key>`` names the torch version, its CUDA version, the C++ ABI, the Python
version and a hash of the source and header, so a new PyTorch (or ccalloc)
gets a new build and never loads a stale one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

MODULE = "ccalloc_torch_allocator"
PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE = PACKAGE_DIR / "csrc" / "torch_allocator.cpp"
HEADERS = (PACKAGE_DIR / "csrc" / "torch_history.hpp",)  # included by SOURCE


def include_dir() -> Path:
    """Where ccalloc/ccalloc.h is: the package's copy (installed), else the
    checkout's include/ (python/ used in place)."""
    packaged = PACKAGE_DIR / "include"
    if (packaged / "ccalloc" / "ccalloc.h").is_file():
        return packaged
    return PACKAGE_DIR.parent.parent / "include"


def key(torch) -> str:
    """The build's identity for this torch and this source (see the module doc)."""
    digest = hashlib.sha256()
    for path in (SOURCE, *HEADERS, include_dir() / "ccalloc" / "ccalloc.h"):
        digest.update(path.read_bytes())
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    parts = [f"torch{torch.__version__}", f"cuda{torch.version.cuda}", f"abi{abi}",
             f"py{sys.version_info[0]}{sys.version_info[1]}", digest.hexdigest()[:12]]
    return "-".join(p.replace("+", "_").replace("/", "_") for p in parts)


def packaged_dir(torch) -> Path:
    return PACKAGE_DIR / "_torch" / key(torch)


def cache_dir(torch) -> Path:
    base = os.environ.get("CCALLOC_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = str(Path(xdg) / "ccalloc")
    return Path(base) / "torch" / key(torch)


def _built(directory: Path) -> Optional[Path]:
    for path in sorted(directory.glob(MODULE + "*.so")):
        return path
    return None


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(MODULE, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def missing_tools() -> list:
    """What a build needs and this machine lacks (empty: it can try)."""
    import shutil

    missing = []
    if not SOURCE.is_file():
        missing.append(f"the source {SOURCE}")
    if not (include_dir() / "ccalloc" / "ccalloc.h").is_file():
        missing.append(f"the header ccalloc/ccalloc.h (looked in {include_dir()})")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler.split()[0]) is None:
        missing.append(f"a C++ compiler ({compiler})")
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the pip package puts the binary on PATH only via its module)
        except ImportError:
            missing.append("ninja")
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError as e:
        missing.append(f"torch.utils.cpp_extension ({e})")
    else:
        if not CUDA_HOME or not (Path(CUDA_HOME) / "include" / "cuda_runtime_api.h").is_file():
            missing.append("CUDA's headers (set CUDA_HOME to the toolkit)")
    return missing


def build(torch, directory: Path, verbose: bool = False) -> Path:
    """Compiles the integration into ``directory`` and returns the module's
    path. Raises RuntimeError naming what is missing or what failed."""
    missing = missing_tools()
    if missing:
        raise RuntimeError("cannot build ccalloc's PyTorch integration: missing " + ", ".join(missing))
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    try:
        _compile(cpp_extension, directory, verbose)
    except Exception as e:  # ninja's whole log is in the message: keep the errors
        text = str(e)
        errors = [line.strip() for line in text.splitlines() if "error" in line.lower()][:4]
        raise RuntimeError(f"compiling {SOURCE.name} against torch {torch.__version__} failed in {directory}: " +
                           (" | ".join(errors) if errors else text[-600:])) from None
    path = _built(directory)
    if path is None:
        raise RuntimeError(f"building ccalloc's PyTorch integration left no {MODULE}*.so in {directory}")
    return path


def _compile(cpp_extension, directory: Path, verbose: bool) -> None:
    cpp_extension.load(
        name=MODULE,
        sources=[str(SOURCE)],
        extra_include_paths=[str(include_dir())],
        extra_cflags=["-O2"],  # no -D with quotes: ninja's command line drops them
        extra_ldflags=["-ldl"],
        build_directory=str(directory),
        with_cuda=True,
        verbose=verbose,
    )


def load(torch, allow_build: bool = True):
    """The integration's module for this torch: the packaged build, else the
    cached one, else (``allow_build``) a new build in the cache directory.
    Raises RuntimeError saying why none is available."""
    try:
        from torch.utils import cpp_extension  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"missing torch.utils.cpp_extension ({e})") from None
    for directory in (packaged_dir(torch), cache_dir(torch)):
        path = _built(directory)
        if path is not None:
            return _import(path)
    if not allow_build:
        raise RuntimeError("ccalloc's PyTorch integration is not built for torch " + torch.__version__)
    failed = cache_dir(torch) / "FAILED"
    if failed.is_file():  # a build of this very source for this torch failed before: say why, at once
        raise RuntimeError(failed.read_text().strip() + f" (earlier build; delete {failed} to try again)")
    try:
        return _import(build(torch, cache_dir(torch)))
    except RuntimeError as e:
        try:
            failed.parent.mkdir(parents=True, exist_ok=True)
            failed.write_text(str(e) + "\n")
        except OSError:
            pass
        raise

"""ccalloc for Python in one command, from a clone, offline:

    python3 -m pip install --no-build-isolation .

builds libccalloc.so with CMake (the libraries only: C++ standard library and,
when a CUDA toolkit is found, CUDA's runtime; CCALLOC_MINIMAL=ON) and puts it
inside the package, with the C header. When torch is importable, it also
compiles ccalloc's PyTorch integration (python/ccalloc/csrc) against it; if
that fails (no compiler, an unknown PyTorch), the install goes on and
ccalloc.torch.install() builds it on first use or falls back to PyTorch's
CUDAPluggableAllocator with a warning.

Environment: CCALLOC_CMAKE_ARGS (extra CMake arguments, split on spaces),
CCALLOC_BUILD_TORCH=0 (skip the PyTorch integration), CMAKE (the cmake
program). Needs cmake >= 3.22 and a C++20 compiler (ninja if present).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


class BinaryDistribution(Distribution):
    """The wheel holds a shared library: platform-specific."""

    def has_ext_modules(self):
        return True


class build_with_library(build_py):
    def run(self):
        super().run()
        package = Path(self.build_lib) / "ccalloc"
        self._build_library(package)
        header = package / "include" / "ccalloc"
        header.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "include" / "ccalloc" / "ccalloc.h", header / "ccalloc.h")
        if os.environ.get("CCALLOC_BUILD_TORCH", "1") != "0":
            self._build_torch(package)

    def _build_library(self, package: Path) -> None:
        build = Path(self.get_finalized_command("build").build_temp) / "ccalloc-cmake"
        if not build.is_absolute():
            build = ROOT / build
        cmake = os.environ.get("CMAKE", "cmake")
        args = [cmake, "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DCCALLOC_MINIMAL=ON",
                "-DCCALLOC_BUILD_GPU_TESTS=OFF", "-DCCALLOC_BUILD_BENCH=OFF", "-DCCALLOC_INSTALL=OFF"]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        args += os.environ.get("CCALLOC_CMAKE_ARGS", "").split()
        print("ccalloc: " + " ".join(args), flush=True)
        subprocess.run(args, check=True)
        subprocess.run([cmake, "--build", str(build), "--target", "ccalloc_shared", "-j",
                        str(max(1, os.cpu_count() or 1))], check=True)
        built = (build / "libccalloc.so").resolve()
        package.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, package / "libccalloc.so")

    def _build_torch(self, package: Path) -> None:
        try:
            import torch
        except ImportError:
            print("ccalloc: torch is not importable: the PyTorch integration is not built now "
                  "(ccalloc.torch.install() builds it on first use)", flush=True)
            return
        sys.path.insert(0, str(package.parent))  # the ccalloc being built, not another one
        try:
            from ccalloc import _build
            directory = package / "_torch" / _build.key(torch)
            path = _build.build(torch, directory, verbose=True)
            for leftover in directory.iterdir():  # ninja's files and objects: only the module ships
                if leftover != path:
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            print(f"ccalloc: built the PyTorch integration for torch {torch.__version__}: {path}", flush=True)
        except Exception as e:  # the install goes on: install() builds on first use or falls back
            print(f"ccalloc: WARNING: could not build the PyTorch integration for torch {torch.__version__}: {e}",
                  flush=True)
        finally:
            sys.path.pop(0)
            for name in [n for n in sys.modules if n == "ccalloc" or n.startswith("ccalloc.")]:
                del sys.modules[name]


setup(
    distclass=BinaryDistribution,
    cmdclass={"build_py": build_with_library},
    # build-pip/, not build/ (the usual CMake build directory of a checkout)
    options={"build": {"build_base": "build-pip"}, "bdist_wheel": {"bdist_dir": "build-pip/bdist"}},
)

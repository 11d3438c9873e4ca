#!/usr/bin/env bash
# The README's Python install, as a new user runs it: a fresh
# virtual environment over the system's packages, then
#   python3 -m pip install --no-build-isolation .
# at the top of a copy of the checkout (offline: setuptools, wheel and pip
# from Debian, scripts/deps.sh). Checks that libccalloc.so and the C header
# are inside the installed package, that a small allocation works through it
# from another directory (no CCALLOC_LIBRARY, no PYTHONPATH), and, where torch
# is not importable (CI), that the PyTorch integration's build was skipped
# with a message saying so. Exit 77 (skip) without venv or setuptools.
#   python_install_test.sh SOURCE_DIR WORK_DIR [PYTHON]
set -euo pipefail
SRC=$1
WORK=$2
PY=${3:-python3}
"$PY" -c 'import venv, setuptools, wheel' 2>/dev/null || { echo "skip: $PY lacks venv/setuptools/wheel (scripts/deps.sh)"; exit 77; }
rm -rf "$WORK"
mkdir -p "$WORK/src"
# A copy without build trees: what a fresh clone holds.
# (Exit status 1, "file changed as we read it", is no failure: tests that run
# beside this one may touch files of the tree meanwhile; it failed in 1 s so.)
{ tar -C "$SRC" --exclude='./build*' --exclude='./.git' --exclude='./out' --exclude='./.torch' --exclude='__pycache__' \
    --exclude='.pytest_cache' --warning=no-file-changed -cf - . || [ $? -eq 1 ]; } |
  tar -C "$WORK/src" -xf -
"$PY" -m venv --system-site-packages "$WORK/venv"
VPY=$WORK/venv/bin/python3
(cd "$WORK/src" && env -u CCALLOC_LIBRARY -u PYTHONPATH "$VPY" -m pip install -v --no-index --no-build-isolation . ) \
  >"$WORK/install.log" 2>&1 || { tail -n 40 "$WORK/install.log"; echo "FAIL: pip install"; exit 1; }
cd "$WORK"
env -u CCALLOC_LIBRARY -u PYTHONPATH "$VPY" - "$WORK/venv" <<'PY'
import os, sys
import ccalloc
venv = os.path.realpath(sys.argv[1])
lib = os.path.realpath(ccalloc.library_path())
assert lib.startswith(venv) and lib.endswith("ccalloc/libccalloc.so"), lib
pkg = os.path.dirname(ccalloc.__file__)
assert os.path.isfile(os.path.join(pkg, "include", "ccalloc", "ccalloc.h"))
assert os.path.isfile(os.path.join(pkg, "csrc", "torch_allocator.cpp"))
assert os.path.isfile(os.path.join(pkg, "csrc", "torch_history.hpp")), "the header torch_allocator.cpp includes"
with ccalloc.Allocator("sim", capacity_bytes=1 << 30, config="") as a:
    p = a.malloc(3 << 20)
    assert p % 512 == 0 and a.memory_stats()["allocated_bytes.all.current"] == 3 << 20
    a.free(p)
    assert a.memory_stats()["allocated_bytes.all.current"] == 0
print("installed ccalloc", ccalloc.version(), "from", lib)
PY
if ! "$VPY" -c 'import torch' 2>/dev/null; then
  grep -q "torch is not importable: the PyTorch integration is not built now" "$WORK/install.log" ||
    { echo "FAIL: no message about skipping the PyTorch integration"; exit 1; }
  echo "PyTorch integration skipped (no torch), as said in the log"
fi
echo PASS

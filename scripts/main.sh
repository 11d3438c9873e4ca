#!/usr/bin/env bash
# README command 1: build, then replay the bundled real trace (GPT-2 training,
# recorded with PyTorch 2.11 on an H200) on the simulated device and compare
# with what PyTorch's allocator reserved. Extra arguments go to `ccalloc replay`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
if [ ! -x build/ccalloc ]; then
  echo "main.sh: building the ccalloc CLI in build/ (the first time: about 5-10 minutes on 2 cores)" >&2
fi
# Progress lines hidden; compiler errors shown, and a failed build stops here.
cmake --build build --target ccalloc_cli 2>&1 | { grep -v '^\[' || true; }
exec build/ccalloc replay "$@"

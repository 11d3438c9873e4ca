#!/usr/bin/env bash
# README command 2 (and CI): build with warnings as errors and run every test
# that needs no GPU (CTest label `gpu` is skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build-test -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCCALLOC_WARNINGS_AS_ERRORS=ON >/dev/null
cmake --build build-test
ctest --test-dir build-test --output-on-failure -LE gpu -j 2

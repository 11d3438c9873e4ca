#!/usr/bin/env bash
# Builds build-bench-torch/bench_torch (PyTorch's allocator on the benchmark
# cases, bench/gpu/bench_torch.cpp) with g++ against the installed torch:
# its headers, libc10 / libc10_cuda and its C++ ABI. Used by
# scripts/gpu/bench.sh and scripts/gpu/mixed-layout.sh.
#
# Usage: scripts/gpu/build-bench-torch.sh LOG [PROBE_SECONDS [BUILD_SECONDS]]
#   LOG            the probe's and the compiler's output are appended here
#   PROBE_SECONDS  limit for importing torch (default 60)
#   BUILD_SECONDS  limit for the compile (default 120)
#   PYTHON         the interpreter whose torch is used (default python3)
#   CUDA_HOME      the CUDA toolkit (default /usr/local/cuda)
# Exit status: 0 built; 3 no torch importable by PYTHON; 1 the build failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
LOG=${1:?usage: scripts/gpu/build-bench-torch.sh LOG [PROBE_SECONDS [BUILD_SECONDS]]}
PROBE_S=${2:-60}
BUILD_S=${3:-120}
PY=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

read -r TORCH_DIR ABI < <(timeout "$PROBE_S" "$PY" -c \
  "import os,torch;print(os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI))" 2>>"$LOG")
if [ -z "${TORCH_DIR:-}" ] || [ -z "${ABI:-}" ]; then exit 3; fi
mkdir -p build-bench-torch
echo "build-bench-torch: building bench_torch against $TORCH_DIR" >&2
timeout "$BUILD_S" g++ -std=c++20 -O2 -DNDEBUG -D_GLIBCXX_USE_CXX11_ABI="$ABI" \
  -Ibench -I"$TORCH_DIR/include" -I"$TORCH_DIR/include/torch/csrc/api/include" -I"$CUDA_HOME/include" \
  bench/gpu/bench_torch.cpp -o build-bench-torch/bench_torch \
  -L"$TORCH_DIR/lib" -lc10_cuda -lc10 -Wl,-rpath,"$TORCH_DIR/lib" \
  -L"$CUDA_HOME/lib64" -lcudart -Wl,-rpath,"$CUDA_HOME/lib64" -pthread >>"$LOG" 2>&1 || exit 1

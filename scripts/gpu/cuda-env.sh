# shellcheck shell=bash
# Sourced by the GPU scripts: puts nvcc on PATH when it is only in a usual
# place, and sets NVCC (its path, or empty) and CUDA_ROOT (CUDA_HOME, else
# the toolkit around nvcc, else empty).
if ! command -v nvcc >/dev/null 2>&1; then
  for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-13 /usr/local/cuda-13.0; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then export PATH="$d/bin:$PATH"; break; fi
  done
fi
NVCC=$(command -v nvcc || true)
CUDA_ROOT=${CUDA_HOME:-}
if [ -z "$CUDA_ROOT" ] && [ -n "$NVCC" ]; then CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")"); fi

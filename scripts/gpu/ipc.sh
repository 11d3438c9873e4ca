#!/usr/bin/env bash
# The IPC and multi-GPU check (SPEC F25-F28) for the GPU machine: builds the
# GPU test program with nothing but the standard library and CUDA
# (CCALLOC_MINIMAL) and runs its IPC and copy tests:
#   ipc_plain          a producer allocates from a plain segment, writes and
#                      shares; a second process opens the handle twice (one
#                      cached mapping), reads the bytes, writes an answer from
#                      a kernel, closes; the producer reads the answer;
#   ipc_expandable     the same for an expandable segment (page descriptors
#                      over a Unix socket with SCM_RIGHTS);
#   ipc_to_second_gpu  both kinds with the consumer's kernel on GPU 1 (skips
#                      with one GPU or without peer access);
#   ipc_expandable_lease  (SPEC C3) a holder process opens an expandable
#                      block; the producer's free waits and empty_cache keeps
#                      the pages (the holder reads its bytes after); the
#                      holder closes, or is killed, and the producer
#                      reclaims the block (reserved bytes back to 0);
#   ipc_exporter_exit  the exporting process frees everything and exits, or
#                      is killed, while this process has its block open: the
#                      mapping keeps its bytes and takes a kernel's writes;
#   ipc_errors, copy_data, peer_copies (memcpy_async between plain and
#                      expandable memory of GPUs 0 and 1, P2P off and on;
#                      skips with one GPU).
# scripts/gpu/check.sh runs these tests too (with the rest, and under
# compute-sanitizer); this script is the quick check of them alone.
#
# Usage: scripts/gpu/ipc.sh [OUT_DIR]   (default: $OUT, else out/gpu-ipc)
# Writes OUT_DIR/build.log and OUT_DIR/gpu-ipc.log.
# Time: build about 2 minutes, the tests a few seconds; capped at 5 minutes.
# Exit status: 0 when the build and the tests passed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

OUT_DIR=${1:-${OUT:-out/gpu-ipc}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
BUILD=build-gpu-ipc
# shellcheck source=scripts/gpu/cuda-env.sh
. scripts/gpu/cuda-env.sh  # NVCC, CUDA_ROOT

CMAKE_ARGS=(-S . -B "$BUILD" -G Ninja -DCCALLOC_MINIMAL=ON -DCCALLOC_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release)
[ -n "$CUDA_ROOT" ] && CMAKE_ARGS+=("-DCUDAToolkit_ROOT=$CUDA_ROOT")
[ -n "$NVCC" ] && CMAKE_ARGS+=("-DCMAKE_CUDA_COMPILER=$NVCC")
{
  echo "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tr '\n' ';')"
  timeout 120 cmake "${CMAKE_ARGS[@]}" &&
    timeout 240 cmake --build "$BUILD" --target ccalloc_gpu_tests
} >"$OUT_DIR/build.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  tail -n 30 "$OUT_DIR/build.log"
  echo "gpu-ipc: build FAILED (rc $rc), see $OUT_DIR/build.log"
  exit 1
fi
timeout 120 "$BUILD/tests/gpu/ccalloc_gpu_tests" ipc_ copy_data peer_copies 2>&1 | tee "$OUT_DIR/gpu-ipc.log"
rc=${PIPESTATUS[0]}
echo "gpu-ipc: tests rc $rc"
exit "$rc"

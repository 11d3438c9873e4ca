#!/usr/bin/env bash
# Sleep and wake on the GPU (SPEC S1-S5, P9): builds ccalloc_sleep_wake_loop
# (the minimal CUDA build, build-gpu, shared with the check stage) and
# scripts/gpu/pinned_bandwidth.cu, then runs
#   1. pinned_bandwidth: cudaMemcpyAsync device<->pinned host, 1 GiB, GiB/s;
#   2. ccalloc_sleep_wake_loop --device cuda --rounds 20: the RL-style loop,
#      its per-round table and its own checks (exit status 1 when one fails);
#   3. ccalloc_sleep_wake_loop --device cuda --bench: pause and resume of
#      1 GiB (64 blocks of 16 MiB), with and without kept contents;
# and prints the targets: pause+keep and resume+restore at >= 80% of the
# pinned bandwidth, pause and resume without contents < 1 ms per GiB.
# Usage: scripts/gpu/sleep-wake.sh [OUT_DIR]   (default $OUT, else out/gpu-sleep-wake)
# Writes OUT_DIR/sleep-wake.log. Exit status 1 when a step failed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT_DIR=${1:-${OUT:-out/gpu-sleep-wake}}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/sleep-wake.log
# shellcheck source=scripts/gpu/cuda-env.sh
. scripts/gpu/cuda-env.sh
BUILD=build-gpu
rc=0
{
  if [ ! -f "$BUILD/build.ninja" ]; then
    cmake -S . -B "$BUILD" -G Ninja -DCCALLOC_MINIMAL=ON -DCCALLOC_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
      ${CUDA_ROOT:+-DCUDAToolkit_ROOT=$CUDA_ROOT} >/dev/null || exit 1
  fi
  cmake --build "$BUILD" --target ccalloc_sleep_wake_loop >/dev/null || { echo "build failed"; exit 1; }
  "$NVCC" -O2 -o "$BUILD/pinned_bandwidth" scripts/gpu/pinned_bandwidth.cu || { echo "nvcc failed"; exit 1; }
  echo "== pinned_bandwidth"
  "$BUILD/pinned_bandwidth" | tee "$BUILD/pinned.txt" || rc=1
  echo "== ccalloc_sleep_wake_loop --device cuda --rounds 20"
  timeout 180 "$BUILD/ccalloc_sleep_wake_loop" --device cuda --rounds 20 || rc=1
  echo "== ccalloc_sleep_wake_loop --device cuda --bench"
  timeout 120 "$BUILD/ccalloc_sleep_wake_loop" --device cuda --bench | tee "$BUILD/bench.txt" || rc=1
  d2h=$(awk '/d2h_gib_per_s/ {print $2}' "$BUILD/pinned.txt")
  h2d=$(awk '/h2d_gib_per_s/ {print $2}' "$BUILD/pinned.txt")
  echo "== against the targets (best of the 5 repetitions; wall ms per GiB)"
  awk -v d2h="$d2h" -v h2d="$h2d" '
    $1 ~ /^(pause|resume|pause\+keep|resume\+restore)$/ {
      if (!($1 in best) || $3 < best[$1]) best[$1] = $3 }
    END {
      for (k in best) {
        gibs = 1000.0 / best[k]
        if (k == "pause+keep") printf "%-15s %8.3f ms/GiB  %6.2f GiB/s  %5.1f%% of pinned d2h %s GiB/s (target >= 80%%)\n", k, best[k], gibs, 100 * gibs / d2h, d2h
        else if (k == "resume+restore") printf "%-15s %8.3f ms/GiB  %6.2f GiB/s  %5.1f%% of pinned h2d %s GiB/s (target >= 80%%)\n", k, best[k], gibs, 100 * gibs / h2d, h2d
        else printf "%-15s %8.3f ms/GiB  (target < 1 ms/GiB)\n", k, best[k]
      }
    }' "$BUILD/bench.txt"
  exit $rc
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# SPEC P on a real GPU: builds and runs bench_gpu (ccalloc, cudaMallocAsync,
# CUB, cudaMalloc) and bench_torch (PyTorch's native allocator), then merges
# their output into one markdown table (bench/gpu/summarize.py).
#
# Usage: scripts/gpu/bench.sh OUT_DIR
#   Writes to OUT_DIR: bench_build.log, bench_gpu.log, bench_torch.log,
#   bench-table.md (also printed last).
# Needs: a GPU, the CUDA toolkit (CUDA_HOME, default /usr/local/cuda), cmake,
# ninja, g++; python3 with torch for bench_torch (optional: if it is missing
# or fails, the rest still runs). Finishes in about a minute; every step is
# bounded so that the whole script stays under 4 minutes.
# Exit status: bench_gpu's (0 when it built and every case ran); bench_torch's
# outcome is reported in the table but does not change it.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${1:?usage: scripts/gpu/bench.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
BUILD_LOG=$OUT/bench_build.log
GPU_LOG=$OUT/bench_gpu.log
TORCH_LOG=$OUT/bench_torch.log
: >"$BUILD_LOG"

START=$(date +%s)
BUDGET_S=225  # whole script, leaving margin under 4 minutes
say() { echo "gpu-bench: $*" >&2; }
# Seconds left for a step: min(the step's own cap, what the budget has left).
left() {
  local cap=$1 rem=$((BUDGET_S - ($(date +%s) - START)))
  ((rem < cap)) && cap=$rem
  ((cap < 1)) && cap=1
  echo "$cap"
}

# ---- bench_gpu (CMake) -------------------------------------------------------
# The lead's build-gpu when it has the target; else a Release build of our own.
gpu_rc=1
BUILD=
if [ -f build-gpu/CMakeCache.txt ] &&
   timeout "$(left 120)" cmake --build build-gpu --target bench_gpu >>"$BUILD_LOG" 2>&1; then
  BUILD=build-gpu
else
  [ -f build-gpu/CMakeCache.txt ] && say "bench_gpu did not build in build-gpu; trying build-bench-gpu"
  say "configuring and building build-bench-gpu"
  if timeout "$(left 90)" cmake -S . -B build-bench-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
       -DCCALLOC_MINIMAL=ON -DCCALLOC_WITH_CUDA=ON >>"$BUILD_LOG" 2>&1 &&
     timeout "$(left 150)" cmake --build build-bench-gpu --target bench_gpu >>"$BUILD_LOG" 2>&1; then
    BUILD=build-bench-gpu
  fi
fi
if [ -n "$BUILD" ] && [ -x "$BUILD/bench/gpu/bench_gpu" ]; then
  BUILD_TYPE=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$BUILD/CMakeCache.txt")
  say "running bench_gpu ($BUILD, ${BUILD_TYPE:-no build type})"
  {
    echo "INFO build_dir=$BUILD build_type=${BUILD_TYPE:-unset}"
    timeout "$(left 150)" "$BUILD/bench/gpu/bench_gpu"
  } >"$GPU_LOG" 2>&1
  gpu_rc=$?
  ((gpu_rc == 0)) || { say "bench_gpu exited $gpu_rc (tail of its log):"; tail -n 20 "$GPU_LOG" >&2; echo "ERROR allocator=ccalloc case=run message=\"bench_gpu exited $gpu_rc\"" >>"$GPU_LOG"; }
else
  say "bench_gpu did not build (tail of $BUILD_LOG):"
  tail -n 20 "$BUILD_LOG" >&2
  echo "ERROR allocator=ccalloc case=build message=\"bench_gpu did not build; see bench_build.log\"" >"$GPU_LOG"
fi

# ---- bench_torch (g++ against the installed torch) ---------------------------
torch_rc=1
scripts/gpu/build-bench-torch.sh "$BUILD_LOG" "$(left 60)" "$(left 120)"
case $? in
  0)
    say "running bench_torch"
    timeout "$(left 90)" build-bench-torch/bench_torch >"$TORCH_LOG" 2>&1
    torch_rc=$?
    ((torch_rc == 0)) || { say "bench_torch exited $torch_rc (tail of its log):"; tail -n 20 "$TORCH_LOG" >&2; echo "ERROR allocator=torch case=run message=\"bench_torch exited $torch_rc\"" >>"$TORCH_LOG"; }
    ;;
  3)
    say "no torch for $PY: bench_torch skipped"
    echo "ERROR allocator=torch case=build message=\"no torch importable by $PY\"" >"$TORCH_LOG"
    ;;
  *)
    say "bench_torch did not build (tail of $BUILD_LOG):"
    tail -n 20 "$BUILD_LOG" >&2
    echo "ERROR allocator=torch case=build message=\"bench_torch did not build; see bench_build.log\"" >"$TORCH_LOG"
    ;;
esac

# ---- table -------------------------------------------------------------------
"$PY" bench/gpu/summarize.py --out "$OUT/bench-table.md" "$GPU_LOG" "$TORCH_LOG" ||
  say "summarize.py found no results"
say "done in $(($(date +%s) - START)) s (bench_gpu rc=$gpu_rc, bench_torch rc=$torch_rc); logs in $OUT"
exit "$gpu_rc"

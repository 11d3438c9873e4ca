#!/usr/bin/env bash
# The integrations check on a GPU machine (CuPy, PyTorch, a GPT-2 step): builds
# libccalloc.so with nothing but the standard library and CUDA
# (CCALLOC_MINIMAL), then
#   (a) GPT-2 (transformers, GPT2Config(), random weights, fixed seed) trains
#       20 AdamW steps on batch 8 x 512 random tokens, on PyTorch's native
#       allocator and on ccalloc, each in its own process, in the order
#       native, ccalloc, ccalloc, native (ABBA, to cancel drift), and
#       scripts/gpu/gpt2_allocators.py compare prints median step time (steps
#       3..19), peak reserved and the largest loss difference;
#   (b) a CuPy array workload on ccalloc printing ccalloc's statistics
#       (scripts/gpu/cupy_workload.py);
#   (c) the Python tests (python/tests) with their torch and CuPy parts;
#   (d) when 2 GPUs are visible (SKIP otherwise): a torch.distributed NCCL
#       all-reduce across them on tensors from a ccalloc pool whose segments
#       come from ncclMemAlloc (SPEC E5; scripts/gpu/nccl_allreduce.py).
#
# Usage: scripts/gpu/integrations.sh [OUT_DIR]
#   OUT_DIR defaults to $OUT, else out/gpu-integrations. Runs from the
#   repository root whatever the cwd. PYTHON (default python3) must have
#   torch, transformers and cupy. GPT2_ROUNDS=1 runs native and ccalloc once
#   each instead of twice; GPT2_ORDER and GPT2_STEPS (default 20) pick other
#   variants and lengths (see below); GPT2_SEQ (default 512) and GPT2_SEQ_MIN
#   (unset: fixed length) vary the sequence length per step in
#   [GPT2_SEQ_MIN, GPT2_SEQ].
# Writes to OUT_DIR (8 files): build.log, gpt2.log, gpt2.json (comparison and
#   every run), cupy.log, python-tests.log, nccl.log, nccl.json (every rank's
#   results; only when it ran), summary.md.
# Time: about 2-5 minutes (build ~1 min, each GPT-2 process ~20-40 s, the
#   all-reduce ~30 s); every
#   step has a time cap. Exit status 0 when every step passed, 1 otherwise;
#   a failing step does not stop the later ones.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT_DIR=${1:-${OUT:-out/gpu-integrations}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
BUILD=build-gpu-integrations
PYTHON=${PYTHON:-python3}
ROUNDS=${GPT2_ROUNDS:-2}
BUILD_LOG=$OUT_DIR/build.log
GPT2_LOG=$OUT_DIR/gpt2.log
CUPY_LOG=$OUT_DIR/cupy.log
PYTEST_LOG=$OUT_DIR/python-tests.log
NCCL_LOG=$OUT_DIR/nccl.log
SUMMARY=$OUT_DIR/summary.md
RUNS_DIR=$BUILD/gpt2-runs
for f in "$BUILD_LOG" "$GPT2_LOG" "$CUPY_LOG" "$PYTEST_LOG" "$NCCL_LOG" "$SUMMARY"; do : >"$f"; done
rm -f "$OUT_DIR/nccl.json"
export PYTHONUNBUFFERED=1
# Keep the machine's NVLink-multicast settings as they are (see the device notes).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

START=$(date +%s)
say() { echo "gpu-integrations: $*"; }
STEPS=()  # "name|result|seconds|detail"
FAILED=0
record() {  # name rc seconds [detail]
  local result=PASS
  if [ "$2" = skip ]; then
    result=SKIP
  elif [ "$2" -ne 0 ]; then
    result=FAIL
    FAILED=1
    [ "$2" -eq 124 ] && result="FAIL (timeout)"
  fi
  STEPS+=("$1|$result|$3|${4:-}")
}
# run_step NAME LOG CAP_SECONDS COMMAND...: runs the command with a time cap,
# output to the terminal and appended to LOG; sets STEP_RC; never exits.
run_step() {
  local name=$1 log=$2 cap=$3 t0
  shift 3
  say "$name"
  echo "== $name: $*" >>"$log"
  t0=$(date +%s)
  set +e
  timeout "$cap" "$@" 2>&1 | tee -a "$log"
  STEP_RC=${PIPESTATUS[0]}
  set -e
  STEP_SECONDS=$(($(date +%s) - t0))
}

# ---- environment -------------------------------------------------------------------
# shellcheck source=scripts/gpu/cuda-env.sh
. scripts/gpu/cuda-env.sh  # NVCC, CUDA_ROOT
{
  echo "== gpu-integrations $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd)"
  nvidia-smi -L 2>&1 || echo "(nvidia-smi failed)"
  echo "== nvcc: ${NVCC:-not found}; cmake: $(cmake --version 2>&1 | head -n 1); ninja: $(ninja --version 2>&1)"
  echo "== git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) changed file(s)"
  "$PYTHON" - <<'EOF' 2>&1 || true
import importlib, sys
print("== python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "cupy", "pytest"):
    try:
        m = importlib.import_module(name)
        print(f"== {name} {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"== {name}: not importable ({e})")
EOF
} 2>&1 | tee -a "$BUILD_LOG"

# ---- build libccalloc.so ---------------------------------------------------------------
CMAKE_ARGS=(-S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCCALLOC_MINIMAL=ON -DCCALLOC_WITH_CUDA=ON
            -DCCALLOC_BUILD_GPU_TESTS=OFF -DCCALLOC_BUILD_BENCH=OFF -DCCALLOC_INSTALL=OFF)
if [ -n "$CUDA_ROOT" ]; then CMAKE_ARGS+=("-DCUDAToolkit_ROOT=$CUDA_ROOT"); fi
run_step "configure ($BUILD)" "$BUILD_LOG" 180 cmake "${CMAKE_ARGS[@]}"
BUILD_RC=$STEP_RC
record configure "$STEP_RC" "$STEP_SECONDS"
if [ "$BUILD_RC" -eq 0 ]; then
  run_step "build libccalloc.so" "$BUILD_LOG" 300 cmake --build "$BUILD" --target ccalloc_shared
  BUILD_RC=$STEP_RC
  record "build libccalloc.so" "$STEP_RC" "$STEP_SECONDS"
fi
LIB=$(pwd)/$BUILD/libccalloc.so
if [ "$BUILD_RC" -ne 0 ] || [ ! -f "$LIB" ]; then
  say "libccalloc.so was not built (see $BUILD_LOG); the steps below need it"
  tail -n 30 "$BUILD_LOG"
fi
export CCALLOC_LIBRARY=$LIB

# ---- (a) GPT-2 on the native allocator and on ccalloc ------------------------------------------
rm -rf "$RUNS_DIR"
mkdir -p "$RUNS_DIR"
ORDER=(native ccalloc)
if [ "$ROUNDS" -ge 2 ]; then ORDER=(native ccalloc ccalloc native); fi
# GPT2_ORDER (space-separated variants) replaces the order; the variants:
#   native, ccalloc: each allocator as configured by the environment;
#   ccalloc-plain: ccalloc with CCALLOC_CONF=expandable_segments:False;
#   native-expandable: PyTorch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True;
#   ccalloc@CONF: ccalloc with CCALLOC_CONF=CONF (e.g. ccalloc@recycles_per_peak:0).
if [ -n "${GPT2_ORDER:-}" ]; then read -r -a ORDER <<<"$GPT2_ORDER"; fi
RUN_FILES=()
GPT2_FAILED=0
n=0
for variant in "${ORDER[@]}"; do
  n=$((n + 1))
  file=$RUNS_DIR/run$n-$variant.json
  env_args=()
  case $variant in
    native | ccalloc) allocator=$variant ;;
    ccalloc-plain) allocator=ccalloc; env_args=(CCALLOC_CONF=expandable_segments:False) ;;
    native-expandable) allocator=native; env_args=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ;;
    ccalloc@*) allocator=ccalloc; env_args=("CCALLOC_CONF=${variant#ccalloc@}") ;;
    *) say "unknown GPT-2 variant '$variant' (native, ccalloc, ccalloc-plain, native-expandable, ccalloc@CONF)"; exit 2 ;;
  esac
  run_step "GPT-2 run $n on $variant" "$GPT2_LOG" 240 \
    env "${env_args[@]}" "$PYTHON" scripts/gpu/gpt2_allocators.py train --allocator "$allocator" --label "$variant" \
    --steps "${GPT2_STEPS:-20}" --seq "${GPT2_SEQ:-512}" ${GPT2_SEQ_MIN:+--seq-min "$GPT2_SEQ_MIN"} --out "$file"
  record "GPT-2 run $n ($variant)" "$STEP_RC" "$STEP_SECONDS"
  if [ "$STEP_RC" -eq 0 ] && [ -f "$file" ]; then RUN_FILES+=("$file"); else GPT2_FAILED=1; fi
done
if [ "${#RUN_FILES[@]}" -ge 2 ]; then
  run_step "GPT-2 comparison" "$GPT2_LOG" 60 \
    "$PYTHON" scripts/gpu/gpt2_allocators.py compare "${RUN_FILES[@]}" --json "$OUT_DIR/gpt2.json"
  record "GPT-2 comparison" "$STEP_RC" "$STEP_SECONDS" "$(grep -E '^ccalloc / native' "$GPT2_LOG" | tail -n 1 || true)"
else
  record "GPT-2 comparison" skip 0 "fewer than two runs finished"
fi

# ---- (b) CuPy workload -----------------------------------------------------------------------
run_step "CuPy workload on ccalloc" "$CUPY_LOG" 180 "$PYTHON" scripts/gpu/cupy_workload.py
record "CuPy workload" "$STEP_RC" "$STEP_SECONDS" "$(grep -E '^ccalloc served' "$CUPY_LOG" | tail -n 1 || true)"

# ---- (c) Python tests, torch and CuPy parts included ---------------------------------------------
export CCALLOC_REQUIRE_GPU_TESTS=1  # test_gpu.py fails rather than skips without torch or CuPy
if "$PYTHON" -c 'import pytest' >/dev/null 2>&1; then
  run_step "Python tests (pytest python/tests)" "$PYTEST_LOG" 300 \
    "$PYTHON" -m pytest -v -p no:cacheprovider python/tests
else
  run_step "Python tests (python/tests/test_gpu.py; no pytest here)" "$PYTEST_LOG" 300 \
    "$PYTHON" python/tests/test_gpu.py
fi
record "Python tests" "$STEP_RC" "$STEP_SECONDS" \
  "$(grep -Eo '[0-9]+ (passed|failed)[^=]*' "$PYTEST_LOG" | tail -n 1 || true)"

# ---- (d) NCCL all-reduce across two GPUs on a pool of ncclMemAlloc memory (SPEC E5) ----------------
GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null | tail -n 1 || echo 0)
if [ "$GPUS" -ge 2 ] 2>/dev/null; then
  run_step "NCCL all-reduce on 2 GPUs (ccalloc pool from ncclMemAlloc)" "$NCCL_LOG" 360 \
    "$PYTHON" scripts/gpu/nccl_allreduce.py --world-size 2 --timeout 300 --json "$OUT_DIR/nccl.json"
  if [ "$STEP_RC" -eq 77 ]; then STEP_RC=skip; fi
  record "NCCL all-reduce (2 GPUs)" "$STEP_RC" "$STEP_SECONDS" \
    "$(grep -E '^nccl_allreduce: (PASS|FAIL|SKIP)' "$NCCL_LOG" | tail -n 1 || true)"
else
  echo "== NCCL all-reduce: SKIP, ${GPUS:-0} GPU(s) visible to PyTorch, 2 needed" | tee -a "$NCCL_LOG"
  record "NCCL all-reduce (2 GPUs)" skip 0 "${GPUS:-0} GPU(s) visible, 2 needed"
fi

# ---- summary ---------------------------------------------------------------------------------------
{
  echo "# gpu-integrations summary ($(($(date +%s) - START)) s; logs in $OUT_DIR)"
  echo
  echo "| step | result | seconds | detail |"
  echo "| --- | --- | --- | --- |"
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name result secs detail <<<"$s"
    echo "| $name | $result | $secs | $detail |"
  done
  echo
  if [ -s "$OUT_DIR/gpt2.json" ]; then
    echo "## GPT-2"
    echo
    sed -n '/^GPT-2 (/,/^P6/p' "$GPT2_LOG"
    echo
  fi
  echo "## CuPy"
  echo
  sed -n '/^cupy workload: [0-9]/,/^cupy workload: /p' "$CUPY_LOG"
  if grep -q '^nccl_allreduce: [0-9]* ranks' "$NCCL_LOG"; then
    echo
    echo "## NCCL all-reduce"
    echo
    sed -n '/^nccl_allreduce: [0-9]* ranks/,/^nccl_allreduce: \(PASS\|FAIL\)/p' "$NCCL_LOG"
  fi
} >"$SUMMARY"
echo
cat "$SUMMARY"
if [ "$FAILED" -ne 0 ] || [ "$GPT2_FAILED" -ne 0 ]; then
  echo "gpu-integrations: FAILED"
  exit 1
fi
echo "gpu-integrations: all steps passed"

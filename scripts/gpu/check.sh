#!/usr/bin/env bash
# The GPU check: build the CUDA backend, the GPU tests and the GPU benchmarks
# with nothing but the standard library and CUDA (CCALLOC_MINIMAL), run the
# GPU tests, replay the bundled traces on the GPU and on the simulated device
# and compare them (ccalloc_replay_cuda_check: `ccalloc replay --device cuda`
# vs `--device sim`; the CLI itself needs CLI11 and nlohmann-json, which the
# GPU machine lacks), run the GPU tests again under compute-sanitizer
# memcheck, then the benchmarks (scripts/gpu/bench.sh), and print a summary
# table.
#
# Usage: [GPU_CHECK_BENCH=0] [GPU_CHECK_BUDGET_S=420] scripts/gpu/check.sh [OUT_DIR]
#   GPU_CHECK_BENCH=0 skips the benchmarks.
#   OUT_DIR defaults to $OUT (the device tool's output folder), else
#   out/gpu-check. Runs from the repository root whatever the cwd.
# Writes to OUT_DIR: build.log (environment, configure, build), gpu-tests.log,
#   replay-cuda.log, sanitizer.log, and whatever scripts/gpu/bench.sh writes
#   there (bench_*.log, bench-table.md) -- at most 8 files, the device tool's limit.
# Needs: an NVIDIA GPU, the CUDA toolkit (nvcc; /usr/local/cuda or on PATH),
#   cmake >= 3.22, ninja, g++. compute-sanitizer for the sanitizer step.
# Time: bounded to about 7 minutes in all (each step has a cap and the
#   steps share one budget); typically 2-4 minutes.
# Exit status: 0 when every step passed, 1 otherwise. A failing step does not
#   stop the later ones.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

OUT_DIR=${1:-${OUT:-out/gpu-check}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
BUILD=build-gpu
BUILD_LOG=$OUT_DIR/build.log
TEST_LOG=$OUT_DIR/gpu-tests.log
SAN_LOG=$OUT_DIR/sanitizer.log
REPLAY_LOG=$OUT_DIR/replay-cuda.log
TEST_BIN=$BUILD/tests/gpu/ccalloc_gpu_tests
REPLAY_BIN=$BUILD/ccalloc_replay_cuda_check
: >"$BUILD_LOG"
: >"$TEST_LOG"
: >"$SAN_LOG"
: >"$REPLAY_LOG"

START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-420}
say() { echo "gpu-check: $*"; }
elapsed() { echo $(($(date +%s) - START)); }
# Seconds a step may take: min(its cap, what is left of the budget), at least 1.
left() {
  local cap=$1 rem=$((BUDGET_S - $(elapsed)))
  ((rem < cap)) && cap=$rem
  ((cap < 1)) && cap=1
  echo "$cap"
}

STEPS=()    # "name|result|seconds|log|detail"
FAILED=0
record() {  # name rc seconds log [detail]
  local result=PASS
  if [ "$2" = skip ]; then result=SKIP
  elif [ "$2" -ne 0 ]; then
    result=FAIL
    FAILED=1
    [ "$2" -eq 124 ] && result="FAIL (timeout)"
  fi
  STEPS+=("$1|$result|$3|$4|${5:-}")
}

# ---- environment ---------------------------------------------------------------
# shellcheck source=scripts/gpu/cuda-env.sh
. scripts/gpu/cuda-env.sh  # NVCC, CUDA_ROOT
SANITIZER=$(command -v compute-sanitizer || true)
if [ -z "$SANITIZER" ]; then
  for c in "$CUDA_ROOT/bin/compute-sanitizer" "$CUDA_ROOT/compute-sanitizer/compute-sanitizer" \
           /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    if [ -x "$c" ]; then SANITIZER=$c; break; fi
  done
fi
{
  echo "== gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd)"
  echo "== nvidia-smi -L"
  nvidia-smi -L 2>&1 || echo "(nvidia-smi failed)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 || true
  echo "== nvcc --version (${NVCC:-not found})"
  ${NVCC:-false} --version 2>&1 || echo "(no nvcc)"
  echo "== cmake: $(cmake --version 2>&1 | head -n 1); ninja: $(ninja --version 2>&1); g++: $(g++ --version 2>&1 | head -n 1)"
  echo "== compute-sanitizer: ${SANITIZER:-not found} $([ -n "$SANITIZER" ] && "$SANITIZER" --version 2>&1 | tail -n 1)"
  echo "== git: $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed file(s)"
} 2>&1 | tee -a "$BUILD_LOG"

# ---- configure -------------------------------------------------------------------
CMAKE_ARGS=(-S . -B "$BUILD" -G Ninja -DCCALLOC_MINIMAL=ON -DCCALLOC_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release)
[ -n "$CUDA_ROOT" ] && CMAKE_ARGS+=("-DCUDAToolkit_ROOT=$CUDA_ROOT")
[ -n "$NVCC" ] && CMAKE_ARGS+=("-DCMAKE_CUDA_COMPILER=$NVCC")
say "configuring $BUILD"
t0=$(date +%s)
echo "== cmake ${CMAKE_ARGS[*]}" >>"$BUILD_LOG"
timeout "$(left 120)" cmake "${CMAKE_ARGS[@]}" >>"$BUILD_LOG" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  say "configure failed (rc $rc); retrying without bench/ (tail of build.log):"
  tail -n 25 "$BUILD_LOG"
  record "configure (with bench)" $rc $(($(date +%s) - t0)) build.log
  t0=$(date +%s)
  rm -rf "$BUILD/CMakeCache.txt" "$BUILD/CMakeFiles"
  echo "== cmake ${CMAKE_ARGS[*]} -DCCALLOC_BUILD_BENCH=OFF" >>"$BUILD_LOG"
  timeout "$(left 120)" cmake "${CMAKE_ARGS[@]}" -DCCALLOC_BUILD_BENCH=OFF >>"$BUILD_LOG" 2>&1
  rc=$?
  record "configure (no bench)" $rc $(($(date +%s) - t0)) build.log
else
  record configure 0 $(($(date +%s) - t0)) build.log
fi
grep -E '^-- ccalloc' "$BUILD_LOG" || true

# ---- build -----------------------------------------------------------------------
if [ $rc -eq 0 ]; then
  say "building"
  t0=$(date +%s)
  echo "== cmake --build $BUILD" >>"$BUILD_LOG"
  timeout "$(left 300)" cmake --build "$BUILD" >>"$BUILD_LOG" 2>&1
  rc=$?
  record build $rc $(($(date +%s) - t0)) build.log
  if [ $rc -ne 0 ]; then
    say "build failed (rc $rc; tail of build.log):"
    tail -n 40 "$BUILD_LOG"
    say "building only the GPU tests"
    t0=$(date +%s)
    echo "== cmake --build $BUILD --target ccalloc_gpu_tests" >>"$BUILD_LOG"
    timeout "$(left 240)" cmake --build "$BUILD" --target ccalloc_gpu_tests >>"$BUILD_LOG" 2>&1
    record "build (GPU tests only)" $? $(($(date +%s) - t0)) build.log
  fi
else
  record build skip 0 build.log "not configured"
fi

# ---- GPU tests -------------------------------------------------------------------
TEST_SUMMARY=""
if [ -x "$TEST_BIN" ]; then
  say "running the GPU tests (ctest -L gpu; benchmarks run below)"
  t0=$(date +%s)
  timeout "$(left 300)" ctest --test-dir "$BUILD" -L gpu -LE bench --output-on-failure -V --timeout 280 2>&1 |
    tee -a "$TEST_LOG"
  rc=${PIPESTATUS[0]}
  TEST_SUMMARY=$(grep -Eo '[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped' "$TEST_LOG" | tail -n 1)
  record "GPU tests" "$rc" $(($(date +%s) - t0)) gpu-tests.log "$TEST_SUMMARY"
else
  record "GPU tests" 1 0 gpu-tests.log "$TEST_BIN was not built"
  echo "$TEST_BIN was not built; see build.log" >>"$TEST_LOG"
fi

# ---- replay on the GPU vs the simulated device ---------------------------------------
# gpt2_train and bert_copystream_infer (record_stream gaps), each replayed with
# --device sim and --device cuda: one JSON line per replay, then MATCH or
# MISMATCH per trace (peak requested, allocated, reserved bytes and OOMs).
if [ -x "$REPLAY_BIN" ]; then
  say "replaying the bundled traces on the GPU and on the simulated device ($REPLAY_BIN)"
  t0=$(date +%s)
  # The default configuration (expandable segments), then PyTorch's policies (plain segments).
  for conf in "" "expandable_segments:False,trim_on_new_peak:False,reuse_across_streams:False"; do
    echo "== $REPLAY_BIN --config '$conf'" >>"$REPLAY_LOG"
    timeout "$(left 150)" "$REPLAY_BIN" --config "$conf" 2>&1 | tee -a "$REPLAY_LOG"
    rc=${PIPESTATUS[0]}
    record "replay --device cuda vs sim (config '${conf:-default}')" "$rc" $(($(date +%s) - t0)) replay-cuda.log \
      "$(grep -Eo '[0-9]+ of [0-9]+ trace\(s\) matched' "$REPLAY_LOG" | tail -n 1)"
    t0=$(date +%s)
  done
  # The default configuration over two passes (each pass's peaks
  # and the synchronizations must agree: page fences on a real device).
  echo "== $REPLAY_BIN --repeat 2" >>"$REPLAY_LOG"
  timeout "$(left 150)" "$REPLAY_BIN" --repeat 2 2>&1 | tee -a "$REPLAY_LOG"
  rc=${PIPESTATUS[0]}
  record "replay --device cuda vs sim (default, --repeat 2)" "$rc" $(($(date +%s) - t0)) replay-cuda.log \
    "$(grep -Eo '[0-9]+ of [0-9]+ trace\(s\) matched' "$REPLAY_LOG" | tail -n 1)"
else
  echo "$REPLAY_BIN was not built; see build.log" >>"$REPLAY_LOG"
  record "replay --device cuda vs sim" 1 0 replay-cuda.log "$REPLAY_BIN was not built"
fi

# ---- the same under compute-sanitizer memcheck -------------------------------------
SAN_DETAIL=""
if [ ! -x "$TEST_BIN" ]; then
  record "memcheck" skip 0 sanitizer.log "no test binary"
elif [ -z "$SANITIZER" ]; then
  echo "compute-sanitizer not found (PATH, $CUDA_ROOT)" >>"$SAN_LOG"
  record "memcheck" 1 0 sanitizer.log "compute-sanitizer not found"
elif (($(left 600) < 30)); then
  record "memcheck" 1 0 sanitizer.log "no time left"
else
  # --sanitizer: the test program skips the cases that make CUDA calls fail on
  # purpose (out of memory, a bad cudaFree), which would count as API errors.
  say "running the GPU tests under compute-sanitizer memcheck"
  t0=$(date +%s)
  echo "== $SANITIZER --tool memcheck --leak-check full --error-exitcode 1 $TEST_BIN --sanitizer" >>"$SAN_LOG"
  timeout "$(left 240)" "$SANITIZER" --tool memcheck --leak-check full --error-exitcode 1 \
    "$TEST_BIN" --sanitizer 2>&1 | tee -a "$SAN_LOG"
  rc=${PIPESTATUS[0]}
  SAN_DETAIL="$(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?' "$SAN_LOG" | tail -n 1)"
  record "memcheck" "$rc" $(($(date +%s) - t0)) sanitizer.log "$SAN_DETAIL"
  if [ "$rc" -ne 0 ] && (($(left 600) > 90)); then
    # Diagnosis only: are the errors CUDA API errors (reported by default) or
    # memory errors and leaks? Appended to the same log.
    say "memcheck failed; again with --report-api-errors no, to tell API errors from memory errors"
    t0=$(date +%s)
    echo "== DIAGNOSIS: $SANITIZER --tool memcheck --leak-check full --report-api-errors no --error-exitcode 1 $TEST_BIN --sanitizer" >>"$SAN_LOG"
    timeout "$(left 200)" "$SANITIZER" --tool memcheck --leak-check full --report-api-errors no --error-exitcode 1 \
      "$TEST_BIN" --sanitizer >>"$SAN_LOG" 2>&1
    rc2=$?
    api_lines=$(grep -c 'Program hit' "$SAN_LOG" || true)
    record "memcheck, API errors off (diagnosis)" $rc2 $(($(date +%s) - t0)) sanitizer.log \
      "$(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?' "$SAN_LOG" | tail -n 1); 'Program hit' lines in first run: $api_lines"
  fi
fi

# ---- benchmarks ----------------------------------------------------------------------
if [ "${GPU_CHECK_BENCH:-1}" = 0 ]; then
  record "benchmarks" skip 0 "-" "GPU_CHECK_BENCH=0"
elif [ -x scripts/gpu/bench.sh ]; then
  if (($(left 600) < 60)); then
    record "benchmarks" 1 0 "-" "no time left (budget ${BUDGET_S} s)"
  else
    say "running scripts/gpu/bench.sh $OUT_DIR"
    t0=$(date +%s)
    timeout "$(left 270)" scripts/gpu/bench.sh "$OUT_DIR"
    record "benchmarks (gpu-bench.sh)" $? $(($(date +%s) - t0)) "bench_*.log, bench-table.md"
  fi
else
  benches=$(find "$BUILD/bench" -type f -perm -u+x -name 'bench_*' 2>/dev/null | sort)
  if [ -z "$benches" ]; then
    record "benchmarks" skip 0 "-" "no scripts/gpu/bench.sh and no binaries under $BUILD/bench"
  else
    for b in $benches; do
      say "running $b"
      t0=$(date +%s)
      timeout "$(left 180)" "$b" 2>&1 | tee -a "$OUT_DIR/bench.log"
      record "benchmark $(basename "$b")" "${PIPESTATUS[0]}" $(($(date +%s) - t0)) bench.log
    done
  fi
fi

# ---- summary -------------------------------------------------------------------------
echo
echo "==== gpu-check summary ($(elapsed) s; logs in $OUT_DIR) ===="
printf '| %-38s | %-14s | %7s | %-28s | %s\n' step result seconds log detail
printf '| %-38s | %-14s | %7s | %-28s | %s\n' "---" "---" "---" "---" "---"
for s in "${STEPS[@]}"; do
  IFS='|' read -r name result secs log detail <<<"$s"
  printf '| %-38s | %-14s | %7s | %-28s | %s\n' "$name" "$result" "$secs" "$log" "$detail"
done
fails=$(grep -hE '\[FAIL\]|FAILED:|: MISMATCH|: ERROR' "$TEST_LOG" "$SAN_LOG" "$REPLAY_LOG" 2>/dev/null | sort -u | head -n 40)
if [ -n "$fails" ]; then
  echo
  echo "failed checks (gpu-tests.log, sanitizer.log, replay-cuda.log):"
  echo "$fails"
fi
if [ "$FAILED" -ne 0 ]; then
  echo "gpu-check: FAILED"
  exit 1
fi
echo "gpu-check: all steps passed"
exit 0

#!/usr/bin/env bash
# One call on the GPU machine: scripts/gpu-check.sh (GPU tests, memcheck,
# replay on cuda vs sim, benchmarks) then scripts/gpu-integrations.sh (GPT-2
# on ccalloc vs native, CuPy, Python tests), within the device tool's limit
# of 8 files back: the two summaries, the benchmark table and one archive of
# every log.
# Usage: scripts/gpu-all.sh [OUT_DIR]   (default $OUT, else out/gpu-all)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${1:-${OUT:-out/gpu-all}}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d)
GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-300} scripts/gpu-check.sh "$WORK/check" >"$WORK/check.out" 2>&1
rc1=$?
scripts/gpu-integrations.sh "$WORK/integrations" >"$WORK/integrations.out" 2>&1
rc2=$?
tail -n 40 "$WORK/check.out" >"$OUT_DIR/check-summary.txt"
cp "$WORK/check/bench-table.md" "$OUT_DIR/" 2>/dev/null
cp "$WORK/integrations/summary.md" "$OUT_DIR/integrations-summary.md" 2>/dev/null
cp "$WORK/integrations/gpt2.json" "$OUT_DIR/" 2>/dev/null
tar czf "$OUT_DIR/logs.tgz" -C "$WORK" . 2>/dev/null
echo "gpu-check rc=$rc1, gpu-integrations rc=$rc2"
cat "$OUT_DIR/check-summary.txt"
cat "$OUT_DIR/integrations-summary.md" 2>/dev/null
[ $rc1 -eq 0 ] && [ $rc2 -eq 0 ]

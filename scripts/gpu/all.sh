#!/usr/bin/env bash
# One call on the GPU machine: scripts/gpu/check.sh (GPU tests, memcheck,
# replay on cuda vs sim, benchmarks), an A/B of ccalloc's hot path with
# expandable segments (the default) and plain segments, then
# scripts/gpu/integrations.sh (GPT-2 on ccalloc vs native, CuPy, Python
# tests) and scripts/gpu/snapshots.sh (snapshots both ways with PyTorch), and
# scripts/gpu/ipc.sh when present, within the device tool's limit of 8 files
# back: the summaries, the benchmark tables and one archive of every log.
# Usage: [GPU_ALL_STAGES="check ab integrations snapshots ipc"] scripts/gpu/all.sh [OUT_DIR]
#   (default $OUT, else out/gpu-all); GPU_ALL_STAGES picks a subset (two calls
#   fit the device tool's 10-minute limit better than one).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT_DIR=${1:-${OUT:-out/gpu-all}}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d)
STAGES=" ${GPU_ALL_STAGES:-check ab integrations snapshots ipc} "
want() { [[ "$STAGES" == *" $1 "* ]]; }
rc1=0; rc2=0; rc3=0; rc4=0
if want check; then
  GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-300} scripts/gpu/check.sh "$WORK/check" >"$WORK/check.out" 2>&1
  rc1=$?
fi
# A/B: the same ccalloc benchmark with both kinds of segment, alternating.
AB=$OUT_DIR/ab-segments.txt
: >"$AB"
if want ab && [ -x build-gpu/bench/gpu/bench_gpu ]; then
  for round in 1 2; do
    for conf in "" "expandable_segments:False"; do
      echo "== round $round CCALLOC_CONF='$conf'" >>"$AB"
      CCALLOC_CONF=$conf timeout 120 build-gpu/bench/gpu/bench_gpu --only=ccalloc --reps=5 2>&1 |
        grep -E '^RESULT' >>"$AB"
    done
  done
fi
if want integrations; then
  scripts/gpu/integrations.sh "$WORK/integrations" >"$WORK/integrations.out" 2>&1
  rc2=$?
fi
if want snapshots; then
  scripts/gpu/snapshots.sh "$WORK/snapshots" >"$WORK/snapshots.out" 2>&1
  rc3=$?
fi
if want ipc && [ -x scripts/gpu/ipc.sh ]; then
  scripts/gpu/ipc.sh "$WORK/ipc" >"$WORK/ipc.out" 2>&1
  rc4=$?
fi
[ -f "$WORK/check.out" ] && tail -n 40 "$WORK/check.out" >"$OUT_DIR/check-summary.txt"
cp "$WORK/check/bench-table.md" "$OUT_DIR/" 2>/dev/null
cp "$WORK/integrations/summary.md" "$OUT_DIR/integrations-summary.md" 2>/dev/null
cp "$WORK/integrations/gpt2.json" "$OUT_DIR/" 2>/dev/null
tar czf "$OUT_DIR/logs.tgz" -C "$WORK" . 2>/dev/null
{ [ -f "$WORK/snapshots.out" ] && tail -n 25 "$WORK/snapshots.out"; echo; [ -f "$WORK/ipc.out" ] && tail -n 30 "$WORK/ipc.out"; } >"$OUT_DIR/snapshots-ipc-summary.txt"
echo "gpu-check rc=$rc1, gpu-integrations rc=$rc2, gpu-snapshots rc=$rc3, gpu-ipc rc=$rc4"
cat "$OUT_DIR/check-summary.txt" 2>/dev/null
cat "$OUT_DIR/integrations-summary.md" 2>/dev/null
cat "$OUT_DIR/snapshots-ipc-summary.txt"
grep -E "case=(pair|mixed)|threads=(1|8) " "$AB" | cut -c1-160
[ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && [ $rc3 -eq 0 ] && [ $rc4 -eq 0 ]

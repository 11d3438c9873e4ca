#!/usr/bin/env bash
# The GPU checks and the PyTorch drop-in run in one device call, each step's
# output kept under OUT_DIR (default $OUT) within the device tool's limit of
# 8 files back:
#   check    scripts/gpu/check.sh: CUDA build, GPU tests, replay on cuda vs
#            sim (also --repeat 2), the benchmarks against PyTorch
#   dropin   scripts/gpu/pytorch.sh: pip install, every PyTorch
#            drop-in item in its own process, GPT-2 native / expandable /
#            ccalloc (GPT2_* variables as there)
#   newuser  NEWUSER_SCRIPT (a new user's script written from the README)
# Usage: [CHECK_PYTORCH_STAGES="check dropin newuser"] scripts/gpu/check-pytorch.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT_DIR=${1:-${OUT:-out/gpu-check-pytorch}}
mkdir -p "$OUT_DIR"
STAGES=" ${CHECK_PYTORCH_STAGES:-check dropin newuser} "
want() { [[ "$STAGES" == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1
W=$(mktemp -d)
rc=0
if want check; then
  GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-240} scripts/gpu/check.sh "$W/check" >"$W/check.out" 2>&1 || rc=1
  tail -n 45 "$W/check.out"
  cp "$W/check/bench-table.md" "$OUT_DIR/" 2>/dev/null
fi
if want dropin; then
  OUT_DIR_D=$W/dropin
  OUT_DIR=$OUT_DIR_D scripts/gpu/pytorch.sh >"$W/dropin.out" 2>&1 || rc=1
  cat "$W/dropin.out"
fi
if want newuser && [ -n "${NEWUSER_SCRIPT:-}" ]; then
  bash "$NEWUSER_SCRIPT" >"$W/newuser.out" 2>&1 || rc=1
  tail -n 40 "$W/newuser.out"
fi
tar cJf "$OUT_DIR/logs.tar.xz" -C "$W" . 2>/dev/null
exit $rc

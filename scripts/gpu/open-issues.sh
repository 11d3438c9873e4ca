#!/usr/bin/env bash
# One device call for the open GPU work, each step's output written straight
# under OUT_DIR as it runs (so a call cut at its time limit still brings back
# what finished):
#   check.out       scripts/gpu/check.sh without the benchmarks: CUDA build,
#                   GPU tests (IPC of expandable memory, leases, exporter exit
#                   included), replay cuda vs sim, compute-sanitizer memcheck
#   sleep-wake.out  scripts/gpu/sleep-wake.sh: the RL-style loop on the GPU
#                   and pause/resume per GiB against pinned copies
#   dropin.out      scripts/gpu/pytorch.sh: pip install and every drop-in item
#                   (torch.multiprocessing of expandable memory, NCCL
#                   registration hook, sleep and wake), no GPT-2 rounds,
#                   history stacks under a cap
#   logs.tar.xz     the logs of the three
# Usage: scripts/gpu/open-issues.sh [OUT_DIR]   (default $OUT)
# Steps: OPEN_STEPS="check sleep dropin" (default all three). Time: about
# 7 minutes on an H200 (check 2, sleep-wake 1, install 1, items 3).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT_DIR=${1:-${OUT:-out/gpu-open-issues}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
STEPS=" ${OPEN_STEPS:-check sleep dropin} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1
W=$OUT_DIR/work
mkdir -p "$W"
rc=0
t0=$(date +%s)
if want check; then
  GPU_CHECK_BENCH=0 GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-200} scripts/gpu/check.sh "$W/check" >"$OUT_DIR/check.out" 2>&1 || rc=1
  echo "check: rc $rc after $(( $(date +%s) - t0 )) s"
fi
if want sleep; then
  timeout 150 scripts/gpu/sleep-wake.sh "$W/sleep" >"$OUT_DIR/sleep-wake.out" 2>&1 || rc=1
  echo "sleep-wake: rc $rc after $(( $(date +%s) - t0 )) s"
fi
if want dropin; then
  GPT2_ROUNDS=0 ITEM_TIMEOUT=${ITEM_TIMEOUT:-90} OUT_DIR=$W/dropin \
    timeout "${DROPIN_CAP_S:-330}" scripts/gpu/pytorch.sh >"$OUT_DIR/dropin.out" 2>&1 || rc=1
  echo "dropin: rc $rc after $(( $(date +%s) - t0 )) s"
fi
tar cJf "$OUT_DIR/logs.tar.xz" -C "$W" . 2>/dev/null && rm -rf "$W"
exit $rc

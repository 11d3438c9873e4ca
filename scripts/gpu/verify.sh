#!/usr/bin/env bash
# One device call that verifies a tree after a change to the hot path: the
# GPU checks (CUDA build, GPU tests, replay cuda vs sim, benchmarks against
# PyTorch), then scripts/gpu/hotpath.sh three times back to back (default
# configuration = thread cache on; and CCALLOC_THREAD_CACHE=0), cases pair,
# mixed, threads, through the C++ API and the C API (libccalloc.so).
# About 150 s on an H200.
# Usage: scripts/gpu/verify.sh OUT_DIR   (one tar of the logs under OUT_DIR)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT_DIR=${1:?OUT_DIR}
mkdir -p "$OUT_DIR"  # the tar of the logs needs it (a missing folder lost them, 2026-12-02)
W=$(mktemp -d)
CHECK_PYTORCH_STAGES=check GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-300} scripts/gpu/check-pytorch.sh "$W/check" >"$W/check.out" 2>&1
echo "check rc=$?"
for i in 1 2 3; do
  HOTPATH_SETTINGS="|;|0" HOTPATH_CASES=pair,mixed,threads scripts/gpu/hotpath.sh "$W/hot$i" >"$W/hot$i.out" 2>&1
  echo "hotpath $i rc=$?"
done
tail -n 50 "$W/check.out"
for i in 1 2 3; do echo "== hotpath run $i"; grep -E "^RESULT|^### " "$W/hot$i"/hotpath-*.log 2>/dev/null | sed 's/.*hotpath-//' ; done
tar cJf "$OUT_DIR/verify-logs.tar.xz" -C "$W" .

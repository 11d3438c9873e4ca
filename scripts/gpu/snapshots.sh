#!/usr/bin/env bash
# Snapshots both ways, on the GPU machine (PyTorch's pickle and ccalloc's report):
#  (i)  a snapshot written by ccalloc on the GPU (ccalloc_snapshot_example:
#       history + snapshot JSON -> python/ccalloc/snapshot.py -> pickle) is
#       read by PyTorch's own viewer: `python -m torch.cuda._memory_viz`
#       trace_plot and segment_plot write HTML, stats and trace print without
#       error (they walk every segment and block and assert their sums);
#  (ii) a snapshot written by PyTorch itself (a small model trained with
#       torch.cuda.memory._record_memory_history, then _dump_snapshot) is
#       converted (tools/snapshot_to_trace.py, no torch needed) and replayed
#       by ccalloc on the simulated device and on the GPU
#       (ccalloc_replay_cuda_check reads the pickle directly: the replay
#       library sniffs it and runs the bundled converter with python3).
#
# Usage: scripts/gpu/snapshots.sh [OUT_DIR] [CCALLOC_BIN]
#   OUT_DIR defaults to $OUT, else out/gpu-snapshots.
#   CCALLOC_BIN (optional): a prebuilt `ccalloc` CLI (built where CLI11 and
#   nlohmann-json exist, e.g. the development machine's build/ccalloc); with
#   it the script also writes `ccalloc report` of the PyTorch snapshot and
#   runs tests/python with torch present. Without it, everything else runs:
#   the programs used are built here with -DCCALLOC_MINIMAL=ON (standard
#   library and CUDA only).
# Needs: an NVIDIA GPU, nvcc, cmake, ninja, g++, python3 with torch.
# Writes to OUT_DIR (at most 8 files): snapshots.log, ccalloc_snapshot.pickle,
#   ccalloc_trace_plot.html, ccalloc_segment_plot.html, torch_snapshot.pickle,
#   torch_snapshot.trace, and with CCALLOC_BIN report.html.
# Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT_DIR=${1:-${OUT:-out/gpu-snapshots}}
CCALLOC_BIN=${2:-}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG=$OUT_DIR/snapshots.log
BUILD=build-gpu-snapshots
: >"$LOG"
FAILED=0
step() {  # name command...
  local name=$1
  shift
  echo "== $name" >>"$LOG"
  if "$@" >>"$LOG" 2>&1; then
    echo "PASS  $name" | tee -a "$LOG"
  else
    echo "FAIL  $name (exit $?; see $LOG)" | tee -a "$LOG"
    FAILED=1
  fi
}

{
  echo "date: $(date -u)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
} >>"$LOG"

step "build (CCALLOC_MINIMAL)" bash -c "cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCCALLOC_MINIMAL=ON -DCCALLOC_BUILD_BENCH=OFF -DCCALLOC_BUILD_GPU_TESTS=OFF && \
  cmake --build $BUILD --target ccalloc_snapshot_example ccalloc_replay_cuda_check"

# (i) ccalloc's snapshot in PyTorch's viewer.
JSON=$OUT_DIR/ccalloc_snapshot.json
PICKLE=$OUT_DIR/ccalloc_snapshot.pickle
step "(i) ccalloc writes a snapshot on the GPU" bash -c "$BUILD/ccalloc_snapshot_example '$JSON' | tee /dev/stderr | grep -q 'from the cuda backend'"
step "(i) python/ccalloc/snapshot.py makes the pickle" python3 python/ccalloc/snapshot.py "$JSON" -o "$PICKLE"
rm -f "$JSON"  # the pickle holds the same data; stay within 8 files
for plot in trace_plot segment_plot; do
  step "(i) torch.cuda._memory_viz $plot" bash -c "python3 -m torch.cuda._memory_viz $plot '$PICKLE' \
    -o '$OUT_DIR/ccalloc_$plot.html' && grep -q 'snapshot.pickle' '$OUT_DIR/ccalloc_$plot.html' && \
    test \$(stat -c %s '$OUT_DIR/ccalloc_$plot.html') -gt 10000"
done
step "(i) torch.cuda._memory_viz stats (segsum asserts every segment's sums)" \
  python3 -m torch.cuda._memory_viz stats "$PICKLE"
step "(i) torch.cuda._memory_viz trace" bash -c "python3 -m torch.cuda._memory_viz trace '$PICKLE' | tail -5"

# (ii) PyTorch's snapshot in ccalloc.
TORCH_PICKLE=$OUT_DIR/torch_snapshot.pickle
step "(ii) PyTorch records a snapshot" python3 - "$TORCH_PICKLE" <<'EOF'
import sys, torch
torch.manual_seed(0)
dev = "cuda"
torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=200000)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU()) for _ in range(8)]).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
side = torch.cuda.Stream()
for step in range(4):
    x = torch.randn(64 * (step + 1), 2048, device=dev)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.stream(side):
        y = torch.empty(8 << 20, device=dev)
    y.record_stream(torch.cuda.current_stream())
    del y
torch.cuda.synchronize()
torch.cuda.empty_cache()
torch.cuda.memory._dump_snapshot(sys.argv[1])
torch.cuda.memory._record_memory_history(enabled=None)
s = torch.cuda.memory._snapshot()
print("peak reserved", torch.cuda.max_memory_reserved(), "entries", sum(len(t) for t in s["device_traces"]))
EOF
step "(ii) tools/snapshot_to_trace.py converts it (no torch imported)" \
  python3 -S -c "import sys; sys.path.insert(0, 'tools'); import snapshot_to_trace as c; sys.exit(c.main(['$TORCH_PICKLE', '-o', '$OUT_DIR/torch_snapshot.trace']))"
step "(ii) ccalloc replays the pickle on the simulated device and the GPU" \
  "$BUILD/ccalloc_replay_cuda_check" "$TORCH_PICKLE"

if [ -n "$CCALLOC_BIN" ]; then
  step "ccalloc report of PyTorch's snapshot" "$CCALLOC_BIN" report "$TORCH_PICKLE" -o "$OUT_DIR/report.html"
  step "tests/python with torch (our pickle in torch.cuda._memory_viz)" \
    env CCALLOC_BIN="$CCALLOC_BIN" python3 -m unittest discover -s tests/python -v
fi
echo "log: $LOG"
exit $FAILED

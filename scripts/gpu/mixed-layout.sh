#!/usr/bin/env bash
# Is the mixed case's spread on the H200 host (the same binary
# measures ~150 or ~250 ns a step from one process to the next) the host or
# the process's memory layout? Times the same loops with and without the
# GPU, with and without address-space randomization, interleaved:
#   bench_count mixed|pair: the simulated device (no driver, no GPU; the
#     layout of a run depends only on the binary and ASLR), ns_per_op of
#     the measured loop;
#   bench_gpu --only=ccalloc --cases=mixed: the CUDA backend;
# each plainly and under `setarch -R` (no randomization), while vmstat
# records the host's steal time (st: a virtual CPU waiting for the host).
#
# Usage: scripts/gpu/mixed-layout.sh OUT_DIR
#   LAYOUT_ROUNDS  rounds (default 6)
#   LAYOUT_STEPS   bench_count mixed steps per run (default 3000000)
#   LAYOUT_CONF    CCALLOC_CONF for bench_count (e.g. recycle_time_percent:100:
#                  no time budget, so every run of one binary under setarch -R
#                  executes the same instructions on the same addresses)
#   LAYOUT_GPU     0: skip bench_gpu (default 1)
#   LAYOUT_TORCH   1: also PyTorch's allocator on the same mixed case in
#                  each round (bench_torch, built with g++ against the
#                  installed torch: scripts/gpu/build-bench-torch.sh; default 0)
# Writes OUT_DIR/layout.log (every run), OUT_DIR/vmstat.log, OUT_DIR/host.txt
# and prints OUT_DIR/layout-summary.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: scripts/gpu/mixed-layout.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROUNDS=${LAYOUT_ROUNDS:-6}
STEPS=${LAYOUT_STEPS:-3000000}
CONF=${LAYOUT_CONF:-}
WITH_GPU=${LAYOUT_GPU:-1}
WITH_TORCH=${LAYOUT_TORCH:-0}
say() { echo "gpu-mixed-layout: $*" >&2; }

BUILD=build-bench-gpu
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCCALLOC_MINIMAL=ON -DCCALLOC_WITH_CUDA=ON \
         >"$OUT/build.log" 2>&1 && cmake --build "$BUILD" --target bench_gpu bench_count >>"$OUT/build.log" 2>&1; }; then
  say "did not build:"; tail -n 30 "$OUT/build.log" >&2; exit 1
fi
COUNT=$BUILD/bench/bench_count
GPU=$BUILD/bench/gpu/bench_gpu
TORCH=build-bench-torch/bench_torch
if [ "$WITH_TORCH" != 0 ] && ! scripts/gpu/build-bench-torch.sh "$OUT/build.log"; then
  say "bench_torch did not build: PyTorch's column stays empty"; WITH_TORCH=0
fi

NORAND=()
if setarch "$(uname -m)" -R true 2>/dev/null; then NORAND=(setarch "$(uname -m)" -R); else say "no setarch -R: those runs are plain"; fi
{
  lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA|L1d|L2|L3|CPU max MHz|Hypervisor)'
  echo "siblings of cpu0..3: $(for c in 0 1 2 3; do cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null; done | tr '\n' ' ')"
  echo "randomize_va_space: $(cat /proc/sys/kernel/randomize_va_space 2>/dev/null)"
  echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
  echo "processes using CPU:"; top -bn1 2>/dev/null | sed -n 1,15p
} >"$OUT/host.txt" 2>&1

vmstat 1 >"$OUT/vmstat.log" 2>&1 &
VMSTAT=$!
trap 'kill $VMSTAT 2>/dev/null' EXIT

ns_of() { grep -oE 'ns_per_(op|pair)=[0-9.]+' | head -1 | cut -d= -f2; }
: >"$OUT/layout.log"
for r in $(seq 1 "$ROUNDS"); do
  for mode in plain norand; do
    pre=()
    [ "$mode" = norand ] && pre=("${NORAND[@]}")
    m=$(CCALLOC_CONF=$CONF "${pre[@]}" "$COUNT" mixed "$STEPS" 2>&1 | tee -a "$OUT/layout.log" | ns_of)
    p=$(CCALLOC_CONF=$CONF "${pre[@]}" "$COUNT" pair 10000000 2>&1 | tee -a "$OUT/layout.log" | ns_of)
    g=-
    if [ "$WITH_GPU" != 0 ]; then
      g=$(timeout 120 "${pre[@]}" "$GPU" --only=ccalloc --cases=mixed --reps=5 2>&1 | tee -a "$OUT/layout.log" |
          grep -E '^RESULT allocator=ccalloc case=mixed' | ns_of)
    fi
    t=-
    if [ "$WITH_TORCH" != 0 ]; then
      t=$(timeout 120 "${pre[@]}" "$TORCH" --cases=mixed --reps=5 2>&1 | tee -a "$OUT/layout.log" |
          grep -E '^RESULT allocator=torch case=mixed' | ns_of)
    fi
    echo "ROUND $r $mode sim_mixed=${m:--} sim_pair=${p:--} gpu_mixed=${g:--} torch_mixed=${t:--} t=$(date -u +%T)" | tee -a "$OUT/layout.log"
  done
done
kill $VMSTAT 2>/dev/null

{
  echo "# mixed case: simulated device (CCALLOC_CONF='$CONF') vs CUDA backend, ASLR on/off ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
  echo
  cat "$OUT/host.txt"
  echo
  echo "| round | mode | sim mixed ns | sim pair ns | gpu mixed ns | PyTorch mixed ns | ccalloc / PyTorch | time |"
  echo "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"
  grep '^ROUND' "$OUT/layout.log" |
    sed -E 's/^ROUND ([0-9]+) ([a-z]+) sim_mixed=([^ ]*) sim_pair=([^ ]*) gpu_mixed=([^ ]*) torch_mixed=([^ ]*) t=(.*)$/\1 \2 \3 \4 \5 \6 \7/' |
    awk '{ r = ($5 ~ /^[0-9.]+$/ && $6 ~ /^[0-9.]+$/ && $6 > 0) ? sprintf("%.3f", $5 / $6) : "-";
           printf "| %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, r, $7 }'
  echo
  echo "vmstat (us sy id wa st), every second:"
  awk 'NR > 2 { printf "%s/%s/%s/%s/%s ", $13, $14, $15, $16, $17 } END { print "" }' "$OUT/vmstat.log"
} >"$OUT/layout-summary.md"
cat "$OUT/layout-summary.md"

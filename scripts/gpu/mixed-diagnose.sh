#!/usr/bin/env bash
# Why the mixed case measures ~150 ns in some runs and ~250-300 ns
# in others on the H200 host: runs bench_gpu's pair and mixed cases (ccalloc
# through the C++ API and the C API) several times unpinned, then pinned to
# one CPU, with the CPU's own counters per step (bench/gpu/hw_counters.hpp:
# PERF lines), the driver calls the allocator made and their host time
# (bench/gpu/timed_backend.hpp: INFO lines), and the host's CPU layout;
# each run under the default configuration and with plain segments.
#
# Usage: scripts/gpu/mixed-diagnose.sh OUT_DIR
#   DIAG_RUNS  runs per placement (default 3)
#   DIAG_CPU   the CPU to pin to (default 2)
#   DIAG_SETTINGS  gpu-hotpath.sh's HOTPATH_SETTINGS (default: the default
#                  configuration, then expandable_segments:False)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: scripts/gpu/mixed-diagnose.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RUNS=${DIAG_RUNS:-3}
CPU=${DIAG_CPU:-2}
{
  echo "## host"
  lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA|L1d|L2|L3|CPU max MHz)' 
  echo "governor: $(cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null || echo n/a)"
  echo "perf_event_paranoid: $(cat /proc/sys/kernel/perf_event_paranoid 2>/dev/null || echo n/a)"
  echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo n/a)"
  echo "allowed CPUs: $(grep Cpus_allowed_list /proc/self/status)"
} >"$OUT/host.txt" 2>&1
cat "$OUT/host.txt"
for placement in free pinned; do
  for r in $(seq 1 "$RUNS"); do
    pin=""
    [ "$placement" = pinned ] && pin=$CPU
    HOTPATH_SETTINGS=${DIAG_SETTINGS:-'|;expandable_segments:False|'} HOTPATH_CASES=pair,mixed HOTPATH_PIN=$pin HOTPATH_REPS=7 \
      scripts/gpu/hotpath.sh "$OUT/$placement-$r" >/dev/null 2>"$OUT/$placement-$r.err"
    echo "### $placement run $r"
    for f in "$OUT/$placement-$r"/hotpath-*.log; do
      head -1 "$f"
      grep -E '^(RESULT|PERF|INFO allocator)' "$f" | grep -E 'mixed|size=512 ' | sed -E 's/ (reps|pairs_per_rep)=[^ ]*//g'
    done
  done
done | tee "$OUT/diagnose-summary.md"

# Order and time in the process: each API alone, the mixed case 4 times in a
# row (does a case run later in the process measure faster?). DIAG_ORDER=0 skips.
if [ "${DIAG_ORDER:-1}" != 0 ]; then
  B=build-bench-gpu/bench/gpu/bench_gpu
  for r in $(seq 1 "$RUNS"); do
    for only in ccalloc_c ccalloc; do
      echo "### alone: $only, run $r, --mixed-repeats=4"
      timeout 150 "$B" --only=$only --cases=mixed --mixed-repeats=4 --reps=7 2>&1 |
        grep -E '^(RESULT|PERF)' | sed -E 's/ (reps|pairs_per_rep)=[^ ]*//g; s/ (cycles|instructions|branch_misses|l1d_misses|llc_misses|dtlb_misses)=unavailable//g'
    done
  done | tee -a "$OUT/diagnose-summary.md"
fi

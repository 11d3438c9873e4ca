#!/usr/bin/env bash
# The hot path on a real GPU under several settings: builds
# bench_gpu (Release, standard library + CUDA only) and runs its ccalloc
# cases once per setting, with the counters each case moved (pages mapped,
# unmapped, remapped; device synchronizations: bench_gpu's INFO lines), then
# profiles the mixed case with perf when the machine has it.
#
# Usage: scripts/gpu/hotpath.sh OUT_DIR
#   HOTPATH_SETTINGS  ';'-separated settings, each "CONF|THREAD_CACHE" where
#                     CONF goes to CCALLOC_CONF and THREAD_CACHE to
#                     CCALLOC_THREAD_CACHE (empty: unset). Default: the
#                     default configuration, then recycles_per_peak:4, each
#                     with the thread cache off and on.
#   HOTPATH_CASES     bench_gpu --cases (default: pair,mixed,churn,threads)
#   HOTPATH_REPS      bench_gpu --reps (default 5)
#   HOTPATH_PIN       a CPU list for taskset (e.g. 2): every run of bench_gpu
#                     stays on those CPUs (default: unpinned)
#   HOTPATH_ONLY      bench_gpu --only (default: ccalloc,ccalloc_c: the C++ API
#                     and the C API through libccalloc.so; ccalloc_c runs the
#                     pair and mixed cases)
# Writes OUT_DIR/hotpath-N.log per setting, OUT_DIR/perf-mixed.txt, and a
# OUT_DIR/bench_vm.log (bench_vm: driver virtual memory calls per page), and a
# summary (printed last) in OUT_DIR/hotpath-summary.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: scripts/gpu/hotpath.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SETTINGS=${HOTPATH_SETTINGS:-"|;|1;recycles_per_peak:4|;recycles_per_peak:4|1"}
CASES=${HOTPATH_CASES:-pair,mixed,churn,threads}
REPS=${HOTPATH_REPS:-5}
ONLY=${HOTPATH_ONLY:-ccalloc,ccalloc_c}
PIN=()
if [ -n "${HOTPATH_PIN:-}" ]; then PIN=(taskset -c "$HOTPATH_PIN"); fi
say() { echo "gpu-hotpath: $*" >&2; }

BUILD=build-bench-gpu
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCCALLOC_MINIMAL=ON -DCCALLOC_WITH_CUDA=ON \
         >"$OUT/build.log" 2>&1 && cmake --build "$BUILD" --target bench_gpu bench_vm >>"$OUT/build.log" 2>&1; }; then
  say "bench_gpu did not build:"; tail -n 30 "$OUT/build.log" >&2; exit 1
fi

i=0
IFS=';' read -r -a list <<<"$SETTINGS"
for setting in "${list[@]}"; do
  i=$((i + 1))
  conf=${setting%%|*}
  tc=${setting#*|}
  say "setting $i: CCALLOC_CONF='$conf' CCALLOC_THREAD_CACHE='$tc'"
  (
    if [ -n "$conf" ]; then export CCALLOC_CONF=$conf; else unset CCALLOC_CONF; fi
    if [ -n "$tc" ]; then export CCALLOC_THREAD_CACHE=$tc; else unset CCALLOC_THREAD_CACHE; fi
    echo "SETTING conf='$conf' thread_cache='$tc'"
    timeout 150 "${PIN[@]}" "$BUILD/bench/gpu/bench_gpu" --only="$ONLY" --cases="$CASES" --reps="$REPS"
  ) >"$OUT/hotpath-$i.log" 2>&1
done

say "bench_vm: the driver's virtual memory calls per page"
timeout 60 "$BUILD/bench/gpu/bench_vm" 32 7 >"$OUT/bench_vm.log" 2>&1

if command -v perf >/dev/null 2>&1; then
  say "perf of the mixed case (default setting)"
  ( unset CCALLOC_CONF CCALLOC_THREAD_CACHE
    timeout 120 perf record -g -o "$OUT/perf-mixed.data" "$BUILD/bench/gpu/bench_gpu" --only=ccalloc --cases=mixed \
      --reps=9 >/dev/null 2>&1
    perf report -i "$OUT/perf-mixed.data" --no-children --stdio 2>/dev/null | grep '%' | head -80 >"$OUT/perf-mixed.txt"
    rm -f "$OUT/perf-mixed.data" )
else
  echo "no perf on this machine" >"$OUT/perf-mixed.txt"
fi

{
  echo "# bench_gpu, ccalloc only, per setting ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
  echo
  echo "## bench_vm (driver virtual memory calls, per page)"
  grep -E '^(INFO|RESULT)' "$OUT/bench_vm.log"
  for f in "$OUT"/hotpath-*.log; do
    echo
    echo "## $(head -1 "$f")"
    grep -E '^(RESULT|INFO allocator|PERF|ERROR)' "$f" | sed -E 's/ (min_ns|max_ns|reps|pairs_per_rep|pairs|seconds)=[^ ]*//g'
  done
} >"$OUT/hotpath-summary.md"
cat "$OUT/hotpath-summary.md"

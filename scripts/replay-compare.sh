#!/usr/bin/env bash
# Before/after check for a change that must not change behaviour:
#
#   scripts/replay-compare.sh save DIR [BUILD_DIR]   writes DIR/<trace>.<config>.r<repeat>.lag<lag>.json
#                                                    and DIR/callgrind.txt
#   scripts/replay-compare.sh check DIR [BUILD_DIR]  runs again and compares with DIR
#
# Replay: every trace in $TRACES (default /work/shared/traces/*.trace.gz),
# in each configuration of $CONFIGS (default: "default", plain segments and
# the PyTorch policy; "default" is no --config), at each --repeat of
# $REPEATS (default "1 4") and each --device-lag of $LAGS (default "0 10"):
# `ccalloc replay TRACE --json`. Fields that measure time (any key ending in
# "seconds") are dropped; everything else must be byte-identical.
#
# (REPLAY=0 skips the replays.) Instructions (unless CALLGRIND=0): `bench_count pair|mixed N` under
# callgrind, N = $CG_N (default 100000) minus N = 0, divided by N, with
# CCALLOC_CONF=recycle_time_percent:100 (no clock: deterministic) and
# BENCH_COUNT_CAPACITY_GB=8 (the reservation fits under valgrind). `check`
# prints before, after and the change, and fails when one moves by more
# than $CG_TOLERANCE percent (default 1).
#
# BUILD_DIR (default build) must hold the targets ccalloc and bench_count (bench/bench_count).
# Exit status 1 when anything differs.
set -euo pipefail
mode=${1:?save|check}
dir=${2:?directory}
build=${3:-build}
traces=${TRACES:-/work/shared/traces/*.trace.gz}
configs=${CONFIGS:-default expandable_segments:False expandable_segments:False,trim_on_new_peak:False,reuse_across_streams:False}
mkdir -p "$dir"
strip_times() { python3 -c '
import json, sys
def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if not k.endswith("seconds")}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x
print(json.dumps(strip(json.load(sys.stdin)), indent=1, sort_keys=True))'; }
status=0
same=0
[ "${REPLAY:-1}" = 0 ] && traces=""
for t in $traces; do
  name=$(basename "$t" .trace.gz)
  for conf in $configs; do
    tag=${conf//[:,]/_}
    if [ "$conf" = default ]; then args=(); else args=(--config "$conf"); fi
    for repeat in ${REPEATS:-1 4}; do
      for lag in ${LAGS:-0 10}; do
        file="$dir/$name.$tag.r$repeat.lag$lag.json"
        out=$("$build/ccalloc" replay "$t" --json --repeat "$repeat" --device-lag "$lag" "${args[@]}" | strip_times)
        if [ "$mode" = save ]; then
          printf '%s\n' "$out" > "$file"
        elif ! diff -q <(printf '%s\n' "$out") "$file" > /dev/null; then
          echo "DIFFERS: $name $conf --repeat $repeat --device-lag $lag"; status=1
        else
          same=$((same + 1))
        fi
      done
    done
  done
done
[ "$mode" = check ] && [ "${REPLAY:-1}" != 0 ] && echo "replay: $same identical"

if [ "${CALLGRIND:-1}" != 0 ]; then
  n=${CG_N:-100000}
  count() {  # instructions of `bench_count CASE N`
    local f; f=$(mktemp)
    CCALLOC_CONF=recycle_time_percent:100 BENCH_COUNT_CAPACITY_GB=8 \
      valgrind --tool=callgrind --callgrind-out-file="$f" "$build/bench/bench_count" "$1" "$2" > /dev/null 2>&1
    callgrind_annotate "$f" 2> /dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }'
    rm -f "$f"
  }
  figures=""
  for c in pair mixed; do
    per=$(python3 -c "print(f'{($(count "$c" "$n") - $(count "$c" 0)) / $n:.2f}')")
    figures+="$c $per"$'\n'
  done
  if [ "$mode" = save ]; then
    printf '%s' "$figures" > "$dir/callgrind.txt"
  else
    while read -r c per; do
      [ -n "$c" ] || continue
      before=$(awk -v c="$c" '$1 == c { print $2 }' "$dir/callgrind.txt")
      verdict=$(python3 -c "d = ($per - $before) / $before * 100; print(f'{d:+.2f} %', 'ok' if abs(d) <= ${CG_TOLERANCE:-1} else 'MOVED')")
      echo "callgrind $c: before $before after $per instructions a step: $verdict"
      case $verdict in *MOVED) status=1 ;; esac
    done <<< "$figures"
  fi
fi
exit $status

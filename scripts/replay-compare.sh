#!/usr/bin/env bash
# Replay figures before/after a change that must not change placement:
#
#   scripts/replay-compare.sh save DIR [CCALLOC_BINARY]   writes DIR/<trace>.<config>.json
#   scripts/replay-compare.sh check DIR [CCALLOC_BINARY]  replays again and diffs against DIR
#
# Every trace in $TRACES (default /work/shared/traces/*.trace.gz), in each
# configuration of $CONFIGS (default: "default expandable_segments:False";
# "default" is no --config), `ccalloc replay TRACE --json --repeat 2
# --config CONF` (the CLI reads its configuration from --config only, never
# from CCALLOC_CONF). Fields that measure time (any key ending in
# "seconds") are dropped before comparing; everything else must be
# byte-identical. Exit status 1 when any file differs.
set -euo pipefail
mode=${1:?save|check}
dir=${2:?directory}
bin=${3:-build/ccalloc}
traces=${TRACES:-/work/shared/traces/*.trace.gz}
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
for t in $traces; do
  name=$(basename "$t" .trace.gz)
  for conf in ${CONFIGS:-default expandable_segments:False}; do
    tag=${conf//:/_}
    if [ "$conf" = default ]; then args=(); else args=(--config "$conf"); fi
    out=$("$bin" replay "$t" --json --repeat 2 "${args[@]}" | strip_times)
    if [ "$mode" = save ]; then
      printf '%s\n' "$out" > "$dir/$name.$tag.json"
    elif ! diff -q <(printf '%s\n' "$out") "$dir/$name.$tag.json" > /dev/null; then
      echo "DIFFERS: $name $conf"; status=1
    else
      echo "same: $name $conf"
    fi
  done
done
exit $status

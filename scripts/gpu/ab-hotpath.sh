#!/usr/bin/env bash
# A/B of the hot path on one GPU machine: the host of the H200 moves the
# mixed case by up to 2x between runs (docs/perf.md), so a change is judged against the tree it replaces in
# the same call, with the two builds' runs interleaved (A B A B ...).
#
# Usage: scripts/gpu/ab-hotpath.sh BASE_SRC OUT_DIR
#   BASE_SRC  a source tree of the base revision (e.g. `git archive REV | tar
#             -x -C build-ab-base`, carried to the device as an ignored path)
#   AB_ROUNDS rounds of (base, this tree) (default 4)
#   AB_CASES  bench_gpu --cases (default pair,mixed)
#   AB_REPS   bench_gpu --reps (default 7)
# Prints one line per run: which tree, then bench_gpu's RESULT lines; the
# logs go to OUT_DIR/ab-logs.tar.xz.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
BASE=${1:?usage: scripts/gpu/ab-hotpath.sh BASE_SRC OUT_DIR}
OUT_DIR=${2:?usage: scripts/gpu/ab-hotpath.sh BASE_SRC OUT_DIR}
ROUNDS=${AB_ROUNDS:-4}
CASES=${AB_CASES:-pair,mixed}
REPS=${AB_REPS:-7}
mkdir -p "$OUT_DIR"
W=$(mktemp -d)
build() {  # SRC BUILD_DIR
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCCALLOC_MINIMAL=ON -DCCALLOC_WITH_CUDA=ON \
    >"$W/$(basename "$2").build.log" 2>&1 &&
    cmake --build "$2" --target bench_gpu >>"$W/$(basename "$2").build.log" 2>&1
}
build "$BASE" "$PWD/build-ab-a" || { echo "base did not build"; tail -20 "$W/build-ab-a.build.log"; exit 1; }
build . "$PWD/build-ab-b" || { echo "this tree did not build"; tail -20 "$W/build-ab-b.build.log"; exit 1; }
unset CCALLOC_CONF CCALLOC_THREAD_CACHE
for r in $(seq 1 "$ROUNDS"); do
  for t in a b; do
    log="$W/round$r-$t.log"
    timeout 120 "build-ab-$t/bench/gpu/bench_gpu" --only=ccalloc --cases="$CASES" --reps="$REPS" >"$log" 2>&1
    rc=$?  # before the command substitution below, which sets $? of its own
    echo "== round $r tree $t ($([ $t = a ] && echo base || echo this)) rc=$rc"
    grep -E '^RESULT' "$log" | sed -E 's/ (min_ns|max_ns|reps|pairs_per_rep|pairs|seconds)=[^ ]*//g'
  done
done
tar cJf "$OUT_DIR/ab-logs.tar.xz" -C "$W" .

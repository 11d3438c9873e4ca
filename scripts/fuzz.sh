#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang with ASan + UBSan) and runs each
# for a while (SPEC R3). CI (scripts/test.sh) runs it briefly; run it longer
# by hand to search harder.
#
# Usage: scripts/fuzz.sh [SECONDS [TARGET...]]
#   SECONDS  per target (default 60)
#   TARGET   names from fuzz/corpus/ (default: all of them), e.g. config trace_text
# Environment: FUZZ_BUILD (default build-fuzz), CXX (default clang++).
#
# Each target starts from its seed corpus fuzz/corpus/NAME (read only) and
# writes what it finds to $FUZZ_BUILD/corpus/NAME, crashes to
# $FUZZ_BUILD/artifacts/NAME/. To keep a crashing input as a regression
# input, fix the bug, then copy the file into fuzz/corpus/NAME/ (CTest runs
# every seed once: fuzz_NAME_corpus). Prints each target's final libFuzzer
# figures. Exit status: 1 if any target crashed, timed out or leaked.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
SECONDS_EACH=${1:-60}
shift || true
BUILD=${FUZZ_BUILD:-build-fuzz}
CXX_COMPILER=${CXX:-clang++}
if [ $# -gt 0 ]; then
  TARGETS=("$@")
else
  TARGETS=()
  for d in fuzz/corpus/*/; do TARGETS+=("$(basename "$d")"); done
fi

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$CXX_COMPILER" \
  -DCCALLOC_BUILD_FUZZERS=ON -DCCALLOC_BUILD_TESTS=OFF -DCCALLOC_BUILD_TOOLS=OFF -DCCALLOC_BUILD_BENCH=OFF \
  -DCCALLOC_WITH_CUDA=OFF -DCCALLOC_WARNINGS_AS_ERRORS=ON >/dev/null
cmake --build "$BUILD" --target "${TARGETS[@]/#/fuzz_}"
build_abs=$(cd "$BUILD" && pwd)

failed=()
for name in "${TARGETS[@]}"; do
  work="$BUILD/corpus/$name"
  artifacts="$BUILD/artifacts/$name/"
  mkdir -p "$work" "$artifacts"
  work_abs=$(cd "$work" && pwd)
  args=(-max_total_time="$SECONDS_EACH" -timeout=10 -print_final_stats=1 -artifact_prefix="$(cd "$artifacts" && pwd)/")
  [ -f "fuzz/dict/$name.dict" ] && args+=(-dict="$root/fuzz/dict/$name.dict")
  echo "fuzz.sh: fuzz_$name for $SECONDS_EACH s (seeds fuzz/corpus/$name, new inputs $work)"
  log="$BUILD/fuzz_$name.log"
  # From a scratch folder: whatever a target writes by accident (a file an
  # input names) lands there, not in the checkout.
  scratch="$BUILD/scratch/$name"
  mkdir -p "$scratch"
  if (cd "$scratch" && "$build_abs/fuzz/fuzz_$name" "${args[@]}" "$work_abs" "$root/fuzz/corpus/$name") >"$log" 2>&1; then
    grep -E '^#[0-9]+[[:space:]]+(INITED|DONE)|^Done [0-9]+ runs|^stat::' "$log" || tail -n 5 "$log"
  else
    echo "fuzz.sh: fuzz_$name FAILED (log $log); last lines:"
    tail -n 40 "$log"
    failed+=("$name")
  fi
done
if ((${#failed[@]})); then
  echo "fuzz.sh: failed: ${failed[*]} (inputs in $BUILD/artifacts/)"
  exit 1
fi
echo "fuzz.sh: ${#TARGETS[@]} target(s), $SECONDS_EACH s each, no crash"

#!/usr/bin/env bash
# README command 2 (and CI): build and run every test that needs no GPU
# (CTest label `gpu` is skipped), in four stages:
#   plain  warnings as errors, every test (build-test)
#   asan   AddressSanitizer + UndefinedBehaviorSanitizer (gcc; UB aborts the
#          test: -fno-sanitize-recover), every test but the benchmarks, which
#          are not built (build-asan); SPEC R1
#   tsan   ThreadSanitizer, only the concurrent tests (CTest label
#          `concurrent`: tests/concurrency_test.cpp, tests/stress_test.cpp)
#          and only their program is built (build-tsan); SPEC R1
#   fuzz   the libFuzzer targets (clang), each run CCALLOC_FUZZ_SECONDS
#          (default 60) from its seed corpus; a crash fails (scripts/fuzz.sh,
#          build-fuzz); SPEC R3
# CCALLOC_TEST_STAGES picks stages (default "plain asan tsan fuzz"), e.g.
#   CCALLOC_TEST_STAGES=plain scripts/test.sh
# Exit status: that of the first stage that failed; later stages do not run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh

STAGES=${CCALLOC_TEST_STAGES:-plain asan tsan fuzz}
JOBS=$(nproc)
CONFIGURE=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCCALLOC_WARNINGS_AS_ERRORS=ON)
SUMMARY=()
# Sanitizer reports stop the program with a stack trace (UBSan: no recovery).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}

run_stage() {  # name command...
  local name=$1 start=$SECONDS
  shift
  echo "test.sh: stage $name"
  "$@"
  SUMMARY+=("$name $((SECONDS - start)) s")
}

plain() {
  cmake -S . -B build-test "${CONFIGURE[@]}" >/dev/null
  cmake --build build-test -j "$JOBS"
  ctest --test-dir build-test --output-on-failure -LE gpu -j "$JOBS"
}

asan() {
  # Internal invariants (CCALLOC_ASSERT) and the per-structure checks at
  # state transitions (CCALLOC_ASSERT_EXPENSIVE) are checked here too.
  cmake -S . -B build-asan "${CONFIGURE[@]}" -DCCALLOC_SANITIZE=address,undefined -DCCALLOC_BUILD_BENCH=OFF \
    -DCCALLOC_ENABLE_ASSERTS=ON -DCCALLOC_ENABLE_EXPENSIVE_ASSERTS=ON >/dev/null
  cmake --build build-asan -j "$JOBS"
  # Not the install and Python tests: they load the instrumented library into
  # programs built without the sanitizers (an outside project, python3); the
  # plain stage runs them.
  ctest --test-dir build-asan --output-on-failure -LE "gpu|install|python" -j "$JOBS" --timeout 900
}

tsan() {
  cmake -S . -B build-tsan "${CONFIGURE[@]}" -DCCALLOC_SANITIZE=thread -DCCALLOC_BUILD_BENCH=OFF >/dev/null
  cmake --build build-tsan -j "$JOBS" --target ccalloc_concurrent_tests
  ctest --test-dir build-tsan --output-on-failure -L concurrent -j "$JOBS" --timeout 900
}

fuzz() {
  scripts/fuzz.sh "${CCALLOC_FUZZ_SECONDS:-60}"
}

for stage in $STAGES; do
  case $stage in
    plain | asan | tsan | fuzz) run_stage "$stage" "$stage" ;;
    *) echo "test.sh: unknown stage '$stage' (stages: plain asan tsan fuzz)" >&2; exit 2 ;;
  esac
done
echo "test.sh: all stages passed:"
printf '  %s\n' "${SUMMARY[@]}"

#!/usr/bin/env bash
# ccalloc as a drop-in for PyTorch on the GPU machine:
#   1. installs the package with the README's command (offline, no build
#      isolation: CMake builds libccalloc.so, torch's cpp_extension the C++
#      integration) into python3's environment (PYTHON=...; DROPIN_VENV=DIR
#      makes a fresh venv over its packages first: only where python3 is not
#      a venv itself, else torch is not seen there);
#   2. runs every item of scripts/gpu/pytorch_dropin.py in its own process: one
#      line `PASS item (...)` / `FAIL item: reason` / `SKIP item: reason` each
#      (DROPIN_ITEMS="a b" runs only those, DROPIN_ITEMS=none none of them);
#   3. GPT-2 (scripts/gpu/gpt2_allocators.py) on PyTorch's allocator, PyTorch's
#      with expandable_segments:True, and ccalloc, interleaved (GPT2_ROUNDS
#      rounds, default 2; GPT2_STEPS steps, default 30; 0 rounds skips it;
#      GPT2_SEQ the sequence length, default 512, and GPT2_SEQ_MIN, when set,
#      the shortest: each step's length is drawn from [GPT2_SEQ_MIN, GPT2_SEQ];
#      GPT2_AMP=bf16 trains with bf16 autocast, as the shared GPT-2 traces were;
#      GPT2_BATCH the batch size, default 8 (larger: the step is bound by
#      the GPU rather than by the host's enqueue);
#      GPT2_VARIANTS picks and orders the variants of each round, default
#      "native native-expandable ccalloc"; GPT2_EXPANDABLE_ROUNDS, when set,
#      runs native-expandable only in the first that many rounds, so more
#      rounds go to the step-time comparison of native and ccalloc).
#   4. scripts/gpu/history_stacks.py: frames of _record_memory_history(stacks=...)
#      and _memory_viz on ccalloc against PyTorch's allocator (HISTORY_STACKS=0 skips it).
# Output: the lines above and $OUT_DIR (default out/pytorch-dropin)/{install.log,
# items.log, gpt2-*.json, gpt2-compare.txt}. Exit status 1 when any item FAILed.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
OUT_DIR=${OUT_DIR:-out/pytorch-dropin}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
if [ -n "${DROPIN_VENV:-}" ]; then  # a fresh venv over $PY's packages (where $PY is no venv itself)
  rm -rf "$DROPIN_VENV"
  "$PY" -m venv --system-site-packages "$DROPIN_VENV" || exit 1
  PY=$DROPIN_VENV/bin/python3
fi
t0=$(date +%s)
# The README's command:
if ! "$PY" -m pip install -v --no-build-isolation . >"$OUT_DIR/install.log" 2>&1; then
  echo "FAIL install: pip install --no-build-isolation . failed (tail of $OUT_DIR/install.log):"
  tail -n 30 "$OUT_DIR/install.log"
  exit 1
fi
echo "PASS install ($(( $(date +%s) - t0 )) s; $(grep -c 'built the PyTorch integration' "$OUT_DIR/install.log") C++ integration build(s))"
cd /tmp  # import the installed package, not the checkout's python/
SCRIPTS=$REPO/scripts/gpu
FAILED=0
ITEMS=${DROPIN_ITEMS:-$("$PY" "$SCRIPTS/pytorch_dropin.py" --list)}
[ "$ITEMS" = none ] && ITEMS=""
for item in $ITEMS; do
  line=$(timeout "${ITEM_TIMEOUT:-150}" "$PY" "$SCRIPTS/pytorch_dropin.py" "$item" 2>>"$OUT_DIR/items.log" | grep -E '^(PASS|FAIL|SKIP) ' | tail -n 1)
  [ -z "$line" ] && line="FAIL $item: no result (crashed or timed out; see $OUT_DIR/items.log)"
  echo "$line"
  case $line in FAIL*) FAILED=1 ;; esac
done
# Stacks in the memory history against PyTorch's own allocator (HISTORY_STACKS=0 skips it).
if [ "${HISTORY_STACKS:-1}" != 0 ]; then
  timeout 600 "$PY" "$REPO/scripts/gpu/history_stacks.py" --out "$OUT_DIR/history-stacks" 2>>"$OUT_DIR/items.log" || FAILED=1
fi
cd "$REPO"
ROUNDS=${GPT2_ROUNDS:-2}
STEPS=${GPT2_STEPS:-30}
SEQ_ARGS=(--seq "${GPT2_SEQ:-512}" --batch "${GPT2_BATCH:-8}")
[ -n "${GPT2_SEQ_MIN:-}" ] && SEQ_ARGS+=(--seq-min "$GPT2_SEQ_MIN")
[ -n "${GPT2_AMP:-}" ] && SEQ_ARGS+=(--amp "$GPT2_AMP")
if [ "$ROUNDS" -gt 0 ]; then
  runs=()
  for r in $(seq 1 "$ROUNDS"); do
    for v in ${GPT2_VARIANTS:-native native-expandable ccalloc}; do
      f=$OUT_DIR/gpt2-$v-$r.json
      [ "$v" = native-expandable ] && [ -n "${GPT2_EXPANDABLE_ROUNDS:-}" ] && [ "$r" -gt "$GPT2_EXPANDABLE_ROUNDS" ] && continue
      case $v in
        native) env -u PYTORCH_CUDA_ALLOC_CONF "$PY" scripts/gpu/gpt2_allocators.py train --allocator native --steps "$STEPS" "${SEQ_ARGS[@]}" --out "$f" >>"$OUT_DIR/gpt2.log" 2>&1 ;;
        native-expandable) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$PY" scripts/gpu/gpt2_allocators.py train --allocator native --label native-expandable --steps "$STEPS" "${SEQ_ARGS[@]}" --out "$f" >>"$OUT_DIR/gpt2.log" 2>&1 ;;
        ccalloc) (cd /tmp && env -u PYTORCH_CUDA_ALLOC_CONF "$PY" "$SCRIPTS/gpt2_allocators.py" train --allocator ccalloc --steps "$STEPS" "${SEQ_ARGS[@]}" --out "$f") >>"$OUT_DIR/gpt2.log" 2>&1 ;;
      esac
      [ -s "$f" ] && runs+=("$f") || echo "gpt2: run $v $r failed (see $OUT_DIR/gpt2.log)"
    done
  done
  "$PY" scripts/gpu/gpt2_allocators.py compare "${runs[@]}" --json "$OUT_DIR/gpt2-compare.json" | tee "$OUT_DIR/gpt2-compare.txt"
fi
exit $FAILED

#!/usr/bin/env bash
# The GPU entry point: every check and measurement that needs an NVIDIA GPU
# (none of them runs in CI). Each stage is a script in scripts/gpu/ that
# says, at its top, what it builds and runs, what it writes and the
# environment variables it reads; this runs it from the checkout's root with
# the remaining arguments.
#
#   scripts/gpu.sh STAGE [ARGS...]
#
# Stages:
#   check           CUDA build, GPU tests, replay on cuda vs the simulated device,
#                   compute-sanitizer memcheck, then the bench stage    [OUT_DIR]
#   bench           bench_gpu (ccalloc, cudaMallocAsync, cudaMalloc) and bench_torch  OUT_DIR
#   pytorch         ccalloc as a drop-in for PyTorch: pip install, every item of
#                   scripts/gpu/pytorch_dropin.py, GPT-2 on each allocator   (OUT_DIR in env)
#   integrations    GPT-2 on ccalloc vs native, CuPy, the Python GPU tests, NCCL  [OUT_DIR]
#   ipc             IPC and multi-GPU tests (SPEC F25-F28)                     [OUT_DIR]
#   sleep-wake      the RL-style loop and pause/resume per GiB vs pinned copies  [OUT_DIR]
#   snapshots       snapshots both ways with PyTorch (SPEC E4, X8)   [OUT_DIR] [CCALLOC_BIN]
#   hotpath         the hot path's time under several settings                  OUT_DIR
#   ab-hotpath      A/B of the hot path against a base source tree     BASE_SRC OUT_DIR
#   mixed-layout    the mixed case in rounds, with and without a fixed layout   OUT_DIR
#   mixed-diagnose  the mixed case's spread by placement                        OUT_DIR
#   check-pytorch   check + pytorch (+ a new-user install) in one call         [OUT_DIR]
#   verify          check, then hotpath three times                             OUT_DIR
#   all             check, ab, integrations, snapshots, ipc in one call        [OUT_DIR]
#   open-issues     check (no benchmarks), sleep-wake, the drop-in items, with
#                   each step's output under OUT_DIR as it runs           [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
stages="check bench pytorch integrations ipc sleep-wake snapshots hotpath ab-hotpath mixed-layout mixed-diagnose check-pytorch verify all open-issues"
stage=${1:-}
if [ -z "$stage" ] || [[ " $stages " != *" $stage "* ]]; then
  echo "usage: scripts/gpu.sh STAGE [ARGS...]; stages: $stages" >&2
  exit 2
fi
shift
cd "$here/.."
exec "$here/gpu/$stage.sh" "$@"

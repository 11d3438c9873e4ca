#!/bin/sh
# The README's CLI quick start, run by the test suite (example_replay_quickstart)
# from a folder where build/ccalloc is the CLI and data/ the repository's data/.
set -e
build/ccalloc replay                      # the bundled GPT-2 training trace, next to PyTorch's figures
build/ccalloc replay data/traces/bert_copystream_infer.trace.gz   # ccalloc's format, an RMM log or a PyTorch snapshot pickle
build/ccalloc report data/traces/bert_copystream_infer.trace.gz -o report.html   # one HTML page with plots
build/ccalloc compare data/traces/bert_copystream_infer.trace.gz --config default --config expandable_segments:False

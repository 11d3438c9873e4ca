#!/bin/sh
# cli_nothing_to_replay.sh CCALLOC DIR PYTHON: inputs whose reader found or
# kept no event say why (0-byte RMM rows skipped, a snapshot without trace
# entries, a snapshot device without entries), and --snapshot-device on a
# text trace is refused. Prints each message and exit status; the test's
# PASS_REGULAR_EXPRESSION (tests/CMakeLists.txt) says what must hold.
ccalloc=$1
d=$2
python=$3
rm -rf "$d" && mkdir -p "$d" || exit 1
cd "$d" || exit 1
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000001,allocate,0x7f0000000000,0,0x0\n1,10:00:00.000002,free,0x7f0000000000,0,0x0\n' > zero.csv
"$python" -c 'import pickle, sys
pickle.dump({"segments": [], "device_traces": []}, open("none.pickle", "wb"), protocol=2)
pickle.dump({"segments": [], "device_traces": [[], [], []]}, open("empty3.pickle", "wb"), protocol=2)' || exit 1
printf '1 alloc 4096 512 0\n' > one.trace
for run in "zero.csv" "none.pickle" "empty3.pickle --snapshot-device 2" "one.trace --snapshot-device 1"; do
  # shellcheck disable=SC2086 # the options are split on purpose
  "$ccalloc" replay $run > /dev/null 2> err.txt
  echo "rc=$? $(grep -v '^ccalloc: note:' err.txt)"
done

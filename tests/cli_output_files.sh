#!/bin/sh
# cli_output_files.sh CCALLOC DIR CASE [PRELOAD]: the CLI's output files (report -o,
# replay --snapshot, --config oom_snapshot:) are written whole or not at
# all, through symbolic links without replacing them, and to FIFOs without
# handing the reader an end-of-file first. Prints what it finds; the test's
# PASS_REGULAR_EXPRESSION (tests/CMakeLists.txt) says what must hold.
ccalloc=$1
d=$2
rm -rf "$d" && mkdir -p "$d/x" || exit 1
cd "$d" || exit 1
printf '1 alloc 4096 512 0\n' > good.trace
printf '1 alloc 4096 512 0\n2 alocc 4096 512 0\n' > bad.trace
printf '1 alloc 4096 512 0\n2 alloc 8192 200000000000 0\n' > oom.trace
# A trace of 300 live blocks: a report and a snapshot of a few hundred KB.
awk 'BEGIN { for (i = 1; i <= 300; i++) print i " alloc " (i * 1048576) " 4096 0" }' > many.trace

# is_link NAME: "link" while NAME is still a symbolic link, else "gone".
is_link() { if [ -L "$1" ]; then echo link; else echo gone; fi; }
# reader OUT: starts `cat f > OUT` in the background and returns once cat
# waits in its open of the FIFO (it is cat and asleep; at most 2 s): from
# then on the FIFO has a reader.
reader() {
  cat f > "$1" &
  reader_pid=$!
  n=0
  while [ $n -lt 100 ]; do
    if [ "$(tr '\0' ' ' < "/proc/$reader_pid/cmdline" 2> /dev/null)" = "cat f " ] &&
       [ "$(cut -d' ' -f3 "/proc/$reader_pid/stat" 2> /dev/null)" = S ]; then
      return
    fi
    sleep 0.02
    n=$((n + 1))
  done
}
# reader_done: waits for the reader to end (at most 5 s; a writer that never
# opened the FIFO leaves it waiting in open: it is then stopped).
reader_done() {
  n=0
  while [ $n -lt 250 ] && kill -0 "$reader_pid" 2> /dev/null; do sleep 0.02; n=$((n + 1)); done
  kill "$reader_pid" 2> /dev/null
  wait "$reader_pid" 2> /dev/null
}
# exists NAME: "yes" or "no".
exists() { if [ -e "$1" ]; then echo yes; else echo no; fi; }

case $3 in
dangling_link)
  # A failed run leaves the link and creates nothing at its target; a run
  # that succeeds writes the target and keeps the link.
  ln -s "$d/x/r.html" r.html
  ln -s "$d/x/s.json" s.json
  ln -s "$d/x/o.pickle" o.pickle
  "$ccalloc" report bad.trace -o r.html > /dev/null 2>&1
  echo "report rc=$? $(is_link r.html) target=$(exists x/r.html)"
  "$ccalloc" replay bad.trace --snapshot s.json > /dev/null 2>&1
  echo "snapshot rc=$? $(is_link s.json) target=$(exists x/s.json)"
  "$ccalloc" replay good.trace --config oom_snapshot:o.pickle > /dev/null 2>&1
  echo "oom_snapshot rc=$? $(is_link o.pickle) target=$(exists x/o.pickle)"
  "$ccalloc" replay good.trace --snapshot s.json > /dev/null 2>&1
  echo "written rc=$? $(is_link s.json) target=$(exists x/s.json)"
  ;;
cut_off_write)
  # A file size limit stops the write part way: the old file stays whole,
  # with its mode, and no temporary file is left (the command ignores
  # SIGXFSZ itself: the write fails with EFBIG, and the error is said).
  printf 'old report\n' > keep.html
  printf 'old snapshot\n' > keep.json
  chmod 640 keep.html
  (ulimit -f 64; "$ccalloc" report many.trace --config expandable_segments:False -o keep.html) > /dev/null 2>&1
  echo "report rc=$? [$(head -c 20 keep.html)] $(ls -l keep.html | cut -c1-10)"
  (ulimit -f 64; "$ccalloc" replay many.trace --config expandable_segments:False --snapshot keep.json) > /dev/null 2>&1
  echo "snapshot rc=$? [$(head -c 20 keep.json)]"
  echo "files: $(ls | tr '\n' ' ')end"
  ;;
fifo)
  # A FIFO with a reader gets the whole output (the check before the run
  # does not open it); with no reader, an oom_snapshot there is not waited for.
  mkfifo f || { echo "no mkfifo: skipped"; exit 0; }
  reader report.out
  timeout 5 "$ccalloc" report good.trace -o f > /dev/null 2>&1
  echo "report rc=$?"
  reader_done
  echo "report bytes: $(head -c 15 report.out)"
  reader snapshot.out
  timeout 5 "$ccalloc" replay good.trace --snapshot f > /dev/null 2>&1
  echo "snapshot rc=$?"
  reader_done
  echo "snapshot bytes: $(head -c 12 snapshot.out)"
  reader oom.out
  timeout 5 "$ccalloc" replay oom.trace --allow-oom --config oom_snapshot:f > /dev/null 2>&1
  echo "oom_snapshot rc=$?"
  reader_done
  echo "oom_snapshot bytes: $(od -An -tx1 -N2 oom.out)"
  timeout 5 "$ccalloc" replay oom.trace --allow-oom --config oom_snapshot:f 2>&1 > /dev/null | grep -o 'oom_snapshot) could not be written to f: a FIFO with no reader'
  echo "no reader rc=$?"
  ;;
json_bytes)
  # A trace whose file name is not UTF-8 (legal on Linux): --json writes it
  # with U+FFFD in place of the bad byte, not an error after the replay.
  name="t$(printf '\377').trace"
  cp good.trace "$name"
  "$ccalloc" replay "$name" --json > out.json 2> err.txt
  echo "json rc=$? trace lines=$(grep -c '"trace": "t' out.json) errors=$(wc -c < err.txt)"
  ;;
report_bytes)
  # A trace name and a --title that are not UTF-8: the page (declared
  # UTF-8) shows U+FFFD in their place, still HTML-escaped.
  name="t$(printf '\377').trace"
  cp good.trace "$name"
  fffd=$(printf '\357\277\275')
  "$ccalloc" report "$name" -o a.html > /dev/null 2>&1
  echo "report rc=$? valid=$(iconv -f UTF-8 -t UTF-8 a.html > /dev/null 2>&1 && echo yes || echo no) title=$(grep -c "<title>ccalloc report: t$fffd\.trace</title>" a.html)"
  "$ccalloc" report "$name" --title "<b$(printf '\376')>" -o b.html > /dev/null 2>&1
  echo "titled rc=$? valid=$(iconv -f UTF-8 -t UTF-8 b.html > /dev/null 2>&1 && echo yes || echo no) title=$(grep -c "<title>ccalloc report: &lt;b$fffd&gt;</title>" b.html)"
  ;;
signal)
  # SIGTERM (SIGHUP for the oom_snapshot the library writes during the
  # replay) while an output file is being written (tests/pause_before_rename.c,
  # preloaded, holds the write just before its rename): the temporary file
  # is removed, the old file stays, and the process ends by the signal.
  printf 'old report\n' > keep.html
  printf 'old snapshot\n' > keep.json
  printf 'old pickle\n' > keep.pickle
  for out in "TERM report good.trace -o keep.html" "TERM replay good.trace --snapshot keep.json" \
             "HUP replay oom.trace --allow-oom --config oom_snapshot:keep.pickle"; do
    sig=${out%% *}
    out=${out#* }
    rm -f paused
    # shellcheck disable=SC2086
    CCALLOC_TEST_PAUSED=paused LD_PRELOAD=$4 "$ccalloc" $out > /dev/null 2>&1 &
    pid=$!
    n=0
    while [ ! -e paused ] && [ $n -lt 500 ]; do sleep 0.02; n=$((n + 1)); done
    held=$(ls | grep -c '\.tmp\.')
    kill -$sig $pid
    wait $pid 2> /dev/null
    echo "${out%% *} rc=$? paused=$(exists paused) held=$held left=$(ls | grep -c '\.tmp\.')"
  done
  echo "[$(cat keep.html)] [$(cat keep.json)] [$(cat keep.pickle)]"
  ;;
min_memory)
  # --min-memory with an oom_snapshot: the snapshot is of a replay on the
  # device 2 MiB below the smallest that fits, and a line says so; with no
  # such device nothing is written, and a line says why. 12 blocks of
  # 600,000 bytes, 2 of each 3 freed, then five of 2 MiB: fits in 16 MiB;
  # on 14 MiB the fifth 2 MiB block fails (4 fit: the snapshot, replayed,
  # peaks at 4 x 600,000 + 4 x 2 MiB = 10,788,608 bytes), on 12 MiB the
  # fourth (8,691,456).
  awk 'BEGIN { t = 1; for (i = 0; i < 12; i++) print t++ " alloc " (i * 1048576 + 4096) " 600000 0";
    for (i = 0; i < 12; i++) if (i % 3) { print t++ " free_requested " (i * 1048576 + 4096) " 600000 0";
      print t++ " free_completed " (i * 1048576 + 4096) " 600000 0" }
    for (i = 0; i < 5; i++) print t++ " alloc " (1000000000 + i * 4194304) " 2097152 0" }' > frag.trace
  "$ccalloc" replay frag.trace --min-memory --config oom_snapshot:o.pickle > out.txt 2> err.txt
  echo "search rc=$? $(grep -c '(16777216 B)' out.txt) $(cat err.txt)"
  "$ccalloc" replay o.pickle --json 2> /dev/null | grep -m1 '"peak_requested_bytes"'
  "$ccalloc" replay good.trace --min-memory --config oom_snapshot:g.pickle > /dev/null 2> err.txt
  echo "small rc=$? $(cat err.txt) file=$(exists g.pickle)"
  ;;
report_oom_snapshot)
  # report replays twice (the curves, then up to the peak for the segment
  # map): an out-of-memory before the peak writes the oom_snapshot once,
  # in the first replay (tests/pause_before_rename.c lists each output
  # renamed into place).
  printf '1 alloc 8192 200000000000 0\n2 alloc 4096 512 0\n' > early_oom.trace
  CCALLOC_TEST_RENAMES=renames.txt LD_PRELOAD=$4 "$ccalloc" report early_oom.trace --allow-oom \
    --config oom_snapshot:o.pickle -o r.html > /dev/null 2>&1
  echo "report rc=$? writes: $(tr '\n' ' ' < renames.txt)end"
  ;;
two_outputs)
  # Two outputs of one command naming one file are refused before the run
  # (the later write would replace the earlier), and nothing is written.
  "$ccalloc" replay oom.trace --allow-oom --config oom_snapshot:o.json --snapshot ./o.json > out.txt 2>&1
  echo "replay rc=$? $(grep -c 'oom_snapshot) and the snapshot name the same file' out.txt)"
  "$ccalloc" report oom.trace --config oom_snapshot:r.html -o r.html > out.txt 2>&1
  echo "report rc=$? $(grep -c 'oom_snapshot) and the report name the same file' out.txt)"
  "$ccalloc" compare oom.trace --config oom_snapshot:c.p --config "expandable_segments:False,oom_snapshot:$PWD/c.p" > out.txt 2>&1
  echo "compare rc=$? $(grep -c 'of configuration 1 and the out-of-memory snapshot (oom_snapshot) of configuration 2 name the same file' out.txt)"
  echo "files: $(ls | tr '\n' ' ')end"
  ;;
esac

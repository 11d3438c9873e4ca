#!/usr/bin/env python3
"""The figures `ccalloc replay` and `ccalloc report` print, read back and
checked against each other: the device calls add up (cudaMalloc + pages
created, cudaFree + pages released, pages created + remapped = mapped,
released + remapped = unmapped), the fragmentation is the printed peaks'
ratio (over unpaused blocks when tags were paused, so never below 1), and
report's segment count at the peak names what it counts.

    cli_figures_test.py CCALLOC_BIN SLEEP_WAKE_TRACE OUT_DIR
"""
import os
import re
import subprocess
import sys


def run(args):
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(args)} exited {p.returncode}: {p.stderr}")
    return p.stdout


def number(text):
    return int(text.replace(",", ""))


def rows(out):
    """label -> the rest of its line, for the replay's 'label  value' rows."""
    found = {}
    for line in out.splitlines():
        m = re.match(r"^([a-z][a-z ]*?)\s{2,}(\S.*)$", line)
        if m and m.group(1) not in found:
            found[m.group(1)] = m.group(2)
    return found


def check(cond, what, out):
    if not cond:
        sys.exit(f"FAIL: {what}\n--- output ---\n{out}")
    print(f"ok  : {what}")


def check_replay(out, paused):
    r = rows(out)
    req = number(re.match(r"([\d,]+) B", r["peak requested"]).group(1))
    res = number(re.match(r"([\d,]+) B", r["peak reserved"]).group(1))
    m = re.fullmatch(r"([\d,]+)  \(over the run: ([\d,]+) cudaMalloc, ([\d,]+) address-space reservations\)",
                     r["segments made"])
    check(m and number(m.group(1)) == number(m.group(2)) + number(m.group(3)),
          "segments made = cudaMalloc + reservations, over the run", out)
    cuda_mallocs = number(m.group(2))
    created = number(re.match(r"([\d,]+)", r["pages created"]).group(1))
    m = re.fullmatch(r"([\d,]+)  \(([\d,]+) cudaMalloc \+ ([\d,]+) pages created\)", r["device mallocs"])
    check(m and number(m.group(1)) == number(m.group(2)) + number(m.group(3))
          and number(m.group(2)) == cuda_mallocs and number(m.group(3)) == created,
          "device mallocs = cudaMalloc + pages created", out)
    m = re.fullmatch(r"([\d,]+)  \(([\d,]+) cudaFree \+ ([\d,]+) pages released\)", r["device frees"])
    check(m and number(m.group(1)) == number(m.group(2)) + number(m.group(3)),
          "device frees = cudaFree + pages released", out)
    released = number(m.group(3))
    m = re.fullmatch(r"([\d,]+)  \(([\d,]+) created \+ ([\d,]+) remapped\)", r["pages mapped"])
    check(m and number(m.group(1)) == number(m.group(2)) + number(m.group(3)) and number(m.group(2)) == created,
          "pages mapped = created + remapped", out)
    remapped = number(m.group(3))
    m = re.match(r"([\d,]+)  \(([\d,]+) released \+ ([\d,]+) remapped", r["pages unmapped"])
    check(m and number(m.group(1)) == number(m.group(2)) + number(m.group(3))
          and number(m.group(2)) == released and number(m.group(3)) == remapped,
          "pages unmapped = released + remapped, as device frees and pages mapped say", out)
    frag = float(re.match(r"([\d.]+)", r["fragmentation"]).group(1))
    if paused:
        check("peak unpaused" in r and "(blocks of paused tags included)" in r["peak requested"],
              "with pauses: the peaks say that they include paused blocks, and peak unpaused is printed", out)
        unpaused = number(re.match(r"([\d,]+) B", r["peak unpaused"]).group(1))
        check(r["fragmentation"].endswith("(peak reserved / peak unpaused)") and unpaused <= req
              and abs(frag - res / unpaused) < 0.0015,
              f"fragmentation {frag} = peak reserved / peak unpaused ({res} / {unpaused})", out)
    else:
        check("peak unpaused" not in r and abs(frag - res / req) < 0.0015,
              f"fragmentation {frag} = peak reserved / peak requested ({res} / {req})", out)
    check(frag >= 1.0, f"fragmentation {frag} is at least 1 (nothing reserved is less than what live blocks use)", out)
    return number(r["segments made"].split()[0])


def main():
    cli, sleep_trace, out_dir = sys.argv[1:4]
    os.makedirs(out_dir, exist_ok=True)
    # The bundled GPT-2 trace: pages moved between places, none released.
    made = check_replay(run([cli, "replay"]), paused=False)
    check(made == 2, "gpt2_train: 2 segments made (two reservations)", "")
    # Sleep and wake: paused blocks count as requested but hold no pages.
    check_replay(run([cli, "replay", "--device-memory", "1GiB", sleep_trace]), paused=True)
    # report: the segment map's count names mapped ranges and live segments.
    html = os.path.join(out_dir, "figures.html")
    out = run([cli, "report", "-o", html])
    m = re.search(r"\((\d+) mapped ranges of (\d+) live segments, ([\d,]+) blocks\)", out)
    check(m and int(m.group(1)) >= int(m.group(2)) and int(m.group(2)) <= made,
          "report: mapped ranges at the peak >= live segments <= replay's segments made", out)
    page = open(html, encoding="utf-8").read()
    check(f"{m.group(1)} mapped ranges in {m.group(2)} segments" in page,
          "report's page gives the same two counts", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

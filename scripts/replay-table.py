#!/usr/bin/env python3
"""Prints the per-trace markdown table of docs/perf.md: ccalloc's replay of each
trace (default config, and PyTorch's policies via trim_on_new_peak:False) next
to PyTorch's own figures from native_peaks.json.
usage: replay-table.py PATH_TO_CCALLOC TRACE_DIR [CONFIG ...]"""
import json, math, os, subprocess, sys

exe, tdir = sys.argv[1:3]
configs = sys.argv[3:] or ["", "trim_on_new_peak:False"]
peaks = json.load(open(os.path.join(tdir, "native_peaks.json")))
head = ["trace", "events"] + [f"ccalloc `{c or 'default'}`" for c in configs] + \
       ["PyTorch native", "PyTorch expandable", "replay s (default)"]
print("| " + " | ".join(head) + " |")
print("|" + " --- |" * len(head))
logs = {c: [] for c in configs + ["native", "expandable"]}
for name, ref in sorted(peaks.items()):
    req = ref["requested_peak"]
    row = [name, f"{ref['events']:,}"]
    secs = None
    for c in configs:
        cmd = [exe, "replay", os.path.join(tdir, name + ".trace.gz"), "--json"] + (["--config", c] if c else [])
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        assert r["peak_requested_bytes"] == req, (name, r["peak_requested_bytes"], req)
        f = r["peak_reserved_bytes"] / req
        logs[c].append(math.log(f))
        row.append(f"{f:.3f} ({r['peak_reserved_bytes'] / 2**30:.2f} GiB, {r['device_mallocs']} mallocs)")
        secs = secs if secs is not None else r["wall_seconds"]
    for key, col in (("native", "native_reserved_peak"), ("expandable", "native_expandable_reserved_peak")):
        f = ref[col] / req
        logs[key].append(math.log(f))
        row.append(f"{f:.3f} ({ref[col] / 2**30:.2f} GiB)")
    row.append(f"{secs:.3f}")
    print("| " + " | ".join(row) + " |")
geo = ["**geometric mean**", ""] + [f"**{math.exp(sum(v) / len(v)):.3f}**" for v in logs.values()] + [""]
print("| " + " | ".join(geo) + " |")

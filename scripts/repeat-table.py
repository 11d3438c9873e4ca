#!/usr/bin/env python3
"""Replays every trace of TRACE_DIR with `ccalloc replay
--repeat N` for N in PASSES (default 1 2 4) and prints, per trace and N, peak
reserved / peak requested (whole run), ccalloc's peak over PyTorch expandable's
(native_expandable_reserved_peak: PyTorch expandable's peak does not grow with
passes), device synchronizations, pages remapped in the last pass, and the
geometric mean of the ratios per N. Markdown with --markdown.
Exit status 1 when a P8 target is missed (ratio <= 1.03 everywhere, geometric
mean <= 1.01 at the largest N, below PyTorch expandable everywhere,
synchronizations at the largest N == at N=1, peak requested == PyTorch's).
With --device-lag L the simulated device runs L trace events behind the host
(`ccalloc replay --device-lag`), as a GPU does.
usage: repeat-table.py PATH_TO_CCALLOC TRACE_DIR [--config C] [--passes 1 2 4] [--device-lag L] [--markdown]"""
import argparse, json, math, os, subprocess, sys

ap = argparse.ArgumentParser()
ap.add_argument("exe")
ap.add_argument("tdir")
ap.add_argument("--config", default="")
ap.add_argument("--passes", type=int, nargs="+", default=[1, 2, 4])
ap.add_argument("--markdown", action="store_true")
ap.add_argument("--device-lag", type=int, default=0)
a = ap.parse_args()
peaks = json.load(open(os.path.join(a.tdir, "native_peaks.json")))
logs = {n: [] for n in a.passes}
missed = []
rows = []
for name, ref in sorted(peaks.items()):
    row = [name]
    syncs = {}
    for n in a.passes:
        cmd = [a.exe, "replay", os.path.join(a.tdir, name + ".trace.gz"), "--json", "--repeat", str(n)]
        if a.config:
            cmd += ["--config", a.config]
        if a.device_lag:
            cmd += ["--device-lag", str(a.device_lag)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        res, req = r["peak_reserved_bytes"], r["peak_requested_bytes"]
        f = res / req
        vs_exp = res / ref["native_expandable_reserved_peak"]
        logs[n].append(math.log(f))
        syncs[n] = r["device_synchronizations"]
        last = r["passes"][-1]
        row.append(f"{f:.3f} / {vs_exp:.3f}x / {syncs[n]} / {last['pages_remapped']}")
        if f > 1.03: missed.append(f"{name} x{n}: ratio {f:.3f} > 1.03")
        if vs_exp >= 1.0: missed.append(f"{name} x{n}: {vs_exp:.3f}x PyTorch expandable")
        if req != ref["requested_peak"] and n == 1:
            missed.append(f"{name}: peak requested {req} != PyTorch's {ref['requested_peak']}")
        if n == a.passes[-1] and syncs[n] != syncs[a.passes[0]]:
            missed.append(f"{name}: {syncs[n]} synchronizations at x{n} vs {syncs[a.passes[0]]} at x{a.passes[0]}")
    rows.append(row)
geo = {n: math.exp(sum(v) / len(v)) for n, v in logs.items()}
if geo[a.passes[-1]] > 1.01: missed.append(f"geometric mean at x{a.passes[-1]} {geo[a.passes[-1]]:.4f} > 1.01")
head = ["trace"] + [f"x{n}: ratio / vs expandable / syncs / remapped in last pass" for n in a.passes]
geo_row = ["geometric mean"] + [f"{geo[n]:.4f}" for n in a.passes]
if a.markdown:
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for r in rows + [geo_row]:
        print("| " + " | ".join(r) + " |")
else:
    w = [max(len(r[c]) for r in rows + [head, geo_row]) for c in range(len(head))]
    for r in [head] + rows + [geo_row]:
        print("  ".join(x.ljust(w[c]) for c, x in enumerate(r)))
print(f"config: {a.config or 'default'}" + (f", device lag {a.device_lag} events" if a.device_lag else ""))
for m in missed:
    print("missed:", m)
sys.exit(1 if missed else 0)

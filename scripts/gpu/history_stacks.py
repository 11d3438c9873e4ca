#!/usr/bin/env python3
"""Stacks in PyTorch's memory history: ccalloc against PyTorch's own allocator.

  history_stacks.py [--out DIR]     runs the same program twice per stacks
                                    mode ("python", "all"), once on PyTorch's
                                    allocator and once with ccalloc installed
                                    (ccalloc.torch.install(), the installed
                                    package), each in its own process, and
                                    compares; one line `PASS ...` / `FAIL ...`
                                    per mode, exit status 0 when all passed
  history_stacks.py one ALLOCATOR STACKS OUT.json    one run (native|ccalloc)

The program: torch.cuda.memory._record_memory_history(stacks=STACKS,
context="all"), tensors of distinct sizes made by named functions of this
file, some freed, then torch.cuda.memory._dump_snapshot. Checked, for each
size: the live block and its alloc entry carry frames with PyTorch's keys
(name, filename, line), and the innermost frame in this file names the same
function and line on both allocators; the free entries carry frames
(context="all"); torch.cuda._memory_viz's trace_plot and segment_plot read
both dumps, and the functions' names appear in the trace plot of ccalloc's
dump wherever they appear in PyTorch's. Needs a GPU, torch and the ccalloc
package; without torch it says so and exits with status 2.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1 << 20
SIZES_MIB = (3, 5, 7, 11)  # weights 3, 5; activations 7 (freed), 11 (kept)
NAMES = ("make_weight", "make_activation")


def make_weight(torch, n):
    return torch.empty(n * MiB, dtype=torch.uint8, device="cuda")


def make_activation(torch, n):
    return torch.empty(n * MiB, dtype=torch.uint8, device="cuda")


def program(torch):
    weights = [make_weight(torch, n) for n in (3, 5)]
    a = make_activation(torch, 7)
    b = make_activation(torch, 11)
    del a
    torch.cuda.synchronize()
    return weights, b


def innermost_here(frames):
    """(name, line) of the innermost frame in this file, or None."""
    for f in frames:
        if os.path.basename(f["filename"]) == os.path.basename(__file__):
            return [f["name"], f["line"]]
    return None


def summarize(data):
    """What the comparison reads from a dumped snapshot."""
    out = {"frame_keys": [], "blocks": {}, "alloc": {}, "free_requested": {}}
    keys = set()
    for seg in data["segments"]:
        for b in seg["blocks"]:
            for f in b.get("frames", []):
                keys.add(tuple(sorted(f)))
            mib = b["requested_size"] // MiB
            if b["state"] == "active_allocated" and b["requested_size"] % MiB == 0 and mib in SIZES_MIB:
                out["blocks"][str(mib)] = innermost_here(b.get("frames", []))
    for trace in data["device_traces"]:
        for e in trace:
            if e["action"] in ("alloc", "free_requested") and e["size"] % MiB == 0 and e["size"] // MiB in SIZES_MIB:
                for f in e.get("frames", []):
                    keys.add(tuple(sorted(f)))
                out[e["action"]][str(e["size"] // MiB)] = innermost_here(e.get("frames", []))
    out["frame_keys"] = sorted(list(k) for k in keys)
    return out


def one(allocator, stacks, out_path):
    if allocator == "ccalloc":
        import ccalloc.torch

        how = ccalloc.torch.install()
        if how != "native":
            raise SystemExit(f"ccalloc.torch.install() gave the {how!r} integration; stacks need the native one")
    import torch
    from torch.cuda import _memory_viz

    torch.cuda.init()
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks=stacks, context="all")
    kept = program(torch)
    path = Path(tempfile.mkdtemp()) / f"{allocator}-{stacks}.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
    del kept
    with open(path, "rb") as f:
        data = pickle.load(f)
    summary = summarize(data)
    trace_html = _memory_viz.trace_plot(data)
    segment_html = _memory_viz.segment_plot(data)
    summary["trace_plot_bytes"] = len(trace_html)
    summary["segment_plot_bytes"] = len(segment_html)
    summary["names_in_trace_plot"] = [n for n in NAMES if n in trace_html]
    summary["dump"] = str(path)
    Path(out_path).write_text(json.dumps(summary, indent=1))


def compare(stacks, native, ours):
    problems = []
    if ours["frame_keys"] != [["filename", "line", "name"]]:
        problems.append(f"ccalloc's frame keys are {ours['frame_keys']}, expected name, filename, line")
    for what in ("blocks", "alloc"):
        for mib in map(str, (3, 5, 11) if what == "blocks" else SIZES_MIB):
            theirs, mine = native[what].get(mib), ours[what].get(mib)
            if mine is None:
                problems.append(f"{what} of {mib} MiB: no frame of this file on ccalloc (PyTorch: {theirs})")
            elif theirs is not None and mine != theirs:
                problems.append(f"{what} of {mib} MiB: ccalloc names {mine}, PyTorch {theirs}")
    if ours["free_requested"].get("7") is None:
        problems.append(f"free_requested of 7 MiB: no frame of this file on ccalloc (PyTorch: "
                        f"{native['free_requested'].get('7')})")
    if ours["trace_plot_bytes"] < 1000 or ours["segment_plot_bytes"] < 1000:
        problems.append("_memory_viz wrote almost nothing for ccalloc's dump")
    missing = set(native["names_in_trace_plot"]) - set(ours["names_in_trace_plot"])
    if missing:
        problems.append(f"the trace plot of ccalloc's dump lacks {sorted(missing)}")
    if problems:
        return f"FAIL history_stacks[{stacks}]: " + "; ".join(problems)
    return (f"PASS history_stacks[{stacks}] (blocks {ours['blocks']}; the same innermost frames as PyTorch; "
            f"_memory_viz trace_plot {ours['trace_plot_bytes']} B, names {ours['names_in_trace_plot']})")


def main(argv):
    if len(argv) == 5 and argv[1] == "one":
        one(argv[2], argv[3], argv[4])
        return 0
    out_dir = Path(argv[argv.index("--out") + 1]) if "--out" in argv else Path(tempfile.mkdtemp())
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"FAIL history_stacks: torch is not importable here ({e}); run it where PyTorch and a GPU are")
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = False
    for stacks in ("python", "all"):
        results = {}
        for allocator in ("native", "ccalloc"):
            path = out_dir / f"{allocator}-{stacks}.json"
            env = dict(os.environ)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            run = subprocess.run([sys.executable, __file__, "one", allocator, stacks, str(path)], env=env,
                                 capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())
            if run.returncode != 0:
                tail = " ".join(run.stderr.strip().splitlines()[-3:])[:600]
                results[allocator] = f"the {allocator} run failed (status {run.returncode}): {tail}"
            else:
                results[allocator] = json.loads(path.read_text())
        if isinstance(results["native"], str) or isinstance(results["ccalloc"], str):
            why = "; ".join(r for r in results.values() if isinstance(r, str))
            line = f"FAIL history_stacks[{stacks}]: {why}"
        else:
            line = compare(stacks, results["native"], results["ccalloc"])
        print(line, flush=True)
        failed = failed or line.startswith("FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

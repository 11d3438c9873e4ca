#!/usr/bin/env python3
"""Merge bench_gpu / bench_torch output into SPEC P's side-by-side table.

Usage: summarize.py [--out FILE] LOG [LOG ...]

Reads the RESULT / ERROR / INFO lines that bench/gpu/harness.hpp prints, e.g.

    RESULT allocator=ccalloc case=pair size=512 ns_per_pair=41.2 ...
    RESULT allocator=torch case=threads threads=8 pairs_per_s=1.2e+06 ...

and writes markdown (stdout, and FILE with --out): SPEC P's table shape, a
per-case table with ratios ccalloc / each other allocator, and the P1-P3
targets. Standard library only.
"""

import argparse
import shlex
import sys

ALLOCATORS = [  # (key in the logs, column title)
    ("ccalloc", "ccalloc"),
    ("ccalloc_c", "ccalloc (C API, libccalloc.so)"),
    ("torch", "PyTorch native"),
    ("cudaMallocAsync", "cudaMallocAsync (pool kept)"),
    ("cub", "CUB caching"),
    ("cudaMalloc", "cudaMalloc"),
]
PAIR_SIZES = [512, 4 << 10, 1 << 20, 16 << 20, 256 << 20]
THREADS = [1, 2, 4, 8, 16]
P1_NS, P2_NS, P3_SCALE = 60.0, 150.0, 5.0


def parse_fields(line):
    fields = {}
    for tok in shlex.split(line)[1:]:
        if "=" in tok:
            k, v = tok.split("=", 1)
            fields[k] = v
    return fields


def read_logs(paths):
    results = {}  # (allocator, case key) -> float
    errors, info = [], []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
        except OSError as e:
            errors.append(f"{path}: {e.strerror}")
            continue
        for line in lines:
            line = line.strip()
            try:
                if line.startswith("RESULT "):
                    d = parse_fields(line)
                    a, case = d.get("allocator"), d.get("case")
                    if case == "pair":
                        results[(a, ("pair", int(d["size"])))] = float(d["ns_per_pair"])
                    elif case == "mixed":
                        results[(a, ("mixed",))] = float(d["ns_per_pair"])
                    elif case == "threads":
                        results[(a, ("threads", int(d["threads"])))] = float(d["pairs_per_s"])
                    elif case == "churn":
                        results[(a, ("churn",))] = float(d["ns_per_pair"])
                    elif case == "cross":
                        results[(a, ("cross",))] = float(d["pairs_per_s"])
                elif line.startswith("ERROR "):
                    errors.append(line[len("ERROR "):])
                elif line.startswith("INFO "):
                    info.append(line[len("INFO "):])
            except (ValueError, KeyError):
                errors.append(f"unparsable line in {path}: {line}")
    return results, errors, info


def size_text(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def ns_text(ns):
    if ns is None:
        return "-"
    if ns < 1000:
        return f"{ns:.0f} ns"
    if ns < 10000:
        return f"{ns / 1000:.2f} us"
    return f"{ns / 1000:.1f} us"


def rate_text(r):
    return "-" if r is None else f"{r / 1e6:.2f} M/s"


def ratio_text(mine, other):
    if mine is None or other is None or other == 0:
        return "-"
    return f"{mine / other:.3g}x"


def range_text(values):
    """SPEC's form for a range of times: "300-378 ns", "2.4-155 us"."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    if len(vals) == 1:
        return ns_text(lo)
    if hi < 1000:
        return f"{lo:.0f}-{hi:.0f} ns"
    if lo < 1000:
        return f"{lo:.0f} ns-{hi / 1000:.3g} us"
    return f"{lo / 1000:.2g}-{hi / 1000:.3g} us"


def render(results, errors, info):
    get = lambda a, k: results.get((a, k))
    present = [(k, t) for k, t in ALLOCATORS
               if any(a == k for a, _ in results) or any(f"allocator={k} " in e for e in errors)]
    if not present:
        present = ALLOCATORS[:1]
    out = ["# SPEC P: allocator benchmarks, one run", ""]
    for line in info:
        out.append(f"- {line}")
    if info:
        out.append("")

    # SPEC P's table shape.
    out.append("| case | " + " | ".join(t for _, t in present) + " |")
    out.append("| --- |" + " --- |" * len(present))
    row = ["alloc+free pair, 512 B .. 256 MiB, one thread"]
    for k, _ in present:
        row.append(range_text([get(k, ("pair", s)) for s in PAIR_SIZES]))
    out.append("| " + " | ".join(row) + " |")
    row = ["64 live blocks, random sizes 512 B - 64 MiB"]
    for k, _ in present:
        row.append(ns_text(get(k, ("mixed",))))
    out.append("| " + " | ".join(row) + " |")
    row = ["1 MiB pairs/s, 1/2/4/8/16 threads, own stream each"]
    for k, _ in present:
        vals = [get(k, ("threads", n)) for n in THREADS]
        row.append("-" if all(v is None for v in vals) else
                   "/".join("-" if v is None else f"{v / 1e6:.2f}" for v in vals) + " M")
    out.append("| " + " | ".join(row) + " |")
    out.append("")

    # Per case, with ratios ccalloc / other, every case (time: < 1 is ccalloc faster;
    # pairs/s: > 1 is ccalloc faster).
    others = [(k, t) for k, t in present if k != "ccalloc"]
    header = ["case", "ccalloc"]
    for _, t in others:
        header += [t, f"ccalloc / {t}"]
    out.append("Ratios are ccalloc / other: for times, below 1 means ccalloc is faster; "
               "for pairs/s, above 1 means ccalloc is faster.")
    out.append("")
    out.append("| " + " | ".join(header) + " |")
    out.append("| --- |" + " ---: |" * (len(header) - 1))
    cases = [(("pair", s), f"pair {size_text(s)}", ns_text) for s in PAIR_SIZES]
    cases.append((("mixed",), "mixed, 64 live", ns_text))
    cases += [(("threads", n), f"1 MiB pairs, {n} thread{'s' if n > 1 else ''}", rate_text) for n in THREADS]
    cases.append((("churn",), "churn, 8 live, 1-128 MiB (expandable: pages mapped and recycled)", ns_text))
    cases.append((("cross",), "1 MiB pairs, allocated by one thread, freed by another", rate_text))
    for key, title, fmt in cases:
        mine = get("ccalloc", key)
        row = [title, fmt(mine)]
        for k, _ in others:
            v = get(k, key)
            row += [fmt(v), ratio_text(mine, v)]
        out.append("| " + " | ".join(row) + " |")
    out.append("")

    # Targets.
    out.append("## SPEC P targets (ccalloc)")
    out.append("")
    pairs = [get("ccalloc", ("pair", s)) for s in PAIR_SIZES]
    if all(v is not None for v in pairs):
        worst = max(pairs)
        out.append(f"- P1 pair <= {P1_NS:.0f} ns at every size: worst {worst:.1f} ns -> "
                   f"{'PASS' if worst <= P1_NS else 'FAIL'}")
    else:
        out.append("- P1: missing pair results")
    mixed = get("ccalloc", ("mixed",))
    out.append(f"- P2 mixed <= {P2_NS:.0f} ns: " + (
        f"{mixed:.1f} ns -> {'PASS' if mixed <= P2_NS else 'FAIL'}" if mixed is not None else "missing"))
    c_pairs = [get("ccalloc_c", ("pair", s)) for s in PAIR_SIZES]
    c_mixed = get("ccalloc_c", ("mixed",))
    if all(v is not None for v in c_pairs) and c_mixed is not None:
        out.append(f"- through the C API (libccalloc.so): pairs worst {max(c_pairs):.1f} ns, "
                   f"mixed {c_mixed:.1f} ns")
    t1, t8 = get("ccalloc", ("threads", 1)), get("ccalloc", ("threads", 8))
    if t1 and t8:
        scale = t8 / t1
        out.append(f"- P3 8 threads >= {P3_SCALE:.0f}x one thread (issue 18 asks 6x): {scale:.2f}x "
                   f"({t8 / 1e6:.2f} M/s vs {t1 / 1e6:.2f} M/s) -> {'PASS' if scale >= P3_SCALE else 'FAIL'}")
    else:
        out.append("- P3: missing thread results")
    if errors:
        out.append("")
        out.append("## Errors")
        out.append("")
        for e in errors:
            out.append(f"- {e}")
    return "\n".join(out) + "\n"


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("logs", nargs="+")
    args = ap.parse_args(argv)
    results, errors, info = read_logs(args.logs)
    text = render(results, errors, info)
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""GPT-2 training steps on PyTorch's native CUDA allocator and on ccalloc
(a real training step through ccalloc no slower than
native; the loss curves match within floating-point noise).

  gpt2_allocators.py train --allocator native|ccalloc --out RUN.json [--steps 20] [--label NAME]
                           [--seq 512] [--seq-min N] [--amp bf16]
  gpt2_allocators.py compare RUN.json... [--json OUT.json] [--warmup 3]

`train` runs in its own process per allocator (the allocator is chosen
before CUDA is initialized): GPT-2 from transformers' GPT2Config() (the
default small model, 124M parameters, random weights from a fixed seed,
built on the CPU so both runs start from the same weights), AdamW, inputs of
random token ids (batch 8 x 512 by default, from a seeded CPU generator),
labels = inputs. With --seq-min N each step's sequence length is drawn from
[N, --seq] (seeded: the same lengths in every run), a varying-length loop
(memory over a long run). With --amp bf16 the forward pass runs
under torch.autocast(bfloat16), as the programs behind ../shared/traces
(gpt2_train, gpt2_train_long) were recorded: mixed-precision training, where
the casts' copies of the weights come and go each step. Per step it records the loss and the wall time between two
device synchronizations (host-to-device copy of the batch, forward,
backward, optimizer step). At the end: peak reserved and allocated bytes and
device malloc/free counts, from torch.cuda.memory_stats() for the native
allocator and from ccalloc's own statistics (same key names) for ccalloc,
whose statistics PyTorch cannot read through its pluggable interface.

`--label` names a variant (default: the allocator's name), e.g. ccalloc
with CCALLOC_CONF=expandable_segments:False as "ccalloc-plain", or native
with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True as "native-expandable".

`compare` reads the run files (any number per label, e.g. native,
ccalloc, ccalloc, native to cancel drift), prints per label the median step time
(steps after the warm-up ones, all runs of an allocator pooled), peak
reserved and allocated, device mallocs, and the largest |loss difference|
per step between the first native and the first ccalloc run (and between
two runs of one allocator when there are two, the noise floor).

Needs: PyTorch with a GPU, transformers; for ccalloc, the package in
python/ (found from this file) and libccalloc.so (CCALLOC_LIBRARY).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(args: argparse.Namespace) -> int:
    ccalloc_torch = None
    if args.allocator == "ccalloc":
        try:  # the installed package (pip install --no-build-isolation .), else the checkout's python/
            import ccalloc.torch as ccalloc_torch  # before anything touches CUDA
        except ImportError:
            sys.path.insert(0, str(REPO / "python"))
            import ccalloc.torch as ccalloc_torch

        ccalloc_torch.install()
    t_start = time.perf_counter()
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    if not torch.cuda.is_available():
        print("gpt2: no GPU visible to PyTorch", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    config = GPT2Config()  # the default small GPT-2
    model = GPT2LMHeadModel(config)  # random weights, on the CPU: the same in every run
    model.to("cuda")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed + 1)
    lengths = [args.seq if args.seq_min is None
               else int(torch.randint(args.seq_min, args.seq + 1, (1,), generator=generator))
               for _ in range(args.steps)]
    batches = [torch.randint(0, config.vocab_size, (args.batch, n), generator=generator) for n in lengths]
    torch.cuda.manual_seed_all(args.seed)  # dropout masks: the same sequence in every run
    steps = []
    for i, batch in enumerate(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = batch.to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        if args.sync_phases:
            torch.cuda.synchronize()
        loss.backward()
        if args.sync_phases:
            torch.cuda.synchronize()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        enqueued = time.perf_counter() - t0  # the host's share: all the step's work is queued
        value = loss.item()
        torch.cuda.synchronize()
        steps.append({"step": i, "loss": value, "time_s": time.perf_counter() - t0, "enqueue_s": enqueued})
        print(f"gpt2 [{args.allocator}] step {i:2d}: loss {value:.6f}  {1e3 * steps[-1]['time_s']:.1f} ms",
              flush=True)
    if ccalloc_torch is not None:
        stats = ccalloc_torch.memory_stats()
    else:
        stats = torch.cuda.memory_stats()
    result = {
        "allocator": args.allocator,
        "label": args.label or args.allocator,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": args.batch,
        "seq": args.seq,
        "seq_min": args.seq_min,
        "amp": args.amp,
        "seed": args.seed,
        "steps": steps,
        "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
        "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
        "num_device_alloc": stats["num_device_alloc"],
        "num_device_free": stats["num_device_free"],
        "num_alloc_retries": stats["num_alloc_retries"],
        # ccalloc's own counters (absent from PyTorch's statistics)
        "num_device_synchronizations": stats.get("num_device_synchronizations", 0),
        "num_pages_remapped": stats.get("num_pages_remapped", 0),
        "num_pages_mapped": stats.get("num_pages_mapped", 0),
        "bytes_moved_between_streams": stats.get("bytes_moved_between_streams", 0),
        "total_s": time.perf_counter() - t_start,
        "ccalloc_config": os.environ.get("CCALLOC_CONF", ""),
        "ccalloc_integration": ccalloc_torch.integration() if ccalloc_torch is not None else None,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def _median_ms(runs: list, warmup: int) -> float:
    times = [s["time_s"] for r in runs for s in r["steps"][warmup:]]
    return 1e3 * statistics.median(times) if times else float("nan")


def _max_loss_diff(a: dict, b: dict) -> float:
    pairs = zip(a["steps"], b["steps"])
    return max((abs(x["loss"] - y["loss"]) for x, y in pairs), default=float("nan"))


def compare(args: argparse.Namespace) -> int:
    runs = [json.loads(Path(f).read_text()) for f in args.runs]
    by = {}
    for r in runs:
        by.setdefault(r.get("label", r["allocator"]), []).append(r)
    if "native" not in by or "ccalloc" not in by:
        print(f"gpt2 compare: need native and ccalloc runs, got {sorted(by)}", file=sys.stderr)
        return 2
    first = runs[0]
    seq = f"{first['seq_min']}-{first['seq']}" if first.get("seq_min") else f"{first['seq']}"
    amp = " bf16 autocast," if first.get("amp") == "bf16" else ""
    print(f"GPT-2 ({first['parameters'] / 1e6:.0f}M parameters), batch {first['batch']} x {seq},{amp} "
          f"{len(first['steps'])} AdamW steps, {first['device']}, torch {first['torch']}, "
          f"transformers {first['transformers']}; median over steps {args.warmup}.. of "
          + ", ".join(f"{len(rs)} {name}" for name, rs in by.items()) + " run(s)")
    rows = {}
    print("| variant | median step (ms) | vs native | host enqueue (ms) | peak reserved (MiB) | peak allocated (MiB) "
          "| device mallocs | allocator device syncs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    native_ms = _median_ms(by["native"], args.warmup)
    for name, rs in by.items():
        row = {
            "median_step_ms": _median_ms(rs, args.warmup),
            "per_run_median_step_ms": [_median_ms([r], args.warmup) for r in rs],
            "peak_reserved_bytes": max(r["peak_reserved_bytes"] for r in rs),
            "peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in rs),
            "num_device_alloc": max(r["num_device_alloc"] for r in rs),
            "num_device_synchronizations": max(r.get("num_device_synchronizations", 0) for r in rs),
            "median_enqueue_ms": 1e3 * statistics.median(
                [st.get("enqueue_s", float("nan")) for r in rs for st in r["steps"][args.warmup:]] or [float("nan")]),
            "config": rs[0].get("ccalloc_config") or rs[0].get("pytorch_cuda_alloc_conf") or "",
        }
        rows[name] = row
        print(f"| {name} | {row['median_step_ms']:.2f} (runs: "
              f"{', '.join(f'{m:.2f}' for m in row['per_run_median_step_ms'])}) | "
              f"{row['median_step_ms'] / native_ms:.4f} | {row['median_enqueue_ms']:.2f} | "
              f"{row['peak_reserved_bytes'] / 2**20:.0f} | {row['peak_allocated_bytes'] / 2**20:.0f} | "
              f"{row['num_device_alloc']} | {row['num_device_synchronizations']} |")
    diff = _max_loss_diff(by["native"][0], by["ccalloc"][0])
    noise = {name: _max_loss_diff(rs[0], rs[1]) for name, rs in by.items() if len(rs) > 1}
    ratio = rows["ccalloc"]["median_step_ms"] / rows["native"]["median_step_ms"]
    reserved_ratio = rows["ccalloc"]["peak_reserved_bytes"] / rows["native"]["peak_reserved_bytes"]
    print(f"max |loss difference| native vs ccalloc: {diff:.3g}"
          + "".join(f"; {n} vs {n}: {d:.3g}" for n, d in noise.items()))
    print(f"ccalloc / native: median step time {ratio:.3f}, peak reserved {reserved_ratio:.3f}")
    # Round k's ccalloc run against round k's native run (run back to back,
    # so the host's drift between rounds cancels): one ratio per round.
    paired = [c / n for c, n in zip(rows["ccalloc"]["per_run_median_step_ms"], rows["native"]["per_run_median_step_ms"])]
    if len(paired) > 1:
        print(f"ccalloc / native per round: {', '.join(f'{p:.3f}' for p in paired)} "
              f"(median {statistics.median(paired):.3f}, {sum(p <= 1.0 for p in paired)} of {len(paired)} rounds <= 1)")
    if "native-expandable" in rows:
        vs_exp = rows["ccalloc"]["peak_reserved_bytes"] / rows["native-expandable"]["peak_reserved_bytes"]
        print(f"ccalloc / native-expandable: peak reserved {vs_exp:.3f} (target: <= 0.95)")
    print(f"P6 (a training step through ccalloc no slower than native): "
          f"{'met' if ratio <= 1.0 else 'not met'} in this run (ratio {ratio:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "rows": rows, "max_loss_diff": diff, "loss_noise": noise, "step_time_ratio": ratio,
            "peak_reserved_ratio": reserved_ratio, "paired_step_time_ratios": paired, "runs": runs}, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train in this process on one allocator")
    t.add_argument("--allocator", choices=["native", "ccalloc"], required=True)
    t.add_argument("--out", required=True, help="JSON file to write")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--seq", type=int, default=512, help="sequence length (the largest with --seq-min)")
    t.add_argument("--seq-min", type=int, default=None,
                   help="vary the sequence length per step, uniformly in [SEQ_MIN, SEQ] (seeded)")
    t.add_argument("--amp", choices=["none", "bf16"], default="none",
                   help="bf16: forward pass under torch.autocast(bfloat16) (mixed-precision training)")
    t.add_argument("--sync-phases", action="store_true",
                   help="synchronize the device after the forward and after the backward pass (diagnosis: "
                        "the device never runs behind the host at those points)")
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--label", help="the variant's name in compare (default: the allocator)")
    c = sub.add_parser("compare", help="compare run files")
    c.add_argument("runs", nargs="+")
    c.add_argument("--json", help="write the comparison and the runs here")
    c.add_argument("--warmup", type=int, default=3, help="steps left out of the median (default 3)")
    args = parser.parse_args()
    return train(args) if args.command == "train" else compare(args)


if __name__ == "__main__":
    sys.exit(main())

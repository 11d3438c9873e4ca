#!/usr/bin/env python3
"""A torch.distributed all-reduce across two GPUs on tensors from a ccalloc
private pool whose segments come from ncclMemAlloc.

  nccl_allreduce.py [--world-size 2] [--sizes 64MiB,1MiB,12345,4KiB]
                    [--timeout 300] [--json OUT.json]

The parent starts one worker process per rank (this file with --worker) and
waits for them with a time cap. Rank r, on GPU r:
  1. ccalloc.torch.install() before CUDA is used (ccalloc is PyTorch's allocator);
  2. dist.init_process_group("nccl", init_method=file://...);
  3. MemPool(segment_allocator=ccalloc.nccl_segment_allocator()) on GPU r;
  4. inside use_mem_pool(pool): one float32 tensor per size, filled with r + 1
     (plus one control tensor outside the pool);
  5. checks that every pool tensor's data_ptr lies in a segment of the pool
     (ccalloc's snapshot carries pool ids) and that the pool's usage shows
     them (reserved > 0, allocated >= their bytes), and that the control
     tensor does not;
  6. dist.all_reduce (sum) of each tensor, then checks every element equals
     1 + 2 + ... + world exactly;
  7. times a few more all-reduces of the largest tensor;
  8. frees the tensors, closes the pool, destroys the process group and
     empties the cache (ncclMemFree of the pool's segments).
Each worker writes its results to a JSON file; the parent prints a report
and exits 0 only when every rank passed every check.

Environment: NCCL_NVLS_ENABLE is left as it is (0 when unset; the GPU
machine sets 0: NVLink multicast must stay off there). CCALLOC_LIBRARY
points at libccalloc.so (else python/ccalloc finds one as usual); the
package is imported from python/ next to this file.

Exit status: 0 all checks passed; 1 a check failed, a worker failed or
timed out; 77 fewer GPUs than --world-size (nothing run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
SKIP = 77


def parse_size(text: str) -> int:
    """'64MiB', '4KiB', '12345' -> bytes."""
    text = text.strip()
    for suffix, unit in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * unit)
    return int(text)


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# ---- worker (one per rank) ------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> int:
    rank, world = args.rank, args.world_size
    result = {"rank": rank, "ok": False, "errors": [], "checks": {}}
    out_path = Path(args.result_dir) / f"rank{rank}.json"

    def fail(message: str) -> None:
        result["errors"].append(message)
        print(f"[rank {rank}] FAIL: {message}", flush=True)

    def say(message: str) -> None:  # progress, for a run that hangs
        print(f"[rank {rank}] {time.perf_counter() - t_start:7.2f} s: {message}", flush=True)

    def write() -> None:
        out_path.write_text(json.dumps(result, indent=1))

    t_start = time.perf_counter()
    try:
        sys.path.insert(0, str(REPO / "python"))
        import ccalloc
        import ccalloc.torch

        ccalloc.torch.install()  # before anything touches CUDA
        import datetime

        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        result["device"] = torch.cuda.get_device_name(rank)
        result["torch"] = torch.__version__
        version = torch.cuda.nccl.version()
        result["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        result["allocator_backend"] = ccalloc.process_allocator().backend_name
        timeout = datetime.timedelta(seconds=args.pg_timeout)
        kwargs = dict(backend="nccl", init_method=f"file://{args.init_file}", rank=rank, world_size=world,
                      timeout=timeout)
        try:  # PyTorch >= 2.3: bind the communicator to this GPU at once
            dist.init_process_group(**kwargs, device_id=torch.device("cuda", rank))
        except TypeError:
            dist.init_process_group(**kwargs)
        result["init_s"] = round(time.perf_counter() - t_start, 3)
        say(f"process group up (NCCL {result['nccl']}, {result['device']})")
        try:
            run_checks(args, result, fail, say, ccalloc, torch, dist)
        finally:
            try:
                dist.destroy_process_group()
            except Exception as e:  # report, but the checks' verdict stands
                fail(f"destroy_process_group: {type(e).__name__}: {e}")
        ccalloc.torch.empty_cache()  # the released pool's segments go back (ncclMemFree)
        result["reserved_after_empty_cache"] = ccalloc.torch.memory_reserved(rank)
    except BaseException as e:  # noqa: BLE001 - every failure goes to the report
        import traceback

        fail(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    result["wall_s"] = round(time.perf_counter() - t_start, 3)
    result["ok"] = not result["errors"]
    write()
    return 0 if result["ok"] else 1


def run_checks(args, result, fail, say, ccalloc, torch, dist) -> None:
    rank, world = args.rank, args.world_size
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    result["sizes_bytes"] = sizes
    segment_functions = ccalloc.nccl_segment_allocator()
    pool = ccalloc.torch.MemPool(segment_allocator=segment_functions, device=rank)
    result["pool_id"] = list(pool.id)
    value = float(rank + 1)
    expected = float(world * (world + 1) // 2)
    tensors = []
    with ccalloc.torch.use_mem_pool(pool):
        for size in sizes:
            tensors.append(torch.full((max(1, size // 4),), value, dtype=torch.float32, device="cuda"))
    control = torch.full((MiB // 4,), value, dtype=torch.float32, device="cuda")  # the default pool
    torch.cuda.synchronize()
    say(f"{len(tensors)} tensors in pool {pool.id} (segments from ncclMemAlloc at {segment_functions[0]:#x})")

    # The tensors are in the pool: usage and the segments' addresses.
    usage = pool.usage()
    segments = pool.snapshot()
    result["pool_usage"] = usage
    result["pool_segments"] = [{"address": s["address"], "total_size": s["total_size"],
                                "allocated_size": s["allocated_size"]} for s in segments]
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)
    result["tensor_bytes"] = tensor_bytes

    def in_pool(t) -> bool:
        p = t.data_ptr()
        return any(s["address"] <= p and p + t.numel() * t.element_size() <= s["address"] + s["total_size"]
                   for s in segments)

    checks = result["checks"]
    checks["pool_reserved_positive"] = usage["reserved_bytes"] > 0
    checks["pool_allocated_covers_tensors"] = usage["allocated_bytes"] >= tensor_bytes
    checks["pool_allocation_count"] = usage["allocation_count"] == len(tensors)
    checks["tensors_inside_pool_segments"] = all(in_pool(t) for t in tensors)
    checks["control_outside_pool"] = not in_pool(control)
    for name in ("pool_reserved_positive", "pool_allocated_covers_tensors", "pool_allocation_count",
                 "tensors_inside_pool_segments", "control_outside_pool"):
        if not checks[name]:
            fail(f"{name}: usage {usage}, tensor bytes {tensor_bytes}, "
                 f"segments {result['pool_segments']}, tensors at "
                 f"{[hex(t.data_ptr()) for t in tensors]}, control at {hex(control.data_ptr())}")

    # The all-reduce, checked exactly.
    t0 = time.perf_counter()
    for t in tensors + [control]:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    torch.cuda.synchronize()
    result["first_allreduce_s"] = round(time.perf_counter() - t0, 4)
    say("all-reduce done")
    wrong = []
    for size, t in zip(sizes + ["control"], tensors + [control]):
        bad = int((t != expected).sum().item())
        if bad:
            wrong.append({"size": size, "wrong_elements": bad, "numel": t.numel(),
                          "first_values": t[:4].tolist()})
    checks["sum_exact"] = not wrong
    result["expected_value"] = expected
    if wrong:
        fail(f"all_reduce sums differ from {expected}: {wrong}")

    # Timing: a few more all-reduces of the largest pool tensor (values grow; not checked).
    big = max(tensors, key=lambda t: t.numel())
    times = []
    for _ in range(args.iterations):
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        dist.all_reduce(big)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t1)
    median = statistics.median(times) if times else 0.0
    nbytes = big.numel() * big.element_size()
    result["timing"] = {"bytes": nbytes, "iterations": len(times), "median_ms": round(median * 1e3, 3),
                        # NCCL's bus bandwidth for all-reduce: size / time x 2 (n - 1) / n
                        "busbw_GBps": round(nbytes / median * 2 * (world - 1) / world / 1e9, 2) if median else 0}

    # Free, release: the pool's blocks are free again, its segments still cached.
    # ProcessGroupNCCL may keep references to a collective's tensors until its
    # watchdog sees the work complete: wait for them (10 s at most).
    del tensors, big, control, t
    torch.cuda.synchronize()
    import gc

    waited = time.perf_counter()
    while True:
        gc.collect()
        after = pool.usage()
        if after["allocated_bytes"] == 0 or time.perf_counter() - waited > 10:
            break
        time.sleep(0.05)
    result["pool_usage_after_free"] = after
    result["free_wait_s"] = round(time.perf_counter() - waited, 3)
    checks["pool_empty_after_free"] = after["allocated_bytes"] == 0
    if not checks["pool_empty_after_free"]:
        fail(f"pool still has allocated blocks after the tensors were freed: {after}")
    pool.close()
    result["pool_use_count_after_close"] = pool.use_count()
    dist.barrier()
    say("checks done")


# ---- parent ------------------------------------------------------------------------------------------

def gpu_count() -> int:
    """Visible GPUs, without initializing CUDA in this process."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def launch(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # never turned on here (see the module docstring)
    env["PYTHONUNBUFFERED"] = "1"
    print(f"nccl_allreduce: world size {args.world_size}, sizes {args.sizes}, "
          f"NCCL_NVLS_ENABLE={env['NCCL_NVLS_ENABLE']}, CCALLOC_LIBRARY={env.get('CCALLOC_LIBRARY', '(unset)')}",
          flush=True)
    count = gpu_count()
    if count < args.world_size:
        print(f"nccl_allreduce: SKIP: {count} GPU(s) visible, {args.world_size} needed", flush=True)
        return SKIP
    work = Path(tempfile.mkdtemp(prefix="ccalloc-nccl-"))
    init_file = work / "store"  # must not exist yet: torch's FileStore creates it
    procs = []
    logs = []
    try:
        for rank in range(args.world_size):
            log = open(work / f"rank{rank}.log", "w")
            logs.append(log)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(rank),
                   "--world-size", str(args.world_size), "--sizes", args.sizes, "--init-file", str(init_file),
                   "--result-dir", str(work), "--iterations", str(args.iterations),
                   "--pg-timeout", str(args.pg_timeout)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + args.timeout
        timed_out = False
        first_failure = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed and first_failure is None:
                first_failure = now
            if first_failure is not None and now - first_failure > 30:
                break  # a rank failed; the others would wait for it in NCCL until their timeout
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in logs:
            log.close()

        results = []
        for rank, p in enumerate(procs):
            text = (work / f"rank{rank}.log").read_text(errors="replace")
            print(f"---- rank {rank} (exit {p.returncode}) ----")
            print(text.rstrip() or "(no output)")
            path = work / f"rank{rank}.json"
            r = json.loads(path.read_text()) if path.exists() else {"rank": rank, "ok": False,
                                                                    "errors": ["no result file"]}
            r["exit"] = p.returncode
            results.append(r)
        ok = not timed_out and all(r.get("ok") and r["exit"] == 0 for r in results)
        report(args, results, timed_out, ok, time.perf_counter() - t_start)
        if args.json:
            Path(args.json).write_text(json.dumps({"ok": ok, "timed_out": timed_out, "ranks": results,
                                                   "NCCL_NVLS_ENABLE": env["NCCL_NVLS_ENABLE"]}, indent=1))
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


def report(args, results, timed_out, ok, seconds) -> None:
    print()
    print(f"nccl_allreduce: {args.world_size} ranks, ccalloc pool with ncclMemAlloc segments "
          f"({seconds:.1f} s{', TIMED OUT' if timed_out else ''})")
    first = results[0]
    if "device" in first:
        print(f"  device {first['device']}, torch {first.get('torch')}, NCCL {first.get('nccl')}, "
              f"ccalloc backend {first.get('allocator_backend')}")
    if "sizes_bytes" in first:
        print("  tensor sizes: " + ", ".join(human(s) for s in first["sizes_bytes"]) + " (float32, in the pool)"
              " + 1 MiB control tensor (default pool)")
    for r in results:
        usage = r.get("pool_usage", {})
        timing = r.get("timing", {})
        sums = r.get("checks", {}).get("sum_exact")
        print(f"  rank {r['rank']}: {'PASS' if r.get('ok') and r['exit'] == 0 else 'FAIL'}"
              f" exit {r['exit']}; sum == {r.get('expected_value', '?')} exactly: {sums};"
              f" pool {tuple(r.get('pool_id', ()))} reserved {human(usage.get('reserved_bytes', 0))},"
              f" allocated {human(usage.get('allocated_bytes', 0))} for {human(r.get('tensor_bytes', 0))} of tensors"
              f" in {usage.get('segment_count', 0)} segment(s);"
              f" tensors inside pool segments: {r.get('checks', {}).get('tensors_inside_pool_segments')};"
              f" all-reduce of {human(timing.get('bytes', 0))}: median {timing.get('median_ms', '?')} ms"
              f" ({timing.get('busbw_GBps', '?')} GB/s bus); init {r.get('init_s', '?')} s,"
              f" wall {r.get('wall_s', '?')} s")
        for e in r.get("errors", []):
            print(f"    error: {e}")
    print(f"nccl_allreduce: {'PASS' if ok else 'FAIL'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="ranks, one GPU each (default 2)")
    parser.add_argument("--sizes", default="64MiB,1MiB,12345,4KiB",
                        help="tensor sizes in bytes (suffixes KiB, MiB, GiB), comma-separated")
    parser.add_argument("--iterations", type=int, default=5, help="timed all-reduces of the largest tensor")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for the whole run (parent)")
    parser.add_argument("--pg-timeout", type=float, default=120, help="torch.distributed timeout, seconds")
    parser.add_argument("--json", help="write the results of every rank here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--init-file", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error("--world-size must be at least 1 (1: a one-GPU smoke run)")
    if args.worker:
        return worker(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())

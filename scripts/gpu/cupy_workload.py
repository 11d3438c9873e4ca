#!/usr/bin/env python3
"""A CuPy array workload on ccalloc: installs ccalloc as
CuPy's allocator, runs elementwise kernels, reductions, matrix products and
FFTs on arrays from 1 KiB to 64 MiB on the default stream and on a second
stream, checks a few results against NumPy, and prints ccalloc's statistics
(allocation counts, reserved bytes, device mallocs) and CuPy's own pool
usage, which stays at 0 bytes when ccalloc serves everything.

  cupy_workload.py [--iterations 40] [--json OUT.json]

Needs: CuPy with a GPU; the package in python/ (found from this file) and
libccalloc.so (CCALLOC_LIBRARY). Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import ccalloc  # noqa: E402
import ccalloc.cupy  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--json")
    args = parser.parse_args()

    import cupy
    import numpy

    ccalloc.cupy.install()
    device = cupy.cuda.runtime.getDevice()
    pool = cupy.get_default_memory_pool()
    before = ccalloc.memory_stats(device)
    failures = []
    t0 = time.perf_counter()
    rng = numpy.random.default_rng(0)
    side = cupy.cuda.Stream(non_blocking=True)
    for i in range(args.iterations):
        n = 1 << (8 + i % 17)  # 256 .. 16M float32 elements: 1 KiB .. 64 MiB
        a = cupy.arange(n, dtype=cupy.float32)
        b = cupy.sin(a) ** 2 + cupy.cos(a) ** 2  # = 1
        total = float(b.sum())
        if abs(total - n) > 1e-3 * n:
            failures.append(f"iteration {i}: sum(sin^2+cos^2) over {n} = {total}")
        m = 64 + 32 * (i % 8)
        x_host = rng.standard_normal((m, m)).astype(numpy.float32)
        x = cupy.asarray(x_host)
        y = x @ x.T
        if not numpy.allclose(cupy.asnumpy(y), x_host @ x_host.T, rtol=1e-3, atol=1e-3):
            failures.append(f"iteration {i}: {m}x{m} matrix product differs from NumPy")
        f = cupy.fft.fft(a[: min(n, 1 << 16)])
        if abs(complex(f[0]).real - float(a[: min(n, 1 << 16)].sum())) > 1e-2 * max(1.0, float(f[0].real)):
            failures.append(f"iteration {i}: fft[0] != sum")
        with side:  # memory allocated and freed on a second stream
            c = cupy.ones(n // 2 + 1, dtype=cupy.float64).cumsum()
            if int(c[-1]) != n // 2 + 1:
                failures.append(f"iteration {i}: cumsum on the side stream gave {int(c[-1])}")
        side.synchronize()
        del a, b, x, y, f, c
    cupy.cuda.Device(device).synchronize()
    elapsed = time.perf_counter() - t0
    after = ccalloc.memory_stats(device)
    keys = ["allocation.all.allocated", "allocation.all.current", "allocation.all.peak",
            "allocated_bytes.all.peak", "reserved_bytes.all.current", "reserved_bytes.all.peak",
            "segment.all.peak", "num_device_alloc", "num_device_free", "num_ooms"]
    print(f"cupy workload: {args.iterations} iterations in {elapsed:.2f} s on device {device} "
          f"(ccalloc backend: {ccalloc.process_allocator().backend_name}, library {ccalloc.library_path()})")
    print("| ccalloc statistic | before | after |")
    print("| --- | --- | --- |")
    for k in keys:
        print(f"| {k} | {before[k]} | {after[k]} |")
    served = after["allocation.all.allocated"] - before["allocation.all.allocated"]
    print(f"ccalloc served {served} allocations; CuPy's own pool holds {pool.total_bytes()} bytes "
          f"({pool.used_bytes()} used)")
    if served < args.iterations * 5:
        failures.append(f"ccalloc served only {served} allocations for {args.iterations} iterations")
    if pool.total_bytes() != 0:
        failures.append(f"CuPy's default pool holds {pool.total_bytes()} bytes: some arrays bypassed ccalloc")
    for f in failures:
        print("FAIL:", f)
    print("cupy workload:", "all checks passed" if not failures else f"{len(failures)} check(s) failed")
    if args.json:
        Path(args.json).write_text(json.dumps({"before": before, "after": after, "served": served,
                                               "cupy_pool_bytes": pool.total_bytes(), "seconds": elapsed,
                                               "failures": failures}, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

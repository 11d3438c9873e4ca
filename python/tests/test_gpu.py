"""ccalloc with the real PyTorch and CuPy on a GPU (skipped without them).

Each check runs in its own Python process: ccalloc must become PyTorch's
allocator before CUDA is initialized, which a pytest process may already
have done. scripts/gpu.sh integrations runs this file on the GPU machine,
with pytest, or as `python3 test_gpu.py` where pytest is not installed."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

try:
    import pytest
except ImportError:  # run as a script without pytest (see the end of the file)
    pytest = None

PYTHON_DIR = Path(__file__).resolve().parents[1]


def _has(module: str, check: str) -> bool:
    code = f"import {module}, sys; sys.exit(0 if ({check}) else 1)"
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


HAVE_TORCH_GPU = _has("torch", "torch.cuda.is_available()")
HAVE_CUPY_GPU = _has("cupy", "cupy.cuda.runtime.getDeviceCount() > 0")


# Set by scripts/gpu.sh integrations: on the GPU machine a missing torch or
# CuPy is a failure, not a skip.
REQUIRED = os.environ.get("CCALLOC_REQUIRE_GPU_TESTS") == "1"


def _skip_unless(condition: bool, reason: str):
    """pytest's skipif, also read by the runner at the end of the file."""
    condition = condition or REQUIRED

    def mark(fn):
        fn.skip_reason = None if condition else reason
        return fn if pytest is None else pytest.mark.skipif(not condition, reason=reason)(fn)

    return mark


def run(code: str) -> dict:
    """Runs `code` in a fresh interpreter; it prints one JSON object last."""
    env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@_skip_unless(HAVE_TORCH_GPU, "needs PyTorch with a GPU")
def test_torch_tensors_come_from_ccalloc():
    r = run("""
        import json, ccalloc, ccalloc.torch
        ccalloc.torch.install()
        import torch
        before = ccalloc.torch.memory_stats()
        x = torch.randn(1024, 1024, device="cuda")           # 4 MiB
        y = (x @ x).sum().item()
        mid = ccalloc.torch.memory_stats()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            z = torch.ones(256, 1024, device="cuda")         # 1 MiB on a side stream
        z.record_stream(torch.cuda.current_stream())
        del x, z
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        after = ccalloc.torch.memory_stats()
        torch.cuda.set_per_process_memory_fraction(0.5)
        fraction = ccalloc.torch.get_per_process_memory_fraction()
        try:
            torch.empty(int(0.75 * torch.cuda.get_device_properties(0).total_memory), dtype=torch.uint8,
                        device="cuda")
            oom = ""
        except RuntimeError as e:
            oom = str(e)
        print(json.dumps(dict(backend=ccalloc.process_allocator().backend_name,
                              before=before["allocation.all.current"], mid=mid["allocation.all.current"],
                              mid_bytes=mid["allocated_bytes.all.current"],
                              after=after["allocation.all.current"], reserved_after=after["reserved_bytes.all.current"],
                              allocated_after=after["allocated_bytes.all.current"],
                              fraction=fraction, oom=oom, ooms=ccalloc.torch.memory_stats()["num_ooms"])))
    """)
    assert r["backend"] == "cuda"
    assert r["mid"] >= r["before"] + 1
    assert r["mid_bytes"] >= 4 << 20
    assert r["after"] < r["mid"]
    assert r["reserved_after"] >= r["allocated_after"]
    assert r["fraction"] == 0.5
    assert "ccalloc: out of memory" in r["oom"]
    assert r["ooms"] >= 1


@_skip_unless(HAVE_TORCH_GPU, "needs PyTorch with a GPU")
def test_torch_install_after_cuda_init_raises():
    r = run("""
        import json, torch, ccalloc.torch
        torch.zeros(1, device="cuda")
        try:
            ccalloc.torch.install()
            msg = ""
        except RuntimeError as e:
            msg = str(e)
        print(json.dumps(dict(msg=msg, installed=ccalloc.torch.is_installed())))
    """)
    assert "must run before CUDA is initialized" in r["msg"]
    assert not r["installed"]


# A MemPool on the GPU, its segments from a C segment allocator; prints the
# figures that _check_pool_run checks. SEGMENTS is replaced by the code that
# sets `functions` (a pair of addresses).
_POOL_RUN = """
    import ctypes, json, ccalloc, ccalloc.torch
    ccalloc.torch.install()
    import torch
    SEGMENTS
    pool = ccalloc.torch.MemPool(segment_allocator=functions)
    with ccalloc.torch.use_mem_pool(pool):
        x = torch.full((1 << 22,), 2.0, device="cuda")       # 16 MiB, from the pool
    y = torch.ones(1 << 20, device="cuda")                   # 4 MiB, outside
    usage = pool.usage()
    segments = pool.snapshot()
    inside = lambda t: any(s["address"] <= t.data_ptr() < s["address"] + s["total_size"] for s in segments)
    total = float(x.sum().item())
    x_in, y_in, nbytes = inside(x), inside(y), x.numel() * x.element_size()
    del x, y
    torch.cuda.synchronize()
    after_free = pool.usage()
    pool.close()
    torch.cuda.empty_cache()
    try:
        pool.usage()
        gone = False
    except ccalloc.InvalidArgumentError:
        gone = True
    print(json.dumps(dict(usage=usage, x_in=x_in, y_in=y_in, nbytes=nbytes, total=total,
                          after_free=after_free, gone=gone,
                          reserved_end=ccalloc.torch.memory_stats()["reserved_bytes.all.current"])))
"""


def _check_pool_run(r):
    assert r["x_in"] and not r["y_in"], r
    assert r["usage"]["allocated_bytes"] >= r["nbytes"] == 16 << 20
    assert r["usage"]["reserved_bytes"] >= r["usage"]["allocated_bytes"]
    assert r["usage"]["segment_count"] >= 1 and r["usage"]["use_count"] == 1
    assert r["total"] == 2.0 * (1 << 22)
    assert r["after_free"]["allocated_bytes"] == 0
    assert r["after_free"]["reserved_bytes"] == r["usage"]["reserved_bytes"], "cached while the pool is open"
    assert r["gone"], "released and emptied: the pool is gone"


@_skip_unless(HAVE_TORCH_GPU, "needs PyTorch with a GPU")
def test_torch_mem_pool_with_cudamalloc_segments():
    r = run(_POOL_RUN.replace("SEGMENTS", """
    cudart = None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            cudart = ctypes.CDLL(name)
            break
        except OSError:
            pass
    address = lambda f: ctypes.cast(f, ctypes.c_void_p).value
    functions = (address(cudart.cudaMalloc), address(cudart.cudaFree))
    """))
    _check_pool_run(r)


@_skip_unless(HAVE_TORCH_GPU, "needs PyTorch with a GPU (and its NCCL)")
def test_torch_mem_pool_with_nccl_segments():
    """SPEC E5 on one GPU: segments from ncclMemAlloc (the two-GPU
    all-reduce is scripts/gpu/nccl_allreduce.py)."""
    r = run(_POOL_RUN.replace("SEGMENTS", "functions = ccalloc.nccl_segment_allocator()"))
    _check_pool_run(r)


@_skip_unless(HAVE_CUPY_GPU, "needs CuPy with a GPU")
def test_cupy_arrays_come_from_ccalloc():
    r = run("""
        import json, ccalloc, ccalloc.cupy, cupy
        ccalloc.cupy.install()
        before = ccalloc.memory_stats(0)
        a = cupy.arange(1 << 20, dtype=cupy.float64)        # 8 MiB
        b = (a * 2).sum()
        value = float(b)
        mid = ccalloc.memory_stats(0)
        del a, b
        after = ccalloc.memory_stats(0)
        print(json.dumps(dict(value=value, before=before["allocation.all.allocated"],
                              mid=mid["allocation.all.allocated"], live_mid=mid["allocation.all.current"],
                              live_after=after["allocation.all.current"],
                              mid_bytes=mid["allocated_bytes.all.current"])))
    """)
    n = 1 << 20
    assert r["value"] == float(n * (n - 1))
    assert r["mid"] >= r["before"] + 2
    assert r["mid_bytes"] >= 8 << 20
    assert r["live_after"] < r["live_mid"]


if __name__ == "__main__":
    # Without pytest: run every test_* here, print pytest's closing line.
    import traceback

    passed = failed = skipped = 0
    for name, fn in sorted(globals().items()):
        if not (name.startswith("test_") and callable(fn)):
            continue
        reason = getattr(fn, "skip_reason", None)
        if reason:
            print(f"SKIPPED {name}: {reason}")
            skipped += 1
            continue
        try:
            fn()
            print(f"PASSED {name}")
            passed += 1
        except Exception:
            print(f"FAILED {name}")
            traceback.print_exc()
            failed += 1
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    sys.exit(1 if failed else 0)

#!/usr/bin/env python3
"""One check of ccalloc as PyTorch's allocator per process.

  pytorch_dropin.py ITEM      runs ITEM, prints `PASS ITEM` or `FAIL ITEM: why`
                              (or `SKIP ITEM: why`), exit status 0 / 1 / 0
  pytorch_dropin.py --list    the items, one a line

Each item installs ccalloc (`ccalloc.torch.install()`, the installed
package: `python3 -m pip install --no-build-isolation .`) first thing, then
uses only PyTorch's own API, and checks what PyTorch reports against
ccalloc's own view (`ccalloc.memory_stats()`, `ccalloc.memory_snapshot()`).
scripts/gpu/pytorch.sh runs them all. The distributed items (ddp,
fsdp2, nccl_pool_collective) start torchrun on 2 GPUs and SKIP with fewer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
GiB = 1 << 30
ITEMS = {}


class Skip(Exception):
    pass


def item(fn):
    ITEMS[fn.__name__] = fn
    return fn


def setup(expect="native"):
    import ccalloc.torch

    how = ccalloc.torch.install()
    import torch

    assert how == expect, f"install() gave the {how!r} integration, expected {expect!r}"
    torch.cuda.init()
    return torch, ccalloc


def pool_segments(ccalloc, pool=None):
    """ccalloc's segments of private pools (of `pool` when given)."""
    segs = ccalloc.memory_snapshot(include_traces=False)["segments"]
    out = [s for s in segs if tuple(s["segment_pool_id"]) != (0, 0)]
    return [s for s in out if pool is None or tuple(s["segment_pool_id"]) == tuple(pool)]


# ---- scope 1 -------------------------------------------------------------------------------------

@item
def memory_stats():
    torch, ccalloc = setup()
    keep = [torch.empty(n, device="cuda") for n in (100, 300_000, 5 * MiB, 40 * MiB)]
    del keep[1]
    torch.cuda.synchronize()
    theirs = torch.cuda.memory_stats()
    ours = ccalloc.memory_stats()
    assert theirs, "torch.cuda.memory_stats() is empty"
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"keys of torch.cuda.memory_stats() that ccalloc lacks: {missing[:8]}"
    diff = {k: (theirs[k], ours[k]) for k in theirs if theirs[k] != ours[k]}
    assert not diff, f"values differ (torch, ccalloc): {dict(list(diff.items())[:6])}"
    assert theirs["allocation.all.current"] == 3, theirs["allocation.all.current"]
    return f"{len(theirs)} keys equal"


@item
def memory_functions():
    torch, ccalloc = setup()
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_allocated() == ccalloc.memory_allocated() >= 320 * MiB
    del x
    assert torch.cuda.max_memory_allocated() == ccalloc.max_memory_allocated() >= 320 * MiB
    assert torch.cuda.memory_reserved() == ccalloc.memory_reserved() >= 64 * MiB
    assert torch.cuda.max_memory_reserved() == ccalloc.max_memory_reserved() >= 320 * MiB
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() < 320 * MiB
    torch.cuda.reset_accumulated_memory_stats()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == 0
    summary = torch.cuda.memory_summary()
    assert "Allocated memory" in summary and "PyTorch CUDA memory summary" in summary, summary[:200]
    del y
    return "allocated/reserved/peaks/reset/summary agree"


@item
def oom():
    torch, ccalloc = setup()
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as e:
        message = str(e)
    else:
        raise AssertionError("no error for twice the device's memory")
    assert "ccalloc" in message or "out of memory" in message.lower(), message[:300]
    assert torch.cuda.memory_stats()["num_ooms"] == 1
    z = torch.ones(1024, device="cuda") * 2  # the program goes on
    assert float(z.sum()) == 2048.0
    return "caught torch.cuda.OutOfMemoryError: " + message.splitlines()[0][:120]


@item
def compile_reduce_overhead():
    torch, ccalloc = setup()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
    x = torch.randn(32, 256, device="cuda")
    eager = model(x)
    compiled = torch.compile(model, mode="reduce-overhead")
    for _ in range(4):  # warm-up, recording, replays
        out = compiled(x)
    out = compiled(x).clone()
    torch.cuda.synchronize()
    assert torch.allclose(out, eager, atol=1e-3, rtol=1e-3), (out - eager).abs().max().item()
    segs = pool_segments(ccalloc)
    assert segs, "no segment of a private pool: the CUDA graph's memory is not in ccalloc's pools"
    x2 = torch.randn(32, 256, device="cuda")  # new input: replay with copied inputs
    assert torch.allclose(compiled(x2), model(x2), atol=1e-3, rtol=1e-3)
    return f"same as eager; {len(segs)} private-pool segment(s) in ccalloc"


@item
def cuda_graph():
    torch, ccalloc = setup()
    x = torch.randn(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2 + 1  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2 + 1
        z = y.sum()
    pools = pool_segments(ccalloc, g.pool())
    assert pools, f"no ccalloc segment in the graph's pool {g.pool()}"
    x.copy_(torch.arange(1 << 20, device="cuda", dtype=torch.float32))
    g.replay()
    torch.cuda.synchronize()
    expected = (torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 2 + 1)
    assert torch.equal(y, expected)
    assert abs(z.item() - expected.sum().item()) <= 1e-3 * abs(expected.sum().item())
    del g, y, z
    return f"replay equals eager; graph pool has {len(pools)} ccalloc segment(s)"


@item
def mempool():
    torch, ccalloc = setup()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    segs = pool_segments(ccalloc, pool.id)
    assert segs, f"no ccalloc segment in pool {pool.id}"
    addrs = [(s["address"], s["address"] + s["total_size"]) for s in segs]
    assert any(lo <= a.data_ptr() < hi for lo, hi in addrs), "the tensor is not in the pool's segments"
    assert not any(lo <= b.data_ptr() < hi for lo, hi in addrs), "a tensor outside the block is in the pool"
    assert pool.use_count() >= 1
    assert pool.snapshot(), "MemPool.snapshot() is empty"
    del a
    del pool
    torch.cuda.empty_cache()
    return "use_mem_pool routes to the pool; MemPool.snapshot/use_count work"


NCCL_PLUG = r"""
#include <stddef.h>
typedef int (*alloc_fn)(void**, size_t);
typedef int (*free_fn)(void*);
static alloc_fn nccl_alloc; static free_fn nccl_free; static long served;
void plug_set(void* a, void* f) { nccl_alloc = (alloc_fn)a; nccl_free = (free_fn)f; }
long plug_served(void) { return served; }
void* nccl_alloc_plug(size_t size, int device, void* stream) {
  void* p = 0; (void)device; (void)stream;
  if (nccl_alloc(&p, size) != 0) return 0;
  ++served; return p;
}
void nccl_free_plug(void* p, size_t size, int device, void* stream) {
  (void)size; (void)device; (void)stream; nccl_free(p);
}
"""


def nccl_plug_library(ccalloc):
    """A CUDAPluggableAllocator library over ncclMemAlloc (as PyTorch's docs
    build one), compiled now; returns (path, ctypes handle)."""
    import ctypes

    directory = Path(tempfile.mkdtemp(prefix="ccalloc-nccl-plug-"))
    (directory / "plug.c").write_text(NCCL_PLUG)
    lib = directory / "libnccl_plug.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(directory / "plug.c")], check=True)
    handle = ctypes.CDLL(str(lib))
    alloc_addr, free_addr = ccalloc.nccl_segment_allocator()
    handle.plug_set(ctypes.c_void_p(alloc_addr), ctypes.c_void_p(free_addr))
    handle.plug_served.restype = ctypes.c_long
    return str(lib), handle


@item
def mempool_nccl():
    torch, ccalloc = setup()
    path, handle = nccl_plug_library(ccalloc)
    plug = torch.cuda.memory.CUDAPluggableAllocator(path, "nccl_alloc_plug", "nccl_free_plug")
    pool = torch.cuda.MemPool(plug.allocator())
    with torch.cuda.use_mem_pool(pool):
        t = torch.full((4 * MiB,), 3.0, device="cuda")
    assert handle.plug_served() >= 1, "ncclMemAlloc was never called"
    segs = pool_segments(ccalloc, pool.id)
    assert any(s["address"] <= t.data_ptr() < s["address"] + s["total_size"] for s in segs)
    assert float(t.sum()) == 3.0 * 4 * MiB
    return f"{handle.plug_served()} segment(s) from ncclMemAlloc in the MemPool"


@item
def memory_history():
    torch, ccalloc = setup()
    import pickle

    from torch.cuda import _memory_viz

    torch.cuda.memory._record_memory_history(max_entries=10000)
    xs = [torch.empty(n * MiB, dtype=torch.uint8, device="cuda") for n in (1, 3, 30)]
    del xs[0]
    snap = torch.cuda.memory._snapshot()
    actions = {e["action"] for trace in snap["device_traces"] for e in trace}
    assert {"alloc", "free_requested"} <= actions, actions
    path = Path(tempfile.mkdtemp()) / "snap.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        data = pickle.load(f)
    html = _memory_viz.trace_plot(data)
    assert len(html) > 1000
    text = _memory_viz.segsum(data)
    assert "segment" in text.lower() or len(text) > 0
    segs = torch.cuda.memory_snapshot()
    assert segs and all("blocks" in s for s in segs)
    return f"{sum(len(t) for t in snap['device_traces'])} trace entries; _memory_viz read the dump"


@item
def memory_fraction():
    torch, ccalloc = setup()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.1)
    assert abs(ccalloc.get_memory_fraction(0) - 0.1) < 1e-9
    try:
        torch.empty(int(0.2 * total), dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        pass
    else:
        raise AssertionError("an allocation of 20% of the device passed a 10% fraction")
    small = torch.empty(int(0.05 * total), dtype=torch.uint8, device="cuda")
    del small
    return "10% cap refuses 20%, allows 5%"


@item
def empty_cache():
    torch, ccalloc = setup()
    x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    del x
    assert torch.cuda.memory_reserved() >= 512 * MiB
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == ccalloc.memory_reserved() == 0, torch.cuda.memory_reserved()
    return "reserved back to 0"


@item
def mem_get_info():
    torch, ccalloc = setup()
    free0, total = torch.cuda.mem_get_info()
    x = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    free1, _ = torch.cuda.mem_get_info()
    assert free0 - free1 >= int(1.9 * GiB), (free0, free1)
    del x
    return f"free dropped by {(free0 - free1) / GiB:.2f} GiB for a 2 GiB tensor"


@item
def record_stream():
    torch, ccalloc = setup()
    side = torch.cuda.Stream()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    ptr = x.data_ptr()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keep the side stream busy
        x.add_(1)
    x.record_stream(side)
    del x
    y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    # Reuse is safe once the side stream's work is done (the allocator may
    # wait for it, e.g. to recycle pages); it is a bug only while it still runs.
    side_busy = not side.query()
    reused = y.data_ptr() == ptr
    torch.cuda.synchronize()
    assert not (reused and side_busy), "the block was reused while the recorded stream still used it"
    return ("block reused only after the recorded stream finished" if reused
            else "block not reused while the recorded stream is busy")


def _ipc_child(queue, done):
    t = queue.get()
    total = float(t.sum())
    t.fill_(5.0)
    import torch

    torch.cuda.synchronize()
    done.put(total)


@item
def ipc():
    # CUDA IPC through PyTorch needs plain segments (cudaIpcGetMemHandle):
    # ccalloc's default on GPUs is expandable segments.
    os.environ["CCALLOC_CONF"] = "expandable_segments:False"
    torch, ccalloc = setup()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    t = torch.full((1 << 20,), 7.0, device="cuda")
    p = ctx.Process(target=_ipc_child, args=(queue, done))
    p.start()
    queue.put(t)
    total = done.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    assert total == 7.0 * (1 << 20), total
    torch.cuda.synchronize()
    assert float(t.sum()) == 5.0 * (1 << 20), "the child's write is not visible"
    return "child read and wrote a ccalloc tensor through CUDA IPC"


def _ipc_expandable_child(queue, done):
    # The child opens ccalloc's handle of an expandable block: it must use
    # ccalloc's integration too, installed before the tensor is unpickled.
    torch, ccalloc = setup()
    t = queue.get()
    total = float(t.sum())
    t.fill_(5.0)
    torch.cuda.synchronize()
    mapped = sum(s["total_size"] for s in ccalloc.memory_snapshot(include_traces=False)["segments"])
    del t
    torch.cuda.synchronize()
    done.put((total, mapped))


@item
def ipc_expandable():
    # torch.multiprocessing with ccalloc's default expandable segments: the
    # block is shared as ccalloc's own handle (its pages only), and the
    # producer's free of it waits while the child holds it.
    os.environ.pop("CCALLOC_CONF", None)
    torch, ccalloc = setup()
    import ctypes
    import torch.multiprocessing as mp

    # The child takes this process's page descriptors with pidfd_getfd: under
    # Yama ptrace_scope 1 a child may do that only if its parent allows it.
    ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    n = 3 << 20  # 12 MiB of float32: a large-pool block of an expandable segment
    t = torch.full((n,), 7.0, device="cuda")
    p = ctx.Process(target=_ipc_expandable_child, args=(queue, done))
    p.start()
    queue.put(t)
    total, child_segments = done.get(timeout=180)
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    assert total == 7.0 * n, total
    torch.cuda.synchronize()
    assert float(t.sum()) == 5.0 * n, "the child's write is not visible"
    # Sharing twice gives one handle (one export), whatever the number of shares.
    h1 = t.untyped_storage()._share_cuda_()[1]
    h2 = t.untyped_storage()._share_cuda_()[1]
    assert h1 == h2, "two shares of one block gave different handles"
    del t
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return (f"child read and wrote an expandable block through torch.multiprocessing "
            f"(child's own segments {child_segments >> 20} MiB); one handle per block")


@item
def pytorch_alloc_conf():
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") is None:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64,garbage_collection_threshold:0.7")
        env.pop("CCALLOC_CONF", None)
        r = subprocess.run([sys.executable, __file__, "pytorch_alloc_conf"], env=env, capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        raise SystemExit(r.returncode)
    torch, ccalloc = setup()
    conf = ccalloc.get_config()
    assert "max_split_size_mb:64" in conf and "garbage_collection_threshold:0.7" in conf, conf
    assert torch.cuda.memory_stats()["max_split_size"] == 64 * MiB
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="no_such_key:1")
    code = "import ccalloc.torch\ntry:\n ccalloc.torch.install()\nexcept Exception as e: print(type(e).__name__, e)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "ConfigError" in r.stdout and "no_such_key" in r.stdout, r.stdout + r.stderr
    return "PYTORCH_CUDA_ALLOC_CONF applied; an unknown key is a ConfigError naming it"


@item
def pluggable_fallback():
    os.environ["CCALLOC_TORCH_INTEGRATION"] = "pluggable"
    torch, ccalloc = setup(expect="pluggable")
    x = torch.ones(1 << 20, device="cuda")
    assert ccalloc.memory_allocated() >= 4 << 20
    return "CCALLOC_TORCH_INTEGRATION=pluggable still serves tensors"


# ---- sleep and wake (SPEC S1-S5) -----------------------------------------------------------------

@item
def sleep_wake_region():
    torch, ccalloc = setup()
    import ccalloc.torch as ct

    with ct.region(tag="dropin_weights", keep_contents=True):
        w = torch.arange(256 * MiB // 4, device="cuda", dtype=torch.float32)
    with ct.region(tag="dropin_kv", keep_contents=False):
        kv = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    ptr_w, ptr_kv = w.data_ptr(), kv.data_ptr()
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    r = ct.pause()
    free1, _ = torch.cuda.mem_get_info()
    assert free1 - free0 >= 768 * MiB - 4 * MiB, f"pause freed only {(free1 - free0) / MiB:.1f} MiB ({r})"
    other = torch.empty(700 * MiB, dtype=torch.uint8, device="cuda")  # the freed memory is usable
    del other
    torch.cuda.empty_cache()
    ct.resume()
    assert w.data_ptr() == ptr_w and kv.data_ptr() == ptr_kv
    expected = torch.arange(256 * MiB // 4, device="cuda", dtype=torch.float32)
    assert torch.equal(w, expected), "kept contents differ after resume"
    kv.fill_(3)
    torch.cuda.synchronize()
    return (f"pause freed {(free1 - free0) / MiB:.0f} MiB (tags 768 MiB), host {r.get('host_time_us', 0)} us; "
            "weights equal after resume")


@item
def sleep_wake_graph():
    torch, ccalloc = setup()
    import ccalloc.torch as ct

    with ct.region(tag="dropin_graph", keep_contents=True):
        x = torch.randn(1 << 22, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y = x * 3 - 1  # warm-up
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 3 - 1
    g.replay()
    torch.cuda.synchronize()
    before = y.clone()
    ct.pause("dropin_graph", keep_contents=True)
    ct.resume("dropin_graph")
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, before), "the graph captured before the pause replays differently after the resume"
    return "a graph captured before pause replays after resume with the same output"


@item
def nccl_register_hook():
    # ProcessGroupNCCL registers the allocator's segments from its trace
    # hook (SEGMENT_ALLOC/FREE, SEGMENT_MAP/UNMAP for expandable pages).
    os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
    torch, ccalloc = setup()
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        sums = []
        for n in (1 << 20, 40 << 20, 3 << 20):  # grows the expandable reservation in between
            t = torch.ones(n, device="cuda")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            sums.append(float(t.sum()))
            del t
        torch.cuda.empty_cache()
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        assert sums == [float(1 << 20), float(40 << 20), float(3 << 20)], sums
    finally:
        dist.destroy_process_group()
    return "all_reduce on expandable memory with the register hook, across growth and empty_cache"


# ---- scope 3: distributed ---------------------------------------------------------------------------

def _torchrun(mode, allocator):
    import torch

    if torch.cuda.device_count() < 2:
        raise Skip("needs 2 GPUs")
    out = Path(tempfile.mkdtemp()) / f"{mode}-{allocator}.txt"
    env = dict(os.environ, DROPIN_OUT=str(out), DROPIN_ALLOCATOR=allocator)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(HERE / "pytorch_dropin_dist.py"), mode], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-1500:]
    return [float(v) for v in out.read_text().split()]


def _compare_losses(mode):
    ours = _torchrun(mode, "ccalloc")
    theirs = _torchrun(mode, "native")
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    assert len(ours) == len(theirs) > 0 and worst <= 2e-2, f"losses differ by {worst}: {ours} vs {theirs}"
    return f"{len(ours)} steps, largest loss difference {worst:.2e}"


@item
def ddp():
    return _compare_losses("ddp")


@item
def fsdp2():
    return _compare_losses("fsdp2")


@item
def nccl_pool_collective():
    losses = _torchrun("nccl_pool", "ccalloc")
    return f"{len(losses)} steps with an all-reduce on ncclMemAlloc memory"


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    if sys.argv[1] == "--list":
        print("\n".join(ITEMS))
        return 0
    name = sys.argv[1]
    try:
        detail = ITEMS[name]()
    except Skip as e:
        print(f"SKIP {name}: {e}", flush=True)
        return 0
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - one line per item, whatever happened
        traceback.print_exc(file=sys.stderr)
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:400]
        print(f"FAIL {name}: {reason}", flush=True)
        return 1
    print(f"PASS {name}" + (f" ({detail})" if detail else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""ccalloc.torch and ccalloc.cupy against stand-ins for torch and cupy that
record what the integration asks of them, on the simulated device. The real
libraries are exercised by test_gpu.py on a GPU machine.

The torch stand-in then calls the C entry points exactly as PyTorch's
CUDAPluggableAllocator does: through the raw function addresses it was given,
with PyTorch's signatures."""

import ctypes
import sys
import types

import pytest

import ccalloc
import ccalloc.cupy
import ccalloc.torch

MiB = 1 << 20


class FakeNativeAllocator:
    """torch._C._CUDAPluggableAllocator: records the hook addresses set."""

    def __init__(self):
        self.hooks = {}

    def __getattr__(self, name):
        if name.startswith("set_"):
            return lambda address: self.hooks.__setitem__(name, address)
        raise AttributeError(name)


def make_fake_torch(initialized=False, refuse_swap=False):
    torch = types.ModuleType("torch")
    cuda = types.SimpleNamespace()
    memory = types.SimpleNamespace()
    record = {"swapped": None, "created": None}

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc_fn_name, free_fn_name):
            lib = ctypes.CDLL(path)  # as PyTorch does
            self.alloc_address = ctypes.cast(getattr(lib, alloc_fn_name), ctypes.c_void_p).value
            self.free_address = ctypes.cast(getattr(lib, free_fn_name), ctypes.c_void_p).value
            self.args = (path, alloc_fn_name, free_fn_name)
            self._native = FakeNativeAllocator()
            record["created"] = self

        def allocator(self):
            return self._native

    def change_current_allocator(allocator):
        if refuse_swap:
            raise RuntimeError("Can't swap an already initialized allocator")
        record["swapped"] = allocator

    memory.CUDAPluggableAllocator = CUDAPluggableAllocator
    memory.change_current_allocator = change_current_allocator
    cuda.memory = memory
    cuda.is_initialized = lambda: initialized
    cuda.current_device = lambda: 0
    # torch.cuda.current_stream(device).cuda_stream: a stream of the
    # simulated device, set by the test (0: the default stream).
    record["stream"] = 0
    cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=record["stream"])
    torch.cuda = cuda
    torch.record = record
    return torch


@pytest.fixture
def fresh_torch_state(monkeypatch):
    # The stand-in has no C++ side: the pluggable route (the fallback).
    monkeypatch.setenv("CCALLOC_TORCH_INTEGRATION", "pluggable")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(ccalloc.torch, "_installed", None)
    monkeypatch.setattr(ccalloc.torch, "_integration", None)
    monkeypatch.setattr(ccalloc, "_default_device", ccalloc._default_device)


def test_torch_install_wires_every_hook(monkeypatch, fresh_torch_state, process_wide_expandable,
                                       reservation_bytes):
    torch = make_fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    ccalloc.torch.install()
    assert ccalloc.torch.is_installed()
    created = torch.record["created"]
    assert torch.record["swapped"] is created
    path, alloc_name, free_name = created.args
    assert path == ccalloc.library_path()
    assert (alloc_name, free_name) == ("ccalloc_torch_alloc", "ccalloc_torch_free")
    lib = ctypes.CDLL(path)
    expected = {setter: ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value
                for setter, fn in ccalloc._lib.TORCH_HOOKS.items()}
    assert created.allocator().hooks == expected
    assert set(expected) == {"set_init_fn", "set_reset_fn", "set_memory_fraction_fn", "set_base_alloc_fn",
                             "set_record_stream_fn"}
    ccalloc.torch.install()  # again: no-op
    assert torch.record["created"] is created

    # Call the entry points as PyTorch does, through the addresses.
    alloc_fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        created.alloc_address)
    free_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        created.free_address)
    hooks = created.allocator().hooks
    init_fn = ctypes.CFUNCTYPE(None, ctypes.c_int)(hooks["set_init_fn"])
    reset_fn = ctypes.CFUNCTYPE(None)(hooks["set_reset_fn"])
    fraction_fn = ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int)(hooks["set_memory_fraction_fn"])
    base_fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t))(
        hooks["set_base_alloc_fn"])
    record_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(hooks["set_record_stream_fn"])

    init_fn(1)
    before = ccalloc.torch.memory_stats()
    p = alloc_fn(MiB + 1, 0, None)
    assert p
    stats = ccalloc.torch.memory_stats(0)
    assert stats["allocation.all.current"] == before["allocation.all.current"] + 1
    assert ccalloc.torch.memory_allocated() == before["allocated_bytes.all.current"] + MiB + 512
    size = ctypes.c_size_t()
    base = base_fn(p, ctypes.byref(size))
    assert base <= p < base + size.value
    if process_wide_expandable:  # the large pool's reservation
        assert size.value == reservation_bytes(ccalloc.process_allocator())
    else:  # a 20 MiB segment
        assert size.value == 20 * MiB
    record_fn(p, None)
    free_fn(p, MiB + 1, 0, None)
    assert ccalloc.torch.memory_allocated() == before["allocated_bytes.all.current"]
    fraction_fn(0.5, 0)
    assert ccalloc.torch.get_per_process_memory_fraction() == 0.5
    ccalloc.torch.set_per_process_memory_fraction(1.0)
    assert ccalloc.get_memory_fraction(0) == 1.0
    assert ccalloc.torch.memory_reserved() >= (2 * MiB if process_wide_expandable else 20 * MiB)
    reset_fn()  # torch.cuda.empty_cache()
    assert ccalloc.torch.memory_reserved() == ccalloc.torch.memory_allocated()
    ccalloc.torch.reset_peak_memory_stats()
    assert ccalloc.torch.max_memory_reserved() == ccalloc.torch.memory_reserved()
    assert ccalloc.torch.max_memory_allocated() == ccalloc.torch.memory_allocated()
    ccalloc.torch.reset_accumulated_memory_stats()
    assert ccalloc.torch.memory_stats()["num_device_alloc"] == 0
    ccalloc.torch.empty_cache()


def test_torch_install_after_cuda_init_is_refused(monkeypatch, fresh_torch_state):
    torch = make_fake_torch(initialized=True)
    monkeypatch.setitem(sys.modules, "torch", torch)
    with pytest.raises(RuntimeError, match="must run before CUDA is initialized"):
        ccalloc.torch.install()
    assert torch.record["created"] is None
    assert not ccalloc.torch.is_installed()


def test_torch_refusing_the_swap_is_explained(monkeypatch, fresh_torch_state):
    monkeypatch.setitem(sys.modules, "torch", make_fake_torch(refuse_swap=True))
    with pytest.raises(RuntimeError, match="refused to swap its CUDA allocator .Can't swap"):
        ccalloc.torch.install()
    assert not ccalloc.torch.is_installed()


def test_torch_install_rejects_a_bad_config_before_swapping(monkeypatch, fresh_torch_state):
    torch = make_fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    with pytest.raises(ccalloc.ConfigError, match="no_such_key"):
        ccalloc.torch.install(config="no_such_key:1")
    assert torch.record["swapped"] is None


def test_torch_missing_is_an_import_error(monkeypatch, fresh_torch_state):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match="ccalloc.torch needs PyTorch"):
        ccalloc.torch.install()


# ---- private pools: ccalloc.torch.MemPool and use_mem_pool ---------------------------------------

def test_torch_mem_pool_takes_the_current_streams_tensors(monkeypatch, fresh_torch_state):
    torch = make_fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    pool = ccalloc.torch.MemPool()
    with pytest.raises(RuntimeError, match="call ccalloc.torch.install.. first"):
        with ccalloc.torch.use_mem_pool(pool):
            pass
    ccalloc.torch.install()
    created = torch.record["created"]
    alloc_fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        created.alloc_address)
    free_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        created.free_address)
    process = ccalloc.process_allocator()
    stream = process.stream_create(0)
    torch.record["stream"] = stream  # torch's current stream
    assert pool.id[0] >= 1 and pool.id[1] == 0
    assert pool.device == 0
    assert pool.use_count() == 1
    with ccalloc.torch.use_mem_pool(pool) as entered:
        assert entered is pool
        x = alloc_fn(3 * MiB, 0, stream)  # a tensor on the current stream: the pool
        y = alloc_fn(3 * MiB, 0, None)  # another stream: the default pool
    z = alloc_fn(3 * MiB, 0, stream)  # after the block: the default pool
    u = pool.usage()
    assert (u["allocated_bytes"], u["allocation_count"], u["use_count"]) == (3 * MiB, 1, 1)
    assert u["reserved_bytes"] >= 3 * MiB
    segments = pool.snapshot()
    assert sum(s["allocated_size"] for s in segments) == 3 * MiB
    assert any(s["address"] <= x < s["address"] + s["total_size"] for s in segments)
    assert not any(s["address"] <= p < s["address"] + s["total_size"] for s in segments for p in (y, z))
    with pytest.raises(ValueError, match="is on device 0, not device 1"):
        with ccalloc.torch.use_mem_pool(pool, device=1):
            pass
    for p in (x, y, z):
        free_fn(p, 3 * MiB, 0, None)
    assert pool.usage()["allocated_bytes"] == 0
    pool.close()
    pool.close()  # again: nothing
    assert pool.use_count() == 0
    ccalloc.torch.empty_cache()
    with pytest.raises(ccalloc.InvalidArgumentError, match="has no private pool"):
        pool.usage()
    with pytest.raises(ccalloc.InvalidArgumentError, match="has no private pool"):
        with ccalloc.torch.use_mem_pool(pool):
            pass
    process.stream_destroy(stream)


def test_torch_mem_pool_with_a_segment_allocator_and_its_errors(monkeypatch, fresh_torch_state):
    monkeypatch.setitem(sys.modules, "torch", make_fake_torch())
    with pytest.raises(ccalloc.InvalidArgumentError, match="must be None or a pair"):
        ccalloc.torch.MemPool(segment_allocator=(1,))
    calls = []
    libc = ctypes.CDLL(None)
    libc.aligned_alloc.restype = ctypes.c_void_p
    libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def seg_malloc(out, size):
        calls.append(size)
        out[0] = libc.aligned_alloc(4096, size)
        return 0

    def seg_free(ptr):
        calls.append(-1)
        libc.free(ptr)
        return 0

    functions = (ccalloc._lib.SEGMENT_MALLOC(seg_malloc), ccalloc._lib.SEGMENT_FREE(seg_free))
    pool = ccalloc.torch.MemPool(segment_allocator=functions)
    ccalloc.torch.install()
    with ccalloc.torch.use_mem_pool(pool):
        x = ccalloc.process_allocator().malloc(MiB + 1)  # the current stream is the default one
    assert calls == [20 * MiB]
    assert pool.usage()["reserved_bytes"] == 20 * MiB
    assert "open" in repr(pool)
    ccalloc.process_allocator().free(x)
    del pool  # released at garbage collection
    import gc
    gc.collect()
    ccalloc.torch.empty_cache()
    assert calls == [20 * MiB, -1]


# ---- CuPy -----------------------------------------------------------------------------------------

def make_fake_cupy():
    cupy = types.ModuleType("cupy")
    state = {"allocator": "cupy-default"}

    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id=-1):
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    cuda = types.SimpleNamespace(
        UnownedMemory=UnownedMemory,
        MemoryPointer=MemoryPointer,
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        get_current_stream=lambda: types.SimpleNamespace(ptr=0),
        set_allocator=lambda fn: state.__setitem__("allocator", fn),
        get_allocator=lambda: state["allocator"],
    )
    cupy.cuda = cuda
    cupy.state = state
    return cupy


def test_cupy_install_allocates_and_frees_through_ccalloc(monkeypatch):
    cupy = make_fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(ccalloc.cupy, "_installed", False)
    ccalloc.cupy.install()
    assert ccalloc.cupy.is_installed()
    malloc = cupy.state["allocator"]
    assert malloc is ccalloc.cupy.malloc
    before = ccalloc.memory_stats(0)
    mp = malloc(3 * MiB)
    assert mp.ptr % 512 == 0 and mp.mem.size == 3 * MiB and mp.mem.device_id == 0
    after = ccalloc.memory_stats(0)
    assert after["allocation.all.current"] == before["allocation.all.current"] + 1
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] + 3 * MiB
    del mp  # CuPy drops the memory: ccalloc frees it
    assert ccalloc.memory_stats(0)["allocation.all.current"] == before["allocation.all.current"]
    with pytest.raises(ccalloc.OutOfMemoryError):
        malloc(1 << 62)
    zero = malloc(0)
    assert zero.ptr == 0
    ccalloc.cupy.uninstall()
    assert cupy.state["allocator"] == "cupy-default"
    assert not ccalloc.cupy.is_installed()


def test_torch_install_falls_back_with_a_warning_naming_what_is_missing(monkeypatch, fresh_torch_state):
    torch = make_fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setenv("CCALLOC_TORCH_INTEGRATION", "auto")
    with pytest.warns(RuntimeWarning, match=r"C\+\+ integration is not available \(missing torch.utils.cpp_extension"):
        assert ccalloc.torch.install() == "pluggable"
    assert ccalloc.torch.integration() == "pluggable"
    assert torch.record["swapped"] is torch.record["created"]


def test_torch_install_native_only_raises_when_unavailable(monkeypatch, fresh_torch_state):
    torch = make_fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    with pytest.raises(RuntimeError, match=r"integration='native'.*cpp_extension"):
        ccalloc.torch.install(integration="native")
    assert torch.record["swapped"] is None and not ccalloc.torch.is_installed()
    with pytest.raises(ValueError, match="auto, native or pluggable"):
        ccalloc.torch.install(integration="cuda")


def test_torch_install_reads_pytorch_cuda_alloc_conf(monkeypatch, fresh_torch_state):
    monkeypatch.setitem(sys.modules, "torch", make_fake_torch())
    monkeypatch.delenv("CCALLOC_CONF", raising=False)
    before = ccalloc.get_config()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "no_such_key:1")
    with pytest.raises(ccalloc.ConfigError, match=r"PYTORCH_CUDA_ALLOC_CONF='no_such_key:1'.*unknown key 'no_such_key'"):
        ccalloc.torch.install()
    assert ccalloc.get_config() == before and not ccalloc.torch.is_installed()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    try:
        ccalloc.torch.install()
        assert "max_split_size_mb:64" in ccalloc.get_config()
    finally:
        ccalloc.set_config(before)
    # CCALLOC_CONF set: PYTORCH_CUDA_ALLOC_CONF is not read.
    monkeypatch.setattr(ccalloc.torch, "_installed", None)
    monkeypatch.setenv("CCALLOC_CONF", "")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "no_such_key:1")
    ccalloc.torch.install()


def test_torch_snapshot_route_filters_by_pool():
    a = ccalloc.process_allocator()
    pool = a.new_pool_id()
    a.create_pool(pool)
    a.begin_allocate_to_pool(pool, all_streams=True)
    p = a.malloc(MiB)
    a.end_allocate_to_pool(pool)
    q = a.malloc(MiB)
    try:
        mine = ccalloc.torch._snapshot((pool[0], pool[1], False))
        assert mine["segments"] and all(tuple(s["segment_pool_id"]) == pool for s in mine["segments"])
        assert mine["device_traces"] == [] or all(not t for t in mine["device_traces"])
        everything = ccalloc.torch._snapshot(None)
        assert len(everything["segments"]) > len(mine["segments"])
    finally:
        a.free(p)
        a.free(q)
        a.release_pool(pool)
        a.empty_cache()


def _fake_torch_with_cpp_extension(monkeypatch, load):
    """The stand-in plus the parts of torch that ccalloc._build reads."""
    torch = make_fake_torch()
    torch.__version__ = "9.9.0+fake"
    torch.version = types.SimpleNamespace(cuda="13.0")
    torch._C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True)
    cpp_extension = types.ModuleType("torch.utils.cpp_extension")
    cpp_extension.CUDA_HOME = "/usr/local/cuda"
    cpp_extension.load = load
    utils = types.ModuleType("torch.utils")
    utils.cpp_extension = cpp_extension
    torch.utils = utils
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.utils", utils)
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", cpp_extension)
    return torch


def test_torch_failed_build_falls_back_once_and_remembers_why(monkeypatch, fresh_torch_state, tmp_path):
    import ccalloc._build as build

    calls = []

    def load(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("Error building extension 'x': [1/2] c++ ...\nfoo.cpp:1:1: error: boom\nninja: stopped")

    torch = _fake_torch_with_cpp_extension(monkeypatch, load)
    if build.missing_tools():
        pytest.skip("this machine cannot even try a build: " + ", ".join(build.missing_tools()))
    monkeypatch.setenv("CCALLOC_TORCH_INTEGRATION", "auto")
    monkeypatch.setenv("CCALLOC_CACHE_DIR", str(tmp_path))
    with pytest.warns(RuntimeWarning, match=r"torch_allocator.cpp against torch 9.9.0\+fake failed.*error: boom"):
        assert ccalloc.torch.install() == "pluggable"
    assert len(calls) == 1 and calls[0]["with_cuda"] and calls[0]["name"] == build.MODULE
    assert str(tmp_path) in calls[0]["build_directory"] and "torch9.9.0_fake" in calls[0]["build_directory"]
    failed = list(tmp_path.glob("torch/*/FAILED"))
    assert len(failed) == 1 and "error: boom" in failed[0].read_text()
    # The next process (here: install again) does not compile again.
    monkeypatch.setattr(ccalloc.torch, "_installed", None)
    with pytest.warns(RuntimeWarning, match=r"error: boom.*earlier build; delete .*FAILED"):
        ccalloc.torch.install()
    assert len(calls) == 1
    assert torch.record["swapped"] is torch.record["created"]

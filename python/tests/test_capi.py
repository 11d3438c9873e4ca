"""The Python package over the C API on the simulated device (no torch, no
CuPy, no GPU needed). Expected figures follow ccalloc's rules: sizes round up
to 512 bytes; in the default configuration (expandable segments) each
(stream, pool) has one address-space reservation as large as the device, and
reserved bytes are the 2 MiB pages mapped in it; with plain segments
(PYTORCH_POLICIES, as PyTorch) requests up to 1 MiB use 2 MiB segments,
requests of 1-10 MiB a 20 MiB segment."""

import ctypes
import gc
import os
import subprocess
import sys
import threading

import pytest

import ccalloc

MiB = 1 << 20
PAGE = 2 * MiB  # of an expandable segment

# ccalloc::pytorch_policies (include/ccalloc/core/config.hpp): PyTorch's
# allocator's policies in its default configuration, plain segments included.
PYTORCH_POLICIES = "expandable_segments:False,trim_on_new_peak:False,reuse_across_streams:False"

# torch.cuda.memory_stats()'s flat keys for the statistics of SPEC B9.
POOLED = ["allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
          "active_bytes", "inactive_split_bytes", "requested_bytes"]
FIELDS = ["current", "peak", "allocated", "freed"]
TORCH_KEYS = sorted(
    [f"{n}.{g}.{f}" for n in POOLED for g in ("all", "small_pool", "large_pool") for f in FIELDS]
    + [f"{n}.{f}" for n in ("oversize_allocations", "oversize_segments") for f in FIELDS]
    + ["num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
       "max_split_size"])
# ccalloc's own counters, next to PyTorch's (include/ccalloc/core/stats.hpp).
CCALLOC_KEYS = ["num_device_synchronizations", "num_pages_remapped", "num_pages_mapped", "num_pages_unmapped",
                "bytes_moved_between_streams", "num_thread_cache_hits", "num_stream_waits"]


@pytest.fixture
def sim():
    with ccalloc.Allocator("sim", capacity_bytes=1 << 30, config="") as a:
        yield a


def test_library_identity():
    assert os.path.isfile(ccalloc.library_path())
    assert ccalloc.version().count(".") == 2
    assert isinstance(ccalloc.built_with_cuda(), bool)


def test_allocator_describes_itself(sim):
    assert sim.initialized
    assert sim.device_count == 1
    assert sim.backend_name == "sim"
    assert sim.mem_get_info(0) == (1 << 30, 1 << 30)
    assert sim.is_enabled
    with pytest.raises(ccalloc.InvalidArgumentError, match="device 1 is out of range"):
        sim.mem_get_info(1)


def test_stats_have_pytorchs_keys_and_values(sim):
    stats = sim.memory_stats()
    assert list(stats) == sorted(TORCH_KEYS + CCALLOC_KEYS)
    assert all(v == 0 for k, v in stats.items() if k != "max_split_size")
    assert stats["max_split_size"] == -1
    # The default configuration: the large pool's reservation for the default
    # stream is made and one 2 MiB page of it mapped, all that is reserved.
    p = sim.malloc(MiB + 1)
    assert p % 512 == 0
    stats = sim.memory_stats(0)
    assert stats["allocated_bytes.all.current"] == MiB + 512
    assert stats["allocated_bytes.large_pool.current"] == MiB + 512
    assert stats["requested_bytes.all.current"] == MiB + 1
    assert stats["reserved_bytes.all.current"] == PAGE
    assert stats["segment.all.current"] == 1  # one reservation
    assert stats["allocation.all.current"] == 1
    assert stats["num_device_alloc"] == 1  # one physical page
    assert sim.stat("reserved_bytes.all.peak") == PAGE
    sim.free(p)
    assert sim.stat("allocated_bytes.all.current") == 0
    assert sim.stat("reserved_bytes.all.current") == PAGE  # cached, still mapped
    assert sim.cache_info(0) == PAGE
    # 12 MiB grows the same reservation by 5 pages: 12 MiB reserved.
    q = sim.malloc(12 * MiB)
    assert q == p
    assert sim.stat("reserved_bytes.all.current") == 12 * MiB
    assert sim.stat("num_device_alloc") == 6
    assert sim.stat("segment.all.current") == 1
    assert sim.cache_info(0) == 0
    sim.free(q)
    sim.empty_cache()  # unmaps the 6 pages, releases the reservation
    assert sim.stat("reserved_bytes.all.current") == 0
    assert sim.stat("reserved_bytes.all.peak") == 12 * MiB
    assert sim.stat("num_device_free") == 6
    assert sim.stat("segment.all.current") == 0
    assert sim.cache_info(0) == 0
    with pytest.raises(ccalloc.InvalidArgumentError, match="unknown statistic 'reserved_bytes.all.top'"):
        sim.stat("reserved_bytes.all.top")


def test_pytorch_policies_give_plain_segments():
    # About plain segments and their sizes (PyTorch's), so expandable segments
    # are off (PYTORCH_POLICIES pins expandable_segments:False).
    with ccalloc.Allocator("sim", capacity_bytes=1 << 30, config=PYTORCH_POLICIES) as a:
        p = a.malloc(MiB + 1)
        assert a.stat("reserved_bytes.all.current") == 20 * MiB  # a 20 MiB large-pool segment
        q = a.malloc(2 * MiB)  # split from the same segment
        assert a.get_base_allocation(q) == (p, 20 * MiB)
        r = a.malloc(3000)
        assert a.get_base_allocation(r) == (r, 2 * MiB)  # a small-pool segment
        assert a.stat("reserved_bytes.all.current") == 22 * MiB
        assert a.stat("segment.all.current") == 2
        assert a.stat("num_device_alloc") == 2
        for x in (p, q, r):
            a.free(x)
        assert a.stat("reserved_bytes.all.current") == 22 * MiB
        assert a.cache_info(0) == 20 * MiB
        a.empty_cache()
        assert a.stat("reserved_bytes.all.current") == 0
        assert a.stat("num_device_free") == 2


def test_reset_peak_and_accumulated(sim):
    p = sim.malloc(3 * MiB)
    q = sim.malloc(5 * MiB)
    sim.free(q)
    assert sim.stat("allocated_bytes.all.peak") == 8 * MiB
    sim.reset_peak_stats()
    assert sim.stat("allocated_bytes.all.peak") == 3 * MiB
    assert sim.stat("allocation.all.allocated") == 2
    sim.reset_accumulated_stats()
    assert sim.stat("allocation.all.allocated") == 0
    assert sim.stat("allocation.all.current") == 1
    sim.free(p)


def test_errors_name_the_problem(sim):
    p = sim.malloc(4096)
    sim.free(p)
    with pytest.raises(ccalloc.InvalidArgumentError, match=hex(p)):
        sim.free(p)
    assert sim.stat("allocation.all.freed") == 1  # unchanged by the bad free
    with pytest.raises(ccalloc.InvalidArgumentError, match="not a live allocation"):
        sim.get_base_allocation(p)
    with pytest.raises(ccalloc.InvalidArgumentError, match="device 3 is not initialized"):
        sim.malloc(512, device=3)
    with pytest.raises(ccalloc.InvalidArgumentError, match="unknown backend 'tpu'"):
        ccalloc.Allocator("tpu")
    with pytest.raises(ccalloc.ConfigError, match="max_split_size_mb"):
        ccalloc.Allocator("sim", config="max_split_size_mb:huge")
    assert issubclass(ccalloc.ConfigError, ValueError)
    assert issubclass(ccalloc.OutOfMemoryError, MemoryError)
    assert sim.malloc(0) == 0
    sim.free(0)


def test_out_of_memory_and_observer():
    seen = []
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        a.attach_out_of_memory_observer(lambda *args: seen.append(args))
        with pytest.raises(ccalloc.OutOfMemoryError, match="out of memory on device 0") as e:
            a.malloc(100 * MiB)
        assert e.value.status == 2
        assert seen == [(0, 100 * MiB, 64 * MiB, 64 * MiB)]
        assert a.stat("num_ooms") == 1
        p = a.malloc(40 * MiB)  # still works after an OOM
        a.free(p)


def test_memory_fraction(sim):
    assert sim.get_memory_fraction() == 1.0
    sim.set_memory_fraction(0.25)
    assert sim.get_memory_fraction(0) == 0.25
    with pytest.raises(ccalloc.InvalidArgumentError, match=r"outside \[0, 1\]"):
        sim.set_memory_fraction(1.5)
    assert sim.get_memory_fraction() == 0.25
    with pytest.raises(ccalloc.OutOfMemoryError, match="fraction 0.25"):
        sim.malloc(300 * MiB)  # the device has 1 GiB, the fraction allows 256 MiB
    sim.free(sim.malloc(200 * MiB))


def test_config_set_and_get(sim):
    sim.set_config("max_split_size_mb:40,garbage_collection_threshold:0.5")
    text = sim.get_config()
    assert "max_split_size_mb:40" in text
    assert "garbage_collection_threshold:0.5" in text
    assert sim.stat("max_split_size") == 40 * MiB
    with pytest.raises(ccalloc.ConfigError, match="no_such_key"):
        sim.set_config("no_such_key:1")
    assert sim.get_config() == text


def test_get_config_names_expandable_segments_at_its_default(sim):
    # The simulated device has virtual memory: the default is in force.
    assert "expandable_segments:True" in sim.get_config().split(",")
    sim.set_config("expandable_segments:False")
    assert "expandable_segments:False" in sim.get_config().split(",")
    sim.set_config("expandable_segments:True")
    assert "expandable_segments:True" in sim.get_config().split(",")


def test_no_caching_mode(sim):
    sim.enable(False)
    assert not sim.is_enabled
    p = sim.malloc(3 * MiB)
    assert sim.stat("reserved_bytes.all.current") == 3 * MiB
    sim.free(p)
    assert sim.stat("reserved_bytes.all.current") == 0
    sim.enable(True)
    assert sim.is_enabled


def test_streams_record_stream_base_allocation(reservation_bytes):
    # trim_on_new_peak off: q's free page stays mapped in s's reservation
    # rather than move to the default stream's.
    with ccalloc.Allocator("sim", config="trim_on_new_peak:False") as a:
        s = a.stream_create()
        assert s != 0
        p = a.malloc(2 * MiB, stream=s)
        q = a.malloc(2 * MiB, stream=s)
        assert q == p + 2 * MiB  # the next page of s's large-pool reservation
        # An expandable segment's base allocation is its whole reservation:
        # the simulated device's 141 GB rounded up to 2 MiB pages.
        assert a.get_base_allocation(q) == (p, reservation_bytes(a))
        assert reservation_bytes(a) == 67235 * PAGE
        a.record_stream(p, 0)
        a.record_stream(q + 4096, 0)  # a view inside q (SPEC X4)
        a.record_stream(0x1000, 0)  # not ours: ignored
        a.free(p)
        a.free(q)
        a.stream_synchronize(s)
        assert a.malloc(2 * MiB, stream=s) == p  # back in s's pool
        other = a.malloc(2 * MiB, stream=0)
        assert other != q  # blocks are bound to their stream
        # The default stream has a reservation of its own, with a new page.
        assert a.get_base_allocation(other) == (other, reservation_bytes(a))
        assert a.stat("segment.large_pool.current") == 2
        assert a.stat("reserved_bytes.all.current") == 3 * PAGE
        a.stream_destroy(s)

        class TorchLikeStream:  # objects with .cuda_stream (torch) or .ptr (CuPy) are accepted
            cuda_stream = 0

        assert a.raw_alloc(512, stream=TorchLikeStream()) != 0


def test_multiple_simulated_devices():
    with ccalloc.Allocator("sim", devices=2, config="") as a:
        assert a.device_count == 2
        p = a.malloc(4096, device=1)
        assert a.stat("allocation.all.current", 1) == 1
        assert a.stat("allocation.all.current", 0) == 0
        a.free(p)


def test_observer_exception_is_dropped(capfd):
    with ccalloc.Allocator("sim", capacity_bytes=8 * MiB, config="") as a:
        def bad(*_):
            raise ValueError("observer failed")
        a.attach_out_of_memory_observer(bad)
        with pytest.raises(ccalloc.OutOfMemoryError):
            a.malloc(16 * MiB)
    assert "observer failed" in capfd.readouterr().err


def test_allocations_from_threads(sim):
    errors = []

    def work():
        try:
            for _ in range(200):
                sim.free(sim.malloc(8192))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sim.stat("allocation.all.allocated") == 800
    assert sim.stat("allocation.all.current") == 0


def test_closed_allocator_frees_its_memory():
    a = ccalloc.Allocator("sim", config="")
    a.malloc(MiB)
    a.close()
    a.close()  # twice: no-op
    b = ccalloc.Allocator("sim", config="")
    del b
    gc.collect()


# ---- the process-wide allocator (the one PyTorch and CuPy use) -----------------------------

def test_process_wide_functions(process_wide_expandable):
    a = ccalloc.process_allocator()
    assert a.initialized
    assert a.backend_name in ("sim", "cuda")
    device = a.current_device
    before = ccalloc.memory_stats()
    p = ccalloc._lib.lib().ccalloc_alloc(MiB + 1, device, None)  # PyTorch's alloc_fn signature
    assert p
    assert ccalloc.memory_allocated() == before["allocated_bytes.all.current"] + MiB + 512
    assert ccalloc.max_memory_allocated(device) >= MiB + 512
    # At least p's 2 MiB page (expandable segments) or 20 MiB segment (plain).
    assert ccalloc.memory_reserved() >= (PAGE if process_wide_expandable else 20 * MiB)
    assert ccalloc.max_memory_reserved() >= ccalloc.memory_reserved()
    ccalloc._lib.lib().ccalloc_free(p, MiB + 1, device, None)
    assert ccalloc.memory_allocated() == before["allocated_bytes.all.current"]
    ccalloc.reset_peak_memory_stats()
    assert ccalloc.max_memory_allocated() == ccalloc.memory_allocated()
    ccalloc.reset_accumulated_memory_stats()
    assert ccalloc.stats()["allocation.all.allocated"] == 0
    ccalloc.set_memory_fraction(0.5)
    assert ccalloc.get_memory_fraction() == 0.5
    ccalloc.set_memory_fraction(1.0)
    ccalloc.empty_cache()
    assert ccalloc.memory_reserved() == ccalloc.memory_allocated() or a.backend_name == "cuda"
    config = ccalloc.get_config()
    ccalloc.set_config("garbage_collection_threshold:0.7")
    assert "garbage_collection_threshold:0.7" in ccalloc.get_config()
    ccalloc.set_config(config or "garbage_collection_threshold:0.7")


def test_missing_library_is_a_clear_error(tmp_path):
    code = "import ccalloc\ntry:\n    ccalloc.version()\nexcept OSError as e:\n    print(e)\n"
    env = dict(os.environ, CCALLOC_LIBRARY=str(tmp_path / "nope.so"),
               PYTHONPATH=str(ccalloc.__path__[0].rsplit(os.sep, 1)[0]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "CCALLOC_LIBRARY=" in out.stdout and "nope.so is not a file" in out.stdout


def test_environment_configures_the_process_wide_allocator():
    code = ("import ccalloc\nprint(ccalloc.get_config())\n"
            "print(ccalloc.process_allocator().is_enabled)\n")
    env = dict(os.environ, CCALLOC_CONF="max_split_size_mb:64", CCALLOC_NO_CACHING="1",
               PYTHONPATH=str(ccalloc.__path__[0].rsplit(os.sep, 1)[0]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.split()
    assert "max_split_size_mb:64" in lines[0]
    assert lines[1] == "False"


def test_history_and_snapshot_in_pytorchs_layout(tmp_path):
    import pickle
    with ccalloc.Allocator("sim", capacity_bytes=1 << 30, config="") as a:
        a.record_history(True, 1000)
        p = a.malloc(5 * MiB)
        snap = a.snapshot()
        assert set(snap) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
        actions = [e["action"] for e in snap["device_traces"][0]]
        assert "alloc" in actions and "segment_map" in actions, actions
        alloc = [e for e in snap["device_traces"][0] if e["action"] == "alloc"][0]
        assert alloc["addr"] == p and alloc["size"] == 5 * MiB
        assert sum(s["allocated_size"] for s in snap["segments"]) == 5 * MiB
        path = tmp_path / "snap.pickle"
        a.dump_snapshot(str(path))
        with open(path, "rb") as f:
            loaded = pickle.load(f)
        assert loaded["segments"][0]["is_expandable"] is True
        a.free(p)
        with pytest.raises(ccalloc.InvalidArgumentError):
            a.record_history(True, 0)


def test_history_with_python_stacks_per_mode_cleared_and_skipped():
    def here():
        return a.malloc(MiB)  # the line the frames must name

    line = here.__code__.co_firstlineno + 1
    for when in ("state", "alloc", "all"):
        with ccalloc.Allocator("sim", capacity_bytes=1 << 30, config="") as a:
            a.record_history(True, 1000, context="python", when=when, skip_actions=["segment_map"])
            p = here()
            a.free(p)
            q = here()
            snap = a.snapshot()
            block = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == q][0]
            assert block["frames"][0] == {"name": "here", "filename": __file__, "line": line}, block["frames"][:2]
            assert any(f["name"] == "test_history_with_python_stacks_per_mode_cleared_and_skipped"
                       for f in block["frames"])
            trace = snap["device_traces"][0]
            assert "segment_map" not in [e["action"] for e in trace]
            by_action = {e["action"]: e for e in trace}
            alloc_frames = by_action["alloc"]["frames"]
            free_frames = by_action["free_requested"]["frames"]
            assert bool(alloc_frames) == (when != "state"), (when, alloc_frames[:1])
            assert bool(free_frames) == (when == "all"), (when, free_frames[:1])
            if when == "all":
                assert free_frames[0]["name"] == "test_history_with_python_stacks_per_mode_cleared_and_skipped"
            a.record_history(True, 1000, context="python", when=when, clear=True)
            # cleared; a snapshot's own entry is recorded after its text, so the next one shows it
            assert [e["action"] for e in a.snapshot()["device_traces"][0]] == []
            assert [e["action"] for e in a.snapshot()["device_traces"][0]] == ["snapshot"]
            a.free(q)
    with ccalloc.Allocator("sim", capacity_bytes=1 << 30, config="") as a:
        a.record_history(True, 1000, context=lambda: [("fn", "f.py", 3)])
        p = a.malloc(MiB)
        assert [b["frames"] for s in a.snapshot()["segments"] for b in s["blocks"] if b["address"] == p] == \
            [[{"name": "fn", "filename": "f.py", "line": 3}]]
        a.free(p)
        with pytest.raises(ccalloc.InvalidArgumentError, match="unknown action 'allok'"):
            a.record_history(True, 1000, skip_actions=["allok"])
        with pytest.raises(ccalloc.InvalidArgumentError, match="when must be one of"):
            a.record_history(True, 1000, when="sometimes")


def test_oom_snapshot_is_pytorchs_pickle_of_the_snapshot(tmp_path):
    import pickle
    from ccalloc import snapshot as snapshot_module
    path = tmp_path / "oom.pickle"
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config=f"oom_snapshot:{path}") as a:
        a.record_history(True, 1000, context=lambda: [("fn", "f.py", 3)])
        p = a.malloc(5 * MiB)
        with pytest.raises(ccalloc.OutOfMemoryError, match="was written to " + str(path)):
            a.malloc(100 * MiB)
        with open(path, "rb") as f:
            written = pickle.load(f)
        # ccalloc's own keys (sleep and wake: tag, paused) are in the pickle;
        # from_json keeps PyTorch's keys only.
        def pytorch_keys(d):
            return {k: v for k, v in d.items() if k not in ("tag", "paused")}
        for seg in written["segments"]:
            seg.update(pytorch_keys(seg), blocks=[pytorch_keys(b) for b in seg["blocks"]])
            seg.pop("tag", None)
            seg.pop("paused", None)
        written["device_traces"] = [[pytorch_keys(e) for e in t] for t in written["device_traces"]]
        assert all("tag" in b for seg in pickle.load(open(path, "rb"))["segments"] for b in seg["blocks"])
        now = snapshot_module.from_json(a.snapshot_json())
        assert written["segments"] == now["segments"]
        assert written["allocator_settings"] == now["allocator_settings"]
        assert written["external_annotations"] == now["external_annotations"]
        trace = written["device_traces"][0]
        assert [e["action"] for e in trace][-2:] == ["oom", "snapshot"]
        assert trace[-2]["size"] == 100 * MiB and trace[-2]["frames"] == [{"name": "fn", "filename": "f.py",
                                                                             "line": 3}]
        # The entries up to the OOM are the ones the live snapshot has.
        assert trace[:-1] == now["device_traces"][0][:len(trace) - 1]
        a.free(p)


# ---- private pools (SPEC F20, F21, E5) ---------------------------------------------------------

def test_pool_ids_are_fresh_user_ids(sim):
    a, b = sim.new_pool_id(), sim.new_pool_id()
    assert a[0] >= 1 and a[1] == 0
    assert b == (a[0] + 1, 0)
    assert ccalloc.process_allocator().new_pool_id()[0] == b[0] + 1  # one counter per process


def test_pool_routing_use_counts_and_release():
    with ccalloc.Allocator("sim", capacity_bytes=1 << 30, config=PYTORCH_POLICIES) as a:
        pool = a.new_pool_id()
        a.create_pool(pool)
        assert a.pool_use_count(pool) == 1
        assert a.pool_usage(pool) == dict(segment_count=0, reserved_bytes=0, allocated_bytes=0, active_bytes=0,
                                          allocation_count=0, use_count=1)
        s = a.stream_create()
        a.begin_allocate_to_pool(pool, stream=s)
        x = a.malloc(3 * MiB, stream=s)  # routed: a 20 MiB segment of the pool
        y = a.malloc(3 * MiB)  # the default stream: the default pool
        a.end_allocate_to_pool(pool)
        z = a.malloc(3 * MiB, stream=s)  # after the end: the default pool
        u = a.pool_usage(pool)
        assert (u["segment_count"], u["reserved_bytes"], u["allocated_bytes"], u["allocation_count"]) == \
            (1, 20 * MiB, 3 * MiB, 1)
        assert a.pool_usage((0, 0))["allocated_bytes"] == 6 * MiB
        assert a.get_base_allocation(x)[1] == 20 * MiB
        assert a.get_base_allocation(z)[0] != a.get_base_allocation(x)[0]
        # Every stream: y's stream (the default) lands in the pool too.
        a.create_pool(pool)
        assert a.pool_use_count(pool) == 2
        a.begin_allocate_to_pool(pool, all_streams=True)
        w = a.malloc(MiB)
        a.end_allocate_to_pool(pool)
        assert a.pool_usage(pool)["allocated_bytes"] == 4 * MiB
        for p in (x, y, z, w):
            a.free(p)
        a.empty_cache()
        assert a.pool_usage(pool)["reserved_bytes"] == 22 * MiB, "a pool with users keeps its segments"
        a.release_pool(pool)
        a.release_pool(pool)
        assert a.pool_use_count(pool) == 0
        a.empty_cache()
        assert a.memory_stats()["reserved_bytes.all.current"] == 0
        with pytest.raises(ccalloc.InvalidArgumentError, match="has no private pool"):
            a.pool_usage(pool)
        a.stream_destroy(s)


class HostSegments:
    """A segment allocator in Python (ctypes callbacks) over host memory,
    which the simulated device's allocator only keeps the addresses of."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.libc = ctypes.CDLL(None)
        self.libc.aligned_alloc.restype = ctypes.c_void_p
        self.libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        self.libc.free.argtypes = [ctypes.c_void_p]
        self.calls = []  # (what, size or address, current device)
        self.live = set()
        self.malloc_code = 0
        self.free_code = 0
        self.malloc = ccalloc._lib.SEGMENT_MALLOC(self._malloc)
        self.free = ccalloc._lib.SEGMENT_FREE(self._free)

    def _malloc(self, out, size):
        self.calls.append(("malloc", size, self.allocator.current_device))
        if self.malloc_code:
            return self.malloc_code
        ptr = self.libc.aligned_alloc(4096, size)
        self.live.add(ptr)
        out[0] = ptr
        return 0

    def _free(self, ptr):
        self.calls.append(("free", ptr, self.allocator.current_device))
        if self.free_code:
            return self.free_code
        self.live.remove(ptr)
        self.libc.free(ptr)
        return 0


def test_pool_with_a_segment_allocator_on_its_device():
    with ccalloc.Allocator("sim", devices=2, capacity_bytes=1 << 30, config="") as a:
        host = HostSegments(a)
        pool = a.new_pool_id()
        a.create_pool(pool, device=1, segment_allocator=(host.malloc, host.free))
        a.begin_allocate_to_pool(pool, device=1)
        x = a.malloc(3 * MiB, device=1)
        a.end_allocate_to_pool(pool, device=1)
        assert host.calls == [("malloc", 20 * MiB, 1)], "device 1 current during the call"
        assert a.current_device == 0, "and device 0 again after it"
        assert x in host.live
        assert a.pool_usage(pool, device=1)["reserved_bytes"] == 20 * MiB
        assert a.memory_stats(1)["reserved_bytes.all.current"] == 20 * MiB
        # A failing malloc: out of memory with its code, nothing changed.
        host.malloc_code = 7
        a.begin_allocate_to_pool(pool, device=1)
        try:
            with pytest.raises(ccalloc.OutOfMemoryError, match=r"of device 1 returned 7"):
                a.malloc(30 * MiB, device=1)
        finally:
            a.end_allocate_to_pool(pool, device=1)
        assert a.pool_usage(pool, device=1)["reserved_bytes"] == 20 * MiB
        # A failing free: a backend error naming the code; the segment stays.
        a.free(x)
        a.release_pool(pool, device=1)
        host.free_code = 5
        with pytest.raises(ccalloc.BackendError, match=r"its free returned 5"):
            a.empty_cache()
        assert a.pool_usage(pool, device=1)["reserved_bytes"] == 20 * MiB
        host.free_code = 0
        a.empty_cache()
        assert not host.live
        # The failing malloc is tried twice: no graph capture runs, so the
        # scope does not stop the retry after the cache is freed (issue 16).
        assert [c[0] for c in host.calls] == ["malloc", "malloc", "malloc", "free", "free"]
        assert {c[2] for c in host.calls} == {1}


def test_pool_bad_arguments(sim):
    pool = sim.new_pool_id()
    with pytest.raises(ccalloc.InvalidArgumentError, match="names the default pool"):
        sim.create_pool((0, 0))
    for bad, error, message in (((1,), ccalloc.InvalidArgumentError, "id must be a pool id, .* got 1 items"),
                                ((1, 2, 3), ccalloc.InvalidArgumentError, "id must be a pool id, .* got 3 items"),
                                ((1, -1), ccalloc.InvalidArgumentError, r"id\[1\] must be an integer from 0 to"),
                                ("12", TypeError, "id must be a pool id, a pair .* got str '12'"),
                                ((1.5, 0), TypeError, r"id\[0\] must be an integer, got float 1.5"),
                                ((True, 0), TypeError, r"id\[0\] must be an integer, got bool"),
                                ((1 << 64, 0), ccalloc.InvalidArgumentError, r"id\[0\] must be an integer from 0"),
                                (None, TypeError, "id must be a pool id"), (iter((1, 2)), TypeError, "id must be"),
                                ({1: 0, 2: 0}, TypeError, "id must be a pool id")):
        for call in (sim.create_pool, sim.release_pool, sim.pool_use_count, sim.begin_allocate_to_pool,
                     sim.end_allocate_to_pool, sim.pool_usage):
            with pytest.raises(error, match=f"^ccalloc: {message}"):
                call(bad)
    assert sim.pool_use_count((1, 2)) == 0 and sim.pool_use_count([pool[0], 0]) == 0, "nothing was created"
    with pytest.raises(ccalloc.InvalidArgumentError, match="must be None or a pair"):
        sim.create_pool(pool, segment_allocator=(1,))
    with pytest.raises(ccalloc.InvalidArgumentError, match="segment free function must be an address"):
        sim.create_pool(pool, segment_allocator=(1234, "free"))
    with pytest.raises(ccalloc.InvalidArgumentError, match="segment malloc function address is 0"):
        sim.create_pool(pool, segment_allocator=(0, 1234))
    assert sim.pool_use_count(pool) == 0, "nothing was created"
    with pytest.raises(ccalloc.InvalidArgumentError, match="device 1 is not initialized"):
        sim.create_pool(pool, device=1)
    with pytest.raises(ccalloc.InvalidArgumentError, match="has no private pool"):
        sim.release_pool(pool)
    with pytest.raises(ccalloc.InvalidArgumentError, match="has no private pool"):
        sim.begin_allocate_to_pool(pool)
    sim.create_pool(pool)
    with pytest.raises(ccalloc.InvalidArgumentError, match="is not active"):
        sim.end_allocate_to_pool(pool)
    sim.release_pool(pool)
    assert sim.pool_use_count(pool) == 0


def test_nccl_segment_allocator_names_what_it_tried(tmp_path):
    with pytest.raises(OSError, match=r"cannot find ncclMemAlloc.*no such file"):
        ccalloc.nccl_segment_allocator(str(tmp_path / "libnccl.so.2"))
    with pytest.raises(OSError, match=r"no ncclMemAlloc/ncclMemFree \(NCCL older than 2.19\)"):
        ccalloc.nccl_segment_allocator(ccalloc.library_path())  # a library without them
    with pytest.raises(OSError, match=r"libnccl_not_here\.so\.9: .*cannot open"):
        ccalloc.nccl_segment_allocator("libnccl_not_here.so.9")


# ---- the functions for PyTorch's CUDAAllocator interface (python/ccalloc/csrc) ----

def _addr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _check(status):
    if status != 0:
        raise AssertionError(ccalloc._lib.lib().ccalloc_last_error().decode())


def test_pool_stream_filter_with_user_data_is_released(sim):
    lib, L = ccalloc._lib.lib(), ccalloc._lib
    pool = sim.new_pool_id()
    sim.create_pool(pool)
    side = sim.stream_create()
    seen, released = [], []
    filt = L.STREAM_FILTER(lambda ud, stream: seen.append((ud, stream or 0)) or int((stream or 0) == side))
    rel = L.USER_DATA_RELEASE(lambda ud: released.append(ud))
    _check(lib.ccalloc_begin_allocate_to_pool_filter(sim._handle, 0, ccalloc._pool_id(pool), _addr(filt), 77,
                                                     _addr(rel)))
    in_pool = sim.malloc(MiB, stream=side)
    outside = sim.malloc(MiB)
    assert (77, side) in seen and (77, 0) in seen
    assert sim.pool_usage(pool)["allocation_count"] == 1
    out = ctypes.c_int(-1)
    live = (ctypes.c_void_p * 1)(in_pool)
    _check(lib.ccalloc_check_pool_live_allocations(sim._handle, 0, ccalloc._pool_id(pool), live, 1,
                                                   ctypes.byref(out)))
    assert out.value == 1
    _check(lib.ccalloc_check_pool_live_allocations(sim._handle, 0, ccalloc._pool_id(pool), None, 0,
                                                   ctypes.byref(out)))
    assert out.value == 0, "the pool has a live block that was not expected"
    assert released == []
    sim.end_allocate_to_pool(pool)
    assert released == [77], "the user data is released once, at the end"
    # A NULL filter: invalid argument, and the release is still called.
    status = lib.ccalloc_begin_allocate_to_pool_filter(sim._handle, 0, ccalloc._pool_id(pool), None, 5, _addr(rel))
    assert status == 1 and b"filter is NULL" in lib.ccalloc_last_error()
    assert released == [77, 5]
    sim.free(in_pool)
    sim.free(outside)
    sim.stream_destroy(side)


def test_pool_source_with_user_data_and_checkpoints(sim):
    lib, L = ccalloc._lib.lib(), ccalloc._lib
    libc = ctypes.CDLL(None)
    libc.aligned_alloc.restype = ctypes.c_void_p
    libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    calls = []

    def seg_malloc(ud, out, size):
        calls.append(("malloc", ud, size))
        out[0] = libc.aligned_alloc(4096, size)
        return 0

    def seg_free(ud, ptr):
        calls.append(("free", ud, 0))
        libc.free(ptr)
        return 0

    m, f = L.SEGMENT_MALLOC_UD(seg_malloc), L.SEGMENT_FREE_UD(seg_free)
    pool = sim.new_pool_id()
    pid = ccalloc._pool_id(pool)
    _check(lib.ccalloc_create_pool_with_source(sim._handle, 0, pid, _addr(m), _addr(f), 42))
    _check(lib.ccalloc_set_no_split(sim._handle, 0, pid, 0))
    _check(lib.ccalloc_set_use_on_oom(sim._handle, 0, pid, 0))
    sim.begin_allocate_to_pool(pool)
    a = sim.malloc(3 * MiB)
    sim.end_allocate_to_pool(pool)
    assert calls == [("malloc", 42, 20 * MiB)]
    # Checkpoint with `a` live; free it; restoring creates it again.
    cp = ctypes.c_void_p()
    _check(lib.ccalloc_get_checkpoint_state(sim._handle, 0, pid, ctypes.byref(cp)))
    sim.free(a)
    blocks = []
    on_block = L.CHECKPOINT_BLOCK(lambda ud, ptr, size, created: blocks.append((ud, ptr, size, created)))
    _check(lib.ccalloc_set_checkpoint_pool_state(sim._handle, 0, cp, _addr(on_block), 9))
    assert blocks == [(9, a, 3 * MiB, 1)], blocks
    assert sim.pool_usage(pool)["allocation_count"] == 1
    sim.free(a)  # the caller owns the created block
    lib.ccalloc_pool_checkpoint_destroy(cp)
    lib.ccalloc_pool_checkpoint_destroy(None)
    # NULL functions are refused, nothing created.
    other = ccalloc._pool_id(sim.new_pool_id())
    assert lib.ccalloc_create_pool_with_source(sim._handle, 0, other, None, _addr(f), None) == 1
    assert b"malloc_fn is NULL" in lib.ccalloc_last_error()
    sim.release_pool(pool)
    sim.empty_cache()
    assert calls[-1] == ("free", 42, 0)


def test_enable_peer_access_needs_two_devices(sim):
    lib = ccalloc._lib.lib()
    assert lib.ccalloc_enable_peer_access(sim._handle, 0, 0) == 1


def test_mapping_listener_and_trace_tracker_see_every_change(sim):
    events, entries = [], []
    sim.attach_mapping_listener(events.append)
    sim.attach_trace_tracker(entries.append)
    p = sim.malloc(5 << 20)
    assert [(e["change"], e["reason"], e["size"]) for e in events] == [("map", "pages_mapped", 6 << 20)]
    assert events[0]["expandable"] and events[0]["addr"] <= p
    sim.free(p)
    sim.empty_cache()
    assert [(e["change"], e["reason"]) for e in events[1:]] == [("unmap", "pages_released")]
    actions = [e["action"] for e in entries]
    assert actions[:2] == ["segment_map", "alloc"], actions  # recorded or not: history is off here
    assert "free_requested" in actions and "segment_unmap" in actions


def test_trackers_see_pause_and_resume_when_they_happen(sim):
    events, entries = [], []
    sim.attach_mapping_listener(events.append)
    sim.attach_trace_tracker(entries.append)
    with ccalloc.tag("kv"):
        p = sim.malloc(1 << 20)
    sim.pause("kv")
    assert [e["action"] for e in entries][-2:] == ["segment_unmap", "pause"], entries
    assert events[-1]["change"] == "unmap" and events[-1]["reason"] == "pages_paused"
    sim.resume("kv")
    assert [e["action"] for e in entries][-2:] == ["segment_map", "resume"], entries
    assert events[-1]["change"] == "map" and events[-1]["reason"] == "pages_resumed"
    sim.free(p)


def test_a_raising_mapping_listener_is_dropped(sim, capfd):
    def bad(_event):
        raise ValueError("listener failed")

    sim.attach_mapping_listener(bad)
    sim.free(sim.malloc(1 << 20))
    assert "a mapping listener raised (ignored)" in capfd.readouterr().err


_DAEMON_AT_EXIT = """
import ccalloc, sys, threading, time
mode = sys.argv[1]
a = ccalloc.Allocator(backend='sim', capacity_bytes=256 << 20)
if mode == 'tracker':
    a.attach_trace_tracker(lambda e: None)
elif mode == 'history':
    a.record_history(True, 1000, context='python')
elif mode == 'listener':
    a.attach_mapping_listener(lambda e: None)
else:
    a.attach_out_of_memory_observer(lambda *args: None)
def spin():
    while True:
        try:
            if mode == 'oom':
                a.malloc(1 << 40)
            a.free(a.malloc(3 << 20))
            a.empty_cache()
        except ccalloc.OutOfMemoryError:
            pass
for _ in range(2):
    threading.Thread(target=spin, daemon=True).start()
time.sleep(0.1)
print('exit')
"""


@pytest.mark.parametrize("mode", ["tracker", "history", "listener", "oom"])
def test_daemon_threads_allocating_at_interpreter_exit(mode):
    # CPython ends a daemon thread that calls into Python while the
    # interpreter finalizes (pthread_exit): inside a callback that stopped
    # the process ("FATAL: exception not rethrown"). The package stops the
    # library's callbacks at exit (ccalloc_set_observers_enabled).
    env = dict(os.environ, PYTHONPATH=str(ccalloc.__path__[0].rsplit(os.sep, 1)[0]))
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", _DAEMON_AT_EXIT, mode], env=env, capture_output=True,
                             text=True, timeout=60)
        assert (out.returncode, out.stdout.strip()) == (0, "exit"), out.stderr[-2000:]

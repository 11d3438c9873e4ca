"""The Python API's argument handling: a closed Allocator refuses every call,
and every integer, string and number is checked before ctypes converts it
(ctypes wraps out-of-range integers silently and stops C strings at a NUL).

The property test draws arguments at random (seeded: a failure names its
seed and repeats) from values that ctypes mishandles and checks that each
call either succeeds with a value in range or raises TypeError /
InvalidArgumentError naming the argument, leaving the allocator's
statistics as they were."""
import ctypes
import os
import random
import re

import pytest

import ccalloc

MiB = 1 << 20
U64 = 1 << 64


class Index:
    """An integer-like object (as numpy's integers are): accepted through __index__."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value


# ---- a closed Allocator ------------------------------------------------------------------

# Every public method with arguments it would accept while open.
CALLS = {
    "init": (1,),
    "mem_get_info": (),
    "malloc": (MiB,),
    "free": (0,),
    "raw_alloc": (MiB,),
    "record_stream": (0, 0),
    "get_base_allocation": (4096,),
    "empty_cache": (),
    "cache_info": (),
    "set_memory_fraction": (0.5,),
    "get_memory_fraction": (),
    "enable": (True,),
    "memory_stats": (),
    "stat": ("allocated_bytes.all.current",),
    "reset_peak_stats": (),
    "reset_accumulated_stats": (),
    "set_config": ("max_split_size_mb:64",),
    "get_config": (),
    "record_history": (True, 10),
    "snapshot_json": (),
    "snapshot": (),
    "attach_out_of_memory_observer": (lambda *a: None,),
    "new_pool_id": (),
    "create_pool": ((7, 0),),
    "release_pool": ((7, 0),),
    "pool_use_count": ((7, 0),),
    "begin_allocate_to_pool": ((7, 0),),
    "end_allocate_to_pool": ((7, 0),),
    "pool_usage": ((0, 0),),
    "stream_create": (),
    "stream_destroy": (0,),
    "stream_synchronize": (0,),
    "pause": ("t",),
    "resume": ("t",),
    "tag_usage": ("t",),
    "attach_trace_tracker": (lambda *a: None,),
    "attach_mapping_listener": (lambda *a: None,),
    "share_ipc_handle": (4096,),
    "share_ipc_handle_bytes": (4096,),
    "open_ipc_handle": (b"x",),
    "open_ipc_handle_bytes": (b"x",),
    "close_ipc_handle": (4096,),
    "reclaim_ipc_exports": (),
    "ipc_export_status": (4096,),
}
PROPERTIES = ("initialized", "device_count", "current_device", "backend_name", "is_enabled")


def test_every_public_method_is_listed():
    public = {n for n in dir(ccalloc.Allocator) if not n.startswith("_")}
    unlisted = public - set(CALLS) - set(PROPERTIES) - {"close", "closed", "process_wide", "dump_snapshot"}
    assert not unlisted, f"add {sorted(unlisted)} to CALLS"


def test_a_closed_allocator_refuses_every_call(tmp_path):
    process_wide = ccalloc.process_allocator()
    before = process_wide.memory_stats(0)
    config_before = process_wide.get_config()
    a = ccalloc.Allocator("sim", config="")
    p = a.malloc(MiB)
    a.close()
    assert a.closed and not process_wide.closed
    for name, args in CALLS.items():
        with pytest.raises(ccalloc.InvalidArgumentError, match="this Allocator is closed"):
            getattr(a, name)(*args)
    for name in PROPERTIES:
        with pytest.raises(ccalloc.InvalidArgumentError, match="this Allocator is closed"):
            getattr(a, name)
    with pytest.raises(ccalloc.InvalidArgumentError, match="this Allocator is closed"):
        a.dump_snapshot(str(tmp_path / "s.pickle"))
    with pytest.raises(ccalloc.InvalidArgumentError, match="this Allocator is closed"):
        a.free(p)  # its own pointer: not "not a live allocation" of the process-wide one
    a.close()  # closing twice stays a no-op
    # Nothing reached the process-wide allocator.
    assert process_wide.memory_stats(0) == before
    assert process_wide.get_config() == config_before


def test_an_allocator_cannot_be_copied_or_pickled():
    import copy
    import pickle

    with ccalloc.Allocator("sim", config="") as a:
        p = a.malloc(MiB)
        for make in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot be"):
                make(a)
        # The original still works (a copy's __del__ once closed its C allocator).
        assert a.memory_stats(0)["allocated_bytes.all.current"] >= MiB
        a.free(p)


def test_a_tag_with_a_nul_character_is_refused():
    with pytest.raises(ccalloc.InvalidArgumentError, match="NUL"):
        with ccalloc.tag("a\0b"):
            pass
    assert ccalloc.current_tag() == "default"


def test_a_string_device_is_refused_naming_it():
    for bad in ("x", "cuda:0"):
        with pytest.raises(ccalloc.InvalidArgumentError, match="device must be an int or a torch.device"):
            ccalloc.memory_allocated(bad)


def test_leaving_with_closes():
    with ccalloc.Allocator("sim", config="") as a:
        a.malloc(MiB)
    with pytest.raises(ccalloc.InvalidArgumentError, match="closed"):
        a.malloc(MiB)


def test_close_waits_for_calls_on_other_threads():
    """close() while other threads malloc and free: they finish or get the
    closed error; nothing uses the destroyed allocator (a segfault under
    ctypes, which releases the GIL during each call)."""
    import threading
    import time

    for _ in range(3):
        a = ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="")
        errors = []
        done = []

        def work():
            try:
                while True:
                    a.free(a.malloc(4096))
            except ccalloc.InvalidArgumentError as e:
                errors.append(str(e))
            done.append(1)

        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        a.close()
        for t in threads:
            t.join(30)
        assert len(done) == 3
        assert errors and all("this Allocator is closed" in e for e in errors), errors


def test_close_inside_a_callback_is_refused():
    a = ccalloc.Allocator("sim", capacity_bytes=8 * MiB, config="")
    seen = []

    def observer(device, size, total, free):
        try:
            a.close()
        except ccalloc.InvalidArgumentError as e:
            seen.append(str(e))

    a.attach_out_of_memory_observer(observer)
    with pytest.raises(ccalloc.OutOfMemoryError):
        a.malloc(64 * MiB)
    assert seen and "from inside one of its own calls" in seen[0]
    assert not a.closed
    a.close()
    assert a.closed


# ---- the values ctypes would wrap or truncate ---------------------------------------------

def test_the_reproducers_raise_naming_the_argument():
    with ccalloc.Allocator("sim", config="") as a:
        cases = [
            (lambda: a.malloc(U64 + 4096), ccalloc.InvalidArgumentError, "size_bytes .* got 18446744073709555712"),
            (lambda: a.malloc(U64), ccalloc.InvalidArgumentError, "size_bytes"),
            (lambda: a.malloc(-1), ccalloc.InvalidArgumentError, "size_bytes .* got -1"),
            (lambda: a.malloc(1.9), TypeError, "size_bytes must be an integer, got float"),
            (lambda: a.malloc(4096, device=1 << 32), ccalloc.InvalidArgumentError, "device .* got 4294967296"),
            (lambda: a.record_history(True, -1), ccalloc.InvalidArgumentError, "max_entries .* got -1"),
            (lambda: a.record_history(True, 0), ccalloc.InvalidArgumentError,
             "max_entries must be an integer from 1 to 18446744073709551615, got 0"),
            (lambda: a.set_config("max_split_size_mb:128\0bogus:1"), ccalloc.InvalidArgumentError,
             "config contains a NUL character at index 21"),
            (lambda: a.set_config(None), TypeError, "config must be a str, got NoneType"),
            (lambda: a.set_memory_fraction(float("nan")), ccalloc.InvalidArgumentError, "fraction must be a finite"),
            (lambda: a.set_memory_fraction("0.5"), TypeError, "fraction must be a real number"),
            (lambda: a.stat("allocated_bytes.all.current\0x"), ccalloc.InvalidArgumentError, "name contains a NUL"),
            (lambda: a.stream_synchronize(-1), ccalloc.InvalidArgumentError, "stream .* got -1"),
            (lambda: ccalloc.Allocator("sim", capacity_bytes=-1), ccalloc.InvalidArgumentError,
             "capacity_bytes .* got -1"),
            # 0 is the C API's "default size": a size computed as 0 made a 141 GB device.
            (lambda: ccalloc.Allocator("sim", capacity_bytes=0), ccalloc.InvalidArgumentError,
             "capacity_bytes must be an integer from 1 to .* got 0"),
            (lambda: ccalloc.Allocator("sim", devices=1 << 32), ccalloc.InvalidArgumentError, "devices .* got"),
            (lambda: ccalloc.Allocator("sim", config="a\0b"), ccalloc.InvalidArgumentError, "config contains a NUL"),
        ]
        for call, error, pattern in cases:
            with pytest.raises(error, match=pattern):
                call()
        p = a.malloc(4096)
        with pytest.raises(ccalloc.InvalidArgumentError, match="ptr"):
            a.free(p + U64)  # would have freed p
        assert a.stat("allocation.all.current") == 1
        a.free(Index(p))
        assert a.stat("allocation.all.current") == 0
        assert a.stat("allocation.all.allocated") == 1  # none of the refused calls allocated


def test_dump_snapshot_takes_a_path_only_and_names_it(tmp_path):
    """An int would be taken by open() as a file descriptor: the pickle went
    into the caller's file and the descriptor was closed."""
    precious = tmp_path / "precious"
    precious.write_bytes(b"precious")
    fd = os.open(precious, os.O_RDWR)
    try:
        with ccalloc.Allocator("sim", config="") as a:
            for bad in (fd, 3.0, None, b"bytes-path", [str(tmp_path / "x")]):
                with pytest.raises(TypeError, match="dump_snapshot: path must be a str or os.PathLike"):
                    a.dump_snapshot(bad)
            os.write(fd, b"!")  # still open
            with pytest.raises(IsADirectoryError, match=re.escape(f"ccalloc: dump_snapshot: cannot write '{tmp_path}'")):
                a.dump_snapshot(str(tmp_path))
            a.dump_snapshot(tmp_path / "s.pickle")  # os.PathLike
            assert (tmp_path / "s.pickle").read_bytes()[:1] == b"\x80"
    finally:
        os.close(fd)
    assert precious.read_bytes() == b"!recious"


def test_context_frames_of_any_text_and_bad_recorders_say_so(capfd):
    """Frames whose file names are not valid UTF-8 keep their place (the
    library writes U+FFFD); a recorder returning what is not frames is
    reported once per call in the package's words, never as a raw ctypes
    traceback."""
    bad_name = os.fsdecode(b"/tmp/d\xff/mod.py")  # undecodable bytes arrive as surrogates
    with ccalloc.Allocator("sim", config="") as a:
        a.record_history(True, 100, context=lambda: [("f", bad_name, 7), ("g", "ok.py", 9)])
        a.free(a.malloc(4096))
        frames = a.snapshot()["device_traces"][0][0]["frames"]
        assert [(f["name"], f["line"]) for f in frames] == [("f", 7), ("g", 9)]
        assert frames[0]["filename"] == "/tmp/d\ufffd/mod.py"
        assert frames[1]["filename"] == "ok.py"
        for bad in (lambda: 5, lambda: [("f", "x.py")], lambda: [("f", "x.py", 1 << 70)], lambda: [("f", "x.py", -1)]):
            a.record_history(True, 100, context=bad)
            a.free(a.malloc(4096))
            err = capfd.readouterr().err
            assert "ccalloc: a context recorder raised (ignored; this call has no context)" in err, err
            assert "Exception ignored on calling ctypes callback" not in err, err
        assert a.stat("allocation.all.current") == 0


def test_a_library_that_is_not_ccalloc_is_named_not_an_attribute_error():
    import _ctypes
    import subprocess
    import sys
    other = _ctypes.__file__  # a shared library, not libccalloc.so
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(ccalloc.__file__)))
    env = dict(os.environ, CCALLOC_LIBRARY=other,
               PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", "import ccalloc; ccalloc.Allocator('sim')"], env=env,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert f"{other}: lacks " in out.stderr and "not libccalloc.so" in out.stderr, out.stderr
    assert "AttributeError" not in out.stderr, out.stderr


# ---- yes/no arguments: only a bool ----------------------------------------------------------

def test_enable_false_as_text_is_refused_not_read_as_true():
    with ccalloc.Allocator("sim", config="") as a:
        a.enable(False)
        for bad in ("False", "no", "0", -1, U64, 0, 1, None, 0.0):
            with pytest.raises(TypeError, match=f"ccalloc: enabled must be a bool \\(True or False\\), "
                                                f"got {type(bad).__name__} "):
                a.enable(bad)
        assert a.is_enabled is False
        a.enable(True)
        assert a.is_enabled is True
        with pytest.raises(TypeError, match="ccalloc: enabled must be a bool"):
            a.record_history("False", 10)
        a.free(a.malloc(4096))
        assert a.snapshot()["device_traces"] == [[]], "nothing recorded"
        with pytest.raises(TypeError, match="ccalloc: keep_contents must be a bool"):
            a.pause("t", keep_contents="no")


class NumpyBool:
    """Stands in for numpy.bool_ (numpy is not needed by the tests): accepted as a bool."""

    def __init__(self, value):
        self.value = value

    def __bool__(self):
        return self.value


NumpyBool.__module__ = "numpy"
NumpyBool.__name__ = "bool_"

# Every yes/no parameter of the public API: (label, call with the value).
BOOL_ARGS = {
    "enable.enabled": lambda a, v: a.enable(v),
    "record_history.enabled": lambda a, v: a.record_history(v, 10),
    "record_history.clear": lambda a, v: a.record_history(True, 10, clear=v),
    "snapshot_json.include_traces": lambda a, v: a.snapshot_json(v),
    "snapshot.include_traces": lambda a, v: a.snapshot(include_traces=v),
    "pause.keep_contents": lambda a, v: a.pause("t", keep_contents=v),
    "begin_allocate_to_pool.all_streams": lambda a, v: a.begin_allocate_to_pool((1, 1), all_streams=v),
    "ccalloc.record_history.enabled": lambda a, v: ccalloc.record_history(v, 10),
    "ccalloc.memory_snapshot.include_traces": lambda a, v: ccalloc.memory_snapshot(v),
    "ccalloc.pause.keep_contents": lambda a, v: ccalloc.pause("t", keep_contents=v),
}


@pytest.mark.parametrize("seed", range(2))
def test_random_non_bools_are_refused_naming_the_argument(seed):
    rng = random.Random(seed)
    bad_values = ["False", "True", "no", "0", "", 0, 1, -1, 2, U64, U64 + 1, 0.0, 1.0, None, b"", [], [False],
                  Index(1), Index(0), NumpyBool]
    process_wide = ccalloc.process_allocator()
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        before, enabled = a.memory_stats(0), a.is_enabled
        wide_snapshot = process_wide.snapshot_json()
        for _ in range(200):
            label = rng.choice(sorted(BOOL_ARGS))
            value = rng.choice(bad_values)
            name = label.split(".")[-1]
            with pytest.raises(TypeError) as info:
                BOOL_ARGS[label](a, value)
            assert f"ccalloc: {name} must be a bool (True or False), got {type(value).__name__}" in str(info.value), \
                (seed, label, value, str(info.value))
        assert a.memory_stats(0) == before
        assert a.is_enabled == enabled
        assert a.snapshot()["device_traces"] == [[]]
        assert process_wide.snapshot_json() == wide_snapshot


def test_bools_and_numpy_bools_work():
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        for value, expected in ((NumpyBool(False), False), (True, True), (False, False), (NumpyBool(True), True)):
            a.enable(value)
            assert a.is_enabled is expected
        a.record_history(NumpyBool(True), 10, clear=NumpyBool(False))
        a.free(a.malloc(4096))
        actions = [t["action"] for t in a.snapshot(include_traces=NumpyBool(True))["device_traces"][0]]
        assert "alloc" in actions and "free_completed" in actions, actions
        assert a.snapshot(include_traces=NumpyBool(False)) == a.snapshot(include_traces=False)
        a.record_history(False)


def test_context_frames_of_the_wrong_types_are_refused_not_stringified(capfd):
    """A recorder's frames with bytes or None where text belongs became
    {'name': "b'n'", 'filename': 'None'}: the call now has no context and the
    reason is printed."""
    with ccalloc.Allocator("sim", config="") as a:
        for frames, message in (([(b"n", "f.py", 1)], "a frame's name must be a str, got bytes b'n'"),
                                ([("n", None, 1)], "a frame's filename must be a str, got NoneType None"),
                                ([("n", "f.py", "1")], "a frame's line must be an int, got str '1'"),
                                ([("n", "f.py", True)], "a frame's line must be an int, got bool True")):
            a.record_history(True, 100, context=lambda frames=frames: frames, clear=True)
            a.free(a.malloc(4096))
            err = capfd.readouterr().err
            assert "ccalloc: a context recorder raised (ignored; this call has no context)" in err, err
            assert message in err, err
            traces = a.snapshot()["device_traces"][0]
            assert traces and all(not t.get("frames") for t in traces), traces
        a.record_history(True, 100, context=lambda: [("n", "f.py", Index(3))], clear=True)
        a.free(a.malloc(4096))
        frames = a.snapshot()["device_traces"][0][0]["frames"]
        assert frames == [{"name": "n", "filename": "f.py", "line": 3}]


# ---- property test: random arguments --------------------------------------------------------

def bad_integers(rng, low, high):
    """Integers out of [low, high] and things that are no integers."""
    values = [
        low - 1, low - rng.randrange(1, 1 << 70), high + 1, high + rng.randrange(1, 1 << 70), U64, U64 + 4096,
        -U64, 1 << 32, 1 << 31, 1.0, 1.9, float("nan"), float("inf"), True, False, None, "1", b"1", [1],
        Index(high + 1), Index(low - 1),
    ]
    return rng.choice([v for v in values if type(v) is not int or not low <= v <= high])


INT_ARGS = {  # (method, argument position or keyword, low, high, make the other arguments)
    "malloc.size_bytes": (lambda a, v: a.malloc(v), 0, U64 - 1),
    "malloc.device": (lambda a, v: a.malloc(4096, device=v), 0, (1 << 31) - 1),
    "malloc.stream": (lambda a, v: a.malloc(4096, stream=v), 0, U64 - 1),
    "raw_alloc.size_bytes": (lambda a, v: a.raw_alloc(v), 0, U64 - 1),
    "free.ptr": (lambda a, v: a.free(v), 0, U64 - 1),
    "get_base_allocation.ptr": (lambda a, v: a.get_base_allocation(v), 0, U64 - 1),
    "record_stream.ptr": (lambda a, v: a.record_stream(v, 0), 0, U64 - 1),
    "cache_info.device": (lambda a, v: a.cache_info(v), 0, (1 << 31) - 1),
    "mem_get_info.device": (lambda a, v: a.mem_get_info(v), 0, (1 << 31) - 1),
    "memory_stats.device": (lambda a, v: a.memory_stats(v), 0, (1 << 31) - 1),
    "stat.device": (lambda a, v: a.stat("allocated_bytes.all.current", v), 0, (1 << 31) - 1),
    "set_memory_fraction.device": (lambda a, v: a.set_memory_fraction(1.0, v), 0, (1 << 31) - 1),
    "record_history.max_entries": (lambda a, v: a.record_history(True, v), 1, U64 - 1),
    "create_pool.device": (lambda a, v: a.create_pool((99, 0), v), 0, (1 << 31) - 1),
    "stream_create.device": (lambda a, v: a.stream_create(v), 0, (1 << 31) - 1),
    "stream_synchronize.stream": (lambda a, v: a.stream_synchronize(v), 0, U64 - 1),
}


@pytest.mark.parametrize("seed", range(4))
def test_random_bad_integers_are_refused_naming_the_argument(seed):
    rng = random.Random(seed)
    with ccalloc.Allocator("sim", devices=2, capacity_bytes=256 * MiB, config="") as a:
        before = a.memory_stats(0)
        for _ in range(300):
            label = rng.choice(sorted(INT_ARGS))
            call, low, high = INT_ARGS[label]
            name = label.split(".")[1]
            value = bad_integers(rng, low, high)
            while value is None and name in ("ptr", "stream"):  # None: NULL, the default stream
                value = bad_integers(rng, low, high)
            with pytest.raises((TypeError, ccalloc.InvalidArgumentError)) as info:
                call(a, value)
            assert type(info.value) in (TypeError, ccalloc.InvalidArgumentError), (seed, label, value)
            assert f"ccalloc: {name} must be" in str(info.value), (seed, label, value, str(info.value))
        a.record_history(False)
        after = a.memory_stats(0)
        for key in ("allocation.all.allocated", "reserved_bytes.all.current", "num_device_alloc"):
            assert after[key] == before[key], (seed, key)


@pytest.mark.parametrize("seed", range(2))
def test_random_good_integers_work(seed):
    """In-range sizes (as int or __index__ objects) allocate exactly that much
    or raise OutOfMemoryError; the statistics add up."""
    rng = random.Random(seed)
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        live = {}
        for _ in range(200):
            if live and rng.random() < 0.4:
                p = rng.choice(sorted(live))
                a.free(Index(p) if rng.random() < 0.5 else p)
                del live[p]
                continue
            size = rng.choice([0, 1, 511, 512, 4096, MiB, 3 * MiB, rng.randrange(1, 96 * MiB), U64 - 1])
            try:
                p = a.malloc(Index(size) if rng.random() < 0.5 else size)
            except ccalloc.OutOfMemoryError:
                assert size > 8 * MiB, size
                continue
            if size:
                assert p and p not in live
                live[p] = size
            else:
                assert p == 0
        assert a.stat("allocation.all.current") == len(live)
        assert a.stat("requested_bytes.all.current") == sum(live.values())


@pytest.mark.parametrize("seed", range(2))
def test_random_strings_and_numbers(seed):
    rng = random.Random(seed)
    with ccalloc.Allocator("sim", config="") as a:
        config = a.get_config()
        for _ in range(100):
            bad = rng.choice([None, 5, 1.5, b"max_split_size_mb:64", ["x"], "max_split_size_mb:64\0" + "x" * rng.randrange(5),
                              "max_split_size_mb:6\udcff", "\ud800"])
            with pytest.raises((TypeError, ccalloc.InvalidArgumentError), match="ccalloc: config "):
                a.set_config(bad)
            with pytest.raises((TypeError, ccalloc.InvalidArgumentError), match="ccalloc: name "):
                a.stat(bad)
            fraction = rng.choice([None, "0.5", float("nan"), float("inf"), -float("inf"), True, [0.5], 10**400,
                                   -10**400])
            with pytest.raises((TypeError, ccalloc.InvalidArgumentError), match="ccalloc: fraction "):
                a.set_memory_fraction(fraction)
        assert a.get_config() == config
        assert a.get_memory_fraction() == 1.0


def test_callbacks_must_be_callable():
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB) as a:
        for method in ("attach_out_of_memory_observer", "attach_trace_tracker", "attach_mapping_listener"):
            with pytest.raises(TypeError, match="must be callable, got int 5"):
                getattr(a, method)(5)


def test_a_device_count_is_bounded_at_once():
    # 2**20 simulated devices used to be accepted and exhaust the host (the
    # peer table alone is devices**2); now refused before the C call.
    assert ccalloc.MAX_DEVICE_COUNT == 1024
    for count in (1025, 0, 1 << 20):  # 1025 first: without the bound, 2**20 would exhaust the host
        with pytest.raises(ccalloc.InvalidArgumentError,
                           match=f"ccalloc: devices must be an integer from 1 to 1024, got {count}$"):
            ccalloc.Allocator("sim", devices=count)
    with ccalloc.Allocator("sim") as a:
        with pytest.raises(ccalloc.InvalidArgumentError,
                           match="ccalloc: device_count must be an integer from 1 to 1024, got 1048576$"):
            a.init(1 << 20)
        with pytest.raises(ccalloc.InvalidArgumentError, match="ccalloc: ccalloc_init\\(2\\): the 'sim' backend"):
            a.init(2)


def test_record_stream_of_a_pointer_not_allocated_is_ignored_as_in_c():
    # SPEC F11: a pointer the allocator did not hand out is ignored (PyTorch's
    # recordStream does the same); Python, C and C++ agree: no error.
    from ccalloc import _lib
    with ccalloc.Allocator("sim") as a:
        assert _lib.lib().ccalloc_record_stream(a._h, ctypes.c_void_p(999), None) == 0
        assert a.record_stream(999, 0) is None
        p = a.malloc(4096)
        a.record_stream(p + 999 * 4096 * 1024, 0)  # far past any block: ignored too
        a.free(p)
        assert a.stat("allocated_bytes.all.current") == 0


# ---- history contexts: callables kept exactly as long as the library may call them ------------

def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_record_history_cycles_keep_no_callables_and_memory_stays_flat():
    """Each record_history with a context kept its callbacks forever:
    3,000 on/off cycles grew the process by 10 MB."""
    from ccalloc import _allocator
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        def cycle():
            a.record_history(True, 100, context=lambda: [("f", "x.py", 1)])
            a.free(a.malloc(4096))
            a.record_history(False)
        for _ in range(300):
            cycle()
        before = _rss_bytes()
        configs_before = set(getattr(_allocator, "_configs", ()))
        for _ in range(3000):
            cycle()
        grown = _rss_bytes() - before
        assert grown < 2 * MiB, f"{grown} bytes more after 3,000 cycles"
        assert len(a._observers) == 0
        assert set(_allocator._configs) <= configs_before, "replaced configurations are kept"


def test_contexts_recorded_before_a_switch_keep_their_frames_until_released():
    from ccalloc import _allocator
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        a.record_history(True, 100, context=lambda: [("first", "a.py", 1)])
        first = a._history.number
        p = a.malloc(4096)
        a.record_history(True, 100, context=lambda: [("second", "b.py", 2)])
        second = a._history.number
        q = a.malloc(8192)
        assert first in _allocator._configs, "the first configuration's contexts are still held"
        snap = a.snapshot()
        frames = {b["address"]: [f["name"] for f in b["frames"]] for s in snap["segments"] for b in s["blocks"]
                  if b["state"] == "active_allocated"}
        assert frames == {p: ["first"], q: ["second"]}
        assert [[f["name"] for f in e["frames"]] for e in snap["device_traces"][0] if e["action"] == "alloc"] == \
            [["first"], ["second"]]
        a.free(p)
        a.record_history(True, 100, context=lambda: [("third", "c.py", 3)], clear=True)
        assert first not in _allocator._configs, "every context of the first configuration was released"
        assert second in _allocator._configs  # q's block holds its context
        a.free(q)
        assert second not in _allocator._configs
        third = a._history.number
        assert third in _allocator._configs
    assert third not in _allocator._configs, "close() released the contexts and the configuration"


def test_switching_contexts_while_other_threads_allocate():
    """Threads allocating while record_history switches recorders: each
    block gets a recorder's frames or none, and once history stops every
    configuration is forgotten."""
    import threading
    from ccalloc import _allocator
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        configs_before = set(_allocator._configs)
        stop = threading.Event()

        def allocate():
            while not stop.is_set():
                a.free(a.malloc(4096))

        threads = [threading.Thread(target=allocate) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            for i in range(300):
                a.record_history(True, 50, context=lambda i=i: [(f"f{i}", "x.py", i)], when="all")
        finally:
            stop.set()
            for t in threads:
                t.join()
        names = {f["name"] for e in a.snapshot()["device_traces"][0] for f in e.get("frames", ())}
        assert names and all(n.startswith("f") for n in names)
        a.record_history(False)
        assert set(_allocator._configs) <= configs_before
        assert a.stat("allocation.all.current") == 0


def test_a_pool_id_is_a_pair_of_integers_not_any_iterable():
    """create_pool("12") created pool (1, 2) and create_pool((1.5, 0)) pool (1, 0)."""
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        for bad in ("12", (1.5, 0), b"\x01\x02", range(1, 3), {1, 2}):
            with pytest.raises((TypeError, ccalloc.InvalidArgumentError), match="^ccalloc: id"):
                a.create_pool(bad)
        assert a.pool_use_count((1, 2)) == 0 and a.pool_use_count((1, 0)) == 0, "a refused id created a pool"
        a.create_pool([3, 0])  # a list is a pair too (snapshots give lists)
        assert a.pool_use_count((3, 0)) == 1


def test_strings_numbers_and_actions_of_the_hostile_trial():
    """A str skip_actions was split into characters ("unknown action 'f'"),
    a huge int fraction raised a bare OverflowError, a lone surrogate a
    bare UnicodeEncodeError, a huge int a ValueError of str()."""
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        a.record_history(True, 100, skip_actions="free_requested")
        a.free(a.malloc(4096))
        assert [e["action"] for e in a.snapshot()["device_traces"][0]] == ["segment_map", "alloc", "free_completed"]
        a.record_history(True, 100, skip_actions="free_requested,segment_map", clear=True)
        a.free(a.malloc(4096))
        assert [e["action"] for e in a.snapshot()["device_traces"][0]] == ["alloc", "free_completed"]
        cases = [
            (lambda: a.record_history(True, 100, skip_actions=[1]), TypeError,
             "ccalloc: skip_actions must be a str or a list of str, got an item int 1"),
            (lambda: a.record_history(True, 100, skip_actions=b"oom"), TypeError, "ccalloc: skip_actions must be"),
            (lambda: a.record_history(True, 100, skip_actions="bogus"), ccalloc.InvalidArgumentError,
             "unknown action 'bogus'"),
            (lambda: a.record_history(True, 100, when=["all"]), ccalloc.InvalidArgumentError, "when must be one of"),
            (lambda: a.record_history(True, 100, context=5), ccalloc.InvalidArgumentError,
             "context must be None, 'python' or a callable, got 5"),
            (lambda: a.set_memory_fraction(10**400), ccalloc.InvalidArgumentError,
             "ccalloc: fraction must be a finite number, got an integer of 1329 bits, beyond a double's range"),
            (lambda: a.set_config("\udcff"), ccalloc.InvalidArgumentError,
             "ccalloc: config is not valid Unicode text: '\\\\udcff' at index 0 is a lone surrogate"),
            (lambda: a.stat("x\ud800"), ccalloc.InvalidArgumentError, "ccalloc: name is not valid Unicode text"),
            (lambda: a.tag_usage("\udcff"), ccalloc.InvalidArgumentError, "ccalloc: tag is not valid Unicode text"),
            (lambda: a.pause(["\udcff"]), ccalloc.InvalidArgumentError, "ccalloc: tag is not valid Unicode text"),
            (lambda: ccalloc.tag("\udcff").__enter__(), ccalloc.InvalidArgumentError,
             "ccalloc: tag is not valid Unicode text"),
            (lambda: a.malloc(10**5000), ccalloc.InvalidArgumentError,
             "ccalloc: size_bytes must be an integer from 0 to 18446744073709551615, got an integer of 16610 bits"),
            (lambda: a.free(Index(-10**5000)), ccalloc.InvalidArgumentError, "ccalloc: ptr must be an integer"),
            (lambda: a.create_pool((10**5000, 0)), ccalloc.InvalidArgumentError, r"ccalloc: id\[0\] must be"),
            (lambda: ccalloc.Allocator(backend=["sim"]), ccalloc.InvalidArgumentError, "ccalloc: unknown backend"),
        ]
        for call, error, pattern in cases:
            with pytest.raises(error, match=pattern) as info:
                call()
            assert type(info.value) is error, (pattern, info.value)
        assert ccalloc.current_tag() == "default"
        a.record_history(True, 100, context=lambda: [("f\ud800", "x\udcff.py", 1)], clear=True)
        a.free(a.malloc(4096))
        frames = a.snapshot()["device_traces"][0][0]["frames"]
        assert [(f["name"], f["filename"]) for f in frames] == [("f?", "x\ufffd.py")]
        assert a.stat("allocation.all.current") == 0

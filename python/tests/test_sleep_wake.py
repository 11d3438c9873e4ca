"""Sleep and wake from Python (SPEC S1-S5) on the simulated device: the tag
scope, pause and resume on an Allocator, and ccalloc.torch's
torch_memory_saver-shaped region / pause / resume (no torch needed: they act
on the process-wide allocator)."""

import ctypes
import threading

import pytest

import ccalloc

MiB = 1 << 20


def test_tag_scope_nests_and_is_per_thread():
    assert ccalloc.current_tag() == "default"
    seen = []
    with ccalloc.tag("py_outer"):
        with ccalloc.tag("py_inner"):
            assert ccalloc.current_tag() == "py_inner"
            t = threading.Thread(target=lambda: seen.append(ccalloc.current_tag()))
            t.start()
            t.join()
        assert ccalloc.current_tag() == "py_outer"
    assert ccalloc.current_tag() == "default"
    assert seen == ["default"]


def test_a_generator_leaving_its_scope_closes_its_own_not_the_callers():
    """A generator's ``with`` that ends inside its caller's scope closed the
    thread's innermost scope (the caller's): the caller's allocations then
    went to the generator's tag."""
    def generator():
        with ccalloc.tag("py_gen_kv"):
            yield

    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        g = generator()
        next(g)
        assert ccalloc.current_tag() == "py_gen_kv"
        with ccalloc.tag("py_gen_weights"):
            assert next(g, None) is None  # the generator's with ends here
            assert ccalloc.current_tag() == "py_gen_weights"
            p = a.malloc(4 * MiB)
        assert ccalloc.current_tag() == "default"
        assert a.tag_usage("py_gen_weights")["allocated_bytes"] == 4 * MiB
        assert a.tag_usage("py_gen_kv")["allocated_bytes"] == 0
        a.free(p)


def test_one_tag_object_on_threads_and_entered_twice():
    weights = ccalloc.tag("py_shared_obj")
    with weights:
        with pytest.raises(ccalloc.InvalidArgumentError, match="already entered on this thread"):
            weights.__enter__()
        seen, errors = [], []

        def other_thread():
            try:
                with weights:  # the same object, another thread: its own scope
                    seen.append(ccalloc.current_tag())
                seen.append(ccalloc.current_tag())
                weights.__exit__(None, None, None)  # entered on the main thread only
            except ccalloc.InvalidArgumentError as e:
                errors.append(str(e))

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert seen == ["py_shared_obj", "default"]
        assert len(errors) == 1 and "is not entered on this thread" in errors[0], errors
        assert ccalloc.current_tag() == "py_shared_obj"  # the refused exit closed nothing here
    assert ccalloc.current_tag() == "default"
    with pytest.raises(ccalloc.InvalidArgumentError, match="is not entered on this thread"):
        weights.__exit__(None, None, None)
    with weights:  # reusable once left
        assert ccalloc.current_tag() == "py_shared_obj"


def test_bad_tags_are_refused():
    with pytest.raises(ccalloc.InvalidArgumentError, match="character outside"):
        with ccalloc.tag("has space"):
            pass
    with pytest.raises(ccalloc.InvalidArgumentError, match="must be a str"):
        ccalloc.tag(3)
    assert ccalloc.current_tag() == "default"


def test_bad_tag_names_are_refused_by_every_tag_function():
    """A name that can be no tag (empty, too long, a character outside the
    set) is an InvalidArgumentError wherever a tag is named, as ccalloc.h
    documents; a well-formed name that never allocated reads as zeros."""
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        for name, why in (("", "empty"), ("x" * 65, "65 bytes long"), ("has space", "character outside")):
            with pytest.raises(ccalloc.InvalidArgumentError, match=why):
                a.tag_usage(name)
            with pytest.raises(ccalloc.InvalidArgumentError, match=why):
                ccalloc.tag_usage(name)
            with pytest.raises(ccalloc.InvalidArgumentError, match=why):
                with ccalloc.tag(name):
                    pass
            for call in (a.pause, a.resume):
                with pytest.raises(ccalloc.InvalidArgumentError):
                    call(name)
        assert a.tag_usage("py_never_allocated") == {"allocated_bytes": 0, "reserved_bytes": 0, "paused_bytes": 0,
                                                     "kept_bytes": 0, "segments": 0, "blocks": 0, "paused": False}


def test_pause_frees_device_memory_and_resume_restores_contents():
    with ccalloc.Allocator("sim", capacity_bytes=64 * MiB, config="") as a:
        with ccalloc.tag("py_weights"):
            w = a.malloc(20 * MiB)
        ctypes.memset(w, 0x3c, 20 * MiB)
        free_before = a.mem_get_info()[0]
        r = a.pause("py_weights", keep_contents=True)
        assert r["paused_bytes"] == 20 * MiB and r["copied_bytes"] == 20 * MiB
        assert a.mem_get_info()[0] - free_before == 20 * MiB
        u = a.tag_usage("py_weights")
        assert u["paused"] and u["reserved_bytes"] == 0 and u["allocated_bytes"] == 20 * MiB
        with pytest.raises(ccalloc.InvalidArgumentError, match="the tag is paused"):
            with ccalloc.tag("py_weights"):
                a.malloc(MiB)
        other = a.malloc(50 * MiB)  # the room the pause made
        with pytest.raises(ccalloc.OutOfMemoryError, match="resuming tag 'py_weights'"):
            a.resume("py_weights")
        assert a.tag_usage("py_weights")["paused"]
        a.free(other)
        a.resume(["py_weights"])
        assert ctypes.string_at(w, 1) == b"\x3c" and ctypes.string_at(w + 20 * MiB - 1, 1) == b"\x3c"
        assert not a.tag_usage("py_weights")["paused"]
        a.free(w)
        with pytest.raises(ccalloc.InvalidArgumentError, match="default tag is never paused"):
            a.pause("default")
        with pytest.raises(ccalloc.InvalidArgumentError, match="tags must be"):
            a.pause([])


def test_torch_memory_saver_shapes_on_the_process_allocator():
    import ccalloc.torch as ct
    with ct.region(tag="py_kv", keep_contents=False):
        kv = ccalloc.process_allocator().malloc(8 * MiB)
    with ct.region(tag="py_params", keep_contents=True):
        params = ccalloc.process_allocator().malloc(4 * MiB)
    ctypes.memset(params, 0x11, 4 * MiB)
    r = ct.pause()  # every region's tag, each as it asked
    assert r["paused_bytes"] == 12 * MiB
    assert r["copied_bytes"] == 4 * MiB
    assert ccalloc.tag_usage("py_kv")["paused"] and ccalloc.tag_usage("py_params")["paused"]
    ct.resume()
    assert ctypes.string_at(params + 4 * MiB - 1, 1) == b"\x11"
    ct.pause(tag="py_kv")
    assert ccalloc.tag_usage("py_kv")["paused"] and not ccalloc.tag_usage("py_params")["paused"]
    ct.resume(tag="py_kv")
    ccalloc.process_allocator().free(kv)
    ccalloc.process_allocator().free(params)
    with pytest.raises(TypeError, match="ccalloc: keep_contents must be a bool"):
        with ct.region(tag="py_bad", keep_contents="yes"):
            pass

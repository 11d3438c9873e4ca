"""os.fork while other threads are inside ccalloc calls: the child's
allocators work at once (the library's fork handlers free its locks, the
package resets its call gates), and close() in the child does not wait for
calls the parent's other threads had in progress."""
import os
import signal
import threading
import time

import pytest

import ccalloc

MiB = 1 << 20

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")


def _hammer(allocator, stop):
    held = []
    i = 0
    while not stop.is_set():
        i += 1
        try:
            held.append(allocator.malloc((i * 7919) % (4 * MiB) + 1))
            if len(held) > 6:
                allocator.free(held.pop(0))
            if i % 32 == 0:
                allocator.empty_cache()
        except ccalloc.OutOfMemoryError:
            pass
    for p in held:
        allocator.free(p)


def _child(process, own):
    try:
        for a in (process, own):
            p = a.malloc(3 * MiB)
            q = a.malloc(4096)
            a.free(p)
            a.free(q)
            a.empty_cache()
            if a.stat("num_device_alloc") < 1:
                return 3
        own.close()  # waits for no call: the parent's threads are not here
        return 0
    except BaseException:  # noqa: BLE001 - any failure is the child's exit status
        return 4


def _wait(pid, deadline_s):
    end = time.monotonic() + deadline_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung"
        time.sleep(0.001)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork")
def test_children_forked_under_threads_allocate_and_close():
    process = ccalloc.Allocator.process_wide()
    own = ccalloc.Allocator("sim", capacity_bytes=512 * MiB, config="")
    stop = threading.Event()
    threads = [threading.Thread(target=_hammer, args=(a, stop)) for a in (process, own, process)]
    for t in threads:
        t.start()
    results = []
    try:
        for _ in range(20):
            time.sleep(0.002)
            pid = os.fork()
            if pid == 0:
                os._exit(_child(process, own))
            results.append(_wait(pid, 20))
            if results[-1] == "hung":
                break  # one is enough: the rest would wait as long
    finally:
        stop.set()
        for t in threads:
            t.join()
        own.close()
    assert results == [0] * 20

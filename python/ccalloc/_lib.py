"""Loading libccalloc.so and declaring its C functions (include/ccalloc/ccalloc.h).

The library is looked for, in order:

1. the path in the environment variable ``CCALLOC_LIBRARY``;
2. ``libccalloc.so`` next to this package (``ccalloc/libccalloc.so``);
3. the dynamic linker's search path (``ctypes.util.find_library("ccalloc")``,
   e.g. after ``cmake --install`` into a prefix the linker knows).

It is loaded once, on first use, so ``import ccalloc`` never fails for a
missing library; the first call that needs it raises ``OSError`` saying where
it looked. PyTorch's ``CUDAPluggableAllocator`` is given the same path, so the
process holds one copy of the library and one process-wide allocator.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import threading
from pathlib import Path

# ccalloc_status_t values.
OK = 0
ERROR_INVALID_ARGUMENT = 1
ERROR_OUT_OF_MEMORY = 2
ERROR_CONFIG = 3
ERROR_BACKEND = 4
ERROR_INTERNAL = 5

# ccalloc_backend_kind_t values.
BACKEND_DEFAULT = 0
BACKEND_SIM = 1
BACKEND_CUDA = 2


class ccalloc_options_t(ctypes.Structure):
    """include/ccalloc/ccalloc.h: ccalloc_options_t (fill with ccalloc_options_init)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("backend", ctypes.c_int),
        ("sim_device_count", ctypes.c_int),
        ("sim_capacity_bytes", ctypes.c_size_t),
        ("config", ctypes.c_char_p),
    ]


class ccalloc_mempool_id_t(ctypes.Structure):
    """include/ccalloc/ccalloc.h: ccalloc_mempool_id_t (PyTorch's MempoolId_t)."""

    _fields_ = [("first", ctypes.c_uint64), ("second", ctypes.c_uint64)]


class ccalloc_pool_usage_t(ctypes.Structure):
    """include/ccalloc/ccalloc.h: ccalloc_pool_usage_t."""

    _fields_ = [
        ("segment_count", ctypes.c_size_t),
        ("reserved_bytes", ctypes.c_size_t),
        ("allocated_bytes", ctypes.c_size_t),
        ("active_bytes", ctypes.c_size_t),
        ("allocation_count", ctypes.c_size_t),
        ("use_count", ctypes.c_int),
    ]


class ccalloc_ipc_export_t(ctypes.Structure):
    """include/ccalloc/ccalloc.h: ccalloc_ipc_export_t."""

    _fields_ = [
        ("handle", ctypes.c_void_p),
        ("handle_bytes", ctypes.c_size_t),
        ("fds", ctypes.POINTER(ctypes.c_int)),
        ("fd_count", ctypes.c_size_t),
    ]


class ccalloc_sleep_result_t(ctypes.Structure):
    """include/ccalloc/ccalloc.h: ccalloc_sleep_result_t."""

    _fields_ = [
        ("released_bytes", ctypes.c_size_t),
        ("paused_bytes", ctypes.c_size_t),
        ("copied_bytes", ctypes.c_size_t),
        ("cache_released_bytes", ctypes.c_size_t),
        ("host_time_us", ctypes.c_uint64),
    ]


class ccalloc_tag_usage_t(ctypes.Structure):
    """include/ccalloc/ccalloc.h: ccalloc_tag_usage_t."""

    _fields_ = [
        ("allocated_bytes", ctypes.c_size_t),
        ("reserved_bytes", ctypes.c_size_t),
        ("paused_bytes", ctypes.c_size_t),
        ("kept_bytes", ctypes.c_size_t),
        ("segments", ctypes.c_size_t),
        ("blocks", ctypes.c_size_t),
        ("paused", ctypes.c_int),
    ]


# ccalloc_segment_malloc_fn / ccalloc_segment_free_fn (cudaMalloc's and
# cudaFree's shape), for segment allocators written in Python (tests): the
# prototypes below take them as plain addresses.
SEGMENT_MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
SEGMENT_FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)

# The callbacks of the functions for PyTorch's CUDAAllocator interface.
STREAM_FILTER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
USER_DATA_RELEASE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
SEGMENT_MALLOC_UD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
SEGMENT_FREE_UD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
CHECKPOINT_BLOCK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

OOM_OBSERVER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t,
                                ctypes.c_size_t)



class ccalloc_trace_entry_t(ctypes.Structure):
    _fields_ = [
        ("action", ctypes.c_int),
        ("device", ctypes.c_int),
        ("addr", ctypes.c_size_t),
        ("size_bytes", ctypes.c_size_t),
        ("stream", ctypes.c_void_p),
        ("time_us", ctypes.c_uint64),
    ]


class ccalloc_mapping_event_t(ctypes.Structure):
    _fields_ = [
        ("change", ctypes.c_int),
        ("reason", ctypes.c_int),
        ("device", ctypes.c_int),
        ("expandable", ctypes.c_int),
        ("addr", ctypes.c_size_t),
        ("size_bytes", ctypes.c_size_t),
        ("stream", ctypes.c_void_p),
    ]


TRACE_TRACKER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ccalloc_trace_entry_t))
MAPPING_LISTENER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ccalloc_mapping_event_t))

# The names of ccalloc_trace_action_t, ccalloc_mapping_change_t and
# ccalloc_mapping_reason_t, by value.
TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
                 "segment_unmap", "snapshot", "oom", "empty_cache", "pause", "resume")
MAPPING_CHANGES = ("map", "unmap", "move", "unmap_completed")
MAPPING_REASONS = ("segment_alloc", "segment_free", "pages_mapped", "pages_recycled", "pages_released",
                   "pages_retired", "reservation_moved", "deferred_unmap", "pages_paused", "pages_resumed")

# ccalloc_record_history_ex's context callbacks and its options.
CONTEXT_RECORD = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
CONTEXT_RELEASE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
FRAME_SINK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64)
CONTEXT_FRAMES = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, FRAME_SINK, ctypes.c_void_p)


class ccalloc_history_options_t(ctypes.Structure):
    _fields_ = [("enabled", ctypes.c_int), ("max_entries", ctypes.c_size_t), ("when", ctypes.c_int),
                ("clear", ctypes.c_int), ("skip_actions", ctypes.c_char_p), ("record", CONTEXT_RECORD),
                ("release", CONTEXT_RELEASE), ("frames", CONTEXT_FRAMES), ("user_data", ctypes.c_void_p)]


_S = ctypes.c_int  # ccalloc_status_t
_A = ctypes.c_void_p  # ccalloc_allocator_t*
_P = ctypes.c_void_p  # void* and ccalloc_stream_t
_Z = ctypes.c_size_t

# name: (restype, argtypes); the declarations of include/ccalloc/ccalloc.h.
_PROTOTYPES = {
    "ccalloc_last_error": (ctypes.c_char_p, []),
    "ccalloc_status_name": (ctypes.c_char_p, [_S]),
    "ccalloc_name": (ctypes.c_char_p, []),
    "ccalloc_version": (ctypes.c_char_p, []),
    "ccalloc_built_with_cuda": (ctypes.c_int, []),
    "ccalloc_options_init": (None, [ctypes.POINTER(ccalloc_options_t)]),
    "ccalloc_create": (_S, [ctypes.POINTER(ccalloc_options_t), ctypes.POINTER(_A)]),
    "ccalloc_destroy": (None, [_A]),
    "ccalloc_init": (_S, [_A, ctypes.c_int]),
    "ccalloc_initialized": (_S, [_A, ctypes.POINTER(ctypes.c_int)]),
    "ccalloc_device_count": (_S, [_A, ctypes.POINTER(ctypes.c_int)]),
    "ccalloc_backend_name": (_S, [_A, ctypes.POINTER(ctypes.c_char_p)]),
    "ccalloc_current_device": (_S, [_A, ctypes.POINTER(ctypes.c_int)]),
    "ccalloc_mem_get_info": (_S, [_A, ctypes.c_int, ctypes.POINTER(_Z), ctypes.POINTER(_Z)]),
    "ccalloc_malloc": (_S, [_A, ctypes.c_int, _Z, _P, ctypes.POINTER(_P)]),
    "ccalloc_delete": (_S, [_A, _P]),
    "ccalloc_raw_alloc": (_S, [_A, _Z, ctypes.POINTER(_P)]),
    "ccalloc_raw_alloc_with_stream": (_S, [_A, _Z, _P, ctypes.POINTER(_P)]),
    "ccalloc_set_current_stream": (None, [_P]),
    "ccalloc_current_stream": (_P, []),
    "ccalloc_record_stream": (_S, [_A, _P, _P]),
    "ccalloc_get_base_allocation": (_S, [_A, _P, ctypes.POINTER(_P), ctypes.POINTER(_Z)]),
    "ccalloc_empty_cache": (_S, [_A]),
    "ccalloc_cache_info": (_S, [_A, ctypes.c_int, ctypes.POINTER(_Z)]),
    "ccalloc_set_memory_fraction": (_S, [_A, ctypes.c_int, ctypes.c_double]),
    "ccalloc_get_memory_fraction": (_S, [_A, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]),
    "ccalloc_enable": (_S, [_A, ctypes.c_int]),
    "ccalloc_is_enabled": (_S, [_A, ctypes.POINTER(ctypes.c_int)]),
    "ccalloc_stat_count": (_Z, []),
    "ccalloc_stat_name": (ctypes.c_char_p, [_Z]),
    "ccalloc_get_device_stats": (_S, [_A, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), _Z]),
    "ccalloc_get_device_stat": (_S, [_A, ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64)]),
    "ccalloc_reset_accumulated_stats": (_S, [_A, ctypes.c_int]),
    "ccalloc_reset_peak_stats": (_S, [_A, ctypes.c_int]),
    "ccalloc_set_config": (_S, [_A, ctypes.c_char_p]),
    "ccalloc_get_config": (_S, [_A, ctypes.c_char_p, _Z, ctypes.POINTER(_Z)]),
    "ccalloc_record_history": (_S, [_A, ctypes.c_int, _Z]),
    "ccalloc_history_options_init": (None, [ctypes.POINTER(ccalloc_history_options_t)]),
    "ccalloc_record_history_ex": (_S, [_A, ctypes.POINTER(ccalloc_history_options_t)]),
    "ccalloc_snapshot_json": (_S, [_A, ctypes.c_int, ctypes.c_char_p, _Z, ctypes.POINTER(_Z)]),
    "ccalloc_attach_out_of_memory_observer": (_S, [_A, OOM_OBSERVER, ctypes.c_void_p]),
    "ccalloc_attach_trace_tracker": (_S, [_A, TRACE_TRACKER, ctypes.c_void_p]),
    "ccalloc_attach_mapping_listener": (_S, [_A, MAPPING_LISTENER, ctypes.c_void_p]),
    "ccalloc_set_observers_enabled": (_S, [ctypes.c_int, ctypes.c_uint32, ctypes.POINTER(_Z)]),
    "ccalloc_new_pool_id": (_S, [_A, ctypes.POINTER(ccalloc_mempool_id_t)]),
    "ccalloc_create_pool": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t, _P, _P]),
    "ccalloc_release_pool": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t]),
    "ccalloc_pool_use_count": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t, ctypes.POINTER(ctypes.c_int)]),
    "ccalloc_begin_allocate_to_pool": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t, _P, ctypes.c_int]),
    "ccalloc_end_allocate_to_pool": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t]),
    "ccalloc_pool_usage": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t, ctypes.POINTER(ccalloc_pool_usage_t)]),
    "ccalloc_begin_allocate_to_pool_filter": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t, _P, _P, _P]),
    "ccalloc_create_pool_with_source": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t, _P, _P, _P]),
    "ccalloc_set_use_on_oom": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t, ctypes.c_int]),
    "ccalloc_set_no_split": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t, ctypes.c_int]),
    "ccalloc_check_pool_live_allocations": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t,
                                                 ctypes.POINTER(ctypes.c_void_p), _Z, ctypes.POINTER(ctypes.c_int)]),
    "ccalloc_get_checkpoint_state": (_S, [_A, ctypes.c_int, ccalloc_mempool_id_t, ctypes.POINTER(_P)]),
    "ccalloc_pool_checkpoint_destroy": (None, [_P]),
    "ccalloc_set_checkpoint_pool_state": (_S, [_A, ctypes.c_int, _P, _P, _P]),
    "ccalloc_enable_peer_access": (_S, [_A, ctypes.c_int, ctypes.c_int]),
    "ccalloc_tag_begin": (_S, [ctypes.c_char_p]),
    "ccalloc_tag_end": (_S, []),
    "ccalloc_tag_end_named": (_S, [ctypes.c_char_p]),
    "ccalloc_current_tag": (ctypes.c_char_p, []),
    "ccalloc_pause": (_S, [_A, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), _Z, ctypes.c_int,
                           ctypes.POINTER(ccalloc_sleep_result_t)]),
    "ccalloc_resume": (_S, [_A, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), _Z,
                            ctypes.POINTER(ccalloc_sleep_result_t)]),
    "ccalloc_tag_usage": (_S, [_A, ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ccalloc_tag_usage_t)]),
    "ccalloc_share_ipc_handle": (_S, [_A, _P, ctypes.POINTER(ccalloc_ipc_export_t)]),
    "ccalloc_ipc_export_free": (None, [ctypes.POINTER(ccalloc_ipc_export_t), ctypes.c_int]),
    "ccalloc_send_ipc_handle": (_S, [ctypes.c_int, ctypes.POINTER(ccalloc_ipc_export_t)]),
    "ccalloc_receive_ipc_handle": (_S, [ctypes.c_int, ctypes.POINTER(ccalloc_ipc_export_t)]),
    "ccalloc_open_ipc_handle": (_S, [_A, ctypes.c_char_p, _Z, ctypes.POINTER(ctypes.c_int), _Z, ctypes.c_int,
                                     ctypes.POINTER(_P)]),
    "ccalloc_share_ipc_handle_pidfd": (_S, [_A, _P, ctypes.c_void_p, _Z, ctypes.POINTER(_Z)]),
    "ccalloc_open_ipc_handle_pidfd": (_S, [_A, ctypes.c_char_p, _Z, ctypes.c_int, ctypes.POINTER(_P)]),
    "ccalloc_close_ipc_handle": (_S, [_A, _P]),
    "ccalloc_reclaim_ipc_exports": (_S, [_A, ctypes.POINTER(_Z)]),
    "ccalloc_ipc_export_status": (_S, [_A, _P, ctypes.POINTER(_Z), ctypes.POINTER(ctypes.c_int)]),
    "ccalloc_stream_create": (_S, [_A, ctypes.c_int, ctypes.POINTER(_P)]),
    "ccalloc_stream_destroy": (_S, [_A, ctypes.c_int, _P]),
    "ccalloc_stream_synchronize": (_S, [_A, ctypes.c_int, _P]),
    "ccalloc_alloc": (_P, [_Z, ctypes.c_int, _P]),
    "ccalloc_free": (None, [_P, _Z, ctypes.c_int, _P]),
}

# The hooks python/ccalloc hands to torch.cuda.memory.CUDAPluggableAllocator
# (their addresses only; Python never calls them: they throw C++ exceptions).
TORCH_ALLOC = "ccalloc_torch_alloc"
TORCH_FREE = "ccalloc_torch_free"
TORCH_HOOKS = {
    # CUDAPluggableAllocator setter: exported function
    "set_init_fn": "ccalloc_torch_init",
    "set_reset_fn": "ccalloc_torch_empty_cache",
    "set_memory_fraction_fn": "ccalloc_torch_set_memory_fraction",
    "set_base_alloc_fn": "ccalloc_torch_base_alloc",
    "set_record_stream_fn": "ccalloc_torch_record_stream",
}

_lock = threading.Lock()


def _new_lock_in_child() -> None:
    # A thread of the parent that was loading the library may have held it.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)
_lib: ctypes.CDLL | None = None
_path: str | None = None


def _candidates() -> list[str]:
    env = os.environ.get("CCALLOC_LIBRARY")
    if env:
        return [env]
    out = [str(Path(__file__).resolve().parent / "libccalloc.so")]
    found = ctypes.util.find_library("ccalloc")
    if found:
        out.append(found)
    return out


def _load() -> None:
    global _lib, _path
    env = os.environ.get("CCALLOC_LIBRARY")
    if env and not Path(env).is_file():
        raise OSError(f"ccalloc: CCALLOC_LIBRARY={env} is not a file (build it with `cmake --build BUILD "
                      f"--target ccalloc_shared`: BUILD/libccalloc.so)")
    def missing_symbols(library):
        missing = [name for name in _PROTOTYPES if not hasattr(library, name)]
        if missing:
            return (f"lacks {len(missing)} of ccalloc's C functions (first {missing[0]}): not libccalloc.so, "
                    f"or one older than this package")
        return None

    lib, candidate, errors = load_first(_candidates(), missing_symbols)
    if lib is not None and env and candidate != env:
        lib = None  # the library the user named comes first, or nothing does
    if lib is None:
        raise OSError("ccalloc: cannot load libccalloc.so; set CCALLOC_LIBRARY=/path/to/libccalloc.so "
                      "(CMake target ccalloc_shared) or put it next to ccalloc/__init__.py. Tried: " +
                      "; ".join(errors))
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    # The path PyTorch must load: the file itself, resolved, so that
    # dlopen hands back this same copy.
    _path = str(Path(candidate).resolve()) if os.sep in candidate else candidate
    _lib = lib
    atexit.register(_stop_observers_at_exit)


# How long interpreter exit waits for callbacks already running (seconds).
_EXIT_WAIT_SECONDS = 2


def _stop_observers_at_exit() -> None:
    """At interpreter exit, before CPython ends the daemon threads that call
    into Python: no more calls of the Python callbacks given to the library
    (trackers, listeners, observers, history's Python stacks), and those
    running finish (ccalloc_set_observers_enabled; ctypes releases the
    interpreter's lock meanwhile, so that they can). Without it, a daemon
    thread still allocating would be ended inside a callback, which stops
    the process ("FATAL: exception not rethrown")."""
    if _lib is not None:
        _lib.ccalloc_set_observers_enabled(0, _EXIT_WAIT_SECONDS * 1000, None)


def load_first(candidates, check=None) -> tuple:
    """``(library, candidate, tried)``: the first of ``candidates`` (paths,
    or names for the dynamic linker; duplicates skipped) that loads and for
    which ``check(library)`` returns None (else it says what is missing);
    ``(None, None, tried)`` when none does. ``tried`` says why each earlier
    candidate failed."""
    tried = []
    for candidate in dict.fromkeys(candidates):
        if os.sep in candidate and not Path(candidate).is_file():
            tried.append(f"{candidate}: no such file")
            continue
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as e:
            tried.append(f"{candidate}: {e}")
            continue
        problem = check(lib) if check is not None else None
        if problem:
            tried.append(f"{candidate}: {problem}")
            continue
        return lib, candidate, tried
    return None, None, tried


def lib() -> ctypes.CDLL:
    """The loaded library with its prototypes declared (loads it on first call)."""
    if _lib is None:
        with _lock:
            if _lib is None:
                _load()
    assert _lib is not None
    return _lib


def path() -> str:
    """The path libccalloc.so was loaded from (loads it on first call)."""
    lib()
    assert _path is not None
    return _path


def function_address(name: str) -> int:
    """Address of an exported function, as PyTorch's set_*_fn setters take it."""
    addr = ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value
    if not addr:
        raise OSError(f"ccalloc: {path()} has no function {name}")
    return addr

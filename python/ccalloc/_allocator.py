"""ccalloc.Allocator: an allocator of the C API (the process-wide one or one
with its own backend), and the argument conversions the package shares.
Re-exported by the package."""

from __future__ import annotations

import collections
import collections.abc
import ctypes
import functools
import itertools
import math
import numbers
import operator
import os
import sys
import threading
import weakref
from typing import Callable, NamedTuple, Optional

from . import _lib
from ._errors import InvalidArgumentError, _check


# The ranges of the C API's integer types (ctypes would wrap larger values
# silently: malloc(2**64 + 4096) would ask for 4096 bytes).
_U64_MAX = (1 << 64) - 1
_INT_MAX = (1 << 31) - 1


def _shown(value, limit: int = 60) -> str:
    """``value`` as a message shows it: its repr, at most ``limit``
    characters. An integer of more than 256 bits is named by its size (str()
    of one over 4300 digits raises ValueError); a repr that raises is
    replaced by the type's name."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 -- any repr failure: the message must still be made
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _integer(value, name: str, low: int = 0, high: int = _U64_MAX) -> int:
    """``value`` as an int in [low, high]. TypeError for anything that is not
    an integer (float, bool, None, str), InvalidArgumentError for one out of
    range; both name the argument."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # int, numpy integers: whatever __index__ makes an int
    except TypeError:
        raise TypeError(f"ccalloc: {name} must be an integer, got {type(value).__name__} {_shown(value)}") from None
    if not low <= value <= high:
        raise InvalidArgumentError(f"ccalloc: {name} must be an integer from {low} to {high}, got {_shown(value)}")
    return value


def _flag(value, name: str) -> bool:
    """A yes/no argument: True or False (or a numpy.bool_). Anything else is
    a TypeError naming the argument: truthiness would read the str "False",
    "no" or "0", or the int -1, as True (and ctypes an int 2**64 as 0)."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"):
        return bool(value)
    raise TypeError(f"ccalloc: {name} must be a bool (True or False), got {kind.__name__} {_shown(value)}")


def _size(value, name: str = "size_bytes") -> int:
    """A byte count for a size_t parameter."""
    return _integer(value, name)


# The most devices an allocator drives (CCALLOC_MAX_DEVICE_COUNT of ccalloc.h).
MAX_DEVICE_COUNT = 1024


def _device_count(value, name: str) -> int:
    """A number of devices: 1 to MAX_DEVICE_COUNT."""
    return _integer(value, name, 1, MAX_DEVICE_COUNT)


def _device_index(value, name: str = "device") -> int:
    """A device index for an int parameter."""
    return _integer(value, name, 0, _INT_MAX)


def _callable(value, name: str) -> None:
    """A callback argument: refused at once when it cannot be called (it would fail only when called)."""
    if not callable(value):
        raise TypeError(f"ccalloc: {name} must be callable, got {type(value).__name__} {_shown(value)}")


def _device_or_all(value, name: str = "device") -> int:
    """A device index, or -1 for every device."""
    return _integer(value, name, -1, _INT_MAX)


def _address(value, name: str = "ptr") -> Optional[int]:
    """A pointer argument: None or 0 (null) or an address that fits in 64 bits."""
    if value is None:
        return None
    return _integer(value, name) or None


def _text(value, name: str) -> bytes:
    """A str for a const char* parameter: no NUL (C would stop reading there)."""
    if not isinstance(value, str):
        raise TypeError(f"ccalloc: {name} must be a str, got {type(value).__name__} {_shown(value)}")
    if "\0" in value:
        raise InvalidArgumentError(f"ccalloc: {name} contains a NUL character at index {value.index(chr(0))} "
                                   f"(C strings end there): {_shown(value, 80)}")
    try:
        return value.encode()
    except UnicodeEncodeError as e:  # a lone surrogate (undecodable bytes read with surrogateescape)
        raise InvalidArgumentError(f"ccalloc: {name} is not valid Unicode text: {value[e.start]!r} at index {e.start} "
                                   f"is a lone surrogate, which UTF-8 cannot encode: {_shown(value, 80)}") from None


def _real(value, name: str) -> float:
    """A finite real number for a double parameter."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"ccalloc: {name} must be a real number, got {type(value).__name__} {_shown(value)}")
    try:
        value = float(value)
    except OverflowError:  # an int or Fraction beyond a double's range
        raise InvalidArgumentError(f"ccalloc: {name} must be a finite number, got {_shown(value)}, "
                                   f"beyond a double's range") from None
    if not math.isfinite(value):
        raise InvalidArgumentError(f"ccalloc: {name} must be a finite number, got {value}")
    return value


def _stream(stream) -> Optional[int]:
    """A stream argument as the C API takes it (None = the default stream)."""
    if stream is None:
        return None
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attr):
            stream = getattr(stream, attr)
            break
    return _integer(stream, "stream") or None


def _pool_id(id, name: str = "id") -> "_lib.ccalloc_mempool_id_t":
    """A pool id, a pair (tuple or list) of integers in [0, 2**64), as the C
    struct. TypeError for anything else (a str or any other iterable would
    be taken apart: "12" as (1, 2)), InvalidArgumentError for a pair of the
    wrong length or out of range; both name the argument."""
    if not isinstance(id, (tuple, list)):
        raise TypeError(f"ccalloc: {name} must be a pool id, a pair (first, second) of integers, "
                        f"got {type(id).__name__} {_shown(id)}")
    if len(id) != 2:
        raise InvalidArgumentError(f"ccalloc: {name} must be a pool id, a pair (first, second) of integers, "
                                   f"got {len(id)} items: {_shown(id)}")
    return _lib.ccalloc_mempool_id_t(_integer(id[0], f"{name}[0]"), _integer(id[1], f"{name}[1]"))


def _skip_actions(actions) -> Optional[bytes]:
    """record_history's skip_actions as the C API's comma-separated names
    (None for none): a str is taken whole, as in C, not as its characters."""
    if isinstance(actions, str):
        actions = [actions]
    if isinstance(actions, (bytes, bytearray)) or not isinstance(actions, collections.abc.Iterable):
        raise TypeError(f"ccalloc: skip_actions must be a str or a list of str, "
                        f"got {type(actions).__name__} {_shown(actions)}")
    names = []
    for action in actions:
        if not isinstance(action, str):
            raise TypeError(f"ccalloc: skip_actions must be a str or a list of str, got an item "
                            f"{type(action).__name__} {_shown(action)}")
        names.append(_text(action, "skip_actions"))
    return b",".join(names) or None


def _function_address(fn, what: str) -> int:
    """The address of a C function given as an int or a ctypes function pointer."""
    if isinstance(fn, ctypes._CFuncPtr):  # pylint: disable=protected-access
        address = ctypes.cast(fn, ctypes.c_void_p).value
    elif isinstance(fn, int) and not isinstance(fn, bool):
        address = fn
    else:
        raise InvalidArgumentError(f"ccalloc: create_pool: the segment {what} function must be an address (int) "
                                   f"or a ctypes function, got {_shown(fn, 80)}")
    if not address or address < 0:
        raise InvalidArgumentError(f"ccalloc: create_pool: the segment {what} function address is {address!r}")
    return address


_stat_names: Optional[list] = None


def _names() -> list:
    global _stat_names
    if _stat_names is None:
        lib = _lib.lib()
        _stat_names = [lib.ccalloc_stat_name(i).decode() for i in range(lib.ccalloc_stat_count())]
    return _stat_names


def _python_stack():
    """The caller's Python stack, innermost first, without ccalloc's own frames."""
    import traceback

    frames = []
    for f in reversed(traceback.extract_stack()):
        if f.filename.endswith(("ccalloc/_allocator.py", "ccalloc/torch.py")):
            continue
        frames.append((f.name, f.filename, f.lineno or 0))
    return frames


# ---- history contexts: Python recorders behind three C callbacks made once --------------------
#
# ccalloc_record_history_ex keeps plain function pointers: the recorder of
# the configuration in force, and in each context it recorded the release
# and frames functions of its configuration, called until the library drops
# the context (long after a later record_history replaced the recorder).
# Callback objects made per call would have to live as long, and one set
# per call grew the process by 3 KB a call, forever. Instead the three C
# functions below exist once per process, and each configuration is a
# number (the callbacks' user_data) naming its _ContextConfig: its recorder
# and the frames of its live contexts. A configuration is forgotten once it
# was replaced and the library released all its contexts; a call for a
# forgotten one (a malloc that read the recorder just before the
# replacement) records no context.


class _ContextConfig:
    """One record_history configuration's recorder and its contexts' frames
    by handle: kept[handle] = [(name bytes, filename bytes, line), ...]."""

    __slots__ = ("recorder", "kept", "next_handle", "recording", "replaced")

    def __init__(self, recorder) -> None:
        self.recorder = recorder
        self.kept: dict = {}
        self.next_handle = 1  # 0 is NULL: no context
        self.recording = 0  # calls of the recorder in progress
        self.replaced = False


_configs: "dict[int, _ContextConfig]" = {}
_SLOTS: "weakref.WeakSet[_HistorySlot]" = weakref.WeakSet()
_config_numbers = itertools.count(1)
_configs_lock = threading.Lock()  # held for dictionary updates only, never across a call


def _new_configs_lock_in_child() -> None:
    # Another thread of the parent may have held them.
    global _configs_lock
    _configs_lock = threading.Lock()
    for slot in list(_SLOTS):
        slot.lock = threading.Lock()


os.register_at_fork(after_in_child=_new_configs_lock_in_child)


def _forget_if_done(number: int, config: _ContextConfig) -> None:
    """Forgets a replaced configuration without contexts (under _configs_lock)."""
    if config.replaced and not config.kept and not config.recording:
        _configs.pop(number, None)


def _context_frame(name, filename, line) -> tuple:
    # Each field of its type: str() would turn b"n" into the name "b'n'"
    # and None into the file "None".
    for field, value in (("name", name), ("filename", filename)):
        if not isinstance(value, str):
            raise TypeError(f"a frame's {field} must be a str, got {type(value).__name__} {_shown(value)}")
    try:
        if isinstance(line, bool):
            raise TypeError
        line = operator.index(line)
    except TypeError:
        raise TypeError(f"a frame's line must be an int, got {type(line).__name__} {_shown(line)}") from None
    if not 0 <= line < 1 << 63:
        raise ValueError(f"a frame's line must be from 0 to {(1 << 63) - 1}, got {line}")
    # A name not valid UTF-8 (a path of undecodable bytes reaches Python
    # as surrogates) goes as its bytes; the library replaces what is not
    # UTF-8 with U+FFFD.
    return (_frame_text(name), _frame_text(filename), line)


def _frame_text(value) -> bytes:
    """A frame's name or file name as bytes: a str from undecodable bytes
    (surrogates U+DC80-U+DCFF) goes back to those bytes; other lone
    surrogates become "?". The library replaces what is not UTF-8 with
    U+FFFD."""
    try:
        return value.encode(errors="surrogateescape")
    except UnicodeEncodeError:
        return value.encode(errors="replace")


def _record_context(number):
    # Nothing may cross into C: on an error the call goes on without a context.
    with _configs_lock:
        config = _configs.get(number)
        if config is None:
            return None
        config.recording += 1
    try:
        try:
            frames = config.recorder()
            if frames is None:
                return None
            frames = [_context_frame(*f) for f in frames]
        except BaseException:
            import traceback

            print("ccalloc: a context recorder raised (ignored; this call has no context):", file=sys.stderr)
            traceback.print_exc()
            return None
        with _configs_lock:
            handle = config.next_handle
            config.next_handle += 1
            config.kept[handle] = frames
        return handle
    finally:
        with _configs_lock:
            config.recording -= 1
            _forget_if_done(number, config)


def _release_context(number, handle) -> None:
    with _configs_lock:
        config = _configs.get(number)
        if config is not None:
            config.kept.pop(handle, None)
            _forget_if_done(number, config)


def _context_frames(number, handle, sink, sink_data) -> None:
    with _configs_lock:
        config = _configs.get(number)
        frames = config.kept.get(handle, ()) if config is not None else ()
    for name, filename, line in frames:
        sink(sink_data, name, filename, line)


_CONTEXT_CALLBACKS = (_lib.CONTEXT_RECORD(_record_context), _lib.CONTEXT_RELEASE(_release_context),
                      _lib.CONTEXT_FRAMES(_context_frames))


class _HistorySlot:
    """The context configuration in force on one C allocator (the
    process-wide one has one slot for all its Allocator wrappers);
    ``lock`` orders record_history calls so that the one in force in C is
    the one noted here."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.number: Optional[int] = None
        _SLOTS.add(self)

    def replace(self, number: Optional[int]) -> None:
        """Notes ``number`` (None: no context) as in force; the one before is
        forgotten once the library released its contexts."""
        with _configs_lock:
            old, self.number = self.number, number
            config = _configs.get(old) if old is not None else None
            if config is not None:
                config.replaced = True
                _forget_if_done(old, config)


_PROCESS_HISTORY = _HistorySlot()


class _IpcHandleFields(NamedTuple):
    handle: bytes
    fds: tuple


class IpcHandle(_IpcHandleFields):
    """A shared block (SPEC F25, C3): the handle's bytes and the file
    descriptors that go with it, in order (this process owns them: close
    them with ``close()`` once sent or opened). A tuple ``(handle, fds)``."""

    def close(self) -> None:
        """Closes the descriptors, once: a second call does nothing (their
        numbers may belong to other files by then, as after file.close())."""
        if self.__dict__.get("_closed"):
            return
        self.__dict__["_closed"] = True
        failure = None
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError as e:  # the others are still closed
                failure = failure or e
        if failure is not None:
            raise failure


def _take_export(ex: "_lib.ccalloc_ipc_export_t") -> IpcHandle:
    """The IpcHandle of a filled ccalloc_ipc_export_t, whose memory is then
    freed (the descriptors move to the result)."""
    try:
        handle = ctypes.string_at(ex.handle, ex.handle_bytes) if ex.handle_bytes else b""
        fds = tuple(ex.fds[i] for i in range(ex.fd_count))
    finally:
        _lib.lib().ccalloc_ipc_export_free(ctypes.byref(ex), 0)
    return IpcHandle(handle, fds)


def _fd_of(sock) -> int:
    fileno = getattr(sock, "fileno", None)
    return _integer(fileno() if callable(fileno) else sock, "socket", 0, _INT_MAX)


def send_ipc_handle(sock, shared: IpcHandle) -> None:
    """Sends ``shared`` (from ``Allocator.share_ipc_handle``) on a connected
    AF_UNIX SOCK_SEQPACKET socket (an object with ``fileno()`` or a
    descriptor); the descriptors travel as SCM_RIGHTS and stay this
    process's. BackendError when sending fails."""
    handle = bytes(shared.handle)
    fds = (ctypes.c_int * max(1, len(shared.fds)))(*shared.fds)
    ex = _lib.ccalloc_ipc_export_t(ctypes.cast(ctypes.c_char_p(handle), ctypes.c_void_p), len(handle),
                                   ctypes.cast(fds, ctypes.POINTER(ctypes.c_int)), len(shared.fds))
    _check(_lib.lib().ccalloc_send_ipc_handle(_fd_of(sock), ctypes.byref(ex)))


def receive_ipc_handle(sock) -> IpcHandle:
    """Receives one handle sent by ``send_ipc_handle`` (blocks); the
    descriptors are new in this process. BackendError when receiving fails
    or the peer closed the socket."""
    ex = _lib.ccalloc_ipc_export_t()
    _check(_lib.lib().ccalloc_receive_ipc_handle(_fd_of(sock), ctypes.byref(ex)))
    return _take_export(ex)


_CLOSED_MESSAGE = "ccalloc: this Allocator is closed (close() or the end of its with block); create a new one"


# Every live call gate, reset in a child of os.fork (_CallGate._after_fork_in_child).
_GATES: "weakref.WeakSet[_CallGate]" = weakref.WeakSet()


def _reset_gates_in_child() -> None:
    for gate in list(_GATES):
        gate._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_gates_in_child)


class _CallGate:
    """Counts the calls in progress on one Allocator so that close() waits
    for them: ctypes releases the GIL during a C call, and destroying the C
    allocator under a call running on another thread would free what that
    call uses. After close() begins, new calls raise InvalidArgumentError."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._calls = 0
        self._closing = False
        self._depth = threading.local()  # this thread's calls in progress
        _GATES.add(self)

    def _after_fork_in_child(self) -> None:
        # The child has only the thread that forked: the calls other threads
        # had in progress will never leave, and one of them may have held the
        # lock. The library's own locks are freed by its fork handlers.
        self._cv = threading.Condition(threading.Lock())
        self._calls = getattr(self._depth, "n", 0)

    def enter(self) -> None:
        with self._cv:
            if self._closing:
                raise InvalidArgumentError(_CLOSED_MESSAGE)
            self._calls += 1
        self._depth.n = getattr(self._depth, "n", 0) + 1

    def leave(self) -> None:
        self._depth.n -= 1
        with self._cv:
            self._calls -= 1
            if self._calls == 0:
                self._cv.notify_all()

    def close(self) -> bool:
        """Stops new calls and waits for those in progress; False when
        closing began already. InvalidArgumentError when this thread is
        inside a call on the same Allocator (a callback), which would wait
        for itself."""
        if getattr(self._depth, "n", 0) > 0:
            raise InvalidArgumentError("ccalloc: close() of an Allocator from inside one of its own calls "
                                       "(a callback); close it after the call returns")
        with self._cv:
            if self._closing:
                return False
            self._closing = True
            while self._calls:
                self._cv.wait()
        return True


def _gated(fn):
    """Runs an Allocator method inside its call gate."""

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        gate = self._gate
        gate.enter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            gate.leave()

    return call


class Allocator:
    """A ccalloc allocator: the process-wide one (``Allocator.process_wide()``)
    or one with its own backend (the constructor).

    ``Allocator(backend="sim", devices=1, capacity_bytes=None, config=None)``
    creates and initializes an allocator on a simulated device (``"sim"``),
    CUDA (``"cuda"``) or whichever is there (``"default"``); ``devices`` is 1
    to MAX_DEVICE_COUNT (1024) simulated devices of ``capacity_bytes`` each
    (1 to 2**64 - 1 bytes; None: 141 GB, an H200's). ``config`` is a
    configuration string in PyTorch's syntax; None reads ``CCALLOC_CONF`` and
    ``CCALLOC_NO_CACHING`` as the process-wide allocator does. Close it with
    ``close()`` (or use it as a context manager): its memory goes back to the
    device and its pointers become invalid, and every later call raises
    InvalidArgumentError ("this Allocator is closed").

    Arguments are checked before they reach the C library: integers
    (sizes, addresses, devices, streams, capacities, history limits) must
    be ints in the C type's range (TypeError for a float, bool, None or
    str; InvalidArgumentError, a ValueError, for a negative or too large
    value), strings must be str without NUL characters.

    Thread safety: every method may be called from any thread. ``close``
    waits for the calls in progress on other threads; calls that start
    after it began raise InvalidArgumentError.
    """

    _KINDS = {"default": _lib.BACKEND_DEFAULT, "sim": _lib.BACKEND_SIM, "cuda": _lib.BACKEND_CUDA}

    def __init__(self, backend: str = "sim", devices: int = 1, capacity_bytes: Optional[int] = None,
                 config: Optional[str] = None, *, _handle: Optional[int] = None, _owned: bool = True):
        self._gate = _CallGate()
        self._history = _PROCESS_HISTORY if not _owned else _HistorySlot()
        self._observers: list = []
        self._kept: list = []  # ctypes segment functions of this allocator's pools
        self._handle: Optional[int] = None
        self._owned = False
        self._closed = False
        if not _owned:
            self._handle = _handle
            self._owned = False
            return
        if not isinstance(backend, str) or backend not in self._KINDS:
            raise InvalidArgumentError(f"ccalloc: unknown backend {_shown(backend)} (accepted: default, sim, cuda)")
        lib = _lib.lib()
        options = _lib.ccalloc_options_t()
        lib.ccalloc_options_init(ctypes.byref(options))
        options.backend = self._KINDS[backend]
        options.sim_device_count = _device_count(devices, "devices")
        # 0 means the default size to the C API: a size computed as 0 must not
        # become a 141 GB device. None asks for the default.
        options.sim_capacity_bytes = 0 if capacity_bytes is None else _integer(capacity_bytes, "capacity_bytes", 1)
        options.config = None if config is None else _text(config, "config")
        handle = ctypes.c_void_p()
        _check(lib.ccalloc_create(ctypes.byref(options), ctypes.byref(handle)))
        self._handle = handle.value
        self._owned = True
        try:
            count = devices if backend == "sim" else self.device_count
            self.init(count)
        except BaseException:
            self.close()
            raise

    @classmethod
    def process_wide(cls) -> "Allocator":
        """The process-wide allocator (the one PyTorch and CuPy use once
        installed): default backend, configured from the environment, never
        closed."""
        return cls(_handle=None, _owned=False)

    def close(self) -> None:
        """Destroys an allocator made by the constructor (no-op for the
        process-wide one and when closed already). Calls in progress on
        other threads finish first; later ones raise InvalidArgumentError.
        InvalidArgumentError from inside a callback of this allocator."""
        if not (self._owned and self._handle is not None):
            return
        if not self._gate.close():
            return
        _lib.lib().ccalloc_destroy(self._handle)  # releases every context
        self._history.replace(None)
        self._handle = None
        self._owned = False
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether close() destroyed this allocator (never for the process-wide one)."""
        return self._closed

    @property
    def _h(self) -> Optional[int]:
        """The C handle for a call (None: the process-wide allocator). Raises
        InvalidArgumentError once closed: a null handle would reach the
        process-wide allocator instead."""
        if self._closed:
            raise InvalidArgumentError(_CLOSED_MESSAGE)
        return self._handle

    def __enter__(self) -> "Allocator":
        return self

    # A copy would share the C allocator and close it when either copy goes.
    def __copy__(self):
        raise TypeError("ccalloc.Allocator cannot be copied: it owns its C allocator (share the object instead)")

    def __deepcopy__(self, memo):
        raise TypeError("ccalloc.Allocator cannot be copied: it owns its C allocator (share the object instead)")

    def __reduce__(self):
        raise TypeError("ccalloc.Allocator cannot be pickled: it owns a C allocator of this process")

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if getattr(self, "_gate", None) is not None:
                self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass

    # ---- identity and devices ----------------------------------------------------------

    def init(self, device_count: int) -> None:
        """Initializes devices [0, device_count) (PyTorch: init)."""
        _check(_lib.lib().ccalloc_init(self._h, _device_count(device_count, "device_count")))

    def _int(self, fn, *args) -> int:
        out = ctypes.c_int()
        _check(fn(self._h, *args, ctypes.byref(out)))
        return out.value

    @property
    def initialized(self) -> bool:
        return bool(self._int(_lib.lib().ccalloc_initialized))

    @property
    def device_count(self) -> int:
        return self._int(_lib.lib().ccalloc_device_count)

    @property
    def current_device(self) -> int:
        """The calling thread's current device on this allocator's backend."""
        return self._int(_lib.lib().ccalloc_current_device)

    @property
    def backend_name(self) -> str:
        """"cuda" or "sim"."""
        out = ctypes.c_char_p()
        _check(_lib.lib().ccalloc_backend_name(self._h, ctypes.byref(out)))
        return out.value.decode()

    def mem_get_info(self, device: int = 0) -> tuple:
        """(free bytes, total bytes) of ``device`` (cudaMemGetInfo)."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        _check(_lib.lib().ccalloc_mem_get_info(self._h, _device_index(device), ctypes.byref(free), ctypes.byref(total)))
        return free.value, total.value

    # ---- allocation ----------------------------------------------------------------------

    def malloc(self, size_bytes: int, device: int = 0, stream=None) -> int:
        """Allocates ``size_bytes`` on ``device`` for ``stream``; returns the
        address (0 for size 0). Raises OutOfMemoryError, InvalidArgumentError."""
        out = ctypes.c_void_p()
        _check(_lib.lib().ccalloc_malloc(self._h, _device_index(device), _size(size_bytes), _stream(stream),
                                         ctypes.byref(out)))
        return out.value or 0

    def free(self, ptr: int) -> None:
        """Frees an address from malloc (0 is a no-op). Raises
        InvalidArgumentError naming the pointer if it is not live here."""
        _check(_lib.lib().ccalloc_delete(self._h, _address(ptr)))

    def raw_alloc(self, size_bytes: int, stream=None) -> int:
        """malloc on the current device; on ``stream``, else the thread's
        current stream (PyTorch: raw_alloc / raw_alloc_with_stream)."""
        out = ctypes.c_void_p()
        if stream is None:
            _check(_lib.lib().ccalloc_raw_alloc(self._h, _size(size_bytes), ctypes.byref(out)))
        else:
            _check(_lib.lib().ccalloc_raw_alloc_with_stream(self._h, _size(size_bytes), _stream(stream),
                                                            ctypes.byref(out)))
        return out.value or 0

    def record_stream(self, ptr: int, stream) -> None:
        """The block holding ``ptr`` is not reused before the work queued on
        ``stream`` up to its free has completed (PyTorch: recordStream)."""
        _check(_lib.lib().ccalloc_record_stream(self._h, _address(ptr), _stream(stream)))

    def get_base_allocation(self, ptr: int) -> tuple:
        """(base address, size in bytes) of the segment holding ``ptr``."""
        base, size = ctypes.c_void_p(), ctypes.c_size_t()
        _check(_lib.lib().ccalloc_get_base_allocation(self._h, _address(ptr), ctypes.byref(base),
                                                      ctypes.byref(size)))
        return base.value or 0, size.value

    # ---- inter-process sharing (SPEC F25, C3) --------------------------------------------------

    def share_ipc_handle(self, ptr: int) -> IpcHandle:
        """Shares the live block at ``ptr`` with other processes (PyTorch:
        shareIpcHandle). A block of an expandable segment gets the same
        handle every time; while another process has it open, this
        allocator's ``free`` of it waits (the block stays allocated) until
        that process closes it or ends. Send the result with
        ``send_ipc_handle``, then ``close()`` it."""
        ex = _lib.ccalloc_ipc_export_t()
        _check(_lib.lib().ccalloc_share_ipc_handle(self._h, _address(ptr), ctypes.byref(ex)))
        return _take_export(ex)

    def open_ipc_handle(self, handle: bytes, fds=(), access_device: int = -1) -> int:
        """Opens a handle of another process (PyTorch: getIpcDevPtr) and
        returns the block's address here; ``fds`` (the descriptors received
        with it) stay the caller's. ``access_device`` -1: the handle's
        device. Opening the same block again returns the same address."""
        if isinstance(handle, IpcHandle):
            handle, fds = handle.handle, handle.fds
        if not isinstance(handle, (bytes, bytearray)):
            raise InvalidArgumentError(f"ccalloc: open_ipc_handle: handle must be bytes, got {type(handle).__name__}")
        fds = [_integer(fd, "fds", 0, _INT_MAX) for fd in fds]
        array = (ctypes.c_int * max(1, len(fds)))(*fds)
        out = ctypes.c_void_p()
        device = _integer(access_device, "access_device", -_INT_MAX - 1, _INT_MAX)
        _check(_lib.lib().ccalloc_open_ipc_handle(self._h, bytes(handle), len(handle), array, len(fds), device,
                                                  ctypes.byref(out)))
        return out.value or 0

    def share_ipc_handle_bytes(self, ptr: int) -> bytes:
        """The handle of the block at ``ptr`` as bytes alone (picklable: no
        descriptors travel); the importer's ``open_ipc_handle_bytes`` takes
        the descriptors from this process with pidfd_getfd (Linux 5.6, ptrace
        permission over this process). The same bytes every time."""
        lib, length = _lib.lib(), ctypes.c_size_t()
        _check(lib.ccalloc_share_ipc_handle_pidfd(self._h, _address(ptr), None, 0, ctypes.byref(length)))
        buffer = ctypes.create_string_buffer(max(1, length.value))
        _check(lib.ccalloc_share_ipc_handle_pidfd(self._h, _address(ptr), buffer, length.value,
                                                  ctypes.byref(length)))
        return buffer.raw[:length.value]

    def open_ipc_handle_bytes(self, data: bytes, access_device: int = -1) -> int:
        """Opens bytes from ``share_ipc_handle_bytes`` of another process and
        returns the block's address here (close it with ``close_ipc_handle``)."""
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"ccalloc: open_ipc_handle_bytes: data must be bytes, got {type(data).__name__}")
        out = ctypes.c_void_p()
        device = _integer(access_device, "access_device", -_INT_MAX - 1, _INT_MAX)
        _check(_lib.lib().ccalloc_open_ipc_handle_pidfd(self._h, bytes(data), len(data), device, ctypes.byref(out)))
        return out.value or 0

    def close_ipc_handle(self, ptr: int) -> None:
        """Drops one reference to an address from ``open_ipc_handle``; the
        last one unmaps it and lets the producer reclaim the block."""
        _check(_lib.lib().ccalloc_close_ipc_handle(self._h, _address(ptr)))

    def reclaim_ipc_exports(self) -> int:
        """Frees the shared blocks whose free waited for other processes
        and that no live process holds any more; returns how many
        (``empty_cache`` does this first too)."""
        out = ctypes.c_size_t()
        _check(_lib.lib().ccalloc_reclaim_ipc_exports(self._h, ctypes.byref(out)))
        return out.value

    def ipc_export_status(self, ptr: int) -> dict:
        """For a shared expandable block not yet really freed:
        ``{"importers": live processes holding it, "owner_freed": whether
        this allocator's free of it is waiting}``."""
        importers, freed = ctypes.c_size_t(), ctypes.c_int()
        _check(_lib.lib().ccalloc_ipc_export_status(self._h, _address(ptr), ctypes.byref(importers),
                                                    ctypes.byref(freed)))
        return {"importers": importers.value, "owner_freed": bool(freed.value)}

    # ---- sleep and wake (SPEC S1-S5) ---------------------------------------------------------

    def pause(self, tags, keep_contents: bool = False, device: int = -1) -> dict:
        """Releases the device pages of every block of ``tags`` (a name or a
        list of names) while keeping their addresses; with
        ``keep_contents`` their bytes are copied to pinned host memory
        first. ``device`` -1: every device. Returns the figures
        (released_bytes, paused_bytes, copied_bytes, host_time_us).
        InvalidArgumentError for "default", an unknown tag or a graph
        capture underway; OutOfMemoryError when the host lacks memory for
        the contents (nothing paused)."""
        names = _tag_names(tags)
        out = _lib.ccalloc_sleep_result_t()
        _check(_lib.lib().ccalloc_pause(self._h, _device_or_all(device), names, len(names),
                                        1 if _flag(keep_contents, "keep_contents") else 0,
                                        ctypes.byref(out)))
        return _sleep_dict(out)

    def resume(self, tags, device: int = -1) -> dict:
        """Maps the paused tags' pages again at the same addresses and
        restores kept contents. OutOfMemoryError (naming the tag and the
        bytes) when the device lacks room even after ccalloc returned its
        cached memory; the tags then stay paused and a later resume may
        succeed."""
        names = _tag_names(tags)
        out = _lib.ccalloc_sleep_result_t()
        _check(_lib.lib().ccalloc_resume(self._h, _device_or_all(device), names, len(names), ctypes.byref(out)))
        return _sleep_dict(out)

    def tag_usage(self, tag: str, device: int = 0) -> dict:
        """What ``tag`` holds on ``device``: allocated, reserved, paused and
        kept bytes, segments, blocks, and whether it is paused."""
        if not isinstance(tag, str):
            raise InvalidArgumentError(f"ccalloc: tag_usage: tag must be a str, not {type(tag).__name__}")
        out = _lib.ccalloc_tag_usage_t()
        _check(_lib.lib().ccalloc_tag_usage(self._h, _device_index(device), _text(tag, "tag"), ctypes.byref(out)))
        d = {name: getattr(out, name) for name, _ in out._fields_}
        d["paused"] = bool(d["paused"])
        return d

    # ---- cache and limits -------------------------------------------------------------------

    def empty_cache(self) -> None:
        """Returns every unused cached segment to the device (PyTorch: emptyCache)."""
        _check(_lib.lib().ccalloc_empty_cache(self._h))

    def cache_info(self, device: int = 0) -> int:
        """Size in bytes of ``device``'s largest cached free block."""
        out = ctypes.c_size_t()
        _check(_lib.lib().ccalloc_cache_info(self._h, _device_index(device), ctypes.byref(out)))
        return out.value

    def set_memory_fraction(self, fraction: float, device: int = 0) -> None:
        """Caps ``device``'s reserved bytes at fraction x total (PyTorch:
        set_per_process_memory_fraction); InvalidArgumentError outside [0, 1]."""
        _check(_lib.lib().ccalloc_set_memory_fraction(self._h, _device_index(device), _real(fraction, "fraction")))

    def get_memory_fraction(self, device: int = 0) -> float:
        out = ctypes.c_double()
        _check(_lib.lib().ccalloc_get_memory_fraction(self._h, _device_index(device), ctypes.byref(out)))
        return out.value

    def enable(self, enabled: bool = True) -> None:
        """Caching on or off (off: every allocation goes to the device and back)."""
        _check(_lib.lib().ccalloc_enable(self._h, 1 if _flag(enabled, "enabled") else 0))

    @property
    def is_enabled(self) -> bool:
        return bool(self._int(_lib.lib().ccalloc_is_enabled))

    # ---- statistics ---------------------------------------------------------------------------

    def memory_stats(self, device: int = 0) -> "collections.OrderedDict[str, int]":
        """``device``'s statistics with the flat keys of
        ``torch.cuda.memory_stats()`` (sorted), e.g.
        ``"reserved_bytes.all.peak"``, ``"allocation.all.current"``,
        ``"num_device_alloc"``. Bytes for *_bytes keys, counts otherwise."""
        names = _names()
        values = (ctypes.c_int64 * len(names))()
        _check(_lib.lib().ccalloc_get_device_stats(self._h, _device_index(device), values, len(names)))
        return collections.OrderedDict(zip(names, values))

    def stat(self, name: str, device: int = 0) -> int:
        """One statistic by its torch.cuda.memory_stats() name."""
        out = ctypes.c_int64()
        _check(_lib.lib().ccalloc_get_device_stat(self._h, _device_index(device), _text(name, "name"), ctypes.byref(out)))
        return out.value

    def reset_peak_stats(self, device: int = 0) -> None:
        _check(_lib.lib().ccalloc_reset_peak_stats(self._h, _device_index(device)))

    def reset_accumulated_stats(self, device: int = 0) -> None:
        _check(_lib.lib().ccalloc_reset_accumulated_stats(self._h, _device_index(device)))

    # ---- configuration and observers -------------------------------------------------------------

    def set_config(self, text: str) -> None:
        """Applies a configuration string in PyTorch's syntax on top of the
        current one; ConfigError names a bad key or value (nothing changes)."""
        _check(_lib.lib().ccalloc_set_config(self._h, _text(text, "config")))

    def get_config(self) -> str:
        """The configuration in force, as a string set_config accepts;
        expandable_segments is named also at its default, with the value in
        force (True where the device has virtual memory)."""
        length = ctypes.c_size_t()
        lib = _lib.lib()
        _check(lib.ccalloc_get_config(self._h, None, 0, ctypes.byref(length)))
        buffer = ctypes.create_string_buffer(length.value + 1)
        _check(lib.ccalloc_get_config(self._h, buffer, len(buffer), ctypes.byref(length)))
        return buffer.value.decode()

    # ---- memory history and snapshots (SPEC F13, F14, E4) ------------------------------------------

    def record_history(self, enabled: bool = True, max_entries: int = 100000, *, context=None,
                       when: str = "all", clear: bool = False, skip_actions=()) -> None:
        """Starts or stops recording the memory history of every device (as
        torch.cuda.memory._record_memory_history): the newest ``max_entries``
        trace entries per device, microsecond timestamps. Stopping drops them.

        ``context``: None (no stacks), ``"python"`` (the Python stack of each
        malloc and free, as PyTorch's ``stacks="python"``), or a callable
        returning the frames to keep, innermost first, as (name, filename,
        line) tuples or None; it is called on the allocating thread. Frames
        appear in snapshots as PyTorch's ``{"name", "filename", "line"}``.
        ``when``: ``"state"`` (frames on live blocks only), ``"alloc"`` (also
        on alloc and segment entries) or ``"all"`` (also at free), PyTorch's
        RecordContext. ``clear``: drop what was recorded so far.
        ``skip_actions``: action names not stored: a list of them (e.g.
        ``["free_requested"]``) or one str, comma-separated as in C
        (``"free_requested,segment_map"``).
        Raises InvalidArgumentError for an unknown ``when``, action or
        context, TypeError for an action that is not a str. The callables
        of a configuration are kept until a later record_history replaced
        it and the library released every context recorded with it."""
        h = self._h  # refuses a closed Allocator first
        enabled = _flag(enabled, "enabled")
        clear = _flag(clear, "clear")
        whens = {"never": 0, "state": 1, "alloc": 2, "all": 3}
        if not isinstance(when, str) or when not in whens:
            raise InvalidArgumentError(f"ccalloc: record_history: when must be one of {', '.join(whens)}, "
                                       f"got {_shown(when)}")
        recorder = None
        if context is not None:
            recorder = _python_stack if isinstance(context, str) and context == "python" else context
            if not callable(recorder):
                raise InvalidArgumentError("ccalloc: record_history: context must be None, 'python' or a callable, "
                                           f"got {_shown(context)}")
        lib = _lib.lib()
        o = _lib.ccalloc_history_options_t()
        lib.ccalloc_history_options_init(ctypes.byref(o))
        o.enabled = 1 if enabled else 0
        o.max_entries = _integer(max_entries, "max_entries", 1)
        o.when = whens[when]
        o.clear = 1 if clear else 0
        o.skip_actions = _skip_actions(skip_actions)
        slot = self._history
        with slot.lock:
            number = None
            if recorder is not None and enabled:
                number = next(_config_numbers)
                with _configs_lock:
                    _configs[number] = _ContextConfig(recorder)
                o.record, o.release, o.frames = _CONTEXT_CALLBACKS
                o.user_data = number
            try:
                _check(lib.ccalloc_record_history_ex(h, ctypes.byref(o)))
            except BaseException:
                if number is not None:
                    with _configs_lock:
                        _configs.pop(number, None)
                raise
            slot.replace(number)

    def snapshot_json(self, include_traces: bool = True) -> str:
        """The snapshot as JSON with the layout of torch.cuda.memory._snapshot()."""
        length = ctypes.c_size_t()
        lib = _lib.lib()
        flag = 1 if _flag(include_traces, "include_traces") else 0
        _check(lib.ccalloc_snapshot_json(self._h, flag, None, 0, ctypes.byref(length)))
        while True:
            # The size query records nothing, so length + 1 fits unless other
            # threads allocate in between; then the loop asks again.
            buffer = ctypes.create_string_buffer(length.value + 1)
            _check(lib.ccalloc_snapshot_json(self._h, flag, buffer, len(buffer), ctypes.byref(length)))
            if length.value < len(buffer):
                return buffer.value.decode()

    def snapshot(self, include_traces: bool = True) -> dict:
        """The snapshot as PyTorch's dictionary (torch.cuda.memory._snapshot())."""
        from . import snapshot as _snapshot
        return _snapshot.from_json(self.snapshot_json(include_traces))

    def dump_snapshot(self, path: str) -> None:
        """Writes the snapshot as the pickle PyTorch's viewers read (as
        torch.cuda.memory._dump_snapshot): ``python -m torch.cuda._memory_viz
        trace_plot PATH`` or pytorch.org/memory_viz. ``path``: a str or
        os.PathLike, replaced whole. Raises TypeError for any other type (an
        int is not taken as a file descriptor), OSError naming the path when
        it cannot be written."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"ccalloc: dump_snapshot: path must be a str or os.PathLike, "
                            f"got {type(path).__name__} {_shown(path)}")
        from . import snapshot as _snapshot
        snapshot = self.snapshot(True)
        try:
            _snapshot.write_pickle(snapshot, path)
        except OSError as e:
            raise type(e)(e.errno, f"ccalloc: dump_snapshot: cannot write {os.fspath(path)!r}: "
                                   f"{e.strerror or e}") from None

    def attach_out_of_memory_observer(self, observer: Callable[[int, int, int, int], None]) -> None:
        """Calls ``observer(device, requested_bytes, allowed_bytes,
        free_bytes)`` on each out-of-memory error (SPEC F17). An exception it
        raises is printed and dropped. Observers stay attached for the
        allocator's life."""
        _callable(observer, "observer")

        def trampoline(_user, device, requested, allowed, free):
            # the caller still gets its OOM
            _call_dropping("an out-of-memory observer", lambda args: observer(*args),
                           (device, requested, allowed, free))

        callback = _lib.OOM_OBSERVER(trampoline)
        _check(_lib.lib().ccalloc_attach_out_of_memory_observer(self._h, callback, None))
        self._keep_callback(callback)

    def _keep_callback(self, callback) -> None:
        self._observers.append(callback)  # the C side keeps only the pointer
        if not self._owned:
            _process_observers.append(callback)

    def attach_trace_tracker(self, tracker: Callable[[dict], None]) -> None:
        """Calls ``tracker(entry)`` with every trace entry of every device,
        recorded or not (SPEC F18; PyTorch's attachAllocatorTraceTracker):
        a dict with ``action`` ("alloc", "free_requested", ...), ``device``,
        ``addr``, ``size``, ``stream``, ``time_us``. It runs after the
        allocator's locks are released and may call back into it. An
        exception it raises is printed and dropped."""
        _callable(tracker, "tracker")

        def trampoline(_user, entry):
            e = entry.contents
            _call_dropping("a trace tracker", tracker, {
                "action": _lib.TRACE_ACTIONS[e.action], "device": e.device, "addr": e.addr,
                "size": e.size_bytes, "stream": e.stream or 0, "time_us": e.time_us})

        callback = _lib.TRACE_TRACKER(trampoline)
        _check(_lib.lib().ccalloc_attach_trace_tracker(self._h, callback, None))
        self._keep_callback(callback)

    def attach_mapping_listener(self, listener: Callable[[dict], None]) -> None:
        """Calls ``listener(event)`` at every change of what a device has
        mapped (SPEC C1): a dict with ``change`` ("map" after the device
        mapped, "unmap" before it unmaps, "move", "unmap_completed"),
        ``reason``, ``device``, ``addr``, ``size``, ``stream``,
        ``expandable``. It runs under the device's locks: it must not call
        into the allocator (most calls then raise InvalidArgumentError;
        ``malloc`` and ``free`` stop the process, as they would deadlock:
        ccalloc.h, ccalloc_attach_mapping_listener). An exception it raises
        is printed and dropped."""
        _callable(listener, "listener")

        def trampoline(_user, event):
            e = event.contents
            _call_dropping("a mapping listener", listener, {
                "change": _lib.MAPPING_CHANGES[e.change], "reason": _lib.MAPPING_REASONS[e.reason],
                "device": e.device, "addr": e.addr, "size": e.size_bytes, "stream": e.stream or 0,
                "expandable": bool(e.expandable)})

        callback = _lib.MAPPING_LISTENER(trampoline)
        _check(_lib.lib().ccalloc_attach_mapping_listener(self._h, callback, None))
        self._keep_callback(callback)

    # ---- private pools (SPEC F20, F21, E5; PyTorch's MemPool) -----------------------------------
    #
    # A pool holds its own segments; allocations routed to it (between
    # begin_allocate_to_pool and end_allocate_to_pool) come from them and
    # return there. Pools are per device. While the use count is above 0 the
    # segments stay; at 0 they go back at the next empty_cache and the pool
    # disappears. ``id`` is a pair of ints (PyTorch's MempoolId_t): user pools
    # (first, 0) from new_pool_id(), CUDA graph pools (0, n); (0, 0) is the
    # default pool. ccalloc.torch.MemPool and use_mem_pool wrap these for
    # PyTorch.

    def new_pool_id(self) -> tuple:
        """A pool id no earlier call of this process returned: ``(n, 0)``,
        n = 1, 2, ... (PyTorch: MemPool's id counter). Creates nothing."""
        out = _lib.ccalloc_mempool_id_t()
        _check(_lib.lib().ccalloc_new_pool_id(self._h, ctypes.byref(out)))
        return (out.first, out.second)

    def create_pool(self, id, device: int = 0, segment_allocator=None) -> None:
        """Creates pool ``id`` on ``device`` with use count 1, or adds 1 to
        its use count (PyTorch: createOrIncrefPool).

        ``segment_allocator``: None (the backend's segments) or a pair
        ``(malloc, free)`` of C functions with cudaMalloc's and cudaFree's
        shapes, ``int malloc(void** ptr, size_t size_bytes)`` and ``int
        free(void* ptr)``, 0 meaning success: as addresses (ints, e.g.
        ``nccl_segment_allocator()``) or ctypes function pointers (kept alive
        here). They run with ``device`` current and the allocator's device
        lock held, so they must not call into ccalloc; a nonzero malloc counts
        as out of memory, a nonzero free raises BackendError from the call
        that returned the segment. Used only when the pool is created.
        Raises InvalidArgumentError for id (0, 0), a bad pair, a bad device.
        """
        pool = _pool_id(id)
        malloc_fn = free_fn = None
        keep = ()
        if segment_allocator is not None:
            try:
                malloc_obj, free_obj = segment_allocator
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    "ccalloc: create_pool: segment_allocator must be None or a pair (malloc, free) of C "
                    f"function addresses, got {_shown(segment_allocator, 80)}") from None
            malloc_fn, free_fn = _function_address(malloc_obj, "malloc"), _function_address(free_obj, "free")
            keep = (malloc_obj, free_obj)
        _check(_lib.lib().ccalloc_create_pool(self._h, _device_index(device), pool, malloc_fn, free_fn))
        if keep:
            (self._kept if self._owned else _process_kept).append(keep)

    def release_pool(self, id, device: int = 0) -> None:
        """Subtracts 1 from pool ``id``'s use count (PyTorch: releasePool).
        InvalidArgumentError for an unknown pool or one already at 0."""
        _check(_lib.lib().ccalloc_release_pool(self._h, _device_index(device), _pool_id(id)))

    def pool_use_count(self, id, device: int = 0) -> int:
        """Pool ``id``'s use count; 0 for a released or unknown pool
        (PyTorch: getPoolUseCount)."""
        out = ctypes.c_int()
        _check(_lib.lib().ccalloc_pool_use_count(self._h, _device_index(device), _pool_id(id), ctypes.byref(out)))
        return out.value

    def begin_allocate_to_pool(self, id, device: int = 0, stream=None, all_streams: bool = False) -> None:
        """From now on, allocations on ``device`` made on ``stream`` (None:
        the default stream), or on every stream when ``all_streams``, come
        from pool ``id`` (PyTorch: beginAllocateToPool). Calls nest; the most
        recent one that takes a stream wins. While one is active the
        allocator follows CUDA graph capture rules on that device: no event
        is queried or waited for and no memory is returned (not even on out
        of memory), so end it promptly. InvalidArgumentError for an unknown
        or released pool."""
        _check(_lib.lib().ccalloc_begin_allocate_to_pool(self._h, _device_index(device), _pool_id(id),
                                                         _stream(stream), 1 if _flag(all_streams, "all_streams") else 0))

    def end_allocate_to_pool(self, id, device: int = 0) -> None:
        """Ends the most recent begin_allocate_to_pool of pool ``id``
        (PyTorch: endAllocateToPool); InvalidArgumentError if none is active."""
        _check(_lib.lib().ccalloc_end_allocate_to_pool(self._h, _device_index(device), _pool_id(id)))

    def pool_usage(self, id, device: int = 0) -> dict:
        """What pool ``id`` holds now: ``segment_count``, ``reserved_bytes``,
        ``allocated_bytes``, ``active_bytes`` (allocated + freed blocks
        waiting on other streams), ``allocation_count``, ``use_count``. Id
        (0, 0) gives the default pool. InvalidArgumentError for an unknown
        pool."""
        out = _lib.ccalloc_pool_usage_t()
        _check(_lib.lib().ccalloc_pool_usage(self._h, _device_index(device), _pool_id(id), ctypes.byref(out)))
        return {name: getattr(out, name) for name, _ in out._fields_}

    # ---- streams of the backend ------------------------------------------------------------------

    def stream_create(self, device: int = 0) -> int:
        """A new stream of the backend (CUDA: non-blocking); destroy it with stream_destroy."""
        out = ctypes.c_void_p()
        _check(_lib.lib().ccalloc_stream_create(self._h, _device_index(device), ctypes.byref(out)))
        return out.value or 0

    def stream_destroy(self, stream, device: int = 0) -> None:
        _check(_lib.lib().ccalloc_stream_destroy(self._h, _device_index(device), _stream(stream)))

    def stream_synchronize(self, stream, device: int = 0) -> None:
        _check(_lib.lib().ccalloc_stream_synchronize(self._h, _device_index(device), _stream(stream)))


_UNGATED = {"__init__", "close", "closed", "_h", "__enter__", "__exit__", "__del__", "process_wide", "_KINDS"}
for _name, _member in list(vars(Allocator).items()):
    if _name in _UNGATED or _name.startswith("__") and _name.endswith("__"):
        continue
    if isinstance(_member, property) and _member.fget is not None:
        setattr(Allocator, _name, property(_gated(_member.fget), _member.fset, _member.fdel, _member.__doc__))
    elif callable(_member) and not isinstance(_member, (classmethod, staticmethod, type)):
        setattr(Allocator, _name, _gated(_member))
del _name, _member

# Observers and segment functions of the process-wide allocator outlive
# every Allocator wrapper.
_process_observers: list = []


def _call_dropping(what: str, fn, arg) -> None:
    """Calls fn(arg); an exception must not cross into C: printed and dropped."""
    try:
        fn(arg)
    except BaseException:
        import traceback

        print(f"ccalloc: {what} raised (ignored):", file=sys.stderr)
        traceback.print_exc()
_process_kept: list = []


def _tag_names(tags):
    """A tag name or a list of them as a C array of char*; InvalidArgumentError otherwise."""
    if isinstance(tags, str):
        tags = [tags]
    if not isinstance(tags, (list, tuple)) or not tags or not all(isinstance(t, str) for t in tags):
        raise InvalidArgumentError(f"ccalloc: tags must be a str or a non-empty list of str, not {_shown(tags)}")
    return (ctypes.c_char_p * len(tags))(*[_text(t, "tag") for t in tags])


def _sleep_dict(out) -> dict:
    return {name: getattr(out, name) for name, _ in out._fields_}

"""ccalloc snapshots as PyTorch memory snapshots (SPEC E4).

ccalloc's C++ library writes a snapshot as JSON (``ccalloc::to_json``, the C
API's snapshot call) with the keys and nesting of PyTorch's
``torch.cuda.memory._snapshot()`` dictionary. This module turns that JSON into
the same Python objects PyTorch builds (the only difference JSON cannot carry:
``segment_pool_id`` is a tuple) and writes them as a pickle, the file
``torch.cuda.memory._dump_snapshot`` writes. PyTorch's viewers read it:

    python -m torch.cuda._memory_viz trace_plot snapshot.pickle -o trace.html
    python -m torch.cuda._memory_viz segment_plot snapshot.pickle -o segments.html

and https://pytorch.org/memory_viz (drag the file onto the page).

Pure Python (standard library only); needs neither torch nor ccalloc's
compiled parts. As a script:

    python3 python/ccalloc/snapshot.py SNAPSHOT.json -o SNAPSHOT.pickle

Errors name the file and where in the snapshot the problem is
(``segments[2].blocks[0]: missing key 'state'``).
"""

import argparse
import errno
import itertools
import json
import pickle
import os
import stat
import sys

__all__ = ["SnapshotError", "from_json", "load_json", "write_pickle", "convert", "main"]

# The keys of PyTorch's snapshot dictionary (PyTorch 2.11), in its order.
SEGMENT_KEYS = ("device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks")
BLOCK_KEYS = ("address", "size", "requested_size", "state", "frames")
TRACE_KEYS = ("action", "size", "stream", "time_us", "frames", "compile_context", "user_metadata")
FRAME_KEYS = ("name", "filename", "line")
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
SEGMENT_TYPES = ("small", "large")


class SnapshotError(ValueError):
    """A snapshot that does not have PyTorch's layout; the message says where."""


def _need(obj, key, where, kind=None):
    if not isinstance(obj, dict):
        raise SnapshotError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise SnapshotError(f"{where}: missing key {key!r}")
    value = obj[key]
    if kind is not None and not _is(value, kind):
        raise SnapshotError(f"{where}.{key}: expected {kind}, got {type(value).__name__} {value!r:.40}")
    return value


def _is(value, kind):
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "list":
        return isinstance(value, list)
    if kind == "dict":
        return isinstance(value, dict)
    raise AssertionError(kind)


def _frames(value, where):
    if not isinstance(value, list):
        raise SnapshotError(f"{where}: expected a list of frames, got {type(value).__name__}")
    out = []
    for i, f in enumerate(value):
        w = f"{where}[{i}]"
        out.append({"name": _need(f, "name", w, "str"), "filename": _need(f, "filename", w, "str"),
                    "line": _need(f, "line", w, "int")})
    return out


def _segment(seg, where):
    out = {}
    for key in SEGMENT_KEYS:
        _need(seg, key, where)
    for key in ("device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream"):
        out[key] = _need(seg, key, where, "int")
    seg_type = _need(seg, "segment_type", where, "str")
    if seg_type not in SEGMENT_TYPES:
        raise SnapshotError(f"{where}.segment_type: {seg_type!r} is not 'small' or 'large'")
    out["segment_type"] = seg_type
    pool = _need(seg, "segment_pool_id", where)
    if not (isinstance(pool, (list, tuple)) and len(pool) == 2 and all(_is(p, "int") for p in pool)):
        raise SnapshotError(f"{where}.segment_pool_id: expected two integers, got {pool!r:.40}")
    out["segment_pool_id"] = (pool[0], pool[1])  # a tuple, as PyTorch pickles it
    out["is_expandable"] = _need(seg, "is_expandable", where, "bool")
    out["frames"] = _frames(seg["frames"], where + ".frames")
    blocks = []
    address = out["address"]
    total = 0
    for i, b in enumerate(_need(seg, "blocks", where, "list")):
        w = f"{where}.blocks[{i}]"
        for key in BLOCK_KEYS:
            _need(b, key, w)
        block = {"address": _need(b, "address", w, "int"), "size": _need(b, "size", w, "int"),
                 "requested_size": _need(b, "requested_size", w, "int"), "state": _need(b, "state", w, "str"),
                 "frames": _frames(b["frames"], w + ".frames")}
        if block["state"] not in BLOCK_STATES:
            raise SnapshotError(f"{w}.state: {block['state']!r} is not one of {', '.join(BLOCK_STATES)}")
        if block["address"] != address:
            raise SnapshotError(f"{w}.address: {block['address']} but the blocks before end at {address}"
                                " (blocks must tile their segment)")
        address += block["size"]
        total += block["size"]
        blocks.append(block)
    if total != out["total_size"]:
        raise SnapshotError(f"{where}: blocks sum to {total} bytes, total_size is {out['total_size']}")
    out["blocks"] = blocks
    return out


def _entry(e, where):
    out = {"action": _need(e, "action", where, "str")}
    addr_key = "device_free" if out["action"] == "oom" else "addr"
    out[addr_key] = _need(e, addr_key, where, "int")
    for key in ("size", "stream", "time_us"):
        out[key] = _need(e, key, where, "int")
    out["frames"] = _frames(_need(e, "frames", where), where + ".frames")
    out["compile_context"] = _need(e, "compile_context", where, "str")
    out["user_metadata"] = _need(e, "user_metadata", where, "str")
    return out


def from_json(data):
    """PyTorch's snapshot dictionary from ccalloc's JSON (text, bytes or the
    already parsed object). Raises SnapshotError naming the first problem."""
    if isinstance(data, (str, bytes, bytearray)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as e:
            raise SnapshotError(f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise SnapshotError(f"expected a JSON object at the top, got {type(data).__name__}")
    segments = [_segment(s, f"segments[{i}]") for i, s in enumerate(_need(data, "segments", "snapshot", "list"))]
    traces = []
    for d, trace in enumerate(_need(data, "device_traces", "snapshot", "list")):
        if not isinstance(trace, list):
            raise SnapshotError(f"device_traces[{d}]: expected a list, got {type(trace).__name__}")
        traces.append([_entry(e, f"device_traces[{d}][{i}]") for i, e in enumerate(trace)])
    settings = _need(data, "allocator_settings", "snapshot", "dict")
    annotations = _need(data, "external_annotations", "snapshot", "list")
    for i, a in enumerate(annotations):
        _need(a, "device", f"external_annotations[{i}]", "int")
        _need(a, "time_us", f"external_annotations[{i}]", "int")
    return {"segments": segments, "device_traces": traces, "allocator_settings": dict(settings),
            "external_annotations": [dict(a) for a in annotations]}


def load_json(path):
    """from_json of a file; errors start with the file name."""
    try:
        with open(path, "rb") as f:
            return from_json(f.read())
    except SnapshotError as e:
        raise SnapshotError(f"{path}: {e}") from None


_temporary_count = itertools.count()


def write_pickle(snapshot, file):
    """Writes `snapshot` as PyTorch's _dump_snapshot does (pickle.dump);
    `file` is a path or a binary file object.

    A path is written whole or not at all, as the library's oom_snapshot
    file (include/ccalloc/core/file_output.hpp): a regular file (or none
    yet) is replaced by a new temporary file in its folder, renamed over it
    (os.replace) once completely written; on failure the temporary file is
    removed and the old file stays. The new file keeps the old one's
    permission bits (a new one gets 0666 less the umask); a read-only file
    is not replaced (PermissionError). A symbolic link stays: the file it
    leads to is replaced. A FIFO, a device and paths under /dev/ and /proc/
    are written in place."""
    if hasattr(file, "write"):
        pickle.dump(snapshot, file)
        return
    path = os.fspath(file)
    in_place = str(path).startswith(("/dev/", "/proc/"))
    target = path if in_place else os.path.realpath(path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    if in_place or (st is not None and not stat.S_ISREG(st.st_mode)):
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
        return
    if st is not None and not os.access(target, os.W_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        temporary = f"{target}.tmp.{os.getpid()}.{next(_temporary_count)}"
        try:
            fd = os.open(temporary, flags, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary file name", target)
    try:
        with os.fdopen(fd, "wb") as f:
            if st is not None:
                os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
            pickle.dump(snapshot, f)
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def convert(json_path, pickle_path):
    """Reads ccalloc's JSON snapshot and writes PyTorch's pickle. Returns the snapshot."""
    snapshot = load_json(json_path)
    write_pickle(snapshot, pickle_path)
    return snapshot


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="snapshot.py",
        description="Turn a ccalloc snapshot (JSON) into a PyTorch memory snapshot pickle that "
                    "torch.cuda._memory_viz and the memory_viz web page read.")
    parser.add_argument("json", help="snapshot written by ccalloc (JSON)")
    parser.add_argument("-o", "--output", required=True, help="the pickle to write")
    args = parser.parse_args(argv)
    if os.path.exists(args.output) and os.path.exists(args.json) and os.path.samefile(args.output, args.json):
        print(f"snapshot.py: the output {args.output} is the snapshot {args.json} (the same file), "
              f"which it would overwrite; write the pickle to another file", file=sys.stderr)
        return 2
    try:
        s = load_json(args.json)
    except SnapshotError as e:
        print(f"snapshot.py: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"snapshot.py: cannot read {args.json}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        write_pickle(s, args.output)
    except OSError as e:  # the path, not a temporary file's name (e.filename)
        print(f"snapshot.py: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 1
    n_entries = sum(len(t) for t in s["device_traces"])
    print(f"wrote {args.output}: {len(s['segments'])} segments, {n_entries} trace entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())

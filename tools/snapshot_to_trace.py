#!/usr/bin/env python3
"""Convert a PyTorch memory snapshot pickle into ccalloc's trace format.

    python3 tools/snapshot_to_trace.py SNAPSHOT.pickle [-o OUT.trace] [--device N]

The input is what ``torch.cuda.memory._dump_snapshot()`` writes (gzip
allowed). Its ``device_traces[N]`` (default: the device with the most entries)
becomes one event per line, ``time_us action addr size stream``
(docs/trace-format.md), which ``ccalloc replay`` and ``ccalloc report`` read.
``ccalloc replay SNAPSHOT.pickle`` does the same conversion itself, in C++
(src/replay/snapshot_reader.cpp): this script shows the converted trace as text.

A snapshot's trace often starts after the program did (history was turned on
later, or the ring buffer dropped the oldest entries). So that the trace
replays as the program ran, the converter adds, at the trace's first time:
- an ``alloc`` for every block that is freed in the trace, or still live in
  the snapshot's segments, without an ``alloc`` in the trace;
- a ``segment_alloc`` for every segment freed in the trace, or present at the
  end, without one (for an expandable segment: a ``segment_map`` of what was
  mapped before the trace), so the recording allocator's reserved bytes start
  right.
Snapshots ccalloc wrote have ``pause`` and ``resume`` entries and a ``tag`` on
every entry and block: they become ``pause``, ``resume`` and ``tag`` lines, as
``ccalloc replay`` reads them (a resume of a tag paused before the trace began
is dropped, with a note).
A ``free_completed`` whose ``free_requested`` is missing gets one just before
it, and an ``alloc`` at an address freed without its ``free_completed`` gets
that one just before it. The header comment says how many of each were added.
An ``alloc`` at an address still live (no ``free_requested`` since its
``alloc``) is an error naming both entries, as the text trace refuses it.

Needs only the standard library: a snapshot holds plain dicts, lists, tuples,
strings and numbers, so it is unpickled without torch, and anything else (a
class, a function) is refused: unpickling never runs code from the file.
Errors print ``snapshot_to_trace: FILE: reason`` and exit with status 1.
"""

import argparse
import errno
import gzip
import io
import pickle
import os
import stat
import sys
import tempfile

# PyTorch's trace-entry actions that ccalloc's trace format has.
KNOWN_ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                 "segment_map", "segment_unmap", "snapshot", "oom", "pause", "resume"}
# A tag name (docs/sleep-wake.md): 1 to 64 of these characters; "default" is the default tag.
TAG_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:/")
DEFAULT_TAG = "default"
# The most an entry's time_us may be before the entry's ahead of it (1 s).
MAX_TIME_STEP_BACK_US = 1_000_000


class ConvertError(Exception):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only: a snapshot never refers to a class or function."""

    def find_class(self, module, name):
        raise ConvertError(f"not a plain-data snapshot: it refers to {module}.{name}")


def load_snapshot(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConvertError(f"cannot read: {e.strerror}") from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise ConvertError(f"corrupt gzip data: {e}") from None
    if not data.startswith(b"\x80"):
        raise ConvertError("not a pickle (PyTorch snapshots start with the pickle protocol byte 0x80)")
    if len(data) < 2 or not 2 <= data[1] <= 5:
        protocol = data[1] if len(data) >= 2 else None
        raise ConvertError(f"a pickle of protocol {protocol} (its first bytes are 0x80 0x{protocol or 0:02x}); "
                           "PyTorch snapshot pickles are protocols 2 to 5")
    try:
        snapshot = _PlainUnpickler(io.BytesIO(data)).load()
    except ConvertError:
        raise
    except Exception as e:  # truncated or corrupt pickle: many exception types
        raise ConvertError(f"corrupt pickle: {type(e).__name__}: {e}") from None
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        keys = sorted(map(repr, snapshot))[:6] if isinstance(snapshot, dict) else type(snapshot).__name__
        raise ConvertError(f"not a PyTorch memory snapshot (no 'device_traces'; found {keys})")
    return snapshot


def _field(entry, key, where, kind=int):
    if not isinstance(entry, dict):
        raise ConvertError(f"{where}: expected a dict, got {type(entry).__name__}")
    if key not in entry:
        raise ConvertError(f"{where}: missing {key!r}")
    value = entry[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ConvertError(f"{where}.{key}: expected a non-negative integer, got {value!r:.40}")
    if kind is str and not isinstance(value, str):
        raise ConvertError(f"{where}.{key}: expected a string, got {value!r:.40}")
    return value


def _tag(entry, where):
    """The tag of a ccalloc snapshot's entry or block ("default" when none)."""
    tag = entry.get("tag", DEFAULT_TAG)
    if not isinstance(tag, str):
        raise ConvertError(f"{where}.tag: expected a string, got {type(tag).__name__}")
    if not 1 <= len(tag) <= 64 or not set(tag) <= TAG_CHARACTERS:
        raise ConvertError(f"{where}.tag: bad tag {tag[:64]!r}: a tag name is 1 to 64 ASCII letters, digits and "
                           "the characters _-.:/")
    return tag


def convert(snapshot, device=None):
    """Returns (lines, notes): the trace lines and what was added or dropped."""
    traces = snapshot["device_traces"]
    if not isinstance(traces, list):
        raise ConvertError("device_traces is not a list")
    for d, t in enumerate(traces):
        if not isinstance(t, list):
            raise ConvertError(f"device_traces[{d}]: expected a list, got {type(t).__name__}")
    if device is None:
        # The device with the most entries, the lowest index among equals (as ccalloc's reader).
        device = max(range(len(traces)), key=lambda d: (len(traces[d]), -d)) if traces else 0
    if not 0 <= device < max(len(traces), 1):
        raise ConvertError(f"--device {device}: the snapshot has {len(traces)} device trace(s)")
    entries = traces[device] if traces else []
    all_segments = snapshot.get("segments", [])
    if not isinstance(all_segments, list):
        raise ConvertError(f"segments: expected a list, got {type(all_segments).__name__}")
    segments, seen = [], set()
    for i, s in enumerate(all_segments):
        if not isinstance(s, dict):
            raise ConvertError(f"segments[{i}]: expected a dict, got {type(s).__name__}")
        # A segment referenced many times (pickle memo) is walked once.
        if id(s) in seen:
            continue
        seen.add(id(s))
        _field(s, "address", f"segments[{i}]")
        _field(s, "total_size", f"segments[{i}]")
        if s.get("device", 0) == device:
            segments.append((i, s))

    events = []            # (time_us, action, addr, size, stream, tag, keep): tag of an alloc, pause, resume
    start_allocs = {}      # addr -> (size, stream, tag): blocks alive before the trace
    start_segments = {}    # addr -> (action, size, stream)
    live = {}              # addr -> (stream, size, entry index) of its alloc, until its free_requested
    pending = {}           # addr -> (stream, size, entry index) of its free_requested, until free_completed
    segment_seen = set()   # segment addrs with a segment_alloc in the trace
    mapped_net = {}        # expandable segment addr -> bytes mapped minus unmapped in the trace
    expandable = sorted(s["address"] for _, s in segments if s.get("is_expandable"))
    dropped = {}
    repaired = 0
    completions_added = 0  # free_completed added before an alloc at an address freed without one
    first_completion_added = ""
    last_time = None
    first_time = None
    steps_back = 0         # entries whose time_us is before the entry's ahead of them
    first_step_back = ""
    largest_step_back = 0
    paused = set()         # tags paused by the trace, not resumed yet
    resumes_dropped = 0    # resumes of tags paused before the trace began

    def owner(addr):  # the expandable segment holding addr, by base address
        best = None
        for base in expandable:
            if base <= addr:
                best = base
        return best

    for i, e in enumerate(entries):
        where = f"device_traces[{device}][{i}]"
        action = _field(e, "action", where, str)
        if action not in KNOWN_ACTIONS:
            dropped[action] = dropped.get(action, 0) + 1
            continue
        t = _field(e, "time_us", where)
        if first_time is None:
            first_time = t
        # PyTorch's approximate clock (the CPU's time-stamp counter) may step
        # back slightly from one core to another: such an entry takes the
        # time before it (the trace format wants time in order). A step back
        # of more than a second comes from no clock: the entries are out of
        # order or the snapshot is corrupt.
        if last_time is not None and t < last_time:
            back = last_time - t
            if back > MAX_TIME_STEP_BACK_US:
                raise ConvertError(f"{where}.time_us: goes backwards by {back} us ({t} after {last_time}), more "
                                   "than the 1000000 us a clock may step back: the entries are out of order")
            if not steps_back:
                first_step_back = f"{where}: {t} after {last_time}"
            steps_back += 1
            largest_step_back = max(largest_step_back, back)
            t = last_time
        last_time = t
        addr = _field(e, "device_free" if action == "oom" else "addr", where)
        size = _field(e, "size", where)
        stream = _field(e, "stream", where)
        tag = _tag(e, where)
        if action == "pause":  # ccalloc's: addr holds the bytes kept in host memory
            paused.add(tag)
            events.append((t, action, 0, size, 0, tag, "keep" if addr else "drop"))
            continue
        if action == "resume":
            if tag not in paused:  # paused before the trace began: nothing in it to wake
                resumes_dropped += 1
                continue
            paused.discard(tag)
            events.append((t, action, 0, size, 0, tag, None))
            continue
        if action == "alloc":
            if addr in live:
                _, live_size, live_entry = live[addr]
                raise ConvertError(f"{where}: alloc at address {addr} ({size} bytes), which is still live (allocated "
                                   f"at device_traces[{device}][{live_entry}] with {live_size} bytes; no "
                                   "free_requested between)")
            if addr in pending:  # its free_completed was not recorded
                freed_stream, freed_size, _ = pending.pop(addr)
                events.append((t, "free_completed", addr, freed_size, freed_stream, None, None))
                if not completions_added:
                    first_completion_added = f"{where} at address {addr}"
                completions_added += 1
            live[addr] = (stream, size, i)
        elif action == "free_requested":
            if addr in live:
                del live[addr]
            elif addr not in pending:
                start_allocs.setdefault(addr, (size, stream, tag))
            pending[addr] = (stream, size, i)
        elif action == "free_completed":
            if addr not in pending:
                if addr in live:
                    del live[addr]
                else:
                    start_allocs.setdefault(addr, (size, stream, tag))
                events.append((t, "free_requested", addr, size, stream, None, None))
                repaired += 1
            pending.pop(addr, None)
        elif action == "segment_alloc":
            segment_seen.add(addr)
        elif action == "segment_free":
            if addr not in segment_seen:
                start_segments.setdefault(addr, ("segment_alloc", size, stream))
            segment_seen.discard(addr)
        elif action in ("segment_map", "segment_unmap"):
            base = owner(addr)
            if base is not None:
                mapped_net[base] = mapped_net.get(base, 0) + (size if action == "segment_map" else -size)
        events.append((t, action, addr, size, stream, tag if action == "alloc" else None, None))

    # Blocks and segments alive at the end that the trace never allocated.
    for i, s in segments:
        stream = s.get("stream", 0)
        if s.get("is_expandable"):
            before = s["total_size"] - mapped_net.get(s["address"], 0)
            if before > 0:
                start_segments.setdefault(s["address"], ("segment_map", before, stream))
        elif s["address"] not in segment_seen:
            start_segments.setdefault(s["address"], ("segment_alloc", s["total_size"], stream))
        addr = s["address"]
        blocks = s.get("blocks", [])
        if not isinstance(blocks, list):
            raise ConvertError(f"segments[{i}].blocks: expected a list, got {type(blocks).__name__}")
        for j, b in enumerate(blocks):
            _field(b, "size", f"segments[{i}].blocks[{j}]")
            block_tag = _tag(b, f"segments[{i}].blocks[{j}]")
            if b.get("state") in ("active_allocated", "active_pending_free") and addr not in live \
                    and addr not in pending:
                start_allocs.setdefault(addr, (b.get("requested_size", b["size"]), stream, block_tag))
            addr += b["size"]

    t0 = first_time if first_time is not None else 0
    head = [(t0, action, addr, size, stream, None, None)
            for addr, (action, size, stream) in sorted(start_segments.items())]
    head += [(t0, "alloc", addr, size, stream, tag, None) for addr, (size, stream, tag) in sorted(start_allocs.items())]
    notes = [f"{len(entries)} trace entries of device {device}"]
    others = [f"device {d} ({len(t)} {'entry' if len(t) == 1 else 'entries'})"
              for d, t in enumerate(traces) if d != device and t]
    if others:
        notes.append("not converted (a trace holds one device; choose one with --device N): " + ", ".join(others))
    if start_allocs or start_segments:
        notes.append(f"{len(start_allocs)} alloc and {len(start_segments)} segment events added at the start "
                     "(allocated before the trace)")
    if repaired:
        notes.append(f"{repaired} missing frees added")
    if completions_added:
        notes.append(f"{completions_added} free_completed added before an alloc at an address freed without one "
                     f"(the first: {first_completion_added})")
    if resumes_dropped:
        notes.append(f"{resumes_dropped} resume {'entry' if resumes_dropped == 1 else 'entries'} of tags paused "
                     "before the trace began dropped")
    if steps_back:
        entries = "entry (" if steps_back == 1 else "entries (the first "
        notes.append(f"time_us steps back at {steps_back} {entries}{first_step_back}; at most "
                     f"{largest_step_back} us): each takes the time of the entry before it")
    if dropped:
        notes.append("dropped actions ccalloc's trace format has not: " +
                     ", ".join(f"{k} x{v}" for k, v in sorted(dropped.items())))
    # ccalloc's snapshots: tag, pause and resume lines, as trace_writer writes
    # them (a tag line before each alloc whose tag differs from the previous
    # alloc's; the trace starts under the default tag).
    lines = []
    alloc_tag = DEFAULT_TAG
    for t, a, addr, size, stream, tag, keep in head + events:
        if a == "alloc" and tag != alloc_tag:
            lines.append(f"{t} tag 0 0 0 {tag}")
            alloc_tag = tag
        if a == "pause":
            lines.append(f"{t} pause 0 {size} 0 {tag} {keep}")
        elif a == "resume":
            lines.append(f"{t} resume 0 {size} 0 {tag}")
        else:
            lines.append(f"{t} {a} {addr} {size} {stream}")
    return lines, notes


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="snapshot_to_trace.py",
        description="Convert a PyTorch memory snapshot pickle (torch.cuda.memory._dump_snapshot) into "
                    "ccalloc's trace format (docs/trace-format.md).")
    parser.add_argument("snapshot", help="the .pickle file (gzip allowed)")
    parser.add_argument("-o", "--output", help="trace file to write (default: standard output)")
    parser.add_argument("--device", type=int, help="device whose trace to convert (default: the one with the most entries)")
    args = parser.parse_args(argv)
    if args.output and os.path.exists(args.output) and os.path.samefile(args.output, args.snapshot):
        print(f"snapshot_to_trace: the output {args.output} is the snapshot {args.snapshot} (the same file), "
              f"which it would overwrite; write the trace to another file", file=sys.stderr)
        return 2
    try:
        lines, notes = convert(load_snapshot(args.snapshot), args.device)
    except ConvertError as e:
        print(f"snapshot_to_trace: {args.snapshot}: {e}", file=sys.stderr)
        return 1
    text = "".join(f"# {n}\n" for n in [f"converted from {args.snapshot} by tools/snapshot_to_trace.py"] + notes)
    tagged = any(line.split(" ", 2)[1] in ("tag", "pause", "resume") for line in lines)
    text += f"# time_us action addr size stream{' [tag [keep|drop]]' if tagged else ''}\n" + "\n".join(lines) + ("\n" if lines else "")
    if not args.output:
        sys.stdout.write(text)
        return 0
    try:
        write_whole(args.output, text)
    except OSError as e:
        print(f"snapshot_to_trace: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def write_whole(path, text):
    """Writes `text` to `path` whole or not at all: a regular file (or none
    yet) is replaced by a temporary file of its folder, renamed over it once
    complete (a failed write, e.g. a full disk, leaves the old file); the
    new file keeps the old one's permission bits. A link is followed; a
    FIFO or a device is written in place."""
    target = os.path.realpath(path)
    old = os.stat(target) if os.path.exists(target) else None
    if old is not None and not stat.S_ISREG(old.st_mode):
        with open(path, "w") as f:
            f.write(text)
        return
    if old is not None and not os.access(target, os.W_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
    fd, temporary = tempfile.mkstemp(prefix=os.path.basename(target) + ".", suffix=".tmp",
                                     dir=os.path.dirname(target) or ".")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), stat.S_IMODE(old.st_mode) if old is not None else 0o666 & ~_umask())
            f.write(text)
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


if __name__ == "__main__":
    sys.exit(main())

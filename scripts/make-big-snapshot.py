#!/usr/bin/env python3
"""Writes a large PyTorch-style memory snapshot pickle, for timing ccalloc's reader.

    python3 scripts/make-big-snapshot.py OUT.pickle [--entries 1500000] [--frames 12] [--sites 2000]

The file is what ``pickle.dump`` of ``torch.cuda.memory._snapshot()`` would
write (protocol 4) for a program whose trace has ENTRIES entries (allocs,
then a free_requested and a free_completed for each, up to 4,000 blocks live)
with FRAMES frames each, where every frame is a distinct dict and every
filename and name a distinct string object (so the pickle holds each in full
and memoizes each, as pickle does for objects that are not shared). Frame
contents repeat: each alloc draws one of SITES stacks. 1.5 million entries of
12 frames make about 1 GB.

The opcodes are written directly (the same bytes pickle.dump writes for such
objects), so the script needs little memory; ``--check`` also unpickles the
result with Python's pickle and compares it with the same snapshot built as
objects (use it at small sizes).
"""

import argparse
import io
import pickle
import random
import struct
import sys


class Writer:
    """Protocol-4 opcodes, with the memo numbering pickle.Pickler uses."""

    def __init__(self, out):
        self.out = out
        self.memo = 0
        self.keys = {}  # interned key string -> memo index

    def memoize(self):
        self.out.write(b"\x94")
        self.memo += 1
        return self.memo - 1

    def text(self, s):
        b = s.encode()
        self.out.write((b"\x8c" + bytes([len(b)])) if len(b) < 256 else (b"X" + struct.pack("<I", len(b))))
        self.out.write(b)
        self.memoize()

    def key(self, s):
        i = self.keys.get(s)
        if i is None:
            self.text(s)
            self.keys[s] = self.memo - 1
        elif i < 256:
            self.out.write(b"h" + bytes([i]))
        else:
            self.out.write(b"j" + struct.pack("<I", i))

    def integer(self, v):
        if 0 <= v < 256:
            self.out.write(b"K" + bytes([v]))
        elif 0 <= v < 65536:
            self.out.write(b"M" + struct.pack("<H", v))
        elif -2**31 <= v < 2**31:
            self.out.write(b"J" + struct.pack("<i", v))
        else:
            n = (v.bit_length() + 8) // 8
            self.out.write(b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True))


def make_sites(count, frames, rng):
    files = [f"site-packages/torch/nn/modules/m{i}.py" for i in range(40)] + \
            [f"train/model_{i}.py" for i in range(20)]
    names = ["forward", "_call_impl", "_wrapped_call_impl", "backward", "step", "matmul", "linear", "conv2d",
             "batch_norm", "layer_norm", "softmax", "dropout", "train_step", "main", "<module>"]
    return [[(rng.choice(files), rng.randrange(1, 3000), rng.choice(names)) for _ in range(frames)]
            for _ in range(count)]


def entries(n, sites, rng):
    """(action, addr, size, stream, time_us, site) for n entries."""
    live = []
    addr = 0x7F0000000000
    t = 1_700_000_000_000_000
    out = 0
    while out < n:
        t += rng.randrange(1, 20)
        if live and (len(live) >= 4000 or rng.random() < 0.45) and out + 2 <= n:
            a, size, site = live.pop(rng.randrange(len(live)))
            yield ("free_requested", a, size, 0, t, site)
            yield ("free_completed", a, size, 0, t + 1, site)
            out += 2
        else:
            size = 512 * rng.randrange(1, 4096)
            site = rng.randrange(len(sites))
            live.append((addr, size, site))
            yield ("alloc", addr, size, 0, t, site)
            addr += size + 512
            out += 1


def write(path, n, frames, site_count, seed=1):
    rng = random.Random(seed)
    sites = make_sites(site_count, frames, rng)
    with open(path, "wb") as f:
        out = io.BufferedWriter(f, 1 << 22)
        w = Writer(out)
        out.write(b"\x80\x04")
        out.write(b"}")  # the snapshot dict
        w.memoize()
        out.write(b"(")
        w.key("segments")
        out.write(b"]")
        w.memoize()
        w.key("device_traces")
        out.write(b"]")  # device_traces
        w.memoize()
        out.write(b"]")  # device 0's entries
        w.memoize()
        batch = 0
        out.write(b"(")
        for action, addr, size, stream, t, site in entries(n, sites, rng):
            out.write(b"}")
            w.memoize()
            out.write(b"(")
            w.key("action")
            w.text(action)
            w.key("addr")
            w.integer(addr)
            w.key("size")
            w.integer(size)
            w.key("stream")
            w.integer(stream)
            w.key("time_us")
            w.integer(t)
            w.key("frames")
            out.write(b"]")
            w.memoize()
            out.write(b"(")
            for filename, line, name in sites[site]:
                out.write(b"}")
                w.memoize()
                out.write(b"(")
                w.key("filename")
                w.text(filename)
                w.key("line")
                w.integer(line)
                w.key("name")
                w.text(name)
                out.write(b"u")
            out.write(b"e")  # the frames list's APPENDS
            out.write(b"u")  # the entry's SETITEMS
            batch += 1
            if batch == 1000:  # pickle appends in batches of 1000
                out.write(b"e(")
                batch = 0
        out.write(b"e")
        out.write(b"a")  # device 0's list into device_traces
        out.write(b"u.")
        out.flush()
    return sites


def as_objects(n, frames, site_count, seed=1):
    rng = random.Random(seed)
    sites = make_sites(site_count, frames, rng)
    trace = [{"action": a, "addr": addr, "size": size, "stream": s, "time_us": t,
              "frames": [{"filename": f, "line": ln, "name": nm} for f, ln, nm in sites[site]]}
             for a, addr, size, s, t, site in entries(n, sites, rng)]
    return {"segments": [], "device_traces": [trace]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output")
    p.add_argument("--entries", type=int, default=1_500_000)
    p.add_argument("--frames", type=int, default=12)
    p.add_argument("--sites", type=int, default=2000)
    p.add_argument("--check", action="store_true", help="unpickle the result and compare (small sizes)")
    a = p.parse_args()
    write(a.output, a.entries, a.frames, a.sites)
    if a.check:
        with open(a.output, "rb") as f:
            got = pickle.load(f)
        if got != as_objects(a.entries, a.frames, a.sites):
            print("make-big-snapshot: the pickle does not unpickle to the snapshot", file=sys.stderr)
            return 1
        print("make-big-snapshot: checked with pickle.load")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Snapshots in PyTorch's layout (SPEC E4) and the snapshot converters.

- python/ccalloc/snapshot.py: ccalloc's JSON snapshot (written by
  `ccalloc replay --snapshot`) becomes a pickle with the same keys, nesting
  and value types as a real PyTorch 2.11 snapshot (tests/data/); malformed
  JSON fails naming where.
- tools/snapshot_to_trace.py: real and malformed pickles.
- When torch is installed: torch.cuda._memory_viz reads our pickle.

Run: CCALLOC_BIN=build/ccalloc python3 -m unittest discover -s tests/python
"""

import gzip
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python", "ccalloc"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import snapshot  # noqa: E402  (python/ccalloc/snapshot.py, imported without the package)
import snapshot_to_trace  # noqa: E402

TORCH_SNAPSHOT = os.path.join(ROOT, "tests", "data", "torch_snapshot_resnet18.pickle.gz")
BIN = os.environ.get("CCALLOC_BIN", os.path.join(ROOT, "build", "ccalloc"))


def load_torch_snapshot():
    with gzip.open(TORCH_SNAPSHOT, "rb") as f:
        return pickle.load(f)


def shape(value):
    """The keys and value types of a snapshot, recursively (lists by their first item)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, tuple):
        return ("tuple", tuple(type(v).__name__ for v in value))
    return type(value).__name__


class CcallocSnapshotAsPyTorchPickle(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.access(BIN, os.X_OK):
            raise unittest.SkipTest(f"no ccalloc binary at {BIN} (set CCALLOC_BIN)")
        cls.tmp = tempfile.TemporaryDirectory()
        cls.json_path = os.path.join(cls.tmp.name, "snap.json")
        # The bundled PyTorch snapshot, replayed by ccalloc with history on.
        subprocess.run([BIN, "replay", TORCH_SNAPSHOT, "--snapshot", cls.json_path], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cls.pickle_path = os.path.join(cls.tmp.name, "snap.pickle")
        out = subprocess.run([sys.executable, os.path.join(ROOT, "python", "ccalloc", "snapshot.py"),
                              cls.json_path, "-o", cls.pickle_path], check=True, capture_output=True, text=True)
        cls.cli_output = out.stdout
        with open(cls.pickle_path, "rb") as f:
            cls.ours = pickle.load(f)
        cls.torch = load_torch_snapshot()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_top_level_keys_match_pytorch(self):
        self.assertEqual(list(self.ours), list(self.torch))
        self.assertEqual(list(self.ours), ["segments", "device_traces", "allocator_settings", "external_annotations"])
        self.assertIn("wrote", self.cli_output)

    def test_segment_and_block_layout_match_pytorch(self):
        self.assertTrue(self.ours["segments"], "the replay ends with live blocks in segments")
        ours, theirs = shape(self.ours["segments"][0]), shape(self.torch["segments"][0])
        self.assertEqual(set(ours), set(theirs))
        for key in theirs:
            if key not in ("blocks", "frames"):
                self.assertEqual(ours[key], theirs[key], key)
        self.assertEqual(ours["segment_pool_id"], ("tuple", ("int", "int")))
        self.assertEqual(set(ours["blocks"][0]), set(theirs["blocks"][0]))
        for key in ("address", "size", "requested_size", "state"):
            self.assertEqual(ours["blocks"][0][key], theirs["blocks"][0][key], key)

    def test_every_segment_is_tiled_by_its_blocks(self):
        for seg in self.ours["segments"]:
            addr = seg["address"]
            for b in seg["blocks"]:
                self.assertEqual(b["address"], addr)
                self.assertIn(b["state"], ("active_allocated", "active_pending_free", "inactive"))
                addr += b["size"]
            self.assertEqual(addr - seg["address"], seg["total_size"])
            self.assertEqual(sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"),
                             seg["allocated_size"])

    def test_trace_entries_match_pytorch(self):
        trace = self.ours["device_traces"][0]
        self.assertEqual(len(self.ours["device_traces"]), 1)
        theirs = shape(self.torch["device_traces"][0][0])
        for e in trace[:50] + trace[-50:]:
            s = shape(e)
            self.assertEqual(set(s), set(theirs), e)
            for key in ("action", "addr", "size", "stream", "time_us", "compile_context", "user_metadata"):
                self.assertEqual(s[key], theirs[key], key)
        actions = {e["action"] for e in trace}
        self.assertTrue({"alloc", "free_requested", "free_completed"} <= actions, actions)
        # Plain segments are segment_alloc'd, expandable ones (the default) segment_map'ped.
        self.assertTrue({"segment_alloc", "segment_map"} & actions, actions)
        # The replay reproduces the recorded program: as many allocs as the recording (657).
        self.assertEqual(sum(e["action"] == "alloc" for e in trace), 657)
        self.assertEqual(trace[-1]["action"], "snapshot")
        times = [e["time_us"] for e in trace]
        self.assertEqual(times, sorted(times))

    def test_settings_have_pytorchs_keys_and_types(self):
        theirs = self.torch["allocator_settings"]
        for key, value in theirs.items():
            self.assertIn(key, self.ours["allocator_settings"])
            self.assertEqual(type(self.ours["allocator_settings"][key]), type(value), key)
        self.assertEqual(self.ours["allocator_settings"]["roundup_power2_divisions"].keys(),
                         theirs["roundup_power2_divisions"].keys())

    def test_pytorch_viewers_read_it(self):
        try:
            from torch.cuda import _memory_viz  # noqa: F401
        except Exception:  # torch absent here; scripts/gpu.sh snapshots runs this on the GPU machine
            self.skipTest("torch is not installed")
        from torch.cuda import _memory_viz
        self.assertIn("<html", _memory_viz.trace_plot(self.ours).lower())
        self.assertIn("<html", _memory_viz.segment_plot(self.ours).lower())
        self.assertIn("total_reserved", _memory_viz.segsum(self.ours))


class SnapshotJsonErrors(unittest.TestCase):
    def minimal(self):
        return {"segments": [{"device": 0, "address": 4096, "total_size": 1024, "allocated_size": 512,
                              "active_size": 512, "requested_size": 500, "stream": 0, "segment_type": "small",
                              "segment_pool_id": [0, 0], "is_expandable": False, "frames": [],
                              "blocks": [{"address": 4096, "size": 512, "requested_size": 500,
                                          "state": "active_allocated",
                                          "frames": [{"name": "f", "filename": "a.py", "line": 3}]},
                                         {"address": 4608, "size": 512, "requested_size": 0, "state": "inactive",
                                          "frames": []}]}],
                "device_traces": [[{"action": "oom", "device_free": 7, "size": 9, "stream": 0, "time_us": 1,
                                    "frames": [], "compile_context": "N/A", "user_metadata": ""}]],
                "allocator_settings": {}, "external_annotations": [{"device": 0, "time_us": 2, "stage": "START"}]}

    def test_minimal_snapshot_converts(self):
        s = snapshot.from_json(json.dumps(self.minimal()))
        self.assertEqual(s["segments"][0]["segment_pool_id"], (0, 0))
        self.assertEqual(s["device_traces"][0][0]["device_free"], 7)
        buf = io.BytesIO()
        snapshot.write_pickle(s, buf)
        self.assertEqual(pickle.loads(buf.getvalue()), s)

    def test_errors_name_the_place(self):
        cases = []
        d = self.minimal(); del d["segments"][0]["blocks"][1]["state"]
        cases.append((d, "segments[0].blocks[1]: missing key 'state'"))
        d = self.minimal(); d["segments"][0]["blocks"][1]["address"] = 5000
        cases.append((d, "segments[0].blocks[1].address: 5000 but the blocks before end at 4608"))
        d = self.minimal(); d["segments"][0]["blocks"][0]["state"] = "allocated"
        cases.append((d, "segments[0].blocks[0].state: 'allocated' is not one of"))
        d = self.minimal(); d["segments"][0]["total_size"] = 2048
        cases.append((d, "segments[0]: blocks sum to 1024 bytes, total_size is 2048"))
        d = self.minimal(); d["device_traces"][0][0]["size"] = "9"
        cases.append((d, "device_traces[0][0].size: expected int"))
        d = self.minimal(); d["segments"][0]["segment_pool_id"] = [0]
        cases.append((d, "segments[0].segment_pool_id: expected two integers"))
        d = self.minimal(); d["segments"][0]["blocks"][0]["frames"][0]["line"] = "3"
        cases.append((d, "segments[0].blocks[0].frames[0].line: expected int"))
        for data, message in cases:
            with self.assertRaises(snapshot.SnapshotError) as ctx:
                snapshot.from_json(data)
            self.assertTrue(str(ctx.exception).startswith(message), (str(ctx.exception), message))
        with self.assertRaisesRegex(snapshot.SnapshotError, "^not JSON"):
            snapshot.from_json("{nope")

    def test_cli_reports_errors_with_file_name(self):
        with tempfile.TemporaryDirectory() as tmp:
            bad = os.path.join(tmp, "bad.json")
            with open(bad, "w") as f:
                f.write('{"segments": []}')
            out = subprocess.run([sys.executable, os.path.join(ROOT, "python", "ccalloc", "snapshot.py"), bad,
                                  "-o", os.path.join(tmp, "x.pickle")], capture_output=True, text=True)
            self.assertEqual(out.returncode, 1)
            self.assertIn(f"snapshot.py: {bad}: snapshot: missing key 'device_traces'", out.stderr)


    def test_cli_names_the_output_it_cannot_write(self):
        import resource
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "s.json")
            with open(src, "w") as f:
                f.write(json.dumps(self.minimal()))
            cli = [sys.executable, os.path.join(ROOT, "python", "ccalloc", "snapshot.py"), src, "-o"]
            missing = os.path.join(tmp, "no_such_folder", "out.pickle")
            out = subprocess.run(cli + [missing], capture_output=True, text=True)
            self.assertEqual(out.returncode, 1)
            self.assertEqual(out.stderr, f"snapshot.py: cannot write {missing}: No such file or directory\n")
            # A file size limit (ulimit -f): the write fails part way; no file is left.
            small = os.path.join(tmp, "out.pickle")
            out = subprocess.run(cli + [small], capture_output=True, text=True,
                                 preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1)))
            self.assertEqual(out.returncode, 1)
            self.assertEqual(out.stderr, f"snapshot.py: cannot write {small}: File too large\n")
            self.assertEqual(os.listdir(tmp), ["s.json"])

    def test_cli_refuses_to_write_over_its_input(self):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "s.json")
            with open(src, "w") as f:
                f.write('{"segments": [], "device_traces": []}')
            for output in (src, os.path.join(tmp, ".", "s.json")):
                out = subprocess.run([sys.executable, os.path.join(ROOT, "python", "ccalloc", "snapshot.py"), src,
                                      "-o", output], capture_output=True, text=True)
                self.assertEqual(out.returncode, 2, out.stderr)
                self.assertIn(f"snapshot.py: the output {output} is the snapshot {src} (the same file)", out.stderr)
            with open(src) as f:
                self.assertEqual(f.read(), '{"segments": [], "device_traces": []}')


class SnapshotToTrace(unittest.TestCase):
    def test_cli_refuses_to_write_over_its_input(self):
        data = pickle.dumps({"device_traces": [[]], "segments": []})
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.pickle")
            with open(path, "wb") as f:
                f.write(data)
            os.symlink(path, os.path.join(tmp, "link.pickle"))
            for output in (path, os.path.join(tmp, "link.pickle")):
                out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "snapshot_to_trace.py"), path,
                                      "-o", output], capture_output=True, text=True)
                self.assertEqual(out.returncode, 2, out.stderr)
                self.assertIn(f"snapshot_to_trace: the output {output} is the snapshot {path} (the same file)",
                              out.stderr)
            with open(path, "rb") as f:
                self.assertEqual(f.read(), data)

    def test_a_failed_write_keeps_the_old_output(self):
        # A write cut off by the file size limit (a full disk alike) leaves
        # the old file whole and no temporary file; a missing folder is a
        # message, not a traceback.
        import resource
        import signal

        entries = [{"action": "alloc", "addr": (i + 1) << 20, "size": 512, "stream": 0, "time_us": i}
                   for i in range(20000)]
        data = pickle.dumps({"device_traces": [entries], "segments": []})

        def limit_file_size():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.pickle")
            with open(path, "wb") as f:
                f.write(data)
            keep = os.path.join(tmp, "keep.trace")
            with open(keep, "w") as f:
                f.write("precious\n" * 1000)
            os.chmod(keep, 0o640)
            tool = os.path.join(ROOT, "tools", "snapshot_to_trace.py")
            out = subprocess.run([sys.executable, tool, path, "-o", keep], capture_output=True, text=True,
                                 preexec_fn=limit_file_size)
            self.assertEqual(out.returncode, 1, out.stderr)
            self.assertIn(f"snapshot_to_trace: cannot write {keep}: File too large", out.stderr)
            self.assertNotIn("Traceback", out.stderr)
            with open(keep) as f:
                self.assertEqual(f.read(), "precious\n" * 1000)
            self.assertEqual(sorted(os.listdir(tmp)), ["keep.trace", "s.pickle"])
            out = subprocess.run([sys.executable, tool, path, "-o", keep], capture_output=True, text=True)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(os.stat(keep).st_mode & 0o777, 0o640)
            with open(keep) as f:
                self.assertEqual(sum(1 for line in f if " alloc " in line), 20000)
            missing = os.path.join(tmp, "no", "x.trace")
            out = subprocess.run([sys.executable, tool, path, "-o", missing], capture_output=True, text=True)
            self.assertEqual(out.returncode, 1, out.stderr)
            self.assertIn(f"snapshot_to_trace: cannot write {missing}: No such file or directory", out.stderr)
            self.assertNotIn("Traceback", out.stderr)

    def test_real_snapshot(self):
        lines, notes = snapshot_to_trace.convert(load_torch_snapshot())
        self.assertEqual(len(lines), 1791)
        self.assertEqual(lines[0].split()[1], "segment_alloc")
        # Nothing was added: the notes say only what is there.
        self.assertFalse(any("events added" in n or "missing frees" in n for n in notes), notes)

    def test_trace_started_late_gets_its_earlier_blocks(self):
        s = load_torch_snapshot()
        full = snapshot_to_trace.convert(s)[0]
        s["device_traces"][0] = s["device_traces"][0][700:]
        lines, notes = snapshot_to_trace.convert(s)
        head = [l.split() for l in lines[: len(lines) - 1091]]
        self.assertTrue(all(h[1] in ("alloc", "segment_alloc") for h in head), head[:3])
        # Replaying: every free has an alloc before it, and no address is allocated twice while live.
        live = set()
        for line in lines:
            _, action, addr, _, _ = line.split()
            if action == "alloc":
                self.assertNotIn(addr, live)
                live.add(addr)
            elif action == "free_requested":
                self.assertIn(addr, live)
                live.discard(addr)
        self.assertRegex(notes[1], r"^\d+ alloc and \d+ segment events added at the start")
        self.assertLess(len(lines), len(full) + 400)

    # A snapshot ccalloc wrote: a tag on each entry, pause and resume entries
    # (a pause's addr: the bytes kept in host memory).
    MiB = 1 << 20
    TAGGED = {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 1 << 30, "size": 8 * MiB, "stream": 0, "time_us": 1, "tag": "weights"},
        {"action": "alloc", "addr": 2 << 30, "size": 4 * MiB, "stream": 0, "time_us": 2, "tag": "kv_cache"},
        {"action": "alloc", "addr": 3 << 30, "size": 1 * MiB, "stream": 0, "time_us": 3, "tag": "default"},
        {"action": "pause", "addr": 8 * MiB, "size": 8 * MiB, "stream": 0, "time_us": 4, "tag": "weights"},
        {"action": "pause", "addr": 0, "size": 4 * MiB, "stream": 0, "time_us": 5, "tag": "kv_cache"},
        {"action": "resume", "addr": 0, "size": 8 * MiB, "stream": 0, "time_us": 6, "tag": "weights"},
        {"action": "resume", "addr": 0, "size": 0, "stream": 0, "time_us": 7, "tag": "earlier"},
        {"action": "free_requested", "addr": 3 << 30, "size": 1 * MiB, "stream": 0, "time_us": 8},
        {"action": "free_completed", "addr": 3 << 30, "size": 1 * MiB, "stream": 0, "time_us": 8}]]}

    def test_tags_pauses_and_resumes_become_trace_lines(self):
        lines, notes = snapshot_to_trace.convert(self.TAGGED)
        MiB = self.MiB
        self.assertEqual(lines, [
            "1 tag 0 0 0 weights", f"1 alloc {1 << 30} {8 * MiB} 0",
            "2 tag 0 0 0 kv_cache", f"2 alloc {2 << 30} {4 * MiB} 0",
            "3 tag 0 0 0 default", f"3 alloc {3 << 30} {MiB} 0",
            f"4 pause 0 {8 * MiB} 0 weights keep", f"5 pause 0 {4 * MiB} 0 kv_cache drop",
            f"6 resume 0 {8 * MiB} 0 weights",
            f"8 free_requested {3 << 30} {MiB} 0", f"8 free_completed {3 << 30} {MiB} 0"])
        self.assertIn("1 resume entry of tags paused before the trace began dropped", notes)
        self.assertFalse(any("dropped actions" in n for n in notes), notes)
        bad = {"segments": [], "device_traces": [[dict(self.TAGGED["device_traces"][0][0], tag="no spaces")]]}
        with self.assertRaisesRegex(snapshot_to_trace.ConvertError,
                                    r"^device_traces\[0\]\[0\]\.tag: bad tag 'no spaces': a tag name is 1 to 64"):
            snapshot_to_trace.convert(bad)

    @unittest.skipUnless(os.path.exists(BIN), "ccalloc not built (set CCALLOC_BIN)")
    def test_the_text_trace_sleeps_and_wakes_as_the_pickle_does(self):
        with tempfile.TemporaryDirectory() as tmp:
            snap, text = os.path.join(tmp, "s.pickle"), os.path.join(tmp, "s.trace")
            with open(snap, "wb") as f:
                pickle.dump(self.TAGGED, f)
            subprocess.run([sys.executable, os.path.join(ROOT, "tools", "snapshot_to_trace.py"), snap, "-o", text],
                           check=True)
            sleep = []
            for path in (snap, text):
                out = subprocess.run([BIN, "replay", path, "--json"], capture_output=True, text=True)
                self.assertEqual(out.returncode, 0, out.stderr)
                sleep.append(json.loads(out.stdout)["sleep"])
        self.assertEqual(sleep[0]["pauses"], 2)
        self.assertEqual(sleep[0]["resumes"], 1)
        for s in sleep:  # lines differ: the text has header comments and tag lines
            for e in s["events"]:
                del e["line"]
        self.assertEqual(sleep[1], sleep[0])

    def test_missing_free_requested_is_added(self):
        s = {"segments": [], "device_traces": [[
            {"action": "alloc", "addr": 10, "size": 5, "stream": 0, "time_us": 3},
            {"action": "free_completed", "addr": 10, "size": 5, "stream": 0, "time_us": 2},  # clock stepped back
            {"action": "user_defined", "addr": 0, "size": 0, "stream": 0, "time_us": 4}]]}
        lines, notes = snapshot_to_trace.convert(s)
        self.assertEqual(lines, ["3 alloc 10 5 0", "3 free_requested 10 5 0", "3 free_completed 10 5 0"])
        self.assertIn("1 missing frees added", notes)
        self.assertIn("dropped actions ccalloc's trace format has not: user_defined x1", notes)
        self.assertIn("time_us steps back at 1 entry (device_traces[0][1]: 2 after 3; at most 1 us): each takes "
                      "the time of the entry before it", notes)

    def test_alloc_at_a_live_address_is_refused_and_a_missing_free_completed_added(self):
        entry = {"stream": 7}
        s = {"segments": [], "device_traces": [[
            {**entry, "action": "alloc", "addr": 4096, "size": 512, "time_us": 10},
            {**entry, "action": "alloc", "addr": 4096, "size": 1024, "time_us": 11}]]}
        with self.assertRaises(snapshot_to_trace.ConvertError) as e:
            snapshot_to_trace.convert(s)
        self.assertEqual(str(e.exception), "device_traces[0][1]: alloc at address 4096 (1024 bytes), which is still "
                                           "live (allocated at device_traces[0][0] with 512 bytes; no free_requested "
                                           "between)")
        s["device_traces"][0][1:1] = [{**entry, "action": "free_requested", "addr": 4096, "size": 512, "time_us": 10}]
        lines, notes = snapshot_to_trace.convert(s)
        self.assertEqual(lines, ["10 alloc 4096 512 7", "10 free_requested 4096 512 7", "11 free_completed 4096 512 7",
                                 "11 alloc 4096 1024 7"])
        self.assertIn("1 free_completed added before an alloc at an address freed without one (the first: "
                      "device_traces[0][2] at address 4096)", notes)

    def test_time_going_back_more_than_a_second_is_refused_naming_the_entry(self):
        entry = {"action": "alloc", "size": 5, "stream": 0}
        s = {"segments": [], "device_traces": [[
            {**entry, "addr": 10, "time_us": 3_000_000}, {**entry, "addr": 20, "time_us": 2_500_000},
            {**entry, "addr": 30, "time_us": 1_999_999}]]}
        with self.assertRaises(snapshot_to_trace.ConvertError) as e:
            snapshot_to_trace.convert(s)
        self.assertEqual(str(e.exception), "device_traces[0][2].time_us: goes backwards by 1000001 us (1999999 after "
                                           "3000000), more than the 1000000 us a clock may step back: the entries "
                                           "are out of order")
        s["device_traces"][0][2]["time_us"] = 2_000_000  # a second back: a note
        lines, notes = snapshot_to_trace.convert(s)
        self.assertEqual([l.split()[0] for l in lines], ["3000000"] * 3)
        self.assertIn("time_us steps back at 2 entries (the first device_traces[0][1]: 2500000 after 3000000; at "
                      "most 1000000 us): each takes the time of the entry before it", notes)

    def run_cli(self, data, *args):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "in.pickle")
            with open(path, "wb") as f:
                f.write(data)
            out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "snapshot_to_trace.py"), path, *args],
                                 capture_output=True, text=True)
            return out, path

    def test_malformed_inputs(self):
        out, path = self.run_cli(b"# time_us action addr size stream\n")
        self.assertEqual(out.returncode, 1)
        self.assertIn(f"snapshot_to_trace: {path}: not a pickle", out.stderr)
        out, path = self.run_cli(b"\x80\x09\x95junk")
        self.assertEqual(out.returncode, 1)
        self.assertIn(f"snapshot_to_trace: {path}: a pickle of protocol 9 (its first bytes are 0x80 0x09); "
                      "PyTorch snapshot pickles are protocols 2 to 5", out.stderr)
        self.assertEqual(out.stderr.count("\n"), 1, out.stderr)
        out, path = self.run_cli(b"\x1f\x8b\x08\x00garbage")
        self.assertIn("corrupt gzip data", out.stderr)
        out, path = self.run_cli(pickle.dumps({"segments": []}))
        self.assertIn("not a PyTorch memory snapshot (no 'device_traces'", out.stderr)
        out, path = self.run_cli(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": -1}]]}))
        self.assertIn("device_traces[0][0]: missing 'time_us'", out.stderr)
        out, path = self.run_cli(pickle.dumps(io.BytesIO))
        self.assertIn("not a plain-data snapshot: it refers to _io.BytesIO", out.stderr)
        out, path = self.run_cli(pickle.dumps({"device_traces": [[]]}), "--device", "3")
        self.assertIn("--device 3: the snapshot has 1 device trace(s)", out.stderr)

    def test_memo_references_are_walked_once(self):
        # One segment referenced 3,000 times whose blocks list references one
        # block 3,000 times: 9 million blocks if walked per reference.
        block = {"size": 512, "state": "active_allocated"}
        segment = {"device": 0, "address": 1 << 20, "total_size": 3000 * 512, "blocks": [block] * 3000}
        data = pickle.dumps({"device_traces": [[]], "segments": [segment] * 3000})
        self.assertLess(len(data), 20000)
        import time
        start = time.perf_counter()
        lines, notes = snapshot_to_trace.convert(pickle.loads(data))
        self.assertLess(time.perf_counter() - start, 1.0)
        self.assertEqual(len(lines), 3001)
        self.assertEqual(notes[1], "3000 alloc and 1 segment events added at the start (allocated before the trace)")

    MALFORMED = [
        ({1: 2, "a": 3}, "not a PyTorch memory snapshot (no 'device_traces'"),
        ({"device_traces": [5]}, "device_traces[0]: expected a list, got int"),
        ({"device_traces": [[]], "segments": [{"address": 4096}]}, "segments[0]: missing 'total_size'"),
        ({"device_traces": [[]], "segments": 7}, "segments: expected a list, got int"),
        ({"device_traces": [[]], "segments": [{"address": 0, "total_size": 8, "blocks": [{"size": 4}, "x"]}]},
         "segments[0].blocks[1]: expected a dict, got str"),
    ]

    def test_malformed_snapshots_give_one_line(self):
        for snap, want in self.MALFORMED:
            out, path = self.run_cli(pickle.dumps(snap))
            self.assertEqual(out.returncode, 1, out.stderr)
            self.assertEqual(out.stderr.count("\n"), 1, out.stderr)
            self.assertIn(f"snapshot_to_trace: {path}: {want}", out.stderr)

    @unittest.skipUnless(os.path.exists(BIN), "ccalloc not built (set CCALLOC_BIN)")
    def test_ccalloc_names_what_is_wrong_in_one_line(self):
        cpp = ["not a PyTorch memory snapshot (no 'device_traces'; found keys an int, 'a')",
               "device_traces[0]: expected a list, got an int", "segments[0]: missing 'total_size'",
               "segments: expected a list, got an int", "segments[0].blocks[1]: expected a dict, got a str"]
        for (snap, _), want in zip(self.MALFORMED, cpp):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "bad.pickle")
                with open(path, "wb") as f:
                    f.write(pickle.dumps(snap))
                out = subprocess.run([BIN, "replay", path], capture_output=True, text=True)
            self.assertEqual(out.returncode, 1, out.stderr)
            self.assertEqual(out.stderr, f"ccalloc: {path}: a PyTorch snapshot that cannot be read: {want}\n")


if __name__ == "__main__":
    unittest.main()

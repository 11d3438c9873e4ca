// snapshot_pickle_test.cpp: the PyTorch snapshot pickle reader
// (convert_pytorch_snapshot, src/replay/pickle_reader.cpp and
// snapshot_reader.cpp): memo references converted once, time linear in the
// pickle's size, malformed and over-limit pickles named in one line, sites
// from frames, the report's allocation-sites table, the device converted
// (--snapshot-device), and the tags, pauses and resumes of ccalloc's own
// snapshots.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/snapshot.hpp>
#include <ccalloc/core/tags.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/report.hpp>
#include <ccalloc/replay/trace.hpp>

#include "peak_rss.hpp"
#include "pickle_writer.hpp"
#include "temp_file.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <ctime>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace {

using ccalloc::trace_action;
using ccalloc::trace_error;
using ccalloc::testing::pickle_writer;
using ccalloc::testing::temp_file;

const std::string snapshot_path = std::string(CCALLOC_SOURCE_DIR) + "/tests/data/torch_snapshot_resnet18.pickle.gz";

/// The message of the trace_error that reading `bytes` throws, or "" if none.
std::string error_of(const std::string& bytes, const ccalloc::trace_read_options& o = {}) {
  try {
    (void)ccalloc::convert_pytorch_snapshot_data(bytes, "snap", o);
  } catch (const trace_error& e) {
    EXPECT_EQ(e.file, "snap");
    EXPECT_EQ(e.line, 0u);
    return e.what();
  }
  return "";
}

/// {"device_traces": [[ entries ]], "segments": []}: `entries` entries
/// (alloc, free_requested, free_completed in turn) of `frames` frames each,
/// every frame a distinct dict with distinct strings (drawn from 50 stacks).
std::string snapshot_with_frames(std::size_t entries, std::size_t frames) {
  pickle_writer p;
  p.dict().key("segments").list().end_list().key("device_traces").list().list();
  const char* actions[] = {"alloc", "free_requested", "free_completed"};
  for (std::size_t i = 0; i < entries; ++i) {
    const std::size_t block = i / 3;
    p.dict()
        .field("action", actions[i % 3])
        .field("addr", static_cast<std::int64_t>(0x7f0000000000 + 4096 * (block % 1000)))
        .field("size", static_cast<std::int64_t>(512 * (1 + block % 50)))
        .field("stream", 0)
        .field("time_us", static_cast<std::int64_t>(1700000000000000 + i));
    p.key("frames").list();
    for (std::size_t f = 0; f < frames; ++f)
      p.dict()
          .field("filename", "model/layer_" + std::to_string(f) + ".py")
          .field("line", static_cast<std::int64_t>(10 + (block % 50) * 7 + f))
          .field("name", "forward_" + std::to_string(f))
          .end_dict();
    p.end_list().end_dict();
    if (i % 1000 == 999) p.raw("e(");  // pickle appends in batches of 1000
  }
  p.end_list().end_list().end_dict();
  return p.done();
}

/// CPU seconds of this thread (not wall time: the test machine may be busy).
double cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

double seconds_to_convert(const std::string& bytes, int repeats) {
  double best = 1e9;
  for (int r = 0; r < repeats; ++r) {
    const double start = cpu_seconds();
    const ccalloc::trace t = ccalloc::convert_pytorch_snapshot_data(bytes, "snap");
    best = std::min(best, cpu_seconds() - start);
    EXPECT_FALSE(t.events.empty());
  }
  return best;
}

// ---- memo references and linear time ----------------------------------------------

TEST(SnapshotPickle, MemoReferencesAreConvertedOnce) {
  // One segment referenced 20,000 times, whose blocks list references one
  // active block 20,000 times: 400 million blocks if walked per reference.
  constexpr std::size_t refs = 20000;
  pickle_writer p;
  p.dict().key("device_traces").list().list().end_list().end_list();
  p.key("segments").list();
  const std::uint32_t segment = p.next_memo();
  p.dict().field("device", 0).field("address", 1 << 20).field("total_size", std::int64_t{refs} * 512).field("stream", 7);
  p.key("blocks").list();
  const std::uint32_t block = p.next_memo();
  p.dict().field("size", 512).field("requested_size", 500).field("state", "active_allocated").end_dict();
  for (std::size_t i = 1; i < refs; ++i) p.get(block);
  p.end_list().end_dict();
  for (std::size_t i = 1; i < refs; ++i) p.get(segment);
  p.end_list().end_dict();
  const std::string bytes = p.done();
  EXPECT_LT(bytes.size(), 250u * 1000);
  const double start = cpu_seconds();
  const ccalloc::trace t = ccalloc::convert_pytorch_snapshot_data(bytes, "snap");
  EXPECT_LT(cpu_seconds() - start, 2.0) << "linear: about 100,000 opcodes";
  // One segment_alloc and one alloc per block position, at successive addresses.
  ASSERT_EQ(t.events.size(), 1 + refs);
  EXPECT_EQ(t.events[0].action, trace_action::segment_alloc);
  EXPECT_EQ(t.events[0].size, refs * 512);
  EXPECT_EQ(t.events[0].stream, 7u);
  for (std::size_t i = 1; i < t.events.size(); ++i) {
    ASSERT_EQ(t.events[i].action, trace_action::alloc);
    ASSERT_EQ(t.events[i].addr, (1u << 20) + 512 * (i - 1));
    ASSERT_EQ(t.events[i].size, 500u);
    ASSERT_EQ(t.events[i].line, i + 1);
  }
  // The history is empty: the trace is the snapshot's live state only, and a note says so.
  ASSERT_EQ(t.notes.size(), 2u);
  EXPECT_EQ(t.notes[0], "device 0 of the snapshot has no trace entries");
  EXPECT_EQ(t.notes[1], "20000 alloc and 1 segment events added at the start (allocated before the trace)");
}

TEST(SnapshotPickle, DistinctSegmentsSharingOneBlocksListAreRefused) {
  // 1,000 segments at distinct addresses sharing a list of 1,000 blocks: a
  // million blocks from a pickle of a few KB would make the walk quadratic.
  pickle_writer p;
  p.dict().key("device_traces").list().list().end_list().end_list();
  p.key("segments").list();
  std::uint32_t blocks = 0;
  for (int s = 0; s < 1000; ++s) {
    p.dict().field("address", std::int64_t{s} << 30).field("total_size", 1 << 20).key("blocks");
    if (s == 0) {
      blocks = p.next_memo();
      p.list();
      const std::uint32_t block = p.next_memo();
      p.dict().field("size", 1).end_dict();
      for (int b = 1; b < 1000; ++b) p.get(block);
      p.end_list();
    } else {
      p.get(blocks);
    }
    p.end_dict();
  }
  p.end_list().end_dict();
  const std::string e = error_of(p.done());
  EXPECT_NE(e.find(": the segments list more blocks ("), std::string::npos) << e;
  EXPECT_NE(e.find("than the pickle has bytes: segments share blocks lists"), std::string::npos) << e;
}

TEST(SnapshotPickle, ReadingScalesLinearly) {
  // 4x the entries (12 distinct frame objects each) may take at most 8x the
  // CPU time (quadratic would be 16x). Best of 3 against noise.
  const std::string small = snapshot_with_frames(1000, 12), big = snapshot_with_frames(4000, 12);
  EXPECT_GT(big.size(), 4 * small.size() - 4096);
  const double t1 = seconds_to_convert(small, 3), t4 = seconds_to_convert(big, 3);
  EXPECT_LT(t4, 8 * t1 + 0.02) << "1x " << t1 << " s, 4x " << t4 << " s";
  const ccalloc::trace t = ccalloc::convert_pytorch_snapshot_data(big, "snap");
  EXPECT_EQ(t.events.size(), 4000u);
  EXPECT_EQ(t.sites.size(), 50u) << "equal stacks are one site";
  EXPECT_EQ(t.events[0].site, 1u);
  EXPECT_EQ(t.sites[0].substr(0, 32), "forward_0 (model/layer_0.py:10)\n");
  std::map<trace_action, std::size_t> count;
  for (const auto& e : t.events) ++count[e.action];
  EXPECT_EQ(count[trace_action::alloc], 1334u);
  EXPECT_EQ(count[trace_action::free_completed], 1333u);
  const ccalloc::replay_result r = ccalloc::replay_trace(t, {});
  EXPECT_EQ(r.ooms, 0u);
  EXPECT_EQ(r.peak_requested_bytes, 512u * 50) << "one block live at a time, the largest 25,600 B";
}

// ---- malformed input ---------------------------------------------------------------

TEST(SnapshotPickle, MalformedSnapshotsNameWhatIsWrong) {
  const std::string prefix = "snap: a PyTorch snapshot that cannot be read: ";
  const auto traces = [](pickle_writer& p) -> pickle_writer& {
    return p.key("device_traces").list().list().end_list().end_list();
  };
  std::map<std::string, std::string> cases;
  {  // mixed-type keys, no device_traces
    pickle_writer p;
    p.dict().field("a", 1).num(5).num(6).end_dict();
    cases["not a PyTorch memory snapshot (no 'device_traces'; found keys 'a', an int)"] = p.done();
  }
  {
    pickle_writer p;
    p.dict().key("device_traces").list().num(5).end_list().end_dict();
    cases["device_traces[0]: expected a list, got an int"] = p.done();
  }
  {
    pickle_writer p;
    p.dict().key("device_traces").num(5).end_dict();
    cases["device_traces: expected a list, got an int"] = p.done();
  }
  {
    pickle_writer p;
    traces(p.dict()).key("segments").list().dict().field("address", 4096).end_dict().end_list().end_dict();
    cases["segments[0]: missing 'total_size'"] = p.done();
  }
  {
    pickle_writer p;
    traces(p.dict()).field("segments", 7).end_dict();
    cases["segments: expected a list, got an int"] = p.done();
  }
  {
    pickle_writer p;
    traces(p.dict()).key("segments").list().dict().field("address", 4096).field("total_size", 8192);
    p.key("blocks").list().dict().field("size", 4096).end_dict().str("x").end_list().end_dict().end_list().end_dict();
    cases["segments[0].blocks[1]: expected a dict, got a str"] = p.done();
  }
  {
    pickle_writer p;
    traces(p.dict()).key("segments").list().num(3).end_list().end_dict();
    cases["segments[0]: expected a dict, got an int"] = p.done();
  }
  {
    pickle_writer p;
    p.dict().key("device_traces").list().list().dict().field("action", "alloc").field("time_us", 1);
    p.field("size", 8).field("stream", 0).end_dict().end_list().end_list().end_dict();
    cases["device_traces[0][0]: missing 'addr'"] = p.done();
  }
  {
    pickle_writer p;
    p.dict().key("device_traces").list().list().num(1).end_list().end_list().end_dict();
    cases["device_traces[0][0]: expected a dict, got an int"] = p.done();
  }
  {
    pickle_writer p;
    p.dict().key("device_traces").list().list().dict().field("action", "alloc").field("time_us", 1);
    p.field("addr", 8).field("size", -8).field("stream", 0).end_dict().end_list().end_list().end_dict();
    cases["device_traces[0][0].size: expected a non-negative integer, got an int below 0"] = p.done();
  }
  {
    pickle_writer p;
    p.dict().key("device_traces").list().list().dict().field("action", 3).end_dict();
    p.end_list().end_list().end_dict();
    cases["device_traces[0][0].action: expected a string, got an int"] = p.done();
  }
  {
    pickle_writer p;
    p.list().num(1).num(2).end_list();
    cases["not a PyTorch memory snapshot (no 'device_traces'; found a list)"] = p.done();
  }
  for (const auto& [want, bytes] : cases) {
    const std::string e = error_of(bytes);
    EXPECT_EQ(e, prefix + want);
    EXPECT_EQ(e.find('\n'), std::string::npos) << "one line";
  }
}

// PyTorch's clock (the CPU's time-stamp counter) may step back slightly
// from one core to another: such an entry takes the time before it, and a
// note says so (was silent). A step back of more than a second is refused
// naming the entry, as the text trace refuses any (was accepted silently).
TEST(SnapshotPickle, TimeGoingBackwardsIsNotedOrRefusedNamingTheEntry) {
  const auto snapshot = [](const std::vector<std::int64_t>& times) {
    pickle_writer p;
    p.dict().key("segments").list().end_list().key("device_traces").list().list();
    for (std::size_t i = 0; i < times.size(); ++i)
      p.dict()
          .field("action", "alloc")
          .field("addr", static_cast<std::int64_t>(4096 * (i + 1)))
          .field("size", 512)
          .field("stream", 0)
          .field("time_us", times[i])
          .end_dict();
    p.end_list().end_list().end_dict();
    return p.done();
  };
  const ccalloc::trace t = ccalloc::convert_pytorch_snapshot_data(snapshot({3'000'000, 2'500'000, 3'000'010, 2'000'010}),
                                                                  "snap");
  ASSERT_EQ(t.events.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(t.events[i].time_us, i < 2 ? 3'000'000u : 3'000'010u) << i;
  ASSERT_EQ(t.notes.size(), 1u);
  EXPECT_EQ(t.notes[0],
            "time_us steps back at 2 entries (the first device_traces[0][1]: 2500000 after 3000000; at most 1000000 "
            "us): each takes the time of the entry before it");
  EXPECT_EQ(ccalloc::convert_pytorch_snapshot_data(snapshot({5, 4}), "snap").notes.at(0),
            "time_us steps back at 1 entry (device_traces[0][1]: 4 after 5; at most 1 us): each takes the time of "
            "the entry before it");
  EXPECT_TRUE(ccalloc::convert_pytorch_snapshot_data(snapshot({5, 5, 6}), "snap").notes.empty());
  EXPECT_EQ(error_of(snapshot({3'000'000, 3'000'005, 2'000'004})),
            "snap: a PyTorch snapshot that cannot be read: device_traces[0][2].time_us: goes backwards by 1000001 us "
            "(2000004 after 3000005), more than the 1000000 us a clock may step back: the entries are out of order");
}

// Two allocs at one address with no free between: PyTorch never records
// that, so the second is refused naming both entries and the address, as
// the text trace refuses an alloc at a live address (the converter used to
// add a free of the second alloc's size, which the replay then refused at
// a line of the converted trace). An alloc at an address freed without its
// free_completed gets that free_completed (the freed block's size and
// stream), with a note naming the first.
TEST(SnapshotPickle, AnAllocAtALiveAddressIsRefusedNamingBothEntries) {
  struct entry {
    const char* action;
    std::int64_t addr, size;
  };
  const auto snapshot = [](const std::vector<entry>& entries) {
    pickle_writer p;
    p.dict().key("segments").list().end_list().key("device_traces").list().list();
    for (std::size_t i = 0; i < entries.size(); ++i)
      p.dict()
          .field("action", entries[i].action)
          .field("addr", entries[i].addr)
          .field("size", entries[i].size)
          .field("stream", 7)
          .field("time_us", static_cast<std::int64_t>(10 + i))
          .end_dict();
    p.end_list().end_list().end_dict();
    return p.done();
  };
  EXPECT_EQ(error_of(snapshot({{"alloc", 4096, 512}, {"alloc", 8192, 512}, {"alloc", 4096, 1024}})),
            "snap: a PyTorch snapshot that cannot be read: device_traces[0][2]: alloc at address 4096 (1024 bytes), "
            "which is still live (allocated at device_traces[0][0] with 512 bytes; no free_requested between)");
  const ccalloc::trace t = ccalloc::convert_pytorch_snapshot_data(
      snapshot({{"alloc", 4096, 512}, {"free_requested", 4096, 512}, {"alloc", 4096, 1024},
                {"free_requested", 4096, 1024}, {"free_completed", 4096, 1024}}),
      "snap");
  const std::vector<trace_action> want = {trace_action::alloc, trace_action::free_requested,
                                          trace_action::free_completed, trace_action::alloc,
                                          trace_action::free_requested, trace_action::free_completed};
  ASSERT_EQ(t.events.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(t.events[i].action, want[i]) << i;
  EXPECT_EQ(t.events[2].size, 512u) << "the freed block's size";
  EXPECT_EQ(t.events[2].stream, 7u);
  EXPECT_EQ(t.events[2].time_us, 12u);
  ASSERT_EQ(t.notes.size(), 1u);
  EXPECT_EQ(t.notes[0], "1 free_completed added before an alloc at an address freed without one (the first: "
                        "device_traces[0][2] at address 4096)");
  const ccalloc::replay_result r = ccalloc::replay_trace(t, {});
  EXPECT_EQ(r.peak_requested_bytes, 1024u);
}

TEST(SnapshotPickle, CorruptPicklesNameTheByte) {
  const std::string prefix = "snap: a PyTorch snapshot that cannot be read: ";
  const std::map<std::string, std::string> cases = {
      {std::string("\x80\x04\x95\x10\x00\x00", 6), "corrupt pickle at byte 2: it ends inside an argument (truncated)"},
      {std::string("\x80\x04}", 3), "corrupt pickle at byte 3: it ends before its STOP opcode (truncated)"},
      {std::string("\x80\x04\xff", 3), "corrupt pickle at byte 2: byte 0xff is not a pickle opcode"},
      {std::string("\x80\x06.", 3), "corrupt pickle at byte 0: pickle protocol 6 (this reader knows 2 to 5)"},
      {std::string("\x80\x02") + "cos\nsystem\nq\x00.",
       "not a plain-data snapshot: it refers to os.system (pickle GLOBAL at byte 2); nothing was run"},
      {std::string("\x80\x04") + "\x8c\x02os\x8c\x06system\x93.",
       "not a plain-data snapshot: it refers to os.system (pickle STACK_GLOBAL at byte 14); nothing was run"},
      {std::string("\x80\x04") + "N)R.",
       "pickle opcode REDUCE at byte 4 is not plain data (a snapshot holds dicts, lists, strings and numbers only)"},
      {std::string("\x80\x04") + "h\x07.", "corrupt pickle at byte 2: memo index 7 was never stored"},
      // A list appended to itself, then appended to again.
      {std::string("\x80\x04]\x94h\x00" "aK\x01" "a.", 11),
       "corrupt pickle at byte 6: APPEND changes a list after it was put into another (a recursive structure)"},
      {std::string("\x80\x04") + "K\x01" "e.", "corrupt pickle at byte 4: an opcode needs a MARK and there is none"},
      {std::string("\x80\x04") + "K\x01K\x02" "a.", "corrupt pickle at byte 6: APPEND on an int, not a list"},
      {std::string("\x80\x04") + ".", "corrupt pickle at byte 2: an opcode takes a value from an empty stack"},
  };
  for (const auto& [bytes, want] : cases) EXPECT_EQ(error_of(bytes), prefix + want);
}

TEST(SnapshotPickle, LimitsNameTheFlagThatRaisesThem) {
  const std::string bytes = snapshot_with_frames(30, 2);
  ccalloc::trace_read_options o;
  o.max_pickle_objects = 100;
  EXPECT_EQ(error_of(bytes, o),
            "snap: a PyTorch snapshot that cannot be read: the pickle has more than the limit of 100 objects (raise "
            "it with ccalloc's --max-pickle-objects N, or trace_read_options::max_pickle_objects)");
  o = {};
  o.max_pickle_bytes = 1000;
  EXPECT_EQ(error_of(bytes, o),
            "snap: a PyTorch snapshot that cannot be read: the pickle is larger than the limit of 1000 bytes (raise "
            "it with ccalloc's --max-pickle-bytes N, or trace_read_options::max_pickle_bytes)");
  // At the limits, it reads.
  o.max_pickle_bytes = bytes.size();
  EXPECT_EQ(ccalloc::convert_pytorch_snapshot_data(bytes, "snap", o).events.size(), 30u);
  // A string longer than the byte limit is refused before it is read.
  o.max_pickle_bytes = 1000;
  EXPECT_EQ(error_of(std::string("\x80\x04\x8d\xff\xff\xff\xff\xff\xff\x00\x00", 11), o),
            "snap: a PyTorch snapshot that cannot be read: a string at byte 2 claims 281474976710655 bytes, more than "
            "the pickle's limit of 1000 bytes (raise it with ccalloc's --max-pickle-bytes N, or "
            "trace_read_options::max_pickle_bytes)");
  // Through read_trace_file, gzip included: the file's name, no temporary file.
  temp_file f("limit.pickle", bytes);
  o.max_pickle_bytes = 1000;
  try {
    (void)ccalloc::read_trace_file(f.path(), o);
    ADD_FAILURE() << "no error";
  } catch (const trace_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(f.path() + ": a PyTorch snapshot that cannot be read: the pickle is larger", 0),
              0u)
        << e.what();
  }
}

// ---- a real snapshot: sites, the report --------------------------------------------

TEST(SnapshotPickle, RealSnapshotHasSitesAndNeedsNoPython) {
  // No Python: neither on PATH nor named by the old converter's variable.
  const char* path_env = std::getenv("PATH");
  const std::string saved_path = path_env != nullptr ? path_env : "/usr/bin:/bin";
  ::setenv("CCALLOC_PYTHON", "/nonexistent/python3", 1);
  ::setenv("PATH", "/nonexistent", 1);
  std::uint64_t progress_calls = 0, last_done = 0, total = 0;
  ccalloc::trace_read_options o;
  o.progress = [&](std::uint64_t d, std::uint64_t t) {
    ++progress_calls;
    EXPECT_GE(d, last_done);
    last_done = d;
    total = t;
  };
  const ccalloc::trace t = ccalloc::read_trace_file(snapshot_path, o);
  ::setenv("PATH", saved_path.c_str(), 1);
  ::unsetenv("CCALLOC_PYTHON");
  EXPECT_GE(progress_calls, 1u);
  EXPECT_EQ(last_done, total);
  EXPECT_GT(total, 10000u);
  ASSERT_EQ(t.events.size(), 1791u);
  EXPECT_FALSE(t.sites.empty());
  std::size_t with_site = 0;
  for (const auto& e : t.events) {
    ASSERT_LE(e.site, t.sites.size());
    with_site += e.site != 0;
  }
  EXPECT_EQ(with_site, 744u) << "the entries with frames (43 distinct stacks)";
  // The first event is a segment_alloc by module.cuda(): innermost frame first.
  ASSERT_NE(t.events[0].site, 0u);
  EXPECT_EQ(t.sites[t.events[0].site - 1].substr(0, 52), "<lambda> (site-packages/torch/nn/modules/module.py:1");

  ccalloc::report_summary s;
  const std::string page = ccalloc::render_report_html(t, {}, nullptr, &s);
  EXPECT_NE(page.find("<h2>Allocation sites at the peak</h2>"), std::string::npos);
  ASSERT_EQ(s.top_sites.size(), 10u);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < s.top_sites.size(); ++i) {
    if (i > 0) {
      EXPECT_GE(s.top_sites[i - 1].second, s.top_sites[i].second);
    }
    sum += s.top_sites[i].second;
  }
  EXPECT_LE(sum, s.replay.peak_requested_bytes);
  EXPECT_GT(sum, s.replay.peak_requested_bytes / 2);
  // A trace without frames has no such table.
  ccalloc::trace plain = t;
  plain.sites.clear();
  EXPECT_EQ(ccalloc::render_report_html(plain, {}, nullptr).find("Allocation sites"), std::string::npos);
}

TEST(SnapshotPickle, SameEventsAsTheScriptConverter) {
  if (std::system("python3 -c 'import pickle, gzip' >/dev/null 2>&1") != 0) GTEST_SKIP() << "python3 is not available";
  // The real snapshot, and small ones with blocks alive before the trace, an
  // expandable segment mapped before and during it, a missing free_requested,
  // an oom and an unknown action, as pickle.dump writes them (protocols 2, 4, 5).
  const std::string corpus = std::string(CCALLOC_SOURCE_DIR) + "/fuzz/corpus/snapshot_pickle/";
  for (const std::string& path : {snapshot_path, corpus + "small_protocol2.pickle", corpus + "small_protocol4.pickle",
                                  corpus + "small_protocol5.pickle", corpus + "small.pickle.gz"}) {
    temp_file out("converted.trace", "");
    const std::string command = "python3 " + std::string(CCALLOC_SOURCE_DIR) + "/tools/snapshot_to_trace.py " + path +
                                " -o " + out.path();
    ASSERT_EQ(std::system(command.c_str()), 0) << path;
    const ccalloc::trace script = ccalloc::read_trace_file(out.path());
    const ccalloc::trace native = ccalloc::read_trace_file(path);
    ASSERT_EQ(script.events.size(), native.events.size()) << path;
    for (std::size_t i = 0; i < script.events.size(); ++i) {
      const auto &a = script.events[i], &b = native.events[i];
      ASSERT_EQ(std::tie(a.time_us, a.action, a.addr, a.size, a.stream),
                std::tie(b.time_us, b.action, b.addr, b.size, b.stream))
          << path << " event " << i;
    }
  }
}

}  // namespace

// A string or bytes object claiming 2^63 bytes in an 11-byte pickle names
// itself and the byte limit it cannot fit in (not "the pickle is larger").
TEST(SnapshotPickle, AHugeStringClaimNamesTheString) {
  const std::string prefix = "snap: a PyTorch snapshot that cannot be read: ";
  const std::string hint = " (raise it with ccalloc's --max-pickle-bytes N, or trace_read_options::max_pickle_bytes)";
  EXPECT_EQ(error_of(std::string("\x80\x04\x8d\x00\x00\x00\x00\x00\x00\x00\x80" "abc", 14)),
            prefix + "a string at byte 2 claims 9223372036854775808 bytes, more than the pickle's limit of 4294967296 "
                     "bytes" + hint);
  EXPECT_EQ(error_of(std::string("\x80\x04\x8e\x00\x00\x00\x00\x00\x00\x00\x80" "abc", 14)),
            prefix + "a bytes object at byte 2 claims 9223372036854775808 bytes, more than the pickle's limit of "
                     "4294967296 bytes" + hint);
  ccalloc::trace_read_options o;
  o.max_pickle_bytes = 100;
  EXPECT_EQ(error_of(std::string("\x80\x04\x8b\xff\x00\x00\x00" "abc", 10), o),
            prefix + "an integer at byte 2 claims 255 bytes, more than the pickle's limit of 100 bytes" + hint);
}

// Memo indices far apart (each BINPUT 20,000 past the last: 8 KB of pickle)
// cost one entry each, not the gap: before, 8 bytes per index skipped
// (1,600 puts made a 256 MB memo).
TEST(SnapshotPickle, SparseMemoIndicesCostNoMemoryForTheGap) {
  std::string bytes = std::string("\x80\x04N", 3);
  for (std::uint32_t i = 1; i <= 1600; ++i) {
    const std::uint32_t index = i * 20000;
    bytes += 'r';
    for (int b = 0; b < 4; ++b) bytes += static_cast<char>((index >> (8 * b)) & 0xff);
  }
  bytes += std::string("h\x00.", 3);  // BINGET 0: never stored
  if (!ccalloc::testing::reset_peak_rss()) GTEST_SKIP() << "no peak resident size (clear_refs, or ASan)";
  std::string why;
  const std::uint64_t growth = ccalloc::testing::peak_rss_growth([&] { why = error_of(bytes); });
  EXPECT_EQ(why, "snap: a PyTorch snapshot that cannot be read: corrupt pickle at byte 8003: memo index 0 was never "
                 "stored");
  EXPECT_LT(growth, 16 * ccalloc::testing::MiB);
  // An entry stored ahead is found, and joins the dense part when it is reached.
  const std::string ahead = std::string("\x80\x04K\x07q\x02K\x05q\x00K\x06q\x01" "000h\x02.", 20);
  EXPECT_EQ(error_of(ahead), "snap: a PyTorch snapshot that cannot be read: not a PyTorch memory snapshot (no "
                             "'device_traces'; found an int)");
}

// The memory the reader builds is bounded by max_pickle_memory_bytes: 15 KB
// of EMPTY_LIST opcodes (48 bytes of memory each) fail at a 100 KB budget,
// naming the limit and the flag.
TEST(SnapshotPickle, MemoryLimitNamesTheFlag) {
  const std::string lists = std::string("\x80\x04(", 3) + std::string(15000, ']') + "l.";
  ccalloc::trace_read_options o;
  o.max_pickle_memory_bytes = 100000;
  EXPECT_EQ(error_of(lists, o),
            "snap: a PyTorch snapshot that cannot be read: reading the pickle takes more than the limit of 100000 "
            "bytes of memory (raise it with ccalloc's --max-pickle-memory SIZE, or "
            "trace_read_options::max_pickle_memory_bytes)");
  // The default reads it (and the snapshot of the test data, 0.7 MB, within 2x its size).
  EXPECT_NE(error_of(lists).find("not a PyTorch memory snapshot"), std::string::npos);
  o.max_pickle_memory_bytes = 1400000;
  EXPECT_GT(ccalloc::convert_pytorch_snapshot(snapshot_path, o).events.size(), 0u);
}

// ---- devices, tags, pause and resume ------------------------------------------------

namespace {

/// {"device_traces": [...], "segments": []}: device d gets counts[d] allocs.
std::string snapshot_with_devices(const std::vector<int>& counts) {
  pickle_writer p;
  p.dict().key("segments").list().end_list().key("device_traces").list();
  for (std::size_t d = 0; d < counts.size(); ++d) {
    p.list();
    for (int i = 0; i < counts[d]; ++i)
      p.dict()
          .field("action", "alloc")
          .field("addr", static_cast<std::int64_t>(0x7f0000000000 + 0x100000 * (100 * d + i)))
          .field("size", static_cast<std::int64_t>(4096 * (d + 1)))
          .field("stream", 0)
          .field("time_us", 1700000000000000 + i)
          .end_dict();
    p.end_list();
  }
  p.end_list().end_dict();
  return p.done();
}

TEST(SnapshotPickle, SeveralDevicesConvertTheBusiestAndNameTheOthers) {
  const std::string bytes = snapshot_with_devices({1, 3, 0, 2});
  const ccalloc::trace busiest = ccalloc::convert_pytorch_snapshot_data(bytes, "snap");
  ASSERT_EQ(busiest.events.size(), 3u);
  for (const ccalloc::trace_event& e : busiest.events) EXPECT_EQ(e.size, 8192u) << "device 1's entries";
  ASSERT_FALSE(busiest.notes.empty());
  EXPECT_EQ(busiest.notes.front(),
            "the snapshot has entries on several devices; the trace holds one: device 1 (3 entries) converted, not "
            "device 0 (1 entry), device 3 (2 entries) (choose one with ccalloc's --snapshot-device N, or "
            "trace_read_options::snapshot_device)");

  ccalloc::trace_read_options o;
  o.snapshot_device = 3;
  const ccalloc::trace third = ccalloc::convert_pytorch_snapshot_data(bytes, "snap", o);
  ASSERT_EQ(third.events.size(), 2u);
  EXPECT_EQ(third.events[0].size, 16384u);
  ASSERT_FALSE(third.notes.empty());
  EXPECT_NE(third.notes.front().find("device 3 (2 entries) converted, not device 0 (1 entry), device 1 (3 entries)"),
            std::string::npos)
      << third.notes.front();

  o.snapshot_device = 4;
  EXPECT_EQ(error_of(bytes, o),
            "snap: a PyTorch snapshot that cannot be read: device 4 was asked for (--snapshot-device), but "
            "device_traces has devices 0..3");

  // One device with entries: no note.
  const ccalloc::trace single = ccalloc::convert_pytorch_snapshot_data(snapshot_with_devices({0, 2}), "snap");
  EXPECT_EQ(single.events.size(), 2u);
  EXPECT_TRUE(single.notes.empty()) << single.notes.front();
}

/// `j` written as pickle opcodes (what python/ccalloc/snapshot.py makes of
/// a snapshot's JSON with Python's pickle).
void write_json(const nlohmann::json& j, pickle_writer& p) {
  switch (j.type()) {
    case nlohmann::json::value_t::object:
      p.dict();
      for (const auto& [k, v] : j.items()) {
        p.key(k);
        write_json(v, p);
      }
      p.end_dict();
      break;
    case nlohmann::json::value_t::array:
      p.list();
      for (const auto& v : j) write_json(v, p);
      p.end_list();
      break;
    case nlohmann::json::value_t::string: p.str(j.get<std::string>()); break;
    case nlohmann::json::value_t::boolean: p.raw(j.get<bool>() ? "\x88" : "\x89"); break;
    case nlohmann::json::value_t::number_unsigned:
    case nlohmann::json::value_t::number_integer: p.num(j.get<std::int64_t>()); break;
    case nlohmann::json::value_t::number_float: {
      const double d = j.get<double>();
      std::uint64_t bits = 0;
      std::memcpy(&bits, &d, sizeof bits);
      std::string be(1, 'G');
      for (int i = 7; i >= 0; --i) be += static_cast<char>((bits >> (8 * i)) & 0xFF);
      p.raw(be);
      break;
    }
    default: p.raw("N"); break;
  }
}

TEST(SnapshotPickle, CcallocSnapshotsKeepTheirTagsPausesAndResumes) {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  auto sim = std::make_shared<ccalloc::sim_backend>();
  ccalloc::caching_allocator a(sim, ccalloc::allocator_config::parse(""));
  a.init(1);
  ccalloc::history_options h;
  h.when = ccalloc::record_context::never;
  a.record_history(h);
  void* weights = nullptr;
  void* kv = nullptr;
  {
    const ccalloc::tag_scope scope("weights");
    weights = a.malloc(0, 8 * MiB, 0);
  }
  {
    const ccalloc::tag_scope scope("kv_cache");
    kv = a.malloc(0, 4 * MiB, 0);
  }
  void* plain = a.malloc(0, 1 * MiB, 0);
  (void)a.pause({"weights"}, /*keep_contents=*/true);
  (void)a.pause({"kv_cache"}, /*keep_contents=*/false);
  (void)a.resume({"weights"});
  a.free(plain);
  pickle_writer p;
  write_json(nlohmann::json::parse(ccalloc::to_json(a.snapshot())), p);
  a.resume({"kv_cache"});
  a.free(weights);
  a.free(kv);

  const ccalloc::trace t = ccalloc::convert_pytorch_snapshot_data(p.done(), "own");
  std::vector<std::string> seen;  // "action tag [keep|drop]" of tag, pause, resume; "alloc SIZE"
  for (const ccalloc::trace_event& e : t.events) {
    const std::string tag = e.tag == 0 ? "default" : t.tags.at(e.tag - 1);
    switch (e.action) {
      case trace_action::tag: seen.push_back("tag " + tag); break;
      case trace_action::pause: seen.push_back("pause " + tag + (e.keep_contents ? " keep" : " drop")); break;
      case trace_action::resume: seen.push_back("resume " + tag); break;
      case trace_action::alloc: seen.push_back("alloc " + std::to_string(e.size / MiB)); break;
      default: break;
    }
    if (e.action == trace_action::pause || e.action == trace_action::resume) {
      EXPECT_EQ(e.addr, 0u);
      EXPECT_EQ(e.stream, 0u);
    }
  }
  const std::vector<std::string> expected = {"tag weights",  "alloc 8",       "tag kv_cache",       "alloc 4",
                                             "tag default",  "alloc 1",       "pause weights keep", "pause kv_cache drop",
                                             "resume weights"};
  EXPECT_EQ(seen, expected);
  for (const std::string& note : t.notes) EXPECT_EQ(note.find("pause"), std::string::npos) << note;

  // The replay sleeps and wakes as the program did.
  const ccalloc::replay_result r = ccalloc::replay_trace(t, ccalloc::replay_options{});
  ASSERT_EQ(r.sleep_events.size(), 3u);
  EXPECT_TRUE(r.sleep_events[0].pause);
  EXPECT_EQ(r.sleep_events[0].tag, "weights");
  EXPECT_TRUE(r.sleep_events[0].keep_contents);
  EXPECT_EQ(r.sleep_events[0].paused_bytes, 8 * MiB);
  EXPECT_EQ(r.sleep_events[1].tag, "kv_cache");
  EXPECT_FALSE(r.sleep_events[1].keep_contents);
  EXPECT_FALSE(r.sleep_events[2].pause);
  EXPECT_EQ(r.sleep_events[2].tag, "weights");
}

/// A resume of tag "weights" paused before the trace, then an alloc under `alloc_tag`.
std::string resume_then_alloc(const std::string& alloc_tag) {
  pickle_writer p;
  p.dict().key("segments").list().end_list().key("device_traces").list().list();
  p.dict().field("action", "resume").field("addr", 0).field("size", 4096).field("stream", 0);
  p.field("time_us", 1700000000000000).field("tag", "weights").end_dict();
  p.dict().field("action", "alloc").field("addr", 0x7f0000000000).field("size", 512).field("stream", 0);
  p.field("time_us", 1700000000000001).field("tag", alloc_tag).end_dict();
  p.end_list().end_list().end_dict();
  return p.done();
}

TEST(SnapshotPickle, AResumeOfATagPausedBeforeTheTraceIsDropped) {
  EXPECT_EQ(error_of(resume_then_alloc("bad tag!")),
            "snap: a PyTorch snapshot that cannot be read: device_traces[0][1].tag: bad tag 'bad tag!': a tag name "
            "is 1 to 64 ASCII letters, digits and the characters _-.:/");
  const ccalloc::trace t = ccalloc::convert_pytorch_snapshot_data(resume_then_alloc("default"), "snap");
  ASSERT_EQ(t.events.size(), 1u);
  EXPECT_EQ(t.events[0].action, trace_action::alloc);
  ASSERT_EQ(t.notes.size(), 1u);
  EXPECT_EQ(t.notes[0], "1 resume entry of tags paused before the trace began dropped");
}

}  // namespace

// trace_formats_test.cpp: the inputs read_trace_file understands besides
// ccalloc's own format (include/ccalloc/replay/trace.hpp): RMM
// logging_resource_adaptor CSV logs and PyTorch snapshot pickles (through the
// bundled converter and python3), told apart by content; real and malformed
// input, every error with FILE:LINE. And the HTML report
// (include/ccalloc/replay/report.hpp) of the bundled trace.
#include <ccalloc/base/errors.hpp>
#include <ccalloc/replay/embedded.hpp>
#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/report.hpp>
#include <ccalloc/replay/trace.hpp>

#include <gtest/gtest.h>

#include "peak_rss.hpp"
#include "temp_file.hpp"
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <string_view>
#include <unistd.h>

#ifndef CCALLOC_SOURCE_DIR
#error "CCALLOC_SOURCE_DIR must name the source tree (tests/CMakeLists.txt sets it)"
#endif

namespace {

namespace fs = std::filesystem;
using ccalloc::trace_action;
using ccalloc::trace_error;

const std::string snapshot_path = std::string(CCALLOC_SOURCE_DIR) + "/tests/data/torch_snapshot_resnet18.pickle.gz";

using ccalloc::testing::temp_file;

/// The message of the trace_error `f` throws, or "" if none.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const trace_error& e) {
    return e.what();
  }
  return "";
}

// ---- sniffing ------------------------------------------------------------------------

TEST(TraceFormats, SniffedByContentNotName) {
  using ccalloc::trace_format;
  EXPECT_EQ(ccalloc::sniff_trace_format("# time_us action addr size stream\n1 alloc 1 1 0\n"), trace_format::ccalloc);
  EXPECT_EQ(ccalloc::sniff_trace_format("Thread,Time,Action,Pointer,Size,Stream\n"), trace_format::rmm_log);
  EXPECT_EQ(ccalloc::sniff_trace_format("\xEF\xBB\xBF\n  Thread,Time,Action,Pointer,Size,Stream\n"),
            trace_format::rmm_log);
  EXPECT_EQ(ccalloc::sniff_trace_format(std::string("\x80\x04\x95", 3)), trace_format::pytorch_snapshot);
  EXPECT_EQ(ccalloc::sniff_trace_format(std::string("\x80\x09", 2)), trace_format::ccalloc) << "not a pickle protocol";
  EXPECT_EQ(ccalloc::sniff_trace_format(""), trace_format::ccalloc);
  // An RMM log is told by its header's column names, in any order, with
  // other columns or without some (the reader then names what it lacks).
  EXPECT_EQ(ccalloc::sniff_trace_format("Time,Thread,Action,Pointer,Size,Stream\n"), trace_format::rmm_log);
  EXPECT_EQ(ccalloc::sniff_trace_format("\n Id , Stream,Size\n"), trace_format::rmm_log);
  EXPECT_EQ(ccalloc::sniff_trace_format("Time,Action,Pointer,Size\n"), trace_format::rmm_log);
  EXPECT_EQ(ccalloc::sniff_trace_format("a,b,c\n"), trace_format::ccalloc) << "no RMM column named";
  EXPECT_EQ(ccalloc::sniff_trace_format("# Thread,Time\n"), trace_format::ccalloc) << "a comment";
  EXPECT_EQ(ccalloc::sniff_trace_format("1 alloc 1 1 0\nThread,Time,Action,Pointer,Size,Stream\n"),
            trace_format::ccalloc) << "only the first line is a header";
  // A file named .csv in ccalloc's format is read as ccalloc's format.
  temp_file f("looks_like.csv", "1 alloc 4096 512 0\n2 free_requested 4096 512 0\n3 free_completed 4096 512 0\n");
  EXPECT_EQ(ccalloc::read_trace_file(f.path()).events.size(), 3u);
}

// ---- RMM logs ------------------------------------------------------------------------

// The format RMM's logging_resource_adaptor writes: the header, then
// "%t,%H:%M:%S.%f,<action>,%p,%zu,<stream as hex pointer>".
constexpr std::string_view rmm_log =
    "Thread,Time,Action,Pointer,Size,Stream\n"
    "139951,23:59:59.999000,allocate,0x7f1a40000000,1024,0x5581c0a0\n"
    "139951,23:59:59.999500,allocate,0x7f1a40000400,4096,0x0\n"
    "139952,23:59:59.999400,free,0x7f1a40000000,1024,0x5581c0a0\n"  // a thread logged late
    "139951,00:00:00.000100,allocate failure,(nil),1099511627776,0x5581c0a0\n"
    "139951,00:00:00.000200,free,0x7f1a40009000,64,0x0\n"  // never allocated in the log
    "139951,00:00:00.000300,free,0x7f1a40000400,4096,0x0\n";

TEST(RmmLog, RealFormatBecomesTraceEvents) {
  temp_file f("rmm.csv", rmm_log);
  const ccalloc::trace t = ccalloc::read_trace_file(f.path());
  ASSERT_EQ(t.events.size(), 7u);
  const std::vector<trace_action> want = {trace_action::alloc,          trace_action::alloc,
                                          trace_action::free_requested, trace_action::free_completed,
                                          trace_action::oom,            trace_action::free_requested,
                                          trace_action::free_completed};
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(t.events[i].action, want[i]) << i;
  EXPECT_EQ(t.events[0].addr, 0x7f1a40000000u);
  EXPECT_EQ(t.events[0].size, 1024u);
  EXPECT_EQ(t.events[0].stream, 0x5581c0a0u);
  EXPECT_EQ(t.events[0].line, 2u);
  EXPECT_EQ(t.events[0].time_us, ((23u * 60 + 59) * 60 + 59) * 1000000ull + 999000);
  EXPECT_EQ(t.events[1].stream, 0u);
  // 23:59:59.999400 came after .999500: held at the previous time.
  EXPECT_EQ(t.events[2].time_us, t.events[1].time_us);
  EXPECT_EQ(t.events[3].time_us, t.events[2].time_us);
  // Past midnight: a day later, not 24 hours back.
  EXPECT_EQ(t.events[4].time_us, 86400ull * 1000000 + 100);
  EXPECT_EQ(t.events[4].size, 1099511627776u);
  EXPECT_EQ(t.events[5].addr, 0x7f1a40000400u);
  ASSERT_EQ(t.notes.size(), 2u);
  EXPECT_NE(t.notes[0].find("1 free(s) of pointers the log never allocated were skipped"), std::string::npos);
  EXPECT_EQ(t.notes[1],
            "Time steps back at 1 row(s) (the first: line 4; at most 100 us, threads logging out of order): each "
            "takes the latest Time above it");
  // And it replays: the 1 TiB request fails nothing (it was a failure in the log, not replayed).
  const ccalloc::replay_result r = ccalloc::replay_trace(t, {});
  EXPECT_EQ(r.peak_requested_bytes, 1024u + 4096u);
  EXPECT_EQ(r.ooms, 0u);
}

TEST(RmmLog, EpochSecondsAndColumnOrder) {
  const std::string text =
      "Stream,Size,Pointer,Action,Time,Thread,Extra\n"
      "0x0,512,7f0000000000,allocate,1634567890.123456,1,x\n"
      "0x0,512,0x7f0000000000,deallocate,1634567890.2,1,y\n";
  const ccalloc::trace t = ccalloc::parse_rmm_log(text, "log");
  ASSERT_EQ(t.events.size(), 3u);
  EXPECT_EQ(t.events[0].time_us, 1634567890123456ull);
  EXPECT_EQ(t.events[0].addr, 0x7f0000000000u);
  EXPECT_EQ(t.events[1].time_us, 1634567890200000ull);
  EXPECT_TRUE(t.notes.empty());
}

// A header with its columns in another order, or with more, is an RMM log
// read by the names; one without a column the replay needs names it.
TEST(RmmLog, ColumnsAreFoundByTheHeadersNames) {
  temp_file reordered("reordered.csv",
                      "Time,Thread,Action,Pointer,Size,Stream\n"
                      "14:03:21.123456,1,allocate,0x7f8a40000000,1024,0x0\n"
                      "14:03:21.223456,1,free,0x7f8a40000000,1024,0x0\n");
  const ccalloc::trace t = ccalloc::read_trace_file(reordered.path());
  ASSERT_EQ(t.events.size(), 3u);
  EXPECT_EQ(t.events[0].addr, 0x7f8a40000000u);
  EXPECT_EQ(t.events[0].time_us, ((14u * 60 + 3) * 60 + 21) * 1000000ull + 123456);
  temp_file extra("extra.csv",
                  "Device,Time,Action,Pointer,Size,Stream,Note\n"
                  "0,1.5,allocate,0x10,8,0x3,a\n");
  const ccalloc::trace e = ccalloc::read_trace_file(extra.path());
  ASSERT_EQ(e.events.size(), 1u);
  EXPECT_EQ(e.events[0].stream, 3u);
  EXPECT_EQ(e.events[0].time_us, 1500000u);
  temp_file no_size("no_size.csv", "Thread,Time,Action,Pointer,Stream\n1,1.0,allocate,0x10,0x0\n");
  EXPECT_EQ(error_of([&] { (void)ccalloc::read_trace_file(no_size.path()); }),
            no_size.path() + ":1: RMM log header lacks the column 'Size' (the replay needs Time, Action, Pointer, "
                             "Size and Stream; RMM writes Thread,Time,Action,Pointer,Size,Stream)");
}

// Threads take the time before the log's lock, so their rows may come a
// little out of order: a step back of up to 1 s takes the latest time
// above it and is counted in a note; more is an error naming the line.
TEST(RmmLog, TimeStepsBackAreNotedUpToASecondAndRefusedBeyond) {
  const std::string head = "Thread,Time,Action,Pointer,Size,Stream\n";
  const ccalloc::trace t = ccalloc::parse_rmm_log(head +
                                                      "1,10.000100,allocate,0x10,8,0x0\n"
                                                      "2,10.000040,allocate,0x20,8,0x0\n"
                                                      "1,10.000200,allocate,0x30,8,0x0\n"
                                                      "2,9.500200,allocate,0x40,8,0x0\n",
                                                  "log");
  ASSERT_EQ(t.events.size(), 4u);
  EXPECT_EQ(t.events[1].time_us, 10000100u);
  EXPECT_EQ(t.events[3].time_us, 10000200u);
  ASSERT_EQ(t.notes.size(), 1u);
  EXPECT_EQ(t.notes[0],
            "Time steps back at 2 row(s) (the first: line 3; at most 500000 us, threads logging out of order): each "
            "takes the latest Time above it");
  EXPECT_EQ(error_of([&] {
              (void)ccalloc::parse_rmm_log(head + "1,10.0,allocate,0x10,8,0x0\n2,8.9,allocate,0x20,8,0x0\n", "log");
            }),
            "log:3: Time '8.9' is 1100000 us before the latest Time above it, more than the 1000000 us threads "
            "logging out of order account for: the rows are out of order, or two logs are merged");
  // A time of day that wraps past midnight is a day later, no step back.
  EXPECT_TRUE(ccalloc::parse_rmm_log(head + "1,23:59:59.9,allocate,0x10,8,0x0\n1,00:00:00.1,allocate,0x20,8,0x0\n",
                                     "log")
                  .notes.empty());
}

// RMM frees on any stream (the memory is reusable in that stream's order);
// ccalloc's format records a free on its block's stream: the reader writes
// the allocation's stream and says so in a note.
TEST(RmmLog, AFreeOnAnotherStreamIsReplayedOnTheAllocationsStream) {
  const ccalloc::trace t = ccalloc::parse_rmm_log(
      "Thread,Time,Action,Pointer,Size,Stream\n1,1.0,allocate,0x10,8,0x1\n1,2.0,free,0x10,8,0x2\n", "log");
  ASSERT_EQ(t.events.size(), 3u);
  EXPECT_EQ(t.events[1].stream, 1u);
  EXPECT_EQ(t.events[2].stream, 1u);
  ASSERT_EQ(t.notes.size(), 1u);
  EXPECT_EQ(t.notes[0], "1 free(s) on another Stream than their allocate's (the first: line 3) are replayed on the "
                        "allocation's stream");
  EXPECT_EQ(ccalloc::replay_trace(t, {}).peak_requested_bytes, 8u);
}

// An allocate of 0 bytes holds no memory: RMM's resources return nullptr,
// others a pointer (maybe the same one again, maybe inside a live
// allocation). It and its free (Size 0) are skipped together, in one note:
// the free is no pointer "the log never allocated".
TEST(RmmLog, ZeroByteAllocatesAndTheirFreesAreSkippedTogether) {
  const ccalloc::trace t = ccalloc::parse_rmm_log("Thread,Time,Action,Pointer,Size,Stream\n"
                                                  "1,1.0,allocate,0x10,0,0x0\n"
                                                  "1,1.1,allocate,0x10,0,0x0\n"   // the same pointer again
                                                  "1,1.2,allocate,0x40,64,0x0\n"
                                                  "1,1.3,allocate,0x40,0,0x0\n"   // at a live allocation
                                                  "1,2.0,free,0x10,0,0x0\n"
                                                  "1,2.1,free,0x10,0,0x0\n"
                                                  "1,2.2,free,0x40,0,0x0\n"
                                                  "1,2.3,free,0x40,64,0x0\n"
                                                  "1,2.4,allocate,(nil),0,0x0\n"  // RMM's nullptr
                                                  "1,2.5,free,(nil),0,0x0\n",
                                                  "log");
  ASSERT_EQ(t.events.size(), 3u);
  EXPECT_EQ(t.events[0].action, trace_action::alloc);
  EXPECT_EQ(t.events[0].size, 64u);
  EXPECT_EQ(t.events[2].action, trace_action::free_completed);
  ASSERT_EQ(t.notes.size(), 1u) << t.notes[0];
  EXPECT_EQ(t.notes[0], "3 allocate(s) of 0 bytes (the first: line 2) and 3 free(s) of them were skipped: 0 bytes "
                        "hold no memory to replay");
  // A third free of 0x10 is a double free, said as one.
  const ccalloc::trace twice = ccalloc::parse_rmm_log(
      "Thread,Time,Action,Pointer,Size,Stream\n1,1.0,allocate,0x10,0,0x0\n1,2.0,free,0x10,0,0x0\n"
      "1,3.0,free,0x10,0,0x0\n",
      "log");
  ASSERT_EQ(twice.notes.size(), 2u);
  EXPECT_EQ(twice.notes[1], "1 double free(s) were skipped: pointers freed again without an allocate between (the "
                            "first: line 4 frees 0x10, already freed at line 3)");
}

TEST(RmmLog, MalformedInputNamesFileAndLine) {
  const std::string head = "Thread,Time,Action,Pointer,Size,Stream\n";
  const std::map<std::string, std::string> cases = {
      {"Thread,Time,Action,Pointer,Size\n", "log:1: RMM log header lacks the column 'Stream'"},
      {head + "1,10:00:00.000001,alloc,0x10,8,0x0\n",
       "log:2: unknown Action 'alloc' (accepted: allocate, free, allocate failure)"},
      {head + "1,10:00:00.000001,allocate,0xZZ,8,0x0\n", "log:2: bad Pointer '0xZZ'"},
      {head + "1,10:00:00.000001,allocate,0x10,-8,0x0\n", "log:2: bad Size '-8'"},
      {head + "1,10:00:00.000001,allocate,0x10,8,stream0\n", "log:2: bad Stream 'stream0'"},
      {head + "1,25:00:00.000001,allocate,0x10,8,0x0\n", "log:2: bad Time '25:00:00.000001'"},
      {head + "1,10:00:00.000001,allocate,0x10,8\n", "log:2: expected 6 comma-separated fields as in the header, got 5"},
      {head + "1,1.0,allocate,0x10,8,0x0\n\n1,2.0,allocate,0x10,8,0x0\n",
       "log:4: allocate at Pointer 0x10, which is still live (allocated at line 2)"},
      {head + "1,1.0,allocate,(nil),8,0x0\n", "log:2: allocate of 8 bytes returned a null Pointer"},
      {head + "1,1.0,allocate failure,0x10,8,0x0\n",
       "log:2: bad Pointer '0x10': an allocate failure has a null Pointer (RMM writes 0, 0x0 or (nil))"},
      {"\n\n", "log: empty RMM log: no header line"},
  };
  for (const auto& [text, want] : cases) {
    const std::string got = error_of([&] { (void)ccalloc::parse_rmm_log(text, "log"); });
    EXPECT_EQ(got.substr(0, want.size()), want) << text;
  }
  // Through read_trace_file, errors name the file.
  temp_file f("bad_rmm.csv", head + "1,10:00:00.000001,allocat,0x10,8,0x0\n");
  EXPECT_EQ(error_of([&] { (void)ccalloc::read_trace_file(f.path()); }).rfind(f.path() + ":2: unknown Action", 0), 0u);
}

// ---- PyTorch snapshots -----------------------------------------------------------------

TEST(PyTorchSnapshot, RealSnapshotConvertsAndReplays) {
  const ccalloc::trace t = ccalloc::read_trace_file(snapshot_path);
  EXPECT_EQ(t.source, snapshot_path);
  EXPECT_FALSE(t.has_source_lines) << "a pickle has no lines to point at";
  // 1791 entries: alloc 657, free_requested 532, free_completed 532, segment_alloc 39, segment_free 31.
  std::map<trace_action, std::size_t> count;
  for (const auto& e : t.events) ++count[e.action];
  EXPECT_EQ(t.events.size(), 1791u);
  EXPECT_EQ(count[trace_action::alloc], 657u);
  EXPECT_EQ(count[trace_action::free_completed], 532u);
  EXPECT_EQ(count[trace_action::segment_alloc], 39u);
  EXPECT_EQ(count[trace_action::segment_free], 31u);
  for (std::size_t i = 1; i < t.events.size(); ++i) ASSERT_GE(t.events[i].time_us, t.events[i - 1].time_us);
  const ccalloc::replay_result r = ccalloc::replay_trace(t, {});
  EXPECT_EQ(r.ooms, 0u);
  EXPECT_GT(r.peak_requested_bytes, 400u * 1000 * 1000);
  EXPECT_GE(r.peak_reserved_bytes, r.peak_requested_bytes);
}

TEST(PyTorchSnapshot, MalformedPicklesGiveClearErrors) {
  // Truncated: a pickle header and nothing else.
  temp_file truncated("truncated.pickle", std::string("\x80\x04\x95\x10\x00\x00", 6));
  std::string e = error_of([&] { (void)ccalloc::read_trace_file(truncated.path()); });
  EXPECT_EQ(e, truncated.path() + ": a PyTorch snapshot that cannot be read: corrupt pickle at byte 2: it ends inside "
                                  "an argument (truncated)");
  // A pickle of something else (a list of ints: protocol 2).
  // (split literal: "\x02e" would be one hex escape)
  temp_file list("list.pickle", std::string("\x80\x02]q\x00(K\x01K\x02" "e.", 12));
  e = error_of([&] { (void)ccalloc::read_trace_file(list.path()); });
  EXPECT_NE(e.find("not a PyTorch memory snapshot (no 'device_traces'"), std::string::npos) << e;
  // A pickle that names a class: refused, nothing runs.
  temp_file cls("class.pickle", std::string("\x80\x02") + "cos\nsystem\nq\x00.");
  e = error_of([&] { (void)ccalloc::read_trace_file(cls.path()); });
  EXPECT_NE(e.find("not a plain-data snapshot: it refers to os.system"), std::string::npos) << e;
}

// ---- the HTML report -------------------------------------------------------------------

ccalloc::trace embedded_trace() {
  const std::string source = "<embedded:gpt2_train>";
  return ccalloc::parse_trace_text(ccalloc::maybe_gunzip(ccalloc::embedded::default_trace_gz(), source), source);
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

TEST(Report, Gpt2PageHasEveryPlot) {
  const ccalloc::trace t = embedded_trace();
  ccalloc::report_options o;
  ccalloc::native_reference native;
  native.origin = "test";
  native.reserved_peak = 15286140928;
  int progress_calls = 0;
  o.progress = [&](int, std::size_t done, std::size_t total) {
    ++progress_calls;
    EXPECT_LE(done, total);
  };
  ccalloc::report_summary s;
  const std::string page = ccalloc::render_report_html(t, o, &native, &s);
  EXPECT_GT(progress_calls, 100);
  // The same figures as a plain replay.
  const ccalloc::replay_result r = ccalloc::replay_trace(t, {});
  EXPECT_EQ(s.replay.peak_reserved_bytes, r.peak_reserved_bytes);
  EXPECT_EQ(s.replay.peak_requested_bytes, r.peak_requested_bytes);
  // The recording allocator's reserved peak from the trace's segment events
  // is PyTorch's own figure (native_reserved_peak in data/traces/native_peaks.json).
  EXPECT_EQ(s.recorded_reserved_peak, 15286140928u);
  EXPECT_GT(s.segments_at_peak, 5u);
  EXPECT_EQ(s.plot_points, 1200u);
  // Self-contained: no network, one file.
  EXPECT_EQ(page.find("http://"), std::string::npos);
  EXPECT_EQ(page.find("https://"), std::string::npos);
  EXPECT_EQ(page.find("<script src"), std::string::npos);
  EXPECT_EQ(page.find("<link"), std::string::npos);
  // Four curves of 2 points per slice, the map, the tables.
  const std::string polyline = "<polyline class=\"curve\" points=\"";
  std::size_t curves = 0;
  for (std::size_t p = page.find(polyline); p != std::string::npos; p = page.find(polyline, p + 1)) {
    ++curves;
    const std::size_t begin = p + polyline.size();
    EXPECT_EQ(count(page.substr(begin, page.find('"', begin) - begin), ","), 2u * 1200) << "one step per slice";
  }
  EXPECT_EQ(curves, 3u) << "recording allocator reserved, ccalloc allocated, ccalloc reserved";
  EXPECT_EQ(count(page, "<polygon points="), 1u) << "requested, filled";
  EXPECT_GT(count(page, "<rect x="), 200u) << "segments and blocks";
  EXPECT_EQ(count(page, "<h2>"), 5u);
  EXPECT_NE(page.find("PyTorch native"), std::string::npos);
  // The hover data parses and has one value per slice.
  const std::size_t a = page.find("id=\"chartdata\">") + 15, b = page.find("</script>", a);
  const auto data = nlohmann::json::parse(page.substr(a, b - a));
  EXPECT_EQ(data["reserved"].size(), 1200u);
  double top = 0;
  for (const auto& v : data["reserved"]) top = std::max(top, v.get<double>());
  EXPECT_NEAR(top, double(r.peak_reserved_bytes) / 1048576.0, 0.01) << "no peak lost to downsampling";
  EXPECT_LT(page.size(), 1000000u);
}

TEST(Report, BadOptionsAndEmptyTrace) {
  ccalloc::report_options o;
  ccalloc::trace empty;
  empty.source = "empty";
  EXPECT_THROW((void)ccalloc::render_report_html(empty, o, nullptr), ccalloc::invalid_argument_error);
  o.plot_points = 1;
  EXPECT_THROW((void)ccalloc::render_report_html(embedded_trace(), o, nullptr), ccalloc::invalid_argument_error);
  o.plot_points = 10;
  o.config = "max_split_size_mb:nope";
  EXPECT_THROW((void)ccalloc::render_report_html(embedded_trace(), o, nullptr), ccalloc::config_error);
}

TEST(Report, TraceWithoutTimesOrSegmentsUsesEventIndex) {
  // An RMM-like trace: no segment events, all at one time.
  const ccalloc::trace t = ccalloc::parse_trace_text(
      "5 alloc 4096 1048576 0\n5 alloc 2101248 3145728 0\n5 free_requested 4096 1048576 0\n"
      "5 free_completed 4096 1048576 0\n",
      "flat");
  ccalloc::report_summary s;
  const std::string page = ccalloc::render_report_html(t, {}, nullptr, &s);
  EXPECT_EQ(s.plot_points, 4u) << "never more slices than events";
  EXPECT_EQ(s.recorded_reserved_peak, 0u);
  EXPECT_EQ(count(page, "<polyline class=\"curve\""), 2u) << "no recording-allocator curve without segment events";
  EXPECT_NE(page.find(">event</text>"), std::string::npos);
  EXPECT_EQ(s.peak_event_index, 1u);
}

// ---- input that is no text trace, and the readers' limits ------------------------------

// What a file is when it is no text trace is named, at line 0.
TEST(TraceInput, NotATextTraceSaysWhatItLooksLike) {
  const std::string events = "1 alloc 4096 512 0\n2 free_requested 4096 512 0\n";
  std::string utf16 = "\xFF\xFE";
  for (const char c : events) utf16 += std::string{c, '\0'};
  temp_file u("u16.trace", utf16);
  EXPECT_EQ(error_of([&] { (void)ccalloc::read_trace_file(u.path()); }),
            u.path() + ": not a text trace: looks like UTF-16 text; convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)");
  temp_file bom("bom.trace", "\xEF\xBB\xBF" + events);
  EXPECT_EQ(error_of([&] { (void)ccalloc::read_trace_file(bom.path()); }),
            bom.path() + ": not a text trace as it is: it starts with a UTF-8 byte-order mark; remove it "
                         "(sed -i '1s/^\\xEF\\xBB\\xBF//' FILE)");
  temp_file junk("junk.bin", std::string("\x0f\x93\x01\x00zz 1 2 3\n", 11));
  EXPECT_EQ(error_of([&] { (void)ccalloc::read_trace_file(junk.path()); }),
            junk.path() + ": not a text trace: looks like binary data (byte 0x0f at offset 0)");
  temp_file xz("t.xz", "\xFD" "7zXZ\0\0\x04\xE6\xD6\xB4\x46");
  EXPECT_NE(error_of([&] { (void)ccalloc::read_trace_file(xz.path()); }).find("looks like xz data"), std::string::npos);
  for (const auto& [magic, name] : std::map<std::string, std::string>{{std::string("\x28\xB5\x2F\xFD", 4), "zstd"},
                                                                       {"BZh91AY&SY", "bzip2"},
                                                                       {std::string("\x04\x22\x4D\x18", 4), "lz4"},
                                                                       {std::string("7z\xBC\xAF\x27\x1C", 6), "7-Zip"},
                                                                       {std::string("\x1F\x9D\x90", 3), "compress (.Z)"}}) {
    temp_file c("c.bin", magic + "\x01\x02 rest\n");
    EXPECT_EQ(error_of([&] { (void)ccalloc::read_trace_file(c.path()); }),
              c.path() + ": not a text trace: looks like " + name +
                  " data; ccalloc reads plain text or gzip (decompress it first)");
  }
  // A pickle of a protocol the reader lacks, plain or in gzip: named with
  // its number, not read as text.
  temp_file p9("p9.pickle", std::string("\x80\x09\x95\x10\x00", 5));
  EXPECT_EQ(error_of([&] { (void)ccalloc::read_trace_file(p9.path()); }),
            p9.path() + ": not a text trace: looks like a pickle of protocol 9 (its first bytes are 0x80 0x09); "
                        "ccalloc reads PyTorch snapshot pickles of protocols 2 to 5");
  EXPECT_EQ(error_of([&] { (void)ccalloc::parse_trace_text(std::string("\x80\x01]q\x00", 5), "p1"); }),
            "p1: not a text trace: looks like a pickle of protocol 1 (its first bytes are 0x80 0x01); ccalloc reads "
            "PyTorch snapshot pickles of protocols 2 to 5");
  // gzip inside gzip: the decompressed text starts with the gzip magic.
  const std::string once = std::string("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", 10) + "rest";
  EXPECT_EQ(error_of([&] { (void)ccalloc::parse_trace_text(once, "twice.gz"); }),
            "twice.gz: not a text trace: looks like gzip data compressed twice (gzip data again after "
            "decompressing); decompress it once (gunzip) and read the result");
  // Plain text still reads, and a control character past the first line
  // gets the line's own message.
  EXPECT_EQ(ccalloc::parse_trace_text(events, "ok").events.size(), 2u);
  EXPECT_EQ(ccalloc::not_text_reason(events), "");
}

// /dev/zero never ends: it must fail on its first block, not read until
// memory runs out.
TEST(TraceInput, DevZeroFailsAtOnce) {
  if (!fs::exists("/dev/zero")) GTEST_SKIP() << "no /dev/zero";
  EXPECT_EQ(error_of([] { (void)ccalloc::read_trace_file("/dev/zero"); }),
            "/dev/zero: not a text trace: looks like binary data (byte 0x00 at offset 0)");
}

TEST(TraceInput, LimitsAreNamedWithTheFlagThatRaisesThem) {
  std::string text;
  for (int i = 0; i < 100; ++i) text += std::to_string(i) + " alloc " + std::to_string((i + 1) * 4096) + " 512 0\n";
  temp_file f("limits.trace", text);
  ccalloc::trace_limits limits;
  limits.max_events = 10;
  EXPECT_EQ(error_of([&] { (void)ccalloc::read_trace_file(f.path(), limits); }),
            f.path() + ":11: more than 10 events, the limit (trace_limits::max_events; raise it with --max-events)");
  limits = {};
  limits.max_input_bytes = 1000;
  EXPECT_EQ(error_of([&] { (void)ccalloc::read_trace_file(f.path(), limits); }),
            f.path() + ": larger than the input limit of 1000 bytes (trace_limits::max_input_bytes; raise it with "
                       "--max-input-bytes)");
  limits = {};
  limits.max_line_bytes = 100;
  EXPECT_EQ(error_of([&] { (void)ccalloc::parse_trace_text(text + "#" + std::string(200, 'x') + "\n", "long", limits); }),
            "long:101: a line of more than 100 bytes, the limit (trace_limits::max_line_bytes; raise it with "
            "--max-line-bytes)");
  // The same limits for an RMM log.
  std::string rmm = "Thread,Time,Action,Pointer,Size,Stream\n";
  for (int i = 0; i < 20; ++i) rmm += "1,10:00:00.000001,allocate,0x" + std::to_string(i + 1) + "000,8,0x0\n";
  limits = {};
  limits.max_events = 5;
  EXPECT_NE(error_of([&] { (void)ccalloc::parse_rmm_log(rmm, "r.csv", limits); }).find("r.csv:6: more than 5 events"),
            std::string::npos);
  // Under the limits, the same input reads.
  EXPECT_EQ(ccalloc::read_trace_file(f.path()).events.size(), 100u);
}

// Blanks around the fields count toward the line limit: an event line padded
// with spaces (after, before or between its fields) is no way around it, in
// a text trace file and in an RMM log.
TEST(TraceInput, BlanksAroundTheFieldsCountTowardTheLineLimit) {
  ccalloc::trace_limits limits;
  limits.max_line_bytes = 100;
  const std::string pad(200, ' ');
  const std::string reason =
      ": a line of more than 100 bytes, the limit (trace_limits::max_line_bytes; raise it with --max-line-bytes)";
  temp_file trailing("trailing.trace", "1 alloc 4096 512 0" + pad + "\n2 free_requested 4096 512 0\n");
  EXPECT_EQ(error_of([&] { (void)ccalloc::read_trace_file(trailing.path(), limits); }), trailing.path() + ":1" + reason);
  EXPECT_EQ(error_of([&] { (void)ccalloc::parse_trace_text("1 alloc 4096 512 0\n" + pad + "2 alloc 8192 8 0", "lead", limits); }),
            "lead:2" + reason);
  EXPECT_EQ(error_of([&] { (void)ccalloc::parse_trace_text("1 alloc" + pad + "4096 512 0\n", "mid", limits); }),
            "mid:1" + reason);
  // At the limit exactly it reads (the newline is not counted).
  const std::string exact = "1 alloc 4096 512 0";
  EXPECT_EQ(ccalloc::parse_trace_text(exact + std::string(100 - exact.size(), ' ') + "\n", "exact", limits).events.size(),
            1u);
  const std::string rmm = "Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000001,allocate,0x1000,8,0x0" + pad + "\n";
  EXPECT_EQ(error_of([&] { (void)ccalloc::parse_rmm_log(rmm, "r.csv", limits); }), "r.csv:2" + reason);
}

// A gzip bomb (a small file of newlines) stops at the input limit instead
// of ending in std::bad_alloc.
TEST(TraceInput, DecompressionStopsAtTheInputLimit) {
  temp_file plain("newlines.txt", std::string(4 << 20, '\n'));
  const std::string gz = plain.path() + ".gz";
  if (std::system(("gzip -kf '" + plain.path() + "' 2>/dev/null").c_str()) != 0) GTEST_SKIP() << "no gzip";
  ccalloc::trace_limits limits;
  limits.max_input_bytes = 1 << 20;
  const std::string why = error_of([&] { (void)ccalloc::read_trace_file(gz, limits); });
  std::remove(gz.c_str());
  EXPECT_EQ(why, gz + ": decompresses to more than 1048576 bytes, the input limit (trace_limits::max_input_bytes; "
                      "raise it with --max-input-bytes)");
}

TEST(RmmLog, DoubleFreeIsNamedAsSuch) {
  const std::string log =
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,10:00:00.000001,allocate,0x7f0000000000,4096,0x0\n"
      "1,10:00:00.000002,free,0x7f0000000000,4096,0x0\n"
      "1,10:00:00.000003,free,0x7f0000000000,4096,0x0\n"
      "1,10:00:00.000004,free,0x7f0000001000,4096,0x0\n";
  const ccalloc::trace t = ccalloc::parse_rmm_log(log, "df.csv");
  ASSERT_EQ(t.notes.size(), 2u);
  EXPECT_EQ(t.notes[0], "1 free(s) of pointers the log never allocated were skipped (the log started after them)");
  EXPECT_EQ(t.notes[1],
            "1 double free(s) were skipped: pointers freed again without an allocate between (the first: line 4 "
            "frees 0x7f0000000000, already freed at line 3)");
}

TEST(MinDeviceMemory, AFractionOfZeroIsNamed) {
  const ccalloc::trace t = ccalloc::parse_trace_text("1 alloc 4096 512 0\n2 free_requested 4096 512 0\n", "f0");
  ccalloc::replay_options o;
  o.config = "per_process_memory_fraction:0";
  try {
    (void)ccalloc::find_min_device_memory(t, o);
    FAIL() << "no error";
  } catch (const ccalloc::error& e) {
    EXPECT_NE(std::string(e.what()).find("per_process_memory_fraction:0 lets ccalloc use none of any device"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace

// ---- memory while reading ----------------------------------------------------------------

namespace {

using ccalloc::testing::MiB;
using ccalloc::testing::peak_rss_growth;
using ccalloc::testing::reset_peak_rss;

/// `text` gzipped by the gzip program, or "" without one.
std::string gzip_of(const std::string& name, const std::string& text) {
  temp_file plain(name, text);
  const std::string gz = plain.path() + ".gz";
  if (std::system(("gzip -kf '" + plain.path() + "' 2>/dev/null").c_str()) != 0) return "";
  std::ifstream in(gz, std::ios::binary);
  std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(gz.c_str());
  return out;
}

}  // namespace

// A gzip bomb (64 MiB of newlines in 64 gzip members of 1 MiB each, 65 KB)
// is read a block at a time: memory stays far below the text's size.
TEST(TraceInput, GzipBombIsReadInBoundedMemory) {
  const std::string member = gzip_of("nl1m.txt", std::string(MiB, '\n'));
  if (member.empty()) GTEST_SKIP() << "no gzip";
  std::string bomb;
  for (int i = 0; i < 64; ++i) bomb += member;
  temp_file gz("bomb.gz", bomb);
  if (!reset_peak_rss()) GTEST_SKIP() << "no peak resident size (clear_refs, or ASan)";
  std::size_t events = 1;
  const std::uint64_t growth = peak_rss_growth([&] { events = ccalloc::read_trace_file(gz.path()).events.size(); });
  EXPECT_EQ(events, 0u);
  EXPECT_LT(growth, 16 * MiB) << "the reader held the decompressed text";
  // Over the limit it fails naming it, having held no more.
  ccalloc::trace_limits limits;
  limits.max_input_bytes = 32 * MiB;
  ASSERT_TRUE(reset_peak_rss());
  std::string why;
  const std::uint64_t over = peak_rss_growth([&] { why = error_of([&] { (void)ccalloc::read_trace_file(gz.path(), limits); }); });
  EXPECT_EQ(why, gz.path() + ": decompresses to more than 33554432 bytes, the input limit "
                             "(trace_limits::max_input_bytes; raise it with --max-input-bytes)");
  EXPECT_LT(over, 8 * MiB);
}

// One huge line (plain or gzip) fails at the line limit once that many of
// its bytes are read, not after reading the whole file.
TEST(TraceInput, HugeLineFailsWithoutReadingItWhole) {
  const std::string line = "1 alloc " + std::string(16 * MiB, '7') + " 512 0\n";
  temp_file plain("hugeline.trace", line);
  const std::string limit_error = ":1: a line of more than 65536 bytes, the limit (trace_limits::max_line_bytes; "
                                  "raise it with --max-line-bytes)";
  if (!reset_peak_rss()) GTEST_SKIP() << "no peak resident size (clear_refs, or ASan)";
  std::string why;
  std::uint64_t growth = peak_rss_growth([&] { why = error_of([&] { (void)ccalloc::read_trace_file(plain.path()); }); });
  EXPECT_EQ(why, plain.path() + limit_error);
  EXPECT_LT(growth, 8 * MiB) << "the reader held the whole line";
  const std::string compressed = gzip_of("hugeline.txt", line);
  if (compressed.empty()) GTEST_SKIP() << "no gzip";
  temp_file gz("hugeline.trace.gz", compressed);
  ASSERT_TRUE(reset_peak_rss());
  growth = peak_rss_growth([&] { why = error_of([&] { (void)ccalloc::read_trace_file(gz.path()); }); });
  EXPECT_EQ(why, gz.path() + limit_error);
  EXPECT_LT(growth, 8 * MiB) << "the reader held the whole line";
  // A long line within a raised limit reads; the line after it keeps its number.
  ccalloc::trace_limits limits;
  limits.max_line_bytes = 3 * MiB;
  temp_file ok("longcomment.trace", "#" + std::string(2 * MiB + 5, 'c') + "\n1 alloc 4096 512 0\n2 bogus 1 1 0\n");
  EXPECT_EQ(error_of([&] { (void)ccalloc::read_trace_file(ok.path(), limits); }),
            ok.path() + ":3: unknown action 'bogus' (accepted: alloc, free_requested, free_completed, segment_alloc, "
                        "segment_free, segment_map, segment_unmap, snapshot, oom, tag, pause, resume)");
}

// ---- frees of another size -----------------------------------------------------------------

// PyTorch and RMM record a free with the size of its allocation: another
// size is a corrupt trace, named with its line, address and both sizes.
TEST(FreeSize, ATextTraceFreeOfAnotherSizeIsAnError) {
  const auto replay_error = [](const std::string& text) {
    return error_of([&] { (void)ccalloc::replay_trace(ccalloc::parse_trace_text(text, "fs"), {}); });
  };
  EXPECT_EQ(replay_error("1 alloc 4096 512 0\n2 alloc 8192 100 0\n3 free_requested 4096 1024 0\n"
                         "4 free_completed 4096 1024 0\n"),
            "fs:3: free_requested of address 4096 with size 1024, but its alloc (line 1) has size 512");
  EXPECT_EQ(replay_error("1 alloc 4096 512 0\n2 free_requested 4096 512 0\n3 alloc 8192 8 0\n"
                         "4 free_completed 4096 511 0\n"),
            "fs:4: free_completed of address 4096 with size 511, but its free_requested (line 2) has size 512");
  // Matching sizes replay; an address reused with another size is no mismatch.
  EXPECT_EQ(replay_error("1 alloc 4096 512 0\n2 free_requested 4096 512 0\n3 free_completed 4096 512 0\n"
                         "4 alloc 4096 64 0\n5 free_requested 4096 64 0\n6 free_completed 4096 64 0\n"),
            "");
}

// PyTorch records free_requested and free_completed on the block's stream
// (the one it was allocated on; a record_stream'ed block's other streams
// only delay free_completed): a free on another stream is a corrupt trace.
TEST(FreeStream, ATextTraceFreeOnAnotherStreamIsAnError) {
  const auto replay_error = [](const std::string& text) {
    return error_of([&] { (void)ccalloc::replay_trace(ccalloc::parse_trace_text(text, "fs"), {}); });
  };
  EXPECT_EQ(replay_error("1 alloc 4096 512 7\n2 free_requested 4096 512 7\n3 alloc 8192 8 0\n"
                         "4 free_completed 4096 512 9\n"),
            "fs:4: free_completed of address 4096 on stream 9, but its free_requested (line 2) is on stream 7 (a free "
            "is recorded on its block's stream, the one it was allocated on)");
  EXPECT_EQ(replay_error("1 alloc 4096 512 7\n2 free_requested 4096 512 0\n3 free_completed 4096 512 0\n"),
            "fs:2: free_requested of address 4096 on stream 0, but its alloc (line 1) is on stream 7 (a free is "
            "recorded on its block's stream, the one it was allocated on)");
  // A record_stream gap on the block's own stream replays.
  EXPECT_EQ(replay_error("1 alloc 4096 512 7\n2 free_requested 4096 512 7\n3 alloc 8192 8 0\n"
                         "4 free_completed 4096 512 7\n"),
            "");
}

// An allocator hands out disjoint blocks: an alloc overlapping a live one
// (above or below it) is refused naming both (was replayed silently). Ends
// that touch, a range freed but not completed, and 0 bytes are no overlap;
// the same address is the event loop's "still live" error.
TEST(LiveRanges, AnAllocOverlappingALiveOneIsAnError) {
  const auto replay_error = [](const std::string& text) {
    return error_of([&] { (void)ccalloc::replay_trace(ccalloc::parse_trace_text(text, "ov"), {}); });
  };
  EXPECT_EQ(replay_error("1 alloc 4096 512 0\n2 alloc 8192 100 0\n3 alloc 4352 512 0\n"),
            "ov:3: alloc of 512 bytes at address 4352 overlaps the live allocation of 512 bytes at address 4096 "
            "(allocated at line 1, not freed since): an allocator hands out disjoint blocks");
  EXPECT_EQ(replay_error("1 alloc 4096 512 0\n2 alloc 2048 2049 0\n"),
            "ov:2: alloc of 2049 bytes at address 2048 overlaps the live allocation of 512 bytes at address 4096 "
            "(allocated at line 1, not freed since): an allocator hands out disjoint blocks");
  EXPECT_EQ(replay_error("1 alloc 4096 512 0\n2 alloc 0 18446744073709551615 0\n"),
            "ov:2: alloc of 18446744073709551615 bytes at address 0 overlaps the live allocation of 512 bytes at "
            "address 4096 (allocated at line 1, not freed since): an allocator hands out disjoint blocks");
  EXPECT_EQ(replay_error("1 alloc 4096 512 0\n2 alloc 3584 512 0\n3 alloc 4608 512 0\n4 alloc 4200 0 0\n"
                         "5 free_requested 4096 512 0\n6 alloc 4100 16 0\n7 free_requested 4100 16 0\n"
                         "8 free_completed 4100 16 0\n9 free_completed 4096 512 0\n"),
            "")
      << "touching ends, 0 bytes, and a freed range (its free_completed still to come) are no overlap";
  EXPECT_EQ(replay_error("1 alloc 4096 512 0\n2 alloc 4096 64 0\n"),
            "ov:2: alloc at address 4096, which is still live (allocated at line 1)");
}

// A range past 2^64 is refused (the recording's figures, sums of segment
// sizes, wrapped: a reserved peak of 2 MiB was printed for this trace).
TEST(LiveRanges, ARangePastTheAddressSpaceIsAnError) {
  const auto replay_error = [](const std::string& text) {
    return error_of([&] { (void)ccalloc::replay_trace(ccalloc::parse_trace_text(text, "as"), {}); });
  };
  EXPECT_EQ(replay_error("1 segment_alloc 6000000000 2097152 0\n2 alloc 6000000000 4096 0\n"
                         "3 segment_map 7000000000 18446744073709551615 0\n"),
            "as:3: segment_map of 18446744073709551615 bytes at address 7000000000 passes the end of the 64-bit "
            "address space");
  EXPECT_EQ(replay_error("1 alloc 18446744073709547520 8192 0\n"),
            "as:1: alloc of 8192 bytes at address 18446744073709547520 passes the end of the 64-bit address space");
  EXPECT_EQ(replay_error("1 alloc 18446744073709547520 4096 0\n2 free_requested 18446744073709547520 4096 0\n"
                         "3 free_completed 18446744073709547520 4096 0\n"),
            "")
      << "a range that ends at 2^64 fits";
}

// The recording allocator's segment events must describe segments and pages
// a program could have had: each refused at its line before the replay
// (the recorded reserved figures would count bytes twice or go negative).
TEST(RecordedSegments, ImpossibleSegmentEventsAreErrors) {
  const auto replay_error = [](const std::string& text) {
    return error_of([&] { (void)ccalloc::replay_trace(ccalloc::parse_trace_text(text, "rs"), {}); });
  };
  const std::string alloc = "1 alloc 6000000000 4096 0\n";
  const auto overlaps = [](const std::string& addr) {  // line 3's segment_alloc meets line 2's
    return "rs:3: segment_alloc of 2097152 bytes at address " + addr +
           " overlaps the live segment of 2097152 bytes at address 8000000000 (segment_alloc at line 2, no "
           "segment_free since): its bytes would be reserved twice";
  };
  const auto not_mapped = [](int line, const std::string& size, const std::string& addr, const std::string& from) {
    return "rs:" + std::to_string(line) + ": segment_unmap of " + size + " bytes at address " + addr +
           " unmaps bytes that are not mapped, from address " + from +
           " (no segment_map covers them, or they were unmapped since): an unmap covers mapped pages only";
  };
  EXPECT_EQ(replay_error(alloc + "2 segment_alloc 8000000000 2097152 0\n3 segment_alloc 8000000000 2097152 0\n"),
            overlaps("8000000000"));
  EXPECT_EQ(replay_error(alloc + "2 segment_alloc 8000000000 2097152 0\n3 segment_alloc 8001048576 2097152 0\n"),
            overlaps("8001048576"));
  EXPECT_EQ(replay_error(alloc + "2 segment_free 8000000000 2097152 0\n"),
            "rs:2: segment_free of 2097152 bytes at address 8000000000: no segment was allocated at this address "
            "(no segment_alloc of it before; a trace that starts after the segment was allocated begins with its "
            "segment_alloc, as the snapshot converters write it)");
  EXPECT_EQ(replay_error(alloc + "2 segment_alloc 8000000000 2097152 0\n3 segment_free 8000000000 2097152 0\n"
                                 "4 segment_free 8000000000 2097152 0\n"),
            "rs:4: segment_free of 2097152 bytes at address 8000000000: the segment at this address was already "
            "freed at line 3 (no segment_alloc since)");
  EXPECT_EQ(replay_error(alloc + "2 segment_alloc 8000000000 2097152 0\n3 segment_free 8000000000 4194304 0\n"),
            "rs:3: segment_free of 4194304 bytes at address 8000000000, but its segment_alloc (line 2) has 2097152 "
            "bytes (a segment is freed whole)");
  EXPECT_EQ(replay_error(alloc + "2 segment_map 8000000000 2097152 0\n3 segment_unmap 8000000000 4194304 0\n"),
            not_mapped(3, "4194304", "8000000000", "8002097152"));
  EXPECT_EQ(replay_error(alloc + "2 segment_map 8000000000 2097152 0\n3 segment_unmap 9000000000 2097152 0\n"),
            not_mapped(3, "2097152", "9000000000", "9000000000"));
  EXPECT_EQ(replay_error(alloc + "2 segment_map 8000000000 4194304 0\n3 segment_unmap 8000000000 2097152 0\n"
                                 "4 segment_unmap 8000000000 2097152 0\n"),
            not_mapped(4, "2097152", "8000000000", "8000000000"));
  EXPECT_EQ(replay_error(alloc + "2 segment_map 8000000000 4194304 0\n3 segment_map 8002097152 4194304 0\n"),
            "rs:3: segment_map of 4194304 bytes at address 8002097152 maps bytes already mapped: those of the "
            "segment_map at line 2 from address 8002097152 (no segment_unmap of them between)");

  // What PyTorch and ccalloc record: an unmap across pages of several maps,
  // part of a map unmapped and mapped again, a segment freed and allocated
  // again at its address, segments that touch.
  EXPECT_EQ(replay_error(alloc + "2 segment_map 8000000000 2097152 0\n3 segment_map 8002097152 2097152 0\n"
                                 "4 segment_unmap 8001048576 2097152 0\n5 segment_map 8001048576 1048576 0\n"
                                 "6 segment_unmap 8000000000 4194304 0\n"
                                 "7 segment_alloc 9000000000 2097152 0\n8 segment_alloc 9002097152 2097152 0\n"
                                 "9 segment_free 9000000000 2097152 0\n10 segment_alloc 9000000000 2097152 0\n"),
            not_mapped(6, "4194304", "8000000000", "8002097152"));
  EXPECT_EQ(replay_error(alloc + "2 segment_map 8000000000 2097152 0\n3 segment_map 8002097152 2097152 0\n"
                                 "4 segment_unmap 8001048576 2097152 0\n5 segment_map 8001048576 2097152 0\n"
                                 "6 segment_unmap 8000000000 4194304 0\n"
                                 "7 segment_alloc 9000000000 2097152 0\n8 segment_alloc 9002097152 2097152 0\n"
                                 "9 segment_free 9000000000 2097152 0\n10 segment_alloc 9000000000 2097152 0\n"),
            "");

  // A trace that opens with segment_map lines (converted from a snapshot
  // taken mid-run): pages the trace has not touched since may be mapped;
  // those it unmapped may not be unmapped again.
  const std::string opening = "1 segment_map 8000000000 2097152 0\n2 alloc 6000000000 4096 0\n";
  EXPECT_EQ(replay_error(opening + "3 segment_map 8000000000 2097152 0\n4 segment_unmap 8004194304 2097152 0\n"),
            "");
  EXPECT_EQ(replay_error(opening + "3 segment_unmap 8004194304 2097152 0\n4 segment_unmap 8004194304 2097152 0\n"),
            "rs:4: segment_unmap of 2097152 bytes at address 8004194304 unmaps bytes the segment_unmap at line 3 "
            "unmapped, from address 8004194304 (no segment_map of them between)");
  EXPECT_EQ(replay_error(opening + "3 segment_map 8004194304 2097152 0\n4 segment_map 8004194304 2097152 0\n"),
            "rs:4: segment_map of 2097152 bytes at address 8004194304 maps bytes already mapped: those of the "
            "segment_map at line 3 from address 8004194304 (no segment_unmap of them between)");
}

TEST(FreeSize, AnRmmFreeOfAnotherSizeIsAnError) {
  const std::string log =
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,10:00:00.000001,allocate,0x7f0000000000,4096,0x0\n"
      "1,10:00:00.000002,free,0x7f0000000000,4096,0x0\n"
      "1,10:00:00.000003,allocate,0x7f0000000000,2048,0x0\n"
      "1,10:00:00.000004,free,0x7f0000000000,4096,0x0\n";
  EXPECT_EQ(error_of([&] { (void)ccalloc::parse_rmm_log(log, "fs.csv"); }),
            "fs.csv:5: free of Pointer 0x7f0000000000 with Size 4096, but its allocate (line 4) has Size 2048");
  EXPECT_EQ(ccalloc::parse_rmm_log(log.substr(0, log.rfind("1,10")), "fs.csv").events.size(), 4u);
}

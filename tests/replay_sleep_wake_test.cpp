// Traces with tags, pauses and resumes (docs/trace-format.md, "Tags, pause
// and resume"): reading their lines, recording them (trace_writer),
// replaying them, and the bundled RL-style trace recorded from
// examples/sleep_wake_loop.cpp.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/tags.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/report.hpp>
#include <ccalloc/replay/trace.hpp>
#include <ccalloc/replay/trace_writer.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: test file

constexpr std::uint64_t MiB = mib;

replay_options on_device_of(std::size_t bytes) {
  replay_options o;
  o.device_memory_bytes = bytes;
  return o;
}

// A caching allocator on one simulated device of `capacity_bytes`, initialized.
std::unique_ptr<caching_allocator> simulated_allocator(std::size_t capacity_bytes) {
  sim_options so;
  so.capacity_bytes = capacity_bytes;
  auto a = std::make_unique<caching_allocator>(std::make_shared<sim_backend>(so), allocator_config{});
  a->init(1);
  return a;
}

TEST(SleepWakeTrace, ReadsTagPauseAndResumeLines) {
  const trace t = parse_trace_text(
      "# time_us action addr size stream [tag [keep|drop]]\n"
      "1 tag 0 0 0 weights\n"
      "2 alloc 4096 100 0\n"
      "3 tag 0 0 0 default\n"
      "4 pause 0 2097152 0 weights keep\n"
      "5 pause 0 0 0 kv.cache/1 drop\n"
      "6 resume 0 2097152 0 weights\n",
      "t");
  ASSERT_EQ(t.events.size(), 6u);
  EXPECT_EQ(t.tags, (std::vector<std::string>{"weights", "kv.cache/1"}));
  EXPECT_EQ(t.events[0].action, trace_action::tag);
  EXPECT_EQ(t.events[0].tag, 1);
  EXPECT_EQ(t.events[1].action, trace_action::alloc);
  EXPECT_EQ(t.events[2].tag, 0) << "default is tag 0";
  EXPECT_EQ(t.events[3].action, trace_action::pause);
  EXPECT_TRUE(t.events[3].keep_contents);
  EXPECT_EQ(t.events[3].size, 2097152u);
  EXPECT_EQ(t.events[3].line, 5u);
  EXPECT_EQ(t.events[4].tag, 2);
  EXPECT_FALSE(t.events[4].keep_contents);
  EXPECT_EQ(t.events[5].action, trace_action::resume);
  EXPECT_EQ(t.events[5].tag, 1);
  EXPECT_EQ(to_string(trace_action::pause), "pause");
}

TEST(SleepWakeTrace, MalformedTagLinesNameTheLineAndTheFault) {
  const auto error_of = [](const std::string& text) {
    try {
      (void)parse_trace_text(text, "t");
    } catch (const trace_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of("1 alloc 0 1 0\n2 pause 0 0 0 w\n"),
            "t:2: pause needs 7 fields (time_us pause addr size stream tag keep|drop), got 6");
  EXPECT_EQ(error_of("1 tag 0 0 0\n"), "t:1: tag needs 6 fields (time_us action addr size stream tag), got 5");
  EXPECT_EQ(error_of("1 resume 0 0 0 w x\n"),
            "t:1: resume needs 6 fields (time_us action addr size stream tag), got 7");
  EXPECT_EQ(error_of("1 pause 0 0 0 w maybe\n"), "t:1: bad keep|drop 'maybe': pause ends with keep or drop");
  EXPECT_EQ(error_of("1 tag 0 0 0 we!ghts\n"),
            "t:1: bad tag 'we!ghts': a tag name is 1 to 64 ASCII letters, digits and the characters _-.:/");
  EXPECT_EQ(error_of("1 tag x 0 0 w\n"), "t:1: bad addr 'x': not an unsigned integer");
  // The columns a line leaves unused are 0 (trace_writer writes 0).
  EXPECT_EQ(error_of("1 tag 5 0 0 w\n"), "t:1: bad addr '5': a tag line has addr, size and stream 0 (unused)");
  EXPECT_EQ(error_of("1 tag 0 4096 0 w\n"), "t:1: bad size '4096': a tag line has addr, size and stream 0 (unused)");
  EXPECT_EQ(error_of("1 tag 0 0 7 w\n"), "t:1: bad stream '7': a tag line has addr, size and stream 0 (unused)");
  EXPECT_EQ(error_of("1 pause 4096 0 0 w keep\n"),
            "t:1: bad addr '4096': a pause line has addr and stream 0 (unused; size holds its bytes)");
  EXPECT_EQ(error_of("1 resume 0 2097152 3 w\n"),
            "t:1: bad stream '3': a resume line has addr and stream 0 (unused; size holds its bytes)");
  EXPECT_EQ(error_of("1 pause 0 2097152 0 w keep\n2 resume 0 2097152 0 w\n"), "no error");
  // The five-column actions keep their messages.
  EXPECT_EQ(error_of("1 alloc 0 1 0 w\n"), "t:1: expected 5 fields (time_us action addr size stream), got 6");
}

// A trace whose tag lines all name the default tag replays to the figures
// of the same trace without them: tag lines change only the tag.
TEST(SleepWakeTrace, DefaultTagLinesChangeNoFigure) {
  std::string plain, tagged;
  for (int i = 0; i < 40; ++i) {
    const std::string addr = std::to_string((i % 7 + 1) * 64 * MiB);
    const std::string size = std::to_string((i * 37 % 11 + 1) * 300000);
    const std::string t = std::to_string(10 * i);
    const std::string lines = t + " alloc " + addr + " " + size + " 0\n" + t + " free_requested " + addr + " " +
                              size + " 0\n" + t + " free_completed " + addr + " " + size + " 0\n";
    plain += lines;
    tagged += t + " tag 0 0 0 default\n" + lines;
  }
  const replay_result a = replay_trace(parse_trace_text(plain, "plain"), on_device_of(1024 * MiB));
  const replay_result b = replay_trace(parse_trace_text(tagged, "tagged"), on_device_of(1024 * MiB));
  EXPECT_EQ(a.peak_reserved_bytes, b.peak_reserved_bytes);
  EXPECT_EQ(a.device_mallocs, b.device_mallocs);
  EXPECT_EQ(a.pages_mapped, b.pages_mapped);
  EXPECT_TRUE(b.sleep_events.empty());
  EXPECT_EQ(b.peak_paused_bytes, 0u);
}

// A program recorded with trace_writer replays to its own figures: what
// each pause paused, the peak of paused bytes, peak reserved.
TEST(SleepWakeTrace, RecordedProgramReplaysToItsOwnFigures) {
  const auto allocator = simulated_allocator(512 * MiB);
  caching_allocator& a = *allocator;
  trace_writer writer(a, 0);
  std::vector<void*> kept, dropped;
  {
    tag_scope w("rw_weights");
    for (int i = 0; i < 6; ++i) kept.push_back(a.malloc(0, 5 * MiB + 1000, default_stream));
  }
  {
    tag_scope k("rw_kv");
    for (int i = 0; i < 4; ++i) dropped.push_back(a.malloc(0, 9 * MiB, default_stream));
  }
  void* temp = a.malloc(0, 3 * MiB, default_stream);
  std::vector<std::size_t> paused;
  paused.push_back(a.pause({"rw_weights"}, true).paused_bytes);
  paused.push_back(a.pause({"rw_kv"}, false).paused_bytes);
  a.free(temp);
  paused.push_back(a.resume({"rw_kv"}).paused_bytes);
  paused.push_back(a.resume({"rw_weights"}).paused_bytes);
  const auto peak_reserved = static_cast<std::uint64_t>(a.get_device_stats(0).reserved_bytes[0].peak);
  const std::string text = writer.text();
  for (void* p : kept) a.free(p);
  for (void* p : dropped) a.free(p);

  const trace t = parse_trace_text(text, "recorded");
  const replay_result r = replay_trace(t, on_device_of(512 * MiB));
  ASSERT_EQ(r.sleep_events.size(), 4u) << text;
  EXPECT_TRUE(r.sleep_events[0].pause && r.sleep_events[0].keep_contents);
  EXPECT_TRUE(r.sleep_events[1].pause && !r.sleep_events[1].keep_contents);
  EXPECT_EQ(r.sleep_events[2].tag, "rw_kv");
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(r.sleep_events[i].paused_bytes, paused[i]) << i;
    EXPECT_EQ(r.sleep_events[i].recorded_bytes, paused[i]) << i;
  }
  EXPECT_EQ(r.sleep_events[0].copied_bytes, paused[0]) << "kept contents are copied";
  EXPECT_EQ(r.peak_paused_bytes, paused[0] + paused[1]);
  EXPECT_EQ(r.sleep_events[1].paused_total_bytes, paused[0] + paused[1]);
  EXPECT_EQ(r.sleep_events[3].paused_total_bytes, 0u);
  EXPECT_EQ(r.peak_reserved_bytes, peak_reserved);
  EXPECT_EQ(r.ooms, 0u);
}

// The replay itself keeps the peak of bytes allocated to unpaused blocks
// (the fragmentation's denominator with pauses), so every caller of
// replay_trace has it: replay, compare, --min-memory and the report.
TEST(SleepWakeTrace, TheReplayKeepsThePeakOfUnpausedAllocatedBytes) {
  // 64 MiB under t1, 32 MiB under default (96 MiB unpaused), t1 paused,
  // 96 MiB more (128 MiB unpaused, 192 MiB requested).
  const std::string text =
      "1 tag 0 0 0 t1\n"
      "2 alloc 1073741824 67108864 0\n"
      "3 tag 0 0 0 default\n"
      "4 alloc 2147483648 33554432 0\n"
      "5 pause 0 67108864 0 t1 drop\n"
      "6 alloc 3221225472 100663296 0\n";
  const trace t = parse_trace_text(text, "unpaused");
  replay_options o = on_device_of(1024 * MiB);
  const replay_result r = replay_trace(t, o);
  EXPECT_EQ(r.peak_requested_bytes, 192 * MiB);
  EXPECT_EQ(r.peak_unpaused_allocated_bytes, 128 * MiB);
  EXPECT_EQ(r.peak_reserved_bytes, 128 * MiB);
  EXPECT_DOUBLE_EQ(shown_fragmentation(r), 1.0);
  EXPECT_DOUBLE_EQ(r.fragmentation(), 128.0 / 192.0);
  o.repeat = 2;  // the second pass starts with t1 resumed: 64 + 32 + 96 MiB before its pause
  EXPECT_EQ(replay_trace(t, o).peak_unpaused_allocated_bytes, 192 * MiB);
  o.repeat = 1;
  o.use_gates_on_sim = true;  // the driver of replay --device cuda
  EXPECT_EQ(replay_trace(t, o).peak_unpaused_allocated_bytes, 128 * MiB);
  // A trace without pauses: 0, and the fragmentation is over requested.
  const replay_result plain = replay_trace(parse_trace_text("1 alloc 4096 1048576 0\n", "plain"), {});
  EXPECT_EQ(plain.peak_unpaused_allocated_bytes, 0u);
  EXPECT_DOUBLE_EQ(shown_fragmentation(plain), plain.fragmentation());
}

TEST(SleepWakeTrace, AnAllocationUnderAPausedTagFailsNamingItsLine) {
  const trace t = parse_trace_text(
      "1 tag 0 0 0 rw_paused\n"
      "2 alloc 4194304 1000 0\n"
      "3 pause 0 2097152 0 rw_paused drop\n"
      "4 alloc 8388608 1000 0\n",
      "t");
  try {
    (void)replay_trace(t, on_device_of(256 * MiB));
    FAIL() << "replayed an allocation under a paused tag";
  } catch (const trace_error& e) {
    EXPECT_EQ(e.line, 4u);
    // The file and line, then the allocator's reason without its own
    // "ccalloc: " (the CLI says it once, before the file).
    EXPECT_EQ(std::string(e.what()),
              "t:4: malloc of 1000 bytes under tag 'rw_paused' on device 0: the tag is paused; resume it first (or "
              "allocate under another tag)");
  }
}

// A resume of a tag the trace has not paused, and a second pause of a
// paused one, are errors naming the line and the tag (the allocator would
// do nothing, and its recorder writes no such line).
TEST(SleepWakeTrace, AResumeOfAnUnpausedTagAndASecondPauseAreErrors) {
  const auto error_of = [](const std::string& text) -> std::string {
    try {
      (void)replay_trace(parse_trace_text(text, "t"), on_device_of(256 * MiB));
    } catch (const trace_error& e) {
      return e.what();
    }
    return "no error";
  };
  const std::string alloc = "1 tag 0 0 0 po_kv\n2 alloc 4194304 1000 0\n3 tag 0 0 0 default\n";
  EXPECT_EQ(error_of(alloc + "4 resume 0 0 0 po_kv\n"),
            "t:4: resume of tag 'po_kv', which the trace has not paused (no pause of it before, or already resumed)");
  EXPECT_EQ(error_of("1 resume 0 0 0 po_never_used\n"),
            "t:1: resume of tag 'po_never_used', which the trace has not paused (no pause of it before, or already "
            "resumed)");
  EXPECT_EQ(error_of(alloc + "4 pause 0 2097152 0 po_kv drop\n5 resume 0 2097152 0 po_kv\n6 resume 0 0 0 po_kv\n"),
            "t:6: resume of tag 'po_kv', which the trace has not paused (no pause of it before, or already resumed)");
  EXPECT_EQ(error_of(alloc + "4 pause 0 2097152 0 po_kv drop\n5 pause 0 0 0 po_kv keep\n"),
            "t:5: pause of tag 'po_kv', which the trace already paused at line 4 (no resume between)");
  // Paired, the same lines replay.
  const replay_result r = replay_trace(
      parse_trace_text(alloc + "4 pause 0 2097152 0 po_kv drop\n5 resume 0 2097152 0 po_kv\n"
                               "6 pause 0 2097152 0 po_kv keep\n7 resume 0 2097152 0 po_kv\n",
                       "t"),
      on_device_of(256 * MiB));
  EXPECT_EQ(r.sleep_events.size(), 4u);
  EXPECT_EQ(r.ooms, 0u);
}

// The library pauses a tag a program named (a tag_scope) but never
// allocated under: nothing to release, and its recorder writes the pause,
// with no tag line before it (tag lines come before allocations). So the
// replay accepts a pause of a tag no line named, as the library does. A
// resume of a tag not paused changes nothing in the library and is not
// recorded, so a resume line of a tag the trace has not paused comes from
// no program: refused (AResumeOfAnUnpausedTagAndASecondPauseAreErrors).
TEST(SleepWakeTrace, APauseOfATagNoLineNamedIsWhatTheLibraryRecords) {
  const auto allocator = simulated_allocator(256 * MiB);
  caching_allocator& a = *allocator;
  trace_writer writer(a, 0);
  { const tag_scope named("pn_named_only"); }
  void* p = a.malloc(0, 1000, default_stream);
  const sleep_result paused = a.pause({"pn_named_only"}, false);
  EXPECT_EQ(paused.tags, std::vector<std::string>{"pn_named_only"});
  EXPECT_EQ(paused.paused_bytes, 0u);
  (void)a.resume({"pn_named_only"});
  const sleep_result again = a.resume({"pn_named_only"});  // not paused: left alone, nothing recorded
  EXPECT_TRUE(again.tags.empty());
  a.free(p);
  const std::string text = writer.text();
  EXPECT_EQ(text.find(" tag "), std::string::npos) << text;
  EXPECT_NE(text.find(" pause 0 0 0 pn_named_only drop\n"), std::string::npos) << text;
  const auto resume_at = text.find(" resume 0 0 0 pn_named_only\n");
  EXPECT_NE(resume_at, std::string::npos) << text;
  EXPECT_EQ(text.find(" resume ", resume_at + 1), std::string::npos) << "the second resume is not recorded:\n" << text;
  const replay_result r = replay_trace(parse_trace_text(text, "recorded"), on_device_of(256 * MiB));
  ASSERT_EQ(r.sleep_events.size(), 2u);
  EXPECT_TRUE(r.sleep_events[0].pause);
  EXPECT_EQ(r.sleep_events[0].tag, "pn_named_only");
  EXPECT_EQ(r.sleep_events[0].paused_bytes, 0u);
  // A name no scope ever used is unknown to the library, for pause and resume alike.
  try {
    (void)a.pause({"pn_never_named_anywhere"}, false);
    ADD_FAILURE() << "paused an unknown tag";
  } catch (const invalid_argument_error& e) {
    EXPECT_EQ(std::string(e.what()), "ccalloc: pause: no tag named 'pn_never_named_anywhere' (unknown tag)");
  }
}

// The report page draws paused bytes over time and lists every pause and
// resume; a trace without them gets neither.
TEST(SleepWakeTrace, TheReportShowsPausedBytesOverTimeAndEveryPause) {
  const std::string plain_text =
      "2 alloc 4194304 5000000 0\n"
      "4 alloc 16777216 9000000 0\n"
      "6 alloc 33554432 100 0\n"
      "9 free_requested 33554432 100 0\n"
      "10 free_completed 33554432 100 0\n";
  const trace tagged = parse_trace_text(
      "1 tag 0 0 0 rp_weights\n"
      "2 alloc 4194304 5000000 0\n"
      "3 tag 0 0 0 rp_kv\n"
      "4 alloc 16777216 9000000 0\n"
      "5 tag 0 0 0 default\n"
      "6 alloc 33554432 100 0\n"
      "9 free_requested 33554432 100 0\n"
      "10 free_completed 33554432 100 0\n"
      "11 pause 0 6291456 0 rp_weights keep\n"
      "12 pause 0 10485760 0 rp_kv drop\n"
      "13 resume 0 10485760 0 rp_kv\n",
      "tagged");
  report_options o;
  o.device_memory_bytes = 256 * MiB;
  report_summary sum;
  const std::string page = render_report_html(tagged, o, nullptr, &sum);
  EXPECT_EQ(sum.replay.sleep_events.size(), 3u);
  EXPECT_EQ(sum.replay.peak_paused_bytes, 16 * MiB);
  EXPECT_NE(page.find("<h2>Sleep and wake</h2>"), std::string::npos);
  EXPECT_NE(page.find("paused (all tags)"), std::string::npos);
  EXPECT_NE(page.find("\"paused\":["), std::string::npos);
  EXPECT_NE(page.find("pause (keep)"), std::string::npos);
  const std::string plain = render_report_html(parse_trace_text(plain_text, "plain"), o, nullptr);
  EXPECT_EQ(plain.find("Sleep and wake"), std::string::npos);
  EXPECT_EQ(plain.find("\"paused\""), std::string::npos);
}

// data/traces/sleep_wake/rl_sleep_wake.trace.gz: `ccalloc_sleep_wake_loop --rounds 2
// --trace FILE` (then gzip -9n), on the simulated device of 1 GiB: the
// first round, which allocates the weights, KV cache and optimizer state,
// and one round as every later one runs. The program printed:
//   paused_MiB after each phase's pauses: 512 640 640 640
//   replay figures: peak_reserved_bytes=603979776 device_mallocs=1056
//                   peak_paused_bytes=671088640 pauses=8
// The replay is deterministic: the same figures, exactly. (Rerecord the
// trace and these figures together when the allocator's policy changes.)
// About 2.5 s: the simulated memory's host pages and the kept contents'
// copies (640 MiB a round).
TEST(SleepWakeTrace, BundledRlTraceReplaysToTheFiguresTheProgramPrinted) {
  const std::filesystem::path file =
      std::filesystem::path(CCALLOC_SOURCE_DIR) / "data" / "traces" / "sleep_wake" / "rl_sleep_wake.trace.gz";
  const trace t = read_trace_file(file.string());
  const replay_result r = replay_trace(t, on_device_of(1024 * MiB));
  EXPECT_EQ(r.ooms, 0u);
  EXPECT_EQ(r.peak_reserved_bytes, 603979776u);
  EXPECT_EQ(r.device_mallocs, 1056u);
  EXPECT_EQ(r.peak_paused_bytes, 671088640u);
  std::vector<std::uint64_t> after_phase;
  std::size_t pauses = 0;
  for (const replay_sleep_event& e : r.sleep_events) {
    if (!e.pause) continue;
    EXPECT_EQ(e.paused_bytes, e.recorded_bytes) << "line " << e.line;
    if (++pauses % 2 == 0) after_phase.push_back(e.paused_total_bytes / MiB);
  }
  EXPECT_EQ(pauses, 8u);
  EXPECT_EQ(after_phase, (std::vector<std::uint64_t>{512, 640, 640, 640}));
}

// Paused blocks count as requested but hold no pages: the requested peak
// (here 128 MiB, twice the reserved peak) is no lower bound of the search,
// which found a 2^63-byte device when it took it for one.
TEST(SleepWakeTrace, MinDeviceMemoryStaysWithinTheReservedPeak) {
  const trace t = parse_trace_text(
      "1 tag 0 0 0 first\n"
      "2 alloc 4194304 67108864 0\n"
      "3 pause 0 67108864 0 first drop\n"
      "4 tag 0 0 0 second\n"
      "5 alloc 272629760 67108864 0\n",
      "t");
  const replay_result full = replay_trace(t, on_device_of(1024 * MiB));
  ASSERT_EQ(full.ooms, 0u);
  ASSERT_EQ(full.peak_requested_bytes, 128 * MiB);
  ASSERT_LT(full.peak_reserved_bytes, full.peak_requested_bytes);
  const std::size_t found = find_min_device_memory(t, on_device_of(1024 * MiB));
  EXPECT_LE(found, full.peak_reserved_bytes);
  EXPECT_GE(found, 64 * MiB);
  EXPECT_EQ(found % (2 * MiB), 0u);
  EXPECT_EQ(replay_trace(t, on_device_of(found)).ooms, 0u);
  EXPECT_GT(replay_trace(t, on_device_of(found - 2 * MiB)).ooms, 0u);
}

}  // namespace

// A block freed while its tag is paused, whose free completes later in the
// trace (it was used on another stream): the replay cannot record_stream a
// paused block, and need not, since its free waits for the resume (as the
// library does when a program frees a paused block). It was an error with
// no file or line naming a record_stream the trace does not contain.
TEST(SleepWakeTrace, AFreeOfAPausedBlockCompletingLaterWaitsForTheResume) {
  const std::string text =
      "1 tag 0 0 0 spf_a\n"
      "2 alloc 1000 98 5\n"
      "3 pause 0 0 0 spf_a drop\n"
      "4 free_requested 1000 98 5\n"
      "5 resume 0 0 0 spf_a\n"
      "6 free_completed 1000 98 5\n"
      "7 tag 0 0 0 default\n"
      "8 alloc 2000 50 5\n";
  const replay_result r = replay_trace(parse_trace_text(text, "paused_pending"), on_device_of(256 * MiB));
  EXPECT_EQ(r.ooms, 0u);
  EXPECT_EQ(r.peak_requested_bytes, 98u);
  ASSERT_EQ(r.sleep_events.size(), 2u);
  // Unfinished: the free never completes in the trace; the replay ends cleanly.
  const std::string unfinished = "1 tag 0 0 0 spf_b\n2 alloc 1000 98 5\n3 pause 0 0 0 spf_b drop\n"
                                 "4 free_requested 1000 98 5\n";
  const replay_result u = replay_trace(parse_trace_text(unfinished, "paused_pending_2"), on_device_of(256 * MiB));
  EXPECT_EQ(u.peak_requested_bytes, 98u);
}

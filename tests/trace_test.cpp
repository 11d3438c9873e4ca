// trace_test.cpp: the trace reader (include/ccalloc/replay/trace.hpp) on the
// real traces bundled in data/traces, gzip detection by content, and every
// kind of malformed input with its FILE:LINE message.
#include <ccalloc/replay/embedded.hpp>
#include <ccalloc/replay/trace.hpp>

#include <gtest/gtest.h>

#include "temp_file.hpp"

#include <array>
#include <cstdint>
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

const std::string traces_dir = std::string(CCALLOC_SOURCE_DIR) + "/data/traces";
const std::string gpt2_path = traces_dir + "/gpt2_train.trace.gz";
const std::string bert_path = traces_dir + "/bert_copystream_infer.trace.gz";

std::map<std::string, std::size_t> count_by_action(const ccalloc::trace& t) {
  std::map<std::string, std::size_t> counts;
  for (const auto& e : t.events) ++counts[std::string(ccalloc::to_string(e.action))];
  return counts;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

using ccalloc::testing::temp_file;

/// What reading `contents` from a file named `name` throws.
struct read_failure {
  std::string what;
  std::string file;
  std::size_t line = 0;
};

read_failure failure_of_file(std::string_view name, std::string_view contents) {
  const temp_file f(name, contents);
  try {
    (void)ccalloc::read_trace_file(f.path());
  } catch (const ccalloc::trace_error& e) {
    return {e.what(), e.file, e.line};
  }
  ADD_FAILURE() << "no trace_error for " << name;
  return {};
}

read_failure failure_of_text(std::string_view text) {
  try {
    (void)ccalloc::parse_trace_text(text, "t.trace");
  } catch (const ccalloc::trace_error& e) {
    return {e.what(), e.file, e.line};
  }
  ADD_FAILURE() << "no trace_error for: " << text;
  return {};
}

constexpr std::string_view header = "# time_us action addr size stream\n";

// ---- real traces ----------------------------------------------------------

// Expected counts were computed from the files with
//   zcat data/traces/NAME.trace.gz | grep -v '^#' |
//     awk 'NF>0 {c[$2]++; n++} END {for (k in c) print k, c[k]; print "total", n}'
// and first/last events with `zcat ... | sed -n '2p;$p'`.
TEST(TraceReader, Gpt2TrainCountsAndEnds) {
  const ccalloc::trace t = ccalloc::read_trace_file(gpt2_path);
  EXPECT_EQ(t.source, gpt2_path);
  ASSERT_EQ(t.events.size(), 18685u);
  const std::map<std::string, std::size_t> expected = {
      {"alloc", 6179}, {"free_requested", 6176}, {"free_completed", 6176}, {"segment_alloc", 154}};
  EXPECT_EQ(count_by_action(t), expected);

  const auto& first = t.events.front();  // line 1 is the header comment
  EXPECT_EQ(first.time_us, 1796001411612040u);
  EXPECT_EQ(first.action, ccalloc::trace_action::segment_alloc);
  EXPECT_EQ(first.addr, 140347686518784u);
  EXPECT_EQ(first.size, 155189248u);
  EXPECT_EQ(first.stream, 0u);
  EXPECT_EQ(first.line, 2u);

  const auto& last = t.events.back();
  EXPECT_EQ(last.time_us, 1796001414155021u);
  EXPECT_EQ(last.action, ccalloc::trace_action::free_completed);
  EXPECT_EQ(last.addr, 140342248306688u);
  EXPECT_EQ(last.size, 4u);
  EXPECT_EQ(last.stream, 0u);
  EXPECT_EQ(last.line, 18686u);
}

TEST(TraceReader, BertCopystreamCountsStreamsAndEnds) {
  const ccalloc::trace t = ccalloc::read_trace_file(bert_path);
  ASSERT_EQ(t.events.size(), 12034u);
  const std::map<std::string, std::size_t> expected = {
      {"alloc", 4006}, {"free_requested", 4004}, {"free_completed", 4001}, {"segment_alloc", 23}};
  EXPECT_EQ(count_by_action(t), expected);

  // zcat ... | awk 'NR>1 {print $5}' | sort | uniq -c
  std::map<std::uint64_t, std::size_t> streams;
  for (const auto& e : t.events) ++streams[e.stream];
  const std::map<std::uint64_t, std::size_t> expected_streams = {{0, 11855}, {864234448, 179}};
  EXPECT_EQ(streams, expected_streams);

  const auto& first = t.events.front();
  EXPECT_EQ(first.time_us, 1796001614567723u);
  EXPECT_EQ(first.action, ccalloc::trace_action::segment_alloc);
  EXPECT_EQ(first.addr, 140032543293440u);
  EXPECT_EQ(first.size, 48234496u);
  EXPECT_EQ(first.line, 2u);
  const auto& last = t.events.back();
  EXPECT_EQ(last.time_us, 1796001618801928u);
  EXPECT_EQ(last.action, ccalloc::trace_action::free_completed);
  EXPECT_EQ(last.addr, 140032592448512u);
  EXPECT_EQ(last.size, 1536u);
  EXPECT_EQ(last.line, 12035u);
}

TEST(TraceReader, EmbeddedDefaultTraceMatchesTheFile) {
  const std::string text =
      ccalloc::maybe_gunzip(ccalloc::embedded::default_trace_gz(), "<embedded:gpt2_train>");
  const ccalloc::trace embedded = ccalloc::parse_trace_text(text, "<embedded:gpt2_train>");
  const ccalloc::trace file = ccalloc::read_trace_file(gpt2_path);
  EXPECT_EQ(ccalloc::embedded::default_trace_name(), "gpt2_train");
  ASSERT_EQ(embedded.events.size(), file.events.size());
  EXPECT_EQ(embedded.events.back().time_us, file.events.back().time_us);
  EXPECT_EQ(embedded.source, "<embedded:gpt2_train>");
  EXPECT_NE(ccalloc::embedded::default_trace_native_peaks_json().find("native_reserved_peak"),
            std::string_view::npos);
}

#ifdef CCALLOC_SHARED_TRACES_DIR
// The largest shared trace (850,930 events; see ../shared/traces/README.md).
// Skipped where the shared folder is absent (an installed or copied tree).
TEST(TraceReader, LlamaGenerateLargeTrace) {
  const std::string path = std::string(CCALLOC_SHARED_TRACES_DIR) + "/llama_generate.trace.gz";
  if (!fs::exists(path)) GTEST_SKIP() << path << " not present";
  const ccalloc::trace t = ccalloc::read_trace_file(path);
  EXPECT_EQ(t.events.size(), 850930u);
  EXPECT_EQ(t.events.back().time_us, 1796001438721654u);
  EXPECT_EQ(t.events.back().line, 850931u);
}
#endif

// ---- gzip detection by content, not by name -------------------------------

TEST(TraceReader, PlainTextNamedGzIsReadAsText) {
  const temp_file f("plain.trace.gz",
                    std::string(header) + "10 alloc 4096 512 0\n20 free_requested 4096 512 0\n");
  const ccalloc::trace t = ccalloc::read_trace_file(f.path());
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.events[1].action, ccalloc::trace_action::free_requested);
  EXPECT_EQ(t.events[1].line, 3u);
}

TEST(TraceReader, GzipNamedTxtIsDecompressed) {
  const temp_file f("compressed.txt", read_bytes(gpt2_path));
  EXPECT_EQ(ccalloc::read_trace_file(f.path()).events.size(), 18685u);
}

TEST(TraceReader, MaybeGunzipPassesPlainDataThrough) {
  EXPECT_EQ(ccalloc::maybe_gunzip("1 alloc 2 3 4\n", "x"), "1 alloc 2 3 4\n");
  EXPECT_EQ(ccalloc::maybe_gunzip("", "x"), "");
  EXPECT_EQ(ccalloc::maybe_gunzip("\x1f", "x"), "\x1f");  // too short for the magic
}

TEST(TraceReader, ConcatenatedGzipMembersDecodeToTheConcatenation) {
  const std::string one = read_bytes(bert_path);
  const std::string text = ccalloc::maybe_gunzip(one, "one");
  EXPECT_EQ(ccalloc::maybe_gunzip(one + one, "two"), text + text);
}

// ---- layout tolerance -----------------------------------------------------

TEST(TraceReader, CommentsBlankLinesTabsAndCrlf) {
  const ccalloc::trace t = ccalloc::parse_trace_text(
      "# header\r\n"
      "\n"
      "   \t\n"
      "  # indented comment\n"
      "5\talloc  1  2\t 3\r\n"
      "5 segment_map 7 8 9",  // no final newline
      "t");
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.events[0].time_us, 5u);
  EXPECT_EQ(t.events[0].addr, 1u);
  EXPECT_EQ(t.events[0].size, 2u);
  EXPECT_EQ(t.events[0].stream, 3u);
  EXPECT_EQ(t.events[0].line, 5u);
  EXPECT_EQ(t.events[1].action, ccalloc::trace_action::segment_map);
  EXPECT_EQ(t.events[1].line, 6u);
}

TEST(TraceReader, EmptyTextIsAnEmptyTrace) {
  EXPECT_TRUE(ccalloc::parse_trace_text("", "t").events.empty());
  EXPECT_TRUE(ccalloc::parse_trace_text(header, "t").events.empty());
}

TEST(TraceReader, EveryActionNameRoundTrips) {
  constexpr std::array<std::string_view, 9> names = {
      "alloc",       "free_requested", "free_completed", "segment_alloc", "segment_free",
      "segment_map", "segment_unmap",  "snapshot",       "oom"};
  std::string text;
  for (const auto name : names) text += "1 " + std::string(name) + " 0 0 0\n";
  const ccalloc::trace t = ccalloc::parse_trace_text(text, "t");
  ASSERT_EQ(t.events.size(), names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(ccalloc::to_string(t.events[i].action), names[i]);
  }
}

TEST(TraceReader, LargestValuesAndEqualTimesAreAccepted) {
  const ccalloc::trace t = ccalloc::parse_trace_text(
      "18446744073709551615 alloc 18446744073709551615 0 18446744073709551615\n"
      "18446744073709551615 free_requested 18446744073709551615 0 18446744073709551615\n",
      "t");
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.events[1].addr, UINT64_MAX);
}

// ---- malformed input: FILE:LINE and the reason ------------------------------

TEST(TraceReaderErrors, WrongFieldCount) {
  const read_failure few = failure_of_file(
      "few.trace", std::string(header) + "1 alloc 2 3 0\n2 alloc 4096\n");
  EXPECT_EQ(few.line, 3u);
  EXPECT_EQ(few.what,
            few.file + ":3: expected 5 fields (time_us action addr size stream), got 3: size and stream are missing");

  const read_failure many = failure_of_text("1 alloc 2 3 0 extra\n");
  EXPECT_EQ(many.what, "t.trace:1: expected 5 fields (time_us action addr size stream), got 6");
}

// Breaker finding: a trace cut short inside its last line. The message names
// the line and the missing columns, and says the file may be cut short; a
// last line that is complete without its newline stays valid.
TEST(TraceReaderErrors, LastLineCutShortNamesWhatIsMissing) {
  const std::string head = "5 alloc 4096 512 0\n";
  const std::string expected = "t.trace:2: expected 5 fields (time_us action addr size stream), got ";
  const std::string cut = " (the last line, with no newline after it: is the trace cut short?)";
  const read_failure no_size = failure_of_text(head + "123 alloc 4096");
  EXPECT_EQ(no_size.line, 2u);
  EXPECT_EQ(no_size.what, expected + "3: size and stream are missing" + cut);
  EXPECT_EQ(failure_of_text(head + "123 free_requested 4096 512").what, expected + "4: stream is missing" + cut);
  EXPECT_EQ(failure_of_text(head + "123 al").what, expected + "2: addr, size and stream are missing" + cut);
  EXPECT_EQ(failure_of_text(head + "12").what,
            expected + "1: action, addr, size and stream are missing" + cut);
  EXPECT_EQ(failure_of_text(head + "123 alloc 4096 512 ").what, expected + "4: stream is missing" + cut);
  // The field count is checked before the numbers (0x1 alone would be a bad addr).
  EXPECT_EQ(failure_of_text(head + "123 alloc 0x1").what,
            expected + "3: size and stream are missing" + cut);
  // The same through a file.
  const read_failure file = failure_of_file("cut.trace", head + "123 alloc 4096");
  EXPECT_EQ(file.what, file.file + ":2: expected 5 fields (time_us action addr size stream), got 3: size and "
                                   "stream are missing" + cut);
  // Complete last lines without a newline, also after CRLF lines.
  for (const std::string& text : {head + "6 free_requested 4096 512 7", head + "6 free_requested 4096 512 7 \t",
                                 std::string("5 alloc 4096 512 0\r\n6 free_requested 4096 512 7\r")}) {
    const ccalloc::trace t = ccalloc::parse_trace_text(text, "t.trace");
    ASSERT_EQ(t.events.size(), 2u) << text;
    EXPECT_EQ(t.events[1].action, ccalloc::trace_action::free_requested);
    EXPECT_EQ(t.events[1].stream, 7u);
    EXPECT_EQ(t.events[1].line, 2u);
  }
}

TEST(TraceReaderErrors, UnknownAction) {
  const read_failure f = failure_of_text("# c\n1 alloc 2 3 0\n2 alocc 2 3 0\n");
  EXPECT_EQ(f.line, 3u);
  EXPECT_EQ(f.what,
            "t.trace:3: unknown action 'alocc' (accepted: alloc, free_requested, "
            "free_completed, segment_alloc, segment_free, segment_map, segment_unmap, "
            "snapshot, oom, tag, pause, resume)");
  // Case matters: PyTorch's names are lower case.
  EXPECT_EQ(failure_of_text("1 ALLOC 2 3 0\n").line, 1u);
}

TEST(TraceReaderErrors, NonNumericFields) {
  EXPECT_EQ(failure_of_text("1 alloc 2 abc 0\n").what,
            "t.trace:1: bad size 'abc': not an unsigned integer");
  EXPECT_EQ(failure_of_text("1 alloc 0x10 3 0\n").what,
            "t.trace:1: bad addr '0x10': not an unsigned integer");
  EXPECT_EQ(failure_of_text("1.5 alloc 2 3 0\n").what,
            "t.trace:1: bad time_us '1.5': not an unsigned integer");
  EXPECT_EQ(failure_of_text("1 alloc 2 3 s1\n").what,
            "t.trace:1: bad stream 's1': not an unsigned integer");
  EXPECT_EQ(failure_of_text("1 alloc 2 +3 0\n").what,
            "t.trace:1: bad size '+3': not an unsigned integer");
}

TEST(TraceReaderErrors, NegativeNumber) {
  const read_failure f = failure_of_file("neg.trace", "1 alloc 2 3 0\n2 alloc 2 -4096 0\n");
  EXPECT_EQ(f.line, 2u);
  EXPECT_EQ(f.what, f.file + ":2: bad size '-4096': not an unsigned integer (negative)");
}

TEST(TraceReaderErrors, OverflowBeyondU64) {
  EXPECT_EQ(failure_of_text("1 alloc 18446744073709551616 3 0\n").what,
            "t.trace:1: bad addr '18446744073709551616': out of range "
            "(largest accepted is 18446744073709551615)");
}

TEST(TraceReaderErrors, TimeGoesBackwards) {
  const read_failure f =
      failure_of_file("back.trace", std::string(header) + "2000 alloc 1 2 0\n1000 free_requested 1 2 0\n");
  EXPECT_EQ(f.line, 3u);
  EXPECT_EQ(f.what, f.file + ":3: time_us goes backwards (1000 after 2000)");
}

TEST(TraceReaderErrors, LongFieldIsShortenedInTheMessage) {
  const std::string long_action(100, 'x');
  const read_failure f = failure_of_text("1 " + long_action + " 2 3 0\n");
  EXPECT_NE(f.what.find("'" + std::string(40, 'x') + "...'"), std::string::npos) << f.what;
}

TEST(TraceReaderErrors, MissingFile) {
  const std::string path = "/nonexistent-ccalloc-dir/none.trace.gz";
  try {
    (void)ccalloc::read_trace_file(path);
    FAIL() << "no trace_error";
  } catch (const ccalloc::trace_error& e) {
    EXPECT_EQ(e.file, path);
    EXPECT_EQ(e.line, 0u);
    EXPECT_EQ(std::string(e.what()), path + ": cannot open: No such file or directory");
  }
}

TEST(TraceReaderErrors, DirectoryIsNotATrace) {
  try {
    (void)ccalloc::read_trace_file(traces_dir);
    FAIL() << "no trace_error";
  } catch (const ccalloc::trace_error& e) {
    EXPECT_EQ(e.line, 0u);
    EXPECT_EQ(std::string(e.what()), traces_dir + ": cannot read: Is a directory");
  }
}

TEST(TraceReaderErrors, CorruptGzip) {
  std::string bytes = read_bytes(bert_path);
  ASSERT_GT(bytes.size(), 1000u);
  for (std::size_t i = 100; i < 200; ++i) bytes[i] = static_cast<char>(bytes[i] ^ 0x5a);
  const read_failure f = failure_of_file("corrupt.trace.gz", bytes);
  EXPECT_EQ(f.line, 0u);
  EXPECT_EQ(f.what.rfind(f.file + ": corrupt gzip data: ", 0), 0u) << f.what;
}

TEST(TraceReaderErrors, TruncatedGzip) {
  const std::string bytes = read_bytes(bert_path);
  const read_failure f = failure_of_file("truncated.trace.gz", bytes.substr(0, bytes.size() / 2));
  EXPECT_EQ(f.line, 0u);
  EXPECT_EQ(f.what, f.file + ": corrupt gzip data: truncated (unexpected end of data)");
}

TEST(TraceReaderErrors, GarbageAfterGzipStream) {
  const std::string bytes = read_bytes(bert_path) + "junk";
  const read_failure f = failure_of_file("junk.trace.gz", bytes);
  EXPECT_EQ(f.what, f.file + ": corrupt gzip data: trailing bytes after the gzip stream");
}

TEST(TraceReaderErrors, BadCrcIsCorrupt) {
  std::string bytes = read_bytes(bert_path);
  bytes[bytes.size() - 6] = static_cast<char>(bytes[bytes.size() - 6] ^ 1);  // CRC32 field
  const read_failure f = failure_of_file("crc.trace.gz", bytes);
  EXPECT_EQ(f.what, f.file + ": corrupt gzip data: incorrect data check");
}

}  // namespace

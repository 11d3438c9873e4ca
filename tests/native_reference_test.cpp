// native_reference_test.cpp: reading PyTorch's figures from the
// native_peaks.json beside a trace (ccalloc/replay/native_reference.hpp):
// each fault of the file gets a warning of its own naming the file and,
// for a figure, the entry and the key; the figures are then ignored.
#include <ccalloc/replay/native_reference.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <unistd.h>

namespace {

namespace fs = std::filesystem;

// A folder holding native_peaks.json with `json`; the trace x.trace in it
// (its entry is "x") need not exist.
class peaks_folder {
 public:
  explicit peaks_folder(const std::string& json)
      : dir_(fs::temp_directory_path() / ("ccalloc_native_" + std::to_string(::getpid()))) {
    fs::create_directories(dir_);
    std::ofstream(dir_ / "native_peaks.json", std::ios::binary) << json;
  }
  ~peaks_folder() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  peaks_folder(const peaks_folder&) = delete;
  peaks_folder& operator=(const peaks_folder&) = delete;
  [[nodiscard]] std::string trace() const { return (dir_ / "x.trace").string(); }
  [[nodiscard]] std::string peaks() const { return (dir_ / "native_peaks.json").string(); }

 private:
  fs::path dir_;
};

struct read_result {
  std::optional<ccalloc::native_reference> figures;
  std::string warning;
};

read_result read(const std::string& json) {
  const peaks_folder folder(json);
  read_result r;
  r.figures = ccalloc::native_reference_beside(folder.trace(), &r.warning);
  return r;
}

// The warning for `json`, less "ignoring <file>: ".
std::string warning_for(const std::string& json) {
  const peaks_folder folder(json);
  std::string warning;
  EXPECT_FALSE(ccalloc::native_reference_beside(folder.trace(), &warning).has_value()) << json;
  const std::string prefix = "ignoring " + folder.peaks() + ": ";
  EXPECT_EQ(warning.substr(0, prefix.size()), prefix) << warning;
  return warning.substr(std::min(prefix.size(), warning.size()));
}

// `levels` arrays and objects nested: {"x":{"deep":[[...]]}}.
std::string nested(std::size_t levels) {
  return "{\"x\":{\"native_reserved_peak\":7,\"deep\":" + std::string(levels - 2, '[') + std::string(levels - 2, ']') +
         "}}";
}

constexpr const char* counts = " (PyTorch's figures are counts: integers from 0 to 18446744073709551615)";

TEST(NativeReference, ReadsTheTracesEntryAndKeepsItsText) {
  const auto r = read(R"({"y": [1, 2], "x": {"native_reserved_peak": 2097152, "requested_peak": 0,)"
                      R"( "native_device_allocs": 18446744073709551615, "note": "kept"}})");
  ASSERT_TRUE(r.figures.has_value()) << r.warning;
  EXPECT_EQ(r.warning, "");
  EXPECT_EQ(r.figures->reserved_peak, 2097152u);
  EXPECT_EQ(r.figures->requested_peak, 0u);
  EXPECT_EQ(r.figures->device_allocs, 18446744073709551615u);
  EXPECT_EQ(r.figures->entry_json,
            R"({"native_reserved_peak":2097152,"requested_peak":0,"native_device_allocs":18446744073709551615,)"
            R"("note":"kept"})");
  const auto minus_zero = read(R"({"x": {"native_reserved_peak": 2097152, "requested_peak": -0}})");
  ASSERT_TRUE(minus_zero.figures.has_value()) << minus_zero.warning;  // -0 is 0, not a negative figure
  EXPECT_EQ(minus_zero.figures->requested_peak, 0u);
  EXPECT_FALSE(read(R"({"y": {"native_reserved_peak": 1}})").figures.has_value());  // no entry: no warning
  EXPECT_EQ(read(R"({"y": {"native_reserved_peak": 1}})").warning, "");
}

TEST(NativeReference, EachFaultOfTheFileHasItsOwnWarning) {
  EXPECT_EQ(warning_for(R"({"x": {"native_reserved_peak": 5)"),
            "not valid JSON: parse error at line 1, column 33: syntax error while parsing object - unexpected end "
            "of input; expected '}'");
  EXPECT_EQ(warning_for(""),
            "not valid JSON: parse error at line 1, column 1: syntax error while parsing value - unexpected end of "
            "input; expected '[', '{', or a literal");
  EXPECT_EQ(warning_for(R"({"x": {"native_reserved_peak": 1e999}})"),
            "not valid JSON: number overflow parsing '1e999' (after the key 'native_reserved_peak')");
  EXPECT_EQ(warning_for("[1]"),
            "not a JSON object (its top level is a JSON array; expected an object whose keys are trace names)");
  EXPECT_EQ(warning_for(R"({"x": 3})"), "the entry 'x' is a JSON number, not an object of figures");
}

// A NUL ends nlohmann-json's input: the text after it was ignored without
// a word (an entry after it, or garbage). The file is ignored, naming the byte.
TEST(NativeReference, ANulByteIsRefusedNamingItsOffset) {
  const std::string good = R"({"x": {"native_reserved_peak": 5}})";
  ASSERT_TRUE(read(good).figures.has_value());
  EXPECT_EQ(warning_for(good + std::string(1, '\0') + "{\"junk"),
            "a NUL byte at byte 34 of 41 (JSON text holds none; a JSON reader would stop there and ignore the rest)");
  EXPECT_EQ(warning_for(std::string("{\"y\": 1}\0, \"x\": {\"native_reserved_peak\": 5}}", 44)),
            "a NUL byte at byte 8 of 44 (JSON text holds none; a JSON reader would stop there and ignore the rest)");
}

TEST(NativeReference, NegativeNonIntegerAndOutOfRangeFiguresAreRefusedNamingTheKey) {
  EXPECT_EQ(warning_for(R"({"x": {"native_reserved_peak": -5}})"),
            std::string("in the entry 'x', native_reserved_peak is -5: negative") + counts);
  EXPECT_EQ(warning_for(R"({"x": {"native_allocated_peak": 5.5}})"),
            std::string("in the entry 'x', native_allocated_peak is 5.5: not an integer") + counts);
  EXPECT_EQ(warning_for(R"({"x": {"requested_peak": 18446744073709551616}})"),
            std::string("in the entry 'x', requested_peak is 1.8446744073709552e+19: out of range") + counts);
  EXPECT_EQ(warning_for(R"({"x": {"events": "5"}})"),
            std::string("in the entry 'x', events is a JSON string, not a number") + counts);
  EXPECT_EQ(warning_for(R"({"x": {"native_min_capacity_bytes": 1, "native_device_allocs": null}})"),
            std::string("in the entry 'x', native_device_allocs is a JSON null, not a number") + counts);
}

// 64 levels of arrays and objects are read; 65 are not (the real files nest
// 2). Deeper levels are discarded as the parser meets them: 100,000 levels
// take milliseconds and build nothing deep.
TEST(NativeReference, NestingBeyond64LevelsIsIgnoredWithAWarning) {
  static_assert(ccalloc::max_native_peaks_depth == 64);
  const auto at_limit = read(nested(64));
  ASSERT_TRUE(at_limit.figures.has_value()) << at_limit.warning;
  EXPECT_EQ(at_limit.figures->reserved_peak, 7u);
  EXPECT_EQ(warning_for(nested(65)), "nested more than 64 levels deep");
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(warning_for(nested(100'000)), "nested more than 64 levels deep");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2.0);
  // Deep nesting in another trace's entry counts too: the file is malformed.
  EXPECT_EQ(warning_for(R"({"x": {"native_reserved_peak": 7}, "y": )" + std::string(70, '[') + std::string(70, ']') +
                        "}"),
            "nested more than 64 levels deep");
}

// A key written twice keeps one value in JSON (nlohmann the last), so which
// is meant is unclear: where the trace's figures are read (its entry's name
// at the top level, or any key inside its entry), the file is ignored with
// a warning naming the key. Another trace's entry is not read.
TEST(NativeReference, AKeyWrittenTwiceWhereTheFiguresAreReadIsIgnoredNamingIt) {
  EXPECT_EQ(warning_for(R"({"x": {"requested_peak": 1, "native_reserved_peak": 5, "requested_peak": 2}})"),
            "in the entry 'x', the key 'requested_peak' is written twice in one object (which value is meant is "
            "unclear)");
  EXPECT_EQ(warning_for(R"({"x": {"native_reserved_peak": 5}, "y": {}, "x": {"native_reserved_peak": 6}})"),
            "the entry 'x' is written twice (which one holds the figures is unclear)");
  EXPECT_EQ(warning_for(R"({"x": {"native_reserved_peak": 5, "note": {"by": "a", "by": "b"}}})"),
            "in the entry 'x', the key 'by' is written twice in one object (which value is meant is unclear)");
  // The same key in two objects, or twice in another trace's entry, is no fault.
  const auto r = read(R"({"y": {"a": 1, "a": 2}, "x": {"native_reserved_peak": 5, "n": {"native_reserved_peak": 1}},)"
                      R"( "z": {"x": 1}})");
  ASSERT_TRUE(r.figures.has_value()) << r.warning;
  EXPECT_EQ(r.warning, "");
  EXPECT_EQ(r.figures->reserved_peak, 5u);
}

}  // namespace

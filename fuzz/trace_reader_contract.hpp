// fuzz/trace_reader_contract.hpp: what every trace reader promises, checked
// on arbitrary input. Shared by the fuzz_trace_* targets (one per reader).
//
// The contract (include/ccalloc/replay/trace.hpp, SPEC R5):
//   - a reader returns a trace or throws trace_error; no other exception, no
//     crash, no undefined behaviour, no leak (the sanitizers catch those);
//   - a trace_error's what() is "SOURCE:LINE: reason" with the source name it
//     was given and its own `line` field; LINE is 0 (not tied to a line) or a
//     line of the (decompressed) input;
//   - a trace's source is the name given; its events' lines are increasing,
//     within the input, and their actions are known.
// Input goes through maybe_gunzip first, as read_trace_file does, so gzip
// input is fuzzed too (the seed corpus holds a small .gz).
//
// Adding a reader (say parse_rmm_csv): fuzz/fuzz_trace_rmm.cpp with
//     extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
//       ccalloc::fuzz::check_trace_reader(data, size, [](std::string_view text, const std::string& source) {
//         return ccalloc::parse_rmm_csv(text, source);
//       });
//       return 0;
//     }
// plus ccalloc_add_fuzzer(trace_rmm LIBS ccalloc_replay) in fuzz/CMakeLists.txt
// and a few real inputs in fuzz/corpus/trace_rmm/. Reader-specific checks
// (like the text format's round trip in fuzz_trace_text.cpp) go in its file.
#pragma once

#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/trace.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace ccalloc::fuzz {

/// Prints what broke and aborts: libFuzzer records the input as a crash.
[[noreturn]] inline void violated(const std::string& what) {
  std::fprintf(stderr, "contract violated: %s\n", what.c_str());
  std::abort();
}

/// Number of lines of `text` as a reader counts them (a last line without '\n' counts).
inline std::size_t line_count(std::string_view text) {
  std::size_t lines = 0;
  for (std::size_t i = 0; i < text.size(); ++i)
    if (text[i] == '\n') ++lines;
  if (!text.empty() && text.back() != '\n') ++lines;
  return lines;
}

/// A trace_error from reading `source` whose input had `lines` lines.
inline void check_error(const trace_error& e, const std::string& source, std::size_t lines) {
  // "FILE:LINE: reason", or "FILE: reason" when not tied to a line (line 0).
  const std::string prefix = source + (e.line != 0 ? ":" + std::to_string(e.line) : std::string()) + ": ";
  const std::string what = e.what();
  if (e.file != source) violated("trace_error names file '" + e.file + "', not '" + source + "'");
  if (what.rfind(prefix, 0) != 0) violated("trace_error message does not start with '" + prefix + "': " + what);
  if (what.size() == prefix.size()) violated("trace_error without a reason: " + what);
  if (e.line > lines) violated("trace_error at line " + std::to_string(e.line) + " of " + std::to_string(lines));
}

/// A trace read from `source` whose input had `lines` lines.
inline void check_trace(const trace& t, const std::string& source, std::size_t lines) {
  if (t.source != source) violated("trace source '" + t.source + "', not '" + source + "'");
  std::uint64_t previous_line = 0;
  for (const trace_event& e : t.events) {
    if (e.line <= previous_line || e.line > lines)
      violated("event line " + std::to_string(e.line) + " after line " + std::to_string(previous_line) + " of " +
               std::to_string(lines));
    previous_line = e.line;
    if (to_string(e.action) == "unknown") violated("event with an unknown action enumerator");
  }
}

/// Runs `read(text, source)` on the fuzzer's input (gunzipped when it is
/// gzip) and checks the contract above. Returns the trace when the input
/// parsed, for reader-specific checks.
template <class Reader>
std::optional<trace> check_trace_reader(const std::uint8_t* data, std::size_t size, Reader&& read) {
  const std::string source = "fuzz-input";
  const std::string_view raw(reinterpret_cast<const char*>(data), size);
  std::string text;
  try {
    text = maybe_gunzip(raw, source);
  } catch (const trace_error& e) {
    check_error(e, source, 0);  // decompression errors are not tied to a line
    return std::nullopt;
  }
  const std::size_t lines = line_count(text);
  try {
    trace t = read(std::string_view(text), source);
    check_trace(t, source, lines);
    return t;
  } catch (const trace_error& e) {
    check_error(e, source, lines);
    return std::nullopt;
  }
}

// A trace without events is not replayed: replay_trace rejects it with
// invalid_argument_error (nothing to replay). Returns true when `t` was such
// a trace (the caller stops there).
inline bool check_empty_trace_rejected(const trace& t) {
  if (!t.events.empty()) return false;
  replay_options options;
  options.device_memory_bytes = std::size_t{1} << 30;
  try {
    (void)replay_trace(t, options);
  } catch (const invalid_argument_error&) {
    return true;
  }
  violated("replay of a trace without events did not fail with invalid_argument_error");
}

}  // namespace ccalloc::fuzz

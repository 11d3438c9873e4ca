// ccalloc/replay/trace.hpp: allocation traces (the recorded input of replay).
//
// A trace is the sequence of allocator events of a real program, one per
// line, as in ../shared/traces (PyTorch's trace-entry action names):
//
//     # time_us action addr size stream
//     1796001411612040 segment_alloc 140347686518784 155189248 0
//     1796001411612042 alloc 140347686518784 154389504 0
//
// Files may be gzip-compressed (detected by content, not by name). Lines
// starting with '#' and blank lines are skipped. Errors throw trace_error
// with "FILE:LINE: reason".
#pragma once

#include <ccalloc/base/errors.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ccalloc {

/// A malformed trace. what() is "FILE:LINE: reason".
class trace_error : public error {
 public:
  trace_error(const std::string& source_file, std::size_t source_line, const std::string& reason)
      : error(source_file + ":" + std::to_string(source_line) + ": " + reason),
        file(source_file),
        line(source_line) {}
  std::string file;
  std::size_t line;  ///< 1-based; 0 when the error is not tied to a line
};

enum class trace_action : std::uint8_t {
  alloc,
  free_requested,
  free_completed,
  segment_alloc,
  segment_free,
  segment_map,
  segment_unmap,
  snapshot,
  oom,
};

/// PyTorch's name of an action ("free_requested").
[[nodiscard]] std::string_view to_string(trace_action action) noexcept;

struct trace_event {
  std::uint64_t time_us = 0;  ///< wall-clock microseconds of the recording
  trace_action action = trace_action::alloc;
  std::uint64_t addr = 0;     ///< address the recording allocator used
  std::uint64_t size = 0;     ///< bytes: requested size (alloc, frees) or segment size
  std::uint64_t stream = 0;   ///< stream handle as recorded (0 = legacy default)
  std::uint64_t line = 0;     ///< 1-based line in the source, for error messages
};

struct trace {
  std::string source;  ///< file name, or "<embedded:NAME>"
  std::vector<trace_event> events;
};

/// Reads a trace file (plain or gzip). Throws trace_error for a missing or
/// unreadable file ("FILE:0: cannot open: <reason>") or a malformed line.
[[nodiscard]] trace read_trace_file(const std::string& path);
/// Parses trace text (already decompressed); `source` names it in errors.
[[nodiscard]] trace parse_trace_text(std::string_view text, const std::string& source);
/// Decompresses gzip data if it starts with the gzip magic, else returns it
/// unchanged. Throws trace_error(source, 0, ...) on corrupt gzip data.
[[nodiscard]] std::string maybe_gunzip(std::string_view data, const std::string& source);

}  // namespace ccalloc

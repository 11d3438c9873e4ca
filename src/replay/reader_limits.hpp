// The messages of the readers' limits (trace_limits, include/ccalloc/replay/
// trace.hpp), shared by the text trace and RMM log readers (private to src/replay/).
#pragma once

#include <cstdint>
#include <string>

namespace ccalloc::detail {

inline std::string line_limit_reason(std::uint64_t max_line_bytes) {
  return "a line of more than " + std::to_string(max_line_bytes) +
         " bytes, the limit (trace_limits::max_line_bytes; raise it with --max-line-bytes)";
}

inline std::string event_limit_reason(std::uint64_t max_events) {
  return "more than " + std::to_string(max_events) +
         " events, the limit (trace_limits::max_events; raise it with --max-events)";
}

}  // namespace ccalloc::detail

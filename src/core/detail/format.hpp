// Text of numbers in the core's error messages: fractions here, bytes in
// <ccalloc/base/detail/bytes_text.hpp> (format_bytes).
#pragma once

#include <ccalloc/base/detail/bytes_text.hpp>
#include <ccalloc/base/types.hpp>

#include <charconv>
#include <cstddef>
#include <string>
#include <system_error>

namespace ccalloc::detail {

/// Shortest text that parses back to exactly `value` (0.05, not 0.050000000000000003).
inline std::string format_double(double value) {
  char buffer[64];
  const auto [ptr, ec] = std::to_chars(buffer, buffer + sizeof buffer, value);
  return ec == std::errc{} ? std::string(buffer, ptr) : std::to_string(value);
}

}  // namespace ccalloc::detail

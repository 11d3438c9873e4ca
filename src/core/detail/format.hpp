// Text of numbers in the core's error messages: fractions here, bytes in
// <ccalloc/base/detail/bytes_text.hpp> (format_bytes).
#pragma once

#include <ccalloc/base/detail/bytes_text.hpp>
#include <ccalloc/base/types.hpp>

#include <cstddef>
#include <cstdio>
#include <string>

namespace ccalloc::detail {

inline std::string format_fraction(double f) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", f);
  return buf;
}

}  // namespace ccalloc::detail

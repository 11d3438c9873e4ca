// Text of numbers in the core's error messages.
#pragma once

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

inline std::string format_bytes(std::size_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= gib) std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(gib));
  else if (bytes >= mib) std::snprintf(buf, sizeof buf, "%.2f MiB", b / double(mib));
  else if (bytes >= kib) std::snprintf(buf, sizeof buf, "%.2f KiB", b / double(kib));
  else std::snprintf(buf, sizeof buf, "%zu bytes", bytes);
  return buf;
}

}  // namespace ccalloc::detail

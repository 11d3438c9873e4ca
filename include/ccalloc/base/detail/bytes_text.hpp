// ccalloc/base/detail/bytes_text.hpp: the one way ccalloc writes a number of
// bytes for people (error messages, the CLI, the HTML report). Not part of
// the public API.
#pragma once

#include <ccalloc/base/types.hpp>

#include <cstdint>
#include <cstdio>
#include <string>

namespace ccalloc::detail {

/// `bytes` in the largest binary unit (KiB, MiB, GiB, TiB) that keeps the
/// value at least 1, with `decimals` digits after the point ("1.50 GiB",
/// "290.00 MiB"); under 1 KiB, whole bytes ("512 bytes"). `decimals` is
/// clamped to [0, 9]. Thread-safe; allocates the returned string.
inline std::string format_bytes(std::uint64_t bytes, int decimals = 2) {
  static constexpr const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  static constexpr std::uint64_t sizes[] = {kib, mib, gib, std::uint64_t{gib} * kib};
  char buf[64];
  if (bytes < kib) {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(bytes));
    return buf;
  }
  int u = 3;
  while (bytes < sizes[u]) --u;
  const int d = decimals < 0 ? 0 : decimals > 9 ? 9 : decimals;
  std::snprintf(buf, sizeof buf, "%.*f %s", d, static_cast<double>(bytes) / static_cast<double>(sizes[u]), units[u]);
  return buf;
}

/// `bytes` in GiB whatever the size, with `decimals` digits after the point
/// ("12.661 GiB"): for columns of figures read side by side. `decimals` is
/// clamped to [0, 9]. Thread-safe; allocates the returned string.
inline std::string format_gib(std::uint64_t bytes, int decimals = 3) {
  char buf[64];
  const int d = decimals < 0 ? 0 : decimals > 9 ? 9 : decimals;
  std::snprintf(buf, sizeof buf, "%.*f GiB", d, static_cast<double>(bytes) / static_cast<double>(gib));
  return buf;
}

}  // namespace ccalloc::detail

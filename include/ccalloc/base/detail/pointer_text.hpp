// ccalloc/base/detail/pointer_text.hpp: how error messages write a pointer.
// Not part of the public API.
#pragma once

#include <cstdio>
#include <string>

namespace ccalloc::detail {

/// `ptr` as printf's %p writes it ("0x7f..." on Linux, "(nil)" for null).
/// Thread-safe; allocates the returned string.
inline std::string pointer_text(const void* ptr) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", ptr);
  return buf;
}

}  // namespace ccalloc::detail

// peak_rss.hpp: how far a piece of code raises the process's resident size
// (Linux: /proc/self/status VmHWM, reset through /proc/self/clear_refs), for
// tests that readers stay within bounded memory.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace ccalloc::testing {

/// The `key` line of /proc/self/status in bytes (VmHWM, VmRSS), or 0.
inline std::uint64_t proc_status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(key + ":", 0) == 0) return std::stoull(line.substr(key.size() + 1)) * 1024;
  return 0;
}

/// Resets the peak resident size (VmHWM) to the current one; false when the
/// kernel does not let it, or under AddressSanitizer, whose quarantine keeps
/// freed memory resident (the resident size then says nothing of a reader's
/// bound; the plain build checks it). The caller then skips.
inline bool reset_peak_rss() {
#if defined(__SANITIZE_ADDRESS__)
  return false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  return false;
#endif
#endif
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return clear.good() && proc_status_bytes("VmHWM") != 0;
}

/// How far the resident size rose above its level before `f` ran (call
/// reset_peak_rss first).
template <class F>
std::uint64_t peak_rss_growth(F f) {
  const std::uint64_t before = proc_status_bytes("VmRSS");
  f();
  const std::uint64_t peak = proc_status_bytes("VmHWM");
  return peak > before ? peak - before : 0;
}

inline constexpr std::uint64_t MiB = std::uint64_t{1} << 20;

}  // namespace ccalloc::testing

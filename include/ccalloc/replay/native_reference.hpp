// ccalloc/replay/native_reference.hpp: PyTorch's own figures for a trace
// (its native allocator's peaks, from a native_peaks.json beside the trace,
// or built in for the embedded trace), to compare a replay with.
//
// Built with the tools or the tests (it reads JSON with nlohmann-json; the
// CCALLOC_MINIMAL build for the GPU checks leaves it out).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace ccalloc {

/// PyTorch's own figures for the trace (native_peaks.json); 0 = unknown.
struct native_reference {
  std::string origin;  ///< where they come from, shown on the page
  std::uint64_t requested_peak = 0;
  std::uint64_t reserved_peak = 0;
  std::uint64_t expandable_reserved_peak = 0;
  std::uint64_t allocated_peak = 0;
  std::uint64_t device_allocs = 0;
  std::uint64_t min_capacity_bytes = 0;             ///< smallest device memory without OOM (SPEC P7)
  std::uint64_t expandable_min_capacity_bytes = 0;  ///< the same with expandable segments
  std::string entry_json;  ///< the entry as written (a JSON object, keys in their order); "" when built by hand
};

/// The deepest nesting of arrays and objects that native_reference_beside
/// accepts in a native_peaks.json (the real files nest 2 levels).
inline constexpr std::size_t max_native_peaks_depth = 64;

/// The native_peaks.json that native_reference_beside reads for trace file
/// `trace_path`: the one in its folder ("./native_peaks.json" for a bare
/// file name). Only builds the path; never throws but std::bad_alloc.
[[nodiscard]] std::string native_peaks_path_beside(const std::string& trace_path);

/// The figures for trace file `trace_path` from a native_peaks.json in its
/// folder, under the trace's name ("gpt2_train" for
/// ".../gpt2_train.trace.gz" or ".../gpt2_train.trace", else the file name).
/// nullopt when there is no such file or entry. An unreadable or malformed
/// native_peaks.json gives nullopt and, when `warning` is given, a sentence
/// there naming the file and the fault (docs/trace-format.md lists them):
/// not JSON (nlohmann-json's line and column), nested more than
/// max_native_peaks_depth levels, a top level or an entry that is no
/// object, or a figure of the entry that is no integer from 0 to 2^64 - 1
/// (naming its key). The replay itself does not depend on it. Never throws
/// for file content; std::bad_alloc may escape.
[[nodiscard]] std::optional<native_reference> native_reference_beside(const std::string& trace_path,
                                                                      std::string* warning = nullptr);

/// The built-in figures of the embedded default trace
/// (ccalloc/replay/embedded.hpp); nullopt if they do not parse.
[[nodiscard]] std::optional<native_reference> embedded_native_reference();

}  // namespace ccalloc

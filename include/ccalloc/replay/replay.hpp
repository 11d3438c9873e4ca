// ccalloc/replay/replay.hpp: replay a trace through ccalloc and report what it
// reserved (SPEC X8).
//
// The replay drives a caching_allocator on the simulated device (or a real
// one) with a trace's alloc / free_requested / free_completed events, on the
// trace's streams. Virtual time advances by one unit per trace event. A block
// whose free_completed comes after its free_requested was used on another
// stream until then (record_stream in the program): the replay records the
// block on a side stream whose work lasts until the free_completed event, so
// the allocator cannot reuse it earlier. Segment events of the recording
// allocator are ignored: the replayed allocator reserves on its own.
#pragma once

#include <ccalloc/core/config.hpp>
#include <ccalloc/replay/trace.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

namespace ccalloc {

struct replay_options {
  std::string config;  ///< configuration string (PyTorch syntax); "" = defaults
  /// Simulated device capacity in bytes; default 141 GB (an H200).
  std::size_t device_memory_bytes = std::size_t{141} * 1000 * 1000 * 1000;
};

struct replay_result {
  std::string source;
  std::string config;
  std::uint64_t events = 0;                ///< trace events replayed
  std::uint64_t peak_requested_bytes = 0;  ///< requested_bytes.all.peak
  std::uint64_t peak_allocated_bytes = 0;  ///< allocated_bytes.all.peak
  std::uint64_t peak_reserved_bytes = 0;   ///< reserved_bytes.all.peak
  std::uint64_t device_mallocs = 0;        ///< num_device_alloc
  std::uint64_t device_frees = 0;          ///< num_device_free
  std::uint64_t ooms = 0;                  ///< allocations that failed
  std::uint64_t alloc_retries = 0;         ///< num_alloc_retries
  double wall_seconds = 0.0;               ///< replay time, excluding reading the trace
  /// peak_reserved_bytes / peak_requested_bytes (0 when nothing was requested).
  [[nodiscard]] double fragmentation() const noexcept {
    return peak_requested_bytes ? double(peak_reserved_bytes) / double(peak_requested_bytes) : 0.0;
  }
};

/// Replays `t` on a fresh simulated device. Throws config_error for a bad
/// configuration and trace_error for an event that contradicts the trace's
/// own history (a free of an address with no live allocation), naming the
/// event's line.
[[nodiscard]] replay_result replay_trace(const trace& t, const replay_options& options);

}  // namespace ccalloc

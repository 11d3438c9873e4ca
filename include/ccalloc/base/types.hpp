// ccalloc/base/types.hpp: the handles and constants every layer shares.
//
// Streams and events are opaque integer handles owned by a device backend
// (for the CUDA backend they hold a cudaStream_t / cudaEvent_t value). They are
// plain integers so that the core never depends on CUDA headers and so that a
// trace's stream column maps onto them without conversion.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ccalloc {

/// A stream handle. 0 is the legacy default stream (CUDA's `cudaStreamLegacy`
/// semantics on the CUDA backend). Valid for the backend that created it.
using stream_t = std::uintptr_t;

/// An event handle created by a device backend; 0 is never a valid event.
using event_t = std::uintptr_t;

inline constexpr stream_t default_stream = 0;

/// The value of CUDA's `cudaStreamLegacy` handle: the legacy default stream
/// of the current device, the same stream as default_stream here.
inline constexpr stream_t legacy_stream_handle = 1;
/// The value of CUDA's `cudaStreamPerThread` handle: the calling thread's
/// per-thread default stream, a different stream on each thread. The
/// allocator resolves it on the calling thread (device_backend::resolve_stream)
/// and keys its pools by the resolved handle, never by this value.
inline constexpr stream_t per_thread_stream_handle = 2;

inline constexpr std::size_t kib = std::size_t{1} << 10;
inline constexpr std::size_t mib = std::size_t{1} << 20;
inline constexpr std::size_t gib = std::size_t{1} << 30;

/// Requests of this many bytes or more fail with out_of_memory_error at once
/// (SPEC F2): no device has an exbibyte.
/// The most devices an allocator drives, and a simulated device backend
/// makes (sim_options::device_count): CUDA numbers devices with an int and
/// no host holds a thousand GPUs; per-device state (peer grants are a
/// matrix) must stay small. The C API's CCALLOC_MAX_DEVICE_COUNT.
inline constexpr int max_device_count = 1024;
inline constexpr std::size_t max_request_bytes = std::size_t{1} << 60;

}  // namespace ccalloc

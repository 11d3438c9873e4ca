// ccalloc/adapters/cuda_stream.hpp: ccalloc's stream handles and CUDA's
// cudaStream_t, one to the other (needs the CUDA runtime's headers, not its
// library).
//
// ccalloc::stream_t is a cudaStream_t's value as an integer: 0 is the
// legacy default stream (cudaStreamLegacy is 1, cudaStreamPerThread 2, the
// same values ccalloc gives legacy_stream_handle and per_thread_stream_handle).
// On the simulated device the handles are the simulator's own and must not
// be passed to CUDA. to_stream and to_cuda_stream are casts (no call into
// CUDA, thread-safe, never throw); malloc and record_stream forward to the
// allocator and throw what it throws.
#pragma once

#include <ccalloc/base/types.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>

namespace ccalloc {

/// The ccalloc handle of a CUDA stream (what caching_allocator::malloc takes).
[[nodiscard]] inline stream_t to_stream(cudaStream_t stream) noexcept {
  return reinterpret_cast<stream_t>(stream);
}

/// The CUDA stream of a ccalloc handle made by the CUDA backend or to_stream.
[[nodiscard]] inline cudaStream_t to_cuda_stream(stream_t stream) noexcept {
  return reinterpret_cast<cudaStream_t>(stream);
}

/// caching_allocator::malloc on a cudaStream_t. Throws what malloc throws.
[[nodiscard]] inline void* malloc(caching_allocator& allocator, int device, std::size_t size_bytes,
                                  cudaStream_t stream) {
  return allocator.malloc(device, size_bytes, to_stream(stream));
}

/// caching_allocator::record_stream with a cudaStream_t. Throws what
/// record_stream throws.
inline void record_stream(caching_allocator& allocator, void* ptr, cudaStream_t stream) {
  allocator.record_stream(ptr, to_stream(stream));
}

}  // namespace ccalloc

// ccalloc/adapters/cuda_memory_resource.hpp: a caching_allocator as a CCCL
// memory resource (cuda::mr), so that code written against CCCL's resource
// concepts (RMM's resource refs, CCCL containers, Thrust/CUB users through a
// resource ref) allocates from ccalloc.
//
// cuda_memory_resource satisfies
// cuda::mr::async_resource_with<cuda_memory_resource, cuda::mr::device_accessible>
// (CCCL 3, the CUDA 13 toolkit's include/cccl): allocate/deallocate with and
// without a stream, equality, the device_accessible property. It needs the
// CUDA toolkit's headers (include/cccl and include) and, for CCCL 3.0,
// LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE, which this header defines
// when it is not set; it does not link libcudart.
//
// Streams: cuda::stream_ref wraps a cudaStream_t; its value is taken as a
// ccalloc stream handle (adapters/cuda_stream.hpp), so on the simulated
// device a stream_ref made from a simulated handle works too
// (reinterpret_cast<cudaStream_t>(handle)). The stream-less calls use the
// allocator's current stream of the calling thread
// (caching_allocator::current_stream()).
//
// Thread safety: as caching_allocator (any thread). Ownership: the resource
// refers to the allocator, which must outlive it and every pointer it gave.
#pragma once

#ifndef LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#endif

#include <ccalloc/adapters/cuda_stream.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <cstddef>
#include <string>

namespace ccalloc {

class cuda_memory_resource {
 public:
  /// The largest alignment a block has: every block starts on 512 bytes.
  static constexpr std::size_t max_alignment = 512;

  /// Allocates on `device` of `allocator` (not owned).
  cuda_memory_resource(caching_allocator& allocator, int device) noexcept : allocator_(&allocator), device_(device) {}

  /// `bytes` on the calling thread's current stream. Throws
  /// invalid_argument_error for an alignment that is not a power of two or
  /// is above 512, and what caching_allocator::malloc throws
  /// (out_of_memory_error when the device is full).
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = alignof(std::max_align_t)) {
    check_alignment(alignment);
    return allocator_->malloc(device_, bytes, caching_allocator::current_stream());
  }

  /// Frees `ptr` (from this resource); `bytes` and `alignment` are not
  /// needed (the allocator knows the block). Throws invalid_argument_error
  /// for a pointer ccalloc did not hand out.
  void deallocate(void* ptr, std::size_t /*bytes*/, std::size_t /*alignment*/ = alignof(std::max_align_t)) {
    allocator_->free(ptr);
  }

  /// `bytes` usable in stream order on `stream` at once (PyTorch's and
  /// ccalloc's semantics: the block belongs to that stream). Throws as
  /// allocate.
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment, ::cuda::stream_ref stream) {
    check_alignment(alignment);
    return allocator_->malloc(device_, bytes, to_stream(stream.get()));
  }

  /// Frees `ptr` in stream order on `stream`: when `stream` is not the one
  /// it was allocated on, it is recorded on `stream` first (record_stream),
  /// so another stream reuses it only after `stream`'s work queued so far.
  /// Throws invalid_argument_error for a pointer ccalloc did not hand out.
  void deallocate_async(void* ptr, std::size_t /*bytes*/, std::size_t /*alignment*/, ::cuda::stream_ref stream) {
    allocator_->record_stream(ptr, to_stream(stream.get()));  // a no-op on the block's own stream
    allocator_->free(ptr);
  }

  /// The same allocator and device.
  friend bool operator==(const cuda_memory_resource& a, const cuda_memory_resource& b) noexcept {
    return a.allocator_ == b.allocator_ && a.device_ == b.device_;
  }
  friend bool operator!=(const cuda_memory_resource& a, const cuda_memory_resource& b) noexcept { return !(a == b); }

  /// Memory from it is device memory.
  friend void get_property(const cuda_memory_resource&, ::cuda::mr::device_accessible) noexcept {}

  [[nodiscard]] caching_allocator& allocator() const noexcept { return *allocator_; }
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  static void check_alignment(std::size_t alignment) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > max_alignment)
      throw invalid_argument_error("ccalloc: cuda_memory_resource: alignment " + std::to_string(alignment) +
                                   " is not a power of two up to 512 (blocks start on 512 bytes)");
  }

  caching_allocator* allocator_;
  int device_;
};

}  // namespace ccalloc

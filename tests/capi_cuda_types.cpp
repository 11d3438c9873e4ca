// Compile-time check (built when the CUDA backend is): ccalloc_stream_t is
// CUDA's cudaStream_t, so callers pass their streams without a cast, and the
// PyTorch entry points have exactly the signatures PyTorch's
// CUDAPluggableAllocator calls (torch/csrc/cuda/CUDAPluggableAllocator.h).
#include <ccalloc/ccalloc.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

static_assert(std::is_same_v<ccalloc_stream_t, cudaStream_t>);
static_assert(std::is_same_v<decltype(&ccalloc_plugin_alloc), void* (*)(std::size_t, int, cudaStream_t)>);
static_assert(std::is_same_v<decltype(&ccalloc_plugin_free), void (*)(void*, std::size_t, int, cudaStream_t)>);
static_assert(std::is_same_v<decltype(&ccalloc_torch_alloc), void* (*)(std::size_t, int, cudaStream_t)>);
static_assert(std::is_same_v<decltype(&ccalloc_torch_free), void (*)(void*, std::size_t, int, cudaStream_t)>);
static_assert(std::is_same_v<decltype(&ccalloc_torch_init), void (*)(int)>);
static_assert(std::is_same_v<decltype(&ccalloc_torch_empty_cache), void (*)()>);
static_assert(std::is_same_v<decltype(&ccalloc_torch_set_memory_fraction), void (*)(double, int)>);
static_assert(std::is_same_v<decltype(&ccalloc_torch_base_alloc), void* (*)(void*, std::size_t*)>);
static_assert(std::is_same_v<decltype(&ccalloc_torch_record_stream), void (*)(void*, cudaStream_t)>);

// Private pools' segment functions have cudaMalloc's and cudaFree's
// parameters; their return type is int where CUDA's is the enum cudaError_t,
// which is int-sized, so cudaMalloc passes with a cast (as ncclMemAlloc,
// whose ncclResult_t is an int-sized enum too).
static_assert(std::is_same_v<ccalloc_segment_malloc_fn, int (*)(void**, std::size_t)>);
static_assert(std::is_same_v<ccalloc_segment_free_fn, int (*)(void*)>);
static_assert(sizeof(cudaError_t) == sizeof(int));
[[maybe_unused]] constexpr cudaError_t (*cuda_malloc_signature)(void**, std::size_t) = &cudaMalloc;
[[maybe_unused]] constexpr cudaError_t (*cuda_free_signature)(void*) = &cudaFree;

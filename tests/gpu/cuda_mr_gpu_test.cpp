// The cuda::mr adapter on a GPU: a CCCL async resource ref over ccalloc's
// CUDA backend; kernels write and check the memory on two streams, a block
// freed on another stream than its own is not handed out while that
// stream's kernel still runs. Prints "PASS" and exits 0, or names what
// failed and exits 1. CTest label "gpu".
#include "gpu_kernels.hpp"

#include <ccalloc/adapters/cuda_memory_resource.hpp>
#include <ccalloc/backend/cuda_backend.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <memory>

namespace gk = ccalloc_gpu_test;

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAIL: %s\n", what);
    ++failures;
  }
}

bool cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::printf("FAIL: %s: %s\n", what, cudaGetErrorString(e));
  failures += e != cudaSuccess;
  return e == cudaSuccess;
}

}  // namespace

int main() try {
  if (ccalloc::cuda_backend::available_device_count() < 1) {
    std::fprintf(stderr, "ccalloc_gpu_cuda_mr_test: no CUDA device is visible; this test needs a GPU\n");
    return 1;
  }
  auto backend = std::make_shared<ccalloc::cuda_backend>();
  ccalloc::caching_allocator alloc(backend, ccalloc::allocator_config::parse(""));
  alloc.init(1);
  ccalloc::cuda_memory_resource resource(alloc, 0);
  cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref{resource};

  cudaStream_t a = nullptr, b = nullptr;
  if (!cuda_ok(cudaSetDevice(0), "cudaSetDevice") ||
      !cuda_ok(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "cudaStreamCreate a") ||
      !cuda_ok(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "cudaStreamCreate b"))
    return 1;
  void* counter_memory = nullptr;
  if (!cuda_ok(cudaMalloc(&counter_memory, sizeof(unsigned long long)), "cudaMalloc counter")) return 1;
  auto* counter = static_cast<unsigned long long*>(counter_memory);

  constexpr std::size_t bytes = std::size_t{64} << 20;
  void* p = ref.allocate_async(bytes, 256, cuda::stream_ref{a});
  cuda_ok(gk::launch_fill(p, bytes, 7, a), "fill on a");
  cuda_ok(cudaMemsetAsync(counter, 0, sizeof *counter, a), "memset");
  cuda_ok(gk::launch_count_mismatches(p, bytes, 7, counter, a), "check on a");
  unsigned long long bad = 1;
  cuda_ok(cudaMemcpyAsync(&bad, counter, sizeof bad, cudaMemcpyDeviceToHost, a), "copy back");
  cuda_ok(cudaStreamSynchronize(a), "sync a");
  expect(bad == 0, "the memory holds what the kernel wrote");

  // Used on b by a long kernel, freed on b: a's next request must not get it
  // before b's kernel has finished.
  cuda_ok(cudaStreamSynchronize(a), "sync a");
  cuda_ok(gk::launch_spin_fill(p, bytes, 9, 200ull * 1000 * 1000, b), "spin on b");
  ref.deallocate_async(p, bytes, 256, cuda::stream_ref{b});
  void* q = ref.allocate_async(bytes, 256, cuda::stream_ref{a});
  const cudaError_t running = cudaStreamQuery(b);
  if (running == cudaErrorNotReady) expect(q != p, "a block still in use on b is not handed to a");
  ref.deallocate_async(q, bytes, 256, cuda::stream_ref{a});
  cuda_ok(cudaDeviceSynchronize(), "sync");
  alloc.empty_cache();
  expect(alloc.get_device_stats(0).to_map().at("reserved_bytes.all.current") == 0, "empty_cache returns all");
  cudaFree(counter);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  std::printf("%s\n", failures == 0 ? "PASS" : "FAILED");
  return failures == 0 ? 0 : 1;
} catch (const std::exception& e) {
  std::printf("FAIL: %s\n", e.what());
  return 1;
}

// bench/gpu/bench_gpu.cpp: SPEC P on a real GPU, in one process and one run:
// ccalloc against the allocators CUDA itself offers.
//
//   ccalloc          caching_allocator over cuda_backend: malloc(0, size, stream) / free
//                    (the C++ API, the static libraries)
//   ccalloc_c        the C API through libccalloc.so (what PyTorch's pluggable
//                    allocator, CuPy and C runtimes call): ccalloc_malloc /
//                    ccalloc_delete on an allocator of its own (pair and mixed
//                    cases only)
//   cudaMallocAsync  the device's default memory pool with its release
//                    threshold at UINT64_MAX (the pool keeps what it got),
//                    cudaMallocAsync / cudaFreeAsync on the same stream
//   cub              cub::CachingDeviceAllocator(bin_growth 2, min_bin 9 (512 B),
//                    max_bin 28 (256 MiB), no cap on cached bytes), so every
//                    size of the cases is cached (its defaults cache only
//                    <= 2 MiB and 6 MB in all); DeviceAllocate / DeviceFree
//                    with the stream
//   cudaMalloc       cudaMalloc / cudaFree (pair case only)
//
// PyTorch's native allocator runs the same cases in bench_torch.cpp (a
// separate program, built against the installed torch); harness.hpp holds
// the cases and the output format, summarize.py merges the outputs.
//
// Usage: bench_gpu [--quick] [--only=ccalloc,ccalloc_c,cub,...] [--reps=N] [--thread-seconds=S]
//                  [--warm-up-seconds=S] [--mixed-repeats=N]
// Exit status 0 when every case ran, 1 when any printed ERROR.
#include "gpu/harness.hpp"
#include "gpu/timed_backend.hpp"

#include <ccalloc/backend/cuda_backend.hpp>
#include <ccalloc/ccalloc.h>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <cub/util_allocator.cuh>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

namespace {

namespace cb = ccalloc::bench;
using cb::cuda_check;

struct ccalloc_adapter {
  static constexpr const char* name = "ccalloc";
  // The CUDA backend behind a counter of its calls and their host time.
  std::shared_ptr<cb::timed_backend> backend =
      std::make_shared<cb::timed_backend>(std::make_shared<ccalloc::cuda_backend>());
  ccalloc::caching_allocator allocator{backend};

  ccalloc::device_stats last;  // counters at the end of the previous case
  cb::bench_clock::time_point case_start = cb::bench_clock::now();

  ccalloc_adapter() {
    allocator.init(1);
    last = allocator.device_allocator(0).stats();
  }
  void* alloc(std::size_t size_bytes, cudaStream_t stream) {
    return allocator.malloc(0, size_bytes, ccalloc::from_native_stream(stream));
  }
  void free(void* ptr, std::size_t /*size_bytes*/, cudaStream_t /*stream*/) { allocator.free(ptr); }
  void release() { allocator.empty_cache(); }
  // What the case cost beyond the cache (device 0's counters since the last case).
  void after_case(const std::string& case_text) {
    const ccalloc::device_stats now = allocator.device_allocator(0).stats();
    std::printf("INFO allocator=ccalloc %s device_alloc=%lld pages_mapped=%lld pages_unmapped=%lld "
                "pages_remapped=%lld device_synchronizations=%lld sync_all_streams=%lld\n",
                case_text.c_str(), static_cast<long long>(now.num_device_alloc - last.num_device_alloc),
                static_cast<long long>(now.num_pages_mapped - last.num_pages_mapped),
                static_cast<long long>(now.num_pages_unmapped - last.num_pages_unmapped),
                static_cast<long long>(now.num_pages_remapped - last.num_pages_remapped),
                static_cast<long long>(now.num_device_synchronizations - last.num_device_synchronizations),
                static_cast<long long>(now.num_sync_all_streams - last.num_sync_all_streams));
    // The driver's share of the case: the backend calls the allocator made
    // (count/host time per kind) against the case's wall time, warm-up included.
    double backend_ns = 0;
    const std::string calls = backend->take(&backend_ns);
    const double case_s = cb::seconds_since(case_start);
    std::printf("INFO allocator=ccalloc %s case_seconds=%.3f backend_seconds=%.4f backend_share=%.4f calls: %s\n",
                case_text.c_str(), case_s, backend_ns / 1e9, backend_ns / 1e9 / case_s, calls.c_str());
    std::fflush(stdout);
    last = now;
    case_start = cb::bench_clock::now();
  }
};

struct ccalloc_c_adapter {
  static constexpr const char* name = "ccalloc_c";
  ccalloc_allocator_t* allocator = nullptr;

  static void check(ccalloc_status_t status, const char* what) {
    if (status != CCALLOC_OK) throw std::runtime_error(std::string(what) + ": " + ccalloc_last_error());
  }
  ccalloc_c_adapter() {
    ccalloc_options_t o;
    ccalloc_options_init(&o);
    o.backend = CCALLOC_BACKEND_CUDA;
    check(ccalloc_create(&o, &allocator), "ccalloc_create");
    if (ccalloc_init(allocator, 1) != CCALLOC_OK) {
      const std::string message = ccalloc_last_error();
      ccalloc_destroy(allocator);
      throw std::runtime_error("ccalloc_init: " + message);
    }
  }
  ~ccalloc_c_adapter() { ccalloc_destroy(allocator); }
  ccalloc_c_adapter(const ccalloc_c_adapter&) = delete;
  ccalloc_c_adapter& operator=(const ccalloc_c_adapter&) = delete;
  void* alloc(std::size_t size_bytes, cudaStream_t stream) {
    void* p = nullptr;
    check(ccalloc_malloc(allocator, 0, size_bytes, reinterpret_cast<ccalloc_stream_t>(stream), &p), "ccalloc_malloc");
    return p;
  }
  void free(void* ptr, std::size_t /*size_bytes*/, cudaStream_t /*stream*/) {
    check(ccalloc_delete(allocator, ptr), "ccalloc_delete");
  }
  void release() { check(ccalloc_empty_cache(allocator), "ccalloc_empty_cache"); }
};

struct malloc_async_adapter {
  static constexpr const char* name = "cudaMallocAsync";
  cudaMemPool_t pool = nullptr;

  malloc_async_adapter() {
    cuda_check(cudaDeviceGetDefaultMemPool(&pool, 0), "cudaDeviceGetDefaultMemPool");
    std::uint64_t threshold = UINT64_MAX;
    cuda_check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
               "cudaMemPoolSetAttribute(ReleaseThreshold)");
  }
  void* alloc(std::size_t size_bytes, cudaStream_t stream) {
    void* p = nullptr;
    cuda_check(cudaMallocAsync(&p, size_bytes, stream), "cudaMallocAsync");
    return p;
  }
  void free(void* ptr, std::size_t /*size_bytes*/, cudaStream_t stream) {
    cuda_check(cudaFreeAsync(ptr, stream), "cudaFreeAsync");
  }
  void release() {
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cuda_check(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
  }
};

struct cub_adapter {
  static constexpr const char* name = "cub";
  cub::CachingDeviceAllocator allocator{2u, 9u, 28u, cub::CachingDeviceAllocator::INVALID_SIZE, false};

  void* alloc(std::size_t size_bytes, cudaStream_t stream) {
    void* p = nullptr;
    cuda_check(allocator.DeviceAllocate(0, &p, size_bytes, stream), "cub::CachingDeviceAllocator::DeviceAllocate");
    return p;
  }
  void free(void* ptr, std::size_t /*size_bytes*/, cudaStream_t /*stream*/) {
    cuda_check(allocator.DeviceFree(0, ptr), "cub::CachingDeviceAllocator::DeviceFree");
  }
  void release() { cuda_check(allocator.FreeAllCached(), "cub::CachingDeviceAllocator::FreeAllCached"); }
};

struct cuda_malloc_adapter {
  static constexpr const char* name = "cudaMalloc";
  void* alloc(std::size_t size_bytes, cudaStream_t /*stream*/) {
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, size_bytes), "cudaMalloc");
    return p;
  }
  void free(void* ptr, std::size_t /*size_bytes*/, cudaStream_t /*stream*/) { cuda_check(cudaFree(ptr), "cudaFree"); }
  void release() {}
};

template <class Adapter>
void run(const cb::stream_set& streams, const cb::settings& s, cb::case_set cases = {}) {
  if (!s.wants(Adapter::name)) return;
  try {
    Adapter a;
    cb::run_all(a, streams, s, cases);
  } catch (const std::exception& e) {
    cb::print_error(Adapter::name, "case=setup", e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const cb::settings s = cb::settings::from_args(argc, argv);
  try {
    cuda_check(cudaSetDevice(0), "cudaSetDevice");
    cuda_check(cudaFree(nullptr), "cudaFree(nullptr)");  // create the context before any timing
    cb::print_device_info("bench_gpu");
    cb::warm_up_host(s.warm_up_seconds);
    const cb::stream_set streams;
    run<ccalloc_adapter>(streams, s);
    run<ccalloc_c_adapter>(streams, s, cb::case_set{true, true, false, false, false});
    run<malloc_async_adapter>(streams, s);
    run<cub_adapter>(streams, s);
    run<cuda_malloc_adapter>(streams, s, cb::case_set{true, false, false, false, false});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu: %s\n", e.what());
    return 1;
  }
  return cb::errors_printed() ? 1 : 0;
}

// bench/gpu/bench_torch.cpp: SPEC P for PyTorch's native CUDA caching
// allocator, called from C++ as SPEC P's anchor table was measured:
// c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(size, stream) /
// raw_delete(ptr). Same cases and output as bench_gpu (harness.hpp), with
// allocator=torch.
//
// Not built by CMake: scripts/gpu.sh bench compiles it with g++ against the
// installed torch (c10 and c10_cuda only; no libtorch, no Python):
//
//   T=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")
//   g++ -std=c++20 -O2 -D_GLIBCXX_USE_CXX11_ABI=1 -Ibench -I$T/include
//       -I$T/include/torch/csrc/api/include -I/usr/local/cuda/include
//       bench/gpu/bench_torch.cpp -L$T/lib -lc10_cuda -lc10 -Wl,-rpath,$T/lib
//       -L/usr/local/cuda/lib64 -lcudart -Wl,-rpath,/usr/local/cuda/lib64 -pthread
//   (one command; see scripts/gpu.sh bench)
//
// The allocator backend is whatever PYTORCH_CUDA_ALLOC_CONF selects (the
// native one by default); it is printed as an INFO line.
//
// Usage: bench_torch [--quick] [--reps=N] [--thread-seconds=S] [--warm-up-seconds=S] [--mixed-repeats=N]
#include "gpu/harness.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

namespace {

namespace cb = ccalloc::bench;
namespace tca = c10::cuda::CUDACachingAllocator;

struct torch_adapter {
  static constexpr const char* name = "torch";

  torch_adapter() {
    // Python's torch.cuda initialization (ATen's CUDA hooks) does this; a
    // program linking only c10_cuda must. Growing to the same count again is
    // a no-op, so calling it unconditionally is safe.
    tca::init(static_cast<int>(c10::cuda::device_count()));
  }
  void* alloc(std::size_t size_bytes, cudaStream_t stream) {
    void* p = tca::raw_alloc_with_stream(size_bytes, stream);
    if (p == nullptr) throw std::runtime_error("raw_alloc_with_stream returned nullptr");
    return p;
  }
  void free(void* ptr, std::size_t /*size_bytes*/, cudaStream_t /*stream*/) { tca::raw_delete(ptr); }
  void release() { tca::emptyCache(); }
};

}  // namespace

int main(int argc, char** argv) {
  const cb::settings s = cb::settings::from_args(argc, argv);
  try {
    cb::cuda_check(cudaSetDevice(0), "cudaSetDevice");
    cb::cuda_check(cudaFree(nullptr), "cudaFree(nullptr)");  // create the context before any timing
    cb::print_device_info("bench_torch");
    cb::warm_up_host(s.warm_up_seconds);
    const cb::stream_set streams;
    torch_adapter a;
    std::printf("INFO torch_allocator=\"%s\"\n", tca::name().c_str());
    std::fflush(stdout);
    cb::run_all(a, streams, s);
  } catch (const std::exception& e) {
    // c10::Error derives from std::exception; its what() carries a backtrace.
    std::fprintf(stderr, "bench_torch: %s\n", e.what());
    return 1;
  }
  return cb::errors_printed() ? 1 : 0;
}

// Kernel launchers for the GPU tests (tests/gpu/gpu_kernels.cu, built with
// nvcc). Plain C++ declarations so that the tests themselves are ordinary C++
// built with the project's warnings. Each launcher returns the launch's
// cudaGetLastError() (the kernel itself runs asynchronously on `stream`).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace ccalloc_gpu_test {

/// The byte written at offset `i` of a buffer filled with `seed`.
/// (The kernels compute the same function on the device.)
inline unsigned char pattern_byte(std::size_t i, unsigned seed) noexcept {
  return static_cast<unsigned char>((i * 131u + seed * 7u + (i >> 9)) & 0xffu);
}

/// p[i] = pattern_byte(i, seed) for i in [0, n).
cudaError_t launch_fill(void* p, std::size_t n, unsigned seed, cudaStream_t stream);

/// *mismatches += number of i in [0, n) with p[i] != pattern_byte(i, seed).
/// `mismatches` is device memory.
cudaError_t launch_count_mismatches(const void* p, std::size_t n, unsigned seed, unsigned long long* mismatches,
                                    cudaStream_t stream);

/// Keeps writing pattern_byte(i, seed) to p[0, n) until at least
/// `duration_ns` nanoseconds of GPU global time have passed since the kernel
/// started (n may be 0: then it only spins). Used to keep a buffer busy on a
/// stream while the host frees and reallocates it.
cudaError_t launch_spin_fill(void* p, std::size_t n, unsigned seed, unsigned long long duration_ns,
                             cudaStream_t stream);

}  // namespace ccalloc_gpu_test

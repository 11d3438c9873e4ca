// Kernels for the GPU tests; see gpu_kernels.hpp.
#include "gpu_kernels.hpp"

namespace ccalloc_gpu_test {

namespace {

constexpr unsigned threads_per_block = 256;

__device__ __forceinline__ unsigned char device_pattern_byte(std::size_t i, unsigned seed) {
  return static_cast<unsigned char>((i * 131u + seed * 7u + (i >> 9)) & 0xffu);
}

__device__ __forceinline__ unsigned long long global_time_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

unsigned blocks_for(std::size_t n, unsigned max_blocks) {
  const std::size_t b = (n + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(b == 0 ? 1 : (b < max_blocks ? b : max_blocks));
}

__global__ void fill_kernel(unsigned char* p, std::size_t n, unsigned seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = device_pattern_byte(i, seed);
}

__global__ void count_mismatches_kernel(const unsigned char* p, std::size_t n, unsigned seed,
                                        unsigned long long* mismatches) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    bad += p[i] != device_pattern_byte(i, seed) ? 1 : 0;
  if (bad != 0) atomicAdd(mismatches, bad);
}

__global__ void spin_fill_kernel(unsigned char* p, std::size_t n, unsigned seed, unsigned long long duration_ns) {
  const unsigned long long start = global_time_ns();
  volatile unsigned char* v = p;  // every pass really writes
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  do {
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
      v[i] = device_pattern_byte(i, seed);
  } while (global_time_ns() - start < duration_ns);
}

}  // namespace

cudaError_t launch_fill(void* p, std::size_t n, unsigned seed, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  fill_kernel<<<blocks_for(n, 4096), threads_per_block, 0, stream>>>(static_cast<unsigned char*>(p), n, seed);
  return cudaGetLastError();
}

cudaError_t launch_count_mismatches(const void* p, std::size_t n, unsigned seed, unsigned long long* mismatches,
                                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  count_mismatches_kernel<<<blocks_for(n, 4096), threads_per_block, 0, stream>>>(static_cast<const unsigned char*>(p),
                                                                                 n, seed, mismatches);
  return cudaGetLastError();
}

cudaError_t launch_spin_fill(void* p, std::size_t n, unsigned seed, unsigned long long duration_ns,
                             cudaStream_t stream) {
  // Few enough blocks to be resident at once on any GPU, so that all of them
  // start (and stop) at about the same time.
  spin_fill_kernel<<<blocks_for(n, 64), threads_per_block, 0, stream>>>(static_cast<unsigned char*>(p), n, seed,
                                                                        duration_ns);
  return cudaGetLastError();
}

}  // namespace ccalloc_gpu_test

// pinned_bandwidth.cu: the reference figure for sleep and wake's kept
// contents (SPEC P9): the bandwidth of cudaMemcpyAsync between device
// memory and pinned host memory (cudaHostAlloc), device to host and host to
// device, for one 1 GiB buffer, best of 5. Prints `d2h_gib_per_s X` and
// `h2d_gib_per_s Y`. Built and run by scripts/gpu/sleep-wake.sh.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#define OK(x)                                                                     \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));               \
      return 1;                                                                   \
    }                                                                             \
  } while (0)

int main() {
  const size_t bytes = size_t{1} << 30;
  void* dev = nullptr;
  void* host = nullptr;
  cudaStream_t s;
  OK(cudaMalloc(&dev, bytes));
  OK(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
  OK(cudaStreamCreate(&s));
  OK(cudaMemset(dev, 1, bytes));
  double best[2] = {0, 0};
  for (int rep = 0; rep < 5; ++rep) {
    for (int dir = 0; dir < 2; ++dir) {
      OK(cudaStreamSynchronize(s));
      const auto t0 = std::chrono::steady_clock::now();
      if (dir == 0) OK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, s));
      else OK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s));
      OK(cudaStreamSynchronize(s));
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best[dir] = std::max(best[dir], 1.0 / sec);
    }
  }
  std::printf("d2h_gib_per_s %.2f\nh2d_gib_per_s %.2f\n", best[0], best[1]);
  OK(cudaFreeHost(host));
  OK(cudaFree(dev));
  return 0;
}

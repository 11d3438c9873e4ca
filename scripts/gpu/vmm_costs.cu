// vmm_costs.cu: what each CUDA virtual-memory call costs on this GPU, to
// choose how ccalloc maps and releases pages (pause, resume, growth).
// 1 GiB as 512 pages of 2 MiB, best of 3, microseconds per call and per GiB:
//   create        cuMemCreate of one 2 MiB page (plain; and shareable as a
//                 POSIX file descriptor, as ccalloc asks when IPC is possible)
//   map           cuMemMap of one page
//   access_page   cuMemSetAccess of one page
//   access_range  cuMemSetAccess of the whole 1 GiB (512 mappings) at once
//   unmap_page    cuMemUnmap of one page
//   unmap_range   cuMemUnmap of the whole 1 GiB (512 mappings) at once
//   release       cuMemRelease of a page's handle (after unmap)
//   create_1g     cuMemCreate of one 1 GiB handle, then mapped at 512
//                 offsets (map_offset) and set in one call
// Usage: vmm_costs   (prints `name us_per_call us_per_gib`)
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#define OK(x)                                                   \
  do {                                                          \
    CUresult r_ = (x);                                          \
    if (r_ != CUDA_SUCCESS) {                                   \
      const char* s_ = nullptr;                                 \
      cuGetErrorString(r_, &s_);                                \
      std::fprintf(stderr, "%s: %s\n", #x, s_ ? s_ : "?");      \
      std::exit(1);                                             \
    }                                                           \
  } while (0)

using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }

int main() {
  OK(cuInit(0));
  CUdevice dev;
  OK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  OK(cuDevicePrimaryCtxRetain(&ctx, dev));
  OK(cuCtxSetCurrent(ctx));
  const size_t page = 2u << 20, n = 512, total = page * n;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemAllocationProp sprop = prop;
  sprop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemAccessDesc acc{};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr base;
  OK(cuMemAddressReserve(&base, total, page, 0, 0));
  std::vector<CUmemGenericAllocationHandle> h(n);
  double best[12];
  std::fill(best, best + 12, 1e30);
  const char* names[12] = {"create",      "create_shareable", "map",        "access_page", "access_range", "unmap_page",
                           "unmap_range", "release",          "create_1g",  "map_offset",  "access_1g",    "unmap_release_1g"};
  for (int rep = 0; rep < 3; ++rep) {
    for (int shareable = 0; shareable < 2; ++shareable) {
      auto t0 = clk::now();
      for (size_t i = 0; i < n; ++i) OK(cuMemCreate(&h[i], page, shareable ? &sprop : &prop, 0));
      auto t1 = clk::now();
      best[shareable] = std::min(best[shareable], us(t0, t1) / n);
      for (size_t i = 0; i < n; ++i) OK(cuMemMap(base + i * page, page, 0, h[i], 0));
      auto t2 = clk::now();
      best[2] = std::min(best[2], us(t1, t2) / n);
      if (shareable) {
        for (size_t i = 0; i < n; ++i) OK(cuMemSetAccess(base + i * page, page, &acc, 1));
        best[3] = std::min(best[3], us(t2, clk::now()) / n);
      } else {
        OK(cuMemSetAccess(base, total, &acc, 1));
        best[4] = std::min(best[4], us(t2, clk::now()));
      }
      auto t3 = clk::now();
      if (shareable) {
        for (size_t i = 0; i < n; ++i) OK(cuMemUnmap(base + i * page, page));
        best[5] = std::min(best[5], us(t3, clk::now()) / n);
      } else {
        OK(cuMemUnmap(base, total));
        best[6] = std::min(best[6], us(t3, clk::now()));
      }
      auto t4 = clk::now();
      for (size_t i = 0; i < n; ++i) OK(cuMemRelease(h[i]));
      best[7] = std::min(best[7], us(t4, clk::now()) / n);
    }
    CUmemGenericAllocationHandle big;
    auto t0 = clk::now();
    OK(cuMemCreate(&big, total, &prop, 0));
    auto t1 = clk::now();
    bool offsets = true;
    for (size_t i = 0; i < n && offsets; ++i) offsets = cuMemMap(base + i * page, page, i * page, big, 0) == CUDA_SUCCESS;
    if (!offsets) {  // the driver maps a handle only whole: one mapping of 1 GiB
      (void)cuMemUnmap(base, total);
      OK(cuMemMap(base, total, 0, big, 0));
      names[9] = "map_1g_whole";
    }
    auto t2 = clk::now();
    OK(cuMemSetAccess(base, total, &acc, 1));
    auto t3 = clk::now();
    OK(cuMemUnmap(base, total));
    OK(cuMemRelease(big));
    auto t4 = clk::now();
    best[8] = std::min(best[8], us(t0, t1));
    best[9] = std::min(best[9], offsets ? us(t1, t2) / n : us(t1, t2));
    best[10] = std::min(best[10], us(t2, t3));
    best[11] = std::min(best[11], us(t3, t4));
  }
  std::printf("%-18s %12s %12s\n", "call", "us_per_call", "us_per_gib");
  for (int k = 0; k < 12; ++k) {
    const bool per_gib_call = k == 4 || k == 6 || k == 8 || k == 10 || k == 11 || (k == 9 && names[9][4] == '1');
    std::printf("%-18s %12.2f %12.1f\n", names[k], best[k], per_gib_call ? best[k] : best[k] * n);
  }
  OK(cuMemAddressFree(base, total));
  return 0;
}

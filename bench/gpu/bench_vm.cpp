// bench/gpu/bench_vm.cpp: what the driver's virtual memory calls cost on
// this GPU, per page of the allocation granularity (2 MiB on an H200): the
// calls ccalloc's expandable segments make when they map, recycle (unmap
// here, map there) and unmap pages. Tells how much a remapped page costs
// next to a cached malloc (docs/perf.md, issue 18's mixed case).
//
// Each line: RESULT vm call=NAME pages=N us_per_page=X (median of `reps`
// rounds of `pages` pages each, host wall clock).
//   create       cuMemCreate of one page
//   map          cuMemMap of one page (handle already created)
//   access       cuMemSetAccess of one page
//   access_run   cuMemSetAccess of N contiguous pages in one call (per page)
//   unmap        cuMemUnmap of one page
//   unmap_run    cuMemUnmap of N contiguous pages (each its own mapping) in one call (per page)
//   release      cuMemRelease of one handle
// Usage: bench_vm [pages (default 32)] [reps (default 7)]
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    cuGetErrorName(r, &name);
    throw std::runtime_error(std::string(what) + " failed: " + (name ? name : "?"));
  }
}

using clock_type = std::chrono::steady_clock;
double us_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  const int pages = argc > 1 ? std::max(1, std::atoi(argv[1])) : 32;
  const int reps = argc > 2 ? std::max(1, std::atoi(argv[2])) : 7;
  try {
    check(cuInit(0), "cuInit");
    CUdevice dev = 0;
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    CUcontext ctx = nullptr;
    check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    std::size_t page = 0;
    check(cuMemGetAllocationGranularity(&page, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity");
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUdeviceptr base = 0;
    const std::size_t span = page * static_cast<std::size_t>(pages);
    check(cuMemAddressReserve(&base, span, page, 0, 0), "cuMemAddressReserve");
    std::printf("INFO program=bench_vm page_bytes=%zu pages=%d reps=%d\n", page, pages, reps);

    std::vector<double> create, map, acc, acc_run, unmap, unmap_run, release;
    std::vector<CUmemGenericAllocationHandle> h(static_cast<std::size_t>(pages));
    for (int r = 0; r < reps; ++r) {
      auto t0 = clock_type::now();
      for (auto& x : h) check(cuMemCreate(&x, page, &prop, 0), "cuMemCreate");
      create.push_back(us_since(t0) / pages);
      // Page by page, as the allocator maps today.
      t0 = clock_type::now();
      for (int i = 0; i < pages; ++i) check(cuMemMap(base + i * page, page, 0, h[i], 0), "cuMemMap");
      map.push_back(us_since(t0) / pages);
      t0 = clock_type::now();
      for (int i = 0; i < pages; ++i) check(cuMemSetAccess(base + i * page, page, &access, 1), "cuMemSetAccess");
      acc.push_back(us_since(t0) / pages);
      t0 = clock_type::now();
      for (int i = 0; i < pages; ++i) check(cuMemUnmap(base + i * page, page), "cuMemUnmap");
      unmap.push_back(us_since(t0) / pages);
      // The same pages as runs: one access call and one unmap call.
      for (int i = 0; i < pages; ++i) check(cuMemMap(base + i * page, page, 0, h[i], 0), "cuMemMap");
      t0 = clock_type::now();
      check(cuMemSetAccess(base, span, &access, 1), "cuMemSetAccess(run)");
      acc_run.push_back(us_since(t0) / pages);
      t0 = clock_type::now();
      const CUresult ur = cuMemUnmap(base, span);
      unmap_run.push_back(ur == CUDA_SUCCESS ? us_since(t0) / pages : -1.0);
      if (ur != CUDA_SUCCESS)  // a run of mappings may not be unmappable at once: page by page then
        for (int i = 0; i < pages; ++i) (void)cuMemUnmap(base + i * page, page);
      t0 = clock_type::now();
      for (auto& x : h) check(cuMemRelease(x), "cuMemRelease");
      release.push_back(us_since(t0) / pages);
    }
    auto line = [&](const char* name, int n, const std::vector<double>& v) {
      std::printf("RESULT vm call=%s pages=%d us_per_page=%.2f\n", name, n, median(v));
    };
    line("create", 1, create);
    line("map", 1, map);
    line("access", 1, acc);
    line("access_run", pages, acc_run);
    line("unmap", 1, unmap);
    line("unmap_run", pages, unmap_run);
    line("release", 1, release);
    check(cuMemAddressFree(base, span), "cuMemAddressFree");
    check(cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_vm: %s\n", e.what());
    return 1;
  }
  return 0;
}

// The README's C++ quick start: one allocation on the simulated device.
#include <ccalloc/backend/sim_backend.hpp>  // or <ccalloc/backend/default_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <cstdio>
#include <memory>

int main() try {
  auto device = std::make_shared<ccalloc::sim_backend>();  // or ccalloc::make_default_backend()
  ccalloc::caching_allocator alloc(device);                 // reads CCALLOC_CONF
  alloc.init(device->device_count());

  ccalloc::stream_t stream = alloc.create_stream(0);
  void* p = alloc.malloc(/*device=*/0, /*size_bytes=*/64 << 20, stream);
  alloc.free(p);  // cached: the next 64 MiB request on this stream gets it back

  auto stats = alloc.get_device_stats(0).to_map();  // PyTorch's memory_stats() keys
  std::printf("peak reserved: %lld bytes\n", static_cast<long long>(stats.at("reserved_bytes.all.peak")));
  return 0;
} catch (const ccalloc::error& e) {  // config_error, out_of_memory_error, invalid_argument_error, ...
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}

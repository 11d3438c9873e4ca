// Uses the installed C++ headers and static libraries on a simulated device.
#include <ccalloc/backend/default_backend.hpp>
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <cstdio>
#include <memory>

int main() {
  auto device = std::make_shared<ccalloc::sim_backend>();
  ccalloc::caching_allocator alloc(device, ccalloc::allocator_config{});
  alloc.init(device->device_count());
  void* p = alloc.malloc(0, (1 << 20) + 1, ccalloc::default_stream);
  const auto stats = alloc.get_device_stats(0).to_map();
  const long long reserved = stats.at("reserved_bytes.all.current");
  alloc.free(p);
  // The default (expandable segments): the request's pages, 2 MiB.
  if (reserved != 2LL << 20) {
    std::printf("consumer_cpp: reserved %lld bytes, expected %lld\n", reserved, 2LL << 20);
    return 1;
  }
  (void)ccalloc::make_default_backend();  // the default backend links too
  std::printf("consumer_cpp: ok (%s backend, 2 MiB reserved for 1 MiB + 1 byte)\n", device->name().c_str());
  return 0;
}

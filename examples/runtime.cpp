// A C++ GPU runtime's use of ccalloc, on the simulated device (the same code
// runs on a GPU with ccalloc::make_default_backend()): two streams, a block
// used on both (record_stream), a private pool, statistics, and an
// out-of-memory error caught and survived. Prints what it checks and exits
// non-zero when a check fails.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <cstdint>
#include <cstdio>
#include <memory>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

int failures = 0;

void check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++failures;
}

std::int64_t stat(const ccalloc::caching_allocator& alloc, const char* key) {
  return alloc.get_device_stats(0).to_map().at(key);
}

}  // namespace

int main() try {
  // A simulated device of 1 GiB: host address space, a virtual clock.
  ccalloc::sim_options options;
  options.capacity_bytes = 1024 * MiB;
  auto device = std::make_shared<ccalloc::sim_backend>(options);
  ccalloc::caching_allocator alloc(device, ccalloc::allocator_config::parse("expandable_segments:True"));
  alloc.init(device->device_count());

  // Two streams. A block allocated on `compute` and also read on `copy`.
  const ccalloc::stream_t compute = alloc.create_stream(0);
  const ccalloc::stream_t copy = alloc.create_stream(0);
  void* activations = alloc.malloc(0, 64 * MiB, compute);
  device->enqueue_work(0, copy, device->now() + 100);  // a copy that runs until t+100
  alloc.record_stream(activations, copy);               // the block is in use on `copy` too
  alloc.free(activations);
  void* next = alloc.malloc(0, 64 * MiB, compute);
  check(next != activations, "a block freed while another stream still uses it is not handed out");
  device->advance_to(device->now() + 100);  // the copy has finished
  alloc.free(next);
  void* again = alloc.malloc(0, 64 * MiB, compute);
  check(again == activations || again == next, "once that stream's work is done, the memory is reused");
  alloc.free(again);

  // A private pool (PyTorch's MemPool): allocations on `copy` go to it
  // while the scope lives.
  const ccalloc::mempool_id_t pool = ccalloc::caching_allocator::new_pool_id();
  alloc.create_or_incref_pool(0, pool);
  void* staged = nullptr;
  {
    ccalloc::pool_scope scope(alloc, 0, pool, copy);
    staged = alloc.malloc(0, 8 * MiB, copy);
  }
  const ccalloc::pool_usage usage = alloc.get_pool_stats(0, pool);
  check(usage.allocated_bytes == 8 * MiB, "the pool holds the 8 MiB allocated in its scope");
  alloc.free(staged);
  alloc.release_pool(0, pool);

  // Statistics under PyTorch's names.
  check(stat(alloc, "allocated_bytes.all.peak") >= static_cast<std::int64_t>(64 * MiB),
        "allocated_bytes.all.peak counts the 64 MiB block");

  // Out of memory: an error naming the request; the allocator stays usable.
  try {
    (void)alloc.malloc(0, 4096 * MiB, compute);
    check(false, "a 4 GiB request on a 1 GiB device fails");
  } catch (const ccalloc::out_of_memory_error& e) {
    std::printf("caught: %.70s...\n", e.what());
    check(stat(alloc, "num_ooms") == 1, "num_ooms counts the failure");
  }
  void* after = alloc.malloc(0, 16 * MiB, compute);
  check(after != nullptr, "the allocator works after an out-of-memory error");
  alloc.free(after);
  alloc.empty_cache();
  check(stat(alloc, "reserved_bytes.all.current") == 0, "empty_cache gives every cached byte back");
  return failures == 0 ? 0 : 1;
} catch (const ccalloc::error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}

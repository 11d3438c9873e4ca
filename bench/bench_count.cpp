// bench/bench_count.cpp: N alloc+free pairs on the simulated device and
// nothing else, for counting instructions per pair with callgrind (a
// before/after measure that does not depend on a noisy machine):
//
//   bench_count pair|mixed N
//     pair   N pairs of 512 B on one stream (after one to warm the cache)
//     mixed  the mixed case (bench/common/cases.hpp): one warm-up pass, then N steps
//
//   CCALLOC_CONF=expandable_segments:False valgrind --tool=callgrind bench_count pair 200000
//   minus the same with N = 0, divided by N: instructions per pair. (The
//   simulated device's address-space reservation does not fit under
//   valgrind, hence plain segments.)
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include "common/cases.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 3 || (std::strcmp(argv[1], "pair") != 0 && std::strcmp(argv[1], "mixed") != 0)) {
    std::fprintf(stderr, "usage: bench_count pair|mixed N\n");
    return 2;
  }
  const long n = std::atol(argv[2]);
  auto backend = std::make_shared<ccalloc::sim_backend>();
  ccalloc::caching_allocator a{backend};
  a.init(1);
  const ccalloc::stream_t stream = backend->create_stream(0);
  if (std::strcmp(argv[1], "pair") == 0) {
    a.free(a.malloc(0, 512, stream));
    for (long i = 0; i < n; ++i) a.free(a.malloc(0, 512, stream));
    return 0;
  }
  static const auto plan = ccalloc::bench::make_mixed_plan();
  std::vector<void*> ring(ccalloc::bench::mixed_slots);
  for (std::size_t i = 0; i < ring.size(); ++i) ring[i] = a.malloc(0, plan.initial_sizes_bytes[i], stream);
  std::size_t pos = 0;
  auto step = [&] {
    const auto& st = plan.steps[pos];
    pos = pos + 1 == plan.steps.size() ? 0 : pos + 1;
    a.free(ring[st.slot]);
    ring[st.slot] = a.malloc(0, st.size_bytes, stream);
  };
  for (std::size_t i = 0; i < plan.steps.size(); ++i) step();  // warm-up: one pass
  for (long i = 0; i < n; ++i) step();
  for (void* p : ring) a.free(p);
  return 0;
}

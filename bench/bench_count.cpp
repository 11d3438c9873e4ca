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
//   simulated H200's address-space reservation does not fit under valgrind:
//   plain segments, or BENCH_COUNT_CAPACITY_GB=8 for a smaller device with
//   the default configuration's expandable segments.)
//
// BENCH_COUNT_HISTORY=on (history recorded) or =context (history with a
// context recorder at every malloc and free) counts the history's cost.
//
// After the run it prints one line to stderr: what the allocator did during
// the N measured pairs or steps (the counters' increase; the warm-up is not
// counted), e.g. for the mixed case's steady state (N = 65536: its second
// pass; issue 15):
//
//   stats mixed steps=4000000 pages_mapped=133 pages_unmapped=104 pages_remapped=104
//         device_allocs=29 device_frees=0 device_synchronizations=0 reserved_bytes=1038090240
//         ns_per_op=104.2
//
// (one line; with CCALLOC_CONF=recycle_time_percent:100, no time budget:
// 18,869 pages remapped at 851,443,712 B). The simulated device's host clock
// is the steady clock plus an H200's cost per virtual-memory call, so the
// recycling time budget acts as on a GPU. Reading the statistics happens after the measured loop: with
// N = 0 subtracted, the instruction count per pair is unchanged.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/stats.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include "common/cases.hpp"

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string_view>
#include <system_error>
#include <vector>

namespace {

/// N: a whole number of decimal digits (0 to LONG_MAX); nullopt otherwise
/// (empty, a sign, other characters, too large).
std::optional<long> parse_count(std::string_view text) {
  long value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || text.front() == '-' || ec != std::errc{} || end != text.data() + text.size())
    return std::nullopt;
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  const char* const usage = "usage: bench_count pair|mixed N   (N: pairs or steps, a whole number >= 0)\n";
  if (argc != 3 || (std::strcmp(argv[1], "pair") != 0 && std::strcmp(argv[1], "mixed") != 0)) {
    std::fprintf(stderr, "%s", usage);
    return 2;
  }
  const std::optional<long> parsed = parse_count(argv[2]);
  if (!parsed) {
    std::fprintf(stderr, "bench_count: bad N '%s': expected a whole number from 0 to %ld\n%s", argv[2],
                 std::numeric_limits<long>::max(), usage);
    return 2;
  }
  const long n = *parsed;
  // The allocator's time budgets see what a GPU program would: the steady
  // clock plus what the virtual-memory calls would have cost on an H200.
  ccalloc::sim_options so;
  so.host_clock_mode = ccalloc::sim_options::host_clock::steady;
  // BENCH_COUNT_CAPACITY_GB: a smaller simulated device (default an H200's
  // 141 GB), whose address-space reservation fits under valgrind, so that
  // the default configuration (expandable segments) can be counted too.
  if (const char* gb = std::getenv("BENCH_COUNT_CAPACITY_GB")) {
    const std::optional<long> value = parse_count(gb);
    if (!value || *value == 0 || *value > 4096) {
      std::fprintf(stderr, "bench_count: bad BENCH_COUNT_CAPACITY_GB '%s': expected a whole number from 1 to 4096\n", gb);
      return 2;
    }
    so.capacity_bytes = static_cast<std::size_t>(*value) * 1000 * 1000 * 1000;
  }
  auto backend = std::make_shared<ccalloc::sim_backend>(so);
  ccalloc::caching_allocator a{backend};
  a.init(1);
  // BENCH_COUNT_HISTORY=on records the memory history (a ring of 100,000
  // entries), =context also a context at every malloc and free (one shared
  // context: ccalloc's own cost of keeping it); unset: history off.
  if (const char* history = std::getenv("BENCH_COUNT_HISTORY")) {
    ccalloc::history_options h;
    h.max_entries = 100000;
    h.when = ccalloc::record_context::never;
    if (std::strcmp(history, "context") == 0) {
      h.when = ccalloc::record_context::all;
      auto context = std::make_shared<const ccalloc::trace_context>(
          std::vector<ccalloc::stack_frame>{{"step", "bench_count.cpp", 1}});
      h.recorder = [context] { return context; };
    }
    a.record_history(h);
  }
  const ccalloc::stream_t stream = backend->create_stream(0);
  // The counters' increase over the measured part, on stderr.
  // The wall time of the measured loop (two clock reads outside it): ns a
  // pair or step, for timing the same loop on another host (the GPU
  // machine's, scripts/gpu.sh mixed-layout); 0 when N = 0.
  using clock = std::chrono::steady_clock;
  clock::time_point started;
  auto print_stats = [&](const char* what, const char* unit, const ccalloc::device_stats& before) {
    const double ns = std::chrono::duration<double, std::nano>(clock::now() - started).count();
    const ccalloc::device_stats after = a.device_allocator(0).stats();
    const auto all = static_cast<std::size_t>(ccalloc::stat_group::all);
    std::fprintf(stderr,
                 "stats %s %s=%ld pages_mapped=%lld pages_unmapped=%lld pages_remapped=%lld device_allocs=%lld "
                 "device_frees=%lld device_synchronizations=%lld reserved_bytes=%lld ns_per_op=%.1f\n",
                 what, unit, n, static_cast<long long>(after.num_pages_mapped - before.num_pages_mapped),
                 static_cast<long long>(after.num_pages_unmapped - before.num_pages_unmapped),
                 static_cast<long long>(after.num_pages_remapped - before.num_pages_remapped),
                 static_cast<long long>(after.num_device_alloc - before.num_device_alloc),
                 static_cast<long long>(after.num_device_free - before.num_device_free),
                 static_cast<long long>(after.num_device_synchronizations - before.num_device_synchronizations),
                 static_cast<long long>(after.reserved_bytes[all].current), n > 0 ? ns / static_cast<double>(n) : 0.0);
  };
  if (std::strcmp(argv[1], "pair") == 0) {
    a.free(a.malloc(0, 512, stream));
    const ccalloc::device_stats before = a.device_allocator(0).stats();
    started = clock::now();
    for (long i = 0; i < n; ++i) a.free(a.malloc(0, 512, stream));
    print_stats("pair", "pairs", before);
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
  const ccalloc::device_stats before = a.device_allocator(0).stats();
  started = clock::now();
  for (long i = 0; i < n; ++i) step();
  print_stats("mixed", "steps", before);
  for (void* p : ring) a.free(p);
  return 0;
}

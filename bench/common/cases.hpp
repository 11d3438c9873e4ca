// bench/common/cases.hpp: the benchmark cases of SPEC P, shared by every
// benchmark program (bench_sim on the simulated device; bench_gpu and
// bench_torch on a real GPU), so that each allocator sees exactly the same
// sizes in the same order.
//
// Cases:
//   pair     one alloc + free of a fixed size on one stream, warm cache:
//            pair_sizes_bytes.
//   mixed    a ring of mixed_slots live blocks; each step frees one slot
//            and allocates a new size there (mixed_sequence). Sizes are
//            log-uniform over [mixed_min_bytes, mixed_max_bytes]: an octave
//            [2^e, 2^(e+1)) is picked uniformly, then a size uniformly in it.
//   threads  1 MiB pairs, 1..16 threads, each thread on its own stream.
//   churn    a ring of churn_slots live blocks; each step frees the oldest
//            and allocates a size log-uniform over [churn_min_bytes,
//            churn_max_bytes] (make_churn_sizes): the live total wanders, so
//            with expandable segments (ccalloc's default) pages are mapped
//            and free pages recycled.
//   cross    one thread allocates cross_pair_bytes on one stream and hands
//            each pointer (a queue of cross_queue_depth) to a second thread,
//            which frees it.
//
// Only the standard library: bench_torch is compiled outside CMake against
// PyTorch's headers.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ccalloc::bench {

inline constexpr std::size_t bench_kib = std::size_t{1} << 10;
inline constexpr std::size_t bench_mib = std::size_t{1} << 20;

/// Sizes of the pair case (bytes).
inline constexpr std::array<std::size_t, 5> pair_sizes_bytes{
    512, 4 * bench_kib, 1 * bench_mib, 16 * bench_mib, 256 * bench_mib};

/// The mixed case: live blocks, size range (bytes), seed, sequence length.
inline constexpr std::size_t mixed_slots = 64;
inline constexpr std::size_t mixed_min_bytes = 512;
inline constexpr std::size_t mixed_max_bytes = 64 * bench_mib;
inline constexpr std::uint64_t mixed_seed = 0x5eed'cca1'10c0'0001ull;
/// Steps in one pass of the generated sequence; runs cycle through it.
inline constexpr std::size_t mixed_sequence_length = std::size_t{1} << 16;

/// The threads case: pair size and thread counts (each on its own stream).
inline constexpr std::size_t threads_pair_bytes = 1 * bench_mib;
inline constexpr std::array<int, 5> thread_counts{1, 2, 4, 8, 16};
inline constexpr int max_threads = 16;

/// The churn case: live blocks, size range (bytes), seed, sequence length.
inline constexpr std::size_t churn_slots = 8;
inline constexpr std::size_t churn_min_bytes = 1 * bench_mib;
inline constexpr std::size_t churn_max_bytes = 128 * bench_mib;
inline constexpr std::uint64_t churn_seed = 0x5eed'cca1'10c0'0002ull;
inline constexpr std::size_t churn_sequence_length = 4096;

/// The cross case: pair size and the depth of the hand-over queue.
inline constexpr std::size_t cross_pair_bytes = 1 * bench_mib;
inline constexpr std::size_t cross_queue_depth = 64;

/// splitmix64: a tiny, fully specified generator (std::uniform_*_distribution
/// differ between standard libraries; this does not).
struct splitmix64 {
  std::uint64_t state;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
};

/// A log-uniform size in [mixed_min_bytes, mixed_max_bytes].
inline std::size_t mixed_size(splitmix64& rng) noexcept {
  constexpr unsigned lo_exp = 9;   // 2^9 = 512 = mixed_min_bytes
  constexpr unsigned hi_exp = 26;  // 2^26 = 64 MiB = mixed_max_bytes
  const unsigned e = lo_exp + static_cast<unsigned>(rng.next() % (hi_exp - lo_exp));
  const std::size_t octave = std::size_t{1} << e;
  const std::size_t size = octave + static_cast<std::size_t>(rng.next() % octave);
  return size > mixed_max_bytes ? mixed_max_bytes : size;
}

/// One step of the mixed case: free `slot`, then allocate `size_bytes` into it.
struct mixed_step {
  std::uint32_t slot;
  std::size_t size_bytes;
};

/// The mixed case's inputs: the sizes that first fill the ring, and the steps.
struct mixed_plan {
  std::vector<std::size_t> initial_sizes_bytes;  ///< mixed_slots entries
  std::vector<mixed_step> steps;                 ///< mixed_sequence_length entries
};

/// The same plan on every call (fixed seed).
inline mixed_plan make_mixed_plan() {
  splitmix64 rng{mixed_seed};
  mixed_plan plan;
  plan.initial_sizes_bytes.reserve(mixed_slots);
  for (std::size_t i = 0; i < mixed_slots; ++i) plan.initial_sizes_bytes.push_back(mixed_size(rng));
  plan.steps.reserve(mixed_sequence_length);
  for (std::size_t i = 0; i < mixed_sequence_length; ++i) {
    const auto slot = static_cast<std::uint32_t>(rng.next() % mixed_slots);
    plan.steps.push_back({slot, mixed_size(rng)});
  }
  return plan;
}

/// The churn case's sizes: churn_slots to fill the ring, then one per step
/// (churn_sequence_length); log-uniform over [churn_min_bytes, churn_max_bytes).
inline std::vector<std::size_t> make_churn_sizes() {
  splitmix64 rng{churn_seed};
  constexpr unsigned lo_exp = 20;  // 1 MiB = churn_min_bytes
  constexpr unsigned hi_exp = 27;  // 128 MiB = churn_max_bytes
  std::vector<std::size_t> sizes;
  sizes.reserve(churn_slots + churn_sequence_length);
  for (std::size_t i = 0; i < churn_slots + churn_sequence_length; ++i) {
    const unsigned e = lo_exp + static_cast<unsigned>(rng.next() % (hi_exp - lo_exp));
    const std::size_t octave = std::size_t{1} << e;
    sizes.push_back(octave + static_cast<std::size_t>(rng.next() % octave));
  }
  return sizes;
}

}  // namespace ccalloc::bench

// How the allocator stores its per-pool statistics (device_stats' stat_arrays)
// so that the hot path writes as little as it can; what callers read is
// unchanged (stats_as_read).
//
// A stat_array holds one stat per stat_group: all, small_pool, large_pool.
// Every change of a pooled counter is in one pool (small or large), so the
// stored form keeps, per counter:
//   [small_pool], [large_pool]: current, peak and allocated as read; `freed`
//     holds the current value at the last reset of the accumulated counts
//     (0 before any), since freed = allocated - current + that value
//     (every increase adds to current and allocated, every decrease takes
//     from current what it adds to freed);
//   [all]: current and peak as read (the peak of the sum needs the sum at
//     every increase); allocated and freed are the sums of the pools' and
//     are not stored (left 0).
// A decrease writes one current per group instead of current and freed of
// two stats; an increase writes no `all.allocated`. Every pooled counter of
// the core (its device stats and the streams' pending deltas) is written
// through count_up/count_down only, and read through stats_as_read.
#pragma once

#include <ccalloc/core/stats.hpp>

#include <cstddef>
#include <cstdint>

namespace ccalloc::detail {

inline constexpr std::size_t all_group = static_cast<std::size_t>(stat_group::all);

/// Adds `amount` (>= 0) to the counter `s` in pool `group` (small_pool or large_pool).
inline void count_up(stat_array& s, stat_group group, std::int64_t amount) noexcept {
  stat& g = s[static_cast<std::size_t>(group)];
  g.current += amount;
  g.allocated += amount;
  if (g.current > g.peak) g.peak = g.current;
  stat& all = s[all_group];
  all.current += amount;
  if (all.current > all.peak) all.peak = all.current;
}

/// Takes `amount` (>= 0) from the counter `s` in pool `group`.
inline void count_down(stat_array& s, stat_group group, std::int64_t amount) noexcept {
  s[static_cast<std::size_t>(group)].current -= amount;
  s[all_group].current -= amount;
}

/// Counts `n` accumulated increases and decreases of `s` in `group` that
/// left its current value as it was (a thread cache hit: a free and an
/// allocation of the same block).
inline void count_through(stat_array& s, stat_group group, std::int64_t n) noexcept {
  s[static_cast<std::size_t>(group)].allocated += n;
}

/// `stored` as callers read it: freed and the `all` group's accumulated
/// counts filled in for every stat_array (the single stats are stored as read).
device_stats stats_as_read(const device_stats& stored) noexcept;

/// reset_accumulated of stored statistics: allocated and freed read 0 after it.
void reset_accumulated_stored(device_stats& stored) noexcept;

}  // namespace ccalloc::detail

// Placement of a request that maps pages in an expandable segment: the free
// runs of a stream's reservations (or of an idle one of another stream)
// offered to it, and the best kept (run_placement.cpp). Private to the core.
#pragma once

#include "block.hpp"
#include "pools.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>

namespace ccalloc::detail {

// A device's segments by base address (device_state::segments_).
using segment_map = std::map<std::uintptr_t, std::unique_ptr<segment>>;
// The reservations (expandable segments) of a device by base address
// (expandable_segments::reservations).
using reservation_map = std::map<std::uintptr_t, segment*>;

// Placement of a request that maps pages (alloc_expandable, step 1): a free
// run (free blocks between blocks in use) of at least `size` bytes, the
// best by fewest pages to map, then own reservation before an idle one of
// another stream (foreign), then the shortest run, then the oldest segment
// and lowest offset: a total order, so the runs may be offered in any order.
struct run_choice {
  segment* seg = nullptr;
  block* first = nullptr;  // the run's first block
  std::uintptr_t start = 0;  // where the request starts in the run (first->ptr unless past a retired page)
  bool foreign = false;
  bool retired = true;     // the request would map over a retired page (a wait)
  std::size_t pages = std::numeric_limits<std::size_t>::max();  // to map for the request
  std::size_t run = std::numeric_limits<std::size_t>::max();    // the run's bytes
};
// Offers the free run of seg starting with block `first`, `run` bytes long,
// to a request of `size` bytes (run_placement.cpp says how it is placed).
void consider_run(run_choice& best, segment& seg, bool foreign, block* first, std::size_t run,
                  std::size_t size) noexcept;
// Offers every free run of seg, walking all its blocks.
void scan_runs(run_choice& best, segment& seg, bool foreign, std::size_t size) noexcept;
// Offers the free runs of pool's expandable segments that can be the best:
// those around an unmapped block (seg.unmapped), and the free mapped blocks
// of at least `size` bytes without a free neighbour (pool's index). O(unmapped
// blocks + the pool's free blocks of `size` or more), not O(blocks).
void best_own_run(const reservation_map& reservations, block_pool& pool, std::size_t size, run_choice& best) noexcept;
// The same by scan_runs over every block (check_invariants compares them).
void best_own_run_by_scan(const reservation_map& reservations, const block_pool& pool, std::size_t size,
                          run_choice& best) noexcept;

}  // namespace ccalloc::detail

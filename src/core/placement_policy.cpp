// Where a block is carved in an expandable segment's free block: the page
// rules of the placement policy (placement_policy.hpp).
#include "detail/device_state.hpp"

#include <ccalloc/base/detail/assert.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace ccalloc::detail {

// Where a block of `size` bytes that falls just short of a whole number of
// pages, or reaches just past a page boundary, or is 8 pages or more and
// would touch a page more than it needs (page_sliver), starts in free
// block b of an expandable segment's large pool; `back`: the end
// place_at_back chose. The block is
// carved at that end, or at one of the two nearest positions where it starts
// or ends on a page boundary, whichever takes the fewest of b's wholly free
// pages (the pages in use grow the least), then touches the fewest pages;
// ties go to that order. Carved flush against a neighbour that is not on a
// page boundary, such a block straddles one page more than it needs: when
// the blocks around it are freed and their pages recycled, it keeps that
// extra page mapped for its whole life. A run of equal blocks carved one
// after another drifts off page boundaries by the shortfall at each block.
// take_found_block asks only where free pages are recycled at every new
// peak: with recycling limited (recycles_per_peak) or off, the neighbours'
// pages stay mapped, the page is not saved, and the pieces left beside such
// blocks only cost. The replays behind this: docs/design.md, "Note: why
// blocks are carved on page boundaries".
std::uintptr_t placement_policy::page_aligned_start(const block& b, std::size_t size, bool back) noexcept {
  const segment& seg = *b.seg;
  const std::size_t page = seg.page_bytes;
  const std::uintptr_t lo = b.ptr;
  const std::uintptr_t hi = b.ptr + b.size;
  CCALLOC_ASSERT(seg.expandable && b.size >= size);
  const auto down = [&](std::uintptr_t x) { return seg.base + (x - seg.base) / page * page; };
  const auto up = [&](std::uintptr_t x) { return seg.base + (x - seg.base + page - 1) / page * page; };
  // b's wholly free pages; the pages at its ends are partly in use by its
  // neighbours (or b's ends are on page boundaries).
  const std::uintptr_t whole_lo = up(lo);
  const std::uintptr_t whole_hi = std::max(whole_lo, down(hi));
  std::uintptr_t candidates[3];
  std::size_t n = 0;
  if (back) {
    candidates[n++] = hi - size;
    if (down(hi - size) >= lo) candidates[n++] = down(hi - size);  // starts on a boundary
    if (down(hi) >= lo + size) candidates[n++] = down(hi) - size;  // ends on one
  } else {
    candidates[n++] = lo;
    if (up(lo + size) <= hi) candidates[n++] = up(lo + size) - size;  // ends on a boundary
    if (up(lo) + size <= hi) candidates[n++] = up(lo);                // starts on one
  }
  std::uintptr_t best = candidates[0];
  std::size_t best_added = std::numeric_limits<std::size_t>::max();
  std::size_t best_touched = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uintptr_t first = down(candidates[i]);
    const std::uintptr_t last = up(candidates[i] + size);
    const std::uintptr_t added_lo = std::max(first, whole_lo);
    const std::uintptr_t added_hi = std::min(last, whole_hi);
    const std::size_t added = added_hi > added_lo ? (added_hi - added_lo) / page : 0;
    const std::size_t touched = (last - first) / page;
    if (added < best_added || (added == best_added && touched < best_touched)) {
      best = candidates[i];
      best_added = added;
      best_touched = touched;
    }
  }
  return best;
}

// Best fit `at` (free block b, larger than p.size) is a free island: a free
// mapped run of p's expandable large pool with no block in use beside it
// (both its neighbours unmapped, or the segment's ends), whose pages the
// next new peak recycles whole. Carved, it starts a new run of live blocks,
// and a request that is not a whole number of pages leaves the end page of
// that run partly free: stranded, once the free pages around it are
// recycled, for as long as the block lives. So such a request takes the
// fitting free block at the lowest address instead (oldest segment first;
// b itself when it is the lowest): blocks allocated one after another land
// one after another, in few runs, and the islands stay whole for
// recycling. A program that loads its model again (load, run, free, in a
// loop) otherwise spreads the weights over the islands its last run left,
// by size, each of them stranding up to a page (the replays: docs/design.md,
// "Note: why blocks are carved on page boundaries"). A request of whole
// pages strands nothing: best fit. Only
// where free pages are recycled at every new peak (as page_aligned_start):
// otherwise the islands stay mapped, and best fit keeps PyTorch's rule. The
// scan goes over the pool's larger free blocks, in this case only.
block_index::position placement_policy::lowest_fitting_block(const alloc_params& p,
                                                             block_index::position at) const noexcept {
  if (!recycles_at_every_peak()) return at;
  if (p.size % p.pool->blocks.at(at)->seg->page_bytes == 0) return at;  // strands nothing: best fit
  const block_index& index = p.pool->blocks;
  block_index::position best = at;
  const block* lowest = index.at(at);
  for (block_index::position j = index.next(at); j != block_index::end(); j = index.next(j)) {
    const block* c = index.at(j);
    if (!oversize_rules_allow(p.size, c->size)) break;  // the sizes only grow from here
    if (!c->seg->expandable) continue;
    const bool lower = c->seg->seq != lowest->seg->seq ? c->seg->seq < lowest->seg->seq
                                                       : c->ptr - c->seg->base < lowest->ptr - lowest->seg->base;
    if (lower) {
      best = j;
      lowest = c;
    }
  }
  return best;
}

}  // namespace ccalloc::detail

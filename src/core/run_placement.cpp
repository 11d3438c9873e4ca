// Placement of a request that maps pages in an expandable segment
// (alloc_expandable, step 1): the free runs offered and the best chosen.
// See detail/run_placement.hpp.
#include "detail/run_placement.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>

namespace ccalloc::detail {

// Offers the free run of seg starting with block `first`, `run` bytes long,
// to a request of `size` bytes (run_choice). An idle reservation of another
// stream (foreign) is offered only when it saves pages: it is adopted whole.
// The request starts at the run's start, or, where it would cover a retired
// page (a deferred unmap), on the page after it, if the run is long enough;
// else the run is offered at its start, marked retired (chosen last: mapping
// there waits for the deferred unmap).
void consider_run(run_choice& best, segment& seg, bool foreign, block* first, std::size_t run,
                  std::size_t size) noexcept {
  if (run < size) return;
  const std::size_t page = seg.page_bytes;
  const std::uintptr_t run_end = first->ptr + run;
  std::uintptr_t start = first->ptr;
  bool retired = false;
  if (!seg.pages.retired().empty()) {
    for (;;) {
      const std::size_t lo = (start - seg.base) / page;
      const std::size_t hi = (start + size - seg.base + page - 1) / page;
      const auto past = seg.pages.retired_from(hi);
      if (past == seg.pages.retired().begin() || std::prev(past)->index < lo) break;  // none under it
      start = seg.base + (std::prev(past)->index + 1) * page;  // past the last one under it
      if (start + size > run_end) {
        start = first->ptr;
        retired = true;
        break;
      }
    }
  }
  const std::uintptr_t end = start + size;
  std::size_t n = 0;  // pages to map: those of the unmapped blocks under the request
  for (const block* x = first; x != nullptr && x->ptr < end; x = x->next) {
    const std::uintptr_t lo = std::max(x->ptr, start);
    const std::uintptr_t hi = std::min(end, x->ptr + x->size);
    if (!x->mapped && lo < hi) n += (hi - lo + page - 1) / page;  // unmapped blocks and start: on page boundaries
  }
  if (foreign && n >= (size + page - 1) / page) return;  // adopting would save nothing
  const bool better = retired != best.retired ? !retired
                      : n != best.pages         ? n < best.pages
                      : foreign != best.foreign ? !foreign
                      : run != best.run         ? run < best.run
                      : best.seg != nullptr &&
                            (seg.seq != best.seg->seq ? seg.seq < best.seg->seq
                                                      : start - seg.base < best.start - best.seg->base);
  if (best.seg == nullptr || better) best = {&seg, first, start, foreign, retired, n, run};
}

void scan_runs(run_choice& best, segment& seg, bool foreign, std::size_t size) noexcept {
  for (block* x = seg.head; x != nullptr;) {
    if (!x->is_free()) {
      x = x->next;
      continue;
    }
    block* first = x;
    std::size_t run = 0;
    for (; x != nullptr && x->is_free(); x = x->next) run += x->size;
    consider_run(best, seg, foreign, first, run, size);
  }
}

// Which runs can be the best (walking every block made a malloc that maps
// pages cost O(live blocks): docs/perf.md, "A malloc that maps pages no
// longer walks every block"): a run with an
// unmapped block is found from that block; a run without one is a single
// free mapped block (free mapped neighbours merge), in the pool's index, and
// only one of at least `size` bytes can take the request. Among those the
// smallest wins (no page to map, the shortest run), so the index is read
// from `size` up to the first size that has one. Free mapped blocks alternate
// with unmapped ones inside a run, so the runs found from seg.unmapped have
// at most twice as many blocks as it has entries.
void best_own_run(const reservation_map& reservations, block_pool& pool, std::size_t size, run_choice& best) noexcept {
  for (const auto& [base, reservation] : reservations) {
    segment& seg = *reservation;
    if (seg.head->pool != &pool) continue;
    std::uintptr_t offered_up_to = seg.base;  // the end of the last run offered
    for (block* u : seg.unmapped) {
      if (u->ptr < offered_up_to) continue;  // in that run
      block* first = u;
      while (first->prev != nullptr && first->prev->is_free()) first = first->prev;
      std::size_t run = 0;
      for (const block* x = first; x != nullptr && x->is_free(); x = x->next) run += x->size;
      offered_up_to = first->ptr + run;
      consider_run(best, seg, false, first, run, size);
    }
  }
  std::size_t offered_size = 0;
  for (auto j = pool.blocks.lower_bound(size); j != block_index::end(); j = pool.blocks.next(j)) {
    block* c = pool.blocks.at(j);
    if (offered_size != 0 && c->size > offered_size) break;  // longer: loses to the one offered
    const bool alone = (c->prev == nullptr || !c->prev->is_free()) && (c->next == nullptr || !c->next->is_free());
    if (!c->seg->expandable || !alone) continue;
    consider_run(best, *c->seg, false, c, c->size, size);
    offered_size = c->size;
  }
}

void best_own_run_by_scan(const reservation_map& reservations, const block_pool& pool, std::size_t size,
                          run_choice& best) noexcept {
  for (const auto& [base, reservation] : reservations)
    if (reservation->head->pool == &pool) scan_runs(best, *reservation, false, size);
}

}  // namespace ccalloc::detail

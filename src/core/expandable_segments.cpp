// Expandable segments (B7, X3): reservations, page mapping, page recycling.
//
// An expandable segment is one address-space reservation per (stream, pool),
// as large as the device. A request that no cached block serves is placed in
// the best free run of the stream's reservation (fewest pages to map, then
// the shortest run, then the lowest address), and the run's missing pages are
// mapped. Inside a free block (cached, or the run just mapped), a block is
// carved flush against its neighbour in use (place_at_back), except where
// flush it would touch a page more than it needs and free pages are
// recycled at every new peak: a sliver of a page past a boundary or short
// of whole pages, or a block of page_aligned_block_pages (8) pages or more
// (page_sliver); it then starts or ends on a page boundary where that maps
// no page more (page_aligned_start), so that it keeps only the pages it
// needs once its neighbours are freed. When mapping would raise reserved memory past its high-water mark
// (trim_on_new_peak) or past the memory-fraction cap, free whole pages of any
// stream are unmapped first and their physical handles mapped where they are
// needed (X3), so the reservation does not grow while free pages exist;
// first those of the free blocks that leave the fewest bytes behind in
// partial pages (partial_page_bytes).
// A stream that has gone idle (nothing allocated or waiting in its
// reservation, its page fences completed) hands its reservation over whole
// when that needs fewer new pages than the request's own placement: a new
// side stream per step then takes the last one's mapped pages where they
// are, instead of each page being unmapped and mapped again.
// Page recycling (unmapping free pages), page fences and deferred unmaps:
// page_recycling.cpp.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"

#include <ccalloc/base/detail/assert.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ccalloc::detail {


expandable_segments::expandable_segments(device_state& d) : d_(d) {
  if (d.backend().capabilities().virtual_memory) page_bytes_ = d.backend().vm_granularity(d.device());
}

// Expandable segments need the backend's virtual memory: an explicit
// expandable_segments:True without it is an error; the default falls back to
// plain segments (expandable_segments_ says which one is in force).
void expandable_segments::check_supported(const allocator_config& config) const {
  if (config.expandable_segments && page_bytes_ == 0 && config.expandable_segments_set)
    throw config_error("ccalloc config: expandable_segments:True needs virtual memory (cuMemMap), which the '" +
                       d_.backend().name() + "' backend of device " + std::to_string(d_.device()) +
                       " does not offer (accepted here: expandable_segments:False)");
}

void expandable_segments::pool_insert_counted(block* b) {
  b->gc_count_base = b->pool->get_free_blocks_call_count;
  b->pool->blocks.insert(b);
  const stat_group g = group_of(b->pool);
  count_up(d_.stats().values().inactive_split, g, 1);
  count_up(d_.stats().values().inactive_split_bytes, g, static_cast<std::int64_t>(b->size));
}

void expandable_segments::pool_erase_counted(block* b) {
  b->pool->blocks.erase(b);
  const stat_group g = group_of(b->pool);
  count_down(d_.stats().values().inactive_split, g, 1);
  count_down(d_.stats().values().inactive_split_bytes, g, static_cast<std::int64_t>(b->size));
}

// Marks the page-aligned range [lo, hi) of `seg` mapped or unmapped. Every
// block overlapping it is free and in the other state. Splits blocks at lo
// and hi, merges free neighbours of equal state, and keeps pool membership,
// the inactive-split statistics and seg.unmapped right.
// reserve_only: only the host memory it needs (may throw std::bad_alloc),
// so that a caller can take it before the device changes the pages.
void expandable_segments::set_page_state(segment& seg, std::uintptr_t lo, std::uintptr_t hi, bool mapped, block* hint,
                                         bool reserve_only) {
  if (lo >= hi) return;
  block* b = hint != nullptr ? hint : unmapped_block_at_or_below(seg, lo);
  CCALLOC_ASSERT(b->seg == &seg && b->ptr <= lo);
  while (b->ptr + b->size <= lo) b = b->next;
  block* first = b->prev != nullptr ? b->prev : b;
  block* last = b;
  while (last->ptr + last->size < hi) last = last->next;
  block* stop = last->next != nullptr ? last->next : last;
  // The window [first, stop] keeps its extent (splits and merges stay inside
  // it, and `first`, the lowest, is never merged away): its entries in
  // seg.unmapped are listed again from its blocks when done, even on an
  // exception. Room for them first (at most two blocks more than now), while
  // nothing has changed.
  std::size_t window_blocks = 1;
  for (const block* x = first; x != stop; x = x->next) ++window_blocks;
  std::vector<block*>& listed = seg.unmapped;
  listed.reserve(listed.size() + window_blocks + 2);
  // The rest of the host memory too, so that running out changes nothing:
  // block objects for the splits at lo and hi, and room in the pool's index
  // for the free mapped blocks left (the range when mapping, one insert; its
  // two ends when unmapping: into one bin, perhaps).
  block_pool& pool = *seg.head->pool;
  pool.owner->reserve_spare_blocks(2);
  if (mapped) {
    if (pool.blocks.owes()) pool.blocks.repay();
  } else {
    pool.blocks.reserve_two(lo - std::min(lo, b->ptr), last->ptr + last->size - std::min(hi, last->ptr + last->size));
  }
  if (reserve_only) return;
  const std::uintptr_t window_hi = stop->ptr + stop->size;
  const auto below = [](const block* x, std::uintptr_t addr) { return x->ptr < addr; };
  const auto listed_lo = std::lower_bound(listed.begin(), listed.end(), first->ptr, below) - listed.begin();
  const auto listed_hi = std::lower_bound(listed.begin(), listed.end(), window_hi, below) - listed.begin();
  const auto relist = [&]() noexcept {
    listed.erase(listed.begin() + listed_lo, listed.begin() + listed_hi);
    auto at = listed.begin() + listed_lo;
    for (block* x = first; x != nullptr && x->ptr < window_hi; x = x->next)
      if (!x->mapped) at = listed.insert(at, x) + 1;  // within the capacity reserved: no allocation
  };
  try {
    for (block* x = first;; x = x->next) {
      if (x->mapped && x->is_free()) pool_erase_counted(x);
      if (x == stop) break;
    }
    if (b->ptr < lo) {
      b = d_.split_free_block(b, lo);
      if (stop == b->prev) stop = b;  // the split block was the window's end
    }
    for (block* x = b; x != nullptr && x->ptr < hi; x = x->next) {
      if (x->ptr + x->size > hi) {
        block* upper = d_.split_free_block(x, hi);
        if (stop == x) stop = upper;
      }
      x->mapped = mapped;
    }
    for (block* x = first;;) {
      block* nx = x->next;
      if (x != stop && nx != nullptr && x->is_free() && nx->is_free() && x->mapped == nx->mapped) {
        x->size += nx->size;
        x->free_seq = std::max(x->free_seq, nx->free_seq);
        x->next = nx->next;
        if (x->next != nullptr) x->next->prev = x;
        if (nx == stop) stop = x;
        nx->pool->owner->delete_block(nx);
        continue;
      }
      if (x->mapped && x->is_free()) pool_insert_counted(x);
      if (x == stop) break;
      x = nx;
    }
  } catch (...) {
    relist();
    throw;
  }
  relist();
}

// The unmapped block of seg at the highest address at or below addr; the
// segment's first block when there is none.
block* expandable_segments::unmapped_block_at_or_below(const segment& seg, std::uintptr_t addr) noexcept {
  const auto above = std::upper_bound(seg.unmapped.begin(), seg.unmapped.end(), addr,
                                      [](std::uintptr_t a, const block* x) { return a < x->ptr; });
  return above == seg.unmapped.begin() ? seg.head : *std::prev(above);
}

segment* expandable_segments::new_expandable_segment(const alloc_params& p) {
  const std::size_t page = page_bytes_;
  const std::size_t want = std::max(d_.memory().total(), p.size);
  if (want > std::numeric_limits<std::size_t>::max() - page) return nullptr;  // no such address range
  const std::size_t size = (want + page - 1) / page * page;
  // The address range first (a device that has none left says so before
  // a page table for it is made), then the host memory: the reservation's
  // record, page table and block; without it, the range goes back.
  void* base = d_.backend().vm_reserve(d_.device(), size);
  if (base == nullptr) return nullptr;
  segment* added = nullptr;
  auto slot = reservations_.end();
  try {
    if (maybe_empty_.capacity() < reservations_.size() + 1) maybe_empty_.reserve(2 * reservations_.size() + 16);
    slot = reservations_.emplace(reinterpret_cast<std::uintptr_t>(base), nullptr).first;
    auto fresh = std::make_unique<segment>();
    fresh->pages.reset(size / page);
    fresh->unmapped.reserve(4);
    added = &d_.segments().add_segment(p, std::move(fresh), reinterpret_cast<std::uintptr_t>(base), size);
    slot->second = added;
  } catch (...) {
    if (slot != reservations_.end()) reservations_.erase(slot);
    try {
      d_.backend().vm_release(d_.device(), base, size);
    } catch (...) {  // the first error is the one thrown; the reservation stays with the device
    }
    throw;
  }
  segment& seg = *added;
  d_.memory().note_made(&p, seg.base);  // a failed request gives it back
  seg.head->mapped = false;
  seg.expandable = true;
  seg.seq = next_segment_seq_++;
  seg.page_bytes = page;
  seg.unmapped.push_back(seg.head);  // reserved
  note_maybe_empty(seg);
  return &seg;
}

// Mapped page i of seg back to the device and off the books (a failed
// request gives back what it mapped). A device that refuses the unmap
// still holds the page: it is retired instead, given up (released at its
// deferred unmap, which the next settle_retired tries again: emptyCache, a
// slow path that recycled pages, a request over it) and counted as reserved
// until then. Other device errors (the handle's release) are ignored.
void expandable_segments::give_back_page(segment& seg, std::size_t i) noexcept {
  const std::size_t page = seg.page_bytes;
  const physical_handle_t h = seg.pages.handle(i);
  try {
    d_.backend().vm_unmap(d_.device(), reinterpret_cast<void*>(seg.base + i * page), page);
  } catch (...) {
    if (retire_refused_page(seg, i, h)) return;
    // No host memory for the record: the page leaves the books (below).
  }
  ++d_.stats().values().num_pages_unmapped;
  ++d_.stats().values().num_device_free;
  try {
    release_page_handle(h);  // a recycled page may be retired elsewhere too
  } catch (...) {  // noexcept cleanup: the handle is the device's now
  }
  seg.pages.set_unmapped(i);
  seg.mapped_bytes -= page;
  if (seg.mapped_bytes == 0) note_maybe_empty(seg);
  d_.memory().remove_reserved(page);
  count_down(d_.stats().values().reserved_bytes, group_of(seg.head->pool), static_cast<std::int64_t>(page));
}

// Page i of seg (handle h), whose unmap the device refused: retired, given
// up (page_table::retired_page::release), still counted as reserved; off
// the segment's mapped bytes. False (nothing changed) without host memory
// for the record.
bool expandable_segments::retire_refused_page(segment& seg, std::size_t i, physical_handle_t h) noexcept {
  try {
    seg.pages.reserve_retired(1);
  } catch (...) {
    return false;
  }
  ++d_.stats().values().num_pages_unmapped;
  ++d_.stats().values().num_device_free;  // as a deferred unmap's page: counted when given up
  seg.pages.set_unmapped(i);
  seg.pages.retire({i, h, seg.head->pool->owner, 0, true});  // fence 0: nothing to wait for
  ++retired_pages_;
  seg.mapped_bytes -= seg.page_bytes;
  if (seg.mapped_bytes == 0) note_maybe_empty(seg);
  CCALLOC_ASSERT_EXPENSIVE(seg.pages.check());
  return true;
}

// A reservation made by a request that failed (discard_made_segment): every
// block free. Its mapped pages (seg.pages says which, also when a failure
// left its blocks' view behind) and the reservation go back to the device;
// its blocks and the segment leave the books. Allocates nothing; device
// errors are ignored, but for a refused unmap: the reservation then stays
// with that page retired (give_back_page).
void expandable_segments::discard_reservation(segment& seg) noexcept {
  const std::size_t page = seg.page_bytes;
  block_pool* const pool = seg.head->pool;
  const stat_group g = group_of(pool);
  for (block* b = seg.head; b != nullptr; b = b->next)
    if (b->pool->blocks.contains(b)) pool_erase_counted(b);
  for (std::size_t i = 0; i < seg.pages.count();) {  // run by run of mapped pages
    const std::size_t n = seg.pages.mapped_run(i);
    if (n == 0) {
      ++i;
      continue;
    }
    d_.mapping().announce(mapping_change::unmap, mapping_reason::pages_released, seg.base + i * page, n * page,
                         seg.head->stream, true);
    if (d_.history().active()) [[unlikely]] {
      try {
        d_.history().record_segment_unmap(seg.base + i * page, n * page, seg.head->stream);
      } catch (...) {  // the history misses this unmap; the cleanup goes on
      }
    }
    for (const std::size_t end = i + n; i < end; ++i) give_back_page(seg, i);
  }
  if (!seg.pages.retired().empty()) {
    // The device refused to unmap a page (here, or when the request gave it
    // back): the reservation stays, as a fresh one (one unmapped block),
    // until its retired pages are unmapped (settle_retired);
    // release_empty_expandable_segments then releases it.
    for (block* b = seg.head->next; b != nullptr;) {
      block* next = b->next;
      b->pool->owner->delete_block(b);
      b = next;
    }
    seg.head->next = nullptr;
    seg.head->size = seg.size;
    seg.head->mapped = false;
    seg.unmapped.clear();
    seg.unmapped.push_back(seg.head);  // within its capacity (never below 4): no allocation
    note_maybe_empty(seg);
    return;
  }
  try {
    d_.backend().vm_release(d_.device(), reinterpret_cast<void*>(seg.base), seg.size);
  } catch (...) {  // noexcept cleanup: the reservation leaves the books whatever the device says
  }
  count_down(d_.stats().values().segment, g, 1);
  d_.tags().detach_segment(pool->priv, seg);
  --pool->owner->segments;
  for (block* b = seg.head; b != nullptr;) {
    block* next = b->next;
    b->pool->owner->delete_block(b);
    b = next;
  }
  const std::uintptr_t base = seg.base;
  if (seg.maybe_empty) maybe_empty_.erase(std::find(maybe_empty_.begin(), maybe_empty_.end(), &seg));
  reservations_.erase(base);
  d_.segments().erase(base);
}

// A request of alloc_expandable as its steps go: where it goes (step 1), the
// pages freed for it (step 2) and what its recycling cost. On return, when
// recycling ran: the host clock before it; the time up to the return, less
// the time the fresh pages of the request took to create and map
// (fresh_pages_us), is spent from the recycling budget (recycle_time_percent):
// the recycling's unmaps and the remapping of the pages it freed, not the
// pages the request would have created either way (docs/design.md, "Note:
// what a recycling request is charged").
struct expandable_segments::expandable_request {
  expandable_segments& x;
  device_state& d;
  // Step 1: the run chosen (best_own_run, an idle reservation or a new one).
  segment* seg = nullptr;
  block* first = nullptr;
  std::uintptr_t start = 0;
  std::uintptr_t end = 0;
  bool foreign = false;  // an idle reservation of another stream, to adopt
  std::size_t need = 0;  // bytes of pages to map
  // Step 2: handles in `recycled` are unmapped (or retired: released once
  // their deferred unmap is done) and no longer counted as reserved.
  std::vector<recycled_page> recycled;
  // Pages of this stream's free blocks may come before their fence has run
  // (unmap_free_pages' same_stream): the default pools only (a private
  // pool's blocks may be used by graphs launched on any stream).
  const stream_state* same_stream = nullptr;
  std::optional<std::uint64_t> recycle_started_us;
  std::uint64_t fresh_pages_us = 0;
  // The budget that pays (recycle_budget_now), read once per request.
  std::optional<recycle_budget::source> budget;

  explicit expandable_request(expandable_segments& owner) : x(owner), d(owner.d_) {}
  expandable_request(const expandable_request&) = delete;
  expandable_request& operator=(const expandable_request&) = delete;
  ~expandable_request() {
    if (!recycle_started_us || !budget) return;
    try {
      x.spend_recycle_time(*budget, *recycle_started_us, fresh_pages_us);
    } catch (...) {  // a clock that throws: the budget misses this spending, nothing else
    }
  }
  // The recycled handles not mapped go back to the device.
  void drop_recycled() {
    for (const recycled_page& r : recycled) {
      ++d.stats().values().num_device_free;
      x.release_page_handle(r.handle);
    }
    recycled.clear();
  }
  // The host clock for fresh_pages_us (0: none); a clock that throws leaves
  // the fresh pages charged (as the spending on return, it never fails the
  // request).
  std::uint64_t clock_reading() noexcept {
    try {
      return d.backend().host_time_us().value_or(0);
    } catch (...) {
      return 0;
    }
  }
};

bool expandable_segments::alloc_expandable(alloc_params& p, bool is_retry, world_lock& w) {
  if (is_retry) ++d_.stats().values().num_alloc_retries;
  expandable_request r(*this);
  place_expandable(p, r);                                      // 1. where: a free run, or a new reservation
  if (!could_map(r.need)) return false;                        //    fail at once what cannot fit
  if (!reserve_placement(p, r)) return false;                  //    adopt an idle reservation, or make one
  if (r.need > 0 && !free_pages_for(r, w)) return false;       // 2. recycle pages below the cap and the mark
  if (!settle_retired_under(r)) return false;                  // 3. retired pages under it unmapped, then
  if (!map_missing_pages(p, r)) return false;                  //    the missing pages mapped
  r.drop_recycled();  // more pages were freed than mapped (the cap counted plain segments)
  d_.memory().raise_high_water();
  p.found = take_mapped_run(r, p.size);                        // 4. the run's free block, off the pool
  return true;
}

// Step 1. Placement: the free run of this (stream, pool) that needs the
// fewest new pages, then the shortest, then the oldest segment and lowest
// offset (never raw addresses: a replay must decide alike on every device).
// An idle reservation of another stream (idle_reservation) competes too, and
// wins only with strictly fewer pages to map: it is then adopted, its mapped
// pages used where they are instead of remapped one by one. No run: a new
// reservation (reserve_placement), made once the pages may fit.
void expandable_segments::place_expandable(alloc_params& p, expandable_request& r) {
  run_choice best;
  best_own_run(reservations_, *p.pool, p.size, best);
  // An idle reservation has no block in use: one run, of few blocks (free
  // mapped and unmapped ones alternate), walked whole.
  for (auto& [base, reservation] : reservations_) {
    segment& seg = *reservation;
    if (seg.head->pool != p.pool && idle_reservation(seg, p)) scan_runs(best, seg, true, p.size);
  }
  r.seg = best.seg;
  r.first = best.first;
  r.start = best.seg != nullptr ? best.start : 0;
  const std::size_t pages = best.seg != nullptr ? best.pages : (p.size + page_bytes_ - 1) / page_bytes_;
  r.need = pages * page_bytes_;
  r.foreign = best.foreign;
}

// The chosen reservation made the request's own: an idle one adopted, or a
// new one reserved (false: no address space left; the ladder retries once
// every cached segment went back, with the reservations of tags that hold
// nothing, and warns when it falls back to a plain segment). Sets where the
// request ends and which stream's unfenced pages it may take.
bool expandable_segments::reserve_placement(const alloc_params& p, expandable_request& r) {
  if (r.foreign) adopt_reservation(*r.seg, p);
  if (r.seg == nullptr) {
    r.seg = new_expandable_segment(p);
    if (r.seg == nullptr) {
      no_address_space_ = true;
      return false;
    }
    r.first = r.seg->head;
    r.start = r.seg->base;
  }
  r.end = r.start + p.size;
  r.same_stream = p.pool->priv == nullptr ? p.pool->owner : nullptr;
  return true;
}

// Step 2. Physical pages: free whole pages rather than raise the peak
// (trim_on_new_peak) or pass the cap; false (nothing kept recycled) when the
// request still does not fit under the cap.
bool expandable_segments::free_pages_for(expandable_request& r, world_lock& w) {
  const std::size_t need = r.need;
  // Bytes over the cap: these must be freed (waiting for page fences if
  // need be), or the request fails.
  auto over_cap = [&]() -> std::size_t {
    return d_.memory().over_cap(need) ? d_.memory().reserved() + need - d_.memory().allowed() : 0;
  };
  // Bytes over the high-water mark: a new peak is avoided by recycling
  // free pages whose fence has completed (never waiting), at most
  // recycles_per_peak times per mark and within recycle_time_percent of
  // the host's time; else the mark rises.
  // The budget is read (a clock reading) only when the mark would pass,
  // and once per request. A large peak, more than a sixteenth of the mark
  // over it, may draw on the reserve when the bucket is empty: the mark it
  // would add stays for the rest of the program, the time is spent once
  // (recycle_budget_now).
  auto within_time = [&] {
    if (!r.budget) {
      const bool large_peak = d_.memory().reserved() + need - d_.memory().high_water() > d_.memory().high_water() / 16;
      r.budget = recycle_budget_now(large_peak);
    }
    return *r.budget != recycle_budget::source::none;
  };
  auto over_mark = [&]() -> std::size_t {
    if (!d_.policy().config().trim_on_new_peak || d_.memory().reserved() + need <= d_.memory().high_water() ||
        d_.memory().recycles_at_mark() >= d_.policy().config().recycles_per_peak || !within_time())
      return 0;
    return std::min(need, d_.memory().reserved() + need - d_.memory().high_water());
  };
  if (!d_.pools().capture_underway() && std::max(over_cap(), over_mark()) > 0) {
    // plain cached segments (no-caching leftovers, earlier configs)
    d_.segments().release_unused_segments(w, /*keep_going=*/true);
    // The time this request's recycling and mapping take is spent from the
    // budget when recycling was a choice (for the mark, not the cap, which
    // must recycle whatever the budget).
    if (over_mark() > 0 && d_.policy().config().recycle_time_percent < 100)
      r.recycle_started_us = d_.backend().host_time_us();
    try {
      std::size_t got = 0;
      if (const std::size_t target = std::max(over_cap(), over_mark()); target > 0)
        got = unmap_free_pages(target, r.seg, r.start, r.end, &r.recycled, false, r.same_stream);
      if (const std::size_t target = over_cap(); target > 0)
        got += unmap_free_pages(target, r.seg, r.start, r.end, &r.recycled, true, r.same_stream);
      if (got > 0) d_.memory().note_recycle();
    } catch (...) {
      r.drop_recycled();  // the pages unmapped before the failure go back to the device
      throw;
    }
  }
  if (d_.memory().over_cap(need)) {
    r.drop_recycled();
    return false;
  }
  return true;
}

// Step 3a. A retired page under the request (placement chose it last:
// nothing else fits) is unmapped first, after its fence (a wait, counted);
// not while a graph is captured (no event may be queried then): false, no
// room.
bool expandable_segments::settle_retired_under(expandable_request& r) {
  segment& seg = *r.seg;
  const std::size_t first_page = (r.start - seg.base) / page_bytes_;
  const std::size_t end_page = (r.end - seg.base + page_bytes_ - 1) / page_bytes_;
  if (seg.pages.retired().empty() || !seg.pages.has_retired(first_page, end_page)) return true;
  if (d_.pools().capture_underway()) {
    r.drop_recycled();
    return false;
  }
  try {
    settle_retired_in(seg, first_page, end_page, true);
  } catch (...) {
    r.drop_recycled();
    throw;
  }
  return true;
}

// Step 3b. Maps the missing pages of the request, run by run of unmapped
// pages: recycled handles first, then fresh ones. False when the device has
// no page left (what was mapped stays, on the books, free).
bool expandable_segments::map_missing_pages(const alloc_params& p, expandable_request& r) {
  segment& seg = *r.seg;
  const std::size_t page = page_bytes_;
  const std::size_t first_page = (r.start - seg.base) / page;
  const std::size_t end_page = (r.end - seg.base + page - 1) / page;
  // The pages [from, to) this request mapped and has not put on its blocks'
  // books (set_page_state) go back when it fails: unmapped, released, as
  // before the call (device errors ignored).
  auto give_back_run = [&](std::size_t from, std::size_t to) noexcept {
    for (std::size_t j = from; j < to; ++j) give_back_page(seg, j);
  };
  for (std::size_t i = first_page; i < end_page;) {
    if (seg.pages.mapped(i)) {
      ++i;
      continue;
    }
    const std::size_t run_first = i;
    bool out_of_memory = false;
    try {
      for (; i < end_page && !seg.pages.mapped(i); ++i) {
        if (!map_request_page(p, r, i)) {
          out_of_memory = true;
          break;
        }
      }
    } catch (...) {
      // Page i too when an unmap that failed left it mapped (on the books).
      give_back_run(run_first, seg.pages.mapped(i) ? i + 1 : i);
      r.drop_recycled();
      throw;
    }
    try {
      set_page_state(seg, seg.base + run_first * page, seg.base + i * page, true);  // no host memory: unchanged
    } catch (...) {
      give_back_run(run_first, i);
      r.drop_recycled();
      throw;
    }
    if (i > run_first)
      d_.mapping().announce(mapping_change::map, mapping_reason::pages_mapped, seg.base + run_first * page,
                           (i - run_first) * page, p.stream, true);
    if (d_.history().active() && i > run_first) [[unlikely]]
      d_.history().record_segment_map(seg.base + run_first * page, (i - run_first) * page, p.stream);
    if (out_of_memory) {
      d_.memory().raise_high_water();
      r.drop_recycled();
      return false;
    }
  }
  return true;
}

// Maps page i (unmapped) of the request's segment: a recycled handle, else a
// fresh one; false when the device has none. On a failure the handle goes
// back where it came from, unless its unmap failed too: then page i stays
// mapped, on the books as a free mapped page, and the error is thrown.
bool expandable_segments::map_request_page(const alloc_params& p, expandable_request& r, std::size_t i) {
  segment& seg = *r.seg;
  const std::size_t page = page_bytes_;
  const stat_group g = group_of(p.pool);
  physical_handle_t h = 0;
  bool fresh = false;
  stream_t from = p.stream;
  // A fresh page costs the same whether or not this request recycles:
  // its time is not recycling's (fresh_pages_us).
  const std::uint64_t fresh_start_us = r.recycle_started_us && r.recycled.empty() ? r.clock_reading() : 0;
  if (!r.recycled.empty()) {
    h = r.recycled.back().handle;
    from = r.recycled.back().from;
    r.recycled.pop_back();
  } else if (d_.backend().vm_create(d_.device(), page, &h)) {
    fresh = true;
  } else {
    return false;
  }
  void* addr = reinterpret_cast<void*>(seg.base + i * page);
  bool mapped = false;
  try {
    d_.backend().vm_map(d_.device(), addr, page, h);
    mapped = true;
    for (int peer : peers_) d_.backend().vm_set_access(d_.device(), addr, page, peer);
  } catch (...) {
    if (mapped) {
      try {
        d_.backend().vm_unmap(d_.device(), addr, page);  // the page must not stay mapped unknown to us
      } catch (...) {
        seg.pages.set_mapped(i, h);  // still mapped: keep it on the books (a free mapped page)
        ++d_.stats().values().num_pages_mapped;
        seg.mapped_bytes += page;
        d_.memory().add_reserved(page);
        count_up(d_.stats().values().reserved_bytes, g, static_cast<std::int64_t>(page));
        if (fresh) ++d_.stats().values().num_device_alloc;
        throw;
      }
    }
    if (fresh) {
      d_.backend().vm_release_handle(d_.device(), h);
    } else {
      r.recycled.push_back({h, from});
    }
    throw;
  }
  seg.pages.set_mapped(i, h);
  ++d_.stats().values().num_pages_mapped;
  if (!fresh) ++d_.stats().values().num_pages_remapped;
  if (!fresh && from != p.stream) d_.stats().values().bytes_moved_between_streams += static_cast<std::int64_t>(page);
  seg.mapped_bytes += page;
  if (fresh) ++d_.stats().values().num_device_alloc;
  d_.memory().add_reserved(page);
  count_up(d_.stats().values().reserved_bytes, g, static_cast<std::int64_t>(page));
  if (fresh_start_us != 0) {
    if (const std::uint64_t t = r.clock_reading(); t > fresh_start_us) r.fresh_pages_us += t - fresh_start_us;
  }
  return true;
}

// Step 4. The run now starts with a free mapped block of at least `size`
// bytes: its first block, still (the block before it is in use, so no merge
// took it; splits and merges keep the lower block's object); or, where the
// request starts past a retired page (consider_run), the block there (an
// unmapped page below it: no merge took it either). Taken off its pool as
// get_free_block does (take_found_block does the statistics).
block* expandable_segments::take_mapped_run(const expandable_request& r, std::size_t size) {
  block* b = r.first;
  while (b != nullptr && b->ptr + b->size <= r.start) b = b->next;
  if (b == nullptr) throw std::logic_error("ccalloc: internal error: the chosen run ends before its request");
  if (b->ptr != r.start || !b->mapped || !b->is_free() || b->size < size)
    throw std::logic_error("ccalloc: internal error: mapped run does not start with a free block");
  b->pool->blocks.erase(b);
  return b;
}

// ---- idle reservations of other streams ------------------------------

// Whether expandable segment `seg`, of another stream, may pass to p's
// stream and pool: reuse_across_streams and trim_on_new_peak are on (either
// off: reservations stay with their stream, as in PyTorch), no capture is
// underway, both are default pools of the same size class, it has mapped
// pages, none of its blocks is allocated or waiting for events, and the
// page fences of its mapped free blocks have completed (queried, never
// waited for). A stream that allocated for a while and went quiet (a
// short-lived side stream, a prefetch stream between bursts) thus hands its
// mapped pages over whole.
bool expandable_segments::idle_reservation(segment& seg, const alloc_params& p) {
  const block_pool* pool = seg.head->pool;
  if (!d_.policy().config().reuse_across_streams || !d_.policy().config().trim_on_new_peak || pool == p.pool ||
      pool->priv != nullptr || p.pool->priv != nullptr || pool->is_small != p.pool->is_small || seg.mapped_bytes == 0 ||
      d_.pools().capture_underway())
    return false;
  if (seg.busy_blocks != 0) return false;  // a block allocated or waiting for events
  if (!seg.pages.retired().empty()) return false;  // its stream's work may still use them
  for (block* x = seg.head; x != nullptr; x = x->next)
    if (x->mapped && !d_.fences().fence_completed(x)) return false;
  return true;
}

// Moves idle reservation `seg` (idle_reservation) to p's stream and pool:
// its free mapped blocks change pools, every block changes stream. The old
// stream's work on it has completed (its fences), so the blocks start with
// no fence to wait for on the new stream (free_seq 0).
void expandable_segments::adopt_reservation(segment& seg, const alloc_params& p) {
  --seg.head->pool->owner->segments;
  ++p.pool->owner->segments;
  for (block* x = seg.head; x != nullptr; x = x->next) {
    if (x->mapped) x->pool->blocks.erase(x);
    x->pool = p.pool;
    x->stream = p.stream;
    x->free_seq = 0;
    if (x->mapped) {
      x->gc_count_base = p.pool->get_free_blocks_call_count;
      p.pool->blocks.insert(x);
    }
  }
  d_.stats().values().bytes_moved_between_streams += static_cast<std::int64_t>(seg.mapped_bytes);
  if (d_.mapping().active()) [[unlikely]] {
    for (std::size_t i = 0; i < seg.pages.count();) {  // run by run of mapped pages
      const std::size_t n = std::max<std::size_t>(seg.pages.mapped_run(i), 1);
      if (seg.pages.mapped(i))
        d_.mapping().announce(mapping_change::move, mapping_reason::reservation_moved, seg.base + i * seg.page_bytes,
                 n * seg.page_bytes, p.stream, true);
      i += n;
    }
  }
}

// Releases the reservations of expandable segments that have no mapped page.
void expandable_segments::release_empty_expandable_segments(empty_of which) {
  if (maybe_empty_.empty()) return;
  // In address order, as a walk of every reservation releases them.
  std::sort(maybe_empty_.begin(), maybe_empty_.end(),
            [](const segment* a, const segment* b) { return a->base < b->base; });
  // [0, kept): read and still listed; [kept, next): read and off the list;
  // from next: not read yet (also when vm_release throws).
  std::size_t kept = 0, next = 0;
  struct drop_read {
    std::vector<segment*>& list;
    const std::size_t& kept;
    const std::size_t& next;
    ~drop_read() {
      list.erase(list.begin() + static_cast<std::ptrdiff_t>(kept), list.begin() + static_cast<std::ptrdiff_t>(next));
    }
  } drop{maybe_empty_, kept, next};
  for (; next < maybe_empty_.size(); ++next) {
    segment* const s = maybe_empty_[next];
    segment& seg = *s;
    if (seg.paused || seg.mapped_bytes != 0) {  // noted again when its last page goes, or at resume
      seg.maybe_empty = false;
      continue;
    }
    const bool skipped =
        (which == empty_of::tags && (seg.head->pool->priv == nullptr || !seg.head->pool->priv->is_tag_pool())) ||
        (which == empty_of::gone_streams && !seg.head->pool->owner->gone);
    if (skipped || seg.head->next != nullptr || !seg.pages.retired().empty()) {  // may be releasable later
      maybe_empty_[kept++] = s;
      continue;
    }
    release_reservation(seg);
  }
}

void expandable_segments::release_gone_empty_reservations() noexcept {
  if (!gone_empty_.exchange(false, std::memory_order_relaxed)) [[likely]]
    return;
  if (d_.pools().capture_underway()) {  // no device frees while capturing: later
    note_gone_empty();
    return;
  }
  try {
    release_empty_expandable_segments(empty_of::gone_streams);
  } catch (...) {  // the device refused: the rest stays noted, tried at a later world lock
    note_gone_empty();
  }
}

// An empty reservation (no page mapped or retired, one block) back to the
// device and off the books; seg is deleted. Throws the device's error,
// nothing changed then.
void expandable_segments::release_reservation(segment& seg) {
  d_.backend().vm_release(d_.device(), reinterpret_cast<void*>(seg.base), seg.size);
  count_down(d_.stats().values().segment, group_of(seg.head->pool), 1);
  d_.tags().detach_segment(seg.head->pool->priv, seg);
  --seg.head->pool->owner->segments;
  seg.head->pool->owner->delete_block(seg.head);
  const std::uintptr_t base = seg.base;
  reservations_.erase(base);
  d_.segments().erase(base);  // seg with it
}

// The reservations of gone stream `ss` (no other stream may take them
// over: stream_registry::gone_caches_unshared), as emptyCache returns them: the whole
// pages of their free blocks are unmapped (the stream's work has completed,
// so their fences have), their deferred unmaps settled where their fences
// have completed, and each one left with no page and no other block is
// released. Paused ones stay (their tag's resume needs them). Throws the
// device's error (or std::bad_alloc): what went back before stays back.
void expandable_segments::release_stream_reservations(const stream_state& ss) {
  std::vector<segment*> own;
  for (const auto& [base, seg] : reservations_)
    if (seg->head->pool->owner == &ss && !seg->paused) own.push_back(seg);
  for (segment* seg : own) {
    // Unmapping merges blocks: the walk starts again after each block that gave pages.
    for (block* b = seg->head; b != nullptr;) {
      if (b->is_free() && b->mapped && b->pool->blocks.contains(b) && d_.fences().fence_completed(b) &&
          unmap_block_pages(b, 0, 0, nullptr, std::numeric_limits<std::size_t>::max()) > 0)
        b = seg->head;
      else
        b = b->next;
    }
    if (!seg->pages.retired().empty()) settle_retired_in(*seg, 0, seg->pages.count(), false);
    if (seg->mapped_bytes != 0 || seg->head->next != nullptr || !seg->pages.retired().empty()) continue;
    if (seg->maybe_empty) {
      maybe_empty_.erase(std::find(maybe_empty_.begin(), maybe_empty_.end(), seg));
      seg->maybe_empty = false;
    }
    release_reservation(*seg);
  }
}

void expandable_segments::warn_plain_fallback(std::size_t size) noexcept {
  if (warned_no_address_space_) return;
  warned_no_address_space_ = true;
  std::fprintf(stderr,
               "ccalloc: warning: device %d: no address space left for another reservation of %zu bytes "
               "(expandable segment); requests that need one get plain segments (cudaMalloc) while none is "
               "left, whose pages are not recycled and which a tag's pause cannot release\n",
               d_.device(), std::max(d_.memory().total(), size));
}

void expandable_segments::note_maybe_empty(segment& seg) noexcept {
  if (seg.head->pool->owner->gone) note_gone_empty();
  if (seg.maybe_empty) return;
  seg.maybe_empty = true;
  maybe_empty_.push_back(&seg);  // within capacity
}

// Whether `need` bytes of new pages may fit at all (rather than create pages
// until the device refuses): not more than the device or the cap, nor, for a
// large request, more than the device has free plus what this allocator
// could give back. Checked before a new reservation: a failed request leaves
// the segment counts as they were.
bool expandable_segments::could_map(std::size_t need) {
  if (need > d_.memory().allowed()) return false;
  if (need >= free_memory_check_bytes) {
    std::size_t free_pages_bytes = 0;
    for (auto& [base, reservation] : reservations_)
      free_pages_bytes += reservation->mapped_bytes;  // an upper bound of what unmapping frees
    if (need > d_.backend().mem_get_info(d_.device()).free_bytes + free_pages_bytes) return false;
  }
  return true;
}

// The recycling time budget (recycle_budget.hpp; docs/design.md, "Note:
// the recycling reserve").
recycle_budget::source expandable_segments::recycle_budget_now(bool large_peak) {
  const auto percent = d_.policy().config().recycle_time_percent;
  const auto from = recycle_budget_.choose(percent, large_peak, [&] { return d_.backend().host_time_us(); });
  // choose() bounds the budget (refills) only between 1 and 99 percent: at 0
  // (recycling off, e.g. lowered by set_config) it holds what it held.
  CCALLOC_ASSERT_EXPENSIVE(percent >= 100 || percent == 0 || recycle_budget_.within_bounds(percent));
  return from;
}

void expandable_segments::spend_recycle_time(recycle_budget::source from, std::uint64_t start_us,
                                             std::uint64_t excluded_us) {
  if (from == recycle_budget::source::none) return;
  const auto percent = d_.policy().config().recycle_time_percent;
  const std::optional<std::uint64_t> now = d_.backend().host_time_us();
  if (!now || *now <= start_us || *now - start_us <= excluded_us) return;
  start_us += excluded_us;
  // Refill first up to now (the budget fills while recycling runs too), then spend.
  if (const std::optional<std::uint64_t> refill_at = d_.backend().host_time_us())
    recycle_budget_.refill(percent, *refill_at);
  recycle_budget_.spend(from, percent, static_cast<double>(*now - start_us));
  CCALLOC_ASSERT_EXPENSIVE(percent == 0 || recycle_budget_.within_bounds(percent));
}

}  // namespace ccalloc::detail

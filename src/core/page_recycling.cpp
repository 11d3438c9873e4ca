// Page recycling (B7, X3): unmapping the whole free pages of expandable
// segments (to map their handles where a request needs them, or to give
// them back), the page fences that say when a free block's pages may
// change hands, and deferred unmaps (segment::retired).
//
// Page fences: cuMemUnmap does not wait for queued work that may
// still touch the range, and the work that last used a free block was
// queued on its stream (uses on other streams completed before the block
// became free). Each stream numbers the blocks that become free on it
// (block::free_seq); before its pages change hands, an event recorded on the
// stream after that free must have completed (stream_state::fences, checked
// with a query, never waited for on the way to a new peak). Pages whose
// fence has not completed stay where they are; the reservation grows
// instead. Only out of memory, the memory-fraction cap and emptyCache wait
// for fences (unmap_free_pages' may_wait; num_device_synchronizations).
#include "detail/device_state.hpp"

#include <ccalloc/base/detail/assert.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace ccalloc::detail {

namespace {
using page_range = std::pair<std::uintptr_t, std::uintptr_t>;

// The whole pages [lo, hi) of a block of seg less the pages overlapping
// [keep_lo, keep_hi) (rounded outward): up to two pieces, empty ones {x, x}.
std::array<page_range, 2> pieces_outside(const segment& seg, std::uintptr_t lo, std::uintptr_t hi,
                                         std::uintptr_t keep_lo, std::uintptr_t keep_hi) noexcept {
  std::array<page_range, 2> pieces = {page_range{lo, hi}, page_range{0, 0}};
  if (keep_lo < keep_hi && keep_lo < hi && keep_hi > lo) {
    const std::size_t page = seg.page_bytes;
    const std::uintptr_t klo = (keep_lo - seg.base) / page * page + seg.base;
    const std::uintptr_t khi = (keep_hi - seg.base + page - 1) / page * page + seg.base;
    pieces[0] = {lo, std::max(lo, std::min(hi, klo))};
    pieces[1] = {std::min(hi, std::max(lo, khi)), hi};
  }
  return pieces;
}

// Why unmap_block_pages unmaps: a deferred unmap (the pages move now, the
// old mapping is retired), pages recycled elsewhere, or pages given back.
mapping_reason unmap_reason(bool defer, bool recycled) noexcept {
  if (defer) return mapping_reason::pages_retired;
  return recycled ? mapping_reason::pages_recycled : mapping_reason::pages_released;
}

// The free mapped blocks of a whole page or more of every expandable
// segment whose pool is not live, each with the bytes its unmapping would
// leave behind in partial pages (partial_page_bytes), in the order pages
// are taken: fewest such bytes first, then the smallest free block (large
// free runs stay whole for large requests), then the oldest segment, then
// by offset: the same order on every device. Read from the pools' indexes
// from a page up, not from every block of every segment.
std::vector<std::pair<std::size_t, block*>> recycling_candidates(device_state& d, std::size_t page_bytes) {
  // Each pool once: sorted and deduplicated, not searched per segment (with
  // thousands of streams, each with its reservation, a search per segment
  // made every slow path quadratic). The pools' order does not matter: the
  // candidates are sorted below on keys that do not depend on it.
  std::vector<block_pool*> pools;
  for (const auto& [base, reservation] : d.expandable().reservations()) {
    block_pool* pool = reservation->head->pool;
    if (reservation->mapped_bytes != 0 && !pool_is_live(pool)) pools.push_back(pool);
  }
  std::sort(pools.begin(), pools.end());
  pools.erase(std::unique(pools.begin(), pools.end()), pools.end());
  std::vector<std::pair<std::size_t, block*>> candidates;
  for (block_pool* pool : pools)
    for (auto j = pool->blocks.lower_bound(page_bytes); j != block_index::end(); j = pool->blocks.next(j)) {
      block* b = pool->blocks.at(j);
      if (b->seg->expandable) candidates.emplace_back(expandable_segments::partial_page_bytes(*b), b);
    }
  std::sort(candidates.begin(), candidates.end(), [](const auto& x, const auto& y) {
    if (x.first != y.first) return x.first < y.first;
    if (x.second->size != y.second->size) return x.second->size < y.second->size;
    return x.second->seg->seq != y.second->seg->seq ? x.second->seg->seq < y.second->seg->seq
                                                    : x.second->ptr < y.second->ptr;
  });
  return candidates;
}
}  // namespace

// Unmaps the whole pages of free block `b` (free, mapped, in an expandable
// segment), except those overlapping [keep_lo, keep_hi), at most `max_bytes`.
// Handles go to `recycled` (then no longer counted as reserved) or back to
// the device.
std::size_t expandable_segments::unmap_block_pages(block* b, std::uintptr_t keep_lo, std::uintptr_t keep_hi,
                                                   std::vector<recycled_page>* recycled, std::size_t max_bytes,
                                                   bool defer) {
  CCALLOC_ASSERT(!defer || recycled != nullptr);
  segment& seg = *b->seg;
  const std::size_t page = seg.page_bytes;
  const std::uintptr_t lo = (b->ptr - seg.base + page - 1) / page * page + seg.base;
  const std::uintptr_t hi = (b->ptr + b->size - seg.base) / page * page + seg.base;
  if (lo >= hi) return 0;
  std::size_t done_total = 0;
  // Where set_page_state starts its walk: b, until a piece has changed the
  // blocks (b may have merged into an unmapped block below it); then the
  // unmapped block the first piece made, right below the second.
  block* hint = b;
  for (const auto& piece : pieces_outside(seg, lo, hi, keep_lo, keep_hi)) {
    const std::uintptr_t from = piece.first;  // named copies: lambdas below capture them
    std::uintptr_t to = piece.second;
    if (done_total >= max_bytes) break;
    if (to - from > max_bytes - done_total) to = from + (max_bytes - done_total + page - 1) / page * page;
    std::uintptr_t addr = from;
    std::vector<physical_handle_t> to_release;
    // Host memory first (may throw; this piece unchanged): the handles' list,
    // the retired pages' room and what set_page_state needs, before the
    // device unmaps anything.
    if (from < to) {
      const std::size_t n = (to - from) / page;
      if (recycled != nullptr) recycled->reserve(recycled->size() + n);
      else to_release.reserve(n);
      if (defer) seg.pages.reserve_retired(n);
      set_page_state(seg, from, to, false, hint, /*reserve_only=*/true);
    }
    const std::size_t retired_before = seg.pages.retired().size();
    // Announced before the device unmaps; what a failure leaves mapped is
    // announced mapped again (finish).
    const mapping_reason reason = unmap_reason(defer, recycled != nullptr);
    if (from < to) d_.mapping().announce(mapping_change::unmap, reason, from, to - from, seg.head->stream, true);
    auto finish = [&] {
      if (addr < to)
        d_.mapping().announce(mapping_change::map, mapping_reason::pages_mapped, addr, to - addr, seg.head->stream,
                             true);
      const std::size_t bytes = addr - from;
      CCALLOC_ASSERT(bytes <= seg.mapped_bytes && bytes <= d_.memory().reserved());
      seg.mapped_bytes -= bytes;
      if (seg.mapped_bytes == 0) note_maybe_empty(seg);
      d_.memory().remove_reserved(bytes);
      count_down(d_.stats().values().reserved_bytes, group_of(seg.head->pool), static_cast<std::int64_t>(bytes));
      set_page_state(seg, from, addr, false, hint);
      if (addr > from) hint = nullptr;
      if (d_.history().active() && bytes > 0) [[unlikely]]
        d_.history().record_segment_unmap(from, bytes, seg.head->stream);
      done_total += bytes;
      d_.stats().values().num_device_free += to_release.size();
      retired_pages_ += seg.pages.retired().size() - retired_before;
      CCALLOC_ASSERT_EXPENSIVE(seg.pages.check());
      for (physical_handle_t h : to_release) release_page_handle(h);  // may throw: state is consistent
    };
    try {
      for (; addr < to; addr += page) {
        const std::size_t i = (addr - seg.base) / page;
        if (defer) {
          // Mapped here until the stream's work before b's free has run
          // (segment::retired); within the capacities reserved above.
          seg.pages.retire({i, seg.pages.handle(i), b->pool->owner, b->free_seq, false});
          recycled->push_back({seg.pages.handle(i), seg.head->stream});
        } else {
          d_.backend().vm_unmap(d_.device(), reinterpret_cast<void*>(addr), page);
          if (recycled != nullptr) recycled->push_back({seg.pages.handle(i), seg.head->stream});
          else to_release.push_back(seg.pages.handle(i));
        }
        ++d_.stats().values().num_pages_unmapped;
        seg.pages.set_unmapped(i);
      }
    } catch (...) {
      finish();
      throw;
    }
    finish();
  }
  return done_total;
}

// Unmaps free whole pages of every expandable segment until `target_bytes`
// are freed: first the pages whose page fence has completed (no waiting);
// then, with may_wait, the others after waiting for their fences.
std::size_t expandable_segments::unmap_free_pages(std::size_t target_bytes, const segment* keep_seg,
                                                  std::uintptr_t keep_lo, std::uintptr_t keep_hi,
                                                  std::vector<recycled_page>* recycled, bool may_wait,
                                                  const stream_state* same_stream) {
  const auto candidates = recycling_candidates(d_, page_bytes_);
  if (candidates.empty()) return 0;
  std::size_t got = 0;
  std::vector<block*> waiting;  // candidates whose fence has not completed
  for (const auto& [partial_bytes, b] : candidates) {
    if (got >= target_bytes) return got;
    const bool keep = b->seg == keep_seg;
    if (!d_.fences().fence_completed(b)) {
      // The request's own stream runs its use of these pages after the
      // work before b's free: map them there now, unmap them here later.
      if (same_stream != nullptr && recycled != nullptr && b->pool->owner == same_stream && b->pool->priv == nullptr)
        got += unmap_block_pages(b, keep ? keep_lo : 0, keep ? keep_hi : 0, recycled, target_bytes - got, true);
      else
        waiting.push_back(b);
      continue;
    }
    got += unmap_block_pages(b, keep ? keep_lo : 0, keep ? keep_hi : 0, recycled, target_bytes - got);
  }
  // (Unmapping a candidate merges or splits only it and unmapped ranges: free
  // mapped blocks never neighbour each other, so the others stay valid.)
  // Then the pages of other streams' blocks whose fence has not completed,
  // behind a device-side wait of the request's stream for that fence
  // (cudaMemPoolReuseAllowInternalDependencies; counted in
  // num_stream_waits): mapped at once, unmapped at the old place once the
  // fence completes (a deferred unmap). One wait per owner stream and fence.
  if (d_.policy().config().reuse_with_stream_wait && same_stream != nullptr && recycled != nullptr &&
      got < target_bytes && !waiting.empty() && d_.fences().may_wait_on_device(*same_stream)) {
    std::vector<std::pair<const stream_state*, std::uint64_t>> waited;  // owner -> fence count waited for
    for (block*& entry : waiting) {
      if (got >= target_bytes) break;
      block* b = entry;
      stream_state& owner = *b->pool->owner;
      if (b->pool->priv != nullptr || &owner == same_stream || owner.gone) continue;
      auto w = std::find_if(waited.begin(), waited.end(), [&](const auto& x) { return x.first == &owner; });
      if (w == waited.end() || w->second < b->free_seq) {
        const auto fence = d_.fences().fence_covering(owner, b->free_seq);
        if (!fence) continue;
        if (w == waited.end()) w = waited.emplace(waited.end(), &owner, 0);  // before the wait: nothing throws after it
        d_.backend().stream_wait_event(d_.device(), same_stream->stream, fence->event);
        ++d_.stats().values().num_stream_waits;
        w->second = fence->covers;
      }
      const bool keep = b->seg == keep_seg;
      got += unmap_block_pages(b, keep ? keep_lo : 0, keep ? keep_hi : 0, recycled, target_bytes - got, true);
      entry = nullptr;  // taken (b may have merged away)
    }
  }
  if (!may_wait) return got;
  for (block* b : waiting) {
    if (got >= target_bytes) break;
    if (b == nullptr) continue;  // taken behind a device-side wait
    d_.fences().wait_fences(*b->pool->owner, page_fences::wait_reason::reclaim_pages);
    const bool keep = b->seg == keep_seg;
    got += unmap_block_pages(b, keep ? keep_lo : 0, keep ? keep_hi : 0, recycled, target_bytes - got);
  }
  return got;
}

// The bytes of free block `b` (mapped, in an expandable segment) outside its
// whole pages: its first and last pages when they are partly in use by the
// blocks beside it. Unmapping b's whole pages leaves these behind as
// separate free pieces, mapped as long as their neighbours live and too
// small for most large requests, where b kept whole could still serve a
// large request without mapping anything; a block whose ends are on page
// boundaries leaves nothing behind. unmap_free_pages recycles the blocks
// that leave the least first (on the shared traces, free space
// stranded in partial pages was most of the excess over the requested peak).
std::size_t expandable_segments::partial_page_bytes(const block& b) noexcept {
  const std::size_t page = b.seg->page_bytes;
  const std::size_t lo = b.ptr - b.seg->base;
  const std::size_t hi = lo + b.size;
  return (page - lo % page) % page + hi % page;
}

// ---- deferred unmaps ---------------------------------------------------
//
// On a GPU the work queued before a free has usually not run when a request
// on the same stream wants that block's pages elsewhere (a free followed by
// a larger request: most of what recycling moves). The stream runs the new
// use after the old one, so the pages may be used at their new address at
// once; only unmapping the old address must wait until the work before the
// free has run (cuMemUnmap does not wait for queued work). So the handle is
// mapped at the new address now and the old mapping is retired
// (segment::retired), unmapped here once the fence covering the free has
// completed: polled on the slow path, waited for only where an address must
// be mapped again (placement puts such runs last) or the cache is emptied.
// The same physical page is then mapped twice for a while: it counts once
// in reserved bytes, at its new place (what this saves: docs/perf.md, "A
// device that runs behind").

void expandable_segments::settle_retired_in(segment& seg, std::size_t first, std::size_t last, bool may_wait) {
  for (std::size_t k = 0; k < seg.pages.retired().size();) {
    const segment::retired_page& r = seg.pages.retired()[k];
    if (r.index < first || r.index >= last) {
      ++k;
      continue;
    }
    if (!d_.fences().fence_completed(*r.owner, r.free_seq)) {
      if (!may_wait) {
        ++k;
        continue;
      }
      d_.fences().wait_fences(*r.owner, page_fences::wait_reason::deferred_unmap);
    }
    d_.backend().vm_unmap(d_.device(), reinterpret_cast<void*>(seg.base + r.index * seg.page_bytes), seg.page_bytes);
    d_.mapping().announce(mapping_change::unmap_completed, mapping_reason::deferred_unmap,
                         seg.base + r.index * seg.page_bytes, seg.page_bytes, r.owner->stream, true);
    const segment::retired_page done = seg.pages.unretire(k);
    const bool release = done.release;  // counted in num_device_free when it was given up
    const physical_handle_t h = done.handle;
    --retired_pages_;
    // A page that moved twice is retired at two places: the last unmap releases it.
    if (release) {
      d_.memory().remove_reserved(seg.page_bytes);
      count_down(d_.stats().values().reserved_bytes, group_of(seg.head->pool),
                 static_cast<std::int64_t>(seg.page_bytes));
      release_page_handle(h);
    }
  }
  CCALLOC_ASSERT_EXPENSIVE(seg.pages.check());
}

// Gives physical page h (no longer counted as reserved) back to the device,
// or, while a retired mapping of it remains, leaves that to its deferred
// unmap (settle_retired_in); the page counts as reserved until then, in the
// segment it is retired in: the device still holds it.
void expandable_segments::release_page_handle(physical_handle_t h) {
  if (retired_pages_ != 0)
    for (auto& [base, up] : reservations_)  // only reservations retire pages
      if (up->pages.release_at_unmap(h)) {
        d_.memory().add_reserved(up->page_bytes);
        count_up(d_.stats().values().reserved_bytes, group_of(up->head->pool),
                 static_cast<std::int64_t>(up->page_bytes));
        return;
      }
  d_.backend().vm_release_handle(d_.device(), h);
}

void expandable_segments::settle_retired(bool may_wait) {
  if (retired_pages_ == 0) return;
  for (auto& [base, up] : reservations_)  // only reservations retire pages
    if (!up->pages.retired().empty()) settle_retired_in(*up, 0, std::numeric_limits<std::size_t>::max(), may_wait);
}

}  // namespace ccalloc::detail

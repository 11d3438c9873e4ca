// The segment table (detail/segment_table.hpp): segments on and off the
// books, and the releases of cached memory back to the device: the
// fallback ladder's rungs 2 (garbage collection), 4 and 5, emptyCache,
// no-caching frees and the device's teardown.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"

#include <ccalloc/base/detail/assert.hpp>
#include "detail/stats_sink.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace ccalloc::detail {

segment* segment_table::containing(std::uintptr_t address) const noexcept {
  auto it = segments_.upper_bound(address);
  if (it == segments_.begin()) return nullptr;
  --it;
  segment& seg = *it->second;
  return address < seg.base + seg.size ? &seg : nullptr;
}

// What the failed request `p` made (device_memory::take_made): a segment or reservation with no
// block in use goes back to the device, off the books; the reserved-memory
// mark comes back down. Device errors on the way are ignored (the request
// reports its own failure).
void segment_table::discard_made_segment(const alloc_params& p) noexcept {
  const device_memory::made_segment made = d_.memory().take_made();
  if (made.owner != &p) return;
  const auto it = segments_.find(made.base);
  if (it == segments_.end()) return;  // released on the way (rung 5)
  segment& seg = *it->second;
  for (const block* b = seg.head; b != nullptr; b = b->next)
    if (!b->is_free()) return;  // in use (never: the request failed)
  if (seg.expandable) {
    d_.expandable().discard_reservation(seg);
  } else {
    block* b = seg.head;
    if (b->next != nullptr) return;  // split (never: take_found_block failed before)
    d_.mapping().announce(mapping_change::unmap, mapping_reason::segment_free, b->ptr, b->size, b->stream, false);
    try {
      release_segment_memory(seg);
    } catch (...) {  // the device refuses: the segment stays cached
      d_.mapping().announce(mapping_change::map, mapping_reason::segment_alloc, b->ptr, b->size, b->stream, false);
      try {
        if (!b->pool->blocks.contains(b)) b->pool->blocks.insert(b);
      } catch (...) {  // no slot: the segment is lost to the cache; nothing to report to
      }
      return;
    }
    if (d_.history().active()) [[unlikely]] {
      try {
        d_.history().record_segment_free(b->ptr, b->size, b->stream);
      } catch (...) {  // the history misses this free; the segment still leaves the books
      }
    }
    forget_segment(b, d_.stats().values());
  }
  d_.memory().restore_mark(made);
}


// A new segment `seg` [base, base + size) of p's stream and pool, as one
// free block, on the books (segment count, its private pool's count). Throws
// std::bad_alloc (host memory) with nothing changed.
segment& segment_table::add_segment(const alloc_params& p, std::unique_ptr<segment> seg, std::uintptr_t base,
                                   std::size_t size) {
  block* b = p.owner->new_block();
  b->ptr = base;
  b->size = size;
  b->stream = p.stream;
  b->pool = p.pool;
  b->seg = seg.get();
  seg->base = base;
  seg->size = size;
  seg->head = b;
  segment_map::iterator at;
  try {
    at = segments_.emplace(base, std::move(seg)).first;
  } catch (...) {
    p.owner->delete_block(b);
    throw;
  }
  count_up(d_.stats().values().segment, group_of(p.pool), 1);
  if (p.pool->priv != nullptr) p.pool->priv->attach(*at->second);
  ++p.pool->owner->segments;
  return *at->second;
}

// ---- rungs 4 and 5, emptyCache: cached segments back to the device ---------------------

// Rung 4 (only with max_split_size set): free the smallest cached oversize
// block that covers the request, else the largest ones until enough is freed.
bool segment_table::release_available_cached_blocks(const alloc_params& p) {
  const std::size_t max_split = d_.policy().config().max_split_size_bytes;
  if (max_split == std::numeric_limits<std::size_t>::max()) return false;
  block_pool& pool = *p.pool;
  const std::size_t wanted = std::max(p.size, max_split);
  const block_index::position i = pool.blocks.lower_bound(wanted);
  if (i != block_index::end()) {
    if (pool.blocks.at(i)->is_split()) return false;
    release_block(pool.blocks.at(i), d_.stats().values());
    return true;
  }
  std::size_t released = 0;
  std::vector<block*> victims;
  pool.blocks.for_each_descending([&](block* b) {
    if (released >= wanted || b->size < max_split) return false;
    if (!b->is_split()) {
      victims.push_back(b);
      released += b->size;
    }
    return true;
  });
  if (released < wanted) return false;
  for (block* b : victims) release_block(b, d_.stats().values());
  return true;
}

// Rung 5 and emptyCache: wait for every pending event, then return every
// cached block that is a whole segment.
// Private pools without users give back their cached segments too. Nothing
// while a capture is underway (waiting and freeing are not allowed then).
bool segment_table::release_cached_blocks(const world_lock& w, bool for_retry) {
  if (d_.pools().capture_underway()) return false;
  d_.pools().flush_deferred_frees();
  d_.events().synchronize_and_free_events();
  release_unused_segments(w, for_retry);
  d_.pools().release_dead_pools(w, for_retry);
  d_.expandable().unmap_free_pages(std::numeric_limits<std::size_t>::max(), nullptr, 0, 0, nullptr, true);
  d_.expandable().settle_retired(true);  // deferred unmaps: the reservations may go
  d_.expandable().release_empty_expandable_segments();
  d_.pools().delete_empty_dead_pools(w);
  return true;
}

void segment_table::release_unused_segments(const world_lock& w, bool keep_going) {
  for (stream_state* ss : w.streams()) {
    release_blocks(ss->pools.large, keep_going);
    release_blocks(ss->pools.small, keep_going);
  }
}

void segment_table::release_blocks(block_pool& pool, bool keep_going) {
  // Only a plain segment's block can be whole: a pool without plain segments
  // (the default configuration's) is not read block by block at each new
  // page.
  if (pool.plain_segments == 0) return;
  std::vector<block*> victims;
  pool.blocks.for_each([&](block* b) {
    if (!b->is_split()) victims.push_back(b);
  });
  for (block* b : victims) {
    try {
      release_block(b, d_.stats().values());
    } catch (...) {
      if (!keep_going) throw;  // else the segment stays cached (release_block changed nothing)
      if (!release_failure_) release_failure_ = std::current_exception();
    }
  }
}

// Returns a cached whole-segment block to the device. If the device refuses
// (segment_free throws), nothing has changed.
void segment_table::release_block(block* b, device_stats& st) {
  release_segment_memory_announced(*b->seg);
  if (d_.history().active()) [[unlikely]]
    d_.history().record_segment_free(b->ptr, b->size, b->stream);
  forget_segment(b, st);
}

// The books of a segment the device has taken back; `b` is its only block.
void segment_table::forget_segment(block* b, device_stats& st) noexcept {
  CCALLOC_ASSERT(b->prev == nullptr && b->next == nullptr && b->size == b->seg->size &&
                 b->size <= d_.memory().reserved());
  d_.tags().detach_segment(b->pool->priv, *b->seg);
  --b->pool->plain_segments;
  --b->pool->owner->segments;
  const stat_group g = group_of(b->pool);
  count_down(st.segment, g, 1);
  count_down(st.reserved_bytes, g, static_cast<std::int64_t>(b->size));
  if (b->seg->oversize) st.oversize_segments.decrease(1);
  ++st.num_device_free;
  d_.memory().remove_reserved(b->size);
  b->pool->blocks.erase(b);
  segments_.erase(b->seg->base);
  b->pool->owner->delete_block(b);
}

// Returns a plain segment's memory: to the pool's custom allocator if it has
// one, else to the backend.
void segment_table::release_segment_memory(segment& seg) {
  const private_pool* pp = seg.head->pool->priv;
  if (pp != nullptr && pp->custom.free) pp->custom.free(reinterpret_cast<void*>(seg.base));
  else d_.backend().segment_free(d_.device(), reinterpret_cast<void*>(seg.base));
}

// release_segment_memory, announced to the mapping listeners: unmapped
// before, mapped again if the device refuses (then nothing has changed).
void segment_table::release_segment_memory_announced(segment& seg) {
  const block& b = *seg.head;
  d_.mapping().announce(mapping_change::unmap, mapping_reason::segment_free, seg.base, seg.size, b.stream, false);
  try {
    release_segment_memory(seg);
  } catch (...) {
    d_.mapping().announce(mapping_change::map, mapping_reason::segment_alloc, seg.base, seg.size, b.stream, false);
    throw;
  }
}

// No-caching mode (F6), a block that is a whole segment and waits on no
// event: the segment goes back to the device before anything else changes,
// so a failing device free leaves the block allocated and the caller's
// pointer live (the caller gets the backend_error).
void segment_table::free_uncached(block* b, stream_state& ss) {
  std::lock_guard device_lock(d_.device_mutex());
  d_.mapping().announce(mapping_change::unmap, mapping_reason::segment_free, b->ptr, b->size, b->stream, false);
  try {
    d_.backend().segment_free(d_.device(), reinterpret_cast<void*>(b->ptr));
  } catch (...) {
    d_.mapping().announce(mapping_change::map, mapping_reason::segment_alloc, b->ptr, b->size, b->stream, false);
    throw;
  }
  if (d_.history().active()) [[unlikely]]
    d_.history().record_segment_free(b->ptr, b->size, b->stream);
  stats_sink sink(d_, ss);
  device_stats& st = sink.get();
  const stat_group g = group_of(b->pool);
  const auto size = static_cast<std::int64_t>(b->size);
  count_down(st.allocation, g, 1);
  count_down(st.allocated_bytes, g, size);
  if (b->counted_oversize) st.oversize_allocations.decrease(1);
  count_down(st.active, g, 1);
  count_down(st.active_bytes, g, size);
  count_down(st.requested_bytes, g, static_cast<std::int64_t>(b->requested_bytes));
  forget_segment(b, st);
}

// ---- rung 2: garbage collection --------------------------------------------------------

// Rung 2 (B5): while reserved bytes exceed threshold x allowed, release
// cached large-pool memory older than the average age: whole plain segments
// (PyTorch's rule) and, in expandable segments, the whole pages of free
// blocks (unmapped; ccalloc's, so that the threshold works with expandable
// segments too, whose blocks all count as split). ccalloc applies the
// threshold to the device total when no memory fraction is set (PyTorch
// ignores it then; SPEC X6).
void segment_table::garbage_collect_cached_blocks(const world_lock& w) {
  const auto threshold = static_cast<std::size_t>(d_.policy().config().garbage_collection_threshold *
                                                  static_cast<double>(d_.memory().allowed()));
  if (d_.memory().reserved() <= threshold) return;
  const std::size_t target = d_.memory().reserved() - threshold;

  // A free mapped block of an expandable segment holding at least one whole page.
  const auto has_whole_page = [](const block* b) {
    const std::size_t page = b->seg->page_bytes;
    const std::uintptr_t first = (b->ptr + page - 1) / page * page;
    return b->mapped && first + page <= b->ptr + b->size;
  };
  std::vector<std::pair<block*, std::uint64_t>> candidates;  // block, age
  std::uint64_t total_age = 0;
  for (stream_state* ss : w.streams()) {
    block_pool& large = ss->pools.large;
    large.blocks.for_each([&](block* b) {
      if (b->seg->expandable ? has_whole_page(b) : !b->is_split()) {
        const std::uint64_t age = large.age(b);
        candidates.emplace_back(b, age);
        total_age += age;
      }
    });
  }
  std::size_t reclaimed = 0;
  bool freed = true;
  bool unmapped = false;
  while (reclaimed < target && freed && !candidates.empty()) {
    const double age_threshold = double(total_age) / double(candidates.size());
    freed = false;
    for (auto it = candidates.begin(); it != candidates.end();) {
      if (double(it->second) >= age_threshold) {
        freed = true;
        total_age -= it->second;
        block* b = it->first;
        it = candidates.erase(it);
        if (b->seg->expandable) {
          // cuMemUnmap does not wait for queued work: the block's page fence
          // must have completed. The threshold is a cap, so this rung may
          // wait for it (counted in num_device_synchronizations).
          d_.fences().await_fence(b, page_fences::wait_reason::garbage_collection);
          unmapped = true;
          reclaimed += d_.expandable().unmap_block_pages(b, 0, 0, nullptr, std::numeric_limits<std::size_t>::max());
        } else {
          reclaimed += b->size;
          release_block(b, d_.stats().values());
        }
      } else {
        ++it;
      }
    }
  }
  if (unmapped) {
    // A page unmapped here may have come behind a device-side wait or from
    // its stream's own earlier free, its old mapping still retired: its
    // release waits for that deferred unmap, and until then it counts as
    // reserved in no segment that a snapshot shows. Its new place's fence,
    // completed now, was recorded after the old one's: settled here without
    // waiting, as the next slow path would, so that reserved memory again
    // equals the segments' mapped bytes when this malloc returns.
    d_.expandable().settle_retired(false);
    d_.expandable().release_empty_expandable_segments();
  }
}

// The device's teardown: deferred unmaps first (segment::retired): their
// handles may be mapped in another segment too, released there (unless
// nothing took them).
void segment_table::release_all() noexcept {
  std::vector<physical_handle_t> given_up;  // released once every retired mapping is gone
  for (auto& [base, seg] : segments_)
    for (const segment::retired_page& r : seg->pages.retired()) {
      try {
        d_.backend().vm_unmap(d_.device(), reinterpret_cast<void*>(base + r.index * seg->page_bytes), seg->page_bytes);
        if (r.release) given_up.push_back(r.handle);
      } catch (...) {  // teardown: the mapping stays with the device; the others still go
      }
    }
  for (physical_handle_t h : given_up) {
    try {
      d_.backend().vm_release_handle(d_.device(), h);
    } catch (...) {  // teardown: as above
    }
  }
  for (auto& [base, seg] : segments_) {
    try {
      if (seg->expandable) {
        for (std::size_t i = 0; i < seg->pages.count(); ++i) {
          if (!seg->pages.mapped(i)) continue;
          d_.backend().vm_unmap(d_.device(), reinterpret_cast<void*>(base + i * seg->page_bytes), seg->page_bytes);
          d_.backend().vm_release_handle(d_.device(), seg->pages.handle(i));
        }
        d_.backend().vm_release(d_.device(), reinterpret_cast<void*>(base), seg->size);
      } else {
        release_segment_memory(*seg);  // reads the head block's pool: before the blocks go
      }
    } catch (...) {  // teardown: this segment stays with the device; the others still go
    }
    for (block* b = seg->head; b != nullptr;) {
      block* next = b->next;
      delete b;
      b = next;
    }
  }
}

}  // namespace ccalloc::detail

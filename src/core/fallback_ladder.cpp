// The fallback ladder: what a malloc does when no cached block of its
// (stream, pool) fits (the call tree is drawn in hot_path.cpp). allocate_slow
// runs the rungs in order with the whole device locked (world_lock): garbage
// collection, a new segment (alloc_segment; expandable segments in
// expandable_segments.cpp), releasing cached segments and retrying (the
// releases are the segment table's: segment_table.cpp), and last the
// out-of-memory error (out_of_memory.cpp).
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>

namespace ccalloc::detail {

// ---- the ladder ---------------------------------------------------------------------

namespace {
// The device and stream of the malloc whose slow path this thread runs:
// page fences may be recorded on that stream (can_record_on). Per thread,
// as the slow path that sets it is the one that records: another thread's
// slow path (the world lock may be released on the way, e.g. for
// out-of-memory observers) never sees it.
struct fence_stream_slot {
  const device_state* device = nullptr;
  stream_t stream = 0;
};
thread_local fence_stream_slot tls_fence_stream;

struct fence_stream_scope {
  fence_stream_slot saved;
  fence_stream_scope(const device_state* d, stream_t s) : saved(tls_fence_stream) { tls_fence_stream = {d, s}; }
  ~fence_stream_scope() { tls_fence_stream = saved; }
  fence_stream_scope(const fence_stream_scope&) = delete;
  fence_stream_scope& operator=(const fence_stream_scope&) = delete;
};
}  // namespace

bool device_fences::can_record_on(const stream_state& ss) const noexcept {
  if (ss.gone) return false;  // destroyed: stream_destroyed
  return ss.stream == default_stream || (tls_fence_stream.device == &d_ && tls_fence_stream.stream == ss.stream);
}

// The slow path, with the whole device locked. A request that fails (host
// out of memory on the way: std::bad_alloc from any host allocation, the
// backend's included) gives back the segment or reservation it made, with
// its pages (device_memory::made_segment, discard_made_segment): the segment counts, reserved
// memory, pools and page tables are as before (SPEC R5). Pages it recycled
// from other free blocks on the way stay returned to the device.
block* device_state::allocate_slow(alloc_params& p, world_lock& w) {
  memory_.clear_made();
  try {
    return climb_ladder(p, w);
  } catch (...) {
    if (w.locked()) segments_.discard_made_segment(p);  // (an observer's unlocked throw made nothing)
    throw;
  }
}

// take_found_block for a rung's block, out of its pool (the rung took it
// out; a new segment's was never in one). take_found_block throws only
// before it changes anything (host memory for a split): the block goes back.
block* device_state::take_from_rung(alloc_params& p) {
  try {
    return take_found_block(p, stats_.values());
  } catch (...) {
    block* b = p.found;
    if (!b->pool->blocks.contains(b)) {
      try {
        b->pool->blocks.insert(b);  // into the bin it left: a free slot, no allocation (a new segment's: may fail)
      } catch (...) {  // no slot: the block is lost to the pool; the first error is the one thrown
      }
    }
    throw;
  }
}

// allocate_slow's rungs, each a function below, in the order of the picture
// in hot_path.cpp. A rung returns the block that serves the request
// (take_from_rung), or nullptr to go on to the next.
namespace {

// What the rungs share: the request, the world lock, and two facts read
// once at the start of the slow path.
struct climb {
  device_state& d;
  alloc_params& p;
  world_lock& w;
  bool capturing;  // a graph capture is underway: no event queries or waits, no device frees
  bool custom;     // a private pool with its own segment allocator: its memory is its own
};

// Before any rung: statistics published; whether a capture is underway;
// completed events, deferred frees,
// page fences and deferred unmaps settled (not while capturing); room in
// the pool's index for a remainder (block_index::owes; may throw).
void prepare_climb(climb& c) {
  device_state& d = c.d;
  d.stats().publish_all_pending(c.w);
  c.capturing = d.pools().capture_underway();
  if (!c.capturing) {
    d.events().process_events_locked();
    if (!d.pools().deferred_frees().empty()) d.pools().flush_deferred_frees();
    if (d.expandable().page_bytes() != 0 && d.policy().config().expandable_segments) d.fences().fence_streams(c.w);
    d.expandable().settle_retired(false);  // deferred unmaps whose fence has completed
  }
  if (c.p.pool->blocks.owes()) c.p.pool->blocks.repay();
}

// Rung 0: requests that cannot fit fail at once, the cache kept. More than
// the whole device (or than the memory fraction allows); or a large request
// that needs more than the device's free memory and all this allocator
// holds beyond its live blocks (what returning the whole cache could give).
// PyTorch returns the cache and retries first; here that only cost (docs/
// design.md, "Note: hopeless requests fail at once"). The device is asked
// only for large requests (one mem_get_info).
bool cannot_fit(climb& c) {
  device_state& d = c.d;
  if (c.custom) return false;
  if (c.p.size > (d.memory().capped() ? d.memory().allowed() : d.memory().total())) return true;
  if (c.p.size < free_memory_check_bytes) return false;
  const auto live = static_cast<std::size_t>(
      std::max<std::int64_t>(0, d.stats().values().allocated_bytes[static_cast<std::size_t>(stat_group::all)].current));
  const std::size_t held_beyond_live = d.memory().reserved() > live ? d.memory().reserved() - live : 0;
  std::size_t could_get = d.backend().mem_get_info(d.device()).free_bytes + held_beyond_live;
  if (d.memory().capped())
    could_get = std::min(could_get, d.memory().allowed() > live ? d.memory().allowed() - live : 0);
  return c.p.size > could_get;
}

// Rung 1 again: another thread may have freed a block meanwhile.
block* rung_cached_block(climb& c) { return c.d.get_free_block(c.p) ? c.d.take_from_rung(c.p) : nullptr; }

// Rung 2: above the garbage-collection threshold, release old cached blocks.
void rung_garbage_collection(climb& c) {
  if (c.d.policy().config().garbage_collection_threshold > 0.0 && !c.capturing)
    c.d.segments().garbage_collect_cached_blocks(c.w);
}

// Rungs 3 and 5 with expandable segments (B7, X3): place the request in the
// stream's expandable segment, mapping pages (recycled from free whole
// pages when the peak or the cap would grow); else wait for events, unmap
// every free page, retry. Then (no block) every free page goes back.
block* rung_expandable(climb& c) {
  device_state& d = c.d;
  d.expandable().clear_no_address_space();
  // Tags' reservations left without a page (their cached pages recycled)
  // give their address space back before another is made.
  if (c.p.pool->priv != nullptr && c.p.pool->priv->is_tag_pool())
    d.expandable().release_empty_expandable_segments(expandable_segments::empty_of::tags);
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt == 1 && d.get_free_block(c.p)) return d.take_from_rung(c.p);
    if (d.expandable().alloc_expandable(c.p, false, c.w) ||
        (d.segments().release_cached_blocks(c.w, /*for_retry=*/true) &&
         (d.get_free_block(c.p) || d.expandable().alloc_expandable(c.p, true, c.w))))
      return d.take_from_rung(c.p);
    if (d.expandable().no_address_space()) break;
    if (!d.events().wait_for_completions_in_flight(c.w)) break;  // X7
  }
  // The retry kept the pages of the chosen run mapped: give them back too.
  if (!c.capturing) {
    d.expandable().unmap_free_pages(std::numeric_limits<std::size_t>::max(), nullptr, 0, 0, nullptr, true);
    d.expandable().settle_retired(true);
  }
  d.expandable().release_empty_expandable_segments();
  return nullptr;
}

// Rung 3a (trim_on_new_peak): a request that would raise reserved memory
// above its high-water mark first takes (X2) a cached whole segment of
// another stream that fits; else cached whole segments (none fits) go back
// to the device: the peak grows by less.
block* rung_trim_on_new_peak(climb& c) {
  device_state& d = c.d;
  if (!d.policy().config().trim_on_new_peak || c.capturing ||
      d.memory().reserved() + c.p.alloc_size <= d.memory().high_water())
    return nullptr;
  if (d.policy().config().reuse_across_streams && c.p.pool->priv == nullptr && d.adopt_idle_segment(c.p, c.w))
    return d.take_from_rung(c.p);
  d.segments().release_unused_segments(c.w, /*keep_going=*/true);
  return nullptr;
}

// Rung 3: a new segment. Rung 4: free oversize cached blocks and retry.
// Rung 5: wait for pending events, free every cached segment, retry (after
// the wait the blocks they held are free and merged: one may fit now, so
// the pool is searched before the device malloc).
block* rung_new_segment(climb& c) {
  device_state& d = c.d;
  const bool priv = c.p.pool->priv != nullptr;
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt == 1 && d.policy().caching() && d.get_free_block(c.p)) return d.take_from_rung(c.p);
    if (d.alloc_segment(c.p, false, c.w) ||
        (d.policy().caching() && !priv && !c.capturing && d.segments().release_available_cached_blocks(c.p) &&
         d.alloc_segment(c.p, false, c.w)) ||
        (d.segments().release_cached_blocks(c.w, /*for_retry=*/true) &&
         ((d.policy().caching() && d.get_free_block(c.p)) || d.alloc_segment(c.p, true, c.w))))
      return d.take_from_rung(c.p);
    if (!d.events().wait_for_completions_in_flight(c.w)) break;  // X7: blocks another thread is returning
  }
  return nullptr;
}

// Rung 5b (F22): a free block of a pool that lends on OOM. Rung 6: the
// out-of-memory error (observers run unlocked).
block* rung_out_of_memory(climb& c) {
  c.d.memory().clear_made();  // released by now
  if (c.d.pools().try_use_on_oom_pools(c.p, c.w)) return c.d.take_from_rung(c.p);
  c.d.oom().throw_out_of_memory(c.p, c.w);
}

}  // namespace

block* device_state::climb_ladder(alloc_params& p, world_lock& w) {
  // Events may be recorded on the malloc's own stream (it exists: the caller
  // passed it), never on other streams (can_record_on).
  const fence_stream_scope fence_scope(this, p.stream);
  const bool custom = p.pool->priv != nullptr && p.pool->priv->custom.malloc;
  climb c{*this, p, w, false, custom};
  prepare_climb(c);
  if (cannot_fit(c)) return rung_out_of_memory(c);
  if (policy_.caching()) {
    if (block* b = rung_cached_block(c)) return b;
    rung_garbage_collection(c);
    // A named tag's memory is always in reservations where the backend has
    // virtual memory, whatever expandable_segments says: pause releases
    // its pages and resume maps them again at the same addresses.
    const bool tagged = p.pool->priv != nullptr && p.pool->priv->tag != default_tag_id;
    if ((policy_.config().expandable_segments || tagged) && expandable_.page_bytes() != 0 && !custom) {
      if (block* b = rung_expandable(c)) return b;
      // Out of address space (a new reservation was refused, e.g. with very
      // many streams): this request gets a plain segment instead.
      if (!expandable_.no_address_space()) return rung_out_of_memory(c);
      expandable_.warn_plain_fallback(p.size);
    }
    if (block* b = rung_trim_on_new_peak(c)) return b;
  }
  if (block* b = rung_new_segment(c)) return b;
  return rung_out_of_memory(c);
}

// ---- rung 3: a new segment ----------------------------------------------------------

bool device_state::alloc_segment(alloc_params& p, bool is_retry, world_lock& w) {
  if (is_retry) ++stats_.values().num_alloc_retries;
  const std::size_t size = p.alloc_size;
  if (memory_.over_cap(size)) return false;
  void* ptr = nullptr;
  private_pool* const pp = p.pool->priv;
  auto device_malloc = [&] {
    return pp != nullptr && pp->custom.malloc ? pp->custom.malloc(size) : backend_.segment_malloc(device_, size);
  };
  auto device_free = [&]() noexcept {  // a segment that cannot be put on the books
    try {
      if (pp != nullptr && pp->custom.free) pp->custom.free(ptr);
      else backend_.segment_free(device_, ptr);
    } catch (...) {  // noexcept cleanup: the segment stays with the device; the first error is reported
    }
  };
  // Host memory first (may throw; nothing changed): the segment's record,
  // its block and the remainder's (take_found_block splits it).
  auto fresh = std::make_unique<segment>();
  p.owner->reserve_spare_blocks(2);
  if (policy_.config().release_lock_on_cudamalloc) {
    // B8: other threads may use the cache while the device mallocs.
    w.unlock();
    try {
      ptr = device_malloc();
    } catch (...) {
      w.lock();
      throw;
    }
    try {
      w.lock();
    } catch (...) {  // no host memory to lock again: the segment goes back
      if (ptr != nullptr) device_free();
      throw;
    }
    // The stream destroyed meanwhile (its state may be forgotten, no longer
    // among w's): the segment goes back, the malloc is refused.
    if (p.owner->gone) [[unlikely]] {
      if (ptr != nullptr) device_free();
      registry_.refuse_malloc(p.stream);
    }
    stats_.publish_all_pending(w);
    // The cap may have been reached meanwhile by another thread.
    if (ptr != nullptr && memory_.over_cap(size)) {
      device_free();
      return false;
    }
  } else {
    ptr = device_malloc();
  }
  if (ptr == nullptr) return false;

  segment* added = nullptr;
  try {
    added = &segments_.add_segment(p, std::move(fresh), reinterpret_cast<std::uintptr_t>(ptr), size);
  } catch (...) {  // no host memory for the map's entry
    device_free();
    throw;
  }
  segment& seg = *added;
  memory_.note_made(&p, seg.base);
  ++p.pool->plain_segments;
  block* b = seg.head;
  seg.oversize = size >= policy_.config().max_split_size_bytes;

  const stat_group g = group_of(p.pool);
  count_up(stats_.values().reserved_bytes, g, static_cast<std::int64_t>(size));
  if (b->seg->oversize) stats_.values().oversize_segments.increase(1);
  ++stats_.values().num_device_alloc;
  memory_.add_reserved(size);
  memory_.raise_high_water();
  p.found = b;
  mapping_.announce(mapping_change::map, mapping_reason::segment_alloc, b->ptr, size, p.stream, false);
  if (history_.active()) [[unlikely]]
    history_.record_segment_alloc(b->ptr, size, p.stream);
  return true;
}
// ---- rung 3a: a cached whole segment of another stream (X2) ----------------------------

// Moves to the requesting stream the best-fitting cached whole segment of
// another stream once its page fence has completed (no work of that stream
// is left on it), waiting for the fence if it has not. Called only where the
// alternative, returning cached segments before a new peak, would
// synchronize the device anyway (cudaFree).
bool device_state::adopt_idle_segment(alloc_params& p, const world_lock& w) {
  block* best = nullptr;
  for (stream_state* ss : w.streams()) {
    if (ss == p.owner) continue;
    block_pool& pool = p.pool->is_small ? ss->pools.small : ss->pools.large;
    for (auto i = pool.blocks.lower_bound(p.size); i != block_index::end(); i = pool.blocks.next(i)) {
      block* b = pool.blocks.at(i);
      if (b->is_split()) continue;
      if (!policy_.oversize_rules_allow(p.size, b->size)) break;
      if (best == nullptr || b->size < best->size) best = b;
      break;  // the smallest whole segment of this pool that fits
    }
  }
  if (best == nullptr) return false;
  // Its stream may still use it: wait for its fence (counted), cheaper than
  // the alternative's cudaFree, which synchronizes the whole device.
  fences_.await_fence(best, page_fences::wait_reason::adopt_segment);
  stats_.values().bytes_moved_between_streams += static_cast<std::int64_t>(best->size);
  best->pool->blocks.erase(best);
  --best->pool->plain_segments;
  --best->pool->owner->segments;
  ++p.pool->plain_segments;
  ++p.pool->owner->segments;
  best->pool = p.pool;
  best->stream = p.stream;
  p.found = best;
  return true;
}

block* device_state::allocate_in_private_pool(private_pool& pp, std::size_t requested_bytes, stream_state& ss,
                                              world_lock& w) {
  if (pp.tag != default_tag_id && tags_.tag_paused(pp.tag))
    throw invalid_argument_error("ccalloc: malloc of " + std::to_string(requested_bytes) + " bytes under tag '" +
                                 tag_name(pp.tag) + "' on device " + std::to_string(device_) +
                                 ": the tag is paused; resume it first (or allocate under another tag)");
  struct unpin {
    std::atomic<int>& n;
    ~unpin() { n.fetch_sub(1, std::memory_order_release); }
  };
  pp.pinned.fetch_add(1, std::memory_order_relaxed);
  unpin guard{pp.pinned};
  alloc_params p;
  policy_.prepare(p, requested_bytes, ss);
  p.pool = &pools_.pool_in(pp, ss, p.pool->is_small);
  return allocate_slow(p, w);
}

block* allocate_tagged(device_state& d, std::size_t requested_bytes, stream_state& ss, tag_id tag) {
  world_lock w(d);
  stream_state& live = d.registry().live(w, ss);  // destroyed since looked up: refused
  private_pool& pp = d.tags().tag_pool(tag);
  try {
    return d.allocate_in_private_pool(pp, requested_bytes, live, w);
  } catch (...) {
    // Refused (a paused tag, out of memory) before the tag held anything:
    // its fresh pool is forgotten again. Without the world lock (the
    // out-of-memory observers ran unlocked) the next empty_cache does it.
    if (w.locked()) d.tags().note_if_empty(pp);
    throw;
  }
}

}  // namespace ccalloc::detail

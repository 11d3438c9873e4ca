// The hot path: malloc and free of a cached block, read top-down from the
// public entry points. Policies follow PyTorch's DeviceCachingAllocator
// (c10/cuda/CUDACachingAllocator.cpp) unless a comment says otherwise; the
// code is ccalloc's own. Everything a cached malloc or a free touches is in
// this file (one translation unit, so the compiler can inline it); the rest
// of the allocator is one file per concept (see src/README.md).
//
// Allocation call tree (malloc); [lock held], (file when not this one):
//
//   device_caching_allocator::malloc
//     thread_cache_take         a block this thread parked for this (stream, size): no
//                               stream lock (detail/thread_cache_fast.hpp); a miss returns
//                               the thread's parked blocks to their pools first
//     malloc_impl               size 0 or too large: throw_out_of_memory at once (F2)
//     device_state::allocate                                          [stream lock]
//       stream_for                the stream's state (thread-local cache, else registry)
//       prepare_search, find_free_block
//                                 best fit in (stream, pool): B1-B3 (placement_policy.hpp)
//       take_found_block          split if worth it, stats via stats_sink
//     allocate_unusual          instead, only if events are pending or a pool scope is active:
//       process_events            (events.cpp; not while a capture is underway) device lock, then stream locks
//       pools_.scopes().routed    (pool_scopes.hpp) begin_allocate_to_pool's newest matching filter [device lock]
//         -> allocate_slow with the private pool's (stream, pool)       [world lock]
//       then as allocate
//     allocate_slow             on a miss (fallback_ladder.cpp)        [world lock]
//       climb_ladder: one chain of named rungs; each returns a block or the chain goes on:
//         prepare_climb           events, deferred frees, page fences, deferred unmaps
//         cannot_fit              more than the device could give: to rung_out_of_memory
//         if caching (not no-caching mode):
//           rung_cached_block       best fit again (another thread may have freed)
//           rung_garbage_collection above the GC threshold
//           if expandable segments (or a named tag) on a backend with virtual memory:
//             rung_expandable       alloc_expandable (expandable_segments.cpp), then
//                                   release_cached_blocks + alloc_expandable
//             if that failed with address space left: to rung_out_of_memory;
//             out of address space: on to plain segments below
//           rung_trim_on_new_peak   adopt_idle_segment, release_unused_segments
//         rung_new_segment        alloc_segment; release_available_cached_blocks +
//                                 alloc_segment; release_cached_blocks + best fit again
//                                 (the events it waited for may have freed and merged a
//                                 block that fits) or alloc_segment
//         rung_out_of_memory      try_use_on_oom_pools (F22; private_pools.cpp), then
//                                 throw_out_of_memory (B6, out_of_memory.cpp; observers
//                                 called unlocked)
//   While a capture is underway (a begin_allocate_to_pool active and a stream
//   seen allocating during it capturing: capture_underway) the ladder
//   neither queries nor waits for events nor frees device memory: garbage
//   collection, trimming and the releases are skipped. A scope without a
//   capture changes nothing here.
//
// Free call tree:
//
//   device_caching_allocator::free
//     thread_cache_park         park it in this thread's cache (not record_stream'd, no
//                               private pool, caching on, no capture): no stream lock
//     device_state::free                                               [stream lock]
//       used on other streams (record_stream)?
//         capture underway?  defer_free (private_pools.cpp)              [+ device lock]
//         else               insert_events: one event per stream (events.cpp) [+ device lock]
//       else no-caching mode and a whole segment?
//                            free_uncached: back to the device (fallback_ladder.cpp) [+ device lock]
//       release_allocation   counts it freed (stats via stats_sink)
//         free_block         only when it waits on no event:
//           merge            with the free neighbour before and after it
//           back into its pool (block_index::insert, or rekey_at: the
//                            merged neighbour's entry becomes the block's)
//   A block that waits on events is returned by process_events (events.cpp)
//   when they have completed, through the same free_block.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/current_tag.hpp"
#include "detail/device_state.hpp"

#include <ccalloc/base/detail/assert.hpp>
#include <ccalloc/base/detail/hot_tls.hpp>
#include "detail/stats_sink.hpp"
#include "detail/thread_cache_fast.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>

namespace ccalloc {

using detail::block;
using detail::world_lock;

// ---- entry points ---------------------------------------------------------------

namespace {

// malloc of 0 bytes or of max_request_bytes or more.
[[gnu::noinline, noreturn]] void reject_size(detail::device_state& s, std::size_t size_bytes, stream_t stream) {
  if (size_bytes == 0) throw invalid_argument_error("ccalloc: device_caching_allocator::malloc of 0 bytes");
  world_lock w(s);
  detail::alloc_params p;
  p.requested_bytes = size_bytes;
  p.size = size_bytes;
  p.alloc_size = size_bytes;
  p.stream = stream;
  s.oom().throw_out_of_memory(p, w);  // SPEC F2: at once, nothing else tried
}

// malloc without history: inlined into device_caching_allocator::malloc.
[[gnu::always_inline]] inline allocation malloc_impl(detail::device_state& s, std::size_t size_bytes,
                                                     stream_t stream) {
  if (size_bytes == 0 || size_bytes >= max_request_bytes) [[unlikely]]
    reject_size(s, size_bytes, stream);
  block* b = s.allocate(size_bytes, stream);
  return {reinterpret_cast<void*>(b->ptr), b};
}

}  // namespace

allocation detail::malloc_unrecorded(detail::device_state& s, std::size_t size_bytes, stream_t stream) {
  return malloc_impl(s, size_bytes, stream);
}

// malloc and free are each one function body (flatten: every call of this
// file they make is inlined, recursively), so that the hot path's steps can
// stay small functions; what is rare is kept out of line (gnu::noinline:
// reject_size, allocate_unusual, allocate_locked, registered_stream,
// free_used_on_other_streams, fence_before_free) or lives in another file
// (the slow path, events, the thread cache when it is on).
[[gnu::flatten]] allocation device_caching_allocator::malloc(std::size_t size_bytes, stream_t stream) {
  auto& s = *state_;
  if (s.history().active()) [[unlikely]] {
    detail::thread_cache_flush_own(s);  // parked before recording began
    return detail::malloc_recorded(s, size_bytes, stream);
  }
  // Under a tag other than default: never a parked block (the thread cache
  // holds default-pool blocks only).
  if (detail::tls_current_tag == default_tag_id) [[likely]]
    if (block* b = detail::thread_cache_take(s, size_bytes, stream)) [[likely]]
      return {reinterpret_cast<void*>(b->ptr), b};
  return malloc_impl(s, size_bytes, stream);
}

[[gnu::flatten]] void device_caching_allocator::free(block* b) {
  auto& s = *state_;
  if (!s.history().active()) [[likely]] {
    if (!detail::thread_cache_park(s, b)) s.free(b);
    return;
  }
  detail::thread_cache_flush_own(s);  // parked before recording began: freed first, in the program's order
  detail::free_recorded(s, b);
}

namespace detail {

// ---- malloc of a cached block ---------------------------------------------------

namespace {

// One cached (device state, stream) -> stream_state per thread: the fast path
// finds its stream without the registry lock (stream_registry.hpp).
CCALLOC_HOT_TLS thread_local stream_cache_entry tls_stream_cache;

// No cached block of the stream fits (or its stream was destroyed since the
// thread looked it up): the fallback ladder, under the world lock (the
// configuration may have changed since the stream lock was let go).
[[gnu::noinline]] block* allocate_locked(device_state& d, std::size_t requested_bytes, stream_state& ss) {
  world_lock w(d);
  alloc_params p;
  d.policy().prepare(p, requested_bytes, d.registry().live(w, ss));
  return d.allocate_slow(p, w);
}
}  // namespace

block* device_state::allocate(std::size_t requested_bytes, stream_t stream) {
  if ((events_.pending_count() | pools_.scopes().depth() |
       tls_current_tag) != 0) [[unlikely]]
    return allocate_unusual(requested_bytes, stream);
  stream_state& ss = registry_.stream_for(stream);
  alloc_params p;
  {
    std::lock_guard lock(ss.mutex);
    policy_.prepare_search(p, requested_bytes, ss);
    // Rung 1: a cached block of this stream and pool (not once the stream
    // is destroyed: allocate_locked refuses it, or finds it made again).
    if (policy_.caching() && !ss.gone) [[likely]] {
      if (const block_index::position at = find_free_block(p); !at.is_end()) [[likely]] {
        stats_sink sink(*this, ss);
        return note_reusable(take_found_block(p, sink.get(), at), ss);
      }
    }
  }
  return allocate_locked(*this, requested_bytes, ss);
}

// allocate when events are pending or a begin_allocate_to_pool is active.
[[gnu::noinline]] block* device_state::allocate_unusual(std::size_t requested_bytes, stream_t stream) {
  stream_state& ss = registry_.stream_for(stream);  // first: a stream it refuses leaves everything as it was
  const bool scoped = pools_.scopes().active();
  if (scoped) pools_.note_if_capturing(stream);
  // Never while capturing: event queries are not allowed then.
  if (!pools_.capture_underway()) events_.process_events();
  if (scoped) {
    bool routed = false;
    {
      std::lock_guard device_lock(device_mutex_);
      routed = pools_.scopes().routed(stream) != nullptr;
    }
    if (routed) {
      world_lock w(*this);
      stream_state& live = registry_.live(w, ss);
      if (private_pool* pp = pools_.scopes().routed(stream)) {  // again: it may have ended meanwhile
        if (pp->use_count == 0)
          throw invalid_argument_error("ccalloc: allocation on stream " + std::to_string(stream) +
                                       " is routed by begin_allocate_to_pool to private pool " + to_string(pp->id) +
                                       " of device " + std::to_string(device_) +
                                       ", which was released (use count 0); end_allocate_to_pool it first");
        return allocate_in_private_pool(*pp, requested_bytes, live, w);
      }
    }
  }
  if (const tag_id tag = tls_current_tag; tag != default_tag_id)
    return allocate_tagged(*this, requested_bytes, ss, tag);
  alloc_params p;
  {
    std::lock_guard lock(ss.mutex);
    policy_.prepare_search(p, requested_bytes, ss);
    if (policy_.caching() && !ss.gone) {
      if (const block_index::position at = find_free_block(p); !at.is_end()) {
        stats_sink sink(*this, ss);
        return note_reusable(take_found_block(p, sink.get(), at), ss);
      }
    }
  }
  return allocate_locked(*this, requested_bytes, ss);
}

// The registry's entry of `stream`, made if new; cached for this thread. [registry]
stream_state& stream_registry::registered_slot(stream_t stream) {
  auto it = streams_.find(stream);
  if (it == streams_.end()) {
    // Made before it is entered: out of host memory, the registry stays as
    // it was (an empty entry left behind was dereferenced later).
    auto fresh = std::make_unique<stream_state>(stream);
    by_handle_.reserve(by_handle_.size() + 1);  // the insert below then cannot throw
    it = streams_.emplace(stream, std::move(fresh)).first;
    auto& slot = it->second;
    by_handle_.insert(std::lower_bound(by_handle_.begin(), by_handle_.end(), stream,
                                       [](const stream_state* a, stream_t h) { return a->stream < h; }),
                      slot.get());
    const std::size_t page = d_.expandable().page_bytes();
    if (stream != default_stream && streams_.size() >= 2 && page != 0) slot->fence_free_bytes = page;
    if (streams_.size() == 2) {
      // The first stream kept its statistics pending without a lock; publish
      // them before two streams can publish independently. Its frees of
      // pages may now be wanted by another stream (free_records_fence).
      for (auto& [other_stream, other] : streams_) {
        if (other.get() == slot.get()) continue;
        std::lock_guard other_lock(other->mutex);
        std::lock_guard stats_lock(d_.stats().mutex());
        publish_pending_stats(d_.stats().values(), *other);
        if (other_stream != default_stream && page != 0) other->fence_free_bytes = page;
        single_stream_.store(false, std::memory_order_relaxed);
      }
    }
  }
  name_in_thread_cache(*it->second);
  return *it->second;
}

// The entry names the state before the caller gets it: the state is not
// deleted while the entry names it (forget_gone_streams). Release: a world
// lock holder that reads the new entry sees every use of the state it named
// before as done. [registry]
void stream_registry::name_in_thread_cache(stream_state& ss) const noexcept {
  stream_cache_entry& e = tls_stream_cache;
  const stream_state* const before = e.state.load(std::memory_order_relaxed);
  e.owner_id.store(cache_key_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  e.stream.store(ss.stream, std::memory_order_relaxed);
  e.state.store(&ss, std::memory_order_release);
  if (before != nullptr && before != &ss) note_entry_change();
}

// A malloc whose thread looked its stream up before it was destroyed finds
// it gone under the world lock: refused as a malloc on a destroyed stream,
// unless the handle was made again meanwhile (its state now: the same one
// made live again, or a new one, registered, so locked by w, and named by
// the thread's entry from now on, as the caller may let w go for a while).
stream_state& stream_registry::live(const world_lock&, stream_state& ss) const {
  if (!ss.gone) [[likely]]
    return ss;
  const auto it = streams_.find(ss.stream);
  if (it == streams_.end() || it->second->gone) refuse_malloc(ss.stream);
  name_in_thread_cache(*it->second);
  return *it->second;
}

// stream_for on a miss of the thread's cached entry: the registry.
// A stream not met before, or destroyed (stream_destroyed), is checked with
// the backend (SPEC R5): a handle never created would fail later, at its
// free. A destroyed stream's handle that the backend reports live again is
// a new stream (CUDA reuses handles). A stream met and live is not asked
// about again: no backend call per malloc (docs/limitations.md).
[[gnu::noinline]] stream_state& stream_registry::registered_stream(stream_t stream) {
  enlist_thread(tls_stream_cache);  // once per thread: reclaim_limbo reads the entry
  {
    std::lock_guard lock(registry_mutex_);
    const auto known = streams_.find(stream);
    const bool met = known != streams_.end();
    if (met && !known->second->gone) return registered_slot(stream);
    if (!d_.backend().is_stream(d_.device(), stream))  // one message, remembered or forgotten (forget_gone_streams)
      refuse_malloc(stream);
    if (!met) {
      note_thread_stream(stream);
      return registered_slot(stream);
    }
  }
  note_thread_stream(stream);  // a thread's own stream marked gone, used again by a later exit hook
  set_stream_gone(stream, false);  // made again; the world lock takes the registry's lock
  std::lock_guard lock(registry_mutex_);
  return registered_slot(stream);
}

void stream_registry::forget_thread_stream() noexcept {
  stream_cache_entry& e = tls_stream_cache;
  e.owner_id.store(0, std::memory_order_relaxed);
  e.stream.store(0, std::memory_order_relaxed);
  if (e.state.exchange(nullptr, std::memory_order_release) != nullptr) note_entry_change();
}

// The cached entry, if it is this device's (its key unchanged) and stream's.
// A state forgotten after the key was read is not deleted while the entry
// names it; the caller sees it gone under its lock (allocate).
stream_state& stream_registry::stream_for(stream_t stream) {
  const stream_cache_entry& c = tls_stream_cache;
  if (c.owner_id.load(std::memory_order_relaxed) == cache_key_.load(std::memory_order_relaxed) &&
      c.stream.load(std::memory_order_relaxed) == stream) [[likely]]
    return *c.state.load(std::memory_order_relaxed);
  return registered_stream(stream);
}

void placement_policy::prepare_search(alloc_params& p, std::size_t requested_bytes, stream_state& ss) const noexcept {
  p.requested_bytes = requested_bytes;
  p.stream = ss.stream;
  p.owner = &ss;
  p.size = round_size(requested_bytes);
  p.pool = p.size <= small_request_bytes ? &ss.pools.small : &ss.pools.large;
  p.found = nullptr;
}

void placement_policy::prepare(alloc_params& p, std::size_t requested_bytes, stream_state& ss) const noexcept {
  prepare_search(p, requested_bytes, ss);
  p.alloc_size = allocation_size(p.size);
}

// B1: 512-byte multiples, or the next of `divisions` equal steps between two
// powers of two (roundup_power2_divisions).
std::size_t placement_policy::round_size(std::size_t size) const noexcept {
  if (size < min_block_bytes) return min_block_bytes;
  const std::size_t divisions = config_.divisions_for(size);  // 0 when none are set
  // size / 512 > divisions, written so that no product can overflow.
  if (divisions > 1 && size / min_block_bytes > divisions) {
    if (std::has_single_bit(size)) return size;
    const std::size_t floor = std::bit_floor(size);
    const std::size_t step = floor / divisions;
    const std::size_t rounded = size & ~(step - 1);
    return rounded == size ? size : rounded + step;
  }
  return (size + min_block_bytes - 1) / min_block_bytes * min_block_bytes;
}

// B2: segment size for a new segment serving a block of `size` bytes.
std::size_t placement_policy::allocation_size(std::size_t size) const noexcept {
  if (!caching_) return size;  // no-caching mode (F6): exactly the block
  if (size <= small_request_bytes) return small_segment_bytes;
  if (size < min_large_alloc_bytes) return config_.large_segment_size_bytes;
  return (size + large_round_bytes - 1) / large_round_bytes * large_round_bytes;
}

// B3: best fit by (size, address) in the request's (stream, pool), with the
// oversize rules: a small request never takes an oversize block, and an
// oversize request takes one at most max_non_split_rounding bytes larger.
// The found block stays in its pool's index at the returned position (end():
// none); take_found_block takes it out, or rewrites its entry in place for
// the remainder of a split. The caller holds the pool's stream lock from
// one to the other (allocate, allocate_unusual): nothing else can change the
// index in between, so the position stays valid.
block_index::position device_state::find_free_block(alloc_params& p) {
  block_pool& pool = *p.pool;
  if (policy_.config().garbage_collection_threshold > 0.0) ++pool.get_free_blocks_call_count;
  const block_index::position i = pool.blocks.lower_bound(p.size);
  if (i.is_end()) return i;
  block* b = pool.blocks.at(i);
  if (!policy_.oversize_rules_allow(p.size, b->size)) return block_index::end();  // b->size >= p.size (lower_bound)
  // Expandable segments: carving b, a free island (no block in use beside
  // it), would start a new run of live blocks (lowest_fitting_block; rare).
  if (b->size != p.size && !pool.is_small && b->seg->expandable && (b->prev == nullptr || !b->prev->mapped) &&
      (b->next == nullptr || !b->next->mapped)) [[unlikely]] {
    const block_index::position lowest = policy_.lowest_fitting_block(p, i);
    p.found = pool.blocks.at(lowest);
    return lowest;
  }
  p.found = b;
  return i;
}

bool device_state::get_free_block(alloc_params& p) {
  const block_index::position i = find_free_block(p);
  if (i.is_end()) return false;
  p.pool->blocks.erase_at(i);
  return true;
}

bool placement_policy::should_split(const block* b, std::size_t size) const noexcept {
  if (b->pool->no_split) [[unlikely]]
    return false;  // F22
  const std::size_t remaining = b->size - size;
  // Expandable segments: always carve exactly (the remainder shares pages
  // with the block; unneeded whole pages are unmapped, not kept as slack).
  if (b->pool->is_small || b->seg->expandable) return remaining >= min_block_bytes;
  return size < config_.max_split_size_bytes && remaining > small_request_bytes;
}

// Splits free block `b` (outside its pool) at address `at`; returns the upper
// part, which inherits b's stream, pool, segment and mapping state.
block* device_state::split_free_block(block* b, std::uintptr_t at) {
  CCALLOC_ASSERT(b->is_free() && at > b->ptr && at < b->ptr + b->size && (at - b->ptr) % min_block_bytes == 0);
  block* hi = b->pool->owner->new_block();
  hi->ptr = at;
  hi->size = b->ptr + b->size - at;
  b->size -= hi->size;
  hi->stream = b->stream;
  hi->pool = b->pool;
  hi->seg = b->seg;
  hi->mapped = b->mapped;
  hi->free_seq = b->free_seq;
  hi->next = b->next;
  if (hi->next != nullptr) hi->next->prev = hi;
  hi->prev = b;
  b->next = hi;
  return hi;
}

// Whether a split of free block b hands out its back: in an expandable
// segment, when the block above is in use (allocated or waiting for events)
// and the one below is not (unmapped, or the segment's start).
bool placement_policy::place_at_back(const block* b) const noexcept {
  if (!b->seg->expandable || b->pool->is_small) return false;
  const bool next_in_use = b->next != nullptr && b->next->mapped && !b->next->is_free();
  const bool prev_in_use = b->prev != nullptr && b->prev->mapped && !b->prev->is_free();
  return next_in_use && !prev_in_use;
}

namespace {
// take_found_block's steps, inlined into it (it is on the hot path).

// The caller gets the front of free block `remaining` (p.size bytes, a new
// block object); the remainder, the same object, stays cached above it.
[[gnu::always_inline]] inline block* carve_front(const alloc_params& p, block* remaining) {
  block* b = p.owner->new_block();
  b->ptr = remaining->ptr;
  b->size = p.size;
  b->stream = remaining->stream;
  b->pool = remaining->pool;
  b->seg = remaining->seg;
  b->prev = remaining->prev;
  if (b->prev != nullptr) b->prev->next = b;
  else b->seg->head = b;
  b->next = remaining;
  remaining->prev = b;
  remaining->ptr += p.size;
  remaining->size -= p.size;
  return b;
}

// Splits p.found (at `at` in its pool's index, or not in it: end()) and
// returns the caller's block; the remainder (p.found's object) and, on a
// page boundary inside the block, a second remainder above the caller's
// stay cached. Counts the inactive splits and notes them on the caller's
// block (reuse_split_*).
[[gnu::always_inline]] inline block* split_found_block(device_state& d, alloc_params& p, device_stats& st,
                                                       block_index::position at, bool already_split) {
  block* b = p.found;
  const stat_group g = group_of(p.pool);
  // Room for the remainder in the pool's index, before anything changes
  // (block_index::owes: host memory ran out).
  if (p.pool->blocks.owes()) [[unlikely]]
    p.pool->blocks.repay();
  block* remaining = b;
  const bool back = d.policy().place_at_back(b);
  std::uintptr_t start = back ? b->ptr + b->size - p.size : b->ptr;
  // Only where free pages are recycled at every new peak (the default):
  // the page it saves is the one its neighbours' recycling frees.
  if (b->seg->expandable && !b->pool->is_small && d.policy().recycles_at_every_peak() &&
      page_sliver(p.size, start - b->seg->base, b->seg->page_bytes)) [[unlikely]]
    start = placement_policy::page_aligned_start(*b, p.size, back);
  block* upper = nullptr;  // a second remainder, above the caller's block
  if (start != b->ptr && start + p.size != b->ptr + b->size) {
    // On a page boundary inside the block (page_aligned_start): the
    // caller gets the middle; both ends stay cached. Two remainders: room
    // for both and their block objects first (may throw; nothing changed).
    p.pool->blocks.reserve_two(start - b->ptr, b->ptr + b->size - start - p.size);
    p.owner->reserve_spare_blocks(2);
    upper = d.split_free_block(remaining, start + p.size);
    b = d.split_free_block(remaining, start);
  } else if (start != b->ptr) {
    // Expandable segments: the caller gets the back, next to the live block
    // above; the remainder stays cached next to the free or unmapped range
    // below, where its whole pages can be recycled (live blocks
    // stay in runs, free space in one piece).
    b = d.split_free_block(remaining, start);
  } else {
    b = carve_front(p, remaining);
  }
  CCALLOC_ASSERT(remaining->size >= min_block_bytes && remaining->size % min_block_bytes == 0);
  remaining->gc_count_base = remaining->pool->get_free_blocks_call_count;
  // The remainder is the found block's object, with a smaller size (and a
  // higher address when the caller got the front).
  if (!at.is_end()) remaining->pool->blocks.rekey_at(at, remaining);
  else remaining->pool->blocks.insert(remaining);
  if (upper != nullptr) [[unlikely]] {  // after the rekey: an insert may move the entry at `at`
    upper->gc_count_base = upper->pool->get_free_blocks_call_count;
    upper->pool->blocks.insert(upper);
    count_up(st.inactive_split, g, 1);  // expandable: the found block was split already
  }
  if (already_split) {
    count_down(st.inactive_split_bytes, g, static_cast<std::int64_t>(p.size));
    b->reuse_split_blocks = upper != nullptr ? 1 : 0;  // the second remainder is one more free block
    b->reuse_split_bytes = static_cast<std::int64_t>(p.size);
  } else {
    count_up(st.inactive_split, g, 1);
    count_up(st.inactive_split_bytes, g, static_cast<std::int64_t>(remaining->size));
    b->reuse_split_blocks = 1;
    b->reuse_split_bytes = static_cast<std::int64_t>(remaining->size);
  }
  return b;
}
}  // namespace

// Hands out p.found: split off the remainder if worth keeping, update stats.
// `at`: p.found's position in its pool's index, or end() when it is not in it.
block* device_state::take_found_block(alloc_params& p, device_stats& st, block_index::position at) {
  block* b = p.found;
  CCALLOC_ASSERT(b->pool == p.pool && !b->allocated && b->event_count == 0 && b->mapped);
  CCALLOC_ASSERT(b->size >= p.size && p.size % min_block_bytes == 0);
  const stat_group g = group_of(p.pool);
  const bool already_split = b->is_split();
  if (policy_.should_split(b, p.size)) {
    b = split_found_block(*this, p, st, at, already_split);
  } else {
    if (!at.is_end()) p.pool->blocks.erase_at(at);
    if (already_split) {
      count_down(st.inactive_split, g, 1);
      count_down(st.inactive_split_bytes, g, static_cast<std::int64_t>(b->size));
    }
    b->reuse_split_blocks = already_split ? 1 : 0;
    b->reuse_split_bytes = already_split ? static_cast<std::int64_t>(b->size) : 0;
  }
  b->allocated = true;
  ++b->seg->busy_blocks;
  b->requested_bytes = p.requested_bytes;
  const auto size = static_cast<std::int64_t>(b->size);
  count_up(st.allocation, g, 1);
  count_up(st.allocated_bytes, g, size);
  count_up(st.active, g, 1);
  count_up(st.active_bytes, g, size);
  count_up(st.requested_bytes, g, static_cast<std::int64_t>(p.requested_bytes));
  b->counted_oversize = b->size >= policy_.config().max_split_size_bytes;
  if (b->counted_oversize) st.oversize_allocations.increase(1);
  CCALLOC_ASSERT_EXPENSIVE(segment_is_valid(*b->seg));
  return b;
}

// Allocate's rung 1 handed out `b` by best fit: a free of it followed by a
// malloc of the same size, with the pool unchanged in between, would put
// the pool back as it was before and hand out `b` again, so the thread cache
// may elide the pair (detail/thread_cache.hpp, "Placement"): b records its
// pool's version. Not when that free would do more than merge: record a page
// fence (free_records_fence), or age the cached blocks (garbage collection counts
// the searches of the free list). Nor a large block while the cache takes
// small ones only. What else keeps a block out of the cache is settled here
// too, so that the free checks only the version: record_stream clears it,
// and private pools, no-caching mode and thread_cache:small change only
// under the world lock, which changes every version. [stream]
block* device_state::note_reusable(block* b, const stream_state& ss) const noexcept {
  const bool kept_out = policy_.free_records_fence(b, ss) || policy_.config().garbage_collection_threshold > 0.0 ||
                        (!b->pool->is_small && thread_caches_.small_only());
  b->reuse_version = kept_out ? no_reuse_version : b->pool->blocks.version();
  return b;
}

// ---- free -------------------------------------------------------------------------

namespace {
// device_state::free of a block used on other streams (record_stream): its
// events, or a deferred free while capturing. [stream] May throw: nothing
// changed then.
[[gnu::noinline]] void free_used_on_other_streams(device_state& d, block* b, stream_state& ss) {
  // No events while capturing (cudaEventQuery is not allowed): decide later.
  if (d.pools().capture_underway() || d.pools().any_stream_capturing(b)) {
    d.pools().defer_free(b);
    return;
  }
  // Its pages may move once the other streams' events and a fence of its
  // own stream recorded now have completed: the block takes the fence's
  // count now (free_block keeps it), not when its events complete.
  const bool fence = b->seg->expandable;
  if (fence) d.fences().fence_before_free(ss);  // may throw: nothing changed yet
  try {
    d.events().insert_events(b);
  } catch (...) {
    if (fence) ++ss.free_seq;  // the fence's count goes unused: no later free may take it
    throw;
  }
  if (fence) {
    b->free_seq = ++ss.free_seq;
    b->free_seq_taken = true;
  }
}
}  // namespace

bool device_state::defer_free_while_paused(block* b) {
  if (!tags_.any_paused()) return false;
  std::lock_guard lock(b->pool->owner->mutex);
  if (!b->seg->paused) return false;
  b->seg->frees_while_paused.push_back(b);  // may throw std::bad_alloc: nothing changed
  b->free_completed_at_resume = true;
  return true;
}

void device_state::free(block* b) {
  stream_state& ss = *b->pool->owner;
  std::unique_lock lock(ss.mutex);
  // A block of a paused tag: its pages are released, so its free (a merge,
  // a page fence) waits for the resume (sleep_wake.cpp). paused is written
  // under the world lock, which holds this stream's lock.
  if (tags_.any_paused() && b->seg->paused) [[unlikely]] {
    b->seg->frees_while_paused.push_back(b);  // may throw std::bad_alloc: nothing changed
    return;
  }
  // Room in the pool's index for the block, before anything changes: a free
  // that runs out of host memory fails unchanged (block_index::owes).
  if (b->pool->blocks.owes()) [[unlikely]]
    b->pool->blocks.repay();
  // Page fences (expandable segments) are recorded here, on the block's own
  // stream, which exists while the caller frees a block of it; another
  // stream's slow path never records on this stream (can_record_on).
  if (!b->stream_uses.empty()) {  // may throw: nothing changed yet
    free_used_on_other_streams(*this, b, ss);
  } else if (!policy_.caching() && !b->is_split() && b->pool->priv == nullptr && !pools_.capture_underway())
      [[unlikely]] {
    segments_.free_uncached(b, ss);  // may throw: nothing changed then
    return;
  } else if (policy_.free_records_fence(b, ss) && !pools_.capture_underway()) [[unlikely]] {
    // No fence of the stream outstanding (one already is: skip, so that a
    // stream that goes idle at every free, an alloc+free loop, records one
    // fence per slow path at most, not one per free). May throw: nothing
    // changed yet.
    fences_.fence_before_free(ss);
  }
  {
    stats_sink sink(*this, ss);
    release_allocation(b, sink.get(), false);
  }
  // A block of a destroyed stream whose memory no other stream may take
  // over: the world lock's release returns what its free left cached
  // (stream_registry::release_gone_caches). ss may be deleted once unlocked.
  if (ss.gone && registry_.gone_caches_unshared()) [[unlikely]] {
    lock.unlock();
    try {
      const world_lock w(*this);
    } catch (...) {  // no host memory for the lock's list: the next world lock returns it
    }
  }
}

// Records a page fence on `ss` covering the free about to happen (count
// ss.free_seq + 1), unless one does already. free calls it where
// free_records_fence says (the last busy block of an expandable segment; a
// block of a page or more on a stream that keeps others) and for a block
// used on other streams (freed later, when their events complete), so that
// those pages can pass to another stream without waiting once the stream's
// work before the free has completed. Throws backend_error from the record,
// before anything changed.
[[gnu::noinline]] void device_fences::fence_before_free(stream_state& ss) {
  if (ss.gone) return;  // destroyed: its work completed, nothing to fence
  std::lock_guard device_lock(d_.device_mutex());  // with ss.mutex: no world lock holder touches ss.fences
  const std::uint64_t coming = ss.free_seq + 1;  // the count the coming free takes
  if (ss.fences.recorded_up_to() < coming) ss.fences.record(events_, ss.stream, coming);
}

// The caller no longer holds `b` (its events, if any, are recorded): count
// it freed and, unless it waits for events, return it to its pool.
void device_state::release_allocation(block* b, device_stats& st, bool device_locked) {
  CCALLOC_ASSERT(b->allocated);
  const stat_group g = group_of(b->pool);
  b->allocated = false;
  b->reuse_version = no_reuse_version;
  count_down(st.allocation, g, 1);
  count_down(st.allocated_bytes, g, static_cast<std::int64_t>(b->size));
  if (b->counted_oversize) st.oversize_allocations.decrease(1);
  b->counted_oversize = false;
  if (b->event_count == 0) free_block(b, st, device_locked);
}

// A block becomes free (its events, if any, completed): merge with free
// neighbours and return it to its pool.
void device_state::free_block(block* b, device_stats& st, bool device_locked) {
  CCALLOC_ASSERT(b->seg->busy_blocks > 0);
  --b->seg->busy_blocks;
  const stat_group g = group_of(b->pool);
  const auto original_size = static_cast<std::int64_t>(b->size);
  std::int64_t net_split_blocks = 0;
  std::int64_t net_split_bytes = 0;
  // Merge with the free neighbours. The entry of the last one merged becomes
  // b's (block_index::rekey_at): the same index as erasing both and
  // inserting b, without moving entries when b's key stays in place.
  block_index& index = b->pool->blocks;
  block_index::position slot = block_index::end();
  const auto absorb = [&](block* neighbour) {
    if (!policy_.can_merge(b, neighbour)) return;
    if (!slot.is_end()) index.erase_at(slot);
    slot = index.find(neighbour);
    const std::size_t subsumed = merge(b, neighbour);
    net_split_blocks -= 1;
    net_split_bytes -= static_cast<std::int64_t>(subsumed);
  };
  absorb(b->prev);
  absorb(b->next);
  // Back into the pool of its own segment, free and whole.
  CCALLOC_ASSERT(b->is_free() && b->mapped && b->pool == b->seg->head->pool);
  b->gc_count_base = b->pool->get_free_blocks_call_count;
  // After the merges: the newest of its parts (a count taken at free stays).
  if (b->free_seq_taken) b->free_seq_taken = false;
  else b->free_seq = ++b->pool->owner->free_seq;
  if (b->pool->owner->gone) [[unlikely]]
    b->pool->owner->release_cached = true;  // stream_registry::release_gone_caches
  if (!slot.is_end()) index.rekey_at(slot, b);
  else index.insert(b);
  if (b->is_split()) {
    net_split_blocks += 1;
    net_split_bytes += static_cast<std::int64_t>(b->size);
  }
  if (net_split_blocks > 0) count_up(st.inactive_split, g, net_split_blocks);
  else if (net_split_blocks < 0) count_down(st.inactive_split, g, -net_split_blocks);
  if (net_split_bytes > 0) count_up(st.inactive_split_bytes, g, net_split_bytes);
  else if (net_split_bytes < 0) count_down(st.inactive_split_bytes, g, -net_split_bytes);
  count_down(st.active, g, 1);
  count_down(st.active_bytes, g, original_size);
  count_down(st.requested_bytes, g, static_cast<std::int64_t>(b->requested_bytes));
  b->requested_bytes = 0;
  CCALLOC_ASSERT_EXPENSIVE(segment_is_valid(*b->seg));
  // No-caching mode (not for private pools, nor while capturing: cudaFree is not allowed then).
  if (!policy_.caching() && !b->is_split() && b->pool->priv == nullptr && !pools_.capture_underway()) {
    // This free completes inside another operation (a malloc that found the
    // block's events done, empty_cache, a neighbour's free): if the device
    // refuses the segment, the block stays cached, consistent, and the next
    // empty_cache returns it (and reports the error if it persists). The
    // operation in progress is not failed for a release it did not ask for,
    // and the other blocks it is completing are not lost.
    try {
      if (device_locked) {
        segments_.release_block(b, st);
      } else {
        std::lock_guard device_lock(device_mutex_);
        segments_.release_block(b, st);
      }
    } catch (const backend_error&) {
    }
  }
}

// Whether `src`, a neighbour of `dst` (or nullptr), is free and may merge into it.
bool placement_policy::can_merge(const block* dst, const block* src) noexcept {
  return src != nullptr && src->is_free() && src->stream_uses.empty() && src->mapped == dst->mapped;
}

// Merges free `src` into `dst` (its neighbour, can_merge); returns the bytes
// subsumed. The caller takes `src` out of the pool's index (before: the
// index finds it by its size and address).
std::size_t device_state::merge(block* dst, block* src) {
  CCALLOC_ASSERT(src->seg == dst->seg && src->pool == dst->pool && (dst->prev == src || dst->next == src));
  if (dst->prev == src) {
    dst->ptr = src->ptr;
    dst->prev = src->prev;
    if (dst->prev != nullptr) dst->prev->next = dst;
    else dst->seg->head = dst;
  } else {
    dst->next = src->next;
    if (dst->next != nullptr) dst->next->prev = dst;
  }
  const std::size_t subsumed = src->size;
  dst->size += subsumed;
  CCALLOC_ASSERT(dst->size % min_block_bytes == 0 && dst->ptr >= dst->seg->base &&
                 dst->ptr + dst->size <= dst->seg->base + dst->seg->size);
  dst->free_seq = std::max(dst->free_seq, src->free_seq);
  src->pool->owner->delete_block(src);
  return subsumed;
}

// ---- the free-block index of a pool ------------------------------------------------

namespace {
// insert filled `v`: grow it now, so that the next insert has room; without
// host memory, the index owes it (repay).
[[gnu::noinline]] void grow_or_owe(block_index::bin_array& v, bool& owes) noexcept {
  try {
    v.grow();
  } catch (const std::bad_alloc&) {
    owes = true;
  }
}
}  // namespace

// One test on the common path: room for this entry and the next one.
void block_index::insert(block* b) {
  const std::uint32_t bin = bin_of(b->size);
  if (bins_[bin].size() + 1 >= bins_[bin].capacity()) [[unlikely]] {
    insert_filling(bin, b);
    return;
  }
  place(bin, b);
}

// insert into a bin it fills (grown after), or that is full (owed: the
// caller did not repay first; grown before, which may throw, unchanged).
[[gnu::noinline]] void block_index::insert_filling(std::uint32_t bin, block* b) {
  bin_array& v = bins_[bin];
  if (v.full()) v.grow();
  place(bin, b);
  if (v.full()) grow_or_owe(v, owes_);
}

void block_index::place(std::uint32_t bin, block* b) noexcept {
  bump_version();
  bin_array& v = bins_[bin];
  v.insert_at(search(v, b->size, b->ptr), entry{b->size, b->ptr, b});
  b->index_bin = static_cast<std::uint8_t>(bin);
  ++count_;
  occupied_[bin / 64] |= std::uint64_t{1} << (bin % 64);
}

void block_index::repay() {
  for (bin_array& v : bins_)
    if (v.full()) v.grow();
  owes_ = false;
}

void block_index::reserve_two(std::size_t a, std::size_t c) {
  if (owes_) repay();
  const std::uint32_t bin = bin_of(a);
  if (bin == bin_of(c) && bins_[bin].size() + 2 > bins_[bin].capacity()) bins_[bin].grow();
}

// Where the index put b (block::index_bin, index_pos): no search. A block
// not in this index (another pool's, or none) names a slot that does not
// hold it.
block_index::position block_index::find(const block* b) const noexcept {
  const std::uint32_t bin = b->index_bin;
  const std::uint32_t i = b->index_pos;
  return i < bins_[bin].size() && bins_[bin][i].b == b ? position{bin, i} : end();  // index_bin < bin_count always
}

void block_index::erase(const block* b) {
  if (const position p = find(b); !p.is_end()) erase_at(p);
}

bool block_index::contains(const block* b) const noexcept { return !find(b).is_end(); }

}  // namespace detail
}  // namespace ccalloc

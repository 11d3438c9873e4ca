// The caching allocator of one device. Policies follow PyTorch's
// DeviceCachingAllocator (c10/cuda/CUDACachingAllocator.cpp) unless a comment
// says otherwise; the code is ccalloc's own.
//
// Allocation call tree (malloc):
//
//   device_caching_allocator::malloc
//     device_state::allocate
//     allocate_unusual          only if events are pending or a pool is active:
//       process_events            (not while a capture is underway) device lock, then stream locks
//       routed_pool               begin_allocate_to_pool's newest matching filter [device lock]
//         -> allocate_slow with the private pool's (stream, pool)       [world lock]
//       stream_for                the stream's state (thread-local cache, else registry)
//       prepare                   round_size, pool, allocation_size: B1, B2   [stream lock]
//       get_free_block            -- rung 1: best fit in (stream, pool)       [likely]
//       take_found_block          split if worth it, stats via stats_sink
//     allocate_slow                                                      [world lock]
//       get_free_block            -- rung 1 again (another thread may have freed)
//       garbage_collect_cached_blocks -- rung 2: above the GC threshold
//       release_unused_segments   -- rung 3a: trim_on_new_peak
//       alloc_segment             -- rung 3: a new segment from the device
//       release_available_cached_blocks + alloc_segment
//                                 -- rung 4: free oversize cached blocks, retry
//       release_cached_blocks + alloc_segment
//                                 -- rung 5: sync events, free every cached segment, retry
//       try_use_on_oom_pools      -- rung 5b: free blocks of set_use_on_oom pools (F22)
//       throw_out_of_memory       -- rung 6: B6 (observers called unlocked)
//   While a capture is underway (begin_allocate_to_pool active) the ladder
//   neither queries nor waits for events nor frees device memory: rungs 2,
//   3a, 4 and 5 are skipped.
//
// Free call tree [stream lock]: free -> (block used on other streams?
//   (capture underway? defer_free : insert_events) [+ device lock] : free_block)
//   free_block -> try_merge with both neighbours -> back into the pool.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"

#include <algorithm>
#include <exception>
#include <array>
#include <bit>
#include <cinttypes>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>

namespace ccalloc {
namespace detail {

namespace {

std::string format_fraction(double f) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", f);
  return buf;
}

std::string format_bytes(std::size_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= gib) std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(gib));
  else if (bytes >= mib) std::snprintf(buf, sizeof buf, "%.2f MiB", b / double(mib));
  else if (bytes >= kib) std::snprintf(buf, sizeof buf, "%.2f KiB", b / double(kib));
  else std::snprintf(buf, sizeof buf, "%zu bytes", bytes);
  return buf;
}

}  // namespace

void block_index::insert(block* b) {
  const std::size_t i = lower_bound(b->size, b->ptr);
  entries_.insert(entries_.begin() + static_cast<std::ptrdiff_t>(i), entry{b->size, b->ptr, b});
}

void block_index::erase(const block* b) {
  const std::size_t i = lower_bound(b->size, b->ptr);
  if (i < entries_.size() && entries_[i].b == b) erase_at(i);
}

bool block_index::contains(const block* b) const noexcept {
  const std::size_t i = lower_bound(b->size, b->ptr);
  return i < entries_.size() && entries_[i].b == b;
}

namespace {
std::atomic<std::uint64_t> next_state_id{1};

// Counts events taken off the queues and subtracts them from
// pending_event_count_ on scope exit, also when a backend call throws.
struct retired_events {
  std::atomic<std::size_t>& pending;
  std::size_t count = 0;
  ~retired_events() { pending.fetch_sub(count, std::memory_order_relaxed); }
};
constexpr std::array<std::size_t, roundup_intervals> no_divisions{};

// One cached (device state, stream) -> stream_state per thread: the fast path
// finds its stream without the registry lock.
struct stream_cache_entry {
  std::uint64_t owner_id = 0;
  stream_t stream = 0;
  stream_state* state = nullptr;
};
thread_local stream_cache_entry tls_stream_cache;
thread_local char tls_thread_tag;  // its address identifies the thread
}  // namespace

device_state::device_state(int device, device_backend& backend, allocator_config config)
    : device_(device), backend_(backend), id_(next_state_id.fetch_add(1)), config_(std::move(config)) {
  device_total_bytes_ = backend_.mem_get_info(device_).total_bytes;
  allowed_bytes_ = device_total_bytes_;
  if (backend_.capabilities().virtual_memory) page_bytes_ = backend_.vm_granularity(device_);
  check_expandable_supported(config_);
  stats_.max_split_size = config_.max_split_size_bytes == std::numeric_limits<std::size_t>::max()
                              ? -1
                              : static_cast<std::int64_t>(config_.max_split_size_bytes);
  if (config_.memory_fraction_set) {
    world_lock w(*this);
    set_memory_fraction(config_.per_process_memory_fraction, w);
  }
}

// Expandable segments need the backend's virtual memory: an explicit
// expandable_segments:True without it is an error; the default falls back to
// plain segments (expandable_segments_ says which one is in force).
void device_state::check_expandable_supported(const allocator_config& config) const {
  if (config.expandable_segments && page_bytes_ == 0 && config.expandable_segments_set)
    throw config_error("ccalloc config: expandable_segments:True needs virtual memory (cuMemMap), which the '" +
                       backend_.name() + "' backend of device " + std::to_string(device_) +
                       " does not offer (accepted here: expandable_segments:False)");
}

device_state::~device_state() {
  for (auto& [stream, queue] : pending_events_)
    for (auto& [e, b] : queue) free_events_.push_back(e);
  for (event_t e : free_events_) {
    try {
      backend_.destroy_event(device_, e);
    } catch (...) {
    }
  }
  for (auto& [base, seg] : segments_) {
    try {
      if (seg->expandable) {
        for (std::size_t i = 0; i < seg->pages.size(); ++i) {
          if (seg->pages[i] == 0) continue;
          backend_.vm_unmap(device_, reinterpret_cast<void*>(base + i * seg->page_bytes), seg->page_bytes);
          backend_.vm_release_handle(device_, seg->pages[i]);
        }
        backend_.vm_release(device_, reinterpret_cast<void*>(base), seg->size);
      } else {
        release_segment_memory(*seg);  // reads the head block's pool: before the blocks go
      }
    } catch (...) {
    }
    for (block* b = seg->head; b != nullptr;) {
      block* next = b->next;
      delete b;
      b = next;
    }
  }
}

// Returns a plain segment's memory: to the pool's custom allocator if it has
// one, else to the backend.
void device_state::release_segment_memory(segment& seg) {
  const private_pool* pp = seg.head->pool->priv;
  if (pp != nullptr && pp->custom.free) pp->custom.free(reinterpret_cast<void*>(seg.base));
  else backend_.segment_free(device_, reinterpret_cast<void*>(seg.base));
}

// ---- locks and statistics ------------------------------------------------------

world_lock::world_lock(device_state& d) : d_(d) { lock(); }
world_lock::~world_lock() {
  if (locked_) unlock();
}

void world_lock::lock() {
  d_.registry_mutex_.lock();
  streams_.clear();
  streams_.reserve(d_.streams_.size());
  for (auto& [stream, ss] : d_.streams_) streams_.push_back(ss.get());
  std::sort(streams_.begin(), streams_.end());
  for (stream_state* ss : streams_) ss->mutex.lock();
  d_.device_mutex_.lock();
  d_.stats_mutex_.lock();
  locked_ = true;
}

void world_lock::unlock() {
  locked_ = false;
  d_.stats_mutex_.unlock();
  d_.device_mutex_.unlock();
  for (auto it = streams_.rbegin(); it != streams_.rend(); ++it) (*it)->mutex.unlock();
  d_.registry_mutex_.unlock();
}

stats_sink::stats_sink(device_state& d, stream_state& s) noexcept : d_(d), s_(s) {
  if (d_.single_stream_.load(std::memory_order_relaxed)) [[likely]]
    return;  // the only stream: pending deltas are exact (see single_stream_)
  if (s_.stats_backoff > 0) {
    --s_.stats_backoff;
    return;
  }
  if (!d_.stats_mutex_.try_lock()) {
    s_.stats_backoff = 64;
    return;
  }
  locked_ = true;
  publish_pending_stats(d_.stats_, s_);
  // Another thread published last: threads are sharing this device, so
  // publish only every 64th operation from now on (see the class comment).
  if (d_.last_stats_thread_ != &tls_thread_tag) {
    if (d_.last_stats_thread_ != nullptr) s_.stats_backoff = 64;
    d_.last_stats_thread_ = &tls_thread_tag;
  }
}

stats_sink::~stats_sink() {
  if (locked_) d_.stats_mutex_.unlock();
}

device_stats& stats_sink::get() noexcept {
  if (locked_) return d_.stats_;
  s_.has_pending_stats = true;
  return s_.pending_stats;
}

void publish_pending_stats(device_stats& into, stream_state& s) noexcept {
  if (!s.has_pending_stats) return;
  s.has_pending_stats = false;
  device_stats& pending = s.pending_stats;
  auto merge = [](stat& to, stat& from) {
    const std::int64_t before = to.current;
    to.current += from.current;
    to.allocated += from.allocated;
    to.freed += from.freed;
    to.peak = std::max({to.peak, before + from.peak, to.current});
    from = stat{};
  };
  auto merge_array = [&](stat_array& to, stat_array& from) {
    for (std::size_t i = 0; i < stat_group_count; ++i) merge(to[i], from[i]);
  };
  merge_array(into.allocation, pending.allocation);
  merge_array(into.segment, pending.segment);
  merge_array(into.active, pending.active);
  merge_array(into.inactive_split, pending.inactive_split);
  merge_array(into.allocated_bytes, pending.allocated_bytes);
  merge_array(into.reserved_bytes, pending.reserved_bytes);
  merge_array(into.active_bytes, pending.active_bytes);
  merge_array(into.inactive_split_bytes, pending.inactive_split_bytes);
  merge_array(into.requested_bytes, pending.requested_bytes);
  merge(into.oversize_allocations, pending.oversize_allocations);
  merge(into.oversize_segments, pending.oversize_segments);
  for (auto field : {&device_stats::num_alloc_retries, &device_stats::num_ooms, &device_stats::num_sync_all_streams,
                     &device_stats::num_device_alloc, &device_stats::num_device_free,
                     &device_stats::num_device_synchronizations, &device_stats::num_pages_remapped}) {
    into.*field += pending.*field;
    pending.*field = 0;
  }
}

void device_state::publish_all_pending_stats(const world_lock& w) {
  for (stream_state* ss : w.streams()) publish_pending_stats(stats_, *ss);
}

stream_state& device_state::stream_for(stream_t stream) {
  stream_cache_entry& c = tls_stream_cache;
  if (c.owner_id == id_ && c.stream == stream) [[likely]]
    return *c.state;
  std::lock_guard lock(registry_mutex_);
  auto& slot = streams_[stream];
  if (!slot) {
    slot = std::make_unique<stream_state>(stream);
    if (streams_.size() == 2) {
      // The first stream kept its statistics pending without a lock; publish
      // them before two streams can publish independently.
      for (auto& [other_stream, other] : streams_) {
        if (other.get() == slot.get()) continue;
        std::lock_guard other_lock(other->mutex);
        std::lock_guard stats_lock(stats_mutex_);
        publish_pending_stats(stats_, *other);
        single_stream_.store(false, std::memory_order_relaxed);
      }
    }
  }
  c = {id_, stream, slot.get()};
  return *slot;
}

// B1: 512-byte multiples, or the next of `divisions` equal steps between two
// powers of two (roundup_power2_divisions).
std::size_t device_state::round_size(std::size_t size) const noexcept {
  if (size < min_block_bytes) return min_block_bytes;
  const std::size_t divisions = config_.roundup_power2_divisions == no_divisions ? 0 : config_.divisions_for(size);
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
std::size_t device_state::allocation_size(std::size_t size) const noexcept {
  if (!caching_) return size;  // no-caching mode (F6): exactly the block
  if (size <= small_request_bytes) return small_segment_bytes;
  if (size < min_large_alloc_bytes) return config_.large_segment_size_bytes;
  return (size + large_round_bytes - 1) / large_round_bytes * large_round_bytes;
}

void device_state::prepare(alloc_params& p, std::size_t requested_bytes, stream_state& ss) const noexcept {
  p.requested_bytes = requested_bytes;
  p.stream = ss.stream;
  p.owner = &ss;
  p.size = round_size(requested_bytes);
  p.pool = p.size <= small_request_bytes ? &ss.pools.small : &ss.pools.large;
  p.alloc_size = allocation_size(p.size);
  p.found = nullptr;
}

block* device_state::allocate(std::size_t requested_bytes, stream_t stream) {
  if ((pending_event_count_.load(std::memory_order_relaxed) | capture_count_.load(std::memory_order_relaxed)) != 0)
      [[unlikely]]
    return allocate_unusual(requested_bytes, stream);
  stream_state& ss = stream_for(stream);
  alloc_params p;
  {
    std::lock_guard lock(ss.mutex);
    prepare(p, requested_bytes, ss);
    // Rung 1: a cached block of this stream and pool.
    if (caching_ && get_free_block(p)) [[likely]] {
      stats_sink sink(*this, ss);
      return take_found_block(p, sink.get());
    }
  }
  world_lock w(*this);
  prepare(p, requested_bytes, ss);  // the configuration may have changed meanwhile
  return allocate_slow(p, w);
}

// allocate when events are pending or a begin_allocate_to_pool is active.
block* device_state::allocate_unusual(std::size_t requested_bytes, stream_t stream) {
  if (!capture_underway()) {
    process_events();  // never while capturing: event queries are not allowed then
  } else {
    bool routed = false;
    {
      std::lock_guard device_lock(device_mutex_);
      routed = routed_pool(stream) != nullptr;
    }
    if (routed) {
      stream_state& ss = stream_for(stream);
      world_lock w(*this);
      if (private_pool* pp = routed_pool(stream)) {  // again: it may have ended meanwhile
        if (pp->use_count == 0)
          throw invalid_argument_error("ccalloc: allocation on stream " + std::to_string(stream) +
                                       " is routed by begin_allocate_to_pool to private pool " + to_string(pp->id) +
                                       " of device " + std::to_string(device_) +
                                       ", which was released (use count 0); end_allocate_to_pool it first");
        struct unpin {
          std::atomic<int>& n;
          ~unpin() { n.fetch_sub(1, std::memory_order_release); }
        };
        pp->pinned.fetch_add(1, std::memory_order_relaxed);
        unpin guard{pp->pinned};
        alloc_params p;
        prepare(p, requested_bytes, ss);
        p.pool = &pool_in(*pp, ss, p.pool->is_small);
        return allocate_slow(p, w);
      }
    }
  }
  stream_state& ss = stream_for(stream);
  alloc_params p;
  {
    std::lock_guard lock(ss.mutex);
    prepare(p, requested_bytes, ss);
    if (caching_ && get_free_block(p)) {
      stats_sink sink(*this, ss);
      return take_found_block(p, sink.get());
    }
  }
  world_lock w(*this);
  prepare(p, requested_bytes, ss);
  return allocate_slow(p, w);
}

// The slow path, with the whole device locked.
block* device_state::allocate_slow(alloc_params& p, world_lock& w) {
  publish_all_pending_stats(w);
  const bool capturing = capture_underway();
  if (!capturing) {
    process_events_locked();
    if (!deferred_frees_.empty()) flush_deferred_frees();
  }
  const bool priv = p.pool->priv != nullptr;
  auto out_of_memory = [&]() {
    // Rung 5b (F22): a free block of a pool that lends on OOM.
    if (try_use_on_oom_pools(p, w)) return take_found_block(p, stats_);
    throw_out_of_memory(p, w);
  };
  if (caching_) {
    // Rung 1 again: another thread may have freed a block meanwhile.
    if (get_free_block(p)) return take_found_block(p, stats_);
    // Rung 2: above the garbage-collection threshold, release old cached blocks.
    if (config_.garbage_collection_threshold > 0.0 && !capturing) garbage_collect_cached_blocks(w);
    if (config_.expandable_segments && page_bytes_ != 0 && !(priv && p.pool->priv->custom.malloc)) {
      // Rung 3 (B7, X3): place the request in the stream's expandable
      // segment, mapping pages (recycled from free whole pages when the
      // peak or the cap would grow). Rung 5: wait for events, unmap every
      // free page, retry.
      no_address_space_ = false;
      for (int attempt = 0; attempt < 2; ++attempt) {
        if (attempt == 1 && get_free_block(p)) return take_found_block(p, stats_);
        if (alloc_expandable(p, false, w) ||
            (release_cached_blocks(w, /*for_retry=*/true) && alloc_expandable(p, true, w)))
          return take_found_block(p, stats_);
        if (no_address_space_) break;
        if (!wait_for_completions_in_flight(w)) break;  // X7
      }
      // The retry kept the pages of the chosen run mapped: give them back too.
      if (!capturing) unmap_free_pages(std::numeric_limits<std::size_t>::max(), nullptr, 0, 0, nullptr);
      release_empty_expandable_segments();
      // Out of address space (a new reservation was refused, e.g. with very
      // many streams): this request gets a plain segment instead.
      if (!no_address_space_) return out_of_memory();
    }
    // Rung 3a (ccalloc, trim_on_new_peak): this request would raise reserved
    // memory above its high-water mark. First (X2) a cached whole segment of
    // another stream that fits moves to this stream; else cached whole
    // segments (none fits) go back to the device: the peak grows by less.
    if (config_.trim_on_new_peak && !capturing && reserved_bytes_ + p.alloc_size > reserved_high_water_bytes_) {
      if (config_.reuse_across_streams && !priv && adopt_idle_segment(p, w)) return take_found_block(p, stats_);
      release_unused_segments(w, /*keep_going=*/true);
    }
  }
  // Rung 3: a new segment. Rung 4: free oversize cached blocks and retry.
  // Rung 5: wait for pending events, free every cached segment, retry.
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt == 1 && caching_ && get_free_block(p)) return take_found_block(p, stats_);
    if (alloc_segment(p, false, w) ||
        (caching_ && !priv && !capturing && release_available_cached_blocks(p) && alloc_segment(p, false, w)) ||
        (release_cached_blocks(w, /*for_retry=*/true) && alloc_segment(p, true, w)))
      return take_found_block(p, stats_);
    // X7: blocks another thread is returning may be what is missing.
    if (!wait_for_completions_in_flight(w)) break;
  }
  // Rung 6: out of memory.
  return out_of_memory();
}

// X7: process_events returns blocks after dropping the device lock; an OOM
// decided meanwhile would miss them. Waits (world lock released) until they
// are back; returns false when there were none (nothing new to try).
bool device_state::wait_for_completions_in_flight(world_lock& w) {
  if (completions_in_flight_.load(std::memory_order_acquire) == 0) return false;
  w.unlock();
  while (completions_in_flight_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  w.lock();
  publish_all_pending_stats(w);
  return true;
}

// B3: best fit by (size, address) in the request's (stream, pool), with the
// oversize rules: a small request never takes an oversize block, and an
// oversize request takes one at most max_non_split_rounding bytes larger.
bool device_state::get_free_block(alloc_params& p) {
  block_pool& pool = *p.pool;
  if (config_.garbage_collection_threshold > 0.0) ++pool.get_free_blocks_call_count;
  const std::size_t i = pool.blocks.lower_bound(p.size);
  if (i == pool.blocks.size()) return false;
  block* b = pool.blocks.at(i);
  const std::size_t max_split = config_.max_split_size_bytes;
  if (p.size < max_split && b->size >= max_split) return false;
  // b->size >= p.size (lower_bound); the difference cannot overflow.
  if (p.size >= max_split && b->size - p.size >= config_.max_non_split_rounding_bytes) return false;
  pool.blocks.erase_at(i);
  p.found = b;
  return true;
}

bool device_state::alloc_segment(alloc_params& p, bool is_retry, world_lock& w) {
  if (is_retry) ++stats_.num_alloc_retries;
  const std::size_t size = p.alloc_size;
  if (set_fraction_ && reserved_bytes_ + size > allowed_bytes_) return false;
  void* ptr = nullptr;
  private_pool* const pp = p.pool->priv;
  auto device_malloc = [&] {
    return pp != nullptr && pp->custom.malloc ? pp->custom.malloc(size) : backend_.segment_malloc(device_, size);
  };
  if (config_.release_lock_on_cudamalloc) {
    // B8: other threads may use the cache while the device mallocs.
    w.unlock();
    try {
      ptr = device_malloc();
    } catch (...) {
      w.lock();
      throw;
    }
    w.lock();
    publish_all_pending_stats(w);
    // The cap may have been reached meanwhile by another thread.
    if (ptr != nullptr && set_fraction_ && reserved_bytes_ + size > allowed_bytes_) {
      if (pp != nullptr && pp->custom.free) pp->custom.free(ptr);
      else backend_.segment_free(device_, ptr);
      return false;
    }
  } else {
    ptr = device_malloc();
  }
  if (ptr == nullptr) return false;

  segment& seg = add_segment(p, reinterpret_cast<std::uintptr_t>(ptr), size);
  block* b = seg.head;
  seg.oversize = size >= config_.max_split_size_bytes;

  const stat_group g = group_of(p.pool);
  device_stats::increase(stats_.reserved_bytes, g, static_cast<std::int64_t>(size));
  if (b->seg->oversize) stats_.oversize_segments.increase(1);
  ++stats_.num_device_alloc;
  reserved_bytes_ += size;
  raise_reserved_high_water();
  p.found = b;
  if (history_.active()) [[unlikely]]
    history_.record_segment_alloc(b->ptr, size, p.stream);
  return true;
}

// Rung 4 (only with max_split_size set): free the smallest cached oversize
// block that covers the request, else the largest ones until enough is freed.
bool device_state::release_available_cached_blocks(const alloc_params& p) {
  const std::size_t max_split = config_.max_split_size_bytes;
  if (max_split == std::numeric_limits<std::size_t>::max()) return false;
  block_pool& pool = *p.pool;
  const std::size_t wanted = std::max(p.size, max_split);
  const std::size_t i = pool.blocks.lower_bound(wanted);
  if (i != pool.blocks.size()) {
    if (pool.blocks.at(i)->is_split()) return false;
    release_block(pool.blocks.at(i), stats_);
    return true;
  }
  std::size_t released = 0;
  std::vector<block*> victims;
  for (std::size_t r = pool.blocks.size(); r-- > 0 && released < wanted;) {
    block* b = pool.blocks.at(r);
    if (b->size < max_split) break;
    if (b->is_split()) continue;
    victims.push_back(b);
    released += b->size;
  }
  if (released < wanted) return false;
  for (block* b : victims) release_block(b, stats_);
  return true;
}

// Rung 5 and emptyCache: wait for every pending event, then return every
// cached block that is a whole segment.
// Private pools without users give back their cached segments too. Nothing
// while a capture is underway (waiting and freeing are not allowed then).
bool device_state::release_cached_blocks(const world_lock& w, bool for_retry) {
  if (capture_underway()) return false;
  flush_deferred_frees();
  synchronize_and_free_events();
  release_unused_segments(w, for_retry);
  release_dead_pools(w, for_retry);
  unmap_free_pages(std::numeric_limits<std::size_t>::max(), nullptr, 0, 0, nullptr);
  release_empty_expandable_segments();
  delete_empty_dead_pools(w);
  return true;
}

void device_state::release_unused_segments(const world_lock& w, bool keep_going) {
  for (stream_state* ss : w.streams()) {
    release_blocks(ss->pools.large, keep_going);
    release_blocks(ss->pools.small, keep_going);
  }
}

void device_state::release_blocks(block_pool& pool, bool keep_going) {
  std::vector<block*> victims;
  for (std::size_t i = 0; i < pool.blocks.size(); ++i)
    if (!pool.blocks.at(i)->is_split()) victims.push_back(pool.blocks.at(i));
  for (block* b : victims) {
    try {
      release_block(b, stats_);
    } catch (...) {
      if (!keep_going) throw;  // else the segment stays cached (release_block changed nothing)
    }
  }
}

// Returns a cached whole-segment block to the device. If the device refuses
// (segment_free throws), nothing has changed.
void device_state::release_block(block* b, device_stats& st) {
  release_segment_memory(*b->seg);
  if (history_.active()) [[unlikely]]
    history_.record_segment_free(b->ptr, b->size, b->stream);
  forget_segment(b, st);
}

// The books of a segment the device has taken back; `b` is its only block.
void device_state::forget_segment(block* b, device_stats& st) noexcept {
  if (b->pool->priv != nullptr) --b->pool->priv->segment_count;
  const stat_group g = group_of(b->pool);
  device_stats::decrease(st.segment, g, 1);
  device_stats::decrease(st.reserved_bytes, g, static_cast<std::int64_t>(b->size));
  if (b->seg->oversize) st.oversize_segments.decrease(1);
  ++st.num_device_free;
  reserved_bytes_ -= b->size;
  b->pool->blocks.erase(b);
  segments_.erase(b->seg->base);
  b->pool->owner->delete_block(b);
}

// Rung 2 (B5): while reserved bytes exceed threshold x allowed, release whole
// cached large-pool segments older than the average age. ccalloc applies the
// threshold to the device total when no memory fraction is set (PyTorch
// ignores it then; SPEC X6).
void device_state::garbage_collect_cached_blocks(const world_lock& w) {
  const auto threshold =
      static_cast<std::size_t>(config_.garbage_collection_threshold * static_cast<double>(allowed_bytes_));
  if (reserved_bytes_ <= threshold) return;
  const std::size_t target = reserved_bytes_ - threshold;

  std::vector<std::pair<block*, std::uint64_t>> candidates;  // block, age
  std::uint64_t total_age = 0;
  for (stream_state* ss : w.streams()) {
    block_pool& large = ss->pools.large;
    for (std::size_t i = 0; i < large.blocks.size(); ++i)
      if (block* b = large.blocks.at(i); !b->is_split()) {
        const std::uint64_t age = large.age(b);
        candidates.emplace_back(b, age);
        total_age += age;
      }
  }
  std::size_t reclaimed = 0;
  bool freed = true;
  while (reclaimed < target && freed && !candidates.empty()) {
    const double age_threshold = double(total_age) / double(candidates.size());
    freed = false;
    for (auto it = candidates.begin(); it != candidates.end();) {
      if (double(it->second) >= age_threshold) {
        freed = true;
        reclaimed += it->first->size;
        total_age -= it->second;
        release_block(it->first, stats_);
        it = candidates.erase(it);
      } else {
        ++it;
      }
    }
  }
}

// ---- expandable segments (B7, X3) ------------------------------------------------

namespace {
// Growth by at least this much first asks the device how much is free.
constexpr std::size_t large_growth_check_bytes = 256 * mib;
}  // namespace
//
// An expandable segment is one address-space reservation per (stream, pool),
// as large as the device. A request that no cached block serves is placed in
// the best free run of the stream's reservation (fewest pages to map, then
// the shortest run, then the lowest address), and the run's missing pages are
// mapped. When mapping would raise reserved memory past its high-water mark
// (trim_on_new_peak) or past the memory-fraction cap, free whole pages of any
// stream are unmapped first and their physical handles mapped where they are
// needed (X3), so the reservation does not grow while free pages exist.
// Unmapping first synchronizes the device: cuMemUnmap does not wait for
// queued work that may still touch the range.

void device_state::pool_insert_counted(block* b) {
  b->gc_count_base = b->pool->get_free_blocks_call_count;
  b->pool->blocks.insert(b);
  const stat_group g = group_of(b->pool);
  device_stats::increase(stats_.inactive_split, g, 1);
  device_stats::increase(stats_.inactive_split_bytes, g, static_cast<std::int64_t>(b->size));
}

void device_state::pool_erase_counted(block* b) {
  b->pool->blocks.erase(b);
  const stat_group g = group_of(b->pool);
  device_stats::decrease(stats_.inactive_split, g, 1);
  device_stats::decrease(stats_.inactive_split_bytes, g, static_cast<std::int64_t>(b->size));
}

// Splits free block `b` (outside its pool) at address `at`; returns the upper
// part, which inherits b's stream, pool, segment and mapping state.
block* device_state::split_free_block(block* b, std::uintptr_t at) {
  block* hi = b->pool->owner->new_block();
  hi->ptr = at;
  hi->size = b->ptr + b->size - at;
  b->size -= hi->size;
  hi->stream = b->stream;
  hi->pool = b->pool;
  hi->seg = b->seg;
  hi->mapped = b->mapped;
  hi->next = b->next;
  if (hi->next != nullptr) hi->next->prev = hi;
  hi->prev = b;
  b->next = hi;
  return hi;
}

// Marks the page-aligned range [lo, hi) of `seg` mapped or unmapped. Every
// block overlapping it is free and in the other state. Splits blocks at lo
// and hi, merges free neighbours of equal state, and keeps pool membership
// and the inactive-split statistics right.
void device_state::set_page_state(segment& seg, std::uintptr_t lo, std::uintptr_t hi, bool mapped) {
  if (lo >= hi) return;
  block* b = seg.head;
  while (b->ptr + b->size <= lo) b = b->next;
  block* first = b->prev != nullptr ? b->prev : b;
  block* last = b;
  while (last->ptr + last->size < hi) last = last->next;
  block* stop = last->next != nullptr ? last->next : last;
  for (block* x = first;; x = x->next) {
    if (x->mapped && x->is_free()) pool_erase_counted(x);
    if (x == stop) break;
  }
  if (b->ptr < lo) {
    b = split_free_block(b, lo);
    if (stop == b->prev) stop = b;  // the split block was the window's end
  }
  for (block* x = b; x != nullptr && x->ptr < hi; x = x->next) {
    if (x->ptr + x->size > hi) {
      block* upper = split_free_block(x, hi);
      if (stop == x) stop = upper;
    }
    x->mapped = mapped;
  }
  for (block* x = first;;) {
    block* nx = x->next;
    if (x != stop && nx != nullptr && x->is_free() && nx->is_free() && x->mapped == nx->mapped) {
      x->size += nx->size;
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
}

segment* device_state::new_expandable_segment(const alloc_params& p) {
  const std::size_t page = page_bytes_;
  const std::size_t want = std::max(device_total_bytes_, p.size);
  if (want > std::numeric_limits<std::size_t>::max() - page) return nullptr;  // no such address range
  const std::size_t size = (want + page - 1) / page * page;
  void* base = backend_.vm_reserve(device_, size);
  if (base == nullptr) return nullptr;
  segment& seg = add_segment(p, reinterpret_cast<std::uintptr_t>(base), size);
  seg.head->mapped = false;
  seg.expandable = true;
  seg.seq = next_segment_seq_++;
  seg.page_bytes = page;
  seg.pages.assign(size / page, 0);
  return &seg;
}

// A new segment [base, base + size) of p's stream and pool, as one free
// block, on the books (segment count, its private pool's count).
segment& device_state::add_segment(const alloc_params& p, std::uintptr_t base, std::size_t size) {
  auto seg = std::make_unique<segment>();
  block* b = p.owner->new_block();
  b->ptr = base;
  b->size = size;
  b->stream = p.stream;
  b->pool = p.pool;
  b->seg = seg.get();
  seg->base = base;
  seg->size = size;
  seg->head = b;
  device_stats::increase(stats_.segment, group_of(p.pool), 1);
  if (p.pool->priv != nullptr) ++p.pool->priv->segment_count;
  return *segments_.emplace(base, std::move(seg)).first->second;
}

bool device_state::alloc_expandable(alloc_params& p, bool is_retry, world_lock& w) {
  if (is_retry) ++stats_.num_alloc_retries;
  const std::size_t page = page_bytes_;
  // 1. Placement: the free run of this (stream, pool) that needs the fewest
  // new pages, then the shortest, then the oldest segment and lowest offset
  // (never raw addresses: a replay must decide alike on every device).
  segment* best_seg = nullptr;
  std::uintptr_t best_start = 0;
  std::size_t best_pages = std::numeric_limits<std::size_t>::max();
  std::size_t best_run = std::numeric_limits<std::size_t>::max();
  auto pages_to_map = [&](block* from, std::uintptr_t end) {
    std::size_t n = 0;
    for (block* x = from; x != nullptr && x->ptr < end; x = x->next)
      if (!x->mapped) n += (std::min(end, x->ptr + x->size) - x->ptr + page - 1) / page;
    return n;
  };
  for (auto& [base, up] : segments_) {
    segment& seg = *up;
    if (!seg.expandable || seg.head->pool != p.pool) continue;
    for (block* x = seg.head; x != nullptr;) {
      if (!x->is_free()) {
        x = x->next;
        continue;
      }
      block* run_first = x;
      std::size_t run = 0;
      for (; x != nullptr && x->is_free(); x = x->next) run += x->size;
      if (run < p.size) continue;
      const std::size_t n = pages_to_map(run_first, run_first->ptr + p.size);
      const bool better =
          n != best_pages ? n < best_pages
          : run != best_run ? run < best_run
          : best_seg != nullptr && (seg.seq != best_seg->seq ? seg.seq < best_seg->seq
                                                             : run_first->ptr - seg.base < best_start - best_seg->base);
      if (best_seg == nullptr || better) {
        best_seg = &seg;
        best_start = run_first->ptr;
        best_pages = n;
        best_run = run;
      }
    }
  }
  if (best_seg == nullptr) {
    best_seg = new_expandable_segment(p);
    if (best_seg == nullptr) {
      no_address_space_ = true;
      return false;
    }
    best_start = best_seg->base;
    best_pages = (p.size + page - 1) / page;
  }
  const std::uintptr_t end = best_start + p.size;

  // 2. Physical pages: recycle free whole pages rather than raise the peak
  // (trim_on_new_peak) or pass the cap.
  const std::size_t need = best_pages * page;
  // Fail at once what cannot fit (rather than create pages until the device
  // refuses): more than the device or the cap, or, for a large request,
  // more than the device has free plus what this allocator could give back.
  if (need > allowed_bytes_) return false;
  if (need >= large_growth_check_bytes) {
    std::size_t free_pages_bytes = 0;
    for (auto& [base, up] : segments_)
      if (up->expandable) free_pages_bytes += up->mapped_bytes;  // an upper bound of what unmapping frees
    if (need > backend_.mem_get_info(device_).free_bytes + free_pages_bytes) return false;
  }
  std::vector<physical_handle_t> recycled;
  // Handles in `recycled` are unmapped and no longer counted as reserved.
  auto drop_recycled = [&] {
    for (physical_handle_t h : recycled) {
      ++stats_.num_device_free;
      backend_.vm_release_handle(device_, h);
    }
    recycled.clear();
  };
  if (need > 0) {
    auto excess = [&] {
      std::size_t target = 0;
      if (set_fraction_ && reserved_bytes_ + need > allowed_bytes_) target = reserved_bytes_ + need - allowed_bytes_;
      // A new peak is avoided by recycling at most recycles_per_peak times
      // per high-water mark; then the mark rises, and a repeating program
      // stops needing either.
      if (config_.trim_on_new_peak && reserved_bytes_ + need > reserved_high_water_bytes_ &&
          recycles_at_mark_ < config_.recycles_per_peak)
        target = std::max(target, std::min(need, reserved_bytes_ + need - reserved_high_water_bytes_));
      return target;
    };
    if (!capture_underway() && excess() > 0) {
      release_unused_segments(w, /*keep_going=*/true);  // plain cached segments (no-caching leftovers, earlier configs)
      if (const std::size_t target = excess(); target > 0) {
        try {
          if (unmap_free_pages(target, best_seg, best_start, end, &recycled) > 0) ++recycles_at_mark_;
        } catch (...) {
          drop_recycled();  // the pages unmapped before the failure go back to the device
          throw;
        }
      }
    }
    if (set_fraction_ && reserved_bytes_ + need > allowed_bytes_) {
      drop_recycled();
      return false;
    }
  }

  // 3. Map the missing pages, run by run of unmapped pages.
  segment& seg = *best_seg;
  const std::size_t first_page = (best_start - seg.base) / page;
  const std::size_t end_page = (end - seg.base + page - 1) / page;
  const stat_group g = group_of(p.pool);
  for (std::size_t i = first_page; i < end_page;) {
    if (seg.pages[i] != 0) {
      ++i;
      continue;
    }
    const std::size_t run_first = i;
    bool out_of_memory = false;
    try {
      for (; i < end_page && seg.pages[i] == 0; ++i) {
        physical_handle_t h = 0;
        bool fresh = false;
        if (!recycled.empty()) {
          h = recycled.back();
          recycled.pop_back();
        } else if (backend_.vm_create(device_, page, &h)) {
          fresh = true;
        } else {
          out_of_memory = true;
          break;
        }
        void* addr = reinterpret_cast<void*>(seg.base + i * page);
        bool mapped = false;
        try {
          backend_.vm_map(device_, addr, page, h);
          mapped = true;
          for (int peer : peers_) backend_.vm_set_access(device_, addr, page, peer);
        } catch (...) {
          if (mapped) {
            try {
              backend_.vm_unmap(device_, addr, page);  // the page must not stay mapped unknown to us
            } catch (...) {
              seg.pages[i] = h;  // still mapped: keep it on the books (a free mapped page)
              seg.mapped_bytes += page;
              reserved_bytes_ += page;
              device_stats::increase(stats_.reserved_bytes, g, static_cast<std::int64_t>(page));
              if (fresh) ++stats_.num_device_alloc;
              ++i;
              throw;
            }
          }
          if (fresh) {
            backend_.vm_release_handle(device_, h);
          } else {
            recycled.push_back(h);
          }
          throw;
        }
        seg.pages[i] = h;
        if (!fresh) ++stats_.num_pages_remapped;
        seg.mapped_bytes += page;
        if (fresh) ++stats_.num_device_alloc;
        reserved_bytes_ += page;
        device_stats::increase(stats_.reserved_bytes, g, static_cast<std::int64_t>(page));
      }
    } catch (...) {
      set_page_state(seg, seg.base + run_first * page, seg.base + i * page, true);
      raise_reserved_high_water();
      drop_recycled();
      throw;
    }
    set_page_state(seg, seg.base + run_first * page, seg.base + i * page, true);
    if (history_.active() && i > run_first) [[unlikely]]
      history_.record_segment_map(seg.base + run_first * page, (i - run_first) * page, p.stream);
    if (out_of_memory) {
      raise_reserved_high_water();
      drop_recycled();
      return false;
    }
  }
  drop_recycled();  // more pages were freed than mapped (the cap counted plain segments)
  raise_reserved_high_water();

  // 4. The run now starts with a free mapped block of at least p.size bytes.
  block* b = seg.head;
  while (b->ptr + b->size <= best_start) b = b->next;
  if (b->ptr != best_start || !b->mapped || !b->is_free() || b->size < p.size)
    throw std::logic_error("ccalloc: internal error: mapped run does not start with a free block");
  b->pool->blocks.erase(b);  // as get_free_block: take_found_block does the statistics
  p.found = b;
  return true;
}

// Unmaps the whole pages of free block `b` (free, mapped, in an expandable
// segment), except those overlapping [keep_lo, keep_hi), at most `max_bytes`.
// Handles go to `recycled` (then no longer counted as reserved) or back to
// the device.
std::size_t device_state::unmap_block_pages(block* b, std::uintptr_t keep_lo, std::uintptr_t keep_hi,
                                             std::vector<physical_handle_t>* recycled, std::size_t max_bytes) {
  segment& seg = *b->seg;
  const std::size_t page = seg.page_bytes;
  const std::uintptr_t lo = (b->ptr - seg.base + page - 1) / page * page + seg.base;
  const std::uintptr_t hi = (b->ptr + b->size - seg.base) / page * page + seg.base;
  if (lo >= hi) return 0;
  // The pieces of [lo, hi) outside the kept range (its pages rounded outward).
  std::pair<std::uintptr_t, std::uintptr_t> pieces[2] = {{lo, hi}, {0, 0}};
  if (keep_lo < keep_hi && keep_lo < hi && keep_hi > lo) {
    const std::uintptr_t klo = (keep_lo - seg.base) / page * page + seg.base;
    const std::uintptr_t khi = (keep_hi - seg.base + page - 1) / page * page + seg.base;
    pieces[0] = {lo, std::max(lo, std::min(hi, klo))};
    pieces[1] = {std::min(hi, std::max(lo, khi)), hi};
  }
  const stat_group g = group_of(b->pool);
  std::size_t done_total = 0;
  for (const auto& piece : pieces) {
    const std::uintptr_t from = piece.first;  // named copies: lambdas below capture them
    std::uintptr_t to = piece.second;
    if (done_total >= max_bytes) break;
    if (to - from > max_bytes - done_total) to = from + (max_bytes - done_total + page - 1) / page * page;
    std::uintptr_t addr = from;
    std::vector<physical_handle_t> to_release;
    auto finish = [&] {
      const std::size_t bytes = addr - from;
      seg.mapped_bytes -= bytes;
      reserved_bytes_ -= bytes;
      device_stats::decrease(stats_.reserved_bytes, g, static_cast<std::int64_t>(bytes));
      set_page_state(seg, from, addr, false);
      if (history_.active() && bytes > 0) [[unlikely]]
        history_.record_segment_unmap(from, bytes, seg.head->stream);
      done_total += bytes;
      stats_.num_device_free += to_release.size();
      for (physical_handle_t h : to_release) backend_.vm_release_handle(device_, h);  // may throw: state is consistent
    };
    try {
      for (; addr < to; addr += page) {
        const std::size_t i = (addr - seg.base) / page;
        backend_.vm_unmap(device_, reinterpret_cast<void*>(addr), page);
        (recycled != nullptr ? *recycled : to_release).push_back(seg.pages[i]);
        seg.pages[i] = 0;
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
// are freed, waiting first for each stream whose pages it unmaps.
std::size_t device_state::unmap_free_pages(std::size_t target_bytes, const segment* keep_seg,
                                           std::uintptr_t keep_lo, std::uintptr_t keep_hi,
                                           std::vector<physical_handle_t>* recycled) {
  std::vector<block*> candidates;
  for (auto& [base, up] : segments_) {
    if (!up->expandable || up->mapped_bytes == 0 || pool_is_live(up->head->pool)) continue;
    for (block* b = up->head; b != nullptr; b = b->next)
      if (b->mapped && b->is_free() && b->size >= up->page_bytes) candidates.push_back(b);
  }
  // Oldest segment first, then by offset: the same order on every device.
  std::sort(candidates.begin(), candidates.end(), [](const block* x, const block* y) {
    return x->seg->seq != y->seg->seq ? x->seg->seq < y->seg->seq : x->ptr < y->ptr;
  });
  std::size_t got = 0;
  bool synchronized = false;
  for (block* b : candidates) {
    if (got >= target_bytes) break;
    if (!synchronized) {
      // Work queued before the free may still use the pages, and cuMemUnmap
      // does not wait for it. The whole device, as cudaFree does: the
      // block's stream may have been destroyed since (no stream handle is
      // used after a free).
      synchronize_before_reuse();
      synchronized = true;
    }
    const bool keep = b->seg == keep_seg;
    got += unmap_block_pages(b, keep ? keep_lo : 0, keep ? keep_hi : 0, recycled, target_bytes - got);
  }
  return got;
}

void device_state::raise_reserved_high_water() noexcept {
  if (reserved_bytes_ <= reserved_high_water_bytes_) return;
  reserved_high_water_bytes_ = reserved_bytes_;
  recycles_at_mark_ = 0;  // a new mark: recycling may start again (recycles_per_peak)
}

void device_state::synchronize_before_reuse() {
  backend_.synchronize_device(device_);
  ++stats_.num_device_synchronizations;
}

// Releases the reservations of expandable segments that have no mapped page.
void device_state::release_empty_expandable_segments() {
  for (auto it = segments_.begin(); it != segments_.end();) {
    segment& seg = *it->second;
    if (!seg.expandable || seg.mapped_bytes != 0 || seg.head->next != nullptr) {
      ++it;
      continue;
    }
    backend_.vm_release(device_, reinterpret_cast<void*>(seg.base), seg.size);
    device_stats::decrease(stats_.segment, group_of(seg.head->pool), 1);
    if (seg.head->pool->priv != nullptr) --seg.head->pool->priv->segment_count;
    seg.head->pool->owner->delete_block(seg.head);
    it = segments_.erase(it);
  }
}

// ---- cross-stream reuse (X2) ------------------------------------------------------

// Moves to the requesting stream the best-fitting cached whole segment of
// another stream, after synchronizing the device (the work queued before the
// free may still use it; the other stream may have been destroyed since, so
// its handle is not used). Called only where the alternative, returning
// cached segments before a new peak, would synchronize the device anyway
// (cudaFree).
bool device_state::adopt_idle_segment(alloc_params& p, const world_lock& w) {
  const std::size_t max_split = config_.max_split_size_bytes;
  block* best = nullptr;
  for (stream_state* ss : w.streams()) {
    if (ss == p.owner) continue;
    block_pool& pool = p.pool->is_small ? ss->pools.small : ss->pools.large;
    for (std::size_t i = pool.blocks.lower_bound(p.size); i < pool.blocks.size(); ++i) {
      block* b = pool.blocks.at(i);
      if (b->is_split()) continue;
      if (p.size < max_split && b->size >= max_split) break;
      if (p.size >= max_split && b->size - p.size >= config_.max_non_split_rounding_bytes) break;
      if (best == nullptr || b->size < best->size) best = b;
      break;  // the smallest whole segment of this pool that fits
    }
  }
  if (best == nullptr) return false;
  synchronize_before_reuse();
  best->pool->blocks.erase(best);
  best->pool = p.pool;
  best->stream = p.stream;
  p.found = best;
  return true;
}

bool device_state::should_split(const block* b, std::size_t size) const noexcept {
  if (b->pool->no_split) [[unlikely]]
    return false;  // F22
  const std::size_t remaining = b->size - size;
  // Expandable segments: always carve exactly (the remainder shares pages
  // with the block; unneeded whole pages are unmapped, not kept as slack).
  if (b->pool->is_small || b->seg->expandable) return remaining >= min_block_bytes;
  return size < config_.max_split_size_bytes && remaining > small_request_bytes;
}

// Hands out p.found: split off the remainder if worth keeping, update stats.
block* device_state::take_found_block(alloc_params& p, device_stats& st) {
  block* b = p.found;
  const stat_group g = group_of(p.pool);
  const bool already_split = b->is_split();
  if (should_split(b, p.size)) {
    // The caller gets the front; the remainder stays cached.
    block* remaining = b;
    b = p.owner->new_block();
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
    remaining->gc_count_base = remaining->pool->get_free_blocks_call_count;
    remaining->pool->blocks.insert(remaining);
    if (already_split) {
      device_stats::decrease(st.inactive_split_bytes, g, static_cast<std::int64_t>(p.size));
    } else {
      device_stats::increase(st.inactive_split, g, 1);
      device_stats::increase(st.inactive_split_bytes, g, static_cast<std::int64_t>(remaining->size));
    }
  } else if (already_split) {
    device_stats::decrease(st.inactive_split, g, 1);
    device_stats::decrease(st.inactive_split_bytes, g, static_cast<std::int64_t>(b->size));
  }
  b->allocated = true;
  b->requested_size = p.requested_bytes;
  const auto size = static_cast<std::int64_t>(b->size);
  device_stats::increase(st.allocation, g, 1);
  device_stats::increase(st.allocated_bytes, g, size);
  device_stats::increase(st.active, g, 1);
  device_stats::increase(st.active_bytes, g, size);
  device_stats::increase(st.requested_bytes, g, static_cast<std::int64_t>(p.requested_bytes));
  b->counted_oversize = b->size >= config_.max_split_size_bytes;
  if (b->counted_oversize) st.oversize_allocations.increase(1);
  return b;
}

void device_state::free(block* b) {
  stream_state& ss = *b->pool->owner;
  std::lock_guard lock(ss.mutex);
  if (!b->stream_uses.empty()) {  // may throw: nothing changed yet
    // No events while capturing (cudaEventQuery is not allowed): decide later.
    if (capture_underway() || any_stream_capturing(b)) defer_free(b);
    else insert_events(b);
  } else if (!caching_ && !b->is_split() && b->pool->priv == nullptr && !capture_underway()) [[unlikely]] {
    free_uncached(b, ss);  // may throw: nothing changed then
    return;
  }
  stats_sink sink(*this, ss);
  release_allocation(b, sink.get(), false);
}

// The caller no longer holds `b` (its events, if any, are recorded): count
// it freed and, unless it waits for events, return it to its pool.
void device_state::release_allocation(block* b, device_stats& st, bool device_locked) {
  const stat_group g = group_of(b->pool);
  b->allocated = false;
  device_stats::decrease(st.allocation, g, 1);
  device_stats::decrease(st.allocated_bytes, g, static_cast<std::int64_t>(b->size));
  if (b->counted_oversize) st.oversize_allocations.decrease(1);
  b->counted_oversize = false;
  if (b->event_count == 0) free_block(b, st, device_locked);
}

// No-caching mode (F6), a block that is a whole segment and waits on no
// event: the segment goes back to the device before anything else changes,
// so a failing device free leaves the block allocated and the caller's
// pointer live (the caller gets the backend_error).
void device_state::free_uncached(block* b, stream_state& ss) {
  std::lock_guard device_lock(device_mutex_);
  backend_.segment_free(device_, reinterpret_cast<void*>(b->ptr));
  if (history_.active()) [[unlikely]]
    history_.record_segment_free(b->ptr, b->size, b->stream);
  stats_sink sink(*this, ss);
  device_stats& st = sink.get();
  const stat_group g = group_of(b->pool);
  const auto size = static_cast<std::int64_t>(b->size);
  device_stats::decrease(st.allocation, g, 1);
  device_stats::decrease(st.allocated_bytes, g, size);
  if (b->counted_oversize) st.oversize_allocations.decrease(1);
  device_stats::decrease(st.active, g, 1);
  device_stats::decrease(st.active_bytes, g, size);
  device_stats::decrease(st.requested_bytes, g, static_cast<std::int64_t>(b->requested_size));
  forget_segment(b, st);
}

void device_state::record_stream(block* b, stream_t stream) {
  std::lock_guard lock(b->pool->owner->mutex);
  if (stream == b->stream) return;
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end())
    b->stream_uses.push_back(stream);
}

// A block becomes free (its events, if any, completed): merge with free
// neighbours and return it to its pool.
void device_state::free_block(block* b, device_stats& st, bool device_locked) {
  const stat_group g = group_of(b->pool);
  const auto original_size = static_cast<std::int64_t>(b->size);
  std::int64_t net_split_blocks = 0;
  std::int64_t net_split_bytes = 0;
  for (block* neighbour : {b->prev, b->next}) {
    const std::size_t subsumed = try_merge(b, neighbour);
    if (subsumed > 0) {
      net_split_blocks -= 1;
      net_split_bytes -= static_cast<std::int64_t>(subsumed);
    }
  }
  b->gc_count_base = b->pool->get_free_blocks_call_count;
  b->pool->blocks.insert(b);
  if (b->is_split()) {
    net_split_blocks += 1;
    net_split_bytes += static_cast<std::int64_t>(b->size);
  }
  if (net_split_blocks > 0) device_stats::increase(st.inactive_split, g, net_split_blocks);
  else if (net_split_blocks < 0) device_stats::decrease(st.inactive_split, g, -net_split_blocks);
  if (net_split_bytes > 0) device_stats::increase(st.inactive_split_bytes, g, net_split_bytes);
  else if (net_split_bytes < 0) device_stats::decrease(st.inactive_split_bytes, g, -net_split_bytes);
  device_stats::decrease(st.active, g, 1);
  device_stats::decrease(st.active_bytes, g, original_size);
  device_stats::decrease(st.requested_bytes, g, static_cast<std::int64_t>(b->requested_size));
  b->requested_size = 0;
  // No-caching mode (not for private pools, nor while capturing: cudaFree is not allowed then).
  if (!caching_ && !b->is_split() && b->pool->priv == nullptr && !capture_underway()) {
    // This free completes inside another operation (a malloc that found the
    // block's events done, empty_cache, a neighbour's free): if the device
    // refuses the segment, the block stays cached, consistent, and the next
    // empty_cache returns it (and reports the error if it persists). The
    // operation in progress is not failed for a release it did not ask for,
    // and the other blocks it is completing are not lost.
    try {
      if (device_locked) {
        release_block(b, st);
      } else {
        std::lock_guard device_lock(device_mutex_);
        release_block(b, st);
      }
    } catch (const backend_error&) {
    }
  }
}

// Merges free `src` into `dst` (its neighbour); returns the bytes subsumed.
std::size_t device_state::try_merge(block* dst, block* src) {
  if (src == nullptr || !src->is_free() || !src->stream_uses.empty() || src->mapped != dst->mapped) return 0;
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
  src->pool->blocks.erase(src);
  src->pool->owner->delete_block(src);
  return subsumed;
}

event_t device_state::get_event() {
  if (!free_events_.empty()) {
    const event_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  return backend_.create_event(device_);
}

// B4: one event per stream that used the block; the block returns to the
// pool when all of them completed.
void device_state::insert_events(block* b) {
  std::lock_guard device_lock(device_mutex_);
  insert_events_locked(b);
}

void device_state::insert_events_locked(block* b) {
  std::vector<event_t> recorded;
  try {
    for (stream_t s : b->stream_uses) {
      const event_t e = get_event();
      recorded.push_back(e);
      backend_.record_event(device_, e, s);
    }
  } catch (...) {
    for (event_t e : recorded) free_events_.push_back(e);
    throw;
  }
  for (std::size_t i = 0; i < recorded.size(); ++i) {
    pending_events_[b->stream_uses[i]].emplace_back(recorded[i], b);
    ++b->event_count;
  }
  pending_event_count_.fetch_add(recorded.size(), std::memory_order_relaxed);
  b->stream_uses.clear();
}

// Pops every completed event, in order per stream (each queue is scanned up
// to its first pending event), and calls on_completed(block) for each.
// [device]. pending_event_count_ stays right if a query throws halfway.
template <class OnCompleted>
void device_state::take_completed_events(OnCompleted on_completed) {
  retired_events retired{pending_event_count_};
  for (auto it = pending_events_.begin(); it != pending_events_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      auto [e, b] = queue.front();
      if (!backend_.query_event(device_, e)) break;
      queue.pop_front();
      free_events_.push_back(e);
      ++retired.count;
      on_completed(b);
    }
    it = queue.empty() ? pending_events_.erase(it) : std::next(it);
  }
}

// Returns blocks whose events completed, without blocking. The completed
// events are taken under the device lock; each block is then updated under
// its own stream's lock (never both: see the lock order).
void device_state::process_events() {
  std::vector<block*> completed;
  std::exception_ptr failure;  // a failed query: blocks already taken are still returned
  {
    std::lock_guard device_lock(device_mutex_);
    try {
      take_completed_events([&](block* b) { completed.push_back(b); });
    } catch (...) {
      failure = std::current_exception();
    }
    completions_in_flight_.fetch_add(completed.size(), std::memory_order_relaxed);
  }
  for (block* b : completed) {
    stream_state& ss = *b->pool->owner;
    {
      std::lock_guard lock(ss.mutex);
      if (--b->event_count == 0) {
        if (history_.active()) [[unlikely]]
          history_.record_free_completed(b->ptr, b->requested_size, b->stream);
        stats_sink sink(*this, ss);
        free_block(b, sink.get(), false);
      }
    }
    completions_in_flight_.fetch_sub(1, std::memory_order_release);
  }
  if (failure) std::rethrow_exception(failure);
}

void device_state::process_events_locked() {
  take_completed_events([&](block* b) {
    if (--b->event_count != 0) return;
    if (history_.active()) [[unlikely]]
      history_.record_free_completed(b->ptr, b->requested_size, b->stream);
    free_block(b, stats_, true);
  });
}

void device_state::synchronize_and_free_events() {
  if (capture_underway()) return;  // waiting is not allowed while capturing
  ++stats_.num_sync_all_streams;
  retired_events retired{pending_event_count_};
  for (auto& [stream, queue] : pending_events_) {
    while (!queue.empty()) {
      auto [e, b] = queue.front();
      backend_.synchronize_event(device_, e);
      queue.pop_front();
      free_events_.push_back(e);
      ++retired.count;
      if (--b->event_count != 0) continue;
      if (history_.active()) [[unlikely]]
        history_.record_free_completed(b->ptr, b->requested_size, b->stream);
      free_block(b, stats_, true);
    }
  }
  pending_events_.clear();
}

void device_state::throw_out_of_memory(const alloc_params& p, world_lock& w) {
  const memory_info info = backend_.mem_get_info(device_);
  ++stats_.num_ooms;
  const auto allocated = static_cast<std::size_t>(stats_.allocated_bytes[0].current);
  const std::size_t reserved = reserved_bytes_;
  std::size_t largest_free = 0;
  for (stream_state* ss : w.streams())
    for (block_pool* pool : {&ss->pools.small, &ss->pools.large})
      if (!pool->blocks.empty()) largest_free = std::max(largest_free, pool->blocks.largest()->size);

  std::string msg = "ccalloc: out of memory on device " + std::to_string(device_) + ". Tried to allocate " +
                    format_bytes(p.requested_bytes) + " (" + std::to_string(p.requested_bytes) +
                    " bytes; needed a new segment of " + format_bytes(p.alloc_size) + "). Device " +
                    std::to_string(device_) + " has a total capacity of " + format_bytes(info.total_bytes) +
                    " of which " + format_bytes(info.free_bytes) + " is free.";
  if (set_fraction_)
    msg += " The per-process memory fraction " + format_fraction(fraction_) + " allows " +
           format_bytes(allowed_bytes_) + ".";
  msg += " Of the memory held by ccalloc, " + format_bytes(allocated) + " is allocated and " +
         format_bytes(reserved - std::min(reserved, allocated)) +
         " is reserved but unallocated; the largest cached free block is " + format_bytes(largest_free) + ".";
  const std::size_t limit = set_fraction_ ? allowed_bytes_ : info.total_bytes;
  if (p.alloc_size > limit)
    msg += " The request alone is larger than the " +
           std::string(set_fraction_ ? "memory the fraction allows" : "device's memory") + ".";
  else if (reserved > allocated && reserved - allocated > reserved / 10)
    msg += " Reserved but unallocated memory is large (fragmentation): try CCALLOC_CONF="
           "max_split_size_mb:<MiB> so that large cached blocks are not split for small requests, or "
           "garbage_collection_threshold to return old cached blocks sooner.";
  else
    msg += " Reduce the memory the program holds at its peak (batch size, sequence length), or raise the "
           "memory fraction.";

  out_of_memory_error::figures f;
  f.device = device_;
  f.requested_bytes = p.requested_bytes;
  f.device_total_bytes = set_fraction_ ? allowed_bytes_ : info.total_bytes;
  f.device_free_bytes = info.free_bytes;
  f.allocated_bytes = allocated;
  f.reserved_bytes = reserved;
  if (history_.active()) [[unlikely]]
    history_.record_oom(info.free_bytes, p.requested_bytes, p.stream);
  // Observers run outside the locks (SPEC F17): they may call back into ccalloc.
  auto observers = observers_;
  w.unlock();
  // Every observer runs, and the caller still gets the out-of-memory error:
  // an exception from an observer is dropped (observers are notifications).
  for (auto& o : observers) {
    try {
      o(device_, p.requested_bytes, f.device_total_bytes, f.device_free_bytes);
    } catch (...) {
    }
  }
  throw out_of_memory_error(std::move(msg), f);
}

// ---- private pools and capture (F20-F24) --------------------------------------------

private_pool* device_state::find_pool(mempool_id_t id) const noexcept {
  auto it = private_pools_.find(id);
  return it == private_pools_.end() ? nullptr : it->second.get();
}

private_pool& device_state::checked_pool(mempool_id_t id, const char* what) const {
  private_pool* pp = find_pool(id);
  if (pp == nullptr)
    throw invalid_argument_error(std::string("ccalloc: ") + what + ": device " + std::to_string(device_) +
                                 " has no private pool " + to_string(id) +
                                 " (never created with create_or_incref_pool, or released and deleted)");
  return *pp;
}

// The pool the newest active begin_allocate_to_pool whose filter accepts
// `stream` names, or nullptr.
private_pool* device_state::routed_pool(stream_t stream) const {
  for (auto it = captures_underway_.rbegin(); it != captures_underway_.rend(); ++it)
    if (it->filter(stream)) return it->pool;
  return nullptr;
}

block_pool& device_state::pool_in(private_pool& pp, stream_state& ss, bool small) {
  auto& slot = ss.private_pools[&pp];
  if (!slot) {
    slot = std::make_unique<stream_pools>(&ss);
    for (block_pool* bp : {&slot->small, &slot->large}) {
      bp->priv = &pp;
      bp->no_split = pp.no_split;
    }
  }
  return small ? slot->small : slot->large;
}

// Rung 5b (F22): a request of the default pool takes a free block of a
// set_use_on_oom pool (same stream and size class). The block stays in that pool.
bool device_state::try_use_on_oom_pools(alloc_params& p, const world_lock&) {
  if (p.pool->priv != nullptr || !caching_) return false;
  for (auto& [id, pp] : private_pools_) {
    if (!pp->use_on_oom) continue;
    auto it = p.owner->private_pools.find(pp.get());
    if (it == p.owner->private_pools.end()) continue;
    alloc_params q = p;
    q.pool = p.pool->is_small ? &it->second->small : &it->second->large;
    if (get_free_block(q)) {
      p.pool = q.pool;
      p.found = q.found;
      return true;
    }
  }
  return false;
}

// Cached whole segments of pools without users go back to the device.
void device_state::release_dead_pools(const world_lock& w, bool keep_going) {
  for (stream_state* ss : w.streams())
    for (auto& [pp, sp] : ss->private_pools)
      if (pp->use_count == 0) {
        release_blocks(sp->large, keep_going);
        release_blocks(sp->small, keep_going);
      }
}

void device_state::delete_empty_dead_pools(const world_lock& w) {
  for (auto it = private_pools_.begin(); it != private_pools_.end();) {
    private_pool* pp = it->second.get();
    const bool active = std::any_of(captures_underway_.begin(), captures_underway_.end(),
                                    [&](const capture_entry& c) { return c.pool == pp; });
    if (pp->use_count != 0 || pp->segment_count != 0 || active || pp->pinned.load(std::memory_order_acquire) != 0) {
      ++it;
      continue;
    }
    for (stream_state* ss : w.streams()) ss->private_pools.erase(pp);
    it = private_pools_.erase(it);
  }
}

bool device_state::any_stream_capturing(const block* b) {
  if (backend_.is_capturing(device_, b->stream)) return true;
  for (stream_t s : b->stream_uses)
    if (backend_.is_capturing(device_, s)) return true;
  return false;
}

// The free of a block used on other streams while capturing: it waits,
// counted as active, with a placeholder event, until flush_deferred_frees.
void device_state::defer_free(block* b) {
  std::lock_guard device_lock(device_mutex_);
  deferred_frees_.push_back(b);
  b->event_count = 1;
}

// Records the events of deferred frees (PyTorch:
// insert_events_deferred_until_no_capture) once no capture is underway; a
// block whose streams the backend still reports capturing stays deferred.
void device_state::flush_deferred_frees() {
  if (capture_underway() || deferred_frees_.empty()) return;
  std::vector<block*> todo;
  todo.swap(deferred_frees_);
  for (std::size_t i = 0; i < todo.size(); ++i) {
    block* b = todo[i];
    try {
      if (any_stream_capturing(b)) {
        deferred_frees_.push_back(b);
        continue;
      }
      b->event_count = 0;
      insert_events_locked(b);  // on a throw: nothing recorded, stream_uses kept
    } catch (...) {
      b->event_count = 1;
      deferred_frees_.insert(deferred_frees_.end(), todo.begin() + static_cast<std::ptrdiff_t>(i), todo.end());
      throw;
    }
    if (b->event_count == 0) free_block(b, stats_, true);
  }
}

// Frees allocated block `b` as free() does, with the world lock held.
void device_state::free_allocated_locked(block* b) {
  if (!b->stream_uses.empty()) insert_events_locked(b);
  release_allocation(b, stats_, true);
}

// Makes [ptr, ptr + size) of `seg`, which lies inside one free mapped block,
// an allocated block of its own (checkpoint restore).
block* device_state::carve_allocated(segment& seg, std::uintptr_t ptr, std::size_t size, std::size_t requested) {
  block* f = seg.head;
  while (f != nullptr && f->ptr + f->size <= ptr) f = f->next;
  if (f == nullptr || f->ptr > ptr || f->ptr + f->size < ptr + size || !f->is_free() || !f->mapped)
    throw std::logic_error("ccalloc: internal error: checkpoint block is not inside one free block");
  const stat_group g = group_of(f->pool);
  f->pool->blocks.erase(f);
  if (f->is_split()) {
    device_stats::decrease(stats_.inactive_split, g, 1);
    device_stats::decrease(stats_.inactive_split_bytes, g, static_cast<std::int64_t>(f->size));
  }
  block* lo = nullptr;
  if (f->ptr < ptr) {
    lo = f;
    f = split_free_block(f, ptr);
  }
  block* hi = f->ptr + f->size > ptr + size ? split_free_block(f, ptr + size) : nullptr;
  for (block* x : {lo, hi}) {
    if (x == nullptr) continue;
    x->gc_count_base = x->pool->get_free_blocks_call_count;
    x->pool->blocks.insert(x);
    device_stats::increase(stats_.inactive_split, g, 1);
    device_stats::increase(stats_.inactive_split_bytes, g, static_cast<std::int64_t>(x->size));
  }
  f->allocated = true;
  f->requested_size = requested;
  device_stats::increase(stats_.allocation, g, 1);
  device_stats::increase(stats_.allocated_bytes, g, static_cast<std::int64_t>(size));
  device_stats::increase(stats_.active, g, 1);
  device_stats::increase(stats_.active_bytes, g, static_cast<std::int64_t>(size));
  device_stats::increase(stats_.requested_bytes, g, static_cast<std::int64_t>(requested));
  f->counted_oversize = size >= config_.max_split_size_bytes;
  if (f->counted_oversize) stats_.oversize_allocations.increase(1);
  return f;
}

void device_state::set_memory_fraction(double fraction, const world_lock& w) {
  if (!(fraction >= 0.0 && fraction <= 1.0))
    throw invalid_argument_error("ccalloc: memory fraction " + format_fraction(fraction) +
                                 " for device " + std::to_string(device_) + " is outside [0, 1]");
  const auto allowed = static_cast<std::size_t>(fraction * static_cast<double>(device_total_bytes_));
  // Keep reserved <= the new cap where cached memory allows it. Before the
  // cap changes: if the device fails meanwhile, the old cap stays in force.
  if (reserved_bytes_ > allowed) release_cached_blocks(w);
  fraction_ = fraction == 0.0 ? 0.0 : fraction;  // -0.0 becomes 0
  set_fraction_ = true;
  allowed_bytes_ = allowed;
}

}  // namespace detail

// ---- public wrapper -----------------------------------------------------------

using detail::block;
using detail::world_lock;

device_caching_allocator::device_caching_allocator(int device, device_backend& backend, allocator_config config)
    : device_(device) {
  if (device < 0 || device >= backend.device_count())
    throw invalid_argument_error("ccalloc: device " + std::to_string(device) + " is out of range [0, " +
                                 std::to_string(backend.device_count()) + ")");
  state_ = std::make_unique<detail::device_state>(device, backend, std::move(config));
}

device_caching_allocator::~device_caching_allocator() = default;

namespace {

// malloc without history: inlined into device_caching_allocator::malloc.
[[gnu::always_inline]] inline allocation malloc_impl(detail::device_state& s, std::size_t size_bytes,
                                                     stream_t stream) {
  if (size_bytes == 0 || size_bytes >= max_request_bytes) [[unlikely]] {
    if (size_bytes == 0)
      throw invalid_argument_error("ccalloc: device_caching_allocator::malloc of 0 bytes");
    world_lock w(s);
    detail::alloc_params p;
    p.requested_bytes = size_bytes;
    p.size = size_bytes;
    p.alloc_size = size_bytes;
    p.stream = stream;
    s.throw_out_of_memory(p, w);  // SPEC F2: at once, nothing else tried
  }
  block* b = s.allocate(size_bytes, stream);
  return {reinterpret_cast<void*>(b->ptr), b};
}

}  // namespace

allocation detail::malloc_unrecorded(detail::device_state& s, std::size_t size_bytes, stream_t stream) {
  return malloc_impl(s, size_bytes, stream);
}

allocation device_caching_allocator::malloc(std::size_t size_bytes, stream_t stream) {
  auto& s = *state_;
  if (s.history_.active()) [[unlikely]]
    return detail::malloc_recorded(s, size_bytes, stream);
  return malloc_impl(s, size_bytes, stream);
}

void device_caching_allocator::free(block* b) {
  auto& s = *state_;
  if (!s.history_.active()) [[likely]] {
    s.free(b);
    return;
  }
  detail::free_recorded(s, b);
}

void device_caching_allocator::record_stream(block* b, stream_t stream) { state_->record_stream(b, stream); }

bool device_caching_allocator::record_stream_containing(std::uintptr_t address, stream_t stream) {
  auto& s = *state_;
  world_lock w(s);
  auto it = s.segments_.upper_bound(address);
  if (it == s.segments_.begin()) return false;
  --it;
  const detail::segment& seg = *it->second;
  if (address >= seg.base + seg.size) return false;
  for (block* b = seg.head; b != nullptr; b = b->next) {
    if (address < b->ptr || address >= b->ptr + b->size) continue;
    if (!b->allocated) return false;
    if (stream != b->stream &&
        std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end())
      b->stream_uses.push_back(stream);
    return true;
  }
  return false;
}

void device_caching_allocator::empty_cache() {
  detail::tracker_delivery deliver;  // segment_free entries reach trackers after the locks
  world_lock w(*state_);
  state_->publish_all_pending_stats(w);
  if (state_->history_.active()) [[unlikely]]
    state_->history_.record(trace_entry_action::empty_cache, 0, state_->reserved_bytes_, 0, nullptr);
  state_->release_cached_blocks(w);
}

std::size_t device_caching_allocator::largest_free_block() const {
  world_lock w(*state_);
  std::size_t largest = 0;
  for (detail::stream_state* ss : w.streams())
    for (auto* pool : {&ss->pools.small, &ss->pools.large})
      if (!pool->blocks.empty()) largest = std::max(largest, pool->blocks.largest()->size);
  return largest;
}

// A live block's segment neither moves nor changes size: no lock needed.
std::pair<void*, std::size_t> device_caching_allocator::base_allocation(block* b) const {
  return {reinterpret_cast<void*>(b->seg->base), b->seg->size};
}

std::size_t device_caching_allocator::block_size(const block* b) const noexcept { return b->size; }

block_segment device_caching_allocator::segment_of(const block* b) const {
  std::lock_guard lock(state_->device_mutex_);  // pages change under the device lock
  const detail::segment& seg = *b->seg;
  block_segment out;
  out.base = seg.base;
  out.size_bytes = seg.size;
  out.expandable = seg.expandable;
  if (seg.expandable) {
    out.page_bytes = seg.page_bytes;
    out.first_page = (b->ptr - seg.base) / seg.page_bytes;
    const std::size_t end_page = (b->ptr + b->size - seg.base + seg.page_bytes - 1) / seg.page_bytes;
    out.page_handles.assign(seg.pages.begin() + static_cast<std::ptrdiff_t>(out.first_page),
                            seg.pages.begin() + static_cast<std::ptrdiff_t>(end_page));
  }
  return out;
}

void device_caching_allocator::set_memory_fraction(double fraction) {
  detail::tracker_delivery deliver;  // it may release segments
  world_lock w(*state_);
  state_->publish_all_pending_stats(w);
  state_->set_memory_fraction(fraction, w);
}

double device_caching_allocator::memory_fraction() const {
  std::lock_guard lock(state_->device_mutex_);
  return state_->set_fraction_ ? state_->fraction_ : 1.0;
}

void device_caching_allocator::set_config(const allocator_config& config) {
  detail::tracker_delivery deliver;  // a new fraction may release segments
  auto& s = *state_;
  s.check_expandable_supported(config);
  world_lock w(s);
  s.publish_all_pending_stats(w);
  // A fraction set at run time (set_memory_fraction) stays unless the new
  // configuration changes per_process_memory_fraction itself.
  const bool fraction_changed =
      config.memory_fraction_set && (!s.config_.memory_fraction_set ||
                                     config.per_process_memory_fraction != s.config_.per_process_memory_fraction);
  // The fraction first: if returning cached memory fails, nothing changes.
  if (fraction_changed) s.set_memory_fraction(config.per_process_memory_fraction, w);
  s.config_ = config;
  s.stats_.max_split_size = config.max_split_size_bytes == std::numeric_limits<std::size_t>::max()
                                ? -1
                                : static_cast<std::int64_t>(config.max_split_size_bytes);
}

allocator_config device_caching_allocator::config() const {
  world_lock w(*state_);
  return state_->config_;
}

void device_caching_allocator::set_caching_enabled(bool enabled) {
  detail::tracker_delivery deliver;  // turning caching off releases segments
  auto& s = *state_;
  world_lock w(s);
  s.publish_all_pending_stats(w);
  // The cache first: if returning it fails, the mode does not change.
  if (!enabled) s.release_cached_blocks(w);
  s.caching_ = enabled;
}

bool device_caching_allocator::caching_enabled() const {
  world_lock w(*state_);
  return state_->caching_;
}

device_stats device_caching_allocator::stats() const {
  world_lock w(*state_);
  state_->publish_all_pending_stats(w);
  return state_->stats_;
}

void device_caching_allocator::reset_accumulated_stats() {
  world_lock w(*state_);
  state_->publish_all_pending_stats(w);
  state_->stats_.reset_accumulated();
}

void device_caching_allocator::reset_peak_stats() {
  world_lock w(*state_);
  state_->publish_all_pending_stats(w);
  state_->stats_.reset_peak();
}

void device_caching_allocator::attach_oom_observer(oom_observer observer) {
  std::lock_guard lock(state_->device_mutex_);
  state_->observers_.push_back(std::move(observer));
}

std::vector<expandable_segment_info> device_caching_allocator::expandable_segments() const {
  auto& s = *state_;
  world_lock w(s);
  std::vector<expandable_segment_info> out;
  for (auto& [base, seg] : s.segments_) {
    if (!seg->expandable) continue;
    expandable_segment_info e;
    e.stream = seg->head->stream;
    e.is_small_pool = seg->head->pool->is_small;
    e.address = base;
    e.reserved_address_bytes = seg->size;
    e.mapped_bytes = seg->mapped_bytes;
    out.push_back(e);
  }
  return out;
}

void device_caching_allocator::enable_peer_access(int peer) {
  auto& s = *state_;
  if (peer < 0 || peer >= s.backend_.device_count() || peer == device_)
    throw invalid_argument_error("ccalloc: enable_peer_access: peer device " + std::to_string(peer) +
                                 " is not another device of the backend (device " + std::to_string(device_) +
                                 ", devices [0, " + std::to_string(s.backend_.device_count()) + "))");
  if (!s.backend_.can_access_peer(peer, device_))
    throw backend_error("ccalloc: enable_peer_access: device " + std::to_string(peer) + " cannot access device " +
                        std::to_string(device_) + " on the '" + s.backend_.name() + "' backend (no peer-to-peer path)");
  world_lock w(s);
  if (std::find(s.peers_.begin(), s.peers_.end(), peer) != s.peers_.end()) return;
  for (auto& [base, seg] : s.segments_) {
    if (!seg->expandable) continue;
    for (std::size_t i = 0; i < seg->pages.size(); ++i)
      if (seg->pages[i] != 0)
        s.backend_.vm_set_access(device_, reinterpret_cast<void*>(base + i * seg->page_bytes), seg->page_bytes, peer);
  }
  s.peers_.push_back(peer);
}

std::vector<int> device_caching_allocator::peers() const {
  world_lock w(*state_);
  return state_->peers_;
}

// ---- private pools (F20-F24) ----------------------------------------------------------

std::string to_string(const mempool_id_t& id) {
  std::string text = "(";  // appended, not "(" + std::string: GCC 12's -Wrestrict misfires on that at -O3
  text.append(std::to_string(id.first)).append(", ").append(std::to_string(id.second)).append(")");
  return text;
}

void device_caching_allocator::create_or_incref_pool(mempool_id_t id, segment_allocator custom) {
  if (id == mempool_id_t{})
    throw invalid_argument_error("ccalloc: create_or_incref_pool: pool id (0, 0) names the default pool of device " +
                                 std::to_string(device_) + "; a private pool needs another id");
  if (static_cast<bool>(custom.malloc) != static_cast<bool>(custom.free))
    throw invalid_argument_error("ccalloc: create_or_incref_pool: the custom segment allocator of pool " +
                                 to_string(id) + " has only its " + (custom.malloc ? "malloc" : "free") +
                                 " function; give both or neither");
  auto& s = *state_;
  world_lock w(s);
  if (detail::private_pool* pp = s.find_pool(id)) {
    ++pp->use_count;
    return;
  }
  auto pp = std::make_unique<detail::private_pool>();
  pp->id = id;
  pp->custom = std::move(custom);
  s.private_pools_.emplace(id, std::move(pp));
}

void device_caching_allocator::release_pool(mempool_id_t id) {
  auto& s = *state_;
  world_lock w(s);
  detail::private_pool& pp = s.checked_pool(id, "release_pool");
  if (pp.use_count == 0)
    throw invalid_argument_error("ccalloc: release_pool: private pool " + to_string(id) + " of device " +
                                 std::to_string(device_) + " was already released (use count 0)");
  --pp.use_count;
  if (pp.use_count == 0) s.delete_empty_dead_pools(w);
}

int device_caching_allocator::get_pool_use_count(mempool_id_t id) const {
  auto& s = *state_;
  world_lock w(s);
  const detail::private_pool* pp = s.find_pool(id);
  return pp == nullptr ? 0 : pp->use_count;
}

void device_caching_allocator::begin_allocate_to_pool(mempool_id_t id, stream_filter filter) {
  auto& s = *state_;
  if (!filter)
    throw invalid_argument_error("ccalloc: begin_allocate_to_pool: pool " + to_string(id) +
                                 ": the stream filter is empty");
  world_lock w(s);
  detail::private_pool& pp = s.checked_pool(id, "begin_allocate_to_pool");
  if (pp.use_count == 0)
    throw invalid_argument_error("ccalloc: begin_allocate_to_pool: private pool " + to_string(id) + " of device " +
                                 std::to_string(device_) + " was released (use count 0); it takes no allocations");
  s.captures_underway_.push_back({&pp, std::move(filter)});
  s.capture_count_.store(s.captures_underway_.size(), std::memory_order_relaxed);
}

void device_caching_allocator::end_allocate_to_pool(mempool_id_t id) {
  auto& s = *state_;
  world_lock w(s);
  auto& stack = s.captures_underway_;
  auto it = std::find_if(stack.rbegin(), stack.rend(), [&](const auto& c) { return c.pool->id == id; });
  if (it == stack.rend())
    throw invalid_argument_error("ccalloc: end_allocate_to_pool: private pool " + to_string(id) + " of device " +
                                 std::to_string(device_) + " is not active (no begin_allocate_to_pool to end)");
  stack.erase(std::next(it).base());
  s.capture_count_.store(stack.size(), std::memory_order_relaxed);
  if (stack.empty()) {
    s.publish_all_pending_stats(w);
    s.flush_deferred_frees();
  }
  s.delete_empty_dead_pools(w);
}

void device_caching_allocator::set_use_on_oom(mempool_id_t id, bool enabled) {
  world_lock w(*state_);
  state_->checked_pool(id, "set_use_on_oom").use_on_oom = enabled;
}

void device_caching_allocator::set_no_split(mempool_id_t id, bool enabled) {
  auto& s = *state_;
  world_lock w(s);
  detail::private_pool& pp = s.checked_pool(id, "set_no_split");
  pp.no_split = enabled;
  for (detail::stream_state* ss : w.streams())
    if (auto it = ss->private_pools.find(&pp); it != ss->private_pools.end())
      it->second->small.no_split = it->second->large.no_split = enabled;
}

bool device_caching_allocator::check_pool_live_allocations(mempool_id_t id,
                                                           const std::vector<void*>& expected) const {
  auto& s = *state_;
  world_lock w(s);
  const detail::private_pool* pp = s.find_pool(id);
  std::vector<std::uintptr_t> live;
  if (pp != nullptr)
    for (auto& [base, seg] : s.segments_)
      if (seg->head->pool->priv == pp)
        for (const block* b = seg->head; b != nullptr; b = b->next)
          if (b->allocated) live.push_back(b->ptr);
  std::vector<std::uintptr_t> want;
  for (void* p : expected) want.push_back(reinterpret_cast<std::uintptr_t>(p));
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());
  std::sort(live.begin(), live.end());
  return live == want;
}

pool_usage device_caching_allocator::pool_stats(mempool_id_t id) const {
  auto& s = *state_;
  world_lock w(s);
  const detail::private_pool* pp = nullptr;
  pool_usage u;
  if (id != mempool_id_t{}) {
    pp = &s.checked_pool(id, "pool_stats");
    u.use_count = pp->use_count;
  }
  for (auto& [base, seg] : s.segments_) {
    if (seg->head->pool->priv != pp) continue;
    ++u.segment_count;
    u.reserved_bytes += seg->expandable ? seg->mapped_bytes : seg->size;
    for (const block* b = seg->head; b != nullptr; b = b->next) {
      if (b->allocated) {
        u.allocated_bytes += b->size;
        ++u.allocation_count;
      }
      if (!b->is_free()) u.active_bytes += b->size;
    }
  }
  return u;
}

std::vector<mempool_id_t> device_caching_allocator::pools() const {
  world_lock w(*state_);
  std::vector<mempool_id_t> out;
  for (auto& [id, pp] : state_->private_pools_) out.push_back(id);
  return out;
}

pool_checkpoint device_caching_allocator::get_checkpoint_state(mempool_id_t id) const {
  auto& s = *state_;
  world_lock w(s);
  const detail::private_pool& pp = s.checked_pool(id, "get_checkpoint_state");
  pool_checkpoint cp;
  cp.device = device_;
  cp.pool = id;
  for (auto& [base, seg] : s.segments_) {
    if (seg->head->pool->priv != &pp) continue;
    checkpoint_segment cs;
    cs.address = base;
    cs.total_bytes = seg->size;
    cs.stream = seg->head->stream;
    cs.is_small_pool = seg->head->pool->is_small;
    cs.is_expandable = seg->expandable;
    for (const block* b = seg->head; b != nullptr; b = b->next)
      cs.blocks.push_back({b->ptr, b->size, b->allocated ? b->requested_size : 0, b->allocated, b->mapped});
    cp.segments.push_back(std::move(cs));
  }
  return cp;
}

checkpoint_restore_result device_caching_allocator::set_checkpoint_pool_state(const pool_checkpoint& state) {
  auto& s = *state_;
  const std::string where = "ccalloc: set_checkpoint_pool_state: ";
  if (state.device != device_)
    throw invalid_argument_error(where + "the checkpoint is of device " + std::to_string(state.device) +
                                 ", not of device " + std::to_string(device_));
  world_lock w(s);
  detail::private_pool& pp = s.checked_pool(state.pool, "set_checkpoint_pool_state");
  if (s.capture_underway())
    throw invalid_argument_error(where + "a begin_allocate_to_pool is active on device " + std::to_string(device_) +
                                 " (a capture is underway); restore after end_allocate_to_pool");
  // 1. Validate everything before changing anything.
  std::vector<detail::segment*> segs;
  for (auto& [base, seg] : s.segments_)
    if (seg->head->pool->priv == &pp) segs.push_back(seg.get());
  const std::string pool_text = "private pool " + to_string(state.pool) + " of device " + std::to_string(device_);
  if (segs.size() != state.segments.size())
    throw invalid_argument_error(where + pool_text + " holds " + std::to_string(segs.size()) +
                                 " segments but the checkpoint has " + std::to_string(state.segments.size()) +
                                 " (a checkpoint of another pool, or segments were freed or added since)");
  for (std::size_t i = 0; i < segs.size(); ++i) {
    const detail::segment& seg = *segs[i];
    const checkpoint_segment& cs = state.segments[i];
    if (seg.base != cs.address || seg.size != cs.total_bytes || seg.head->stream != cs.stream ||
        seg.head->pool->is_small != cs.is_small_pool || seg.expandable != cs.is_expandable)
      throw invalid_argument_error(where + "segment " + std::to_string(i) + " of " + pool_text + " (address " +
                                   std::to_string(seg.base) + ", " + std::to_string(seg.size) +
                                   " bytes) differs from the checkpoint's (address " + std::to_string(cs.address) +
                                   ", " + std::to_string(cs.total_bytes) + " bytes) or its stream or kind");
    std::uintptr_t expect = cs.address;
    for (const checkpoint_block& cb : cs.blocks) {
      if (cb.address != expect || cb.size_bytes == 0 || cb.size_bytes % detail::min_block_bytes != 0)
        throw invalid_argument_error(where + "the checkpoint's blocks do not tile segment " + std::to_string(i) +
                                     " (block at " + std::to_string(cb.address) + ")");
      expect += cb.size_bytes;
      if (!cb.allocated || !seg.expandable) continue;
      const std::size_t page = seg.page_bytes;
      for (std::size_t p = (cb.address - seg.base) / page; p < (cb.address + cb.size_bytes - seg.base + page - 1) / page;
           ++p)
        if (seg.pages[p] == 0)
          throw invalid_argument_error(where + "block " + std::to_string(cb.address) + " of the checkpoint lies in " +
                                       "an unmapped range of expandable segment " + std::to_string(i));
    }
    if (expect != cs.address + cs.total_bytes)
      throw invalid_argument_error(where + "the checkpoint's blocks do not cover segment " + std::to_string(i));
  }
  // 2. Free what the checkpoint does not hold allocated, wait for events.
  s.publish_all_pending_stats(w);
  checkpoint_restore_result result;
  std::vector<std::vector<const checkpoint_block*>> to_create(segs.size());
  for (std::size_t i = 0; i < segs.size(); ++i) {
    const checkpoint_segment& cs = state.segments[i];
    std::vector<const checkpoint_block*> wanted;
    for (const checkpoint_block& cb : cs.blocks)
      if (cb.allocated) wanted.push_back(&cb);
    std::vector<block*> to_free;
    std::size_t k = 0;
    for (block* b = segs[i]->head; b != nullptr; b = b->next) {
      while (k < wanted.size() && wanted[k]->address < b->ptr) to_create[i].push_back(wanted[k++]);
      const bool kept = k < wanted.size() && wanted[k]->address == b->ptr && wanted[k]->size_bytes == b->size;
      if (b->allocated && kept) {
        ++k;
        continue;
      }
      if (b->allocated) to_free.push_back(b);
    }
    while (k < wanted.size()) to_create[i].push_back(wanted[k++]);
    for (block* b : to_free) {
      result.freed_pointers.push_back(reinterpret_cast<void*>(b->ptr));
      s.free_allocated_locked(b);
    }
  }
  s.flush_deferred_frees();
  s.synchronize_and_free_events();
  // 3. Create the blocks the checkpoint holds allocated.
  for (std::size_t i = 0; i < segs.size(); ++i)
    for (const checkpoint_block* cb : to_create[i]) {
      block* b = s.carve_allocated(*segs[i], cb->address, cb->size_bytes, cb->requested_bytes);
      result.blocks_created.push_back({reinterpret_cast<void*>(b->ptr), b});
    }
  return result;
}

std::vector<segment_info> device_caching_allocator::segments() const {
  auto& s = *state_;
  world_lock w(s);
  std::vector<segment_info> out;
  out.reserve(s.segments_.size());
  for (auto& [base, seg] : s.segments_) {
    segment_info si;
    si.device = device_;
    si.address = base;
    si.total_bytes = seg->size;
    si.stream = seg->head->stream;
    si.is_small_pool = seg->head->pool->is_small;
    si.is_expandable = seg->expandable;
    si.mapped_bytes = seg->expandable ? seg->mapped_bytes : seg->size;
    if (s.history_.enabled()) si.context = s.history_.segment_context(base);
    if (const detail::private_pool* pp = seg->head->pool->priv) {
      si.pool = pp->id;
      si.pool_id = {pp->id.first, pp->id.second};
    }
    for (const block* b = seg->head; b != nullptr; b = b->next) {
      block_info bi;
      bi.address = b->ptr;
      bi.size_bytes = b->size;
      bi.requested_bytes = b->requested_size;
      bi.mapped = b->mapped;
      bi.state = b->allocated ? block_state::active_allocated
                 : b->event_count > 0 ? block_state::active_pending_free
                                      : block_state::inactive;
      if (b->allocated) si.allocated_bytes += b->size;
      if (bi.state != block_state::inactive) {
        si.active_bytes += b->size;
        si.requested_bytes += b->requested_size;
        if (s.history_.enabled()) bi.context = s.history_.block_context(b->ptr);
      }
      si.blocks.push_back(bi);
    }
    out.push_back(std::move(si));
  }
  return out;
}

void device_caching_allocator::check_invariants() const {
  auto& s = *state_;
  world_lock w(s);
  s.publish_all_pending_stats(w);
  auto fail = [](const std::string& what) { throw std::logic_error("ccalloc invariant violated: " + what); };
  device_stats recount;
  std::size_t pooled = 0;
  for (auto& [base, seg] : s.segments_) {
    if (seg->head == nullptr || seg->head->ptr != base || seg->head->prev != nullptr)
      fail("segment head is not the block at the segment base");
    const stat_group g = s.group_of(seg->head->pool);
    device_stats::increase(recount.segment, g, 1);
    device_stats::increase(recount.reserved_bytes, g,
                           static_cast<std::int64_t>(seg->expandable ? seg->mapped_bytes : seg->size));
    const std::size_t page = seg->page_bytes;
    if (seg->expandable) {
      std::size_t mapped_pages = 0;
      for (physical_handle_t h : seg->pages) mapped_pages += h != 0 ? 1 : 0;
      if (mapped_pages * page != seg->mapped_bytes) fail("expandable segment's mapped_bytes differs from its pages");
      if (seg->pages.size() * page != seg->size) fail("expandable segment's page table does not cover it");
    }
    std::uintptr_t expect = base;
    std::size_t sum = 0;
    for (const block* b = seg->head; b != nullptr; b = b->next) {
      if (b->ptr != expect) fail("blocks do not tile segment " + std::to_string(base));
      if (b->seg != seg.get()) fail("block points to the wrong segment");
      if (b->next != nullptr && b->next->prev != b) fail("next->prev link broken");
      if (b->pool != seg->head->pool) fail("blocks of one segment in different pools");
      if (b->size == 0 || b->size % detail::min_block_bytes != 0) fail("block size not a positive multiple of 512");
      const bool in_pool = b->pool->blocks.contains(b);
      if (seg->expandable) {
        const std::size_t first = (b->ptr - base) / page;
        const std::size_t last = (b->ptr + b->size - base + page - 1) / page;
        for (std::size_t i = first; i < last; ++i)
          if ((seg->pages[i] != 0) != b->mapped)
            fail(b->mapped ? "a mapped block touches an unmapped page" : "an unmapped block covers a mapped page");
      } else if (!b->mapped) {
        fail("unmapped block in a plain segment");
      }
      if (!b->mapped) {
        if (!b->is_free()) fail("an unmapped block is in use");
        if ((b->ptr - base) % page != 0 || b->size % page != 0) fail("an unmapped block is not page-aligned");
        if (in_pool) fail("an unmapped block is in a pool");
        if (b->next != nullptr && !b->next->mapped) fail("two unmapped neighbours are not merged");
        expect += b->size;
        sum += b->size;
        continue;
      }
      const bool free_now = b->is_free();
      if (in_pool != free_now) fail("pool membership does not match block state");
      if (free_now) {
        ++pooled;
        if (b->next != nullptr && b->next->is_free() && b->next->mapped)
          fail("two free neighbours are not merged");
        if (b->is_split()) {
          device_stats::increase(recount.inactive_split, g, 1);
          device_stats::increase(recount.inactive_split_bytes, g, static_cast<std::int64_t>(b->size));
        }
      } else {
        device_stats::increase(recount.active, g, 1);
        device_stats::increase(recount.active_bytes, g, static_cast<std::int64_t>(b->size));
        device_stats::increase(recount.requested_bytes, g, static_cast<std::int64_t>(b->requested_size));
        if (b->allocated) {
          device_stats::increase(recount.allocation, g, 1);
          device_stats::increase(recount.allocated_bytes, g, static_cast<std::int64_t>(b->size));
        }
      }
      expect += b->size;
      sum += b->size;
    }
    if (sum != seg->size) fail("block sizes do not sum to the segment size");
  }
  std::size_t in_pools = 0;
  for (detail::stream_state* ss : w.streams()) {
    in_pools += ss->pools.small.blocks.size() + ss->pools.large.blocks.size();
    for (auto& [pp, sp] : ss->private_pools) {
      if (s.find_pool(pp->id) != pp) fail("a stream holds pools of a deleted private pool");
      if (sp->small.priv != pp || sp->large.priv != pp || sp->small.owner != ss || sp->large.owner != ss)
        fail("a private pool's stream pools point to the wrong pool or stream");
      in_pools += sp->small.blocks.size() + sp->large.blocks.size();
    }
  }
  for (auto& [id, pp] : s.private_pools_) {
    std::size_t held = 0;
    for (auto& [base, seg] : s.segments_) held += seg->head->pool->priv == pp.get() ? 1 : 0;
    if (held != pp->segment_count) fail("private pool " + to_string(id) + "'s segment_count differs from its segments");
    if (pp->use_count < 0) fail("negative pool use count");
  }
  for (const block* b : s.deferred_frees_)
    if (b->allocated || b->event_count != 1) fail("a deferred free is allocated or lacks its placeholder event");
  if (in_pools != pooled) fail("pools hold blocks that are not free blocks of live segments");
  if (static_cast<std::int64_t>(s.reserved_bytes_) != recount.reserved_bytes[0].current)
    fail("the reservation counter differs from the sum of segment sizes");
  std::size_t queued = 0;
  for (auto& [stream, queue] : s.pending_events_) queued += queue.size();
  if (queued != s.pending_event_count_.load()) fail("pending_event_count_ differs from the queued events");
  auto same = [&](const stat_array& a, const stat_array& b, const char* name) {
    for (std::size_t i = 0; i < stat_group_count; ++i)
      if (a[i].current != b[i].current)
        fail(std::string(name) + "[" + std::to_string(i) + "].current is " + std::to_string(a[i].current) +
             " but a recount gives " + std::to_string(b[i].current));
  };
  same(s.stats_.segment, recount.segment, "segment");
  same(s.stats_.reserved_bytes, recount.reserved_bytes, "reserved_bytes");
  same(s.stats_.allocation, recount.allocation, "allocation");
  same(s.stats_.allocated_bytes, recount.allocated_bytes, "allocated_bytes");
  same(s.stats_.active, recount.active, "active");
  same(s.stats_.active_bytes, recount.active_bytes, "active_bytes");
  same(s.stats_.requested_bytes, recount.requested_bytes, "requested_bytes");
  same(s.stats_.inactive_split, recount.inactive_split, "inactive_split");
  same(s.stats_.inactive_split_bytes, recount.inactive_split_bytes, "inactive_split_bytes");
}

}  // namespace ccalloc

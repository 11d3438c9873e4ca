// Private data structures of the device caching allocator. Only the core's
// sources (src/core/*.cpp, one per concept: see src/README.md) use them.
//
// device_state is one device: it keeps the segments, blocks and pools and
// orchestrates (malloc, free, the fallback ladder, segment releases). Its
// parts own their data behind small interfaces, each in its own header
// that states what it owns and which lock guards it:
//   stream_registry        the stream states, registry_mutex_   (registry_)
//   placement_policy       the configuration, rounding, split and carving rules (policy_)
//   device_memory          total, cap, reserved bytes and their mark (memory_)
//   event_queue            the event pool, events of cross-stream frees (events_)
//   device_fences          the page fences over this device's events (fences_)
//   expandable_segments    reservations, page mapping and recycling (expandable_)
//   private_pool_registry  private pools, capture scopes, deferred frees (pools_)
//   tag_sleep              tags' pools, pause and resume (tags_)
// The ones that act across the device hold a device_state& and reach the
// segments, pools and statistics through it.
//
// Picture of one device's memory:
//
//   segment (one device malloc)      [======================================]
//   blocks (split / merged)          [ alloc ][ free ][  alloc  ][   free    ]
//
// Invariants (checked by device_caching_allocator::check_invariants):
//   segment.size  = sum of the sizes of its blocks, which tile it in address order
//   block.next->ptr = block.ptr + block.size; block.next->prev = block
//   a block is in its pool  <=>  !allocated && event_count == 0
//   two neighbouring blocks are never both in a pool (free neighbours merge)
//   stats.reserved_bytes.all.current  = sum of plain segment sizes + mapped bytes
//                                       of expandable segments
//   stats.allocated_bytes.all.current = sum of sizes of allocated blocks
//   stats.active_bytes.all.current    = allocated + sizes of blocks waiting on events
//   all blocks of a segment are in one pool: the segment's (stream, default or
//   private pool, small or large); private_pool::segment_count = its segments
//   a block in pools_.deferred_frees() is not allocated and has event_count == 1
//   while a private pool has users, none of its segments is freed or unmapped
//
// Locking (SPEC X1): each stream has its own state and lock (stream_state);
// the fast path (a cached block of the request's stream, and the free of a
// block) takes only that lock. Device-wide state (segments, events, the
// memory figures, the private pools) has device_mutex_; statistics have stats_mutex_. The slow path
// (a new segment, garbage collection, the OOM ladder, emptyCache) locks the
// whole device: the registry, every stream in stream-handle order, the device,
// the statistics. Lock order, never reversed:
//     registry_mutex_ -> stream_state::mutex (by stream handle) -> device_mutex_ -> stats_mutex_
// A block belongs to its segment's stream: its fields change only under that
// stream's lock (event_count included). The lock each method below needs is
// in brackets next to it; docs/design.md (section 4) lists the locks of each
// public operation. In front of all this, each thread's
// cache of blocks it freed (thread_cache.hpp) serves repeats without these
// locks; its locks come after stats_mutex_ (world_lock frees every parked
// block when it is taken), and a parked block is allocated for the pools.
//
// Expandable segments (SPEC B7): an address-space reservation whose pages
// (the device's granularity, 2 MiB) are mapped on demand:
//
//   reservation                      [======================================]
//   pages                            |m |m |m |m |  |  |m |  |  |  |  |  |  |
//   blocks                           [alloc][ free ][unmapped][a][unmapped  ]
//
// Extra invariants: a block is mapped or not as a whole; an unmapped block is
// free, page-aligned, outside every pool, and all its pages are unmapped;
// every page a mapped block touches is mapped; free neighbours merge only
// when both are mapped or both unmapped; segment.mapped_bytes = mapped pages
// x page size; segment.unmapped lists its unmapped blocks in address order.
// Every free mapped block of an expandable segment counts as an
// inactive split block (is_split() is true there).
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/base/detail/spin_mutex.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/stats.hpp>
#include <ccalloc/core/tags.hpp>
#include "block.hpp"
#include "block_index.hpp"
#include "pool_scopes.hpp"
#include "pools.hpp"
#include "stat_storage.hpp"

#include "history_recorder.hpp"
#include "host_copy_cache.hpp"
#include "mapping_notifier.hpp"
#include "device_fences.hpp"
#include "device_memory.hpp"
#include "event_queue.hpp"
#include "expandable_segments.hpp"
#include "placement_policy.hpp"
#include "private_pool_registry.hpp"
#include "stream_registry.hpp"
#include "tag_sleep.hpp"
#include "page_fences.hpp"
#include "page_table.hpp"
#include "recycle_budget.hpp"
#include "run_placement.hpp"
#include "thread_cache.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <array>
#include <atomic>
#include <bit>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ccalloc::detail {

class device_state;

// ---- stats_sink and world_lock (locks_and_stats.cpp, stats_sink.hpp) ------------------

// Where one operation's statistics go: straight into the device's statistics
// when stats_mutex_ is free (always, in a single thread: exact peaks), else
// into the stream's pending deltas. After a failed try, or when another
// thread published last, the stream stops trying for a while so that threads
// on different streams do not share a cache line per operation.
// Its members are inline in stats_sink.hpp (the hot path makes one per
// operation). [stream]
class stats_sink {
 public:
  stats_sink(device_state& d, stream_state& s) noexcept;
  ~stats_sink();
  stats_sink(const stats_sink&) = delete;
  stats_sink& operator=(const stats_sink&) = delete;
  [[nodiscard]] device_stats& get() noexcept;

 private:
  device_state& d_;
  stream_state& s_;
  bool locked_ = false;
};

// Merges the stream's pending deltas (since its last publication) into
// `into` and clears them; nothing when it has none. [stream + stats, or world]
void publish_pending_stats(device_stats& into, stream_state& s) noexcept;

// All of a device's locks, in order (the slow path). unlock()/lock() let the
// device malloc run unlocked (release_lock_on_cudamalloc) and observers run
// outside the locks.
class world_lock {
 public:
  explicit world_lock(device_state& d);
  ~world_lock();
  world_lock(const world_lock&) = delete;
  world_lock& operator=(const world_lock&) = delete;
  void unlock();
  void lock();
  [[nodiscard]] bool locked() const noexcept { return locked_; }
  /// Every stream state of the device when the lock was taken (all locked),
  /// in the order of their stream handles: the slow path's loops over them
  /// (which stream's cached segment is adopted on a tie, which segments go
  /// back to the device first) do not depend on where the host heap put
  /// the stream states, so a seeded program places its blocks the same way
  /// in every run.
  [[nodiscard]] const std::vector<stream_state*>& streams() const noexcept { return streams_; }
  /// Unlocks `ss` and drops it from streams() (its state is about to be
  /// deleted: stream_registry::forget_gone_streams).
  void drop(stream_state* ss) noexcept;

 private:
  device_state& d_;
  std::vector<stream_state*> streams_;
  bool locked_ = false;
};

// The statistics group of a pool's blocks. [none]: is_small is fixed
[[nodiscard]] inline stat_group group_of(const block_pool* pool) noexcept {
  return pool->is_small ? stat_group::small_pool : stat_group::large_pool;
}

// ---- device_state: everything of one device ---------------------------------------------

class device_state {
 public:
  device_state(int device, device_backend& backend, allocator_config config);
  ~device_state();
  device_state(const device_state&) = delete;
  device_state& operator=(const device_state&) = delete;

  // Methods by the file that defines them (src/README.md). The lock each
  // needs on entry is in brackets:
  //   [none]    no lock held; the method takes what it needs
  //   [stream]  the lock of the stream whose pool or block it touches (a
  //             block's stream: b->pool->owner)
  //   [device]  device_mutex_;  [stream, device]: both, in the lock order
  //   [world]   world_lock: every lock of the device (section "Locking" above)
  // "takes X" names a lock the method takes itself; "drops" one it may
  // release and retake while it runs.

  // --- hot_path.cpp: malloc and free of a cached block ----------------------
  block* allocate(std::size_t requested_bytes, stream_t stream);  // [none] takes stream, else world
  // Events pending or a begin_allocate_to_pool active. [none] takes device,
  // then stream or world
  block* allocate_unusual(std::size_t requested_bytes, stream_t stream);
  void free(block* b);                      // [none] takes the block's stream (+device for events)
  bool get_free_block(alloc_params& p);                                        // [stream]
  block_index::position find_free_block(alloc_params& p);                     // [stream]
  block* take_found_block(alloc_params& p, device_stats& st,
                          block_index::position at = block_index::end());      // [stream]
  block* note_reusable(block* b, const stream_state& ss) const noexcept;       // [stream]
  void release_allocation(block* b, device_stats& st, bool device_locked);    // [stream] (+device if device_locked)
  void free_block(block* b, device_stats& st, bool device_locked);            // [stream] (+device if device_locked)
  std::size_t merge(block* dst, block* src);                                   // [stream]
  // Splits free block b at `at` (inside it): the upper part, a new free block. [stream]
  block* split_free_block(block* b, std::uintptr_t at);

  // --- device_state.cpp -----------------------------------------------------------
  // B4: a use of b on `stream` (its free then records an event there).
  // Throws invalid_argument_error for a stream that is not live or a paused
  // block. [none] takes the registry's lock, then the block's stream
  void record_stream(block* b, stream_t stream);
  // Throws that invalid_argument_error when b's segment is paused (its
  // pages are released); record_stream_containing resolves an interior
  // pointer to its block and refuses it the same way. [b's stream]
  void refuse_record_stream_if_paused(const block& b) const;

  // --- fallback_ladder.cpp: the slow path, new segments, releases, GC ---------
  block* allocate_slow(alloc_params& p, world_lock& w);                        // [world]
  block* climb_ladder(alloc_params& p, world_lock& w);                         // [world] allocate_slow's rungs
  block* take_from_rung(alloc_params& p);                                      // [world]
  void discard_made_segment(const alloc_params& p) noexcept;                   // [world]
  bool alloc_segment(alloc_params& p, bool is_retry, world_lock& w);          // [world] drops it with B8
  segment& add_segment(const alloc_params& p, std::unique_ptr<segment> seg, std::uintptr_t base,
                       std::size_t size);                                      // [world]
  // Cross-stream reuse (X2)
  bool adopt_idle_segment(alloc_params& p, const world_lock& w);              // [world]
  bool release_available_cached_blocks(const alloc_params& p);                // [world]
  // for_retry: a segment whose free throws stays cached and the others go
  // on (an allocation retrying must not fail on another pool's segment),
  // the first such error kept in release_failure_ (emptyCache reports it
  // at the end); else the first such error is thrown.
  bool release_cached_blocks(const world_lock& w, bool for_retry = false);    // [world]
  void release_unused_segments(const world_lock& w, bool keep_going = false);  // [world]
  void release_blocks(block_pool& pool, bool keep_going = false);             // [world]
  void release_block(block* b, device_stats& st);                             // [stream, device]
  void forget_segment(block* b, device_stats& st) noexcept;                   // [stream, device]
  void release_segment_memory(segment& seg);                                  // [stream, device] or [world]
  void release_segment_memory_announced(segment& seg);                        // [stream, device] or [world]
  void free_uncached(block* b, stream_state& ss);                             // [stream] takes device
  void garbage_collect_cached_blocks(const world_lock& w);                    // [world]

  // --- out_of_memory.cpp -------------------------------------------------------
  [[noreturn]] void throw_out_of_memory(const alloc_params& p, world_lock& w);  // [world] drops it for observers

  // [world, or in the constructor] The thread_cache key, when given
  // (config.thread_cache_set), switches the thread cache (enabled,
  // small_only); otherwise it stays as CCALLOC_THREAD_CACHE or
  // set_thread_cache_enabled left it. small_only is an atomic written
  // under the world lock and read (relaxed) by the park path.
  void apply_thread_cache_setting(const allocator_config& config);

  // --- tagged allocation (fallback_ladder.cpp; tags: tag_sleep.hpp) -------------
  // An allocation under the calling thread's tag (not default), routed to
  // its pool. [none] takes the world lock; throws for a paused tag.
  block* allocate_tagged(std::size_t requested_bytes, stream_state& ss, tag_id tag);
  // allocate_slow in private pool pp (routed by a capture scope or a tag),
  // pinning it meanwhile. [world]
  block* allocate_in_private_pool(private_pool& pp, std::size_t requested_bytes, stream_state& ss, world_lock& w);

  // --- locks_and_stats.cpp, memory_accounting.cpp --------------------------------
  void publish_all_pending_stats(const world_lock& w);                        // [world]
  // Caps reserved memory at fraction x total (cached memory goes back first
  // where reserved passes the new cap); invalid_argument_error outside [0, 1].
  void set_memory_fraction(double fraction, const world_lock& w);             // [world]

  // --- data, by the lock that guards it ------------------------------------------
  // The parts (stream_registry ... tag_sleep) keep their own data private
  // behind their interfaces; what is left here is the device-wide state
  // the parts and the core's files share (the backend, the locks, the
  // segments, statistics, history, mapping listeners, thread caches, OOM
  // observers). It is still public: the core's free functions (the rungs of
  // the ladder, the hot path's helpers, inspection) read it directly.

  const int device_;
  device_backend& backend_;
  const std::uint64_t id_;  // unique per instance: keys the threads' block caches

  stream_registry registry_;  // the stream states (stream_registry.hpp) [registry_mutex_]

  // The configuration and the placement rules over it (placement_policy.hpp).
  placement_policy policy_;

  // [device_mutex_] (the world lock holds it too)
  spin_mutex device_mutex_;
  device_memory memory_;  // total, cap, reserved bytes and their mark (device_memory.hpp)
  segment_map segments_;  // by base address
  // The parts below each state their lock rule in their header (the
  // world lock for pages and tags; the device lock for the event queues
  // and private pools; a fence is recorded under its stream's lock and the
  // device lock). Declared in this order: constructed and destroyed so.
  expandable_segments expandable_{*this};  // reservations and their pages (expandable_segments.hpp)
  event_queue events_{*this};  // the event pool and the events of cross-stream frees
  private_pool_registry pools_{*this};  // private pools, capture scopes, deferred frees
  tag_sleep tags_{*this};  // tags' pools, pause and resume (tag_sleep.hpp)
  device_fences fences_{*this};  // the page fences of its streams (device_fences.hpp)
  std::vector<oom_observer> observers_;
  // The out-of-memory snapshot (config oom_snapshot; out_of_memory.cpp):
  // the public wrapper sets the writer (it owns the snapshot code); called
  // with no lock held, it writes the device's snapshot to the path and
  // returns the sentence the error message gets; it never throws.
  std::function<std::string(const std::string& path)> oom_snapshot_writer_;
  std::optional<std::uint64_t> last_oom_snapshot_us_;  // steady clock, when the last was written [world]

  // Memory history (SPEC F14-F18): its own lock, innermost. The allocator
  // records only when history_.active() (one relaxed load).
  history_recorder history_{device_};

  // Mapping listeners (SPEC C1, ccalloc/core/mapping_events.hpp): every
  // change of what is mapped is announced where it happens, under the locks
  // that make it; one relaxed load when none is attached.
  mapping_notifier mapping_{device_};

  // The first failure of a segment free that release_blocks went on past
  // (keep_going), until its reader clears it. [world]
  std::exception_ptr release_failure_;

  // Blocks parked in threads' caches (thread_cache.hpp).
  thread_cache_registry thread_caches_;

  // [stats_mutex_] On a cache line of its own: threads on many streams
  // try it every 64th operation, and the flags read on every operation
  // (thread_caches_.enabled above) must not share its line.
  alignas(64) spin_mutex stats_mutex_;
  device_stats stats_;
  const void* last_stats_thread_ = nullptr;  // the thread that published last
};

// A number never returned before in this process (device_state::id_, the
// stream registry's cache key).
std::uint64_t fresh_state_key() noexcept;

// malloc and free behind device_caching_allocator's public ones: without
// history (hot_path.cpp) and with it (device_history.cpp:
// contexts gathered outside the locks, entries recorded, trackers run after).
allocation malloc_unrecorded(device_state& s, std::size_t size_bytes, stream_t stream);
[[gnu::noinline]] allocation malloc_recorded(device_state& s, std::size_t size_bytes, stream_t stream);
[[gnu::noinline]] void free_recorded(device_state& s, block* b);

/// Writes `owner`'s snapshot (segments, its trace, annotations, settings) as
/// PyTorch's pickle to `path` (through a temporary file renamed over it) and
/// returns the sentence for the out-of-memory message: where it wrote, or
/// why it could not. Never throws. Call with no lock of the device held
/// (device_history.cpp).
[[gnu::cold]] std::string write_oom_snapshot(device_caching_allocator& owner, const std::string& path) noexcept;

}  // namespace ccalloc::detail

// Private data structures of the device caching allocator. Only the core's
// sources (src/core/*.cpp, one per concept: see src/README.md) use them.
//
// device_state is one device: it orchestrates (malloc, free, the fallback
// ladder) and holds the parts below; its data is private, each part
// reached through an inline accessor. Each part owns its data behind a
// small interface, in its own header that states what it owns and which
// lock guards it:
//   stream_registry        the stream states, registry_mutex_   (registry())
//   placement_policy       the configuration, rounding, split and carving rules (policy())
//   device_memory          total, cap, reserved bytes and their mark (memory())
//   segment_table          the segments, their releases and teardown (segments())
//   event_queue            the event pool, events of cross-stream frees (events())
//   device_fences          the page fences over this device's events (fences())
//   expandable_segments    reservations, page mapping and recycling (expandable())
//   private_pool_registry  private pools, capture scopes, deferred frees (pools())
//   tag_sleep              tags' pools, pause and resume (tags())
//   oom_reporter           OOM observers, the snapshot, the error (oom())
//   device_statistics      the figures, stats_mutex_, publishing (stats())
//   history_recorder, mapping_notifier, thread_cache_registry
//                          history, mapping listeners, parked blocks
// The ones that act across the device hold a device_state& and reach the
// other parts through it.
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
//   a block in pools().deferred_frees() is not allocated and has event_count == 1
//   while a private pool has users, none of its segments is freed or unmapped
//
// Locking (SPEC X1): each stream has its own state and lock (stream_state);
// the fast path (a cached block of the request's stream, and the free of a
// block) takes only that lock. Device-wide state (segments, events, the
// memory figures, the private pools) has device_mutex_; statistics have
// stats_mutex_ (device_statistics). The slow path
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
#include <ccalloc/base/detail/fork_handlers.hpp>
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
#include "device_statistics.hpp"
#include "device_memory.hpp"
#include "event_queue.hpp"
#include "expandable_segments.hpp"
#include "oom_reporter.hpp"
#include "placement_policy.hpp"
#include "private_pool_registry.hpp"
#include "stream_registry.hpp"
#include "tag_sleep.hpp"
#include "page_fences.hpp"
#include "page_table.hpp"
#include "recycle_budget.hpp"
#include "segment_table.hpp"
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
  // Locks nothing yet (lock() takes the locks, without draining the thread
  // caches): the fork handlers' hold.
  world_lock(device_state& d, std::defer_lock_t) noexcept : d_(d) {}
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
  // A free of a block of a paused tag is done at the resume: true when `b`
  // is one and now waits for it (marked free_completed_at_resume), false
  // (nothing done) otherwise. [none] takes the block's stream
  bool defer_free_while_paused(block* b);
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

  // --- fallback_ladder.cpp: the slow path, new segments -----------------------------
  block* allocate_slow(alloc_params& p, world_lock& w);                        // [world]
  block* climb_ladder(alloc_params& p, world_lock& w);                         // [world] allocate_slow's rungs
  block* take_from_rung(alloc_params& p);                                      // [world]
  bool alloc_segment(alloc_params& p, bool is_retry, world_lock& w);          // [world] drops it with B8
  // Cross-stream reuse (X2)
  bool adopt_idle_segment(alloc_params& p, const world_lock& w);              // [world]
  // allocate_slow in private pool pp (routed by a capture scope or a tag),
  // pinning it meanwhile. [world]
  block* allocate_in_private_pool(private_pool& pp, std::size_t requested_bytes, stream_state& ss, world_lock& w);

  // --- the parts and the device's fixed facts -----------------------------------------
  // Each accessor is inline (one address computation); the part it returns
  // states its own lock rule in its header. The device's figures are the
  // parts' data, reached only through their interfaces.
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] device_backend& backend() const noexcept { return backend_; }
  // Unique per instance: keys the threads' block caches (thread_cache.hpp). [none]
  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }
  [[nodiscard]] stream_registry& registry() noexcept { return registry_; }
  [[nodiscard]] placement_policy& policy() noexcept { return policy_; }
  // Guards memory(), segments(), the event queues, private pools and OOM observers.
  [[nodiscard]] spin_mutex& device_mutex() noexcept { return device_mutex_; }
  [[nodiscard]] device_memory& memory() noexcept { return memory_; }
  [[nodiscard]] segment_table& segments() noexcept { return segments_; }
  [[nodiscard]] expandable_segments& expandable() noexcept { return expandable_; }
  [[nodiscard]] event_queue& events() noexcept { return events_; }
  [[nodiscard]] private_pool_registry& pools() noexcept { return pools_; }
  [[nodiscard]] tag_sleep& tags() noexcept { return tags_; }
  [[nodiscard]] device_fences& fences() noexcept { return fences_; }
  [[nodiscard]] oom_reporter& oom() noexcept { return oom_; }
  [[nodiscard]] history_recorder& history() noexcept { return history_; }
  [[nodiscard]] mapping_notifier& mapping() noexcept { return mapping_; }
  [[nodiscard]] thread_cache_registry& thread_caches() noexcept { return thread_caches_; }
  [[nodiscard]] device_statistics& stats() noexcept { return stats_; }

 private:
  // Declared in this order: constructed so, destroyed in reverse.
  const int device_;
  device_backend& backend_;
  const std::uint64_t id_;

  stream_registry registry_;  // the stream states [registry_mutex_]
  placement_policy policy_;   // the configuration and the placement rules over it

  // [device_mutex_] (the world lock holds it too) and the parts that state
  // their own rule (the world lock for pages and tags; the device lock for
  // segments, event queues and private pools; a fence is recorded under its
  // stream's lock and the device lock).
  spin_mutex device_mutex_;
  device_memory memory_;                   // total, cap, reserved bytes and their mark
  segment_table segments_{*this};          // the segments and their releases
  expandable_segments expandable_{*this};  // reservations and their pages
  event_queue events_{*this};              // the event pool and the events of cross-stream frees
  private_pool_registry pools_{*this};     // private pools, capture scopes, deferred frees
  tag_sleep tags_{*this};                  // tags' pools, pause and resume
  device_fences fences_{*this};            // the page fences of its streams
  oom_reporter oom_{*this};                // OOM observers, snapshot, the error

  // Memory history (SPEC F14-F18): its own lock, innermost. The allocator
  // records only when history_.active() (one relaxed load).
  history_recorder history_{device_};

  // Mapping listeners (SPEC C1, ccalloc/core/mapping_events.hpp): every
  // change of what is mapped is announced where it happens, under the locks
  // that make it; one relaxed load when none is attached.
  mapping_notifier mapping_{device_};

  // Blocks parked in threads' caches (thread_cache.hpp).
  thread_cache_registry thread_caches_;

  // [stats_mutex_] On a cache line of its own: threads on many streams
  // try it every 64th operation, and the flags read on every operation
  // (thread_caches_.enabled() above) must not share its line.
  alignas(64) device_statistics stats_;

  // Around a fork (base/detail/fork_handlers.hpp): every lock of the device
  // in the lock order, so that the child finds them free. Registered last
  // in the constructor, cancelled first in the destructor
  // (locks_and_stats.cpp).
  world_lock fork_world_{*this, std::defer_lock};
  std::optional<fork_registration> fork_outer_;
  std::optional<fork_registration> fork_inner_;
  void register_fork_hooks();
  void cancel_fork_hooks() noexcept;
};

// A B4 use of b on `stream` (its free then records an event there).
// Throws invalid_argument_error for a stream that is not live or a paused
// block. [none] takes the registry's lock, then the block's stream
// (device_state.cpp)
void record_stream(device_state& d, block* b, stream_t stream);
// Throws record_stream's invalid_argument_error when b's segment is paused
// (its pages are released); record_stream_containing resolves a pointer
// inside a block to it and refuses it the same way. [b's stream]
void refuse_record_stream_if_paused(const device_state& d, const block& b);

// An allocation under the calling thread's tag (not default), routed to
// its pool (fallback_ladder.cpp; tags: tag_sleep.hpp). [none] takes the
// world lock; throws for a paused tag.
block* allocate_tagged(device_state& d, std::size_t requested_bytes, stream_state& ss, tag_id tag);

// Caps reserved memory at fraction x total (cached memory goes back first
// where reserved passes the new cap); invalid_argument_error outside [0, 1]
// (memory_accounting.cpp). [world]
void set_memory_fraction(device_state& d, double fraction, const world_lock& w);

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

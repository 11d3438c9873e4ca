// ccalloc/core/device_caching_allocator.hpp: the caching allocator of one
// device (PyTorch's DeviceCachingAllocator).
//
// What it does: serves requests for device memory from a cache of blocks
// carved out of segments that it obtained from a device_backend, so that the
// device's synchronous malloc and free are called rarely. Blocks are bound to
// the stream they were allocated on; reuse on that stream is safe at once
// because work on one stream is ordered. A block also used on other streams
// (record_stream) returns to the cache only when events recorded on those
// streams at free time have completed (SPEC B4).
//
// Policies (SPEC B1-B6), following PyTorch's allocator unless noted:
//  - sizes round up to 512 bytes, or to power-of-two divisions (B1);
//  - requests <= 1 MiB use the small pool (2 MiB segments); larger ones the
//    large pool (20 MiB segments under 10 MiB, else rounded to 2 MiB) (B2);
//  - best fit by (stream, size, address); split when the remainder is worth
//    keeping; merge free neighbours on free; oversize rules (B3);
//  - garbage collection of old cached blocks above a threshold (B5);
//  - out of memory: free oversize cached blocks, then all cached blocks after
//    synchronizing pending events, retry, then throw (B6).
//
// Cost: malloc and free are O(log n) in the number of cached blocks of the
// stream's pool; the device is called only on the slow path.
//
// Thread safety: every public function may be called concurrently. A block
// handle (detail::block*) stays valid from malloc until free.
// Fork: a fork() while other threads are inside it leaves the child's copy
// with every lock free (the fork handlers take them all first, see
// caching_allocator.hpp); blocks other threads had cached for reuse go back
// to the pools at the child's first call that takes the device's world lock.
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/base/types.hpp>
#include <ccalloc/core/allocation.hpp>
#include <ccalloc/core/checkpoint.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/mapping_events.hpp>
#include <ccalloc/core/pools.hpp>
#include <ccalloc/core/segment_info.hpp>
#include <ccalloc/core/stats.hpp>
#include <ccalloc/core/tags.hpp>

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ccalloc {

namespace detail {
struct block;
class device_state;
}  // namespace detail

/// Called on each out-of-memory error, outside the allocator's locks, with
/// (device, bytes asked, bytes allowed (the fraction cap, else device total),
/// device free bytes). SPEC F17. It may call back into the allocator; an
/// out-of-memory error inside an observer, on the thread that runs it (an
/// observer that allocates), does not call the observers again: it is
/// thrown to the observer as usual, without notification, so that an
/// observer cannot recurse without end. An exception it
/// throws is dropped: the other observers still run and the caller still gets
/// the out_of_memory_error.
using oom_observer = std::function<void(int device, std::size_t requested_bytes,
                                        std::size_t allowed_bytes, std::size_t free_bytes)>;

class device_caching_allocator {
 public:
  /// `backend` must outlive the allocator. Throws config_error if `config`
  /// asks for something `backend` cannot do.
  device_caching_allocator(int device, device_backend& backend, allocator_config config);
  /// Returns every segment to the device. Live blocks leak their memory back
  /// to the device too (the caller's pointers become invalid).
  ~device_caching_allocator();
  device_caching_allocator(const device_caching_allocator&) = delete;
  device_caching_allocator& operator=(const device_caching_allocator&) = delete;

  [[nodiscard]] int device() const noexcept { return device_; }

  /// Allocates `size_bytes` (> 0, < max_request_bytes) usable on `stream`
  /// without synchronization. Throws out_of_memory_error (after trying to
  /// free the cache; SPEC B6) and backend_error; invalid_argument_error,
  /// naming the stream, when the first malloc on `stream` (per thread) finds
  /// it is no live stream: destroyed (stream_destroyed) or one the backend
  /// denies (device_backend::is_stream).
  [[nodiscard]] allocation malloc(std::size_t size_bytes, stream_t stream);
  /// Frees a block from malloc. If the block was used on other streams
  /// (record_stream), it returns to the cache when their events complete.
  /// Throws backend_error if recording those events fails, or in no-caching
  /// mode if the device refuses the segment; the block stays allocated then.
  /// (In no-caching mode, a segment freed later, when its events complete,
  /// that the device refuses stays cached until empty_cache.)
  void free(detail::block* block);
  /// Marks `block` as used on `stream` (PyTorch: recordStream). A use on the
  /// block's own stream is ignored. Throws invalid_argument_error naming the
  /// stream, nothing changed, when `stream` is no live stream of this device:
  /// destroyed (stream_destroyed) or denied by device_backend::is_stream
  /// (never created, another device's).
  /// The backend is about to destroy `stream` (caching_allocator::destroy_stream
  /// calls this, with the backend's destroy_stream as `destroy`). Waits for the work queued
  /// on it (synchronize_stream: as CUDA lets a destroyed stream's work
  /// complete), then marks it gone: blocks allocated on it, or recorded on it
  /// (record_stream), stay valid and are freed later as usual, without
  /// recording anything on it; a malloc on it throws invalid_argument_error
  /// in every thread once this call has returned (a thread that had met the
  /// stream finds it gone under its lock). Its
  /// cached blocks stay cached for its handle (other streams may adopt its
  /// idle segments); with reuse_across_streams:False (no other stream may;
  /// for expandable segments also with trim_on_new_peak:False)
  /// they go back to the device now, as empty_cache returns them, and a
  /// segment holding its live blocks when the last of them is freed (one
  /// used on other streams once their work has run). Once it holds no
  /// segment, its state is deleted (nothing of it stays: SPEC P10), as soon
  /// as no thread can still reach it. `destroy` (the backend's
  /// destroy_stream; may be empty) runs under the same lock, after the
  /// stream is marked gone: a malloc racing with this call either comes
  /// before (it may be served) or after (refused, invalid_argument_error),
  /// never sees the stream half destroyed (gone here, still live for the
  /// backend), and a free never records on the destroyed stream. If
  /// `destroy` throws, the stream stays live and the exception propagates.
  /// Throws backend_error from the synchronize (then nothing changed).
  /// Locks the whole device.
  void stream_destroyed(stream_t stream, const std::function<void()>& destroy = {});
  /// The backend made a stream `stream` (a handle a destroyed stream may have
  /// had): it is no longer gone (stream_destroyed). Locks the whole device.
  void stream_created(stream_t stream);
  void record_stream(detail::block* block, stream_t stream);
  /// record_stream for an address inside a live block (a view at an offset,
  /// SPEC X4; PyTorch ignores such pointers). Returns false, changing nothing,
  /// if no live block of this device contains `address`; throws as
  /// record_stream for a stream that is not live or a block of a paused
  /// tag (the same invalid_argument_error). Slow path: locks the whole
  /// device.
  bool record_stream_containing(std::uintptr_t address, stream_t stream);
  /// Returns cached segments that hold no live block to the device, after
  /// waiting for pending events (PyTorch: emptyCache). Live blocks are
  /// untouched. Throws backend_error from the device (synchronizing an event,
  /// freeing a segment): a segment whose free fails stays cached, the
  /// others still go back, and the first such failure is thrown at the end;
  /// a failed synchronize stops it (what was returned before stays returned).
  void empty_cache();
  /// Size in bytes of the largest cached free block (PyTorch: cacheInfo).
  [[nodiscard]] std::size_t largest_free_block() const;
  /// Base address and size in bytes of the segment holding `block`
  /// (PyTorch: getBaseAllocation).
  [[nodiscard]] std::pair<void*, std::size_t> base_allocation(detail::block* block) const;
  /// The segment of a live block and, when expandable, the physical handles
  /// of the pages the block touches (they stay mapped while the block is
  /// live). Read-only; takes the device lock briefly. For IPC (SPEC F25).
  [[nodiscard]] block_segment segment_of(const detail::block* block) const;
  /// Size in bytes and stream of a live block (rounded size).
  [[nodiscard]] std::size_t block_size(const detail::block* block) const noexcept;

  /// Caps reserved bytes at fraction x device total (PyTorch:
  /// setMemoryFraction); a cap below the reserved bytes returns the cache
  /// first. Throws invalid_argument_error outside [0, 1], backend_error if
  /// returning the cache fails (the old cap stays).
  void set_memory_fraction(double fraction);
  [[nodiscard]] double memory_fraction() const;
  /// Replaces the configuration (keys that act on new requests apply at once).
  /// A new per_process_memory_fraction applies as set_memory_fraction does;
  /// if that throws, the configuration is unchanged.
  void set_config(const allocator_config& config);
  [[nodiscard]] allocator_config config() const;
  /// In no-caching mode every block goes straight to the device and back
  /// (SPEC F6). Turning caching off releases the cache first; if that throws
  /// backend_error, the mode is unchanged.
  void set_caching_enabled(bool enabled);
  [[nodiscard]] bool caching_enabled() const;
  /// Turns this device's thread cache on or off at run time. The
  /// thread cache is on by default: the configuration key
  /// thread_cache:off|small|all sets it when the device is created and at a
  /// set_config that changes the key; when the key is not given,
  /// CCALLOC_THREAD_CACHE (spelled as the key) decides, else `all`. This
  /// call overrides on/off until a configuration that changes the key is
  /// set; it keeps `small` (small-pool blocks only) if that was configured.
  /// Each thread parks up to 4 blocks it freed and gets one back when it
  /// asks for the same bytes on the same stream, without the stream's lock,
  /// only while the block's pool has not changed since the block was handed
  /// out: a hit is the block the pools would have handed out, so addresses
  /// and peaks are those of `off` (docs/perf.md, "The thread cache"). Hits
  /// count in device_stats::num_thread_cache_hits. Turning it off returns
  /// every parked block to its pool first. Thread-safe (locks the whole
  /// device); throws nothing.
  void set_thread_cache_enabled(bool enabled);
  [[nodiscard]] bool thread_cache_enabled() const noexcept;

  [[nodiscard]] device_stats stats() const;
  void reset_accumulated_stats();
  void reset_peak_stats();

  void attach_oom_observer(oom_observer observer);

  /// The expandable segments of this device, by address: per stream and pool,
  /// the bytes mapped now (PyTorch: getExpandableSegmentSizes, SPEC F19).
  /// Locks the whole device.
  [[nodiscard]] std::vector<expandable_segment_info> expandable_segments() const;
  /// Grants device `peer` read/write access to every page mapped in this
  /// device's expandable segments now and to every page mapped later (SPEC
  /// F26; cuMemSetAccess). Plain segments need the backend's peer access
  /// (device_backend::enable_peer_access), which the front end enables.
  /// Granting a peer twice does nothing. Throws invalid_argument_error for
  /// `peer` outside the backend's devices or equal to this device, and
  /// backend_error from the backend (peers granted before stay granted).
  void enable_peer_access(int peer);
  /// Devices granted access by enable_peer_access, in the order granted.
  [[nodiscard]] std::vector<int> peers() const;


  // ---- history (SPEC F14-F16, F18; ccalloc/core/history.hpp) ----------------
  /// Starts, changes or stops recording this device's history (PyTorch:
  /// recordHistory). Throws invalid_argument_error for max_entries == 0.
  void record_history(const history_options& options);
  [[nodiscard]] bool is_history_enabled() const noexcept;
  /// Records an annotation with the current time, if history is enabled
  /// (PyTorch: recordAnnotation).
  void record_annotation(std::vector<std::pair<std::string, std::string>> metadata);
  /// Entries recorded meanwhile carry `context` as compile_context (PyTorch:
  /// pushCompileContext; only while history is enabled, as PyTorch).
  void push_compile_context(std::string context);
  /// Pops the last pushed compile context; nothing if none (PyTorch: popCompileContext).
  void pop_compile_context();
  /// Entries recorded from now on carry `metadata` (PyTorch: setUserMetadata).
  void set_user_metadata(std::string metadata);
  [[nodiscard]] std::string user_metadata() const;
  /// Calls `tracker` with every trace entry from now on (PyTorch:
  /// attachAllocatorTraceTracker). See trace_tracker.
  void attach_trace_tracker(trace_tracker tracker);
  /// Calls `listener` at every change of what this device has mapped from
  /// now on, under the device's locks (SPEC C1; ccalloc/core/mapping_events.hpp
  /// says when, in which order, and what a listener must not do). Changes
  /// made before attaching are not replayed: segments() lists what is
  /// mapped. Throws invalid_argument_error for an empty listener. Thread-safe.
  void attach_mapping_listener(mapping_listener listener);
  /// As attach_mapping_listener(listener), and calls `listed` with
  /// segments() under the same hold of the device's locks: the listener
  /// hears every change after that list and none before it (what a consumer
  /// that keeps a table of the mapped ranges needs). `listed` runs under the
  /// device's locks: it must not call into the allocator. Throws what
  /// `listed` throws (the listener stays attached then).
  void attach_mapping_listener(mapping_listener listener,
                               const std::function<void(const std::vector<segment_info>&)>& listed);
  /// The recorded trace entries, oldest first.
  [[nodiscard]] std::vector<trace_entry> trace_entries() const;
  /// The recorded annotations, oldest first.
  [[nodiscard]] std::vector<annotation_entry> annotations() const;
  /// Records a `snapshot` entry (size = active bytes) if history is enabled
  /// and `record_entry`, then returns segments() with each mapped run of an
  /// expandable segment as a segment of its own; what
  /// caching_allocator::snapshot calls.
  [[nodiscard]] std::vector<segment_info> snapshot_segments(bool record_entry = true);
  /// Records a `snapshot` entry (size = active bytes) if history is enabled.
  void record_snapshot_entry();



  // --- private pools and CUDA graphs (SPEC F20-F24; PyTorch's graph pools) ---
  //
  // A private pool holds its own segments: a block allocated to it returns to
  // it, and nothing else allocates from it (except the default pool's OOM
  // fallback, set_use_on_oom). Blocks stay bound to their stream, as in the
  // default pool. While a pool has users (use count > 0) none of its segments
  // are returned to the device or unmapped, so addresses a captured CUDA graph
  // baked in stay valid; at use count 0 its cached segments are returned by
  // empty_cache and by the out-of-memory path, and the pool disappears once it
  // holds no segment. Capture semantics: while a graph capture runs where the
  // allocator can see it -- a begin_allocate_to_pool is active and a stream
  // that allocated on this device since then is capturing
  // (device_backend::is_capturing, asked at each allocation while a scope is
  // active) -- the allocator neither queries nor waits for events, nor frees
  // or unmaps device memory; the free of a block used on other streams is
  // deferred until the last end_allocate_to_pool (or later, while the backend
  // reports one of its streams as capturing). A scope without a capture
  // (a private pool used as a plain scoped pool) is ordinary allocation: the
  // cache is released and events are waited for as without it (PyTorch's
  // captures_underway treats every scope as a capture: pytorch/pytorch#159674).
  // A capture on a stream that has not allocated through this device since
  // its scope began is not seen. Every function below locks the whole device;
  // all are thread-safe.

  /// Creates the pool `id` with use count 1, or adds 1 to an existing pool's
  /// use count (PyTorch: createOrIncrefPool). `custom` supplies the pool's
  /// segments (see segment_allocator); it is used only when the pool is
  /// created. Throws invalid_argument_error for id {0, 0}, and for a
  /// `custom` with only one of its two functions.
  void create_or_incref_pool(mempool_id_t id, segment_allocator custom = {});
  /// Subtracts 1 from the pool's use count (PyTorch: releasePool). At 0 the
  /// pool takes no new allocations; its cached segments go back at the next
  /// empty_cache or out-of-memory retry, and it is deleted when it holds no
  /// segment (at once if it holds none). Throws invalid_argument_error for a
  /// pool that does not exist or whose use count is already 0 (released
  /// twice); nothing changes then.
  void release_pool(mempool_id_t id);
  /// The pool's use count; 0 for a released or unknown pool (PyTorch:
  /// getPoolUseCount).
  [[nodiscard]] int get_pool_use_count(mempool_id_t id) const;
  /// From now on, allocations on streams `filter` accepts go to pool `id`
  /// (PyTorch: beginAllocateToPool). Calls nest: the most recent begin whose
  /// filter accepts the stream wins. Throws invalid_argument_error for an
  /// unknown or released pool or an empty filter.
  void begin_allocate_to_pool(mempool_id_t id, stream_filter filter);
  /// Ends the most recent begin_allocate_to_pool of `id` (PyTorch:
  /// endAllocateToPool). When no begin remains active, deferred frees are
  /// completed (their events recorded). Throws invalid_argument_error if `id`
  /// is not active; nothing changes then.
  void end_allocate_to_pool(mempool_id_t id);
  /// Lets the default pool take free blocks of pool `id` when it would
  /// otherwise run out of memory (after every other rung; PyTorch:
  /// setUseOnOOM). Such a block stays in pool `id`: its free returns it there.
  /// Throws invalid_argument_error for an unknown pool.
  void set_use_on_oom(mempool_id_t id, bool enabled = true);
  /// Blocks of pool `id` are never split: each allocation takes a whole
  /// cached block or a new segment (PyTorch: setNoSplit). Throws
  /// invalid_argument_error for an unknown pool.
  void set_no_split(mempool_id_t id, bool enabled = true);
  /// True iff the allocated blocks of pool `id` are exactly those at
  /// `expected` (order and duplicates ignored; PyTorch:
  /// checkPoolLiveAllocations). An unknown pool has no allocations.
  [[nodiscard]] bool check_pool_live_allocations(mempool_id_t id, const std::vector<void*>& expected) const;
  /// Bytes and blocks pool `id` holds now; {0, 0} gives the default pool.
  /// Throws invalid_argument_error for an unknown pool.
  [[nodiscard]] pool_usage pool_stats(mempool_id_t id) const;
  /// The private pools of this device, by id.
  [[nodiscard]] std::vector<mempool_id_t> pools() const;

  /// The layout of pool `id` now: its segments and blocks (PyTorch:
  /// getCheckpointState). A block freed but still waiting for events (or a
  /// deferred free) counts as free: `allocated` is what the caller holds.
  /// Changes nothing. Throws invalid_argument_error for an unknown pool.
  [[nodiscard]] pool_checkpoint get_checkpoint_state(mempool_id_t id) const;
  /// Restores pool `state.pool` to `state`'s layout (PyTorch:
  /// setCheckpointPoolState): allocated blocks that are not allocated with the
  /// same address and size in `state` are freed (freed_pointers), and the
  /// blocks allocated in `state` that are not allocated now are created
  /// (blocks_created; requested sizes as in `state`). Blocks allocated in both
  /// are untouched. Waits for pending events first. Throws
  /// invalid_argument_error, changing nothing, when `state` is from another
  /// device, names an unknown pool, or the pool's segments (address, size,
  /// stream, kind) differ from those in `state`, when a begin_allocate_to_pool is active,
  /// or when a block to create lies in an unmapped range.
  checkpoint_restore_result set_checkpoint_pool_state(const pool_checkpoint& state);

  // --- sleep and wake (SPEC S1-S4; tags.hpp) ---------------------------------

  /// Releases the device memory of every block of `tags` (allocated or
  /// cached) while keeping its virtual addresses: waits, stream-ordered, for
  /// the work queued before the call on the streams that own or used the
  /// tags' blocks (an event per stream, never a device synchronization);
  /// with keep_contents, copies the pages under their allocated blocks to
  /// host memory (the backend's host_alloc: pinned on a GPU) first; then
  /// unmaps and releases every page of the tags' reservations (their cached
  /// free memory too). Afterwards the memory is free for other tags and for
  /// other allocators (mem_get_info shows it). Tags already paused are left
  /// as they are (not in the result's tags). Blocks of a paused tag: see
  /// Note [Paused blocks] in src/core/sleep_wake.cpp (malloc refused, free
  /// done at resume, record_stream refused). Throws invalid_argument_error,
  /// changing nothing, for "default", an unknown tag (a name never interned
  /// in this process; a tag forgotten on this device, or that never
  /// allocated here, pauses holding nothing and stays paused until resumed),
  /// a tag holding a plain
  /// segment (a backend without virtual memory), or a graph capture
  /// underway; out_of_memory_error, changing nothing but returning the
  /// tags' cached memory, when the host lacks memory for the contents.
  /// Thread safe: locks the whole device (other threads' mallocs wait).
  sleep_result pause(const std::vector<std::string>& tags, bool keep_contents);
  /// Maps pages again at the paused tags' addresses, restores the kept
  /// contents (work queued on a block's stream after the call sees them;
  /// the call returns once they are copied), and makes the tags usable;
  /// blocks freed while paused are freed then. Where the device or the
  /// memory-fraction cap lacks room, ccalloc's cached memory of active tags
  /// is returned first (empty_cache's rungs); if still short, throws
  /// out_of_memory_error naming the tags, the bytes needed and what holds
  /// the device, after calling the OOM observers; the tags stay paused, so
  /// a later resume may succeed. Tags not paused are left alone; an unknown
  /// tag throws invalid_argument_error. Thread safe as pause.
  sleep_result resume(const std::vector<std::string>& tags);
  /// The tag of a live block (its segment's). Thread safe while the caller
  /// owns the block.
  [[nodiscard]] std::string block_tag(const detail::block* block) const;
  /// The paused tags, in the order of their ids.
  [[nodiscard]] std::vector<std::string> paused_tags() const;
  /// Per tag ("default" first, then every paused tag and every tag that
  /// holds memory here or has not been forgotten yet: a tag that holds
  /// nothing is forgotten once its last segment goes, tags.hpp):
  /// allocated, reserved, paused and kept bytes (tag_usage).
  /// Locks the whole device: O(blocks).
  [[nodiscard]] std::vector<tag_usage> tag_stats() const;

  /// Segments and their blocks, sorted by address, with the contexts that
  /// history recorded. Locks the whole device while it walks: O(blocks).
  [[nodiscard]] std::vector<segment_info> segments() const;
  /// Full structural check (SPEC R2): blocks tile their segments, neighbours
  /// link both ways, no two free neighbours are unmerged, every free block is
  /// in exactly its pool, stats equal a recount. Throws std::logic_error
  /// naming the first violated invariant. O(blocks); for tests.
  void check_invariants() const;

 private:
  // segments(), with the device's locks held by the caller.
  [[nodiscard]] std::vector<segment_info> segments_locked() const;

  int device_;
  std::unique_ptr<detail::device_state> state_;
};

}  // namespace ccalloc

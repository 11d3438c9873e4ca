// The thread cache: each thread parks the blocks it frees, up to
// thread_cache_slots of them per device, and hands one back when the same
// thread asks for the same number of bytes on the same stream. A cached
// alloc+free pair then takes no stream lock, no statistics lock and no
// shared cache line: one uncontended exchange on the thread's own record per
// operation (its lock, so that a thread holding the world lock can take the
// blocks back at any time). On by default (thread_cache:all).
//
//   malloc(size, stream)                       free(block)
//     record of (this thread, device)            bypass: record_stream'd, private pool,
//     slot with (stream, requested size)           no caching, capture underway, or
//     whose pool is unchanged?                     its pool changed (Placement)
//       yes: hand it out (no pool, no             a free slot? park it
//            statistics lock)                     else: free this thread's parked
//       no (or events pending, or a capture):          blocks, then the normal free
//            free every parked block of this
//            thread, then the normal malloc
//
// Placement: a hit hands out exactly the block the pools would. A block
// handed out by allocate's best fit (rung 1) records its pool index's
// version (block::reuse_version; the index changes it at every insert,
// erase and rekey, a world lock at every acquisition). While the version is
// unchanged, freeing the block would merge it back into the very free block
// it was split from, and a malloc of the same size would split the same
// piece off again: the pair is the identity, so the cache elides it. A
// block is parked only if its version still holds, and handed out only if
// it still holds then; every other free and malloc first returns the
// thread's parked blocks to the pools, in the program's order. Blocks from
// the slow path (a new segment, mapped pages) prove nothing and are never
// parked; nor is a block whose free would record a page fence, nor any
// block while garbage collection counts the pools' searches. So in one
// thread the addresses handed out are the same with the cache on and off
// (tests: TheLayoutIsTheSameOnAndOff; on the shared traces every replay
// figure is, docs/perf.md), with one exception, where expandable segments
// recycle pages across streams: the elided free does not number itself for
// the page fences (block::free_seq), so the free block a hit leaves beside
// the reused one keeps the count of its own last free, where the pools
// would have given it the elided free's. Its pages may then pass to another
// stream sooner than with the cache off, and page-recycling figures
// (pages remapped, waits in empty_cache) can differ. That is safe: the
// reused block's work never touched those pages, and their own last use is
// what the older count's fence covers (test
// PagesNextToAReusedBlockMoveOnlyWhenTheirWorkIsDone). Numbering exactly
// needs the stream's lock at every park: measured on the H200, pairs went
// from 56-57 ns to 72-80 ns (2026-12-01), so the cache does not.
//
// Statistics: a parked block still counts as allocated; it is freed for
// the pools and the statistics (release_allocation, the normal free) when it
// leaves the cache without being handed out again: at this thread's next
// malloc on the device that it does not serve (before anything else of that
// malloc) or free it does not park, and at every world lock (the slow path,
// statistics reads, inspection, empty_cache, configuration), which returns
// every thread's parked blocks first. A hit (the same block freed and handed
// out again) changes no current value: it only adds to the allocated and
// freed counts (those of inactive_split too: the free's merge and the
// malloc's split), kept in the record (thread_cache_hits) and added by the
// world lock, and to num_thread_cache_hits. So every current, allocated and
// freed value is exact at every read; in one thread so is every peak but
// that of inactive_split(_bytes), which can miss the instant between an
// elided free and its malloc (a parked block is gone before this thread's
// next allocation can raise one); with threads allocating concurrently a
// peak may include blocks that another thread has freed into its cache and
// not yet reused (at most thread_cache_slots per thread and device).
// Inspection (segments, snapshots, invariants) never sees a parked block;
// the slow path and the out-of-memory ladder see all cached memory. A thread
// that exits leaves its parked blocks to the device (orphans), freed by the
// next world lock. Parked memory stays reserved (in its segment).
//
// Lock order: world (registry, streams, device, stats) -> thread_cache_core::mutex
// -> thread_cache_record::lock. The owner takes only its record lock on the
// fast path and never holds it while taking another lock.
#pragma once

#include <ccalloc/base/detail/hot_tls.hpp>
#include <ccalloc/base/detail/spin_mutex.hpp>
#include <ccalloc/base/types.hpp>
#include <ccalloc/core/config.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace ccalloc::detail {

struct block;
class device_state;
class world_lock;

inline constexpr std::size_t thread_cache_slots = 4;

struct thread_cache_core;

// Blocks handed out again from a cache, per pool kind (0 small, 1 large):
// each counts as one free and one allocation (accumulated counts only).
struct thread_cache_hits {
  std::array<std::int64_t, 2> blocks{};
  std::array<std::int64_t, 2> bytes{};
  std::array<std::int64_t, 2> requested_bytes{};
  std::array<std::int64_t, 2> split_blocks{};  // inactive_split: the free undoes, the malloc redoes
  std::array<std::int64_t, 2> split_bytes{};   // inactive_split_bytes: likewise
  std::int64_t oversize = 0;
  bool any = false;
};

// One thread's cache for one device. Owned by the thread (thread_cache.cpp);
// listed in the device's core while both live.
struct thread_cache_record {
  struct slot {
    block* b = nullptr;
    stream_t stream = 0;        // the block's pool's stream
    std::size_t requested = 0;  // the caller's bytes when it was handed out
  };
  yield_lock lock;
  std::uint64_t device_id = 0;  // device_state::id_
  std::shared_ptr<thread_cache_core> core;
  std::atomic<std::uint32_t> count{0};  // parked blocks [lock]; read without it as a hint
  std::array<slot, thread_cache_slots> slots{};  // [lock]
  thread_cache_hits hits;  // [lock] not yet in the device's statistics
  // The owner thread's alone (no lock): mallocs in a row that found parked
  // blocks but none that fit, and a counter of frees while that streak is
  // long. A thread whose frees are not reused (sizes that keep changing)
  // parks only one free in thread_cache_probe_every, so it pays almost
  // nothing for the cache; one hit starts parking every free again.
  std::uint32_t miss_streak = 0;
  std::uint32_t probe = 0;
};

inline constexpr std::uint32_t thread_cache_miss_limit = 16;
inline constexpr std::uint32_t thread_cache_probe_every = 64;

// What a device shares with the threads' records: outlives whichever goes last.
struct thread_cache_core {
  std::mutex mutex;
  bool alive = true;                          // false once the device is gone [mutex]
  std::vector<thread_cache_record*> records;  // of live threads [mutex]
  std::vector<block*> orphans;                // parked by threads that exited [mutex]
  thread_cache_hits orphan_hits;              // theirs [mutex]
};

// device_state's member. CCALLOC_THREAD_CACHE (read when the device is
// created; parse_thread_cache_mode): all/True/true/1 (the default, also when
// unset): every block; small: small-pool blocks only (<= 1 MiB requests);
// off/False/false/0: off. Another value warns and leaves the default.
class thread_cache_registry {
 public:
  thread_cache_registry();
  ~thread_cache_registry();  // detaches the records (the device is going)
  thread_cache_registry(const thread_cache_registry&) = delete;
  thread_cache_registry& operator=(const thread_cache_registry&) = delete;

  // The thread_cache key, when given (config.thread_cache_set), switches
  // the cache (enabled, small_only); otherwise it stays as
  // CCALLOC_THREAD_CACHE or set_thread_cache_enabled left it. [world, or
  // the device's constructor]
  void apply_setting(const allocator_config& config) noexcept;

  // Whether threads park blocks; read on every malloc and free without a
  // lock (relaxed); set under the world lock (set_thread_cache_enabled).
  [[nodiscard]] bool enabled() const noexcept { return enabled_.load(std::memory_order_relaxed); }
  void set_enabled(bool on) noexcept { enabled_.store(on, std::memory_order_relaxed); }
  // Only small-pool blocks are parked (thread_cache:small); read by park. [none]
  [[nodiscard]] bool small_only() const noexcept { return small_only_.load(std::memory_order_relaxed); }
  // What the threads' records share with the device (outlives whichever goes last).
  [[nodiscard]] const std::shared_ptr<thread_cache_core>& core() const noexcept { return core_; }

 private:
  std::atomic<bool> enabled_{true};
  std::atomic<bool> small_only_{false};
  std::shared_ptr<thread_cache_core> core_ = std::make_shared<thread_cache_core>();
};

// The calling thread's record for the device last used (nullptr at first).
CCALLOC_HOT_TLS constinit inline thread_local thread_cache_record* tls_last_record = nullptr;

// This thread's record of `d`; creates it when `create` (and the cache is on).
thread_cache_record* thread_cache_find(device_state& d, bool create);
// Frees this thread's parked blocks of `d` (the normal free's stream locks
// and statistics).
void thread_cache_drain_own(device_state& d, thread_cache_record& r);
// [world] Frees every thread's parked blocks and adds their hits to the
// device's statistics (world_lock's constructor).
void drain_thread_caches(device_state& d, const world_lock& w) noexcept;

}  // namespace ccalloc::detail

// ccalloc/core/stats.hpp: allocator statistics with PyTorch's names.
//
// Each counter is a `stat` kept for three groups (stat_group): all blocks,
// the small pool and the large pool, like torch.cuda.memory_stats(). to_map()
// flattens them to PyTorch's key names, e.g. "allocated_bytes.all.peak",
// "reserved_bytes.large_pool.current", "num_alloc_retries".
//
// Exactness: every value is exact whenever allocations do not run
// concurrently (one thread, any number of streams): each operation publishes
// its changes at once, so peaks are the peaks of the device-wide sums, as in
// PyTorch. When threads allocate concurrently on different streams, a stream
// whose thread finds the statistics busy keeps its changes and publishes them
// with a later operation (at most 64 operations later, or at the next read);
// current, allocated and freed values are still exact at every read, while a
// peak then adds a stream's highest point since its last publication to the
// device's value at that publication: an estimate of the peak of the sum,
// which concurrent operations do not define exactly anyway. This is what
// lets threads on different streams avoid sharing a lock (SPEC X1); PyTorch
// serializes all of them on one mutex instead.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>

namespace ccalloc {

/// One counter: current value, its peak since the last reset_peak(), and the
/// accumulated increases (allocated) and decreases (freed). Invariant:
/// current = allocated - freed (until reset_accumulated()).
struct stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void increase(std::int64_t amount) noexcept {
    current += amount;
    allocated += amount;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t amount) noexcept {
    current -= amount;
    freed += amount;
  }
  void reset_accumulated() noexcept { allocated = freed = 0; }
  void reset_peak() noexcept { peak = current; }
};

enum class stat_group : std::uint8_t { all = 0, small_pool = 1, large_pool = 2 };
inline constexpr std::size_t stat_group_count = 3;
using stat_array = std::array<stat, stat_group_count>;

/// Statistics of one device (PyTorch's DeviceStats). Units: *_bytes in bytes,
/// the others are counts.
struct device_stats {
  stat_array allocation;            ///< blocks handed to callers
  stat_array segment;               ///< segments obtained from the device
  stat_array active;                ///< allocated blocks + blocks waiting on events
  stat_array inactive_split;        ///< free blocks inside split segments
  stat_array allocated_bytes;       ///< rounded sizes of allocated blocks
  stat_array reserved_bytes;        ///< sizes of segments
  stat_array active_bytes;
  stat_array inactive_split_bytes;
  stat_array requested_bytes;       ///< unrounded sizes callers asked for, until the free completes

  std::int64_t num_alloc_retries = 0;   ///< device mallocs retried after freeing the cache
  std::int64_t num_ooms = 0;            ///< out-of-memory errors thrown
  std::int64_t num_sync_all_streams = 0;///< times all pending events were synchronized
  std::int64_t num_device_alloc = 0;    ///< segment mallocs
  std::int64_t num_device_free = 0;     ///< segment frees
  /// Times the allocator blocked the host on the device before memory
  /// changed hands (ccalloc's own): a device-wide synchronize (emptyCache's
  /// unmapping when a stream refuses an event, or moving memory of such a
  /// stream), or a wait for a page fence (an event recorded on the stream
  /// that last used free pages) because the alternative was out of memory,
  /// passing the memory fraction cap, or emptyCache. Recycling for a new
  /// peak never waits: pages whose fence has not completed stay put.
  /// Not counted here: a segment free (cudaFree) itself waits for the
  /// device (CUDA's implicit synchronization); those count in
  /// num_device_free (with plain segments, trim_on_new_peak returns unused
  /// cached segments before a new peak: one each).
  std::int64_t num_device_synchronizations = 0;
  /// Pages of expandable segments unmapped at one place and mapped at
  /// another instead of raising reserved memory (X3). ccalloc's own.
  std::int64_t num_pages_remapped = 0;
  /// Pages (the device's granularity) mapped / unmapped in expandable
  /// segments, remapped ones included. ccalloc's own.
  std::int64_t num_pages_mapped = 0;
  std::int64_t num_pages_unmapped = 0;
  /// Bytes that changed stream: pages unmapped from one stream's segment and
  /// mapped into another's, and cached segments adopted by another stream
  /// (X2). ccalloc's own.
  std::int64_t bytes_moved_between_streams = 0;
  /// Device-side waits the allocator queued (cudaStreamWaitEvent): a
  /// stream made to wait for another stream's page fence so that the pages
  /// of a free block of that stream could move to it at once
  /// (reuse_with_stream_wait). The host never waits for these; they are not
  /// in num_device_synchronizations. ccalloc's own.
  std::int64_t num_stream_waits = 0;
  /// Allocations a thread cache served: a free and the next malloc of the
  /// same bytes on the same stream, in one thread, that never reached the
  /// pools (the block is the one the pools would have handed out). Each
  /// also counts in allocation, active and the byte statistics' allocated
  /// and freed. ccalloc's own.
  std::int64_t num_thread_cache_hits = 0;
  stat oversize_allocations;            ///< allocations of blocks >= max_split_size
  stat oversize_segments;               ///< segments >= max_split_size
  std::int64_t max_split_size = -1;     ///< bytes; -1 when unlimited (as PyTorch reports it)

  /// Adds `amount` to `stat_array[all]` and `[group]` of statistics as read
  /// (what stats() returns; the allocator keeps its own counters in a form
  /// that writes less, src/core/detail/stat_storage.hpp, and returns them
  /// in this one). Not thread-safe (plain integers).
  static void increase(stat_array& s, stat_group group, std::int64_t amount) noexcept {
    s[0].increase(amount);
    s[static_cast<std::size_t>(group)].increase(amount);
  }
  /// Takes `amount` from `stat_array[all]` and `[group]` (adds it to freed).
  static void decrease(stat_array& s, stat_group group, std::int64_t amount) noexcept {
    s[0].decrease(amount);
    s[static_cast<std::size_t>(group)].decrease(amount);
  }

  void reset_accumulated() noexcept;
  void reset_peak() noexcept;
  /// Flat map with torch.cuda.memory_stats() key names.
  [[nodiscard]] std::map<std::string, std::int64_t> to_map() const;
};

}  // namespace ccalloc

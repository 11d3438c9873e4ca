// Private data structures of the device caching allocator. Only
// src/core/device_caching_allocator.cpp uses them.
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
//   stats.reserved_bytes.all.current  = sum of segment sizes
//   stats.allocated_bytes.all.current = sum of sizes of allocated blocks
//   stats.active_bytes.all.current    = allocated + sizes of blocks waiting on events
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/base/detail/spin_mutex.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/stats.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ccalloc::detail {

// Sizes of PyTorch's allocator (B1, B2).
inline constexpr std::size_t min_block_bytes = 512;        // rounding unit and smallest block
inline constexpr std::size_t small_request_bytes = 1 * mib;  // largest small-pool request
inline constexpr std::size_t small_segment_bytes = 2 * mib;  // small-pool segment size
inline constexpr std::size_t min_large_alloc_bytes = 10 * mib;  // below: large_segment_size segments
inline constexpr std::size_t large_round_bytes = 2 * mib;    // larger segments round to this

struct block_pool;
struct segment;

struct block {
  std::uintptr_t ptr = 0;
  std::size_t size = 0;             // bytes, multiple of 512
  std::size_t requested_size = 0;   // caller's bytes while active, else 0
  stream_t stream = 0;              // the stream it was allocated on (the segment's)
  block_pool* pool = nullptr;
  segment* seg = nullptr;
  block* prev = nullptr;            // neighbour at lower address in the segment
  block* next = nullptr;            // neighbour at higher address
  bool allocated = false;
  int event_count = 0;              // events still to complete before reuse
  std::uint64_t gc_count_base = 0;  // pool's get-free-block count when cached
  std::vector<stream_t> stream_uses;  // other streams that used it (record_stream)

  [[nodiscard]] bool is_split() const noexcept { return prev != nullptr || next != nullptr; }
};

struct segment {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  block* head = nullptr;  // block at `base`
};

// The free blocks of one (stream, pool), sorted by (size, address): a flat
// sorted array of {size, ptr, block} entries. Best fit is a binary search
// that touches no block; insert and erase shift the tail. Pools hold tens to
// a few thousand free blocks, where this beats a node-based tree (no node
// allocation, one cache line per few entries). The order is PyTorch's
// (BlockComparatorSize), so the same block is chosen.
class block_index {
 public:
  struct entry {
    std::size_t size;
    std::uintptr_t ptr;
    block* b;
  };

  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  [[nodiscard]] bool empty() const noexcept { return entries_.empty(); }
  [[nodiscard]] block* at(std::size_t i) const noexcept { return entries_[i].b; }
  [[nodiscard]] block* largest() const noexcept { return entries_.empty() ? nullptr : entries_.back().b; }
  /// Index of the first block with (size, ptr) >= (size_bytes, ptr); size() if none.
  [[nodiscard]] std::size_t lower_bound(std::size_t size_bytes, std::uintptr_t ptr = 0) const noexcept {
    std::size_t lo = 0, n = entries_.size();
    while (n > 0) {  // branch-light binary search
      const std::size_t half = n / 2;
      const entry& e = entries_[lo + half];
      const bool less = e.size < size_bytes || (e.size == size_bytes && e.ptr < ptr);
      lo = less ? lo + half + 1 : lo;
      n = less ? n - half - 1 : half;
    }
    return lo;
  }
  void insert(block* b);
  void erase_at(std::size_t i) { entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(i)); }
  void erase(const block* b);
  [[nodiscard]] bool contains(const block* b) const noexcept;

 private:
  std::vector<entry> entries_;
};

struct block_pool {
  explicit block_pool(bool small) : is_small(small) {}
  block_index blocks;
  bool is_small;
  std::uint64_t get_free_blocks_call_count = 0;  // age clock for garbage collection

  [[nodiscard]] std::uint64_t age(const block* b) const noexcept {
    return get_free_blocks_call_count - b->gc_count_base;
  }
};

// The two pools of one stream.
struct stream_pools {
  block_pool small{true};
  block_pool large{false};
};

// A request in flight through the fallback ladder.
struct alloc_params {
  std::size_t requested_bytes = 0;  // caller's size
  std::size_t size = 0;             // rounded block size
  std::size_t alloc_size = 0;       // segment size if a new segment is needed
  stream_t stream = 0;
  block_pool* pool = nullptr;
  block* found = nullptr;
};

class device_state {
 public:
  device_state(int device, device_backend& backend, allocator_config config);

  // --- the allocation ladder (mutex_ held) -----------------------------------
  block* allocate(std::size_t requested_bytes, stream_t stream, std::unique_lock<spin_mutex>& lock);
  void free(block* b);
  stream_pools& pools_for(stream_t stream);
  block_pool& pool_for(std::size_t size, stream_t stream);
  [[nodiscard]] std::size_t round_size(std::size_t size) const noexcept;
  [[nodiscard]] std::size_t allocation_size(std::size_t size) const noexcept;
  bool get_free_block(alloc_params& p);
  bool alloc_segment(alloc_params& p, bool is_retry, std::unique_lock<spin_mutex>& lock);
  bool release_available_cached_blocks(const alloc_params& p);
  bool release_cached_blocks();
  void release_blocks(block_pool& pool);
  void release_unused_segments();
  void release_block(block* b);
  void garbage_collect_cached_blocks();
  block* take_found_block(alloc_params& p);
  [[nodiscard]] bool should_split(const block* b, std::size_t size) const noexcept;
  void free_block(block* b);
  std::size_t try_merge(block* dst, block* src);
  void insert_events(block* b);
  void process_events();
  void synchronize_and_free_events();
  event_t get_event();
  [[noreturn]] void throw_out_of_memory(const alloc_params& p, std::unique_lock<spin_mutex>& lock);
  void set_memory_fraction(double fraction);
  [[nodiscard]] stat_group group_of(const block_pool* pool) const noexcept {
    return pool->is_small ? stat_group::small_pool : stat_group::large_pool;
  }

  spin_mutex mutex_;
  int device_;
  device_backend& backend_;
  allocator_config config_;
  bool caching_ = true;
  bool set_fraction_ = false;
  double fraction_ = 1.0;
  std::size_t allowed_bytes_ = 0;  // fraction x total when set_fraction_, else device total
  std::size_t device_total_bytes_ = 0;
  // Highest reserved bytes ever (unlike stats_ peaks, reset_peak_stats keeps it).
  std::size_t reserved_high_water_bytes_ = 0;

  std::unordered_map<stream_t, std::unique_ptr<stream_pools>> pools_;
  stream_t last_stream_ = 0;
  stream_pools* last_pools_ = nullptr;

  std::map<std::uintptr_t, std::unique_ptr<segment>> segments_;  // by base address
  // Events recorded at free time, per stream that used the block, in order.
  std::unordered_map<stream_t, std::deque<std::pair<event_t, block*>>> pending_events_;
  std::vector<event_t> free_events_;  // event pool: created and reusable
  device_stats stats_;
  std::vector<oom_observer> observers_;
  std::vector<block*> spare_blocks_;  // recycled block objects (no heap call per split)

  block* new_block() {
    if (spare_blocks_.empty()) return new block;
    block* b = spare_blocks_.back();
    spare_blocks_.pop_back();
    return b;
  }
  void delete_block(block* b) {
    *b = block{};
    spare_blocks_.push_back(b);
  }
  ~device_state() {
    for (block* b : spare_blocks_) delete b;
  }
  device_state(const device_state&) = delete;
  device_state& operator=(const device_state&) = delete;
};

}  // namespace ccalloc::detail

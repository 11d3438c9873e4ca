// The placement policy of one device: its configuration (allocator_config,
// and whether caching is on) and the rules of the hot path over it: how a
// request is rounded and which pool and segment size it gets (B1, B2), when
// a free block is split or may serve an oversize request (B3), where in a
// free block of an expandable segment a block is carved, and which free
// neighbours merge. Owns the configuration; held by value in device_state,
// so the hot path reads it at a fixed offset, as before. Read under a
// stream lock (caching() also without one, relaxed); changed only under the
// world lock (set_config, set_caching). Definitions: hot_path.cpp (the hot
// path inlines them) and placement_policy.cpp (the page rules).
#pragma once

#include <ccalloc/core/config.hpp>
#include "block.hpp"
#include "block_index.hpp"
#include "pools.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>

namespace ccalloc::detail {

class placement_policy {
 public:
  explicit placement_policy(allocator_config config) : config_(std::move(config)) {}
  placement_policy(const placement_policy&) = delete;
  placement_policy& operator=(const placement_policy&) = delete;

  [[nodiscard]] const allocator_config& config() const noexcept { return config_; }
  void set_config(const allocator_config& config) { config_ = config; }  // [world]
  // Whether blocks are cached (F6: off, every free goes back to the
  // device). Also read without a lock (the thread cache's park).
  [[nodiscard]] bool caching() const noexcept { return caching_.load(std::memory_order_relaxed); }
  void set_caching(bool enabled) noexcept { caching_.store(enabled); }  // [world]

  [[nodiscard]] std::size_t round_size(std::size_t size) const noexcept;       // [stream]
  [[nodiscard]] std::size_t allocation_size(std::size_t size) const noexcept;  // [stream]
  void prepare(alloc_params& p, std::size_t requested_bytes, stream_state& ss) const noexcept;  // [stream]
  // prepare without p.alloc_size, which only the slow path reads (rung 1 of
  // the hot path; the slow path prepares again). [stream]
  void prepare_search(alloc_params& p, std::size_t requested_bytes, stream_state& ss) const noexcept;
  // Whether free records a page fence on b's stream before freeing b (a
  // block used on no other stream; fence_before_free), so that the pages the
  // free leaves whole can pass to another stream, without waiting, once the
  // stream's work up to the free has completed. Only while no fence of the
  // stream is outstanding: one per stream between two polls of its fences
  // (the slow path polls them), not one per free. And only where no other
  // fence would cover the free: b is its expandable segment's last busy
  // block (the stream stopped using it: a short-lived side stream, a stream
  // between bursts; it may be destroyed next), or b spans a page, while
  // more than one stream allocates, on a stream other than the legacy
  // default stream (which any slow path may record on, can_record_on): the
  // stream keeps other blocks, and another stream's slow path never records
  // on it, so without this its freed pages stayed with it for as long as it
  // kept a block, and the others grew instead (on the H200, a
  // stream holding weights gave no page away). A stream alone has its frees
  // fenced by its own slow path, where its pages are wanted. [stream]
  [[nodiscard]] static bool free_records_fence(const block* b, const stream_state& ss) noexcept {
    // The rare cases first: one stream, or blocks in use beside b, end it.
    return b->seg->expandable &&
           (b->seg->busy_blocks == 1 || b->size >= ss.fence_free_bytes) &&
           ss.fences.empty();
  }
  [[nodiscard]] bool should_split(const block* b, std::size_t size) const noexcept;  // [stream]
  // B3's oversize rules: whether a request of `size` bytes may take a free
  // block of `block_size` >= size bytes (a small request never takes an
  // oversize block; an oversize request one at most max_non_split_rounding
  // larger). Walking a pool upwards, a false answer holds for every larger
  // block too.
  [[nodiscard]] bool oversize_rules_allow(std::size_t size, std::size_t block_size) const noexcept {
    const std::size_t max_split = config_.max_split_size_bytes;
    if (size < max_split) return block_size < max_split;
    return block_size - size < config_.max_non_split_rounding_bytes;
  }
  // Whether free pages are recycled at every new peak (the default:
  // trim_on_new_peak, recycles_per_peak unlimited), where expandable
  // segments place blocks to free whole pages (page_sliver, lowest_fitting_block).
  [[nodiscard]] bool recycles_at_every_peak() const noexcept {
    return config_.trim_on_new_peak && config_.recycles_per_peak == std::numeric_limits<std::size_t>::max();
  }
  [[nodiscard]] bool place_at_back(const block* b) const noexcept;            // [stream]
  // Where in free block b a block of `size` bytes (page_sliver of an
  // expandable segment's page) starts (placement_policy.cpp). [stream]
  [[nodiscard]] static std::uintptr_t page_aligned_start(const block& b, std::size_t size, bool back) noexcept;
  // find_free_block's best fit `at` for p, a free island of an expandable
  // segment's large pool: the fitting free block at the lowest address
  // instead, where free pages are recycled at every new peak
  // (placement_policy.cpp). [stream]
  [[nodiscard]] block_index::position lowest_fitting_block(const alloc_params& p,
                                                           block_index::position at) const noexcept;
  [[nodiscard]] static bool can_merge(const block* dst, const block* src) noexcept;  // [stream]

 private:
  allocator_config config_;
  std::atomic<bool> caching_{true};
};

}  // namespace ccalloc::detail

// The segments of one device, by base address, and their way back to the
// device: a new segment on the books (add_segment), the books of one the
// device took back (forget_segment), the releases of cached whole segments
// (the fallback ladder's rungs 2, 4 and 5, emptyCache, no-caching frees)
// and the teardown. Owns the segment map (each segment with its blocks)
// and the first failure of a release that went on past it (keep_going).
// Reaches the pools, statistics, reserved bytes, pages, history and mapping
// listeners through device_state (a release changes all of them).
// Guarded by device_mutex_: the map changes under the world lock, or under
// a block's stream lock and the device lock (the methods say which);
// reading it whole (begin/end, map) needs the world lock.
#pragma once

#include "block.hpp"
#include "pools.hpp"
#include "run_placement.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <utility>

namespace ccalloc::detail {

class device_state;
class world_lock;
struct stream_state;

class segment_table {
 public:
  explicit segment_table(device_state& d) noexcept : d_(d) {}
  segment_table(const segment_table&) = delete;
  segment_table& operator=(const segment_table&) = delete;

  // ---- reading ----------------------------------------------------------------------
  // Every segment in address order (range-for yields base, owning pointer). [world]
  [[nodiscard]] segment_map::const_iterator begin() const noexcept { return segments_.begin(); }
  [[nodiscard]] segment_map::const_iterator end() const noexcept { return segments_.end(); }
  [[nodiscard]] std::size_t size() const noexcept { return segments_.size(); }
  // The map itself, read-only, for the run placement searches (run_placement.hpp). [world]
  [[nodiscard]] const segment_map& map() const noexcept { return segments_; }
  // The segment whose range holds `address`, or nullptr. [world]
  [[nodiscard]] segment* containing(std::uintptr_t address) const noexcept;

  // ---- the books --------------------------------------------------------------------
  // A new segment `seg` [base, base + size) of p's stream and pool, as one
  // free block, on the books (segment count, its private pool's count).
  // Throws std::bad_alloc (host memory) with nothing changed. [world]
  segment& add_segment(const alloc_params& p, std::unique_ptr<segment> seg, std::uintptr_t base,
                       std::size_t size);
  // Takes a segment (a reservation whose blocks went already) off the map:
  // by iterator (returns the next) or by base. [world]
  segment_map::const_iterator erase(segment_map::const_iterator it) noexcept { return segments_.erase(it); }
  void erase(std::uintptr_t base) noexcept { segments_.erase(base); }
  // What the failed request p made (device_memory::take_made) goes back to
  // the device, off the books; device errors ignored. [world]
  void discard_made_segment(const alloc_params& p) noexcept;
  // The books of a segment the device has taken back; `b` is its only block. [stream, device]
  void forget_segment(block* b, device_stats& st) noexcept;

  // ---- releases ---------------------------------------------------------------------
  // Rung 4 (max_split_size): free cached oversize blocks that cover p. [world]
  bool release_available_cached_blocks(const alloc_params& p);
  // Rung 5 and emptyCache: wait for every pending event, then return every
  // cached whole segment and free page. for_retry: a segment whose free
  // throws stays cached and the others go on (an allocation retrying must
  // not fail on another pool's segment), the first such error kept for
  // take_release_failure; else the first such error is thrown. [world]
  bool release_cached_blocks(const world_lock& w, bool for_retry = false);
  void release_unused_segments(const world_lock& w, bool keep_going = false);  // [world]
  void release_blocks(block_pool& pool, bool keep_going = false);             // [world]
  // A cached whole-segment block back to the device; nothing changes if the
  // device refuses (throws). [stream, device]
  void release_block(block* b, device_stats& st);
  // A plain segment's memory back to its pool's custom allocator or the
  // backend; _announced: told to the mapping listeners (unmapped before,
  // mapped again if the device refuses). [stream, device] or [world]
  void release_segment_memory(segment& seg);
  void release_segment_memory_announced(segment& seg);
  // No-caching mode (F6): whole-segment block b goes back before anything
  // else changes. [stream] takes device
  void free_uncached(block* b, stream_state& ss);
  // Rung 2 (B5): above the garbage-collection threshold, old cached memory. [world]
  void garbage_collect_cached_blocks(const world_lock& w);
  // The first failure release_blocks went on past (null: none), cleared. [world]
  std::exception_ptr take_release_failure() noexcept { return std::exchange(release_failure_, nullptr); }
  // Every segment back to the device, every block deleted (the device's
  // teardown; device errors ignored). [none]: nothing else runs
  void release_all() noexcept;

 private:
  device_state& d_;
  segment_map segments_;  // by base address
  std::exception_ptr release_failure_;
};

}  // namespace ccalloc::detail

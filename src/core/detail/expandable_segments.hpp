// Expandable segments (SPEC B7, X3) of one device: address-space
// reservations whose pages are mapped on demand, page recycling (unmapping
// free pages to map their handles elsewhere or give them back) and deferred
// unmaps. Owns the page size, the count of retired pages, the peers granted
// access to the mappings and the segment sequence numbers; reaches the
// device's segments, pools, statistics and reserved bytes through
// device_state's members (it is the device's page layer, and moves
// blocks between its pools and pages between its segments). Every method
// needs the world lock unless noted. The picture and the invariants of a
// reservation: device_state.hpp; the page states: page_table.hpp.
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/core/config.hpp>
#include "block.hpp"
#include "block_index.hpp"
#include "pools.hpp"
#include "recycle_budget.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

namespace ccalloc::detail {

class device_state;
class world_lock;
struct stream_state;

class expandable_segments {
 public:
  // Reads the backend's granularity: construct after device_state's backend_.
  explicit expandable_segments(device_state& d);
  expandable_segments(const expandable_segments&) = delete;
  expandable_segments& operator=(const expandable_segments&) = delete;

  // The backend's granularity when it has virtual memory, else 0. Fixed.
  [[nodiscard]] std::size_t page_bytes() const noexcept { return page_bytes_; }
  // Throws config_error for an explicit expandable_segments:True without
  // virtual memory. [none]: the page size is fixed
  void check_supported(const allocator_config& config) const;
  // Whether an expandable attempt since clear_no_address_space found no
  // address space (the ladder's rung then stops retrying).
  [[nodiscard]] bool no_address_space() const noexcept { return no_address_space_; }
  void clear_no_address_space() noexcept { no_address_space_ = false; }
  // The ladder gives a plain segment for want of address space: says so on
  // stderr, once per device.
  void warn_plain_fallback(std::size_t size) noexcept;
  // The reservations (expandable segments) by base address, a subset of the
  // device's segments: the walks that concern only reservations read this,
  // so that plain segments (after the address space ran out, thousands of
  // them) cost those walks nothing.
  using reservation_map = std::map<std::uintptr_t, segment*>;
  [[nodiscard]] const reservation_map& reservations() const noexcept { return reservations_; }
  // Retired pages of every segment (deferred unmaps).
  [[nodiscard]] std::size_t retired_pages() const noexcept { return retired_pages_; }
  // Devices granted access to the mappings (F26), in the order added;
  // add_peer appends one (enable_peer_access maps the pages for it first).
  [[nodiscard]] const std::vector<int>& peers() const noexcept { return peers_; }
  void add_peer(int peer) { peers_.push_back(peer); }

  // A block for p in the stream's reservation (its missing pages mapped),
  // recycling free pages first where reserved memory would pass its
  // high-water mark or the cap. False: not served (p.err says why).
  bool alloc_expandable(alloc_params& p, bool is_retry, world_lock& w);
  // Cross-stream reuse of whole reservations.
  bool idle_reservation(segment& seg, const alloc_params& p);
  void adopt_reservation(segment& seg, const alloc_params& p);
  // Which reservations release_empty_expandable_segments releases.
  enum class empty_of : std::uint8_t {
    any,           // every one
    tags,          // those of tags' own pools (a tagged request's slow path: a tag per
                   // request leaves one empty reservation each, once page recycling
                   // moved its cached page on)
    gone_streams,  // those of gone streams (release_gone_empty_reservations)
  };
  // Releases the reservations (of `which`) with no page mapped, no block but
  // one, not paused and no retired page, in address order. Reads only the
  // reservations noted by note_maybe_empty (each one whose last page went,
  // and each one made or resumed), so its cost does not grow with the
  // reservations that hold pages. Throws the device's error: the
  // reservations not released yet stay noted.
  void release_empty_expandable_segments(empty_of which = empty_of::any);
  // seg (a reservation) has no page mapped now, or was made or resumed.
  // Never allocates: room is made when the reservation is made.
  void note_maybe_empty(segment& seg) noexcept;
  // A gone stream may hold a reservation with no page mapped (the stream
  // was just marked gone, or such a reservation lost its last page). [any]
  void note_gone_empty() noexcept { gone_empty_.store(true, std::memory_order_relaxed); }
  // Releases, once note_gone_empty was called, the reservations of gone
  // streams with no page mapped, no block but one, not paused and no retired
  // page: another stream that adopts one gains no mapped page, and kept it
  // would keep its stream's state for ever (a thread's per-thread stream
  // whose blocks another thread frees after it exited, each reservation's
  // pages recycled by newer streams). Reads only the reservations noted by
  // note_maybe_empty. A device error leaves the rest for a later call. [world]
  void release_gone_empty_reservations() noexcept;
  // The cached memory of gone stream `ss`'s reservations back to the
  // device, and each reservation left empty (no other stream may adopt
  // them: stream_registry::release_gone_caches). Throws the device's error.
  void release_stream_reservations(const stream_state& ss);

  segment* new_expandable_segment(const alloc_params& p);
  void discard_reservation(segment& seg) noexcept;
  // Mapped page i of seg back to the device and off the books; a refused
  // unmap retires it instead (retire_refused_page), still reserved.
  void give_back_page(segment& seg, std::size_t i) noexcept;
  void pool_insert_counted(block* b);
  void pool_erase_counted(block* b);
  // hint: a block of seg at or below lo (the walk to lo starts there), or
  // nullptr: the nearest unmapped block at or below lo (seg.unmapped).
  void set_page_state(segment& seg, std::uintptr_t lo, std::uintptr_t hi, bool mapped, block* hint = nullptr,
                      bool reserve_only = false);
  [[nodiscard]] static block* unmapped_block_at_or_below(const segment& seg, std::uintptr_t addr) noexcept;
  // A page taken off one place to be mapped at another, with the stream
  // whose segment it left (bytes_moved_between_streams).
  struct recycled_page {
    physical_handle_t handle;
    stream_t from;
  };
  // may_wait: when the free pages whose fences have not completed are needed
  // (out of memory, the cap, emptyCache), wait for those fences (counted in
  // num_device_synchronizations); else leave those pages where they are.
  // same_stream (with recycled): the stream_state of the request the pages
  // go to; a free block of it whose fence has not completed gives its
  // pages anyway, their old mapping retired (a deferred unmap): the stream
  // runs the new use after the old one. Then, with reuse_with_stream_wait,
  // a free block of another stream whose fence has not completed gives its
  // pages the same way once the request's stream waits on the device for
  // that fence (take_with_stream_wait), before anything waits on the host.
  std::size_t unmap_free_pages(std::size_t target_bytes, const segment* keep_seg, std::uintptr_t keep_lo,
                               std::uintptr_t keep_hi, std::vector<recycled_page>* recycled, bool may_wait,
                               const stream_state* same_stream = nullptr);
  [[nodiscard]] static std::size_t partial_page_bytes(const block& b) noexcept;
  // defer: keep the old mappings (segment::retired) instead of unmapping
  // them now; only with recycled.
  std::size_t unmap_block_pages(block* b, std::uintptr_t keep_lo, std::uintptr_t keep_hi,
                                std::vector<recycled_page>* recycled, std::size_t max_bytes, bool defer = false);
  // Deferred unmaps (segment::retired): unmaps the retired pages of seg
  // with index in [first, last) whose fence has completed, and with
  // may_wait the others after waiting for their fence (counted in
  // num_device_synchronizations). settle_retired: every segment. [world]
  void settle_retired_in(segment& seg, std::size_t first, std::size_t last, bool may_wait);
  void settle_retired(bool may_wait);
  void release_page_handle(physical_handle_t h);

 private:
  bool retire_refused_page(segment& seg, std::size_t i, physical_handle_t h) noexcept;
  void release_reservation(segment& seg);  // an empty one; throws the device's error
  // Whether `need` bytes of new pages may fit at all (not past the device,
  // the cap, or what the device has free plus what unmapping could give).
  bool could_map(std::size_t need);
  // Which budget may pay for recycling for a new peak now
  // (recycle_budget::choose, on the backend's host clock).
  // spend_recycle_time takes the host time since `start_us` (a reading of
  // that clock before the recycling), less `excluded_us` (the time of the
  // fresh pages the same request mapped), out of budget `from`.
  recycle_budget::source recycle_budget_now(bool large_peak);
  void spend_recycle_time(recycle_budget::source from, std::uint64_t start_us, std::uint64_t excluded_us = 0);
  // Its steps, in order, on the request's state (expandable_request).
  struct expandable_request;
  void place_expandable(alloc_params& p, expandable_request& r);
  bool reserve_placement(const alloc_params& p, expandable_request& r);
  bool free_pages_for(expandable_request& r, world_lock& w);
  bool settle_retired_under(expandable_request& r);
  bool map_missing_pages(const alloc_params& p, expandable_request& r);
  bool map_request_page(const alloc_params& p, expandable_request& r, std::size_t i);
  static block* take_mapped_run(const expandable_request& r, std::size_t size);

  device_state& d_;
  std::size_t page_bytes_ = 0;
  std::size_t retired_pages_ = 0;  // retired pages of every segment
  std::vector<int> peers_;
  std::uint64_t next_segment_seq_ = 0;
  bool no_address_space_ = false;
  bool warned_no_address_space_ = false;  // the fallback to plain segments was announced
  reservation_map reservations_;
  // Reservations noted by note_maybe_empty since the last release (each
  // once: segment::maybe_empty); capacity >= reservations_.size().
  std::vector<segment*> maybe_empty_;
  std::atomic<bool> gone_empty_{false};  // note_gone_empty was called since the last release
  recycle_budget recycle_budget_;  // the recycling time budget (recycle_time_percent)
};

}  // namespace ccalloc::detail

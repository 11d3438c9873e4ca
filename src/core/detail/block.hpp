// Blocks and segments: the pieces of device memory one device's allocator
// manages, and the sizes that shape them (PyTorch's B1, B2). Invariants:
// device_state.hpp. Private to the core (src/core/).
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include "page_table.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ccalloc::detail {

// Sizes of PyTorch's allocator (B1, B2).
inline constexpr std::size_t min_block_bytes = 512;        // rounding unit and smallest block
inline constexpr std::size_t small_request_bytes = 1 * mib;  // largest small-pool request
inline constexpr std::size_t small_segment_bytes = 2 * mib;  // small-pool segment size
inline constexpr std::size_t min_large_alloc_bytes = 10 * mib;  // below: large_segment_size segments
inline constexpr std::size_t large_round_bytes = 2 * mib;    // larger segments round to this
// Requests (or growth) of at least this many bytes first ask the device how
// much is free (one mem_get_info): allocate_slow's check against what
// returning the whole cache could give, alloc_expandable's growth check.
inline constexpr std::size_t free_memory_check_bytes = 256 * mib;

// Blocks of at least this many pages are carved so that they touch no more
// pages than they need (page_sliver).
inline constexpr std::size_t page_aligned_block_pages = 8;

// Whether a block of `size` bytes, carved flush at `offset` of its segment,
// is to be carved on page boundaries instead, in an expandable segment's
// large pool where that costs no page now
// (placement_policy::page_aligned_start), when free pages are recycled at every
// new peak (the default). True when:
// - it falls short of a whole number of `page`s by at most 1/64 of a page
//   (and by something): packed with its like, carved flush, a run of them
//   drifts off the boundaries;
// - it reaches past a page boundary by at most that much (and by
//   something): after its neighbours are gone it would keep a whole page
//   mapped for the sliver;
// - it is page_aligned_block_pages pages or more and, flush, would touch one
//   page more than it needs: flush against a neighbour freed before it, it
//   keeps that page mapped for the neighbour's leftover bytes.
// Smaller blocks stay flush. Why these cases and this threshold (with the
// replays that chose them): docs/design.md, "Note: why blocks are carved
// on page boundaries".
[[nodiscard]] constexpr bool page_sliver(std::size_t size, std::size_t offset, std::size_t page) noexcept {
  // Masks for the usual power-of-two page (a division takes tens of cycles:
  // this runs at every split of a large block in an expandable segment).
  const bool pow2 = (page & (page - 1)) == 0;
  const auto in_page = [&](std::size_t bytes) { return pow2 ? bytes & (page - 1) : bytes % page; };
  const std::size_t past = in_page(size);
  if (past != 0 && page - past <= page / 64) return true;
  const std::size_t over = in_page(offset + size);
  if (over != 0 && over <= page / 64) return true;
  return size >= page_aligned_block_pages * page && in_page(offset) + (past == 0 ? page : past) > page;
}

struct block_pool;
struct segment;
struct stream_state;

// block::reuse_version of a block the thread cache may not hand out again.
inline constexpr std::uint64_t no_reuse_version = ~std::uint64_t{0};

// ---- block: a piece of a segment -------------------------------------------------------

struct block {
  std::uintptr_t ptr = 0;
  std::size_t size = 0;             // bytes, multiple of 512
  std::size_t requested_bytes = 0;  // caller's bytes while active, else 0
  stream_t stream = 0;              // the stream it was allocated on (the segment's)
  block_pool* pool = nullptr;
  segment* seg = nullptr;
  block* prev = nullptr;            // neighbour at lower address in the segment
  block* next = nullptr;            // neighbour at higher address
  bool allocated = false;
  bool mapped = true;               // false: an unmapped free range of an expandable segment
  bool counted_oversize = false;    // counted in oversize_allocations (max_split_size may change)
  // Freed while its tag was paused, with history on: the resume that frees
  // it records its free_completed (device_history.cpp). [stream]
  bool free_completed_at_resume = false;
  int event_count = 0;              // events still to complete before reuse
  std::uint64_t gc_count_base = 0;  // pool's get-free-block count when cached
  // Its stream's free count (stream_state::free_seq) when it last became
  // free; a merge keeps the larger. Its pages may change hands once a fence
  // of that stream at or after this count has completed (page fences).
  std::uint64_t free_seq = 0;
  // free_seq was taken when it was freed with events (a fence recorded
  // then covers it); free_block keeps it. [stream]
  bool free_seq_taken = false;
  // Where it is in its pool's index while it is there (block_index keeps
  // them as entries move): find() reads them instead of searching. [stream]
  std::uint8_t index_bin = 0;
  std::uint32_t index_pos = 0;
  std::vector<stream_t> stream_uses;  // other streams that used it (record_stream)
  // The thread cache's proof that handing this block out again is what the
  // pools would do (detail/thread_cache.hpp, "Placement"): its pool index's
  // version right after the best fit that handed it out (allocate's rung
  // 1), or no_reuse_version (every free block, and a block from the slow
  // path). [stream] to write; the owner thread reads it while it holds the
  // block. The inactive-split statistics that handing it out changed
  // (counts; a free that undoes the split changes them back).
  std::uint64_t reuse_version = no_reuse_version;
  std::int64_t reuse_split_blocks = 0;
  std::int64_t reuse_split_bytes = 0;

  [[nodiscard]] inline bool is_split() const noexcept;
  // Free and not waiting for events (unmapped blocks are always free).
  [[nodiscard]] bool is_free() const noexcept { return !allocated && event_count == 0; }
};

// ---- segment: one device malloc or one expandable reservation -------------------------

struct segment {
  std::uintptr_t base = 0;
  std::size_t size = 0;   // bytes: the allocation, or the whole reservation when expandable
  block* head = nullptr;  // block at `base`
  bool oversize = false;  // counted in oversize_segments when it was obtained
  std::size_t busy_blocks = 0;  // blocks not free (allocated, or waiting for events) [stream]
  // --- expandable segments only ---
  bool expandable = false;
  std::uint64_t seq = 0;  // creation order: choices among segments never depend on addresses
  std::size_t page_bytes = 0;            // mapping unit (the device's granularity)
  std::size_t mapped_bytes = 0;          // mapped pages x page_bytes
  page_table pages;  // which pages are mapped, unmapped, retired (page_table.hpp) [world]
  // Its unmapped blocks, by address. They change only where pages are
  // mapped or unmapped (set_page_state, under the world lock), never on the
  // fast path. A request that maps pages looks for its free run around them
  // (best_own_run, run_placement.hpp) instead of walking every block. [world]
  std::vector<block*> unmapped;
  using retired_page = page_table::retired_page;
  // --- sleep and wake (sleep_wake.cpp; SPEC S2-S3) ---
  // Paused: every page unmapped and released (pages all 0, mapped_bytes 0,
  // retired empty) while its blocks keep their addresses; the block
  // invariants about mapping hold again at resume. [world]
  bool paused = false;
  // On expandable_segments' list of reservations that may be empty (no
  // page mapped): release_empty_expandable_segments reads that list. [world]
  bool maybe_empty = false;
  // The page runs resume maps again (those under blocks allocated at the
  // pause), each with its kept contents in host memory from the backend's
  // host_alloc (nullptr: not kept). [world]
  struct paused_run {
    std::size_t first_page = 0;
    std::size_t pages = 0;
    void* host = nullptr;
  };
  std::vector<paused_run> paused_runs;
  // Free mapped blocks (partial pages beside blocks in use) taken out of
  // their pool while paused: put back at resume. [world]
  std::vector<block*> paused_free;
  // Blocks freed by their callers while paused: freed at resume, once their
  // pages are mapped again (a free never touches a released page). [stream]
  std::vector<block*> frees_while_paused;
  // --- private pools only: the pool's list of its segments (private_pool::
  // segments_head), in the order they were made [world] ---
  segment* pool_prev = nullptr;
  segment* pool_next = nullptr;
};

bool block::is_split() const noexcept { return prev != nullptr || next != nullptr || seg->expandable; }

// A segment's own invariant, checked at each of its state transitions under
// CCALLOC_ASSERT_EXPENSIVE (inspection.cpp): its blocks tile it in address
// order (head at base, prev/next linked both ways, each block's seg is it,
// sizes add up to size); an expandable segment's page table covers it and
// holds its own invariant (page_table::check). check_invariants adds what
// ties segments to pools, statistics and each other.
[[nodiscard]] bool segment_is_valid(const segment& seg) noexcept;

}  // namespace ccalloc::detail

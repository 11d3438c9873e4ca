// Private data structures of the device caching allocator. Only the core's
// sources (src/core/*.cpp, one per concept: see src/README.md) use them.
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
//   a block in deferred_frees_ is not allocated and has event_count == 1
//   while a private pool has users, none of its segments is freed or unmapped
//
// Locking (SPEC X1): each stream has its own state and lock (stream_state);
// the fast path (a cached block of the request's stream, and the free of a
// block) takes only that lock. Device-wide state (segments, events, the
// reservation) has device_mutex_; statistics have stats_mutex_. The slow path
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
#include "stat_storage.hpp"

#include "history_recorder.hpp"
#include "host_copy_cache.hpp"
#include "mapping_notifier.hpp"
#include "page_fences.hpp"
#include "page_table.hpp"
#include "recycle_budget.hpp"
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
// (device_state::page_aligned_start), when free pages are recycled at every
// new peak (the default). Three cases:
// - it falls short of a whole number of `page`s by at most 1/64 of a page
//   (and by something): packed with its like, it wastes at most that much
//   per block, where carved flush a run of them drifts off the boundaries;
// - it reaches past a page boundary by at most that much (and by
//   something): a block of whole pages after a neighbour that ends just
//   past one keeps that whole page mapped for the sliver once its
//   neighbours are gone (bert_copystream_infer: a 32 MiB block 15 KiB past
//   a boundary held 17 pages instead of 16);
// - it is page_aligned_block_pages pages or more and, flush, would touch one
//   page more than it needs (its offset in its first page plus its bytes
//   in its last page pass a page). Flush against a neighbour that is freed
//   before it (a large activation, gradient or workspace carved after a
//   temporary), it keeps that page mapped for the neighbour's leftover
//   bytes for the rest of its life; on a boundary it touches the fewest
//   pages, and the gap left in the neighbour's page (less than a page)
//   costs at most 1/page_aligned_block_pages of the block's pages where the
//   neighbours live as long. Smaller blocks stay flush: a model's small
//   parameters loaded one after another ([2 MiB][2 MiB][5.5 MiB] per
//   layer) each left a gap on every layer (aligning every block that would
//   touch a page more: llama_generate 1.006 -> 1.022, bert_varlen 1.021 ->
//   1.051; from 4, 8, 16 or 32 pages up: geometric mean at 4 passes
//   1.0110, 1.0100, 1.0124, 1.0129, from 1.0121).
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
  // (device_state::best_own_run) instead of walking every block. [world]
  std::vector<block*> unmapped;
  using retired_page = page_table::retired_page;
  // --- sleep and wake (sleep_wake.cpp; SPEC S2-S3) ---
  // Paused: every page unmapped and released (pages all 0, mapped_bytes 0,
  // retired empty) while its blocks keep their addresses; the block
  // invariants about mapping hold again at resume. [world]
  bool paused = false;
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
};

bool block::is_split() const noexcept { return prev != nullptr || next != nullptr || seg->expandable; }

// A segment's own invariant, checked at each of its state transitions under
// CCALLOC_ASSERT_EXPENSIVE (inspection.cpp): its blocks tile it in address
// order (head at base, prev/next linked both ways, each block's seg is it,
// sizes add up to size); an expandable segment's page table covers it and
// holds its own invariant (page_table::check). check_invariants adds what
// ties segments to pools, statistics and each other.
[[nodiscard]] bool segment_is_valid(const segment& seg) noexcept;

// ---- block_index: a pool's free blocks, sorted (hot_path.cpp) ------------------------

// The free blocks of one (stream, pool), in (size, address) order: PyTorch's
// order (BlockComparatorSize), so best fit chooses the same block.
//
// Segregated by size: bin_of(size) splits every power of two of (the size in
// 512-byte units - 1) into four bins (units 1-8 have a bin each), 216 bins in
// all, in key order. A bin's sizes are a range (lo, hi]: a whole segment (2 MiB,
// 20 MiB: a bin's upper end) shares its bin with itself split by a small
// allocation, so a split and the merge that undoes it usually only rewrite
// the block's entry in place (rekey_at). Each bin is a flat sorted array of {size, ptr, block}
// entries; a bitmap says which bins hold any. Best fit is a binary search in
// the request's bin, else the first entry of the next bin that holds any (a
// bit scan); insert and erase shift only their bin's tail. Pools hold one to
// a few thousand free blocks: a flat array for the whole pool made every
// insert and erase of a mixed-size workload move the tail (a tenth of the
// mixed benchmark's instructions); a bin rarely holds more than a few.
//
// Positions are {bin, index}; erasing at a position leaves every earlier
// position valid (a loop downwards may erase as it goes).
class block_index {
 public:
  struct entry {
    std::size_t size;
    std::uintptr_t ptr;
    block* b;
  };
  struct position {
    std::uint32_t bin;
    std::uint32_t index;
    friend bool operator==(position, position) = default;
    /// Whether this is end() (one comparison: the hot path asks at every step).
    [[nodiscard]] bool is_end() const noexcept { return bin == bin_count; }
  };
  static constexpr std::uint32_t bin_count = 216;
  static_assert(bin_count <= 256, "block::index_bin is one byte");

  /// One bin: its entries in key order, in one array. Not a std::vector:
  /// its size() divides by the entry's 24 bytes and its insert is a call,
  /// on every best fit, split and merge; this keeps its count and shifts
  /// inline (growing, rare, is out of line).
  ///
  /// A spare slot (SPEC R5: a free never fails half done): an insert
  /// grows the bin when it fills it, after the insert, so the next insert
  /// finds room without allocating. A bin starts with one slot, in the
  /// index's first_slots_ (not owned); a grown bin owns its array.
  class bin_array {
   public:
    [[nodiscard]] std::uint32_t size() const noexcept { return size_; }
    [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
    [[nodiscard]] bool full() const noexcept { return size_ == capacity_; }
    [[nodiscard]] std::uint32_t capacity() const noexcept { return capacity_; }
    [[nodiscard]] entry& operator[](std::uint32_t i) noexcept { return data_[i]; }
    [[nodiscard]] const entry& operator[](std::uint32_t i) const noexcept { return data_[i]; }
    [[nodiscard]] const entry& back() const noexcept { return data_[size_ - 1]; }
    /// Starts with the one slot `slot` (owned by the caller, kept while this lives).
    void attach(entry* slot) noexcept {
      data_ = slot;
      capacity_ = 1;
    }
    /// Inserts `e` before index i (i <= size() < capacity: not full()).
    /// Every entry's block learns its new index (block::index_pos).
    void insert_at(std::uint32_t i, const entry& e) noexcept {
      entry* d = data_;
      for (std::uint32_t j = size_; j > i; --j) move_entry(d, j, j - 1);
      d[i] = e;
      e.b->index_pos = i;
      ++size_;
    }
    /// Removes the entry at index i (< size()).
    void erase_at(std::uint32_t i) noexcept {
      --size_;
      entry* d = data_;
      for (std::uint32_t j = i; j < size_; ++j) move_entry(d, j, j + 1);
    }
    /// Doubles the capacity. May throw std::bad_alloc (then unchanged).
    [[gnu::noinline]] void grow() {
      const std::uint32_t capacity = capacity_ < 4 ? 4 : capacity_ * 2;
      auto data = std::make_unique_for_overwrite<entry[]>(capacity);
      if (size_ != 0) std::memcpy(data.get(), data_, size_ * sizeof(entry));
      owned_ = std::move(data);
      data_ = owned_.get();
      capacity_ = capacity;
    }

   private:
    // The shifts above move a few entries (a bin rarely holds more than a
    // few): a loop, not a call of memmove through the PLT. An asm barrier
    // keeps GCC from turning the loop back into that call.
    static void move_entry(entry* d, std::uint32_t to, std::uint32_t from) noexcept {
      d[to] = d[from];
      d[to].b->index_pos = to;
      asm volatile("" ::: "memory");
    }
    entry* data_ = nullptr;
    std::uint32_t size_ = 0;
    std::uint32_t capacity_ = 0;
    std::unique_ptr<entry[]> owned_;  // data_ once grown
  };

  /// Every bin starts with one slot (one allocation: may throw std::bad_alloc).
  block_index() : first_slots_(std::make_unique_for_overwrite<entry[]>(bin_count)) {
    for (std::uint32_t bin = 0; bin < bin_count; ++bin) bins_[bin].attach(&first_slots_[bin]);
  }
  block_index(const block_index&) = delete;
  block_index& operator=(const block_index&) = delete;

  /// The bin of a block of `size_bytes`: non-decreasing in the size.
  /// Without a branch: with s = max(bit_width(u) - 3, 0), the bin is 4 s +
  /// (u >> s), where u >> s is u's top three bits (4..7) once u >= 8.
  [[nodiscard]] static constexpr std::uint32_t bin_of(std::size_t size_bytes) noexcept {
    std::size_t u = size_bytes >> 9;  // 512-byte units
    u -= u != 0 ? 1 : 0;
    const auto shift = static_cast<std::uint32_t>(std::bit_width(u | 4)) - 3;
    return 4 * shift + static_cast<std::uint32_t>(u >> shift);
  }

  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
  [[nodiscard]] static constexpr position end() noexcept { return {bin_count, 0}; }
  [[nodiscard]] block* at(position p) const noexcept { return bins_[p.bin][p.index].b; }
  [[nodiscard]] block* largest() const noexcept {
    const std::uint32_t bin = last_bin();
    return bin == bin_count ? nullptr : bins_[bin].back().b;
  }
  /// The first block with (size, ptr) >= (size_bytes, ptr); end() if none.
  [[nodiscard]] position lower_bound(std::size_t size_bytes, std::uintptr_t ptr = 0) const noexcept {
    const std::uint32_t bin = bin_of(size_bytes);
    const std::size_t i = search(bins_[bin], size_bytes, ptr);
    if (i < bins_[bin].size()) return {bin, static_cast<std::uint32_t>(i)};
    return {next_bin(bin + 1), 0};
  }
  /// The position after `p` (not end()).
  [[nodiscard]] position next(position p) const noexcept {
    if (p.index + 1 < bins_[p.bin].size()) return {p.bin, p.index + 1};
    return {next_bin(p.bin + 1), 0};
  }
  /// Inserts b (not in the index). Does not throw while the index owes
  /// nothing (owes(): every bin has a spare slot); a bin that it fills and
  /// cannot grow (no host memory) is owed, and the insert still succeeds.
  /// Into an owed bin it grows first: may throw std::bad_alloc (unchanged).
  void insert(block* b);
  /// Whether a bin is full (its growth failed): the next insert into it
  /// would have to allocate. An operation that inserts calls repay() first,
  /// before it changes anything.
  [[nodiscard]] bool owes() const noexcept { return owes_; }
  /// Grows every full bin. Throws std::bad_alloc (host memory), before
  /// anything changed; then owes() stays true.
  [[gnu::noinline]] void repay();
  /// Room for two inserts, of blocks of sizes a and c, with owes() false
  /// (one insert into each bin is covered by its spare slot): may throw
  /// std::bad_alloc, before anything changed.
  void reserve_two(std::size_t a, std::size_t c);
  /// Changes at every insert, erase and rekey (and bump_version): equal
  /// readings mean the index did not change in between. Written under the
  /// pool's stream lock; read without it (a relaxed load, never torn).
  [[nodiscard]] std::uint64_t version() const noexcept { return version_.load(std::memory_order_relaxed); }
  /// A change the index does not see that may change what best fit or a
  /// free does (a world lock: configuration, page fences, the slow path).
  void bump_version() noexcept { version_.store(version_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed); }
  void erase_at(position p) {
    bump_version();
    bin_array& v = bins_[p.bin];
    v.erase_at(p.index);
    --count_;
    if (v.empty()) occupied_[p.bin / 64] &= ~(std::uint64_t{1} << (p.bin % 64));
  }
  /// The entry at `p` (block b, in the index) takes b's new size and address:
  /// the same as erase_at(p) then insert(b), in place when the new key stays
  /// in p's bin between the same neighbours (a split, or a merge with a free
  /// neighbour, rarely moves it).
  void rekey_at(position p, block* b) {
    bin_array& v = bins_[p.bin];
    const bool stays = bin_of(b->size) == p.bin &&
                       (p.index == 0 || key_less(v[p.index - 1], b->size, b->ptr)) &&
                       (p.index + 1 == v.size() || !key_less(v[p.index + 1], b->size, b->ptr));
    if (stays) [[likely]] {
      bump_version();
      v[p.index] = entry{b->size, b->ptr, b};
      b->index_bin = static_cast<std::uint8_t>(p.bin);  // b may be another block than the entry's (a merge)
      b->index_pos = p.index;
      return;
    }
    erase_at(p);
    insert(b);
  }
  void erase(const block* b);
  [[nodiscard]] bool contains(const block* b) const noexcept;
  /// The position of `b` (in the index), else end().
  [[nodiscard]] position find(const block* b) const noexcept;
  /// f(block*) for every block in ascending order (f must not change the index).
  template <class F>
  void for_each(F f) const {
    for (position p = lower_bound(0); !p.is_end(); p = next(p)) f(at(p));
  }
  /// f(block*) in descending order while f returns true (f must not change the index).
  template <class F>
  void for_each_descending(F f) const {
    for (std::uint32_t bin = last_bin(); bin != bin_count; bin = prev_bin(bin))
      for (std::uint32_t i = bins_[bin].size(); i-- > 0;)
        if (!f(bins_[bin][i].b)) return;
  }

 private:
  static constexpr std::uint32_t words = (bin_count + 63) / 64;
  // Whether e's key (size, ptr) is below (size_bytes, ptr); keys are unique.
  [[nodiscard]] static bool key_less(const entry& e, std::size_t size_bytes, std::uintptr_t ptr) noexcept {
    return e.size < size_bytes || (e.size == size_bytes && e.ptr < ptr);
  }
  // The index in `v` of the first entry with (size, ptr) >= (size_bytes, ptr).
  [[nodiscard]] static std::uint32_t search(const bin_array& v, std::size_t size_bytes,
                                            std::uintptr_t ptr) noexcept {
    std::uint32_t lo = 0, n = v.size();
    while (n > 0) {  // branch-light binary search
      const std::uint32_t half = n / 2;
      const entry& e = v[lo + half];
      const bool less = key_less(e, size_bytes, ptr);
      lo = less ? lo + half + 1 : lo;
      n = less ? n - half - 1 : half;
    }
    return lo;
  }
  // The first bin >= `from` that holds a block; bin_count if none.
  [[nodiscard]] std::uint32_t next_bin(std::uint32_t from) const noexcept {
    std::uint32_t w = from / 64;
    if (w >= words) return bin_count;
    std::uint64_t bits = occupied_[w] & (~std::uint64_t{0} << (from % 64));
    while (bits == 0) {
      if (++w == words) return bin_count;
      bits = occupied_[w];
    }
    return w * 64 + static_cast<std::uint32_t>(std::countr_zero(bits));
  }
  // The last bin < `below` that holds a block; bin_count if none.
  [[nodiscard]] std::uint32_t prev_bin(std::uint32_t below) const noexcept {
    for (std::uint32_t w = below / 64 + 1; w-- > 0;) {
      std::uint64_t bits = occupied_[w];
      if (w == below / 64) bits &= below % 64 == 0 ? 0 : ~std::uint64_t{0} >> (64 - below % 64);
      if (bits != 0) return w * 64 + 63 - static_cast<std::uint32_t>(std::countl_zero(bits));
    }
    return bin_count;
  }
  [[nodiscard]] std::uint32_t last_bin() const noexcept { return prev_bin(bin_count); }

  void insert_filling(std::uint32_t bin, block* b);
  void place(std::uint32_t bin, block* b) noexcept;

  std::unique_ptr<entry[]> first_slots_;  // one per bin, until it grows
  std::array<bin_array, bin_count> bins_;
  std::array<std::uint64_t, words> occupied_{};
  bool owes_ = false;  // a bin is full: see owes() [stream]
  std::size_t count_ = 0;
  std::atomic<std::uint64_t> version_{0};  // [stream] to write (version())
};

struct stream_state;
struct private_pool;

// ---- pools: one (stream, small or large, default or private) ----------------------------

struct block_pool {
  explicit block_pool(bool small) : is_small(small) {}
  block_index blocks;
  bool is_small;
  bool no_split = false;          // the private pool's set_no_split (F22); false for default pools
  stream_state* owner = nullptr;  // the stream whose pool this is
  private_pool* priv = nullptr;   // the private pool it belongs to; nullptr: the default pool
  std::uint64_t get_free_blocks_call_count = 0;  // age clock for garbage collection
  std::size_t plain_segments = 0;  // plain (not expandable) segments whose blocks are in this pool [world]

  [[nodiscard]] std::uint64_t age(const block* b) const noexcept {
    return get_free_blocks_call_count - b->gc_count_base;
  }
};

// The two pools of one stream.
struct stream_pools {
  explicit stream_pools(stream_state* o) {
    small.owner = o;
    large.owner = o;
  }
  block_pool small{true};
  block_pool large{false};
};

// ---- private_pool (private_pools.cpp) --------------------------------------------------

// The first half of the id of a tag's own private pool (sleep_wake.cpp).
inline constexpr std::uint64_t tag_pool_id_first = ~std::uint64_t{0};

// A private pool (F20-F24): its id, users and options. Each stream that
// allocates to it gets its own stream_pools in stream_state::private_pools
// (blocks stay bound to their stream). Deleted (with those stream_pools) when
// its use count is 0 and it holds no segment. [world]
struct private_pool {
  mempool_id_t id;
  // The tag its memory carries (tags.hpp): the tag in scope at its creation;
  // a tag's own pool (device_state::tag_pool) has id {tag_pool_id_first, tag}.
  tag_id tag = default_tag_id;
  int use_count = 1;
  segment_allocator custom;     // empty: the backend's segments
  bool use_on_oom = false;
  bool no_split = false;
  std::size_t segment_count = 0;  // segments it holds
  // Allocations in flight to it (they may drop the world lock): not deleted
  // meanwhile. Incremented under the world lock, decremented without it.
  std::atomic<int> pinned{0};
  [[nodiscard]] bool is_tag_pool() const noexcept { return id.first == tag_pool_id_first && tag != default_tag_id; }
};

// Private pools by id (unique among live pools): an order that does not
// depend on host addresses.
struct private_pool_order {
  bool operator()(const private_pool* a, const private_pool* b) const noexcept { return a->id < b->id; }
};

// ---- stream_state: one stream's pools, lock and pending statistics --------------------

// Everything of one stream: its pools, its lock, and the statistics it could
// not publish because stats_mutex_ was busy (merged on the next publish).
// Cache-line aligned: each stream's hot fields (its lock, its spare-block
// list) are written by that stream's thread only; alignment keeps them off
// the lines of the stream states allocated next to it (no false sharing).
struct alignas(64) stream_state {
  explicit stream_state(stream_t s) : stream(s), pools(this) {}
  nap_lock mutex;  // one exchange and one store per uncontended lock + unlock
  stream_t stream;
  stream_pools pools;
  device_stats pending_stats;  // deltas: current may be negative; peak = max prefix
  bool has_pending_stats = false;
  std::uint32_t stats_backoff = 0;  // operations left before trying stats_mutex_ again
  std::vector<block*> spare_blocks;  // recycled block objects: no heap call per split
  // Blocks of this stream that became free so far (each takes the next
  // number as its block::free_seq): the count its page fences cover. [stream]
  std::uint64_t free_seq = 0;
  // Destroyed (device_caching_allocator::stream_destroyed): its work has
  // completed and nothing is recorded on it; malloc on it is refused. [world
  // to write; stream or device to read]
  bool gone = false;
  // Segments whose blocks are in its pools, default and private (plain and
  // expandable). A gone stream that holds none is forgotten: its state is
  // deleted when the world lock that saw it empty is released
  // (device_state::forget_gone_streams). [stream to write; world to read]
  std::size_t segments = 0;
  // Its page fences (page_fences.hpp). [world]; record also [stream + device]
  page_fences fences;
  // Its frees of blocks of at least this many bytes record a page fence
  // (device_state::free_records_fence): a page, where the stream is not the
  // legacy default stream and another stream allocates too; else never
  // (SIZE_MAX). Set when the stream or the second stream registers. [stream]
  std::size_t fence_free_bytes = std::numeric_limits<std::size_t>::max();
  // This stream's pools inside private pools (F20), in the order of the
  // pools' ids (not their host addresses: release_dead_pools returns
  // segments in this order). [world]
  std::map<private_pool*, std::unique_ptr<stream_pools>, private_pool_order> private_pools;

  block* new_block() {
    if (spare_blocks.empty()) return new block;
    block* b = spare_blocks.back();
    spare_blocks.pop_back();
    return b;
  }
  /// At least n block objects spare: new_block will not allocate for the
  /// next n. May throw std::bad_alloc (then nothing else changed).
  void reserve_spare_blocks(std::size_t n) {
    spare_blocks.reserve(n);
    while (spare_blocks.size() < n) {
      auto b = std::make_unique<block>();
      spare_blocks.push_back(b.release());
    }
  }
  /// Never throws: a merge (inside a free) calls it.
  void delete_block(block* b) noexcept {
    // Reset what new_block's callers do not set (stream_uses keeps its capacity).
    b->requested_bytes = 0;
    b->prev = b->next = nullptr;
    b->allocated = false;
    b->mapped = true;
    b->counted_oversize = false;
    b->event_count = 0;
    b->gc_count_base = 0;
    b->free_seq = 0;
    b->free_seq_taken = false;
    b->reuse_version = no_reuse_version;
    b->stream_uses.clear();
    try {
      spare_blocks.push_back(b);
    } catch (const std::bad_alloc&) {
      delete b;  // no host memory for the list: the next new_block allocates
    }
  }
  ~stream_state() {
    for (block* b : spare_blocks) delete b;
  }
};

// ---- alloc_params: one request (hot_path.cpp, fallback_ladder.cpp) ----------------------

// A request in flight through the fallback ladder.
struct alloc_params {
  std::size_t requested_bytes = 0;  // caller's size
  std::size_t size = 0;             // rounded block size
  std::size_t alloc_size = 0;       // segment size if a new segment is needed
  stream_t stream = 0;
  stream_state* owner = nullptr;
  block_pool* pool = nullptr;
  block* found = nullptr;
};

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
  /// deleted: device_state::forget_gone_streams).
  void drop(stream_state* ss) noexcept;

 private:
  device_state& d_;
  std::vector<stream_state*> streams_;
  bool locked_ = false;
};

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
  stream_state& stream_for(stream_t stream);  // [none] takes registry_mutex_ on a thread-cache miss
  [[nodiscard]] std::size_t round_size(std::size_t size) const noexcept;       // [stream]
  [[nodiscard]] std::size_t allocation_size(std::size_t size) const noexcept;  // [stream]
  void prepare(alloc_params& p, std::size_t requested_bytes, stream_state& ss) const noexcept;  // [stream]
  // prepare without p.alloc_size, which only the slow path reads (rung 1 of
  // the hot path; the slow path prepares again). [stream]
  void prepare_search(alloc_params& p, std::size_t requested_bytes, stream_state& ss) const noexcept;
  bool get_free_block(alloc_params& p);                                        // [stream]
  block_index::position find_free_block(alloc_params& p);                     // [stream]
  block* take_found_block(alloc_params& p, device_stats& st,
                          block_index::position at = block_index::end());      // [stream]
  block* note_reusable(block* b, const stream_state& ss) const noexcept;       // [stream]
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
  // expandable segment's page) starts (expandable_segments.cpp). [stream]
  [[nodiscard]] static std::uintptr_t page_aligned_start(const block& b, std::size_t size, bool back) noexcept;
  // find_free_block's best fit `at` for p, a free island of an expandable
  // segment's large pool: the fitting free block at the lowest address
  // instead, where free pages are recycled at every new peak
  // (expandable_segments.cpp). [stream]
  [[nodiscard]] block_index::position lowest_fitting_block(const alloc_params& p,
                                                           block_index::position at) const noexcept;
  void release_allocation(block* b, device_stats& st, bool device_locked);    // [stream] (+device if device_locked)
  void free_block(block* b, device_stats& st, bool device_locked);            // [stream] (+device if device_locked)
  [[nodiscard]] static bool can_merge(const block* dst, const block* src) noexcept;  // [stream]
  std::size_t merge(block* dst, block* src);                                   // [stream]

  // --- events.cpp: record_stream, events, returning blocks ----------------------
  void record_stream(block* b, stream_t stream);  // [none] takes the block's stream
  // Throws invalid_argument_error naming `stream` unless it is a live stream
  // of this device (registry, then backend_.is_stream), for record_stream.
  void check_recorded_stream(stream_t stream) const;  // [registry]
  void set_stream_gone(stream_t stream, bool gone);  // [none] takes the world lock
  // Deletes the state of every gone stream that holds no segment (its
  // pending statistics published first), so that a destroyed stream costs
  // no host memory and no slow-path time once its memory has moved on
  // (adopted by another stream, or returned to the device). Changes
  // stream_cache_key_: no thread's cached entry can name a deleted state.
  // world_lock's destructor calls it. [world]
  void forget_gone_streams(world_lock& w) noexcept;
  static void forget_thread_stream() noexcept;       // the calling thread's stream_for cache (hot_path.cpp)
  void process_events();  // [none] takes device, then (device released) each block's stream
  void process_events_locked();                                               // [world]
  void insert_events(block* b);                                                // [stream] takes device
  void insert_events_locked(block* b);                                        // [stream, device]
  template <class OnCompleted>
  void take_completed_events(OnCompleted on_completed);                      // [device]
  void synchronize_and_free_events();                                         // [world]
  event_t get_event();                                                        // [device]
  bool wait_for_completions_in_flight(world_lock& w);                         // [world] drops it while waiting

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

  // --- expandable_segments.cpp (B7, X3): every one [world] unless noted --------
  bool alloc_expandable(alloc_params& p, bool is_retry, world_lock& w);
  // Its steps, in order, on the request's state (expandable_request).
  struct expandable_request;
  void place_expandable(alloc_params& p, expandable_request& r);
  bool could_map(std::size_t need);
  bool reserve_placement(const alloc_params& p, expandable_request& r);
  bool free_pages_for(expandable_request& r, world_lock& w);
  bool settle_retired_under(expandable_request& r);
  bool map_missing_pages(const alloc_params& p, expandable_request& r);
  bool map_request_page(const alloc_params& p, expandable_request& r, std::size_t i);
  static block* take_mapped_run(const expandable_request& r, std::size_t size);
  segment* new_expandable_segment(const alloc_params& p);
  void discard_reservation(segment& seg) noexcept;
  void give_back_page(segment& seg, std::size_t i) noexcept;
  block* split_free_block(block* b, std::uintptr_t at);
  void pool_insert_counted(block* b);
  void pool_erase_counted(block* b);
  // hint: a block of seg at or below lo (the walk to lo starts there), or
  // nullptr: the nearest unmapped block at or below lo (seg.unmapped).
  void set_page_state(segment& seg, std::uintptr_t lo, std::uintptr_t hi, bool mapped, block* hint = nullptr,
                      bool reserve_only = false);
  [[nodiscard]] static block* unmapped_block_at_or_below(const segment& seg, std::uintptr_t addr) noexcept;
  // Placement of a request that maps pages (alloc_expandable, step 1): a free
  // run (free blocks between blocks in use) of at least `size` bytes, the
  // best by fewest pages to map, then own reservation before an idle one of
  // another stream (foreign), then the shortest run, then the oldest segment
  // and lowest offset: a total order, so the runs may be offered in any order.
  struct run_choice {
    segment* seg = nullptr;
    block* first = nullptr;  // the run's first block
    std::uintptr_t start = 0;  // where the request starts in the run (first->ptr unless past a retired page)
    bool foreign = false;
    bool retired = true;     // the request would map over a retired page (a wait)
    std::size_t pages = std::numeric_limits<std::size_t>::max();  // to map for the request
    std::size_t run = std::numeric_limits<std::size_t>::max();    // the run's bytes
  };
  static void consider_run(run_choice& best, segment& seg, bool foreign, block* first, std::size_t run,
                           std::size_t size) noexcept;
  // Offers every free run of seg, walking all its blocks.
  static void scan_runs(run_choice& best, segment& seg, bool foreign, std::size_t size) noexcept;
  // Offers the free runs of pool's expandable segments that can be the best:
  // those around an unmapped block (seg.unmapped), and the free mapped blocks
  // of at least `size` bytes without a free neighbour (pool's index). O(unmapped
  // blocks + the pool's free blocks of `size` or more), not O(blocks).
  void best_own_run(block_pool& pool, std::size_t size, run_choice& best) const noexcept;
  // The same by scan_runs over every block (check_invariants compares them).
  void best_own_run_by_scan(const block_pool& pool, std::size_t size, run_choice& best) const noexcept;
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
  // Cross-stream reuse with a device-side wait (reuse_with_stream_wait):
  // whether `to` may wait on the device for another stream's
  // fence now (no capture, `to` live and nameable, the backend can wait);
  // and the fence of `owner` covering its free numbered free_seq (event,
  // the free count it covers), recorded now where can_record_on allows;
  // nullopt when there is none.
  [[nodiscard]] bool may_wait_on_device(const stream_state& to);
  [[nodiscard]] std::optional<page_fences::fence> fence_covering(stream_state& owner, std::uint64_t free_seq);
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
  std::size_t retired_pages_ = 0;  // retired pages of every segment [world]
  // The first failure of a segment free that release_blocks went on past
  // (keep_going), until its reader clears it. [world]
  std::exception_ptr release_failure_;
  // Page fences (page_fences.hpp) of the block's or stream's owner, with
  // this device's events: whether free block b's memory (the stream's free
  // numbered free_seq) has no work of its stream left, never blocking
  // (records a fence where none covers it and can_record_on allows);
  // wait_fences blocks until every free of the stream has none, counted in
  // num_device_synchronizations and under `why`; await_fence is the two
  // together (wait unless completed).
  bool fence_completed(block* b);
  bool fence_completed(stream_state& ss, std::uint64_t free_seq);
  void wait_fences(stream_state& ss, page_fences::wait_reason why);
  void await_fence(block* b, page_fences::wait_reason why);
  void fence_streams(const world_lock& w);  // [world]
  void fence_before_free(stream_state& ss);  // [stream] takes the device lock
  // page_fences::device over this device's event pool and backend.
  struct fence_device final : page_fences::device {
    explicit fence_device(device_state& s) noexcept : d(s) {}
    device_state& d;
    event_t take_event() override;
    void give_event(event_t e) override;
    bool query(event_t e) override;
    void record(event_t e, stream_t stream) override;
    void synchronize(event_t e) override;
    void synchronize_device() override;
  };
  // Whether the allocator may record an event on the stream now: the legacy
  // default stream, or the stream of the malloc whose slow path this thread
  // runs (the caller's stream exists). A stream that only freed blocks may have been destroyed
  // since (legal in CUDA: the frees are stream-ordered), and recording on a
  // destroyed stream is undefined behaviour (a crash on an H200), so other
  // streams' fences are only polled; waiting on such a stream synchronizes
  // the device instead. [world]; per thread, race-free (a thread_local).
  [[nodiscard]] bool can_record_on(const stream_state& ss) const noexcept;  // fallback_ladder.cpp
  void release_empty_expandable_segments();
  void check_expandable_supported(const allocator_config& config) const;  // [none]: page_bytes_ is fixed
  // [world, or in the constructor] The thread_cache key, when given
  // (config.thread_cache_set), switches the thread cache (enabled,
  // small_only); otherwise it stays as CCALLOC_THREAD_CACHE or
  // set_thread_cache_enabled left it. small_only is an atomic written
  // under the world lock and read (relaxed) by the park path.
  void apply_thread_cache_setting(const allocator_config& config);
  // reserved_high_water_bytes_ = max(itself, reserved_bytes_); a rise
  // restarts the count of recycles_per_peak.
  void raise_reserved_high_water() noexcept;
  // [world] Which budget may pay for recycling for a new peak now
  // (recycle_budget::choose, on the backend's host clock).
  // spend_recycle_time takes the host time since `start_us` (a reading of
  // that clock before the recycling), less `excluded_us` (the time of the
  // fresh pages the same request mapped), out of budget `from`.
  recycle_budget::source recycle_budget_now(bool large_peak);
  void spend_recycle_time(recycle_budget::source from, std::uint64_t start_us, std::uint64_t excluded_us = 0);
  // Cross-stream reuse of whole reservations.
  bool idle_reservation(segment& seg, const alloc_params& p);
  void adopt_reservation(segment& seg, const alloc_params& p);

  // --- private_pools.cpp (F20-F24): every one [world] unless noted -------------
  private_pool* find_pool(mempool_id_t id) const noexcept;                   // [device] or [world]
  private_pool& checked_pool(mempool_id_t id, const char* what) const;        // [device] or [world]
  private_pool* routed_pool(stream_t stream) const;                           // [device]
  block_pool& pool_in(private_pool& pp, stream_state& ss, bool small);
  // A begin_allocate_to_pool is active: allocations may be routed to a
  // private pool (allocate_unusual). [none]: one relaxed load, on the hot path.
  [[nodiscard]] bool pool_scope_active() const noexcept { return capture_count_.load(std::memory_order_relaxed) != 0; }
  // A graph capture runs where the allocator can see it: a pool scope is
  // active and a stream seen allocating during it still captures
  // (device_backend::is_capturing). Only then may the allocator not query or
  // wait for events, synchronize, or free device memory (CUDA's global
  // capture mode). A scoped pool outside a capture is ordinary allocation
  // (PyTorch has the opposite behaviour: pytorch/pytorch#159674). A capture
  // on a stream that has not allocated through this device since the scope
  // began is not seen. [none] takes capturing_mutex_ while a scope is active
  [[nodiscard]] bool capture_underway() noexcept;
  // Called for each allocation while a pool scope is active: remembers
  // `stream` if it captures. [none] takes capturing_mutex_
  void note_if_capturing(stream_t stream);
  // A tag's own pool is never live in this sense: its cache is ordinary
  // cached memory (recycled, returned by empty_cache), as the default pools'.
  [[nodiscard]] bool pool_is_live(const block_pool* pool) const noexcept {
    return pool->priv != nullptr && pool->priv->use_count > 0 && !pool->priv->is_tag_pool();
  }
  bool try_use_on_oom_pools(alloc_params& p, const world_lock& w);
  void release_dead_pools(const world_lock& w, bool keep_going = false);
  void delete_empty_dead_pools(const world_lock& w);
  void defer_free(block* b);                                                   // [stream] takes device
  void flush_deferred_frees();
  bool any_stream_capturing(const block* b);                                  // [stream]
  block* carve_allocated(segment& seg, std::uintptr_t ptr, std::size_t size, std::size_t requested);
  void free_allocated_locked(block* b);

  // --- sleep_wake.cpp (SPEC S1-S4): every one [world] unless noted -----------
  // A named tag's own private pool, made on first use (never deleted).
  private_pool& tag_pool(tag_id tag);
  // The tag of a segment: its private pool's, else default.
  [[nodiscard]] static tag_id tag_of(const segment& seg) noexcept {
    return seg.head->pool->priv != nullptr ? seg.head->pool->priv->tag : default_tag_id;
  }
  [[nodiscard]] bool tag_paused(tag_id tag) const noexcept { return paused_tags_.count(tag) != 0; }
  // An allocation under the calling thread's tag (not default), routed to
  // its pool. [none] takes the world lock; throws for a paused tag.
  block* allocate_tagged(std::size_t requested_bytes, stream_state& ss, tag_id tag);
  // allocate_slow in private pool pp (routed by a capture scope or a tag),
  // pinning it meanwhile. [world]
  block* allocate_in_private_pool(private_pool& pp, std::size_t requested_bytes, stream_state& ss, world_lock& w);
  sleep_result pause_tags(const std::vector<tag_id>& tags, bool keep_contents, world_lock& w);
  sleep_result resume_tags(const std::vector<tag_id>& tags, world_lock& w);
  void pause_segment(segment& seg, bool keep_contents, sleep_result& r);
  // Maps seg's paused runs again; on failure every page this call mapped
  // goes back and seg stays paused (returns false).
  bool map_paused_segment(segment& seg);
  void restore_paused_segment(segment& seg, sleep_result& r);
  [[nodiscard]] std::vector<segment*> segments_of(tag_id tag) const;
  [[nodiscard]] tag_usage usage_of(tag_id tag) const;

  // --- locks_and_stats.cpp, device_state.cpp -----------------------------------
  void publish_all_pending_stats(const world_lock& w);                        // [world]
  void set_memory_fraction(double fraction, const world_lock& w);             // [world]
  [[nodiscard]] stat_group group_of(const block_pool* pool) const noexcept {  // [none]: is_small is fixed
    return pool->is_small ? stat_group::small_pool : stat_group::large_pool;
  }

  // --- data, by the lock that guards it ------------------------------------------
  // Public: the core's files (one concept each) share it; making it private
  // would take accessors or friends on the hot path for no gain in safety,
  // as the lock discipline, not the access level, is what protects it.

  const int device_;
  device_backend& backend_;
  const std::uint64_t id_;  // unique per instance: keys the threads' block caches

  // [registry_mutex_]
  spin_mutex registry_mutex_;
  std::unordered_map<stream_t, std::unique_ptr<stream_state>> streams_;
  std::size_t gone_streams_ = 0;  // states in streams_ with gone set
  // Keys the thread-local stream cache (stream_for): unique per instance,
  // and drawn again whenever a stream state is deleted. Written under the
  // registry lock; read on the fast path (relaxed).
  std::atomic<std::uint64_t> stream_cache_key_;

  // Read on the fast path under a stream lock; written under the world lock.
  allocator_config config_;
  // Also read without a lock (the thread cache's park, is_caching_enabled):
  // atomic, relaxed there.
  std::atomic<bool> caching_{true};

  // [device_mutex_]
  spin_mutex device_mutex_;
  bool set_fraction_ = false;
  double fraction_ = 1.0;
  std::size_t allowed_bytes_ = 0;  // fraction x total when set_fraction_, else device total
  std::size_t device_total_bytes_ = 0;
  std::size_t reserved_bytes_ = 0;  // sum of segment sizes
  // Highest reserved bytes ever (unlike the stats' peaks, reset_peak_stats keeps it).
  std::size_t reserved_high_water_bytes_ = 0;
  // Recyclings for a new peak since reserved_high_water_bytes_ last rose
  // (recycles_per_peak); raise_reserved_high_water resets it.
  std::size_t recycles_at_mark_ = 0;
  // The recycling time budget (recycle_time_percent). [world]
  recycle_budget recycle_budget_;
  std::map<std::uintptr_t, std::unique_ptr<segment>> segments_;  // by base address
  // Events recorded at free time, per stream that used the block, in order.
  std::unordered_map<stream_t, std::deque<std::pair<event_t, block*>>> pending_events_;
  std::atomic<std::size_t> pending_event_count_{0};  // events in pending_events_
  std::vector<event_t> free_events_;  // event pool: created and reusable
  host_copy_cache host_copies_{backend_, device_};  // kept contents' host buffers (sleep_wake.cpp) [world]
  fence_device fence_device_{*this};  // the page fences' view of it
  std::vector<oom_observer> observers_;
  // The out-of-memory snapshot (config oom_snapshot; out_of_memory.cpp):
  // the public wrapper sets the writer (it owns the snapshot code); called
  // with no lock held, it writes the device's snapshot to the path and
  // returns the sentence the error message gets; it never throws.
  std::function<std::string(const std::string& path)> oom_snapshot_writer_;
  std::optional<std::uint64_t> last_oom_snapshot_us_;  // steady clock, when the last was written [world]
  std::vector<int> peers_;          // devices granted access to expandable mappings (F26)
  std::size_t page_bytes_ = 0;      // the backend's granularity when it has virtual memory, else 0
  bool stream_wait_supported_ = false;  // the backend's capabilities().stream_wait
  std::uint64_t next_segment_seq_ = 0;
  bool no_address_space_ = false;   // the last expandable attempt found no address space [world]
  // The segment or reservation (by base) that the running slow path made for
  // request `owner` (alloc_segment, new_expandable_segment): if the request
  // fails (host out of memory on the way), it goes back whole
  // (discard_made_segment), as its reserved-memory mark. [world]
  struct made_segment {
    const alloc_params* owner = nullptr;
    std::uintptr_t base = 0;
    std::size_t high_water_bytes = 0;  // reserved_high_water_bytes_ and recycles_at_mark_ before it
    std::size_t recycles_at_mark = 0;
  } made_;
  // Blocks whose completed events process_events took but has not yet
  // returned to their pools (it drops the device lock in between). The OOM
  // path waits for them (X7).
  std::atomic<std::size_t> completions_in_flight_{0};

  // Memory history (SPEC F14-F18): its own lock, innermost. The allocator
  // records only when history_.active() (one relaxed load).
  history_recorder history_{device_};

  // Mapping listeners (SPEC C1, ccalloc/core/mapping_events.hpp): every
  // change of what is mapped is announced where it happens, under the locks
  // that make it; one relaxed load when none is attached.
  mapping_notifier mapping_{device_};
  void announce(mapping_change change, mapping_reason reason, std::uintptr_t addr, std::size_t size_bytes,
                stream_t stream, bool expandable) const noexcept {
    if (mapping_.active()) [[unlikely]]
      mapping_.announce({change, reason, device_, addr, size_bytes, stream, expandable});
  }

  // True while the device has at most one stream state: its statistics then
  // stay in its pending deltas without any lock and are published by readers
  // (exact: nothing else changes the device's values meanwhile). Cleared,
  // after publishing, when a second stream appears. Read under a stream lock.
  std::atomic<bool> single_stream_{true};

  // Private pools (F20-F24). [device_mutex_; world to change the set]
  std::map<mempool_id_t, std::unique_ptr<private_pool>> private_pools_;
  struct capture_entry {
    private_pool* pool;
    stream_filter filter;
  };
  std::vector<capture_entry> captures_underway_;  // begin_allocate_to_pool stack, oldest first
  std::atomic<std::size_t> capture_count_{0};    // captures_underway_.size(): read on the hot path
  // Streams seen capturing while a pool scope was active; pruned when they
  // stop, cleared when the last scope ends. [capturing_mutex_, a leaf lock]
  std::mutex capturing_mutex_;
  std::vector<stream_t> capturing_streams_;
  // Frees of blocks used on other streams while a capture was underway:
  // they hold event_count = 1 (a placeholder) until flush_deferred_frees.
  std::vector<block*> deferred_frees_;

  // Tags (sleep_wake.cpp): each named tag's own pool, and the paused tags.
  // [world]
  std::map<tag_id, private_pool*> tag_pools_;
  std::set<tag_id> paused_tags_;
  // paused_tags_ is not empty: the free path looks at a block's segment
  // (a relaxed load on every free). [world to write]
  std::atomic<bool> any_paused_{false};

  // Blocks parked in threads' caches (thread_cache.hpp).
  thread_cache_registry thread_caches_;

  // [stats_mutex_] On a cache line of its own: threads on many streams
  // try it every 64th operation, and the flags read on every operation
  // (thread_caches_.enabled above) must not share its line.
  alignas(64) spin_mutex stats_mutex_;
  device_stats stats_;
  const void* last_stats_thread_ = nullptr;  // the thread that published last
};

// A number never returned before in this process (device_state::id_,
// device_state::stream_cache_key_).
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

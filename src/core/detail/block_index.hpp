// block_index: the free blocks of one pool, sorted (best fit). Private to
// the core (src/core/).
#pragma once

#include "block.hpp"

#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace ccalloc::detail {

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

}  // namespace ccalloc::detail

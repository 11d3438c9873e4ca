// The page table of one expandable segment (an address-space reservation
// whose pages, the device's granularity, are mapped on demand). Each page is
// in one of three states:
//
//   mapped     handle(i) != 0: a physical page is mapped at page i and
//              counted in the segment's mapped bytes
//   unmapped   handle(i) == 0 and not retired: nothing is mapped at page i
//   retired    handle(i) == 0 in the books, but the old mapping stays until
//              the work its stream queued before the free has run (a
//              deferred unmap): the physical page may already be mapped
//              elsewhere; nothing may be mapped at page i before the
//              deferred unmap (expandable_segments::settle_retired_in)
//
// Invariant (check): the retired pages are sorted by index, inside the
// table, unmapped in the books, with a non-zero handle; device_state's
// check_invariants ties the mapped pages to the blocks (a mapped block's
// pages are mapped) and to segment::mapped_bytes (mapped pages x page bytes).
//
// Not thread-safe: pages change only under the world lock (the slow path);
// a reader that holds device_mutex_ (which the world lock includes) sees
// them unchanging (device_caching_allocator::segment_of).
#pragma once

#include <ccalloc/backend/device_backend.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <span>
#include <utility>
#include <vector>

#include <sys/mman.h>

namespace ccalloc::detail {

struct stream_state;

class page_table {
 public:
  /// Tables larger than this (bytes) are mapped, not taken from the heap.
  static constexpr std::size_t mmap_table_bytes = std::size_t{64} << 10;
  struct retired_page {
    std::size_t index = 0;          // page index in the segment
    physical_handle_t handle = 0;   // mapped here and where it went
    stream_state* owner = nullptr;  // the stream that freed it: its fence
    std::uint64_t free_seq = 0;     // the fence count that makes the unmap safe
    bool release = false;           // release the handle once unmapped (it went nowhere)
  };

  /// `count` pages, all unmapped (may throw std::bad_alloc). The table is
  /// zeroed memory: a reservation the size of the device has an entry per
  /// page of the device (about 540 KB on a 141 GB one), and the host gives
  /// zeroed pages it has not touched for free, so a reservation costs host
  /// memory for the pages mapped, not its size. A table above
  /// mmap_table_bytes comes straight from mmap and goes back with munmap:
  /// from the C library's heap, once glibc has freed one such block it
  /// raises its mmap threshold, and the next ones come from its arena,
  /// cleared (touched) by calloc and kept resident after their free. A
  /// smaller one comes from calloc.
  void reset(std::size_t count) {
    table fresh(count == 0 ? 1 : count);  // throws std::bad_alloc: nothing changed
    handles_ = std::move(fresh);
    count_ = count;
  }
  [[nodiscard]] std::size_t count() const noexcept { return count_; }
  [[nodiscard]] bool mapped(std::size_t i) const noexcept { return handles_[i] != 0; }
  /// The number of mapped pages from page i on (0 if page i is not mapped).
  [[nodiscard]] std::size_t mapped_run(std::size_t i) const noexcept {
    std::size_t n = 0;
    while (i + n < count_ && handles_[i + n] != 0) ++n;
    return n;
  }
  /// The physical handle mapped at page i in the books; 0: none.
  [[nodiscard]] physical_handle_t handle(std::size_t i) const noexcept { return handles_[i]; }
  [[nodiscard]] std::span<const physical_handle_t> handles() const noexcept { return {handles_.get(), count_}; }
  /// Page i becomes mapped with handle h (!= 0).
  void set_mapped(std::size_t i, physical_handle_t h) noexcept { handles_[i] = h; }
  /// Page i leaves the books (unmapped, or retired by retire()).
  void set_unmapped(std::size_t i) noexcept { handles_[i] = 0; }

  // ---- retired pages (deferred unmaps), by index ----
  [[nodiscard]] const std::vector<retired_page>& retired() const noexcept { return retired_; }
  /// Room for n more retired pages: retire() then allocates nothing.
  void reserve_retired(std::size_t n) { retired_.reserve(retired_.size() + n); }
  /// Keeps r (its page unmapped in the books now), in index order. Throws
  /// std::bad_alloc only without room (reserve_retired).
  void retire(const retired_page& r) { retired_.insert(retired_from(r.index), r); }
  /// The first retired page at or after page `index`.
  [[nodiscard]] std::vector<retired_page>::const_iterator retired_from(std::size_t index) const noexcept {
    return std::lower_bound(retired_.begin(), retired_.end(), index,
                            [](const retired_page& x, std::size_t i) { return x.index < i; });
  }
  /// Whether a page in [first, last) is retired.
  [[nodiscard]] bool has_retired(std::size_t first, std::size_t last) const noexcept {
    const auto it = retired_from(first);
    return it != retired_.end() && it->index < last;
  }
  /// Removes the k-th retired page (its deferred unmap done) and returns it.
  retired_page unretire(std::size_t k) noexcept {
    const retired_page r = retired_[k];
    retired_.erase(retired_.begin() + static_cast<std::ptrdiff_t>(k));
    return r;
  }
  /// Marks the retired page holding handle h to be released at its deferred
  /// unmap (nothing else took it); false when none holds it.
  bool release_at_unmap(physical_handle_t h) noexcept {
    for (retired_page& r : retired_)
      if (r.handle == h) {
        r.release = true;
        return true;
      }
    return false;
  }

  /// The invariant above.
  [[nodiscard]] bool check() const noexcept {
    for (std::size_t k = 0; k < retired_.size(); ++k) {
      const retired_page& r = retired_[k];
      if ((k > 0 && retired_[k - 1].index >= r.index) || r.index >= count_ || handles_[r.index] != 0 ||
          r.handle == 0)
        return false;
    }
    return true;
  }

 private:
  // Zeroed entries: from mmap above mmap_table_bytes, else from calloc.
  class table {
   public:
    table() noexcept = default;
    explicit table(std::size_t n) {
      if (n > std::numeric_limits<std::size_t>::max() / sizeof(physical_handle_t)) throw std::bad_alloc();
      bytes_ = n * sizeof(physical_handle_t);
      if (bytes_ > mmap_table_bytes) {
        void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        p_ = static_cast<physical_handle_t*>(p);
      } else {
        p_ = static_cast<physical_handle_t*>(std::calloc(n, sizeof(physical_handle_t)));
        if (p_ == nullptr) throw std::bad_alloc();
      }
    }
    table(table&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
    table& operator=(table&& o) noexcept {
      if (this != &o) {
        release();
        p_ = std::exchange(o.p_, nullptr);
        bytes_ = std::exchange(o.bytes_, 0);
      }
      return *this;
    }
    table(const table&) = delete;
    table& operator=(const table&) = delete;
    ~table() { release(); }
    physical_handle_t& operator[](std::size_t i) const noexcept { return p_[i]; }
    [[nodiscard]] physical_handle_t* get() const noexcept { return p_; }

   private:
    void release() noexcept {
      if (p_ == nullptr) return;
      if (bytes_ > mmap_table_bytes) ::munmap(p_, bytes_);
      else std::free(p_);
      p_ = nullptr;
    }
    physical_handle_t* p_ = nullptr;
    std::size_t bytes_ = 0;
  };
  table handles_;  // per page; 0 = not mapped in the books
  std::size_t count_ = 0;
  std::vector<retired_page> retired_;       // by index
};

}  // namespace ccalloc::detail

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
#include <memory>
#include <new>
#include <span>
#include <vector>

namespace ccalloc::detail {

struct stream_state;

class page_table {
 public:
  struct retired_page {
    std::size_t index = 0;          // page index in the segment
    physical_handle_t handle = 0;   // mapped here and where it went
    stream_state* owner = nullptr;  // the stream that freed it: its fence
    std::uint64_t free_seq = 0;     // the fence count that makes the unmap safe
    bool release = false;           // release the handle once unmapped (it went nowhere)
  };

  /// `count` pages, all unmapped (may throw std::bad_alloc). The table is
  /// zeroed memory from calloc: a reservation the size of the device has
  /// an entry per page of the device (about 540 KB on a 141 GB one), and
  /// the host gives zeroed pages it has not touched for free, so a
  /// reservation costs host memory for the pages mapped, not its size.
  void reset(std::size_t count) {
    std::unique_ptr<physical_handle_t[], free_deleter> fresh(
        static_cast<physical_handle_t*>(std::calloc(count == 0 ? 1 : count, sizeof(physical_handle_t))));
    if (!fresh) throw std::bad_alloc();  // nothing changed
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
  struct free_deleter {
    void operator()(physical_handle_t* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<physical_handle_t[], free_deleter> handles_;  // per page; 0 = not mapped in the books
  std::size_t count_ = 0;
  std::vector<retired_page> retired_;       // by index
};

}  // namespace ccalloc::detail

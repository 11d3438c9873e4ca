// A registration table built only from mapping announcements (SPEC C1), as
// NCCL's user-buffer registration would keep it: a map inserts its range,
// an unmap erases it. Used by the tests to check that the table equals what
// the allocator has mapped, and that nothing is unmapped while in it.
#pragma once

#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/mapping_events.hpp>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ccalloc::testing {

/// Disjoint ranges [first, second), merged where they touch.
using range_list = std::vector<std::pair<std::uintptr_t, std::uintptr_t>>;

class mapping_table {
 public:
  /// Applies one announcement; a map that overlaps the table or an unmap not
  /// wholly in it is an error, kept (first one) for error().
  void apply(const mapping_event& e) {
    std::lock_guard lock(mutex_);
    ++events_;
    const std::uintptr_t lo = e.addr;
    const std::uintptr_t hi = e.addr + e.size_bytes;
    if (e.size_bytes == 0) return fail(e, "empty range");
    if (e.change == mapping_change::map) {
      auto it = ranges_.upper_bound(lo);
      if (it != ranges_.end() && it->first < hi) return fail(e, "map overlaps a mapped range");
      if (it != ranges_.begin() && std::prev(it)->second > lo) return fail(e, "map overlaps a mapped range");
      bytes_ += e.size_bytes;
      std::uintptr_t a = lo;
      std::uintptr_t b = hi;
      if (it != ranges_.end() && it->first == hi) {  // merge with touching neighbours
        b = it->second;
        it = ranges_.erase(it);
      }
      if (it != ranges_.begin() && std::prev(it)->second == lo) {
        a = std::prev(it)->first;
        ranges_.erase(std::prev(it));
      }
      ranges_[a] = b;
    } else if (e.change == mapping_change::unmap) {
      auto it = ranges_.upper_bound(lo);
      if (it == ranges_.begin()) return fail(e, "unmap of an unmapped range");
      --it;
      if (it->second < hi) return fail(e, "unmap of a range not wholly mapped");
      const auto [a, b] = *it;
      ranges_.erase(it);
      if (a < lo) ranges_[a] = lo;
      if (hi < b) ranges_[hi] = b;
      bytes_ -= e.size_bytes;
    } else if (e.change == mapping_change::move) {
      if (!covered(lo, hi)) return fail(e, "move of a range not mapped");
    }
  }
  /// The table's ranges, merged.
  [[nodiscard]] range_list ranges() const {
    std::lock_guard lock(mutex_);
    range_list out;
    for (const auto& [lo, hi] : ranges_) {
      if (!out.empty() && out.back().second == lo) out.back().second = hi;
      else out.emplace_back(lo, hi);
    }
    return out;
  }
  [[nodiscard]] std::size_t bytes() const {
    std::lock_guard lock(mutex_);
    return bytes_;
  }
  [[nodiscard]] std::size_t events() const {
    std::lock_guard lock(mutex_);
    return events_;
  }
  [[nodiscard]] std::string error() const {
    std::lock_guard lock(mutex_);
    return error_;
  }

 private:
  bool covered(std::uintptr_t lo, std::uintptr_t hi) const {
    auto it = ranges_.upper_bound(lo);
    if (it == ranges_.begin()) return false;
    --it;
    while (it != ranges_.end() && it->first <= lo && lo < hi) {
      lo = it->second;
      ++it;
    }
    return lo >= hi;
  }
  void fail(const mapping_event& e, const char* what) {
    if (error_.empty())
      error_ = std::string(what) + ": " + std::string(to_string(e.change)) + " (" + std::string(to_string(e.reason)) +
               ") of " + std::to_string(e.size_bytes) + " bytes at offset " + std::to_string(e.addr);
  }
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::uintptr_t> ranges_;
  std::size_t bytes_ = 0;
  std::size_t events_ = 0;
  std::string error_;
};

/// What the allocator has mapped: its mapped blocks, merged.
inline range_list mapped_ranges(device_caching_allocator& dev) {
  std::map<std::uintptr_t, std::uintptr_t> all;
  for (const auto& seg : dev.segments())
    for (const auto& b : seg.blocks)
      if (b.mapped) all[b.address] = b.address + b.size_bytes;
  range_list out;
  for (const auto& [lo, hi] : all) {
    if (!out.empty() && out.back().second == lo) out.back().second = hi;
    else out.emplace_back(lo, hi);
  }
  return out;
}

}  // namespace ccalloc::testing

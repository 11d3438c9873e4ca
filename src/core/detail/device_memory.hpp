// The memory accounting of one device: its total memory, the cap (the
// per-process memory fraction), the bytes reserved against it and their
// high-water mark (with the count of recyclings for a new peak since it
// last rose: recycles_per_peak), and the segment the running slow path made
// (given back whole, with the mark, if its request fails). Owns these
// figures only; the device changes them where it maps or frees memory.
// Guarded by device_mutex_ (the world lock where the slow path changes them).
#pragma once

#include "pools.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace ccalloc::detail {

class device_memory {
 public:
  // The segment or reservation (by base) that the running slow path made
  // for request `owner` (alloc_segment, new_expandable_segment), with the
  // mark before it: if the request fails (host out of memory on the way),
  // it goes back whole (discard_made_segment) and the mark comes back down.
  struct made_segment {
    const alloc_params* owner = nullptr;
    std::uintptr_t base = 0;
    std::size_t high_water_bytes = 0;
    std::size_t recycles_at_mark = 0;
  };

  // The device's total memory (the constructor of device_state); the cap is none.
  void set_total(std::size_t total_bytes) noexcept {
    total_ = total_bytes;
    allowed_ = total_bytes;
  }
  [[nodiscard]] std::size_t total() const noexcept { return total_; }
  // fraction x total when capped(), else total.
  [[nodiscard]] std::size_t allowed() const noexcept { return allowed_; }
  [[nodiscard]] bool capped() const noexcept { return capped_; }
  [[nodiscard]] double fraction() const noexcept { return capped_ ? fraction_ : 1.0; }
  // The cap in bytes, or the device's total without one.
  [[nodiscard]] std::size_t limit() const noexcept { return capped_ ? allowed_ : total_; }
  // Whether `need` more reserved bytes would pass the cap.
  [[nodiscard]] bool over_cap(std::size_t need) const noexcept { return capped_ && reserved_ + need > allowed_; }
  // The cap for `fraction` (in [0, 1]) of the total: fraction x total in
  // double; at 2^64 bytes and above (a huge simulated device) the
  // conversion would overflow, and the cap is then no cap.
  [[nodiscard]] std::size_t allowed_for(double fraction) const noexcept {
    const double allowed_real = fraction * static_cast<double>(total_);
    constexpr auto max_bytes = std::numeric_limits<std::size_t>::max();
    return allowed_real >= static_cast<double>(max_bytes)  // 2^64 once a double
               ? max_bytes
               : static_cast<std::size_t>(allowed_real);
  }
  void set_cap(double fraction, std::size_t allowed) noexcept {
    fraction_ = fraction == 0.0 ? 0.0 : fraction;  // -0.0 becomes 0
    capped_ = true;
    allowed_ = allowed;
  }

  // Sum of the segments' sizes (plain) and mapped pages (expandable).
  [[nodiscard]] std::size_t reserved() const noexcept { return reserved_; }
  void add_reserved(std::size_t bytes) noexcept { reserved_ += bytes; }
  void remove_reserved(std::size_t bytes) noexcept { reserved_ -= bytes; }

  // Highest reserved bytes ever (unlike the stats' peaks, reset_peak_stats keeps it).
  [[nodiscard]] std::size_t high_water() const noexcept { return high_water_; }
  // Recyclings for a new peak since high_water() last rose.
  [[nodiscard]] std::size_t recycles_at_mark() const noexcept { return recycles_at_mark_; }
  void note_recycle() noexcept { ++recycles_at_mark_; }
  // high_water = max(itself, reserved); a rise restarts the count of
  // recycles_per_peak.
  void raise_high_water() noexcept {
    if (reserved_ <= high_water_) return;
    high_water_ = reserved_;
    recycles_at_mark_ = 0;  // a new mark: recycling may start again (recycles_per_peak)
  }

  // made_segment: noted where it is made, taken (and cleared) by the
  // request's failure path, cleared once released or kept.
  void note_made(const alloc_params* owner, std::uintptr_t base) noexcept {
    made_ = {owner, base, high_water_, recycles_at_mark_};
  }
  void clear_made() noexcept { made_ = {}; }
  [[nodiscard]] made_segment take_made() noexcept {
    const made_segment m = made_;
    made_ = {};
    return m;
  }
  // After a made segment went back: the mark as it was before it, unless
  // reserved memory still stands above that.
  void restore_mark(const made_segment& m) noexcept {
    if (high_water_ <= m.high_water_bytes) return;
    high_water_ = std::max(m.high_water_bytes, reserved_);
    if (high_water_ == m.high_water_bytes) recycles_at_mark_ = m.recycles_at_mark;
  }

 private:
  bool capped_ = false;
  double fraction_ = 1.0;
  std::size_t allowed_ = 0;
  std::size_t total_ = 0;
  std::size_t reserved_ = 0;
  std::size_t high_water_ = 0;
  std::size_t recycles_at_mark_ = 0;
  made_segment made_;
};

}  // namespace ccalloc::detail

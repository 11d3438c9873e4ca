// The recycling time budget (recycle_time_percent): how much host time
// recycling free pages for a new peak may take. A token bucket in
// microseconds of host time, plus a reserve:
//
//   bucket   fills at `percent` of the time that passes, up to percent x
//            window_us; recycling for a new peak spends what it took.
//   reserve  keeps the refill that the full bucket cannot hold, up to
//            percent x reserve_window_us; pays only for large peaks found
//            with the bucket empty.
//
// Both start full at the first refill and never hold more than their
// depth, nor a debt of more than their depth (one long recycling delays the
// next by a window at most). Together they never gain more than `percent`
// of the time passing. Why a reserve: docs/design.md, "Note: the recycling
// reserve".
//
// The type reads no clock: the caller passes host-clock readings (so that
// device_state keeps its order of clock reads) and the configured percent
// (set_config may change it; a smaller percent holds at the next refill).
// Not thread-safe: device_state guards it with the world lock.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>

namespace ccalloc::detail {

class recycle_budget {
 public:
  /// Which budget pays for a recycling: none (the mark rises instead), the
  /// bucket or the reserve.
  enum class source : unsigned char { none, bucket, reserve };

  static constexpr std::uint64_t window_us = 1'000'000;
  static constexpr std::uint64_t reserve_window_us = 10'000'000;

  /// The bucket's depth at `percent` (0-100), microseconds.
  [[nodiscard]] static double depth_us(unsigned percent) noexcept {
    return static_cast<double>(percent) / 100.0 * static_cast<double>(window_us);
  }
  /// The reserve's depth at `percent`, microseconds.
  [[nodiscard]] static double reserve_depth_us(unsigned percent) noexcept {
    return static_cast<double>(percent) / 100.0 * static_cast<double>(reserve_window_us);
  }

  /// Which budget may pay now: the bucket at 100 percent or without a
  /// clock (`read_clock` returns nullopt); none at 0 percent; else, after a
  /// refill up to the clock's reading, the bucket while it holds time, the
  /// reserve for a large peak while it holds time, else none. The clock is
  /// read only between 1 and 99 percent.
  template <class Clock>
  [[nodiscard]] source choose(unsigned percent, bool large_peak, Clock&& read_clock) {
    if (percent >= 100) return source::bucket;
    if (percent == 0) return source::none;
    const std::optional<std::uint64_t> now = read_clock();
    if (!now) return source::bucket;
    refill(percent, *now);
    if (tokens_us_ > 0.0) return source::bucket;
    return large_peak && reserve_us_ > 0.0 ? source::reserve : source::none;
  }

  /// Refills both for the time since the last refill (`now_us`, a host
  /// clock reading; a reading earlier than the last one adds nothing).
  /// Bounds both to the depths at `percent` first.
  void refill(unsigned percent, std::uint64_t now_us) noexcept {
    const double depth = depth_us(percent);
    const double reserve_depth = reserve_depth_us(percent);
    if (!clock_us_) {
      tokens_us_ = depth;
      reserve_us_ = reserve_depth;
    } else {
      tokens_us_ = std::clamp(tokens_us_, -depth, depth);
      reserve_us_ = std::clamp(reserve_us_, -reserve_depth, reserve_depth);
      if (now_us > *clock_us_) {
        const double share = static_cast<double>(percent) / 100.0;
        const double filled = tokens_us_ + share * static_cast<double>(now_us - *clock_us_);
        tokens_us_ = std::min(depth, filled);
        reserve_us_ = std::min(reserve_depth, reserve_us_ + (filled - tokens_us_));
      }
    }
    clock_us_ = std::max(clock_us_.value_or(0), now_us);
  }

  /// Takes `spent_us` out of `from` (nothing for source::none), down to a
  /// debt of one depth at `percent`.
  void spend(source from, unsigned percent, double spent_us) noexcept {
    if (from == source::bucket)
      tokens_us_ = std::max(-depth_us(percent), tokens_us_ - spent_us);
    else if (from == source::reserve)
      reserve_us_ = std::max(-reserve_depth_us(percent), reserve_us_ - spent_us);
  }

  [[nodiscard]] double tokens_us() const noexcept { return tokens_us_; }
  [[nodiscard]] double reserve_us() const noexcept { return reserve_us_; }

  /// Whether both lie within one depth at `percent` either side (after a
  /// refill at that percent: a lowered percent holds from then on).
  [[nodiscard]] bool within_bounds(unsigned percent) const noexcept {
    const double d = depth_us(percent), r = reserve_depth_us(percent);
    return tokens_us_ >= -d && tokens_us_ <= d && reserve_us_ >= -r && reserve_us_ <= r;
  }

 private:
  double tokens_us_ = 0.0;
  double reserve_us_ = 0.0;
  std::optional<std::uint64_t> clock_us_;  // the last refill's reading; nullopt: none yet
};

}  // namespace ccalloc::detail

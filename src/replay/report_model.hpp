// The model of the HTML report (private to src/replay/): what the page
// shows, computed from the trace and two replays, without any HTML. The
// page itself is written by report.cpp.
#pragma once

#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/replay/report.hpp>
#include <ccalloc/replay/trace.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ccalloc::report_detail {

// ---- time slices ----------------------------------------------------------------

/// The highest value of a step function in each of `n` slices of the x range;
/// a slice without events holds the value the previous one ended with.
class sliced_series {
 public:
  explicit sliced_series(std::size_t n) : max_(n, -1), last_(n, -1) {}
  void add(std::size_t slice, std::int64_t value) {
    max_[slice] = std::max(max_[slice], value);
    last_[slice] = value;
  }
  /// The per-slice maxima, gaps filled.
  [[nodiscard]] std::vector<std::int64_t> finish() const {
    std::vector<std::int64_t> out(max_.size());
    std::int64_t carry = 0;
    for (std::size_t i = 0; i < max_.size(); ++i) {
      out[i] = max_[i] < 0 ? carry : std::max(max_[i], carry);
      if (last_[i] >= 0) carry = last_[i];
    }
    return out;
  }

 private:
  std::vector<std::int64_t> max_;
  std::vector<std::int64_t> last_;
};

/// Maps an event to its slice: by recorded time when the trace has a time
/// span, else by event index.
struct slicer {
  std::size_t n = 0;
  bool by_time = true;
  std::uint64_t t0 = 0;
  double span = 1;  // seconds (by time) or events
  slicer(const trace& t, std::size_t slices) : n(slices) {
    t0 = t.events.front().time_us;
    const std::uint64_t t1 = t.events.back().time_us;
    by_time = t1 > t0;
    span = by_time ? double(t1 - t0) / 1e6 : double(std::max<std::size_t>(t.events.size() - 1, 1));
  }
  [[nodiscard]] double x(const trace& t, std::size_t i) const {
    return by_time ? double(t.events[i].time_us - t0) / 1e6 : double(i);
  }
  [[nodiscard]] std::size_t slice(const trace& t, std::size_t i) const {
    const auto s = static_cast<std::size_t>(x(t, i) / span * double(n));
    return std::min(s, n - 1);
  }
};

/// The recording allocator's curves, from the trace's own events.
struct recorded_curves {
  std::vector<std::int64_t> requested;
  std::vector<std::int64_t> reserved;  // empty when the trace has no segment events
  std::uint64_t requested_peak = 0;
  std::uint64_t reserved_peak = 0;
  std::uint64_t segment_allocs = 0;
};

recorded_curves curves_from_trace(const trace& t, const slicer& sl);

/// One of the largest allocations of the trace.
struct big_allocation {
  std::uint64_t size = 0;
  std::uint64_t stream = 0;
  double alloc_x = 0;
  double free_x = -1;  // -1: live at the end
  std::uint64_t line = 0;
};

/// The `n` largest allocations of `t`, largest first.
std::vector<big_allocation> largest_allocations(const trace& t, const slicer& sl, std::size_t n);

/// Bytes live at one allocation site (trace::sites).
struct site_row {
  std::uint32_t site = 0;  // 1-based index into trace::sites
  std::uint64_t bytes = 0;
  std::size_t blocks = 0;
};

/// The `n` sites with the most requested bytes live (alloc to
/// free_completed) after event `peak_index`, most bytes first (ties: lower
/// site first); empty when `t` has no sites. One pass over the events up to
/// the peak.
std::vector<site_row> sites_at_peak(const trace& t, std::size_t peak_index, std::size_t n);

/// The time chart's curves (ccalloc's replay and the recording allocator).
struct chart_data {
  std::vector<double> x;  // slice start, seconds or events
  std::vector<std::int64_t> requested, allocated, reserved, recorded_reserved;
  /// Paused bytes of all tags (sleep and wake); empty for a trace without pauses.
  std::vector<std::int64_t> paused;
  bool by_time = true;
  double span = 1;
  double peak_x = 0;
};

/// One row of the fragmentation table: a (stream, pool) at the peak.
struct pool_row {
  std::uint64_t stream = 0;
  bool small = false;
  std::size_t segments = 0;
  std::uint64_t reserved = 0, allocated = 0, requested = 0, pending = 0, largest_free = 0;
};

/// The rows of `segments`, by (stream, pool).
std::vector<pool_row> fragmentation_rows(const std::vector<segment_info>& segments);

/// Everything the page draws that takes a replay.
struct report_model {
  slicer sl;
  recorded_curves recorded;
  chart_data chart;
  std::vector<segment_info> at_peak;  // the segments at the peak event
  report_summary sum;
  std::size_t peak_index = 0;
};

/// Pass 1 (the full replay: ccalloc's curves and the peak) and pass 2 (up to
/// the peak, for its segments). Throws as render_report_html.
report_model build_report_model(const trace& t, const report_options& options);

}  // namespace ccalloc::report_detail

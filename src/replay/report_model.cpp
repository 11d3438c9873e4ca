// report_model.cpp: the numbers of the HTML report (report_model.hpp).
//
// Pipeline: curves_from_trace (the recording allocator, from the trace's own
// events) -> pass 1, replay_trace with an after_event hook that reads
// ccalloc's statistics after every event into time slices and finds the
// peak -> pass 2, replay_trace again up to the peak and take the segments
// there. report.cpp draws the page from it.
#include "report_model.hpp"

#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <algorithm>
#include <map>
#include <queue>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ccalloc::report_detail {

std::vector<site_row> sites_at_peak(const trace& t, std::size_t peak_index, std::size_t n) {
  if (t.sites.empty() || t.events.empty()) return {};
  std::unordered_map<std::uint64_t, std::pair<std::uint64_t, std::uint32_t>> live;  // addr -> size, site
  const std::size_t last = std::min(peak_index, t.events.size() - 1);
  for (std::size_t i = 0; i <= last; ++i) {
    const trace_event& e = t.events[i];
    if (e.action == trace_action::alloc) live[e.addr] = {e.size, e.site};
    else if (e.action == trace_action::free_completed) live.erase(e.addr);
  }
  std::vector<site_row> rows(t.sites.size() + 1);
  for (const auto& [addr, a] : live) {
    rows[a.second].bytes += a.first;
    ++rows[a.second].blocks;
  }
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i].site = static_cast<std::uint32_t>(i);
  // Site 0 (allocations without frames) is listed too when it holds bytes.
  std::vector<site_row> out;
  for (const site_row& r : rows)
    if (r.blocks != 0) out.push_back(r);
  std::sort(out.begin(), out.end(), [](const site_row& a, const site_row& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.site < b.site;
  });
  if (out.size() > n) out.resize(n);
  return out;
}

recorded_curves curves_from_trace(const trace& t, const slicer& sl) {
  sliced_series requested(sl.n), reserved(sl.n);
  std::unordered_map<std::uint64_t, std::uint64_t> live;  // addr -> requested bytes (until free_completed)
  std::int64_t req = 0, res = 0;
  bool has_segments = false;
  recorded_curves out;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const trace_event& e = t.events[i];
    switch (e.action) {
      case trace_action::alloc:
        live[e.addr] = e.size;
        req += static_cast<std::int64_t>(e.size);
        break;
      case trace_action::free_completed:
        if (auto it = live.find(e.addr); it != live.end()) {
          req -= static_cast<std::int64_t>(it->second);
          live.erase(it);
        }
        break;
      case trace_action::segment_alloc:
      case trace_action::segment_map:
        has_segments = true;
        res += static_cast<std::int64_t>(e.size);
        out.segment_allocs += e.action == trace_action::segment_alloc;
        break;
      case trace_action::segment_free:
      case trace_action::segment_unmap:
        has_segments = true;
        res = std::max<std::int64_t>(0, res - static_cast<std::int64_t>(e.size));
        break;
      default:
        break;
    }
    const std::size_t s = sl.slice(t, i);
    requested.add(s, req);
    reserved.add(s, res);
    out.requested_peak = std::max(out.requested_peak, static_cast<std::uint64_t>(req));
    out.reserved_peak = std::max(out.reserved_peak, static_cast<std::uint64_t>(res));
  }
  out.requested = requested.finish();
  if (has_segments) out.reserved = reserved.finish();
  else out.reserved_peak = 0;
  return out;
}

std::vector<big_allocation> largest_allocations(const trace& t, const slicer& sl, std::size_t n) {
  struct open_alloc {
    std::size_t index;
  };
  std::unordered_map<std::uint64_t, std::size_t> live;  // addr -> alloc index
  auto smaller = [](const big_allocation& a, const big_allocation& b) {
    return std::tie(a.size, b.line) > std::tie(b.size, a.line);  // min-heap by size, later lines first out
  };
  std::priority_queue<big_allocation, std::vector<big_allocation>, decltype(smaller)> top(smaller);
  auto offer = [&](std::size_t alloc_index, double free_x) {
    const trace_event& a = t.events[alloc_index];
    if (top.size() == n && a.size <= top.top().size) return;
    top.push({a.size, a.stream, sl.x(t, alloc_index), free_x, a.line});
    if (top.size() > n) top.pop();
  };
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const trace_event& e = t.events[i];
    if (e.action == trace_action::alloc) {
      live[e.addr] = i;
    } else if (e.action == trace_action::free_requested) {
      if (auto it = live.find(e.addr); it != live.end()) {
        offer(it->second, sl.x(t, i));
        live.erase(it);
      }
    }
  }
  for (const auto& [addr, index] : live) offer(index, -1);
  std::vector<big_allocation> out;
  while (!top.empty()) {
    out.push_back(top.top());
    top.pop();
  }
  std::reverse(out.begin(), out.end());
  return out;
}

}  // namespace ccalloc::report_detail

namespace ccalloc {

recorded_figures recorded_allocator_figures(const trace& t) {
  recorded_figures f;
  if (t.events.empty()) return f;
  const report_detail::recorded_curves c = report_detail::curves_from_trace(t, report_detail::slicer(t, 1));
  f.has_segments = !c.reserved.empty();
  f.requested_peak = c.requested_peak;
  f.reserved_peak = c.reserved_peak;
  f.segment_allocs = c.segment_allocs;
  return f;
}

}  // namespace ccalloc

namespace ccalloc::report_detail {

std::vector<pool_row> fragmentation_rows(const std::vector<segment_info>& segments) {
  std::map<std::pair<std::uint64_t, bool>, pool_row> rows;
  for (const auto& s : segments) {
    pool_row& r = rows[{s.stream, s.is_small_pool}];
    r.stream = s.stream;
    r.small = s.is_small_pool;
    ++r.segments;
    r.reserved += s.total_bytes;
    r.allocated += s.allocated_bytes;
    r.pending += s.active_bytes - s.allocated_bytes;
    for (const auto& b : s.blocks) {
      // Requested counts live blocks only, so that requested <= allocated
      // in every row; freed blocks waiting on other streams are `pending`.
      if (b.state == block_state::active_allocated) r.requested += b.requested_bytes;
      if (b.state == block_state::inactive) r.largest_free = std::max<std::uint64_t>(r.largest_free, b.size_bytes);
    }
  }
  std::vector<pool_row> out;
  for (auto& [k, r] : rows) out.push_back(r);
  return out;
}

// Paused bytes after each event (the last pause or resume at or before it), by slice.
auto paused_curve(const trace& t, const slicer& sl, const std::vector<replay_sleep_event>& sleeps) {
  sliced_series paused(sl.n);
  std::size_t k = 0;
  std::int64_t now = 0;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    while (k < sleeps.size() && sleeps[k].index <= i) now = static_cast<std::int64_t>(sleeps[k++].paused_total_bytes);
    paused.add(sl.slice(t, i), now);
  }
  return paused.finish();
}

report_model build_report_model(const trace& t, const report_options& options) {
  if (t.events.empty()) throw invalid_argument_error("ccalloc report: " + t.source + " has no events");
  if (options.plot_points < 2)
    throw invalid_argument_error("ccalloc report: plot_points must be at least 2, got " +
                                 std::to_string(options.plot_points));
  const std::size_t n = t.events.size();
  const slicer sl(t, std::min(options.plot_points, n));
  const recorded_curves recorded = curves_from_trace(t, sl);

  // Pass 1: the full replay, ccalloc's curves, and the peak.
  sliced_series requested(sl.n), allocated(sl.n), reserved(sl.n);
  std::pair<std::int64_t, std::int64_t> peak{-1, -1};
  std::size_t peak_index = 0;
  const std::size_t progress_every = std::max<std::size_t>(1, n / 200);
  replay_options ro;
  ro.config = options.config;
  ro.device_memory_bytes = options.device_memory_bytes;
  ro.after_event = [&](std::size_t i, caching_allocator& a) {
    const device_stats s = a.get_device_stats(0);
    const std::int64_t res = s.reserved_bytes[0].current, al = s.allocated_bytes[0].current;
    const std::size_t slice = sl.slice(t, i);
    requested.add(slice, s.requested_bytes[0].current);
    allocated.add(slice, al);
    reserved.add(slice, res);
    if (std::pair{res, al} > peak) {
      peak = {res, al};
      peak_index = i;
    }
    if (options.progress && (i + 1) % progress_every == 0) options.progress(1, i + 1, n);
    return true;
  };
  report_summary sum;
  sum.replay = replay_trace(t, ro);
  if (options.progress) options.progress(1, n, n);
  sum.peak_event_index = peak_index;
  sum.recorded_reserved_peak = recorded.reserved_peak;
  sum.recorded_requested_peak = recorded.requested_peak;

  // Pass 2: up to the peak, for its segments. It replays pass 1's events:
  // an out-of-memory in it is one of pass 1's, whose oom_snapshot is
  // written already (a second write would replace it for nothing, or find
  // a FIFO's reader gone).
  if (allocator_config c = allocator_config::parse(ro.config); !c.oom_snapshot_path.empty()) {
    c.oom_snapshot_path.clear();
    ro.config = c.to_string();
  }
  std::vector<segment_info> at_peak;
  ro.after_event = [&](std::size_t i, caching_allocator& a) {
    if (options.progress && (i + 1) % progress_every == 0) options.progress(2, i + 1, peak_index + 1);
    if (i < peak_index) return true;
    at_peak = a.device_allocator(0).snapshot_segments();  // mapped runs, as PyTorch shows them
    sum.live_segments_at_peak = static_cast<std::size_t>(a.get_device_stats(0).segment[0].current);
    return false;
  };
  (void)replay_trace(t, ro);
  if (options.progress) options.progress(2, peak_index + 1, peak_index + 1);
  sum.segments_at_peak = at_peak.size();
  for (const auto& s : at_peak) sum.blocks_at_peak += s.blocks.size();

  chart_data c;
  c.by_time = sl.by_time;
  c.span = sl.span;
  c.requested = requested.finish();
  c.allocated = allocated.finish();
  c.reserved = reserved.finish();
  c.recorded_reserved = recorded.reserved;
  if (!sum.replay.sleep_events.empty()) c.paused = paused_curve(t, sl, sum.replay.sleep_events);
  for (std::size_t i = 0; i < sl.n; ++i) c.x.push_back(sl.span * double(i) / double(sl.n));
  c.peak_x = sl.x(t, peak_index);
  sum.plot_points = sl.n;
  return report_model{sl, recorded, std::move(c), std::move(at_peak), sum, peak_index};
}

}  // namespace ccalloc::report_detail

namespace ccalloc {

double shown_fragmentation(const replay_result& r) noexcept {
  if (r.peak_unpaused_allocated_bytes == 0) return r.fragmentation();
  return double(r.peak_reserved_bytes) / double(r.peak_unpaused_allocated_bytes);
}

}  // namespace ccalloc

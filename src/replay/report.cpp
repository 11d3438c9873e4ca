// report.cpp: the HTML report of a trace (include/ccalloc/replay/report.hpp):
// the page, written from the model that report_model.cpp computes (the
// curves, the peak, the segments there): summary, time chart, segment map,
// fragmentation table, largest allocations. Everything is drawn here as SVG;
// nothing is loaded.
#include <ccalloc/replay/report.hpp>

#include "report_model.hpp"

#include <ccalloc/base/detail/bytes_text.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/snapshot.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <map>
#include <queue>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ccalloc {

namespace {

using namespace report_detail;

// ---- text helpers -------------------------------------------------------------

[[gnu::format(printf, 1, 2)]] std::string fmt(const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list again;
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  std::string out(n > 0 ? static_cast<std::size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(out.data(), out.size() + 1, format, again);
  va_end(again);
  return out;
}

using detail::format_bytes;

std::string with_commas(std::uint64_t value) {
  std::string digits = std::to_string(value), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i != 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// Text for the UTF-8 page, escaped: bytes that are not UTF-8 (a file name
// or --title of other bytes, legal on Linux) become U+FFFD (valid_utf8, as
// the snapshot's JSON and the CLI's --json write them).
std::string html(std::string_view s) {
  std::string out;
  for (const char c : valid_utf8(s)) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string seconds_text(double s) {
  if (s == 0) return "0 s";
  if (s < 1e-3) return fmt("%.0f µs", s * 1e6);
  if (s < 1) return fmt("%.1f ms", s * 1e3);
  if (s < 120) return fmt("%.2f s", s);
  return fmt("%.1f min", s / 60);
}

/// About `target` round tick values covering [0, max]: steps of 1, 2 or 5 x 10^k.
std::vector<double> ticks(double max, int target = 5) {
  if (!(max > 0)) return {0};
  const double raw = max / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (const double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * mag) {
      step = m * mag;
      break;
    }
  std::vector<double> out;
  for (double v = 0; v <= max * 1.0001; v += step) out.push_back(v);
  return out;
}

/// Tick labels for bytes: the unit is chosen from the largest value.
struct byte_axis {
  double unit = 1;
  const char* name = "B";
  explicit byte_axis(double max) {
    const std::pair<double, const char*> units[] = {
        {double(std::uint64_t{1} << 40), "TiB"}, {double(gib), "GiB"}, {double(mib), "MiB"}, {double(kib), "KiB"}};
    for (const auto& [u, n] : units)
      if (max >= u) {
        unit = u;
        name = n;
        break;
      }
  }
};

// ---- the pieces of the page -----------------------------------------------------

constexpr const char* color_requested = "#bac8d6";
constexpr const char* color_allocated = "#59a14f";
constexpr const char* color_reserved = "#2f6db5";
constexpr const char* color_recorded = "#e8772e";
constexpr const char* color_paused = "#8e44ad";
constexpr const char* color_block = "#4e79a7";
constexpr const char* color_rounding = "#a0cbe8";
constexpr const char* color_pending = "#f28e2c";
constexpr const char* color_free = "#eef1f5";


std::string polyline_points(const std::vector<std::int64_t>& v, const std::vector<double>& xs, double x_scale,
                            double y_scale, double left, double bottom, bool close_to_base) {
  std::string out;
  out.reserve(v.size() * 16);
  if (close_to_base) out += fmt("%.1f,%.1f ", left + xs.front() * x_scale, bottom);
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double y = bottom - double(v[i]) * y_scale;
    // A step: the slice's value holds from its start to the next slice's start.
    out += fmt("%.1f,%.1f ", left + xs[i] * x_scale, y);
    const double next_x = i + 1 < xs.size() ? xs[i + 1] : xs[i] + (xs.size() > 1 ? xs[1] - xs[0] : 1);
    out += fmt("%.1f,%.1f ", left + next_x * x_scale, y);
  }
  if (close_to_base) {
    const double end_x = xs.back() + (xs.size() > 1 ? xs[1] - xs[0] : 1);
    out += fmt("%.1f,%.1f", left + end_x * x_scale, bottom);
  }
  return out;
}

std::string time_chart_svg(const chart_data& c) {
  constexpr double W = 1040, H = 360, L = 72, R = 16, T = 16, B = 44;
  const double plot_w = W - L - R, plot_h = H - T - B;
  std::int64_t max_v = 1;
  for (const auto* s : {&c.requested, &c.allocated, &c.reserved, &c.recorded_reserved, &c.paused})
    for (const std::int64_t v : *s) max_v = std::max(max_v, v);
  const byte_axis unit{static_cast<double>(max_v)};
  // Headroom above the highest curve, so that it does not run along the frame.
  std::vector<double> yt = ticks(double(max_v) * 1.1 / unit.unit);
  const double y_max = std::max(yt.back(), double(max_v) * 1.1 / unit.unit) * unit.unit;
  const double x_end = c.span;
  const double xs = plot_w / x_end, ys = plot_h / y_max, bottom = T + plot_h;
  std::string o;
  o += fmt("<svg id=\"timechart\" viewBox=\"0 0 %.0f %.0f\" width=\"%.0f\" height=\"%.0f\" role=\"img\" "
           "aria-label=\"bytes over time\">\n", W, H, W, H);
  o += fmt("<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"#fbfcfd\" stroke=\"#d5dbe2\"/>\n", L, T,
           plot_w, plot_h);
  for (const double v : yt) {
    const double y = bottom - v * unit.unit * ys;
    o += fmt("<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#e3e7ec\"/>", L, L + plot_w, y, y);
    o += fmt("<text x=\"%.0f\" y=\"%.1f\" class=\"tick\" text-anchor=\"end\">%g %s</text>\n", L - 6, y + 4, v,
             unit.name);
  }
  for (const double v : ticks(x_end, 8)) {
    const double x = L + v * xs;
    o += fmt("<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.0f\" y2=\"%.0f\" stroke=\"#eef1f4\"/>", x, x, T, bottom);
    o += fmt("<text x=\"%.1f\" y=\"%.0f\" class=\"tick\" text-anchor=\"middle\">%s</text>\n", x, bottom + 16,
             c.by_time ? seconds_text(v).c_str() : with_commas(static_cast<std::uint64_t>(v)).c_str());
  }
  o += fmt("<text x=\"%.0f\" y=\"%.0f\" class=\"axis\" text-anchor=\"middle\">%s</text>\n", L + plot_w / 2, H - 6,
           c.by_time ? "time since the first event (recorded clock)" : "event");
  o += fmt("<polygon points=\"%s\" fill=\"%s\" fill-opacity=\"0.75\"/>\n",
           polyline_points(c.requested, c.x, xs, ys, L, bottom, true).c_str(), color_requested);
  if (!c.recorded_reserved.empty())
    o += fmt("<polyline class=\"curve\" points=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"2\" "
             "stroke-dasharray=\"6 4\"/>\n",
             polyline_points(c.recorded_reserved, c.x, xs, ys, L, bottom, false).c_str(), color_recorded);
  o += fmt("<polyline class=\"curve\" points=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\"/>\n",
           polyline_points(c.allocated, c.x, xs, ys, L, bottom, false).c_str(), color_allocated);
  o += fmt("<polyline class=\"curve\" points=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"2.2\"/>\n",
           polyline_points(c.reserved, c.x, xs, ys, L, bottom, false).c_str(), color_reserved);
  if (!c.paused.empty())
    o += fmt("<polyline class=\"curve\" points=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.8\" "
             "stroke-dasharray=\"2 3\"/>\n",
             polyline_points(c.paused, c.x, xs, ys, L, bottom, false).c_str(), color_paused);
  const double px = L + c.peak_x * xs;
  o += fmt("<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.0f\" y2=\"%.0f\" stroke=\"#c0392b\" stroke-dasharray=\"3 3\"/>"
           "<text x=\"%.1f\" y=\"%.0f\" class=\"tick\" fill=\"#c0392b\" text-anchor=\"%s\">segment map</text>\n",
           px, px, T, bottom, px + (px > L + plot_w - 90 ? -4 : 4), T + 12, px > L + plot_w - 90 ? "end" : "start");
  o += fmt("<line id=\"cursor\" x1=\"0\" x2=\"0\" y1=\"%.0f\" y2=\"%.0f\" stroke=\"#555\" visibility=\"hidden\"/>\n", T,
           bottom);
  o += fmt("<rect id=\"hit\" x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"transparent\" "
           "data-left=\"%.0f\" data-width=\"%.0f\"/>\n", L, T, plot_w, plot_h, L, plot_w);
  o += "</svg>\n";
  return o;
}

std::string chart_json(const chart_data& c) {
  auto arr = [](const std::vector<std::int64_t>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i != 0) s += ',';
      s += fmt("%.2f", double(v[i]) / double(mib));  // no "," + std::string: GCC 12 -O3 misreports -Wrestrict
    }
    return s + "]";
  };
  std::string s = "{\"by_time\":" + std::string(c.by_time ? "true" : "false") + fmt(",\"span\":%.6g", c.span) +
                  ",\"requested\":" + arr(c.requested) + ",\"allocated\":" + arr(c.allocated) +
                  ",\"reserved\":" + arr(c.reserved) + ",\"recorded\":" + arr(c.recorded_reserved) +
                  (c.paused.empty() ? std::string() : ",\"paused\":" + arr(c.paused)) + "}";
  return s;
}

/// Where segment_map_svg draws a segment: the map's left margin (pixels),
/// the segment's offset in its row (bytes), its top (pixels), pixels per
/// byte, and the row's height.
struct segment_place {
  double pad;
  double x;
  double y;
  double scale;
  double row_h;
};

/// The blocks of segment s inside its rectangle: each block of 3 pixels or
/// more with its requested bytes and rounding; runs of tiny blocks of one
/// kind merged into one rectangle. Counts the rectangles in drawn_rects.
void draw_blocks(std::string& o, const segment_info& s, const segment_place& at, std::size_t& drawn_rects) {
  double run_x = -1, run_end = 0;
  const char* run_color = nullptr;
  auto flush = [&] {
    if (run_color != nullptr && run_end > run_x) {
      o += fmt("<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.0f\" fill=\"%s\"/>", run_x, at.y + 1,
               std::max(0.3, run_end - run_x), at.row_h - 2, run_color);
      ++drawn_rects;
    }
    run_color = nullptr;
  };
  for (const block_info& b : s.blocks) {
    if (b.state == block_state::inactive) {
      flush();
      continue;
    }
    const double bx = at.pad + (at.x + double(b.address - s.address)) * at.scale;
    const double bw = double(b.size_bytes) * at.scale;
    const char* color = b.state == block_state::active_pending_free ? color_pending : color_block;
    if (bw >= 3) {
      flush();
      const double rw = b.state == block_state::active_allocated ? double(b.requested_bytes) * at.scale : bw;
      o += fmt("<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.0f\" fill=\"%s\"><title>block %s (%s "
               "requested), %s</title></rect>",
               bx, at.y + 1, std::max(0.3, rw), at.row_h - 2, color, format_bytes(b.size_bytes).c_str(),
               format_bytes(b.requested_bytes).c_str(), std::string(to_string(b.state)).c_str());
      ++drawn_rects;
      if (bw - rw >= 0.5) {
        o += fmt("<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.0f\" fill=\"%s\"/>", bx + rw, at.y + 1,
                 bw - rw, at.row_h - 2, color_rounding);
        ++drawn_rects;
      }
      continue;
    }
    if (run_color != color || std::fabs(bx - run_end) > 0.05 || run_end - run_x >= 3) {
      flush();
      run_x = bx;
      run_color = color;
    }
    run_end = bx + bw;
  }
  flush();
}

/// Segments packed into rows (largest first), blocks drawn inside.
std::string segment_map_svg(std::vector<segment_info> segments, std::size_t& drawn_rects) {
  constexpr double W = 1040, pad = 8, row_h = 18, gap = 6;
  std::sort(segments.begin(), segments.end(), [](const segment_info& a, const segment_info& b) {
    return std::tie(b.total_bytes, a.address) < std::tie(a.total_bytes, b.address);
  });
  std::uint64_t total = 0, largest = 1;
  for (const auto& s : segments) {
    total += s.total_bytes;
    largest = std::max<std::uint64_t>(largest, s.total_bytes);
  }
  const double capacity = std::max(double(largest), double(total) / 24.0);
  const double scale = (W - 2 * pad) / capacity;
  const double seg_gap_bytes = 3 / scale;
  struct placed {
    const segment_info* s;
    double x;
    int row;
  };
  std::vector<placed> layout;
  int row = 0;
  double used = 0;
  for (const auto& s : segments) {
    if (used > 0 && used + double(s.total_bytes) > capacity) {
      ++row;
      used = 0;
    }
    layout.push_back({&s, used, row});
    used += double(s.total_bytes) + seg_gap_bytes;
  }
  const double H = pad * 2 + (row + 1) * (row_h + gap);
  std::string o = fmt("<svg id=\"segmap\" viewBox=\"0 0 %.0f %.0f\" width=\"%.0f\" height=\"%.0f\" role=\"img\" "
                      "aria-label=\"segment map\">\n", W, H, W, H);
  drawn_rects = 0;
  for (const placed& p : layout) {
    const segment_info& s = *p.s;
    const double x0 = pad + p.x * scale, y = pad + p.row * (row_h + gap);
    const double w = std::max(1.0, double(s.total_bytes) * scale);
    o += fmt("<g><title>segment 0x%llx: %s, %s pool, stream %llu; %s allocated, %s requested</title>"
             "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.0f\" fill=\"%s\" stroke=\"#8795a5\" "
             "stroke-width=\"0.6\"/>",
             static_cast<unsigned long long>(s.address), format_bytes(s.total_bytes).c_str(),
             s.is_small_pool ? "small" : "large", static_cast<unsigned long long>(s.stream),
             format_bytes(s.allocated_bytes).c_str(), format_bytes(s.requested_bytes).c_str(), x0, y, w,
             row_h, color_free);
    ++drawn_rects;
    draw_blocks(o, s, {pad, p.x, y, scale, row_h}, drawn_rects);
    o += "</g>\n";
  }
  o += "</svg>\n";
  return o;
}


std::string pool_bar(const pool_row& r, std::uint64_t widest) {
  // requested | rounding (allocated - requested of allocated blocks) | pending | free
  constexpr double W = 170;
  const double s = W / double(std::max<std::uint64_t>(widest, 1));
  const double req = double(std::min(r.requested, r.allocated + r.pending));
  const double rounding = double(r.allocated) - std::min(double(r.allocated), req);
  const double pending = double(r.pending);
  const double free = double(r.reserved) - double(r.allocated) - pending;
  std::string o = fmt("<svg width=\"%.0f\" height=\"14\" class=\"bar\">", W);
  double x = 0;
  for (const auto& [v, color] : {std::pair{req, color_block}, std::pair{rounding, color_rounding},
                                 std::pair{pending, color_pending}, std::pair{std::max(0.0, free), "#d9dee5"}}) {
    if (v * s >= 0.2) o += fmt("<rect x=\"%.1f\" y=\"1\" width=\"%.1f\" height=\"12\" fill=\"%s\"/>", x, v * s, color);
    x += v * s;
  }
  return o + "</svg>";
}

const char* page_style = R"css(
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;margin:0;background:#f3f5f8;color:#1f2933}
main{max-width:1080px;margin:0 auto;padding:24px 20px 48px}
h1{font-size:24px;margin:4px 0 2px}
h2{font-size:18px;margin:0 0 4px}
.sub{color:#52606d;font-size:13px;margin:0 0 16px}
.card{background:#fff;border:1px solid #dde3ea;border-radius:8px;padding:16px 18px;margin:16px 0;box-shadow:0 1px 2px rgba(0,0,0,.04)}
.note{color:#52606d;font-size:13px;margin:2px 0 10px}
.kpis{display:grid;grid-template-columns:repeat(4,1fr);gap:12px;margin:12px 0 4px}
.kpi{background:#f7f9fb;border:1px solid #e4e9ef;border-radius:6px;padding:10px 12px}
.kpi .v{font-size:20px;font-weight:600}
.kpi .l{font-size:12px;color:#52606d}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:5px 7px;border-bottom:1px solid #edf0f3;text-align:right;white-space:nowrap}
th{color:#52606d;font-weight:600;background:#f7f9fb}
td.l,th.l{text-align:left}
td.src{white-space:normal;overflow-wrap:anywhere;color:#52606d;font-size:12px;max-width:220px}
.legend{display:flex;flex-wrap:wrap;gap:16px;font-size:13px;margin:8px 0 0}
.legend span{display:inline-flex;align-items:center;gap:6px}
.sw{display:inline-block;width:18px;height:10px;border-radius:2px}
.swl{display:inline-block;width:22px;height:0;border-top:3px solid}
svg text.tick{font-size:11px;fill:#52606d}
svg text.axis{font-size:12px;fill:#3e4c59}
#readout{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;color:#3e4c59;min-height:16px;margin-top:4px}
.track{position:relative;width:220px;height:10px;background:#edf0f3;border-radius:2px}
.track i{position:absolute;top:0;height:10px;background:#4e79a7;border-radius:2px}
)css";

const char* page_script = R"js(
(function(){
  var d=JSON.parse(document.getElementById('chartdata').textContent);
  var svg=document.getElementById('timechart'),hit=document.getElementById('hit'),cur=document.getElementById('cursor');
  var out=document.getElementById('readout');if(!svg||!hit)return;
  var left=+hit.getAttribute('data-left'),width=+hit.getAttribute('data-width'),n=d.reserved.length;
  function mib(v){return v>=1024?(v/1024).toFixed(2)+' GiB':v.toFixed(1)+' MiB';}
  function when(f){var s=f*d.span;if(!d.by_time)return 'event '+Math.round(s);return s<1?(s*1000).toFixed(1)+' ms':s.toFixed(2)+' s';}
  hit.addEventListener('mousemove',function(ev){
    var p=svg.createSVGPoint();p.x=ev.clientX;p.y=ev.clientY;var q=p.matrixTransform(svg.getScreenCTM().inverse());
    var f=Math.min(Math.max((q.x-left)/width,0),0.999999),i=Math.floor(f*n);
    cur.setAttribute('x1',q.x);cur.setAttribute('x2',q.x);cur.setAttribute('visibility','visible');
    out.textContent=when(f)+'  requested '+mib(d.requested[i])+'  allocated '+mib(d.allocated[i])+
      '  reserved '+mib(d.reserved[i])+(d.recorded.length?'  recording allocator reserved '+mib(d.recorded[i]):'');
  });
  hit.addEventListener('mouseleave',function(){cur.setAttribute('visibility','hidden');});
})();
)js";

std::string kpi(const std::string& value, const std::string& label) {
  return "<div class=\"kpi\"><div class=\"v\">" + html(value) + "</div><div class=\"l\">" + html(label) +
         "</div></div>";
}

std::string peaks_table(const report_summary& sum, const native_reference* native, const recorded_curves& recorded) {
  const bool has_recorded_segments = !recorded.reserved.empty();
  struct row {
    std::string who;
    std::uint64_t reserved = 0;
    std::string mallocs, source;
    const char* color;
  };
  std::vector<row> rows;
  // Segments made: cudaMalloc calls and address-space reservations, the
  // same unit for every row (PyTorch's figure is its cudaMalloc calls).
  rows.push_back({"ccalloc (this replay)", sum.replay.peak_reserved_bytes, with_commas(sum.replay.segments_created),
                  "replay", color_reserved});
  if (has_recorded_segments)
    rows.push_back({"recording allocator", sum.recorded_reserved_peak, with_commas(recorded.segment_allocs),
                    "the trace's segment events", color_recorded});
  if (native != nullptr && native->reserved_peak)
    rows.push_back({"PyTorch native", native->reserved_peak,
                    native->device_allocs ? with_commas(native->device_allocs) : "-", native->origin, color_recorded});
  if (native != nullptr && native->expandable_reserved_peak)
    rows.push_back({"PyTorch expandable_segments", native->expandable_reserved_peak, "-", native->origin,
                    color_recorded});
  const double req = double(sum.replay.peak_requested_bytes);
  std::uint64_t widest = 1;
  for (const row& r : rows) widest = std::max(widest, r.reserved);
  std::string o = "<table><tr><th class=\"l\">allocator</th><th>peak reserved</th><th>reserved / requested</th>"
                  "<th>segments made</th><th class=\"l\">peak reserved, requested shaded</th>"
                  "<th class=\"l\">source</th></tr>\n";
  for (const row& r : rows) {
    const double w = 180.0 * double(r.reserved) / double(widest), rw = 180.0 * req / double(widest);
    o += "<tr><td class=\"l\">" + html(r.who) + "</td><td>" + format_bytes(r.reserved) + "</td><td>" +
         (req > 0 ? fmt("%.3f", double(r.reserved) / req) : std::string("-")) + "</td><td>" + r.mallocs +
         "</td><td class=\"l\">" +
         fmt("<svg width=\"184\" height=\"14\"><rect x=\"0\" y=\"2\" width=\"%.1f\" height=\"10\" fill=\"%s\"/>"
             "<rect x=\"0\" y=\"2\" width=\"%.1f\" height=\"10\" fill=\"%s\" fill-opacity=\"0.9\"/></svg>",
             w, r.color, std::min(rw, w), color_requested) +
         "</td><td class=\"l src\">" + html(r.source) + "</td></tr>\n";
  }
  return o + "</table>\n<p class=\"note\">Segments made: cudaMalloc calls, or address-space reservations of "
             "expandable segments (ccalloc also mapped " + with_commas(sum.replay.pages_mapped - sum.replay.pages_remapped) +
             " 2 MiB pages into its reservations).</p>\n";
}

}  // namespace

// Sleep and wake: paused bytes over the trace's pauses and resumes, and
// what each pause freed ("" for a trace without them).
std::string sleep_table(const replay_result& r) {
  if (r.sleep_events.empty()) return {};
  std::string o = "<section class=\"card\"><h2>Sleep and wake</h2>\n<p class=\"note\">Every pause and resume of "
                  "the trace as ccalloc replayed it; peak paused " +
                  html(format_bytes(r.peak_paused_bytes)) +
                  ". A pause frees its tag's pages under live blocks (paused, mapped again at resume) and its "
                  "cached free pages; a resume first gives back ccalloc's cached memory of active tags when the "
                  "device lacks room.</p>\n";
  o += "<table><tr><th>line</th><th class=\"l\">action</th><th class=\"l\">tag</th><th>paused</th><th>freed / "
       "cache given back</th><th>copied to/from host</th><th>paused, all tags</th><th>reserved after</th></tr>\n";
  for (const replay_sleep_event& e : r.sleep_events)
    o += "<tr><td>" + (e.line ? with_commas(e.line) : std::string("pass end")) + "</td><td class=\"l\">" +
         (e.pause ? (e.keep_contents ? "pause (keep)" : "pause (drop)") : "resume") +
         (e.failed ? (e.pause ? " failed: no host memory" : " failed: no room") : "") + "</td><td class=\"l\">" +
         html(e.tag) + "</td><td>" + html(format_bytes(e.paused_bytes)) + "</td><td>" +
         html(format_bytes(e.released_bytes)) + "</td><td>" + html(format_bytes(e.copied_bytes)) + "</td><td>" +
         html(format_bytes(e.paused_total_bytes)) + "</td><td>" + html(format_bytes(e.reserved_bytes)) +
         "</td></tr>\n";
  return o + "</table></section>\n";
}

namespace {
// render_report_html's sections, in page order; each appends to `o`.

// Summary: the peaks, the OOMs, and what the policy cost (host waits and page traffic).
void summary_section(std::string& o, const report_summary& sum, const native_reference* native,
                     const recorded_curves& recorded) {
  o += "<section class=\"card\"><h2>Summary</h2>\n<div class=\"kpis\">";
  o += kpi(format_bytes(sum.replay.peak_requested_bytes), "peak requested (what the program asked for)");
  o += kpi(format_bytes(sum.replay.peak_allocated_bytes), "ccalloc peak allocated (rounded blocks)");
  o += kpi(format_bytes(sum.replay.peak_reserved_bytes), "ccalloc peak reserved (device memory)");
  if (sum.replay.peak_unpaused_allocated_bytes)
    o += kpi(fmt("%.3f", shown_fragmentation(sum.replay)),
             "ccalloc reserved / allocated to unpaused blocks, at the peaks (paused blocks hold no device pages)");
  else
    o += kpi(fmt("%.3f", sum.replay.fragmentation()), "ccalloc reserved / requested at the peaks");
  o += "</div>\n";
  if (sum.replay.ooms > 0)
    o += "<p class=\"note\"><b>" + html(describe_ooms(sum.replay)) + "</b> on the simulated device.</p>\n";
  o += peaks_table(sum, native, recorded);
  o += "<p class=\"note\">The recording allocator's figures come from the trace itself (its segment_alloc / "
       "segment_free events); PyTorch's from native_peaks.json when the trace has an entry there.</p>\n";
  // What the policy cost: host waits and page traffic.
  o += "<table><tr><th class=\"l\">ccalloc's cost</th><th>count</th><th class=\"l\">meaning</th></tr>\n";
  const auto cost_row = [&](const char* what, const std::string& value, const char* meaning) {
    o += std::string("<tr><td class=\"l\">") + what + "</td><td>" + html(value) + "</td><td class=\"l src\">" +
         meaning + "</td></tr>\n";
  };
  cost_row("device synchronizations", with_commas(sum.replay.device_synchronizations),
           "times the host waited for the device before memory changed hands");
  cost_row("pages mapped", with_commas(sum.replay.pages_mapped), "device pages mapped into expandable segments");
  cost_row("pages unmapped", with_commas(sum.replay.pages_unmapped), "device pages unmapped");
  cost_row("pages remapped", with_commas(sum.replay.pages_remapped),
           "pages unmapped at one place and mapped at another instead of new memory");
  cost_row("moved between streams", format_bytes(sum.replay.bytes_moved_between_streams),
           "bytes that went from one stream's memory to another's");
  cost_row("stream waits", with_commas(sum.replay.stream_waits),
           "device-side waits for another stream's work so that its free pages could move at once (the host did not wait)");
  o += "</table></section>\n";
}

void time_chart_section(std::string& o, const slicer& sl, const chart_data& c, const recorded_curves& recorded) {
  o += "<section class=\"card\"><h2>Memory over time</h2>\n<p class=\"note\">Each point is the highest value in its "
       "slice of time (" + with_commas(sl.n) + " slices), so no peak is lost. Hover for values.</p>\n";
  o += time_chart_svg(c);
  o += "<div class=\"legend\"><span><i class=\"sw\" style=\"background:" + std::string(color_requested) +
       "\"></i>requested</span><span><i class=\"swl\" style=\"border-color:" + color_allocated +
       "\"></i>ccalloc allocated</span><span><i class=\"swl\" style=\"border-color:" + color_reserved +
       "\"></i>ccalloc reserved</span>";
  if (!recorded.reserved.empty())
    o += "<span><i class=\"swl\" style=\"border-color:" + std::string(color_recorded) +
         ";border-top-style:dashed\"></i>recording allocator reserved</span>";
  if (!c.paused.empty())
    o += "<span><i class=\"swl\" style=\"border-color:" + std::string(color_paused) +
         ";border-top-style:dotted\"></i>paused (all tags)</span>";
  o += "</div><div id=\"readout\"></div>\n<script type=\"application/json\" id=\"chartdata\">" + chart_json(c) +
       "</script></section>\n";
}

void segment_map_section(std::string& o, const trace& t, const std::vector<segment_info>& at_peak,
                         std::size_t peak_index, std::size_t live_segments) {
  const std::size_t n = t.events.size();
  std::size_t rects = 0;
  const std::string map = segment_map_svg(at_peak, rects);
  std::uint64_t peak_reserved = 0, peak_alloc = 0, unmapped = 0;
  for (const auto& s : at_peak) {
    peak_reserved += s.mapped_bytes;
    unmapped += s.total_bytes - std::min(s.total_bytes, s.mapped_bytes);
    peak_alloc += s.allocated_bytes;
  }
  o += "<section class=\"card\"><h2>Segment map at the peak</h2>\n<p class=\"note\">After event " +
       with_commas(peak_index + 1) + " of " + with_commas(n) +
       (t.has_source_lines ? " (line " + std::to_string(t.events[peak_index].line) + ")" : std::string()) +
       ", where ccalloc's reserved bytes are highest: " + std::to_string(at_peak.size()) + " mapped ranges in " +
       std::to_string(live_segments) + " segments, " + html(format_bytes(peak_reserved)) + " reserved (mapped), " +
       html(format_bytes(peak_alloc)) + " allocated" +
       (unmapped ? ", and " + html(format_bytes(unmapped)) + " of address space whose pages a pause released"
                 : std::string()) +
       ". A segment is a cudaMalloc or an expandable segment's address-space reservation (what "
       "<code>ccalloc replay</code>'s \"segments made\" counts over the whole run); the map draws each "
       "expandable segment as its contiguous mapped ranges, as PyTorch's snapshots do, and a paused tag's "
       "blocks keep their addresses without device pages. Ranges are packed into rows, largest first; hover "
       "one for its figures.</p>\n" + map;
  o += "<div class=\"legend\"><span><i class=\"sw\" style=\"background:" + std::string(color_block) +
       "\"></i>allocated (requested bytes)</span><span><i class=\"sw\" style=\"background:" + color_rounding +
       "\"></i>rounding</span><span><i class=\"sw\" style=\"background:" + color_pending +
       "\"></i>freed, waiting for other streams</span><span><i class=\"sw\" style=\"background:" + color_free +
       ";border:1px solid #8795a5\"></i>free (cached)</span></div></section>\n";

}

// Fragmentation by pool and stream.
void fragmentation_section(std::string& o, const std::vector<segment_info>& at_peak) {
  const std::vector<pool_row> rows = fragmentation_rows(at_peak);
  std::uint64_t widest = 1;
  for (const auto& r : rows) widest = std::max(widest, r.reserved);
  o += "<section class=\"card\"><h2>Fragmentation by pool and stream, at the peak</h2>\n"
       "<table><tr><th class=\"l\">stream</th><th class=\"l\">pool</th><th>mapped ranges</th><th>reserved</th>"
       "<th>allocated</th><th>requested</th><th>waiting</th><th>free</th><th>largest free block</th>"
       "<th>unused</th><th class=\"l\">composition</th></tr>\n";
  for (const auto& r : rows) {
    const std::uint64_t free = r.reserved - r.allocated - r.pending;
    o += "<tr><td class=\"l\">" + std::to_string(r.stream) + "</td><td class=\"l\">" + (r.small ? "small" : "large") +
         "</td><td>" + std::to_string(r.segments) + "</td><td>" + format_bytes(r.reserved) + "</td><td>" +
         format_bytes(r.allocated) + "</td><td>" + format_bytes(r.requested) + "</td><td>" +
         format_bytes(r.pending) + "</td><td>" + format_bytes(free) + "</td><td>" +
         format_bytes(r.largest_free) + "</td><td>" +
         fmt("%.1f%%", r.reserved ? 100.0 * double(r.reserved - std::min(r.reserved, r.requested)) / double(r.reserved)
                                  : 0.0) +
         "</td><td class=\"l\">" + pool_bar(r, widest) + "</td></tr>\n";
  }
  o += "</table>\n<p class=\"note\">reserved = allocated + waiting + free. allocated: live blocks; requested: "
       "what their requests asked for (at most allocated: blocks are rounded up); waiting: freed blocks not yet "
       "reusable because other streams' work queued before the free has not finished. Mapped ranges: segments, "
       "with each expandable segment (one address-space reservation per stream and pool) counted as its "
       "contiguous mapped ranges, as PyTorch's snapshots show them. "
       "unused = (reserved &minus; requested) / reserved: memory the device gave that "
       "no live request is using. Composition bars (one scale for all rows): requested, rounding, waiting for other "
       "streams, free (cached), in the segment map's colours.</p></section>\n";

}

void largest_allocations_section(std::string& o, const trace& t, const slicer& sl, const report_options& options) {
  const std::size_t n = t.events.size();
  const std::vector<big_allocation> big = largest_allocations(t, sl, options.largest_allocations);
  const double end_x = sl.by_time ? sl.span : double(n - 1);
  o += "<section class=\"card\"><h2>Largest allocations</h2>\n<table><tr><th>#</th><th>size</th><th class=\"l\">"
       "stream</th><th>allocated at</th><th>freed at</th><th>lifetime</th><th class=\"l\">when, over the whole "
       "trace</th>" + std::string(t.has_source_lines ? "<th>line</th>" : "") + "</tr>\n";
  for (std::size_t i = 0; i < big.size(); ++i) {
    const big_allocation& b = big[i];
    const double f = b.free_x < 0 ? end_x : b.free_x;
    auto when = [&](double x) { return sl.by_time ? seconds_text(x) : "event " + with_commas(std::uint64_t(x)); };
    const double l = end_x > 0 ? 100.0 * b.alloc_x / end_x : 0, w = end_x > 0 ? 100.0 * (f - b.alloc_x) / end_x : 100;
    o += "<tr><td>" + std::to_string(i + 1) + "</td><td>" + format_bytes(b.size) + "</td><td class=\"l\">" +
         std::to_string(b.stream) + "</td><td>" + html(when(b.alloc_x)) + "</td><td>" +
         (b.free_x < 0 ? std::string("live at the end") : html(when(b.free_x))) + "</td><td>" +
         (sl.by_time ? html(seconds_text(f - b.alloc_x)) : with_commas(std::uint64_t(f - b.alloc_x)) + " events") +
         "</td><td class=\"l\"><div class=\"track\"><i style=\"left:" + fmt("%.2f%%;width:%.2f%%", l, std::max(w, 0.6)) +
         "\"></i></div></td>" + (t.has_source_lines ? "<td>" + std::to_string(b.line) + "</td>" : std::string()) +
         "</tr>\n";
  }
  o += "</table></section>\n";
}

// Allocation sites at the peak (PyTorch snapshots with frames); returns the
// top sites with their bytes (the summary's top_sites).
std::vector<std::pair<std::uint32_t, std::uint64_t>> sites_section(std::string& o, const trace& t,
                                                                   std::size_t peak_index,
                                                                   const report_options& options) {
  const std::vector<site_row> sites = sites_at_peak(t, peak_index, options.top_sites);
  std::vector<std::pair<std::uint32_t, std::uint64_t>> top_sites;
  if (!sites.empty()) {
    std::uint64_t live_total = 0;
    for (const site_row& r : sites_at_peak(t, peak_index, t.sites.size() + 1)) live_total += r.bytes;
    o += "<section class=\"card\"><h2>Allocation sites at the peak</h2>\n<p class=\"note\">Requested bytes live "
         "after event " + with_commas(peak_index + 1) + ", by the stack that allocated them (innermost frame "
         "first; hover for the whole stack). " + html(format_bytes(live_total)) + " live in all.</p>\n"
         "<table><tr><th>#</th><th>bytes</th><th>share</th><th>blocks</th><th class=\"l\">stack</th></tr>\n";
    for (std::size_t i = 0; i < sites.size(); ++i) {
      const site_row& r = sites[i];
      top_sites.emplace_back(r.site, r.bytes);
      const std::string stack = r.site == 0 ? std::string("(no frames recorded)") : t.sites[r.site - 1];
      // The first three frames, the rest on hover.
      std::string shown;
      std::size_t from = 0;
      for (int k = 0; k < 3 && from <= stack.size(); ++k) {
        const std::size_t nl = stack.find('\n', from);
        shown += (k ? "<br>" : "") + html(stack.substr(from, nl == std::string::npos ? std::string::npos : nl - from));
        if (nl == std::string::npos) break;
        from = nl + 1;
        if (k == 2) shown += "<br>&hellip;";
      }
      o += "<tr><td>" + std::to_string(i + 1) + "</td><td>" + format_bytes(r.bytes) + "</td><td>" +
           fmt("%.1f%%", live_total ? 100.0 * double(r.bytes) / double(live_total) : 0.0) + "</td><td>" +
           with_commas(r.blocks) + "</td><td class=\"l src\" title=\"" + html(stack) + "\">" + shown +
           "</td></tr>\n";
    }
    o += "</table></section>\n";
  }
  return top_sites;
}
}  // namespace

std::string render_report_html(const trace& t, const report_options& options, const native_reference* native,
                               report_summary* summary_out) {
  const report_model m = build_report_model(t, options);
  const std::size_t n = t.events.size();
  const slicer& sl = m.sl;
  const recorded_curves& recorded = m.recorded;
  const chart_data& c = m.chart;
  const std::vector<segment_info>& at_peak = m.at_peak;
  const report_summary& sum = m.sum;
  const std::size_t peak_index = m.peak_index;

  // ---- the page ----
  const std::string title = options.title.empty() ? t.source : options.title;
  std::set<std::uint64_t> streams;
  for (const auto& e : t.events) streams.insert(e.stream);
  const double duration = sl.by_time ? sl.span : 0;
  std::string o;
  o.reserve(1 << 20);
  o += "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>ccalloc report: " + html(title) +
       "</title>\n<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<style>" + page_style +
       "</style></head>\n<body><main>\n";
  o += "<h1>ccalloc memory report</h1>\n<p class=\"sub\">" + html(title) + " &middot; " + with_commas(n) +
       " events &middot; " + std::to_string(streams.size()) + (streams.size() == 1 ? " stream" : " streams") +
       (duration > 0 ? " &middot; " + html(seconds_text(duration)) + " recorded" : std::string()) +
       " &middot; replayed with " + html(options.config.empty() ? "the default configuration" : options.config) +
       " on a simulated device of " + html(format_bytes(options.device_memory_bytes)) + "</p>\n";
  for (const std::string& note : t.notes) o += "<p class=\"note\">Input: " + html(note) + "</p>\n";

  summary_section(o, sum, native, recorded);
  time_chart_section(o, sl, c, recorded);
  o += sleep_table(sum.replay);
  segment_map_section(o, t, at_peak, peak_index, sum.live_segments_at_peak);
  fragmentation_section(o, at_peak);
  largest_allocations_section(o, t, sl, options);
  std::vector<std::pair<std::uint32_t, std::uint64_t>> top_sites = sites_section(o, t, peak_index, options);
  o += "<p class=\"note\">Written by ccalloc report. The replay runs on ccalloc's simulated device; see "
       "docs/trace-format.md for the inputs.</p>\n";
  o += std::string("</main><script>") + page_script + "</script></body></html>\n";
  if (summary_out != nullptr) {
    *summary_out = sum;
    summary_out->top_sites = std::move(top_sites);
  }
  return o;
}

std::string describe_ooms(const replay_result& r) {
  std::string out;
  const auto add = [&out](std::uint64_t n, const char* what) {
    if (n == 0) return;
    if (!out.empty()) out += "; ";
    out += with_commas(n) + what;
  };
  const std::uint64_t others = r.failed_resumes + r.failed_pauses;
  add(r.ooms > others ? r.ooms - others : 0, " allocation(s) failed with out of memory and were skipped");
  add(r.failed_resumes, " resume(s) failed with out of memory (the tag stayed paused)");
  add(r.failed_pauses, " pause(s) keeping contents failed without host memory (the tag stayed active)");
  return out;
}

}  // namespace ccalloc

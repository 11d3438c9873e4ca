// ccalloc/replay/report.hpp: the HTML report of a trace (`ccalloc report`,
// SPEC X8).
//
// render_report_html replays a trace through ccalloc on the simulated device
// and writes one self-contained HTML page (inline SVG, a few lines of inline
// JavaScript for the hover readout, no network) with:
//  - a summary: ccalloc's peaks next to the recording allocator's (taken from
//    the trace's own segment events) and PyTorch's figures when known;
//  - requested, allocated and reserved bytes over time, ccalloc's replay next
//    to what the recording allocator reserved;
//  - the segment map at the peak (the event where ccalloc's reserved bytes,
//    then its allocated bytes, are highest): every segment with its blocks;
//  - fragmentation by pool and stream at the peak;
//  - the largest allocations of the trace with their lifetimes.
// Long traces are downsampled to `plot_points` time slices per curve, each
// point the highest value in its slice (peaks are never lost), so the page
// stays small: 0.19 MB for the 850k-event llama_generate trace (0.25 MB for
// gpt2_train, whose segment map has more blocks).
//
// Cost: two replays (the second stops at the peak), with the allocator's
// statistics read after every event.
#pragma once

#include <ccalloc/replay/native_reference.hpp>
#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/trace.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace ccalloc {

struct report_options {
  std::string config;  ///< ccalloc configuration for the replay ("" = defaults)
  /// Simulated device capacity in bytes (as replay_options).
  std::size_t device_memory_bytes = std::size_t{141} * 1000 * 1000 * 1000;
  std::size_t plot_points = 1200;           ///< time slices per curve (>= 2)
  std::size_t largest_allocations = 20;     ///< rows of the largest-allocations table
  /// Rows of the allocation-sites table (bytes live at the peak by stack),
  /// drawn when the trace has sites (a PyTorch snapshot with frames).
  std::size_t top_sites = 10;
  std::string title;                        ///< page title; default: the trace's source
  /// Optional: told the progress of each replay pass (pass 1 or 2 of 2,
  /// events done, events in the pass), at most a few hundred times per pass.
  std::function<void(int pass, std::size_t done, std::size_t total)> progress;
};

/// What the page shows, in numbers (for the CLI and tests).
struct report_summary {
  replay_result replay;                    ///< the full replay (pass 1)
  std::uint64_t peak_event_index = 0;      ///< the event of the segment map
  std::uint64_t recorded_reserved_peak = 0;   ///< from the trace's segment events; 0 if it has none
  std::uint64_t recorded_requested_peak = 0;  ///< from its alloc / free_completed events
  /// The segment map's entries at the peak: plain segments, and each
  /// expandable segment's contiguous mapped ranges (as PyTorch's snapshots
  /// show them), so it can exceed live_segments_at_peak.
  std::size_t segments_at_peak = 0;
  /// segment.all.current at the peak: cudaMalloc segments and address-space
  /// reservations alive (what replay's "segments made" counts, over the run).
  std::size_t live_segments_at_peak = 0;
  std::size_t blocks_at_peak = 0;
  /// The allocation-sites table: (site, requested bytes live at the peak),
  /// most first; site is 1-based into trace::sites, 0 for allocations
  /// without frames. Empty when the trace has no sites.
  std::vector<std::pair<std::uint32_t, std::uint64_t>> top_sites;
  std::size_t plot_points = 0;             ///< time slices actually drawn
};

/// Fragmentation as `ccalloc replay`, `compare` and `report` print it:
/// peak reserved over peak requested, or, when tags were paused
/// (r.peak_unpaused_allocated_bytes non-zero), over the peak allocated to
/// unpaused blocks, since paused blocks count as requested but hold no
/// reserved pages. 0 when nothing was requested.
[[nodiscard]] double shown_fragmentation(const replay_result& r) noexcept;

/// The out-of-memory errors of a replay in words, for messages: "<n>
/// allocation(s) failed with out of memory and were skipped", "<n>
/// resume(s) failed with out of memory (the tag stayed paused)", "<n>
/// pause(s) keeping contents failed without host memory (the tag stayed
/// active)", those that are not 0 joined by "; " (n with thousands
/// separators: 1,923); "" when r.ooms is 0 (replay_result::ooms,
/// failed_resumes, failed_pauses).
[[nodiscard]] std::string describe_ooms(const replay_result& r);

/// The recording allocator's figures, from the trace's own events: what
/// `ccalloc report` shows next to ccalloc's and `ccalloc replay` prints.
struct recorded_figures {
  bool has_segments = false;          ///< the trace has segment events (else reserved_peak means nothing)
  std::uint64_t requested_peak = 0;   ///< from alloc / free_completed
  std::uint64_t reserved_peak = 0;    ///< from segment_alloc/map and segment_free/unmap
  std::uint64_t segment_allocs = 0;   ///< segment_alloc events: the recording allocator's cudaMalloc calls
};
/// Reads them from `t` (one pass over its events). Never throws beyond
/// std::bad_alloc.
[[nodiscard]] recorded_figures recorded_allocator_figures(const trace& t);

/// Replays `t` and returns the page. `native` may be null. Throws
/// config_error for a bad configuration, trace_error for a trace that
/// contradicts itself (as replay_trace), invalid_argument_error for
/// plot_points < 2 or an empty trace.
[[nodiscard]] std::string render_report_html(const trace& t, const report_options& options,
                                             const native_reference* native, report_summary* summary = nullptr);

}  // namespace ccalloc

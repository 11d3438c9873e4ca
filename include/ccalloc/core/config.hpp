// ccalloc/core/config.hpp: the allocator's settings and their parser.
//
// The configuration string has PyTorch's syntax and keys
// (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF): comma-separated `key:value`
// pairs, e.g. "max_split_size_mb:128,garbage_collection_threshold:0.6,
// roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True".
// ccalloc reads it from the environment variable CCALLOC_CONF, or it is set at
// run time (caching_allocator::set_config). One table of settings
// (config_keys()) feeds the parser, the CLI's help and the documentation.
//
// Errors: an unknown key, a malformed value, or a value out of range throws
// config_error naming the key, the value and what is accepted. A setting that
// parses but would have no effect (SPEC X6) is kept and a warning is added to
// allocator_config::warnings.
#pragma once

#include <ccalloc/base/types.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ccalloc {

/// Number of power-of-two size intervals for roundup_power2_divisions: one per
/// power of two from 1 MiB (index 0, also every smaller size) to 32 GiB and
/// above (index 15), as in PyTorch.
inline constexpr std::size_t roundup_intervals = 16;

/// The configuration string under which ccalloc follows the policies of
/// PyTorch's allocator in its default configuration, to the byte: plain
/// segments, no trim before a new peak, blocks bound to their stream
/// (tests/replay_test.cpp checks this on real traces).
inline constexpr const char* pytorch_policies =
    "expandable_segments:False,trim_on_new_peak:False,reuse_across_streams:False";
/// The same for PyTorch's allocator with expandable_segments:True (its
/// policies; not byte-exact, as PyTorch maps 20 MiB at a time).
inline constexpr const char* pytorch_expandable_policies =
    "expandable_segments:True,trim_on_new_peak:False,reuse_across_streams:False";

/// Which freed blocks the thread cache parks (the thread_cache key; see
/// device_caching_allocator::set_thread_cache_enabled).
enum class thread_cache_mode : std::uint8_t {
  off,    ///< no thread cache
  small,  ///< small-pool blocks only (requests of at most 1 MiB)
  all,    ///< every block of the normal pools
};

/// The one spelling of a thread_cache_mode, for the thread_cache key and the
/// CCALLOC_THREAD_CACHE environment variable alike: "off", "small" or "all";
/// the boolean spellings of the other keys are accepted too ("True", "true",
/// "1" = all; "False", "false", "0" = off). std::nullopt for anything else
/// (the caller reports it). Case-sensitive, as every key's values are;
/// surrounding blanks are dropped.
/// Thread safety: pure function.
[[nodiscard]] std::optional<thread_cache_mode> parse_thread_cache_mode(std::string_view text) noexcept;

struct allocator_config {
  /// Blocks of this size or more are "oversize": never split, and only
  /// served to requests of this size or more (max_split_size_mb). Default:
  /// unlimited (SIZE_MAX). When limited: max_split_size_bytes >=
  /// large_segment_size_bytes (parse() enforces it, as PyTorch does).
  std::size_t max_split_size_bytes = std::numeric_limits<std::size_t>::max();
  /// An oversize block may serve a request up to this many bytes smaller
  /// (max_non_split_rounding_mb). Default 20 MiB (= large_segment_size_bytes;
  /// a string that sets large_segment_size_mb but not this key moves it to
  /// the new segment size, as PyTorch does). Always >= large_segment_size_bytes.
  std::size_t max_non_split_rounding_bytes = 20 * mib;
  /// Segment size for large-pool requests under 10 MiB
  /// (large_segment_size_mb). Default 20 MiB; always an even number of MiB
  /// above 10 MiB.
  std::size_t large_segment_size_bytes = 20 * mib;
  /// Fraction of the allowed memory above which old cached blocks are
  /// released before growing (garbage_collection_threshold), in (0, 1);
  /// 0 = off.
  double garbage_collection_threshold = 0.0;
  /// Divisions per power-of-two interval when rounding request sizes
  /// (roundup_power2_divisions), each 0 or a power of two; 0 = plain
  /// 512-byte rounding. Index i covers request sizes in [2^i MiB, 2^(i+1) MiB)
  /// (index 0 also everything below 1 MiB, index 15 everything from 32 GiB).
  std::array<std::size_t, roundup_intervals> roundup_power2_divisions{};
  /// Use expandable segments (CUDA virtual memory, SPEC B7) for both pools:
  /// one address-space reservation per (stream, pool) that grows by mapping
  /// pages of the device's granularity (2 MiB) instead of new segments.
  /// Default True (PyTorch: False), chosen from the replays in docs/perf.md:
  /// on a device without virtual memory the default falls back to plain
  /// segments, while an explicit True there is a config_error.
  bool expandable_segments = true;
  /// Whether expandable_segments was given explicitly (see above).
  bool expandable_segments_set = false;
  /// Release the allocator's lock while the device malloc runs.
  bool release_lock_on_cudamalloc = false;
  /// Cap on reserved bytes as a fraction of device total memory,
  /// (per_process_memory_fraction), in [0, 1]; 1 = no cap beyond the device.
  double per_process_memory_fraction = 1.0;
  /// Whether per_process_memory_fraction was given explicitly. Invariant kept
  /// by the parser: !memory_fraction_set implies per_process_memory_fraction
  /// == 1 (to_string() writes the fraction only when it was set).
  bool memory_fraction_set = false;
  /// ccalloc's own key (trim_on_new_peak, default True): when a request would
  /// raise reserved memory above its highest value so far, first return the
  /// cached segments that hold no live block to the device, so the peak grows
  /// by less. Costs extra device frees only while the program sets new peaks.
  /// False reproduces PyTorch's allocator's reservations exactly.
  bool trim_on_new_peak = true;
  /// ccalloc's own key (recycles_per_peak, default unlimited = SIZE_MAX,
  /// spelled "unlimited"; SPEC X3, P8): with expandable segments,
  /// trim_on_new_peak recycles free pages (unmaps them and maps them where
  /// the request needs them, in any stream's segment) instead of raising
  /// reserved memory. Only pages whose page fence has completed are taken
  /// (an event recorded on the stream that freed them, queried without
  /// blocking): recycling never synchronizes the device; pages still in use
  /// stay and the mark rises instead. After this many recyclings at one
  /// high-water mark the next need raises the mark instead (fewer
  /// remappings, more memory). 0 never recycles for a new peak (PyTorch's
  /// expandable growth). The memory fraction cap and out of memory recycle
  /// regardless, waiting for fences if they must.
  std::size_t recycles_per_peak = std::numeric_limits<std::size_t>::max();
  /// ccalloc's own key (recycle_time_percent, default 5, 0-100):
  /// a time budget for that recycling. Remapping a page costs tens
  /// of microseconds of driver calls (about 48 us on an H200; docs/perf.md),
  /// the time of hundreds of cached allocations. Recycling for a new peak
  /// (the unmaps and the mapping of the pages they free; not the fresh pages
  /// the same request creates, which cost as much when the mark rises)
  /// may take at most this percent of the host's time (a token bucket over
  /// device_backend::host_time_us: it fills at this percent of the time
  /// that passes and holds at most this percent of one second); when it is
  /// empty the mark rises instead, except for a large peak (more than a
  /// sixteenth of the mark over it), which may draw on a reserve that keeps
  /// what the full bucket cannot hold, up to this percent of ten seconds
  /// (the mark it would add stays for the rest of the program). Over any
  /// stretch of time both together take at most this percent of it, plus
  /// what they hold. A training loop, whose allocations are
  /// spread over its steps' GPU work, stays far within it; a program that
  /// does little besides allocating sizes that never settle stops paying
  /// for a remapping every few hundred allocations and holds somewhat more
  /// memory. 100: no limit; 0: no recycling for a new peak (as
  /// recycles_per_peak:0), also on a backend without a host clock (where
  /// other values do not limit). The memory fraction cap and out of memory are not
  /// limited. The replay charges what the H200 would take (host_clock.hpp).
  unsigned recycle_time_percent = 5;
  /// ccalloc's own key (reuse_across_streams, default True; SPEC X2): before
  /// the device is asked for a new segment, a cached whole segment of another
  /// stream whose work has completed (an event recorded on that stream has
  /// completed) moves to the requesting stream. With expandable segments, an
  /// idle reservation of another stream (no block allocated or waiting, its
  /// page fences completed) moves whole, its pages mapped where they are,
  /// when that maps fewer new pages than the requesting stream's own
  /// placement (short-lived side streams stop remapping pages).
  /// False keeps PyTorch's rule: a block serves only the stream it was
  /// allocated on (free pages are still recycled page by page, X3).
  bool reuse_across_streams = true;
  /// ccalloc's own key (reuse_with_stream_wait, default False):
  /// with expandable segments, when recycling free pages for a new peak (or
  /// under the memory-fraction cap) finds no more pages whose page fence has
  /// completed, nor pages of the requesting stream's own free blocks, it may
  /// take the free pages of another stream's block whose fence has not
  /// completed: the requesting stream is made to wait on the device for that
  /// fence (cudaStreamWaitEvent; the host never blocks; counted in
  /// device_stats::num_stream_waits) and the pages are mapped at their new
  /// place at once, their old mapping unmapped once the fence completes (a
  /// deferred unmap). CUDA's cudaMemPoolReuseAllowInternalDependencies. Not
  /// during a graph capture, not for private pools' blocks, and only where
  /// an event covering the block's free is recorded (or may be recorded) on
  /// its stream. False (the default, PyTorch's behaviour): such pages wait
  /// for their fence (the reservation grows instead; under the cap the host
  /// waits), and no stream ever waits on another that the program did not
  /// make it wait on. True adds such waits: a stream then also waits for
  /// the other stream's work queued before the fence, which can serialize
  /// streams the program meant to run side by side, and can hang a program
  /// whose other stream waits for the host (a host callback, a wait on a
  /// value, a collective waiting for a peer) to act after this stream's
  /// work. Needs a backend with capabilities().stream_wait.
  bool reuse_with_stream_wait = false;
  /// ccalloc's own key (thread_cache: off, small or all): each
  /// thread parks up to 4 blocks it freed and gets one back for the same
  /// bytes on the same stream without the stream's lock, only when the
  /// block's pool has not changed since the block was handed out, so that a
  /// hit is the block the pools' best fit would hand out (the same
  /// addresses as with `off`; pages beside a reused block may be recycled
  /// for another stream sooner, never while in use: see
  /// src/core/detail/thread_cache.hpp, "Placement"). Default all. Applies when thread_cache_set: the
  /// key, when given, wins over the environment variable
  /// CCALLOC_THREAD_CACHE, which decides (at device creation) only when the
  /// key is not given.
  thread_cache_mode thread_cache = thread_cache_mode::off;
  /// Whether thread_cache was given explicitly (to_string() writes it only
  /// then). Invariant kept by the parser: !thread_cache_set implies
  /// thread_cache == off.
  bool thread_cache_set = false;

  /// ccalloc's own key oom_snapshot: where an out-of-memory error writes a
  /// snapshot of its device (PyTorch's pickle, with the history when it is
  /// recorded) before it is raised; "" (the default) writes none. The path
  /// is used as given (relative to the working directory), overwritten each
  /// time; it cannot contain a comma (the item separator).
  std::string oom_snapshot_path;
  /// ccalloc's own key oom_snapshot_interval_s: an out-of-memory error
  /// writes a snapshot only if the device's last one was written at least
  /// this many seconds before (default 60; 0: every time).
  std::uint64_t oom_snapshot_interval_s = 60;

  // Accepted for compatibility with PyTorch's config strings; they configure
  // PyTorch's pinned host allocator, its backend choice or its CUDA-graph
  // capture and have no effect on ccalloc's device memory (each adds a
  // warning when it differs from its default).
  std::string backend = "native";  ///< "native" or "cudaMallocAsync"
  bool pinned_use_cuda_host_register = false;
  std::size_t pinned_num_register_threads = 1;  ///< a power of two in [1, 128]
  bool pinned_use_background_threads = false;
  /// pinned_reserve_segment_size_mb in bytes; 0 = not set (PyTorch >= 2.9).
  std::size_t pinned_reserve_segment_size_bytes = 0;
  bool graph_capture_record_stream_reuse = false;

  /// Warnings about settings that parsed but have no effect (SPEC X6). A
  /// function of the fields above: parse() and apply() recompute it from the
  /// resulting configuration (so earlier warnings that no longer hold go).
  std::vector<std::string> warnings;

  /// Field-by-field equality (warnings included).
  friend bool operator==(const allocator_config&, const allocator_config&) = default;

  /// Parses a configuration string on top of the defaults. Empty or
  /// whitespace-only gives the defaults. A key given twice: the last wins.
  /// Throws config_error. Thread safety: pure function.
  [[nodiscard]] static allocator_config parse(std::string_view text);
  /// Applies `text` on top of this configuration (keys not mentioned keep
  /// their values; a roundup_power2_divisions value replaces all 16
  /// intervals). Throws config_error and leaves *this unchanged on error.
  void apply(std::string_view text);
  /// The configuration from the environment variable CCALLOC_CONF (defaults
  /// when unset). Throws config_error whose message starts with
  /// "ccalloc config (CCALLOC_CONF): " on a bad value.
  [[nodiscard]] static allocator_config from_environment();
  /// Canonical string, parseable by parse(), with parse(to_string()) == *this
  /// for every configuration parse() can produce. Lists every key in
  /// config_keys() order except those at a "not set" state that has no
  /// spelling: max_split_size_mb when unlimited, garbage_collection_threshold
  /// when 0, per_process_memory_fraction when !memory_fraction_set,
  /// thread_cache when !thread_cache_set, pinned_reserve_segment_size_mb
  /// when 0, expandable_segments when !expandable_segments_set; and ccalloc's
  /// recycling limits at their defaults: recycles_per_peak when unlimited,
  /// recycle_time_percent when 5.
  [[nodiscard]] std::string to_string() const;

  /// Divisions that apply to a request of `size_bytes` (PyTorch's
  /// roundup_power2_divisions(size)): roundup_power2_divisions[i] with
  /// i = floor(log2(size_bytes)) - 20 clamped to [0, 15] (size 0: index 0).
  /// Inline: every malloc calls it.
  [[nodiscard]] std::size_t divisions_for(std::size_t size_bytes) const noexcept {
    constexpr std::size_t first_log2 = 20;  // interval 0 starts at 1 MiB; smaller sizes share it
    const auto log2 = size_bytes == 0 ? 0 : static_cast<std::size_t>(std::bit_width(size_bytes) - 1);
    const auto index = std::min(log2 > first_log2 ? log2 - first_log2 : 0, roundup_intervals - 1);
    return roundup_power2_divisions[index];
  }
};

/// One row of the settings table.
struct config_key_info {
  std::string_view key;
  std::string_view accepted;  ///< what values are accepted, for messages and help
  std::string_view meaning;
};

/// Every key the parser accepts, in documentation order (the order
/// to_string() writes them). The same table drives parse(), its error
/// messages and the CLI's help. Thread safety: built once, then read-only.
[[nodiscard]] const std::vector<config_key_info>& config_keys();

}  // namespace ccalloc

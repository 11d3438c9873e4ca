// ccalloc/replay/replay.hpp: replay a trace through ccalloc and report what it
// reserved (SPEC X8).
//
// The replay drives a caching_allocator on the simulated device (or a real
// one) with a trace's alloc / free_requested / free_completed events, on the
// trace's streams. Virtual time advances by one unit per trace event. A block
// whose free_completed comes after its free_requested was used on another
// stream until then (record_stream in the program): the replay records the
// block on a side stream whose work lasts until the free_completed event, so
// the allocator cannot reuse it earlier. Segment events of the recording
// allocator do not drive the replay: the replayed allocator reserves on its
// own. On the simulated device they place its segments (see "Segment
// addresses" below).
//
// Segment addresses (replay_options::recorded_addresses, simulated device):
// PyTorch's best fit, and ccalloc's, break ties between equal free blocks by
// address, so where the driver put each segment can decide a replay. When
// the trace carries the recording allocator's segment_alloc events (and
// every recorded address and size is a multiple of the simulated device's
// 2 MiB granularity), the replay gives the simulated device their addresses
// (sim_backend::place_segments): the replay's k-th device malloc goes at
// the k-th recorded segment's offset from the lowest recorded address, with
// the recording's order and gaps, when the sizes agree and the stretch is
// free; any other goes at the lowest free address (the simulated device's
// own deterministic order). replay_result::recorded_addresses says whether
// the recording's addresses were used. With PyTorch's policies the replay
// then makes the recording's device mallocs in its order, so every one
// lands where the GPU put it.
//
// Devices (replay_options::device):
// - sim (default): a fresh simulated device (ccalloc::sim_backend) of
//   device_memory_bytes; a gap is work on a side stream lasting until the
//   free_completed event's index on the virtual clock (enqueue_work).
// - cuda: the real GPU cuda_device through ccalloc::cuda_backend (builds with
//   the CUDA backend only). Trace stream 0 is the device's legacy default
//   stream, every other trace stream a stream made with create_stream. A gap
//   is a host-controlled gate (device_backend::create_gate): the side stream
//   waits on it, then the block is recorded on the side stream and freed;
//   when the replay reaches the free_completed event it opens the gate and
//   synchronizes the side stream, so the block's event has completed before
//   the next trace event, as in the trace. The replay is deterministic and
//   follows the simulated one event by event: the figures match it except
//   where the device's own choices leak in (segment addresses break ties
//   between equally sized free blocks; a real cudaMalloc can fail).
//   Two rules keep a closed gate from deadlocking the host. A segment the
//   allocator frees while a gap is open (cudaFree waits for the whole
//   device) goes back to the device once no gap is open: the figures, which
//   are the allocator's, do not change, but until then the device holds more
//   than the reserved bytes (with a gap never completed in the trace: until
//   the end). When the allocator waits for a block's event
//   (synchronize_event: only after a segment allocation failed), the gaps up
//   to that event's end are ended first, as the simulated clock jumps ahead
//   there. A watchdog opens every gate if one CUDA call blocks for more than
//   10 s while a gate is closed; the replay then fails with an error naming
//   the call.
// At the end everything the replay still holds is freed, and streams, gates
// and the device's cached memory are released.
//
// Repeated replay (replay_options::repeat = N, SPEC X8 / P8): the trace is
// run N times back to back as one program, on one allocator, as a program
// that runs the recorded loop N times would:
// - pass k (0-based) replays every event at virtual time k x E + i (E = the
//   trace's events), so gaps, side streams and the clock continue;
// - an `alloc` that the trace never frees (no free_requested at its address
//   after it: weights, optimizer state, caches kept to the end) is made in
//   the first pass only and stays live through all passes; every other
//   event is replayed in every pass;
// - a gap whose free_completed is not in the trace (the recording ended
//   first) ends at the end of its pass;
// - each pass's peaks are its own (the allocator's peak statistics are reset
//   at each pass boundary, which changes no policy), its counters the
//   increase during the pass (replay_pass). The whole-run figures of
//   replay_result are the maxima (peaks) and sums (counters) over passes.
// With N = 1 the replay is the plain one, event for event.
//
// Tags, pause and resume (the trace's `tag`, `pause` and `resume` events):
// a `tag` event puts the following allocations under its tag (tag_scope on
// the replaying thread), a `pause` calls caching_allocator::pause on its tag
// with its keep_contents, a `resume` calls resume; each is recorded in
// replay_result::sleep_events with what it paused and freed. A resume that
// finds no room (or a pause without host memory for the kept contents)
// counts in `ooms` and changes nothing (a tag left paused: an allocation
// under it then fails with a trace_error naming the line). At the end, tags still
// paused are resumed before everything is freed. With repeat N > 1, each
// pass replays as the program would run again: tags a pass leaves paused
// are resumed at the pass boundary (sleep_events with line 0; a resume
// without room counts in `ooms`), and the check that a trace never pauses
// a paused tag or resumes an active one holds within each pass. A trace
// without these events replays as before, figure for figure.
//
// A device that runs behind the host (replay_options::device_lag_events = L,
// simulated device only): by default the simulated device finishes the
// program's work at once, so an event recorded on a trace stream has
// completed by the next event. A GPU is some kernels behind the host: an
// event recorded now completes once the work queued before it has run. With
// L > 0 every trace stream stays busy until L events after each of its
// allocs and frees, so an event (a page fence) recorded at event i
// completes at event i + L. The recorded lag between a block's
// free_requested and free_completed (side streams) is modelled as before.
// Measured on an H200 (docs/perf.md, "device lag"): GPT-2 training with bf16
// autocast reserves what the replay predicts with L >= 10, not with L = 0.
#pragma once

#include <ccalloc/core/config.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/replay/trace.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ccalloc {

/// Where a trace is replayed.
enum class replay_device {
  sim,   ///< the simulated device (sim_backend)
  cuda,  ///< a real GPU (cuda_backend)
};

/// "sim" or "cuda".
[[nodiscard]] const char* to_string(replay_device device) noexcept;

class caching_allocator;

/// Called after trace event `index` was replayed, with the allocator that
/// replays it (for reports and progress; it may read stats and segments).
/// Returning false ends the replay there (the result then covers events
/// [0, index]).
using replay_event_hook = std::function<bool(std::size_t index, caching_allocator& allocator)>;

struct replay_options {
  std::string config;  ///< configuration string (PyTorch syntax); "" = defaults
  /// Simulated device capacity in bytes; default 141 GB (an H200). Ignored
  /// with replay_device::cuda: the real device's memory is used.
  std::size_t device_memory_bytes = std::size_t{141} * 1000 * 1000 * 1000;
  replay_device device = replay_device::sim;
  /// CUDA device ordinal for replay_device::cuda.
  int cuda_device = 0;
  /// For tests: with replay_device::sim, model the gaps with the simulated
  /// device's gates, through the same driver as replay_device::cuda, instead
  /// of work on the virtual clock. The figures must not change.
  bool use_gates_on_sim = false;
  /// Optional; see replay_event_hook. Costs one call per event when set.
  replay_event_hook after_event;
  /// When set, the replayed allocator records history from the first event
  /// (for a snapshot taken in after_event, e.g. `ccalloc replay --snapshot`).
  std::optional<history_options> history;
  /// Passes: the trace run this many times back to back as one program (see
  /// "Repeated replay" above); >= 1 (0 is an error). The hook's `index` then
  /// counts events over all passes: pass k's event i is k x E + i.
  std::size_t repeat = 1;
  /// Trace events the device runs behind the host (see "A device that runs
  /// behind the host" above); 0 (default): it never does. replay_device::sim
  /// only, and not with use_gates_on_sim: replay_trace throws
  /// invalid_argument_error otherwise (a GPU has its own lag).
  std::uint64_t device_lag_events = 0;
  /// Place the simulated device's segments at the recording's addresses
  /// where the trace has them (see "Segment addresses" above); false: the
  /// simulated device's own order (lowest free address) for every segment.
  /// Ignored with replay_device::cuda (the driver places them).
  bool recorded_addresses = true;
};

/// One pass of a repeated replay: its peaks (since the pass began) and what
/// the allocator did during it (the counters' increase).
struct replay_pass {
  std::uint64_t events = 0;                   ///< events replayed in this pass
  std::uint64_t peak_requested_bytes = 0;     ///< the program's requested peak in this pass (replay_result's)
  std::uint64_t peak_allocated_bytes = 0;     ///< allocated_bytes.all.peak in this pass
  std::uint64_t peak_reserved_bytes = 0;      ///< reserved_bytes.all.peak in this pass
  std::uint64_t device_mallocs = 0;           ///< num_device_alloc
  std::uint64_t device_frees = 0;             ///< num_device_free
  std::uint64_t segments_created = 0;         ///< segment.all.allocated: cudaMallocs and address reservations
  std::uint64_t ooms = 0;                     ///< out-of-memory errors in this pass (replay_result::ooms)
  std::uint64_t device_synchronizations = 0;  ///< num_device_synchronizations
  std::uint64_t pages_remapped = 0;           ///< num_pages_remapped
  std::uint64_t pages_mapped = 0;             ///< num_pages_mapped
  std::uint64_t pages_unmapped = 0;           ///< num_pages_unmapped
  std::uint64_t bytes_moved_between_streams = 0;  ///< bytes_moved_between_streams
  std::uint64_t stream_waits = 0;             ///< num_stream_waits (device-side waits; the host never waits)
  /// peak_reserved_bytes / peak_requested_bytes (0 when nothing was requested).
  [[nodiscard]] double fragmentation() const noexcept {
    return peak_requested_bytes ? double(peak_reserved_bytes) / double(peak_requested_bytes) : 0.0;
  }
};

/// One pause or resume of a trace, as replayed (the trace's `pause` and
/// `resume` events; docs/trace-format.md, "Tags, pause and resume").
struct replay_sleep_event {
  std::uint64_t index = 0;  ///< the event's index, counted over all passes
  std::uint64_t line = 0;   ///< its line in the trace
  std::string tag;
  bool pause = true;            ///< false: a resume
  bool keep_contents = false;   ///< pause: contents kept in host memory
  std::uint64_t recorded_bytes = 0;  ///< the trace's size: what the recording paused / mapped again
  /// This replay's: bytes of pages under live blocks unmapped (pause) or
  /// mapped again (resume); sleep_result::paused_bytes.
  std::uint64_t paused_bytes = 0;
  /// Pause: device bytes it gave back (its paused pages plus the tag's
  /// cached free pages; sleep_result::released_bytes). Resume: ccalloc's
  /// cached memory of active tags it gave back first (cache_released_bytes).
  std::uint64_t released_bytes = 0;
  std::uint64_t copied_bytes = 0;        ///< bytes copied to (pause) or from (resume) host memory
  std::uint64_t paused_total_bytes = 0;  ///< paused bytes of every tag after the event
  std::uint64_t reserved_bytes = 0;      ///< ccalloc's reserved bytes after the event
  /// It failed and changed nothing: a resume with no room on the device
  /// (the tag stayed paused), a pause with no host memory for the kept
  /// contents (the tag stayed active). Counted in replay_result::ooms and
  /// failed_resumes / failed_pauses.
  bool failed = false;
};

struct replay_result {
  std::string source;
  std::string config;
  replay_device device = replay_device::sim;
  /// Capacity of the device replayed on: device_memory_bytes for sim, the
  /// GPU's total memory (cudaMemGetInfo) for cuda.
  std::uint64_t device_memory_bytes = 0;
  std::uint64_t events = 0;                ///< trace events replayed
  /// The program's requested peak: the most bytes of the allocations
  /// that succeeded, each counted from its alloc to its free_completed
  /// (PyTorch's requested_bytes rule, the trace's own peak), counted by the
  /// replay from the trace's lines. Not requested_bytes.all.peak: a device
  /// synchronization of the replayed allocator (moving cached memory
  /// between streams, an out-of-memory retry) runs side streams to their
  /// ends, so the allocator frees a block still used by another stream
  /// before its free_completed line and its statistic would drop early.
  std::uint64_t peak_requested_bytes = 0;
  std::uint64_t peak_allocated_bytes = 0;  ///< allocated_bytes.all.peak
  std::uint64_t peak_reserved_bytes = 0;   ///< reserved_bytes.all.peak
  std::uint64_t device_mallocs = 0;        ///< num_device_alloc: cudaMallocs plus 2 MiB pages created
  std::uint64_t device_frees = 0;          ///< num_device_free
  /// segment.all.allocated: segments made, each a cudaMalloc (plain) or an
  /// address-space reservation (expandable); PyTorch's cudaMalloc count
  /// compares with this, not with device_mallocs.
  std::uint64_t segments_created = 0;
  /// Out-of-memory errors the replay went on after: allocations that
  /// failed (and were skipped), plus failed_resumes and failed_pauses.
  /// Not 0: the figures are not those of the recorded program.
  std::uint64_t ooms = 0;
  /// Of `ooms`: resumes that found no room on the device (the tag stayed
  /// paused), and pauses keeping contents that found no host memory (the
  /// tag stayed active); replay_sleep_event::failed marks each. The failed
  /// allocations are ooms - failed_resumes - failed_pauses.
  std::uint64_t failed_resumes = 0;
  std::uint64_t failed_pauses = 0;
  /// The library's sentence "The snapshot (oom_snapshot) could not be
  /// written to PATH (why)." from the first out-of-memory whose snapshot
  /// failed; "" when none did. The replay counts such an out-of-memory in
  /// `ooms` and goes on without showing its message: the CLI prints this.
  std::string oom_snapshot_failure;
  std::uint64_t alloc_retries = 0;         ///< num_alloc_retries
  std::uint64_t device_synchronizations = 0;  ///< num_device_synchronizations (each drains the device)
  std::uint64_t pages_remapped = 0;           ///< num_pages_remapped (X3 page recycling)
  std::uint64_t pages_mapped = 0;             ///< num_pages_mapped
  std::uint64_t pages_unmapped = 0;           ///< num_pages_unmapped
  std::uint64_t bytes_moved_between_streams = 0;  ///< bytes_moved_between_streams
  std::uint64_t stream_waits = 0;             ///< num_stream_waits (device-side waits; the host never waits)
  /// num_thread_cache_hits: allocations the thread cache served (the
  /// replay is one thread: a free and the next malloc of the same bytes on
  /// the same stream). The same figures with thread_cache:off.
  std::uint64_t thread_cache_hits = 0;
  double wall_seconds = 0.0;               ///< replay time, excluding reading the trace
  std::uint64_t repeat = 1;                ///< passes asked for (replay_options::repeat)
  std::uint64_t device_lag_events = 0;     ///< replay_options::device_lag_events
  /// Whether the simulated device placed segments at the recording's
  /// addresses (replay_options::recorded_addresses on and the trace had
  /// usable segment_alloc events); false: its own order, or a GPU.
  bool recorded_addresses = false;
  /// One entry per pass replayed (fewer than `repeat` when the hook stopped
  /// the replay early). The figures above are over the whole run: peaks the
  /// highest pass's, counters the sum.
  std::vector<replay_pass> passes;
  /// Sleep and wake: the trace's pauses and resumes in order (empty for a
  /// trace without them), and the most bytes paused at once (all tags).
  std::vector<replay_sleep_event> sleep_events;
  std::uint64_t peak_paused_bytes = 0;
  /// Sleep and wake: the most bytes allocated to blocks of tags not paused
  /// (unpaused_allocated_bytes) after any event of any pass; 0 for a trace
  /// without pause events. Paused blocks keep their addresses and still
  /// count as requested and allocated but hold no device pages, so the
  /// fragmentation of such a trace is peak reserved over this
  /// (shown_fragmentation in ccalloc/replay/report.hpp).
  std::uint64_t peak_unpaused_allocated_bytes = 0;
  /// peak_reserved_bytes / peak_requested_bytes (0 when nothing was requested).
  [[nodiscard]] double fragmentation() const noexcept {
    return peak_requested_bytes ? double(peak_reserved_bytes) / double(peak_requested_bytes) : 0.0;
  }
};

/// Replays `t` on a fresh simulated device, or on a GPU (options.device).
/// Throws config_error for a bad configuration and trace_error for an event
/// that contradicts the trace's own history (a free of an address with no
/// live allocation), naming the event's line. With replay_device::cuda,
/// throws ccalloc::error when this build has no CUDA backend, no GPU is
/// usable, cuda_device is out of range or the driver lacks gates, and
/// backend_error for a failing CUDA call. Throws ccalloc::error when
/// options.repeat is 0.
[[nodiscard]] replay_result replay_trace(const trace& t, const replay_options& options);

/// Bytes allocated on `device` to blocks of tags that are not paused:
/// allocated_bytes.all.current less every paused tag's allocated bytes
/// (caching_allocator::tag_stats). O(1) when no tag is paused, O(blocks)
/// otherwise. Thread safety: as tag_stats.
[[nodiscard]] std::uint64_t unpaused_allocated_bytes(const caching_allocator& allocator, int device = 0);

/// SPEC P7: the smallest simulated device memory (bytes, a multiple of
/// `precision_bytes`) on which `t` replays with options.config without an
/// out-of-memory error, found by bisection between the most bytes the trace
/// holds at once, each allocation counted from its alloc to its
/// free_requested (nothing smaller can work; not the figures' peak requested
/// bytes, which count until free_completed: short of memory, the allocator
/// synchronizes and reuses such blocks earlier; 0 when the trace pauses
/// tags, whose paused blocks hold no memory) and the peak
/// reserved of a replay on options.device_memory_bytes (checked); no size
/// above that upper bound is tried. A per_process_memory_fraction
/// in options.config applies to every size tried: the result is the device's
/// memory, of which the allocator may use that fraction (about peak / fraction),
/// so replaying `t` with the same options on a device of the result's size
/// fits. Like PyTorch's own figures (native_min_capacity_bytes), it assumes
/// that more memory never hurts. options.device must be sim. Cost: about
/// log2(range / precision) + 2 replays. Returns 0 when the trace never
/// reserves memory. Throws ccalloc::error if the trace does not fit
/// options.device_memory_bytes, config_error for a bad options.config.
[[nodiscard]] std::size_t find_min_device_memory(const trace& t, const replay_options& options,
                                                 std::size_t precision_bytes = 2 * mib);

}  // namespace ccalloc

// ccalloc/core/history.hpp: memory history (trace entries, annotations,
// compile contexts, user metadata) and snapshots (SPEC F13-F16, F18).
//
// What it is: while history is recorded (caching_allocator::record_history,
// PyTorch's recordHistory), every device keeps the newest N trace entries in
// a ring buffer: each alloc, free_requested, free_completed, segment_alloc,
// segment_free, segment_map, segment_unmap, snapshot, oom and empty_cache,
// with a wall-clock timestamp in microseconds, the compile context and user
// metadata in force, and optionally a context that the caller's recorder
// returns (e.g. a stack). A snapshot (caching_allocator::snapshot) gathers
// the segments with their blocks, these traces, the annotations and the
// settings in force, in the layout of PyTorch's
// torch.cuda.memory._snapshot(); to_json() writes it as JSON that
// python/ccalloc/snapshot.py turns into PyTorch's pickle (SPEC E4).
//
// Trace trackers (attach_allocator_trace_tracker, PyTorch's
// attachAllocatorTraceTracker) see every entry, recorded or not.
//
// Cost: with history off and no tracker, the allocator pays one relaxed
// atomic load and a predicted branch per malloc and per free. With it on,
// each entry takes a mutex and copies two short strings; with a recorder,
// each malloc (and free, record_context::all) also calls it and keeps its
// context in a map while the block lives. Contexts become frames only when a
// snapshot is written (trace_context::to_frames). Figures: docs/perf.md.
// Snapshots: ccalloc/core/snapshot.hpp.
//
// Thread safety: every function here and in the allocator may be called
// concurrently. Entries of one device are in the order they were recorded.
#pragma once

#include <ccalloc/base/types.hpp>
#include <ccalloc/core/tags.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ccalloc {

/// What a trace entry records. The first nine are PyTorch's
/// TraceEntry::Action (same names in snapshots); empty_cache is ccalloc's own
/// (an emptyCache call; the segment_free entries it causes follow it).
enum class trace_entry_action : std::uint8_t {
  alloc,           ///< malloc returned `addr`; size = requested bytes
  free_requested,  ///< free(addr) was called; size = requested bytes
  free_completed,  ///< the block is back in the cache (after its events); size = requested bytes
  segment_alloc,   ///< a segment came from the device; size = segment bytes
  segment_free,    ///< a segment went back to the device; size = segment bytes
  segment_map,     ///< pages of an expandable segment were mapped; size = mapped bytes
  segment_unmap,   ///< pages of an expandable segment were unmapped; size = unmapped bytes
  snapshot,        ///< a snapshot was taken; addr 0, size = active bytes then
  oom,             ///< out of memory; addr = device free bytes, size = requested bytes
  empty_cache,     ///< empty_cache was called; addr 0, size = reserved bytes then
  pause,           ///< a tag was paused (SPEC S2); addr = bytes of its contents kept in host memory (0: dropped), size = its paused bytes (pages to map again)
  resume,          ///< a tag was resumed (SPEC S3); addr 0, size = the bytes mapped again
};
inline constexpr std::size_t trace_entry_action_count = 12;

/// The name used in snapshots ("free_requested"). Never fails.
[[nodiscard]] std::string_view to_string(trace_entry_action action) noexcept;
/// The action named `name`, or nullopt.
[[nodiscard]] std::optional<trace_entry_action> parse_trace_entry_action(std::string_view name) noexcept;

/// One frame of a context (PyTorch's snapshot frame: {name, filename, line}).
struct stack_frame {
  std::string name;
  std::string filename;
  std::int64_t line = 0;
  friend bool operator==(const stack_frame&, const stack_frame&) = default;
};

/// What a context recorder returns (PyTorch's GatheredContext): an opaque,
/// shared, immutable object that the allocator keeps with the entries and
/// blocks it belongs to and turns into frames only when a snapshot is
/// written (to_json, to_pickle). Two ways to fill it:
/// - eagerly: set `frames` (innermost first, as PyTorch writes them);
/// - lazily: derive and override to_frames(), e.g. to keep raw instruction
///   pointers and symbolize them only for the snapshot (what PyTorch's
///   CapturedTraceback does).
/// The allocator never looks inside: code that gave the context may downcast
/// it (the PyTorch integration hands its own contexts back to PyTorch).
///
/// Lifetime: the allocator holds a context while a trace entry, a live
/// block or a segment holds it. It drops its references outside its locks:
/// one dropped while it holds them (an entry the ring buffer overwrites, the
/// block whose free completes, a segment given back, what record_history
/// clears) is kept by the thread that dropped it and let go where that
/// thread's trace-tracker entries are delivered (trace_tracker): after the
/// allocator released its locks, before the call (malloc, free,
/// empty_cache, record_history, ...) returns or throws; a few calls that
/// change pools (release_pool) deliver nothing and leave it to the thread's
/// next call that does, or to the thread's exit. So a derived context's
/// destructor, run on that thread where the last reference goes, may call
/// into any ccalloc allocator, this one included.
/// Exceptions: the allocator's destructor destroys the contexts it holds
/// (a call into that allocator from there is undefined); a context that
/// caching_allocator::record_history drops goes while that call holds the
/// caching_allocator's configuration lock, so from there a call of that
/// caching_allocator that takes it (record_history, set_config, config,
/// is_history_enabled, the attach_ functions) waits forever; and when no host
/// memory is left to keep a dropped reference, it is dropped in place, where
/// a call into the same allocator may wait forever on a lock its thread holds.
struct trace_context {
  std::vector<stack_frame> frames;

  trace_context() = default;
  explicit trace_context(std::vector<stack_frame> eager_frames) : frames(std::move(eager_frames)) {}
  trace_context(const trace_context&) = default;
  trace_context& operator=(const trace_context&) = default;
  virtual ~trace_context() = default;
  /// The frames a snapshot writes; by default `frames`. Called by the
  /// snapshot writers, outside the allocator's locks, on the thread that
  /// writes the snapshot, once per entry or block that holds the context.
  /// An exception it throws propagates to the caller of to_json/to_pickle.
  [[nodiscard]] virtual std::vector<stack_frame> to_frames() const { return frames; }
};
using context_ptr = std::shared_ptr<const trace_context>;

/// Called by the allocator, outside its locks, on the calling thread, to
/// attach a context to what is being recorded (PyTorch's CreateContextFn).
/// May return nullptr. An exception it throws propagates to the caller of
/// malloc/free, before the allocator changed anything. Its cost is paid on
/// every malloc (state and up) and free (all) while history is on; with
/// history off it is never called.
using context_recorder = std::function<context_ptr()>;

/// When the recorder is called (PyTorch's RecordContext).
enum class record_context : std::uint8_t {
  never,  ///< never
  state,  ///< at malloc: the context is kept with the live block (snapshot frames only)
  alloc,  ///< also attached to the alloc and segment entries of the trace
  all,    ///< also called at free and attached to the free entries
};

/// One entry of a device's trace (PyTorch's TraceEntry).
struct trace_entry {
  trace_entry_action action = trace_entry_action::alloc;
  int device = 0;
  std::uintptr_t addr = 0;   ///< address; for oom, the device's free bytes (as PyTorch)
  std::size_t size = 0;      ///< bytes, see trace_entry_action
  stream_t stream = 0;
  std::uint64_t time_us = 0;  ///< microseconds since the Unix epoch
  context_ptr context;        ///< null unless record_context allows it
  std::string compile_context = "N/A";  ///< top of the compile-context stack, "N/A" if empty (PyTorch)
  std::string user_metadata;            ///< set_user_metadata's value then ("" by default)
  /// The tag (SPEC S1; core/tags.hpp) of the block or segment: for alloc,
  /// free_requested, free_completed (also one completed later, after its
  /// events, on whatever thread), pause and resume its own; for segment
  /// entries the tag in scope on the thread that caused them (a segment_map
  /// inside a tagged malloc is that tag's).
  tag_id tag = default_tag_id;
};

/// A record_annotation call (PyTorch's AnnotationEntry).
struct annotation_entry {
  int device = 0;
  std::uint64_t time_us = 0;  ///< microseconds since the Unix epoch
  std::vector<std::pair<std::string, std::string>> metadata;  ///< in the order given
};

/// Arguments of record_history (PyTorch's recordHistory and the arguments of
/// torch.cuda.memory._record_memory_history).
struct history_options {
  bool enabled = true;
  /// Called according to `when`; may be empty (then no context).
  context_recorder recorder;
  record_context when = record_context::all;
  /// Ring-buffer capacity per device (newest entries kept); >= 1. Also the
  /// capacity of the annotation buffer.
  std::size_t max_entries = std::numeric_limits<std::size_t>::max();
  /// Drop what was recorded so far. Disabling always drops it (PyTorch).
  bool clear = false;
  /// Actions not stored in the ring buffer (trackers still see them).
  std::vector<trace_entry_action> skip_actions;
};

/// Called with every trace entry of every device (SPEC F18), recorded or
/// not, on the thread that caused it, after the allocator released its locks
/// (it may call back into the allocator). An exception it throws is dropped:
/// the other trackers still run and the allocator's state is unaffected.
using trace_tracker = std::function<void(const trace_entry&)>;

}  // namespace ccalloc

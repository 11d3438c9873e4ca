// Trace replay on the simulated device or a GPU (SPEC X8). See
// include/ccalloc/replay/replay.hpp for the model.
//
// One event loop (replay_events) drives a caching_allocator for every device.
// What differs is how a block's free_requested .. free_completed gap holds on
// the device, behind the small gap_model interface:
//   clock_gaps  (gap_model.hpp) the simulated device's virtual clock (enqueue_work /
//               advance_to): the default, bit for bit the replay of old;
//   gate_gaps   (gate_gaps.hpp) host-controlled gates (device_backend::create_gate) on any
//               backend with capabilities().gates: the GPU (cuda_backend),
//               and sim_backend for the CPU test of this driver.
// The side-stream pool, which reuses a side stream once its gap is over, is
// shared (side_stream_pool).
#include <ccalloc/replay/replay.hpp>

#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/tags.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include "gap_model.hpp"
#include "gate_gaps.hpp"

#ifndef CCALLOC_HAVE_CUDA_BACKEND  // set by CMake (CCALLOC_WITH_CUDA)
#define CCALLOC_HAVE_CUDA_BACKEND 0
#endif
#if CCALLOC_HAVE_CUDA_BACKEND
#include <ccalloc/backend/cuda_backend.hpp>
#endif

#include <algorithm>
#include <charconv>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ccalloc {

const char* to_string(replay_device device) noexcept { return device == replay_device::cuda ? "cuda" : "sim"; }

namespace {

using namespace replay_detail;

// An out-of-memory the replay goes on after: counted; the first one whose
// oom_snapshot could not be written keeps the sentence saying why (the
// message is otherwise not shown).
void count_oom(replay_result& r, const out_of_memory_error& e) {
  ++r.ooms;
  if (!r.oom_snapshot_failure.empty()) return;
  const std::string_view what = e.what();
  if (const std::size_t at = what.find("The snapshot (oom_snapshot) could not be written"); at != what.npos)
    r.oom_snapshot_failure = what.substr(at);
}

// A free at an address whose `earlier` event (its alloc, or its
// free_requested) has another size or stream: the trace is corrupt or its
// lines are mixed up. PyTorch records free_requested and free_completed
// with the size and the stream of the block (the stream it was allocated
// on, also when record_stream made other streams use it: those streams'
// events delay free_completed, they are not its stream); ccalloc's history
// does the same, and the RMM reader writes a free with its allocation's.
void check_free_matches(const trace& t, const trace_event& e, const trace_event& earlier) {
  const std::string head = std::string(to_string(e.action)) + " of address " + std::to_string(e.addr);
  const std::string its = ", but its " + std::string(to_string(earlier.action)) + " (line " +
                          std::to_string(earlier.line) + ")";
  if (e.size != earlier.size)
    throw trace_error(t.source, e.line,
                      head + " with size " + std::to_string(e.size) + its + " has size " + std::to_string(earlier.size));
  if (e.stream != earlier.stream)
    throw trace_error(t.source, e.line,
                      head + " on stream " + std::to_string(e.stream) + its + " is on stream " +
                          std::to_string(earlier.stream) +
                          " (a free is recorded on its block's stream, the one it was allocated on)");
}

// An event naming a range of memory must fit in the 64-bit address space:
// [addr, addr + size) past 2^64 comes from no recorded program, and the
// recording's own figures (sums of segment sizes) would wrap.
void check_in_address_space(const trace& t, const trace_event& e) {
  switch (e.action) {
    case trace_action::alloc:
    case trace_action::free_requested:
    case trace_action::free_completed:
    case trace_action::segment_alloc:
    case trace_action::segment_free:
    case trace_action::segment_map:
    case trace_action::segment_unmap:
      if (e.size != 0 && e.addr + (e.size - 1) < e.addr)
        throw trace_error(t.source, e.line,
                          std::string(to_string(e.action)) + " of " + std::to_string(e.size) + " bytes at address " +
                              std::to_string(e.addr) + " passes the end of the 64-bit address space");
      break;
    default: break;
  }
}

// The live allocations of a trace (alloc to free_requested) of one byte or
// more, by address: they must not overlap. An allocator hands out disjoint
// blocks, so an alloc whose [addr, addr + size) meets a live one comes from
// no recorded program: lines mixed up, two traces merged, or a recorder's
// fault. (An alloc at the very address of a live one is the event loop's
// error, naming both lines; an address freed but not yet completed may be
// allocated again, as the replay reads the trace.) The shared traces have
// none.
class live_ranges {
 public:
  explicit live_ranges(const trace& t) : t_(t) {}

  // Alloc event i, checked against the live allocations, then one of them.
  void alloc(std::size_t i) {
    const trace_event& e = t_.events[i];
    if (e.size == 0) return;  // holds no byte
    auto next = by_addr_.lower_bound(e.addr);
    if (next != by_addr_.end() && next->first == e.addr) return;  // the same address: the event loop's error
    if (next != by_addr_.end() && next->first - e.addr < e.size) refuse(e, t_.events[next->second]);
    if (next != by_addr_.begin()) {
      const trace_event& below = t_.events[std::prev(next)->second];
      if (e.addr - below.addr < below.size) refuse(e, below);
    }
    by_addr_.emplace_hint(next, e.addr, i);
  }
  // Alloc event i is freed (free_requested).
  void free(std::size_t i) {
    const auto it = by_addr_.find(t_.events[i].addr);
    if (it != by_addr_.end() && it->second == i) by_addr_.erase(it);
  }

 private:
  [[noreturn]] void refuse(const trace_event& e, const trace_event& live) const {
    throw trace_error(t_.source, e.line,
                      "alloc of " + std::to_string(e.size) + " bytes at address " + std::to_string(e.addr) +
                          " overlaps the live allocation of " + std::to_string(live.size) + " bytes at address " +
                          std::to_string(live.addr) + " (allocated at line " + std::to_string(live.line) +
                          ", not freed since): an allocator hands out disjoint blocks");
  }

  const trace& t_;
  std::map<std::uint64_t, std::size_t> by_addr_;  // addr -> alloc index
};

// The recording allocator's segments and mapped pages, checked as the trace
// goes: each is refused at its line, before the replay, when no recorded
// program makes it (its bytes would count twice, or go negative, in the
// recording allocator's reserved figures).
//   segment_alloc  cudaMalloc: its bytes meet no live segment's;
//   segment_free   cudaFree: of a live segment, at its base, with its size
//                  (PyTorch and ccalloc record the segment's size);
//   segment_map    pages of an expandable segment mapped: none of them mapped
//                  already (PyTorch and ccalloc map unmapped pages only);
//   segment_unmap  pages unmapped: every byte of them mapped (by one or more
//                  segment_map lines: a free run may span pages mapped at
//                  different times).
// A trace that starts after the program did begins with the segments and
// pages live then, as the snapshot converters write them: a segment_alloc
// for each segment (exact), and a segment_map of the bytes each expandable
// segment had mapped, placed at its base (the snapshot does not say which
// pages they were). So when the trace opens with segment_map lines (before
// its first event of another kind than segment_alloc or segment_map), the
// pages are checked against what the trace did after its opening only:
// bytes it has neither mapped nor unmapped since may be mapped or not.
class recorded_segments {
 public:
  explicit recorded_segments(const trace& t) : t_(t) {}

  void event(const trace_event& e) {
    const bool opening_line = e.action == trace_action::segment_alloc || e.action == trace_action::segment_map;
    opening_ = opening_ && opening_line;
    switch (e.action) {
      case trace_action::segment_alloc: alloc(e); break;
      case trace_action::segment_free: free(e); break;
      case trace_action::segment_map:
        if (opening_) open_map(e);
        else map(e);
        break;
      case trace_action::segment_unmap: unmap(e); break;
      default: break;
    }
  }

 private:
  struct range {
    std::uint64_t end;  // one past the last byte, 0 for 2^64 (the event is in the address space)
    std::size_t line;
  };
  using ranges = std::map<std::uint64_t, range>;  // first byte -> range, disjoint

  static std::uint64_t end_of(const trace_event& e) { return e.addr + e.size; }
  static bool below(std::uint64_t a, std::uint64_t end) { return end == 0 || a < end; }  // a < end
  // The first range of `r` that meets [a, end) (a < end, or end 0), or r.end().
  static ranges::iterator meets(ranges& r, std::uint64_t a, std::uint64_t end) {
    auto it = r.upper_bound(a);
    if (it != r.begin() && below(a, std::prev(it)->second.end)) return std::prev(it);
    if (it != r.end() && below(it->first, end)) return it;
    return r.end();
  }
  // Removes [a, end) from `r`.
  static void cut(ranges& r, std::uint64_t a, std::uint64_t end) {
    auto it = meets(r, a, end);
    while (it != r.end() && below(it->first, end)) {
      const range was = it->second;
      const std::uint64_t first = it->first;
      it = r.erase(it);
      if (first < a) r.emplace(first, range{a, was.line});
      if (end != 0 && (was.end == 0 || was.end > end)) {
        r.emplace(end, range{was.end, was.line});
        break;
      }
    }
  }
  std::string head(const trace_event& e) const {
    return std::string(to_string(e.action)) + " of " + std::to_string(e.size) + " bytes at address " +
           std::to_string(e.addr);
  }

  void alloc(const trace_event& e) {
    if (e.size == 0) return;
    if (const auto it = meets(segments_, e.addr, end_of(e)); it != segments_.end())
      throw trace_error(t_.source, e.line,
                        head(e) + " overlaps the live segment of " + std::to_string(it->second.end - it->first) +
                            " bytes at address " + std::to_string(it->first) + " (segment_alloc at line " +
                            std::to_string(it->second.line) +
                            ", no segment_free since): its bytes would be reserved twice");
    segments_.emplace(e.addr, range{end_of(e), e.line});
    freed_.erase(e.addr);
  }

  void free(const trace_event& e) {
    const auto it = segments_.find(e.addr);
    if (it == segments_.end()) {
      if (const auto f = freed_.find(e.addr); f != freed_.end())
        throw trace_error(t_.source, e.line,
                          head(e) + ": the segment at this address was already freed at line " +
                              std::to_string(f->second) + " (no segment_alloc since)");
      throw trace_error(t_.source, e.line,
                        head(e) +
                            ": no segment was allocated at this address (no segment_alloc of it before; a trace "
                            "that starts after the segment was allocated begins with its segment_alloc, as the "
                            "snapshot converters write it)");
    }
    const std::uint64_t size = it->second.end - it->first;
    if (size != e.size)
      throw trace_error(t_.source, e.line,
                        head(e) + ", but its segment_alloc (line " + std::to_string(it->second.line) + ") has " +
                            std::to_string(size) + " bytes (a segment is freed whole)");
    segments_.erase(it);
    freed_[e.addr] = e.line;
  }

  // A segment_map of the trace's opening: pages mapped before the trace,
  // placed where the converter could (see above).
  void open_map(const trace_event&) { opening_maps_ = true; }

  void map(const trace_event& e) {
    if (e.size == 0) return;
    const std::uint64_t end = end_of(e);
    if (const auto it = meets(mapped_, e.addr, end); it != mapped_.end())
      throw trace_error(t_.source, e.line,
                        head(e) + " maps bytes already mapped: those of the segment_map at line " +
                            std::to_string(it->second.line) + " from address " +
                            std::to_string(std::max(it->first, e.addr)) + " (no segment_unmap of them between)");
    cut(unmapped_, e.addr, end);
    mapped_.emplace(e.addr, range{end, e.line});
  }

  void unmap(const trace_event& e) {
    if (e.size == 0) return;
    const std::uint64_t end = end_of(e);
    // The bytes of [addr, end) that no mapped range covers: each must be of
    // unknown state (opening_maps_, and neither mapped nor unmapped since).
    std::uint64_t at = e.addr;  // [addr, at) checked
    for (auto it = meets(mapped_, e.addr, end);; ++it) {
      const bool in = it != mapped_.end() && below(it->first, end);
      if (in ? it->first > at : at != end) refuse_gap(e, at, in ? it->first : end);
      if (!in) break;
      at = it->second.end;
      if (at == 0 || (end != 0 && at >= end)) break;  // covered to the end
    }
    cut(mapped_, e.addr, end);
    cut(unmapped_, e.addr, end);
    unmapped_.emplace(e.addr, range{end, e.line});
  }

  // [from, to) of segment_unmap `e` is not mapped: an error, but for bytes
  // of unknown state after an opening with segment_map lines.
  void refuse_gap(const trace_event& e, std::uint64_t from, std::uint64_t to) {
    if (opening_maps_) {
      const auto it = meets(unmapped_, from, to);
      if (it == unmapped_.end()) return;  // neither mapped nor unmapped since the opening
      throw trace_error(t_.source, e.line,
                        head(e) + " unmaps bytes the segment_unmap at line " + std::to_string(it->second.line) +
                            " unmapped, from address " + std::to_string(std::max(it->first, from)) +
                            " (no segment_map of them between)");
    }
    throw trace_error(t_.source, e.line,
                      head(e) + " unmaps bytes that are not mapped, from address " + std::to_string(from) +
                          " (no segment_map covers them, or they were unmapped since): an unmap covers mapped "
                          "pages only");
  }

  const trace& t_;
  bool opening_ = true;        // no event yet but segment_alloc and segment_map
  bool opening_maps_ = false;  // the opening had segment_map lines
  ranges segments_;            // live segments (segment_alloc .. segment_free)
  ranges mapped_;              // bytes mapped after the opening, by the segment_map that mapped them
  ranges unmapped_;            // bytes unmapped and not mapped again, by the segment_unmap that unmapped them
  std::unordered_map<std::uint64_t, std::size_t> freed_;  // segment base -> line of its segment_free
};

// For each free_requested event, the index of its free_completed event
// (`never` if the trace ends first). Also validates the pairing, that a
// free has the size and stream of its alloc, that live allocations do
// not overlap (live_ranges), and the recording allocator's segments and
// pages (recorded_segments).
std::vector<std::uint64_t> completion_indices(const trace& t) {
  std::vector<std::uint64_t> completion(t.events.size(), never);
  std::unordered_map<std::uint64_t, std::uint64_t> allocated_at;  // addr -> alloc index
  std::unordered_map<std::uint64_t, std::uint64_t> requested_at;  // addr -> free_requested index
  live_ranges ranges(t);
  recorded_segments segments(t);
  allocated_at.reserve(1024);
  requested_at.reserve(1024);
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const trace_event& e = t.events[i];
    check_in_address_space(t, e);
    segments.event(e);
    if (e.action == trace_action::alloc) {
      ranges.alloc(i);
      allocated_at[e.addr] = i;  // an alloc at a live address is the event loop's error, naming both lines
    } else if (e.action == trace_action::free_requested) {
      if (auto it = allocated_at.find(e.addr); it != allocated_at.end()) {
        check_free_matches(t, e, t.events[it->second]);
        ranges.free(it->second);
        allocated_at.erase(it);
      }
      requested_at[e.addr] = i;
    } else if (e.action == trace_action::free_completed) {
      auto it = requested_at.find(e.addr);
      if (it == requested_at.end())
        throw trace_error(t.source, e.line,
                          "free_completed of address " + std::to_string(e.addr) + " with no free_requested before it");
      check_free_matches(t, e, t.events[it->second]);
      completion[it->second] = i;
      requested_at.erase(it);
    }
  }
  return completion;
}

// The trace index where the gap of free_requested event `i` ends: its
// free_completed, or the end of the trace for a block never completed.
std::uint64_t gap_end(const trace& t, const std::vector<std::uint64_t>& completion, std::size_t i) {
  return completion[i] == never ? t.events.size() : completion[i];
}

// Gaps are free_requested events whose free_completed is not the next event.
bool has_gap(const std::vector<std::uint64_t>& completion, std::size_t i) { return completion[i] > i + 1; }

// The most gaps open at once (an upper bound: the replay may end some early).
std::size_t max_open_gaps(const trace& t, const std::vector<std::uint64_t>& completion) {
  std::map<std::uint64_t, std::int64_t> delta;  // index -> change in open gaps
  for (std::size_t i = 0; i < t.events.size(); ++i)
    if (t.events[i].action == trace_action::free_requested && has_gap(completion, i)) {
      ++delta[i];
      --delta[gap_end(t, completion, i)];
    }
  std::int64_t open = 0;
  std::int64_t most = 0;
  for (const auto& [index, d] : delta) most = std::max(most, open += d);
  return static_cast<std::size_t>(most);
}

// ---- the gap models: gap_model.hpp (clock_gaps) and gate_gaps.hpp -------------------

// For each event: true for an `alloc` the trace never frees (no
// free_requested at its address after it). A repeated replay makes these in
// its first pass only.
std::vector<bool> never_freed_allocs(const trace& t) {
  std::vector<bool> never_freed(t.events.size(), false);
  std::unordered_map<std::uint64_t, std::size_t> last_alloc;  // addr -> index of its unfreed alloc
  last_alloc.reserve(1024);
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const trace_event& e = t.events[i];
    if (e.action == trace_action::alloc) last_alloc[e.addr] = i;
    else if (e.action == trace_action::free_requested) last_alloc.erase(e.addr);
  }
  for (const auto& [addr, i] : last_alloc) never_freed[i] = true;
  return never_freed;
}


// Trace stream -> the stream the replay uses for it.
struct stream_map {
  // The trace's handle itself (adopted by the simulated device: replay_trace),
  // but for those in `streams`; otherwise `streams` maps every handle.
  bool identity = true;
  std::unordered_map<std::uint64_t, stream_t> streams;
  [[nodiscard]] stream_t operator()(std::uint64_t recorded) const {
    if (!identity) return streams.at(recorded);
    if (streams.empty()) [[likely]] return static_cast<stream_t>(recorded);
    const auto it = streams.find(recorded);
    return it == streams.end() ? static_cast<stream_t>(recorded) : it->second;
  }
};

// The simulated device's streams for the trace's: each handle becomes a
// stream of the device under that very handle (adopt_stream), before any
// side stream is created. 0, 1 and 2 are the default streams' handles. A
// handle with the top bit set (2^63 and above) is one the device keeps for
// per-thread default streams: it gets a stream of its own (create_stream,
// which skips the adopted handles) under another handle.
stream_map adopt_trace_streams(const trace& t, sim_backend& sim) {
  stream_map m;
  std::unordered_set<std::uint64_t> seen;
  std::vector<std::uint64_t> renamed;  // in the order of their first event
  for (const trace_event& e : t.events) {
    const auto s = static_cast<stream_t>(e.stream);
    if (s == default_stream || s == legacy_stream_handle || s == per_thread_stream_handle ||
        !seen.insert(e.stream).second)
      continue;
    if (device_backend::is_per_thread_stream(s)) renamed.push_back(e.stream);
    else sim.adopt_stream(0, s);
  }
  for (const std::uint64_t s : renamed) m.streams.emplace(s, sim.create_stream(0));
  return m;
}

// Trace stream 0 -> the legacy default stream; every other one -> a new stream.
stream_map make_streams(const trace& t, gate_gaps& gates) {
  stream_map m;
  m.identity = false;
  m.streams.emplace(0, default_stream);
  for (const trace_event& e : t.events)
    if (e.action == trace_action::alloc && m.streams.count(e.stream) == 0)
      m.streams.emplace(e.stream, gates.create_trace_stream());
  return m;
}

// The allocator's refusal `x` of trace event `e` (an allocation under a
// paused tag, a resume or pause it refused), as an error at the event's
// line. The library's "ccalloc: " goes: the tools say it once, before the
// file and line.
[[noreturn]] void throw_refused(const trace& t, const trace_event& e, const invalid_argument_error& x) {
  constexpr std::string_view prefix = "ccalloc: ";
  std::string_view why = x.what();
  if (why.starts_with(prefix)) why.remove_prefix(prefix.size());
  throw trace_error(t.source, e.line, std::string(why));
}

// ---- tags, pause and resume ----------------------------------------------------------

// The trace's tag, pause and resume events on the replaying thread: the tag
// in scope for its allocations, and the record of every pause and resume.
class sleep_replay {
 public:
  sleep_replay(const trace& t, caching_allocator& allocator, replay_result& r) : t_(t), a_(allocator), r_(r) {}
  sleep_replay(const sleep_replay&) = delete;
  sleep_replay& operator=(const sleep_replay&) = delete;

  // Each pass starts under the default tag, as the trace does.
  void begin_pass() { scope_.reset(); }

  // Between two passes: the program runs again from its start, where no tag
  // is paused. Tags the pass left paused are resumed (recorded as resumes at
  // `index`, the pass's last event, line 0: no line of the trace), and the
  // trace's pause order starts afresh, so that the next pass's first pause
  // of a tag is no second pause. A resume without room counts in `ooms`
  // and failed_resumes.
  void end_pass(std::uint64_t index) {
    scope_.reset();
    paused_at_.clear();
    for (const std::string& name : a_.paused_tags(0)) {
      replay_sleep_event s;
      s.index = index;
      s.tag = name;
      s.pause = false;
      try {
        resume_into(s);
      } catch (const out_of_memory_error& x) {
        count_oom(r_, x);
        ++r_.failed_resumes;
        s.failed = true;
      }
      record(std::move(s));
    }
  }

  void replay(const trace_event& e, std::uint64_t index) {
    const std::string name = e.tag == 0 ? std::string(default_tag_name) : t_.tags.at(e.tag - 1);
    if (e.action == trace_action::tag) {
      scope_.reset();
      try {
        if (e.tag != 0) scope_.emplace(name);
      } catch (const invalid_argument_error& x) {  // a name the reader let through but tags refuse
        throw_refused(t_, e, x);
      }
      return;
    }
    check_pause_order(e, name);
    replay_sleep_event s;
    s.index = index;
    s.line = e.line;
    s.tag = name;
    s.pause = e.action == trace_action::pause;
    s.keep_contents = e.keep_contents;
    s.recorded_bytes = e.size;
    try {
      (void)intern_tag(name);  // a tag the replay never allocated under may still be paused
      if (s.pause) {
        const sleep_result p = a_.pause({name}, e.keep_contents, 0);
        s.paused_bytes = p.paused_bytes;
        s.released_bytes = p.released_bytes;
        s.copied_bytes = p.copied_bytes;
        paused_ += p.paused_bytes;
      } else {
        resume_into(s);
      }
    } catch (const out_of_memory_error& x) {
      // A resume without room on the device, or a pause without host memory
      // for the kept contents: nothing changed, the tag stays as it was.
      count_oom(r_, x);
      ++(s.pause ? r_.failed_pauses : r_.failed_resumes);
      s.failed = true;
    } catch (const invalid_argument_error& x) {
      throw_refused(t_, e, x);
    }
    r_.peak_paused_bytes = std::max(r_.peak_paused_bytes, paused_);
    record(std::move(s));
  }

  // Resumes s.tag and fills in what the resume did; out_of_memory_error
  // passes through (nothing changed).
  void resume_into(replay_sleep_event& s) {
    const sleep_result w = a_.resume({s.tag}, 0);
    s.paused_bytes = w.paused_bytes;
    s.released_bytes = w.cache_released_bytes;
    s.copied_bytes = w.copied_bytes;
    paused_ -= std::min(paused_, static_cast<std::uint64_t>(w.paused_bytes));
  }

  // Adds `s` to the result with the figures after it.
  void record(replay_sleep_event s) {
    s.paused_total_bytes = paused_;
    s.reserved_bytes = static_cast<std::uint64_t>(a_.get_device_stats(0).reserved_bytes[0].current);
    r_.sleep_events.push_back(std::move(s));
  }

  // A pause of a tag the trace already paused, or a resume of one it has
  // not paused, is an error naming the line: the allocator would do
  // nothing (it changes only tags not yet in the asked state), and its
  // recorder writes a pause or resume line only for a tag that changed, so
  // such a line comes from no recorded program. The order is the trace's
  // own (not the allocator's state, which a refused resume leaves paused):
  // the verdict does not depend on the device's size.
  void check_pause_order(const trace_event& e, const std::string& name) {
    const bool pause = e.action == trace_action::pause;
    const auto it = paused_at_.find(name);
    if (pause && it != paused_at_.end())
      throw trace_error(t_.source, e.line,
                        "pause of tag '" + name + "', which the trace already paused at line " +
                            std::to_string(it->second) + " (no resume between)");
    if (!pause && it == paused_at_.end())
      throw trace_error(t_.source, e.line,
                        "resume of tag '" + name + "', which the trace has not paused (no pause of it before, "
                                                   "or already resumed)");
    if (pause) paused_at_.emplace(name, e.line);
    else paused_at_.erase(it);
  }

  // The end: back to the default tag, every tag awake (so that its blocks
  // can be freed).
  void finish() {
    scope_.reset();
    for (const std::string& name : a_.paused_tags(0)) {
      try {
        (void)a_.resume({name}, 0);
      } catch (const out_of_memory_error&) {  // its blocks then stay until the allocator goes
      }
    }
  }

 private:
  const trace& t_;
  caching_allocator& a_;
  replay_result& r_;
  std::optional<tag_scope> scope_;
  std::uint64_t paused_ = 0;
  std::unordered_map<std::string, std::size_t> paused_at_;  // tag the trace paused -> line of its pause
};

// ---- the event loop ----------------------------------------------------------------

[[noreturn]] void throw_still_live(const trace& t, const trace_event& e, std::uint64_t allocated_line) {
  throw trace_error(t.source, e.line,
                    "alloc at address " + std::to_string(e.addr) + ", which is still live (allocated at line " +
                        std::to_string(allocated_line) + ")");
}

// The replay's streams for the trace's (`streams`) in the order of their
// last event (index, stream): a program that makes a stream per request
// destroys it after its last use. Empty when `gaps` keeps the trace's
// streams (they are its own).
// Destroying a trace stream at its end changes no figure only while other
// streams may adopt its cached memory: without reuse_across_streams (for
// reservations, without trim_on_new_peak) the allocator gives it back to the
// device at the destroy, which the recorded program, whose stream lived on,
// did not do. Those configurations keep every trace stream to the end.
bool destroying_streams_changes_no_figure(const allocator_config& c) {
  return c.reuse_across_streams && c.trim_on_new_peak;
}

std::vector<std::pair<std::uint64_t, stream_t>> stream_ends_of(const trace& t, const gap_model& gaps,
                                                               const stream_map& streams) {
  std::vector<std::pair<std::uint64_t, stream_t>> stream_ends;  // (last event index, stream), by index
  if (!gaps.ends_trace_streams()) return stream_ends;
  std::unordered_map<stream_t, std::uint64_t> last_event;
  for (std::uint64_t i = 0; i < t.events.size(); ++i) {
    const stream_t st = streams(t.events[i].stream);
    if (st != default_stream && st != legacy_stream_handle && st != per_thread_stream_handle &&
        !device_backend::is_per_thread_stream(st))
      last_event[st] = i;
  }
  stream_ends.reserve(last_event.size());
  for (const auto& [st, i] : last_event) stream_ends.emplace_back(i, st);
  std::sort(stream_ends.begin(), stream_ends.end());
  return stream_ends;
}

// The counters' increase from `before` to `s`, and the peaks of `s`: one
// pass's figures (its peak requested bytes counted from the trace:
// requested_bytes_counter).
replay_pass pass_figures(const device_stats& s, const device_stats& before, std::uint64_t events,
                         std::uint64_t ooms, std::uint64_t peak_requested) {
  replay_pass p;
  p.events = events;
  p.peak_requested_bytes = peak_requested;
  p.peak_allocated_bytes = static_cast<std::uint64_t>(s.allocated_bytes[0].peak);
  p.peak_reserved_bytes = static_cast<std::uint64_t>(s.reserved_bytes[0].peak);
  const auto delta = [](std::int64_t now, std::int64_t then) { return static_cast<std::uint64_t>(now - then); };
  p.device_mallocs = delta(s.num_device_alloc, before.num_device_alloc);
  p.device_frees = delta(s.num_device_free, before.num_device_free);
  p.segments_created = delta(s.segment[0].allocated, before.segment[0].allocated);
  p.device_synchronizations = delta(s.num_device_synchronizations, before.num_device_synchronizations);
  p.pages_remapped = delta(s.num_pages_remapped, before.num_pages_remapped);
  p.pages_mapped = delta(s.num_pages_mapped, before.num_pages_mapped);
  p.pages_unmapped = delta(s.num_pages_unmapped, before.num_pages_unmapped);
  p.bytes_moved_between_streams = delta(s.bytes_moved_between_streams, before.bytes_moved_between_streams);
  p.stream_waits = delta(s.num_stream_waits, before.num_stream_waits);
  p.ooms = ooms;
  return p;
}

// The whole replay's figures: the highest peaks of its passes, the
// counters of the allocator's statistics `s` at the end.
void total_figures(const device_stats& s, replay_result& r) {
  for (const replay_pass& p : r.passes) {
    r.peak_requested_bytes = std::max(r.peak_requested_bytes, p.peak_requested_bytes);
    r.peak_allocated_bytes = std::max(r.peak_allocated_bytes, p.peak_allocated_bytes);
    r.peak_reserved_bytes = std::max(r.peak_reserved_bytes, p.peak_reserved_bytes);
  }
  r.device_mallocs = static_cast<std::uint64_t>(s.num_device_alloc);
  r.device_frees = static_cast<std::uint64_t>(s.num_device_free);
  r.segments_created = static_cast<std::uint64_t>(s.segment[0].allocated);
  r.alloc_retries = static_cast<std::uint64_t>(s.num_alloc_retries);
  r.device_synchronizations = static_cast<std::uint64_t>(s.num_device_synchronizations);
  r.pages_remapped = static_cast<std::uint64_t>(s.num_pages_remapped);
  r.pages_mapped = static_cast<std::uint64_t>(s.num_pages_mapped);
  r.pages_unmapped = static_cast<std::uint64_t>(s.num_pages_unmapped);
  r.bytes_moved_between_streams = static_cast<std::uint64_t>(s.bytes_moved_between_streams);
  r.stream_waits = static_cast<std::uint64_t>(s.num_stream_waits);
  r.thread_cache_hits = static_cast<std::uint64_t>(s.num_thread_cache_hits);
}

// The recording's time, passes end to end: the host clock of the
// allocator's time budgets (gap_model::set_host_time_us). Saturating: a
// recording that spans about 2^64 us (malformed times) must not wrap the
// clock back to its start.
class recording_clock {
 public:
  explicit recording_clock(const trace& t) {
    std::uint64_t t_end = 0;
    for (const trace_event& e : t.events) {
      t0_ = std::min(t0_, e.time_us);
      t_end = std::max(t_end, e.time_us);
    }
    pass_us_ = t.events.empty() ? 0 : t_end - t0_ == max_us ? max_us : t_end - t0_ + 1;
  }
  /// The clock at event `e` of pass `pass`.
  [[nodiscard]] std::uint64_t at(const trace_event& e, std::size_t pass) const {
    const std::uint64_t pass_start_us = pass != 0 && pass_us_ > max_us / pass ? max_us : pass * pass_us_;
    const std::uint64_t offset_us = e.time_us - t0_;  // t0 <= every time_us
    return offset_us > max_us - pass_start_us ? max_us : pass_start_us + offset_us;
  }

 private:
  static constexpr std::uint64_t max_us = std::numeric_limits<std::uint64_t>::max();
  std::uint64_t t0_ = ~std::uint64_t{0};
  std::uint64_t pass_us_ = 0;
};

// The bytes the program has requested (PyTorch's requested_bytes rule): an
// allocation counts from its alloc to its free_completed (at once for a
// free with no gap), taken from the trace's lines, not from the
// allocator's statistics. A device synchronization of the replay's
// allocator (moving cached memory between streams, an out-of-memory retry)
// runs the side streams to their ends, so the allocator frees a block
// still used by another stream before its free_completed line; its
// requested bytes would then stop counting early and the peak would come
// out below the program's. Allocations that failed (out of memory) are not
// counted.
class requested_bytes_counter {
 public:
  void alloc(std::uint64_t size) {
    now_ += size;
    peak_ = std::max(peak_, now_);
  }
  void free(std::uint64_t size) { now_ -= size; }
  /// `size` bytes stop counting at trace index `end` (release_at).
  void free_at(std::uint64_t end, std::uint64_t size) { held_[end] += size; }
  /// Trace index `index` is next: the bytes held until it stop counting.
  void release_at(std::uint64_t index) {
    if (held_.empty()) return;
    const auto it = held_.find(index);
    if (it == held_.end()) return;
    now_ -= it->second;
    held_.erase(it);
  }
  [[nodiscard]] std::uint64_t peak() const noexcept { return peak_; }
  /// A new pass: its peak starts from what counts now.
  void reset_peak() noexcept { peak_ = now_; }

 private:
  std::uint64_t now_ = 0;
  std::uint64_t peak_ = 0;
  std::unordered_map<std::uint64_t, std::uint64_t> held_;  // trace index -> bytes that stop counting there
};

// On every exit, gaps end before the allocator returns its memory to the
// device, and side streams go only once the allocator is gone.
struct allocator_cleanup {
  gap_model& gaps;
  std::unique_ptr<caching_allocator> allocator;
  ~allocator_cleanup() {
    try {
      gaps.end_all();
    } catch (...) {  // a destructor: the allocator and side streams still go
    }
    allocator.reset();
    gaps.release();
  }
};

// The replay of a trace's events on one new allocator, `repeat` passes of
// them back to back (replay_events).
class event_loop {
 public:
  event_loop(const trace& t, const std::vector<std::uint64_t>& completion, std::shared_ptr<device_backend> backend,
             const allocator_config& config, gap_model& gaps, const stream_map& streams, std::uint64_t lag,
             replay_result& r)
      : t_(t), completion_(completion), gaps_(gaps), streams_(streams), lag_(lag), r_(r),
        c_{gaps, std::make_unique<caching_allocator>(std::move(backend), config)}, allocator_(*c_.allocator),
        side_streams_(gaps, trace_streams(t)), never_freed_(never_freed_allocs(t)),
        stream_ends_(destroying_streams_changes_no_figure(config) ? stream_ends_of(t, gaps, streams)
                                                                  : std::vector<std::pair<std::uint64_t, stream_t>>{}),
        clock_(t), sleep_(t, allocator_, r),
        has_pauses_(std::any_of(t.events.begin(), t.events.end(),
                                [](const trace_event& e) { return e.action == trace_action::pause; })) {
    allocator_.init(1);
    live_.reserve(4096);
  }

  caching_allocator& allocator() { return allocator_; }

  // Replays the passes; stops early when `after_event` says so.
  void run(std::size_t repeat, const replay_event_hook& after_event) {
    const auto start = std::chrono::steady_clock::now();
    std::uint64_t replayed = 0;
    bool stopped = false;
    device_stats before = allocator_.get_device_stats(0);
    for (std::size_t pass = 0; pass < repeat && !stopped; ++pass) {
      sleep_.begin_pass();
      const std::uint64_t ooms_before = r_.ooms;
      const std::uint64_t pass_events = replay_pass_events(pass, pass + 1 == repeat, after_event, stopped);
      replayed += pass_events;
      const device_stats s = allocator_.get_device_stats(0);
      r_.passes.push_back(pass_figures(s, before, pass_events, r_.ooms - ooms_before, requested_.peak()));
      before = s;
      if (pass + 1 < repeat && !stopped) {
        sleep_.end_pass(replayed - 1);
        allocator_.reset_peak_stats(0);
        requested_.reset_peak();
      }
    }
    r_.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    r_.events = replayed;
    total_figures(allocator_.get_device_stats(0), r_);
  }

  // Gives everything back (the figures are taken): paused tags wake, what
  // the trace still holds goes, then the gaps, then the cache.
  void finish() {
    sleep_.finish();
    for (auto& [addr, a] : live_)
      if (a.ptr != nullptr) allocator_.free(a.ptr);
    for (void* ptr : kept_) allocator_.free(ptr);
    gaps_.end_all();
    allocator_.empty_cache();
    gaps_.check();
  }

 private:
  struct live_alloc {
    void* ptr = nullptr;  // nullptr: the allocation failed (OOM) in this replay
    std::uint64_t line = 0;
  };

  static std::unordered_set<stream_t> trace_streams(const trace& t) {
    std::unordered_set<stream_t> out;
    for (const trace_event& e : t.events) out.insert(static_cast<stream_t>(e.stream));
    return out;
  }

  // One pass over the events; returns how many it replayed (sets `stopped`
  // when after_event asks to stop).
  std::uint64_t replay_pass_events(std::size_t pass, bool last_pass, const replay_event_hook& after_event,
                                   bool& stopped) {
    constexpr std::uint64_t max_us = std::numeric_limits<std::uint64_t>::max();
    const std::uint64_t n = t_.events.size();
    const std::uint64_t base = pass * n;
    std::uint64_t pass_events = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const trace_event& e = t_.events[i];
      gaps_.advance_to(base + i);
      requested_.release_at(base + i);
      gaps_.set_host_time_us(clock_.at(e, pass));
      // The device runs `lag` events behind: what the stream queues now
      // (and an event recorded after it) completes `lag` events later.
      if (lag_ != 0 && (e.action == trace_action::alloc || e.action == trace_action::free_requested))
        gaps_.run_behind(streams_(e.stream), base + i > max_us - lag_ ? max_us : base + i + lag_);
      replay_event(e, i, base, pass);
      if (last_pass) end_streams(i, base);
      gaps_.check();
      if (has_pauses_) raise_peak_unpaused();
      ++pass_events;
      if (after_event && !after_event(base + i, allocator_)) {
        stopped = true;
        break;
      }
    }
    return pass_events;
  }

  void replay_event(const trace_event& e, std::size_t i, std::uint64_t base, std::size_t pass) {
    switch (e.action) {
      case trace_action::alloc:
        if (never_freed_[i]) {
          if (pass == 0) alloc_kept(e);  // made once, live through every pass
        } else {
          alloc(e);
        }
        break;
      case trace_action::tag:
      case trace_action::pause:
      case trace_action::resume: sleep_.replay(e, base + i); break;
      case trace_action::free_requested: free_requested(e, i, base); break;
      default: break;  // free_completed is the side stream's work ending; segment events are the recorder's
    }
  }

  // An allocation the trace never frees: kept to the end.
  void alloc_kept(const trace_event& e) {
    if (auto it = live_.find(e.addr); it != live_.end()) throw_still_live(t_, e, it->second.line);
    void* ptr = nullptr;
    try {
      ptr = allocator_.malloc(0, e.size, streams_(e.stream));
    } catch (const out_of_memory_error& x) {
      count_oom(r_, x);
    } catch (const invalid_argument_error& x) {
      throw_refused(t_, e, x);  // e.g. under a tag the trace paused
    }
    if (ptr == nullptr) return;
    kept_.push_back(ptr);
    requested_.alloc(e.size);
  }

  void alloc(const trace_event& e) {
    auto [it, fresh] = live_.try_emplace(e.addr);
    if (!fresh) throw_still_live(t_, e, it->second.line);
    it->second.line = e.line;
    try {
      it->second.ptr = allocator_.malloc(0, e.size, streams_(e.stream));
      requested_.alloc(e.size);
    } catch (const out_of_memory_error& x) {
      count_oom(r_, x);
      it->second.ptr = nullptr;
    } catch (const invalid_argument_error& x) {
      live_.erase(it);
      throw_refused(t_, e, x);  // e.g. under a tag the trace paused
    }
  }

  void free_requested(const trace_event& e, std::size_t i, std::uint64_t base) {
    auto it = live_.find(e.addr);
    if (it == live_.end())
      throw trace_error(t_.source, e.line,
                        "free_requested of address " + std::to_string(e.addr) + " with no live allocation");
    void* ptr = it->second.ptr;
    live_.erase(it);
    if (ptr == nullptr) return;  // its alloc failed
    if (has_gap(completion_, i)) {
      // The block stays in use on another stream until its
      // free_completed (the end of the pass if the trace ends first).
      const std::uint64_t end = base + gap_end(t_, completion_, i);
      const stream_t side = side_streams_.acquire(base + i, end);
      gaps_.begin_gap(side, end);
      try {
        allocator_.record_stream(ptr, side);
      } catch (const invalid_argument_error& x) {
        // The one refusal possible here: the block's tag is paused. Its
        // free then waits for the resume anyway, as the library does for a
        // program that frees a paused block; any other refusal is an error
        // at this line.
        if (allocator_.paused_tags(0).empty()) throw_refused(t_, e, x);
      }
      requested_.free_at(end, e.size);
    } else {
      requested_.free(e.size);
    }
    allocator_.free(ptr);
  }

  // Raises r_.peak_unpaused_allocated_bytes to the bytes allocated to
  // unpaused blocks now. O(1) while the allocated bytes are at most the
  // peak (unpaused bytes cannot exceed them then), O(blocks) otherwise:
  // the replay stays near linear in the tags it pauses.
  void raise_peak_unpaused() {
    std::uint64_t& peak = r_.peak_unpaused_allocated_bytes;
    const auto allocated = static_cast<std::uint64_t>(allocator_.get_device_stats(0).allocated_bytes[0].current);
    if (allocated <= peak) return;
    peak = std::max(peak, unpaused_allocated_bytes(allocator_, 0));
  }

  // Each trace stream is destroyed after its last event of the last pass,
  // once its work has run (as a program that makes a stream per request
  // destroys it): the allocator then forgets it (SPEC P10), and a trace
  // with a stream per allocation replays in linear time, not with every
  // slow path walking every stream the trace ever named.
  void end_streams(std::size_t i, std::uint64_t base) {
    while (next_end_ < stream_ends_.size() && stream_ends_[next_end_].first == i)
      ending_.push_back(stream_ends_[next_end_++].second);
    while (!ending_.empty() && gaps_.idle(ending_.front(), base + i)) {
      allocator_.destroy_stream(0, ending_.front());
      ending_.pop_front();
    }
  }

  const trace& t_;
  const std::vector<std::uint64_t>& completion_;
  gap_model& gaps_;
  const stream_map& streams_;
  std::uint64_t lag_;
  replay_result& r_;
  allocator_cleanup c_;  // first made, last gone (see allocator_cleanup)
  caching_allocator& allocator_;
  std::unordered_map<std::uint64_t, live_alloc> live_;  // trace address -> our allocation
  std::vector<void*> kept_;  // allocations the trace never frees (made in the first pass only)
  side_stream_pool side_streams_;
  const std::vector<bool> never_freed_;
  const std::vector<std::pair<std::uint64_t, stream_t>> stream_ends_;
  std::size_t next_end_ = 0;
  std::deque<stream_t> ending_;  // the replay's streams past their last event, waiting for their work to run
  recording_clock clock_;
  sleep_replay sleep_;
  const bool has_pauses_;  // the trace pauses tags: r_.peak_unpaused_allocated_bytes is kept
  requested_bytes_counter requested_;  // the figures' peak requested bytes
};

void replay_events(const trace& t, const std::vector<std::uint64_t>& completion,
                   std::shared_ptr<device_backend> backend, const allocator_config& config, gap_model& gaps,
                   const stream_map& streams, const replay_event_hook& after_event,
                   const std::optional<history_options>& history, std::size_t repeat, std::uint64_t lag,
                   replay_result& r) {
  event_loop loop(t, completion, std::move(backend), config, gaps, streams, lag, r);
  if (history) loop.allocator().record_history(*history);
  loop.run(repeat, after_event);
  loop.finish();
}

// The replay through gates on `backend`'s device `device`.
void replay_with_gates(const trace& t, const std::vector<std::uint64_t>& completion,
                       const std::shared_ptr<device_backend>& backend, int device,
                       const stream_map* trace_streams, bool watchdog, const allocator_config& config,
                       const replay_event_hook& after_event, const std::optional<history_options>& history,
                       std::size_t repeat, replay_result& r) {
  auto gates = std::make_shared<gate_gaps>(backend, device, max_open_gaps(t, completion), watchdog);
  // Streams of its own unless the device has the trace's (`trace_streams`).
  const stream_map streams = trace_streams == nullptr ? make_streams(t, *gates) : *trace_streams;
  replay_events(t, completion, gates, config, *gates, streams, after_event, history, repeat, 0, r);
}

#if CCALLOC_HAVE_CUDA_BACKEND
std::shared_ptr<device_backend> open_cuda(int device) {
  if (const std::string why = cuda_backend::runtime_load_error(); !why.empty())
    throw error("replay on cuda: " + why);
  if (cuda_backend::available_device_count() < 1)
    throw error("replay on cuda: no CUDA device is usable (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)");
  std::shared_ptr<cuda_backend> b;
  try {
    b = std::make_shared<cuda_backend>();
  } catch (const backend_error& e) {
    throw error(std::string("replay on cuda: ") + e.what());
  }
  if (device < 0 || device >= b->device_count())
    throw error("replay on cuda: device " + std::to_string(device) + " is out of range [0, " +
                std::to_string(b->device_count()) + ")");
  if (!b->capabilities().gates)
    throw error(
        "replay on cuda: the CUDA driver lacks cuStreamWaitValue32, or a device cannot map host memory: the "
        "replay needs them to keep blocks in use on side streams");
  return b;
}
#endif

// The recording allocator's segment placement for the simulated device:
// each segment_alloc's offset from the lowest recorded address (aligned
// down to the granularity), in the trace's order. Empty when the trace has
// none, or when an address or size is off the granularity (then the
// simulated device's own order applies to all segments).
std::vector<segment_placement> recorded_placement(const trace& t, std::size_t granularity) {
  std::vector<segment_placement> plan;
  std::uint64_t lowest = std::numeric_limits<std::uint64_t>::max();
  for (const trace_event& e : t.events)
    if (e.action == trace_action::segment_alloc) lowest = std::min(lowest, e.addr);
  if (lowest == std::numeric_limits<std::uint64_t>::max()) return plan;
  const std::uint64_t base = lowest / granularity * granularity;
  for (const trace_event& e : t.events) {
    if (e.action != trace_action::segment_alloc) continue;
    if ((e.addr - base) % granularity != 0 || e.size == 0 || e.size % granularity != 0) return {};
    plan.push_back({static_cast<std::size_t>(e.addr - base), static_cast<std::size_t>(e.size)});
  }
  return plan;
}

}  // namespace

std::uint64_t unpaused_allocated_bytes(const caching_allocator& allocator, int device) {
  const auto current = static_cast<std::uint64_t>(allocator.get_device_stats(device).allocated_bytes[0].current);
  if (allocator.paused_tags(device).empty()) return current;  // O(tags), not tag_stats' O(tags x segments)
  std::uint64_t paused = 0;
  for (const tag_usage& u : allocator.tag_stats(device))
    if (u.paused) paused += u.allocated_bytes;
  return current - std::min(current, paused);
}

replay_result replay_trace(const trace& t, const replay_options& options) {
  // The replay is a function of its configuration string alone: the thread
  // cache is the library's default (all) unless the string says otherwise
  // (CCALLOC_THREAD_CACHE, like CCALLOC_CONF, is for programs that use the
  // library).
  const allocator_config config = [&] {
    allocator_config c = allocator_config::parse(options.config);
    if (!c.thread_cache_set) c.thread_cache = thread_cache_mode::all;
    c.thread_cache_set = true;
    return c;
  }();
  // Zeros would read as a measurement: say there was nothing to replay.
  if (t.events.empty())
    throw invalid_argument_error("ccalloc replay: " + t.source +
                                 " has no events (an empty file, only comments, or an RMM log with only its "
                                 "header): nothing to replay");
  if (options.repeat == 0) throw error("replay: repeat must be at least 1 (passes of the trace), got 0");
  if (options.device_lag_events != 0 && (options.device != replay_device::sim || options.use_gates_on_sim))
    throw invalid_argument_error("replay: device_lag_events (" + std::to_string(options.device_lag_events) +
                                 ") models a simulated device running behind the host; it applies to "
                                 "replay_device::sim without use_gates_on_sim only (a GPU has its own lag)");
  const std::vector<std::uint64_t> completion = completion_indices(t);

  replay_result r;
  r.source = t.source;
  r.config = options.config;
  r.device = options.device;
  r.repeat = options.repeat;
  r.device_lag_events = options.device_lag_events;
  if (options.device == replay_device::sim) {
    sim_options so;
    so.capacity_bytes = options.device_memory_bytes;
    // The gaps' side-stream work models when PyTorch saw a block's event
    // complete, not device work: a segment free must not end it early (on a
    // GPU the gate driver defers segment frees past the gaps instead).
    so.segment_free_synchronizes = false;
    // The allocator's time budgets see the recording's time (replay_events).
    so.host_clock_mode = sim_options::host_clock::modeled;
    auto sim = std::make_shared<sim_backend>(so);
    if (options.recorded_addresses) {
      std::vector<segment_placement> plan = recorded_placement(t, so.granularity_bytes);
      r.recorded_addresses = !plan.empty();
      if (r.recorded_addresses) sim->place_segments(0, std::move(plan));
    }
    // The trace's stream ids are used as they are where the device can
    // (it rejects handles it never made).
    const stream_map streams = adopt_trace_streams(t, *sim);
    r.device_memory_bytes = options.device_memory_bytes;
    if (options.use_gates_on_sim) {
      replay_with_gates(t, completion, sim, 0, &streams, /*watchdog=*/false, config, options.after_event,
                        options.history, options.repeat, r);
    } else {
      clock_gaps gaps(*sim);
      replay_events(t, completion, sim, config, gaps, streams, options.after_event, options.history,
                    options.repeat, options.device_lag_events, r);
    }
    return r;
  }
#if CCALLOC_HAVE_CUDA_BACKEND
  const std::shared_ptr<device_backend> cuda = open_cuda(options.cuda_device);
  r.device_memory_bytes = cuda->mem_get_info(options.cuda_device).total_bytes;
  replay_with_gates(t, completion, cuda, options.cuda_device, /*trace_streams=*/nullptr, /*watchdog=*/true,
                    config, options.after_event, options.history, options.repeat, r);
  return r;
#else
  throw error(
      "replay on cuda: this build of ccalloc has no CUDA backend (configure with a CUDA toolkit and "
      "-DCCALLOC_WITH_CUDA=ON)");
#endif
}

// The most bytes the program holds at once: an allocation counts from its
// alloc to its free_requested. Its uses may go on until free_completed, but an
// allocator short of memory synchronizes the device and takes such blocks
// back earlier, so only this is a lower bound of the memory a replay needs.
namespace {

std::uint64_t peak_live_bytes(const trace& t) {
  std::uint64_t now = 0;
  std::uint64_t peak = 0;
  for (const trace_event& e : t.events) {
    if (e.action == trace_action::alloc) {
      now += e.size;
      peak = std::max(peak, now);
    } else if (e.action == trace_action::free_requested) {
      now -= std::min(now, e.size);
    }
  }
  return peak;
}

}  // namespace

std::size_t find_min_device_memory(const trace& t, const replay_options& options, std::size_t precision_bytes) {
  if (options.device != replay_device::sim)
    throw error("find_min_device_memory: only the simulated device can change its memory size");
  if (precision_bytes == 0) throw error("find_min_device_memory: precision_bytes must be > 0");
  replay_options probe = options;  // the caller's hook and history are for its own replay only
  probe.after_event = nullptr;
  probe.history.reset();
  const replay_result full = replay_trace(t, probe);
  if (full.ooms != 0) {
    // A fraction caps every device size alike: a larger device cannot help
    // when the fraction is 0, and helps in proportion otherwise.
    const allocator_config config = allocator_config::parse(options.config);
    std::string why = "; a larger device may fit (raise --device-memory)";
    if (config.memory_fraction_set && config.per_process_memory_fraction <= 0.0)
      why = "; per_process_memory_fraction:0 lets ccalloc use none of any device: no device size fits (raise the "
            "fraction)";
    else if (config.memory_fraction_set && config.per_process_memory_fraction < 1.0) {
      char fraction[32] = {};  // the shortest text that reads back as the fraction
      (void)std::to_chars(fraction, fraction + sizeof fraction - 1, config.per_process_memory_fraction);
      why = "; per_process_memory_fraction:" + std::string(fraction) +
            " lets ccalloc use only that part of it (raise the fraction or --device-memory)";
    }
    throw error("find_min_device_memory: " + t.source + " does not fit even in " +
                std::to_string(options.device_memory_bytes) + " bytes (" + std::to_string(full.ooms) +
                " allocations failed)" + why);
  }
  // Multiples of precision_bytes, saturating: a value within precision_bytes
  // of 2^64 stays as it is.
  const auto round_up = [&](std::size_t v) {
    if (v > std::numeric_limits<std::size_t>::max() - (precision_bytes - 1)) return v;
    return (v + precision_bytes - 1) / precision_bytes * precision_bytes;
  };
  // per_process_memory_fraction caps reserved memory at fraction x each device
  // size tried (rounded down, as the allocator does): the answer is a device,
  // not a cap, and replaying with the same configuration on it fits.
  const allocator_config parsed = allocator_config::parse(options.config);
  const double fraction = parsed.memory_fraction_set ? parsed.per_process_memory_fraction : 1.0;
  const auto cap = [&](std::size_t device_bytes) {
    return fraction >= 1.0 ? device_bytes : static_cast<std::size_t>(fraction * static_cast<double>(device_bytes));
  };
  const std::size_t start = round_up(options.device_memory_bytes);  // assumed to fit: more memory never hurts
  // The smallest multiple of precision_bytes whose cap holds `bytes` (at
  // most `start`, whose cap held the whole replay).
  const auto device_for = [&](std::size_t bytes) -> std::size_t {
    if (bytes == 0) return 0;
    const double guess = std::ceil(static_cast<double>(bytes) / fraction);
    std::size_t m = guess >= static_cast<double>(start) ? start : round_up(static_cast<std::size_t>(guess));
    while (m < start && cap(m) < bytes) m += precision_bytes;
    while (m >= precision_bytes && cap(m - precision_bytes) >= bytes) m -= precision_bytes;
    return m;
  };
  // Bounds: `fails` is too small for the bytes the program holds at its
  // peak (peak_live_bytes; 0: none tried), `fits` holds the first replay's
  // peak reserved; checked, since a smaller cap changes what
  // garbage_collection_threshold does. The figures' peak requested bytes
  // (allocations counted until free_completed) are no lower bound: a replay
  // that runs short synchronizes and reuses blocks whose frees were
  // requested. Blocks of a paused tag hold no device pages, so with pauses
  // the search starts from nothing. `fails` always stays below `fits`.
  std::size_t fits = device_for(full.peak_reserved_bytes);
  if (fits == 0) return 0;  // nothing was ever reserved
  const std::size_t lower = full.sleep_events.empty() ? device_for(peak_live_bytes(t)) : 0;
  std::size_t fails = lower >= precision_bytes ? lower - precision_bytes : 0;
  if (fails >= fits) fails = 0;
  if (fits < start) {
    probe.device_memory_bytes = fits;
    if (replay_trace(t, probe).ooms != 0) {
      fails = fits;
      fits = start;
    }
  }
  while (fits - fails > precision_bytes) {
    const std::size_t mid = fails + (fits - fails) / 2 / precision_bytes * precision_bytes;
    probe.device_memory_bytes = mid;
    if (replay_trace(t, probe).ooms == 0) fits = mid;
    else fails = mid;
  }
  return fits;
}

}  // namespace ccalloc

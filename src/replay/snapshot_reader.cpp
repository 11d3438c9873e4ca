// snapshot_reader.cpp: PyTorch memory snapshot pickles as traces
// (convert_pytorch_snapshot in include/ccalloc/replay/trace.hpp).
//
// The pickle is read as a stream (zlib's gzread reads plain and gzip files
// alike) by the plain-data pickle reader (pickle_reader.hpp), which never
// runs code and shares equal contents, then device_traces[D] (D: the one
// asked for, else the device with the most entries, the others noted)
// becomes one trace event per entry. tools/snapshot_to_trace.py does the
// same conversion in Python, to text.
//
// A snapshot ccalloc wrote (core/snapshot_json.cpp) also has `pause` and
// `resume` entries and a `tag` on each entry: they become the trace's
// `pause`, `resume` and `tag` events, as trace_writer writes them (a `tag`
// event before each alloc whose tag differs from the previous alloc's), so
// that the replay sleeps and wakes as the program did.
//
// A snapshot's trace often starts after the program did (history was turned
// on later, or the ring buffer dropped the oldest entries). So that the
// trace replays as the program ran, at the trace's first time the converter
// adds an `alloc` for every block freed in the trace, or still live in the
// snapshot's segments, without an `alloc` in the trace, and a
// `segment_alloc` for every segment freed in the trace, or present at the
// end, without one (for an expandable segment: a `segment_map` of what was
// mapped before the trace). A `free_completed` whose `free_requested` is
// missing gets one just before it; an `alloc` at an address freed without
// its `free_completed` gets one just before it. Notes say how many of each
// were added. An `alloc` at a live address (no `free_requested` since its
// `alloc`) is an error naming both entries, as in the text trace.
//
// Each distinct segment is walked once and each distinct frames list turned
// into a site once, so the work is linear in the pickle's size even when a
// pickle refers to one segment or one block many times.
#include <ccalloc/replay/trace.hpp>

#include "line_parsers.hpp"
#include "pickle_reader.hpp"

#include <ccalloc/core/tags.hpp>

#ifndef CCALLOC_HAVE_ZLIB
#define CCALLOC_HAVE_ZLIB 1
#endif
#if CCALLOC_HAVE_ZLIB
#include <zlib.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <sys/stat.h>

namespace ccalloc {

namespace {

using pickle::kind;
using pickle::value;

/// The most an entry's time_us may be before the entry's ahead of it (1 s).
constexpr std::uint64_t max_time_step_back_us = 1'000'000;

/// A conversion error: the reason, without the file name.
class convert_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::string kind_text(const pickle::tree& t, value v) { return std::string(pickle::describe(t.kind_of(v))); }

/// The converter: the tree's device trace and segments into trace events.
class converter {
 public:
  converter(const pickle::tree& t, std::int64_t wanted_device) : t_(t), wanted_device_(wanted_device) {}

  trace run() {
    const value root = t_.root;
    value traces = 0;
    if (!t_.get(root, "device_traces", traces)) {
      std::string found;
      if (t_.kind_of(root) != kind::dict) {
        found = kind_text(t_, root);
      } else {
        std::size_t n = 0;
        const value* it = t_.items(root, n);
        for (std::size_t i = 0; i < n && i < 12; i += 2)
          found += (found.empty() ? "keys " : ", ") +
                   (t_.kind_of(it[i]) == kind::str ? "'" + std::string(t_.text(it[i]).substr(0, 40)) + "'"
                                                     : kind_text(t_, it[i]));
        if (found.empty()) found = "an empty dict";
      }
      throw convert_error("not a PyTorch memory snapshot (no 'device_traces'; found " + found + ")");
    }
    if (t_.kind_of(traces) != kind::list)
      throw convert_error("device_traces: expected a list, got " + kind_text(t_, traces));
    std::size_t devices = 0;
    const value* per_device = t_.items(traces, devices);
    for (std::size_t d = 0; d < devices; ++d)
      if (t_.kind_of(per_device[d]) != kind::list)
        throw convert_error("device_traces[" + std::to_string(d) + "]: expected a list, got " +
                            kind_text(t_, per_device[d]));
    choose_device(per_device, devices);
    std::size_t entry_count = 0;
    const value* entries = devices > 0 ? t_.items(per_device[device_], entry_count) : nullptr;
    for (std::size_t i = 0; i < entry_count; ++i) entry(entries[i], i);
    segments();
    return finish();
  }

 private:
  struct event {
    std::uint64_t time, addr, size, stream;
    trace_action action;
    std::uint32_t site;
    std::uint16_t tag = 0;  // alloc: the tag it was made under; pause, resume: the tag
    bool keep = false;      // pause: the contents were kept
  };

  /// device_ from wanted_device_ (-1: the device with the most entries, the
  /// lowest index among equals); notes the other devices that have entries.
  void choose_device(const value* per_device, std::size_t devices) {
    std::vector<std::size_t> counts(devices, 0);
    for (std::size_t d = 0; d < devices; ++d) (void)t_.items(per_device[d], counts[d]);
    if (wanted_device_ >= 0) {
      if (static_cast<std::uint64_t>(wanted_device_) >= devices)
        throw convert_error("device " + std::to_string(wanted_device_) + " was asked for (--snapshot-device), but " +
                            (devices == 0 ? std::string("device_traces is empty")
                                          : "device_traces has devices 0.." + std::to_string(devices - 1)));
      device_ = static_cast<std::size_t>(wanted_device_);
    } else {
      device_ = 0;
      for (std::size_t d = 1; d < devices; ++d)
        if (counts[d] > counts[device_]) device_ = d;
    }
    const auto device_text = [&](std::size_t d) {
      return "device " + std::to_string(d) + " (" + std::to_string(counts[d]) +
             (counts[d] == 1 ? " entry)" : " entries)");
    };
    std::string others;
    for (std::size_t d = 0; d < devices; ++d)
      if (d != device_ && counts[d] != 0) others += (others.empty() ? "" : ", ") + device_text(d);
    if (!others.empty())
      device_note_ = "the snapshot has entries on several devices; the trace holds one: " + device_text(device_) +
                     " converted, not " + others +
                     " (choose one with ccalloc's --snapshot-device N, or trace_read_options::snapshot_device)";
    else if (devices == 0)
      device_note_ = "the snapshot has no trace entries (device_traces is empty: was the memory history recorded "
                     "before the snapshot was taken? torch.cuda.memory._record_memory_history)";
    else if (counts[device_] == 0)
      device_note_ = "device " + std::to_string(device_) + " of the snapshot has no trace entries" +
                     (devices > 1 ? std::string(", nor has any other device") : std::string());
  }

  [[nodiscard]] std::string where(std::size_t i) const {
    return "device_traces[" + std::to_string(device_) + "][" + std::to_string(i) + "]";
  }
  std::uint64_t uint_field(value d, std::string_view key, const std::string& at) const {
    value v = 0;
    if (!t_.get(d, key, v)) throw convert_error(at + ": missing '" + std::string(key) + "'");
    std::uint64_t out = 0;
    if (t_.kind_of(v) == kind::boolean || !t_.as_uint(v, out))
      throw convert_error(at + "." + std::string(key) + ": expected a non-negative integer, got " + kind_text(t_, v) +
                          (t_.kind_of(v) == kind::integer ? " below 0" : ""));
    return out;
  }
  std::uint64_t uint_or(value d, std::string_view key, std::uint64_t fallback, const std::string& at) const {
    value v = 0;
    return t_.get(d, key, v) ? uint_field(d, key, at) : fallback;
  }
  void need_dict(value v, const std::string& at) const {
    if (t_.kind_of(v) != kind::dict) throw convert_error(at + ": expected a dict, got " + kind_text(t_, v));
  }

  /// The site of a frames list: 0 when it has none.
  std::uint32_t site_of(value d) {
    value frames = 0;
    if (!t_.get(d, "frames", frames)) return 0;
    std::size_t n = 0;
    const value* f = t_.items(frames, n);
    if (n == 0 || t_.kind_of(frames) == kind::dict) return 0;
    const auto [it, inserted] = sites_by_id_.try_emplace(pickle::tree::id(frames), 0);
    if (!inserted) return it->second;
    std::string text;
    for (std::size_t i = 0; i < n; ++i) {
      value name = 0, file = 0, line = 0;
      std::uint64_t line_no = 0;
      const bool has_line = t_.get(f[i], "line", line) && t_.as_uint(line, line_no);
      if (!text.empty()) text += '\n';
      text += t_.get(f[i], "name", name) ? std::string(t_.text(name)) : std::string("?");
      text += " (";
      text += t_.get(f[i], "filename", file) ? std::string(t_.text(file)) : std::string("?");
      if (has_line) text += ":" + std::to_string(line_no);
      text += ")";
    }
    const auto [text_it, new_text] = sites_by_text_.try_emplace(text, 0);
    if (new_text) {
      sites_.push_back(text);
      text_it->second = static_cast<std::uint32_t>(sites_.size());
    }
    it->second = text_it->second;
    return it->second;
  }

  std::optional<trace_action> action_of(std::string_view a) const {
    static const std::pair<std::string_view, trace_action> known[] = {
        {"alloc", trace_action::alloc},
        {"free_requested", trace_action::free_requested},
        {"free_completed", trace_action::free_completed},
        {"segment_alloc", trace_action::segment_alloc},
        {"segment_free", trace_action::segment_free},
        {"segment_map", trace_action::segment_map},
        {"segment_unmap", trace_action::segment_unmap},
        {"snapshot", trace_action::snapshot},
        {"oom", trace_action::oom},
        {"pause", trace_action::pause},
        {"resume", trace_action::resume},
    };
    for (const auto& [name, action] : known)
      if (name == a) return action;
    return std::nullopt;
  }

  void entry(value e, std::size_t i) {
    const std::string at = where(i);
    need_dict(e, at);
    value a = 0;
    if (!t_.get(e, "action", a)) throw convert_error(at + ": missing 'action'");
    if (t_.kind_of(a) != kind::str) throw convert_error(at + ".action: expected a string, got " + kind_text(t_, a));
    const std::optional<trace_action> action = action_of(t_.text(a));
    if (!action) {
      ++dropped_[std::string(t_.text(a).substr(0, 64))];
      return;
    }
    std::uint64_t time = uint_field(e, "time_us", at);
    if (!first_time_) first_time_ = time;
    if (last_time_ && time < *last_time_) time = stepped_back(time, at);
    last_time_ = time;
    const std::uint64_t addr = uint_field(e, *action == trace_action::oom ? "device_free" : "addr", at);
    const std::uint64_t size = uint_field(e, "size", at);
    const std::uint64_t stream = uint_field(e, "stream", at);
    const std::uint32_t site = site_of(e);
    const std::uint16_t tag = tag_of(e, at);
    switch (*action) {
      case trace_action::alloc: {
        // PyTorch records a block's frees before its address serves another
        // allocation: an alloc at a live address is refused, as the text
        // trace refuses it (which free is missing, and when, is unknown).
        if (const auto l = live_.find(addr); l != live_.end())
          throw convert_error(at + ": alloc at address " + std::to_string(addr) + " (" + std::to_string(size) +
                              " bytes), which is still live (allocated at " + where(l->second.entry) +
                              " with " + std::to_string(l->second.size) + " bytes; no free_requested between)");
        // Freed but its free_completed missing: added here, with its
        // free_requested's size and stream (the block was reusable).
        if (const auto q = pending_.find(addr); q != pending_.end()) {
          events_.push_back({time, addr, q->second.size, q->second.stream, trace_action::free_completed, 0});
          if (completions_added_++ == 0) first_completion_added_ = at + " at address " + std::to_string(addr);
          pending_.erase(q);
        }
        live_[addr] = {stream, size, i};
        events_.push_back({time, addr, size, stream, *action, site, tag});
        ++entries_;
        return;
      }
      case trace_action::free_requested:
        if (live_.erase(addr) == 0 && pending_.count(addr) == 0) start_allocs_.try_emplace(addr, size, stream, 0, tag);
        pending_[addr] = {stream, size, i};
        break;
      case trace_action::free_completed:
        if (pending_.count(addr) == 0) {
          if (live_.erase(addr) == 0) start_allocs_.try_emplace(addr, size, stream, 0, tag);
          events_.push_back({time, addr, size, stream, trace_action::free_requested, 0});
          ++repaired_;
        }
        pending_.erase(addr);
        break;
      case trace_action::segment_alloc: segment_seen_.insert(addr); break;
      case trace_action::segment_free:
        if (segment_seen_.count(addr) == 0) start_segments_.try_emplace(addr, trace_action::segment_alloc, size, stream);
        segment_seen_.erase(addr);
        break;
      case trace_action::segment_map:
      case trace_action::segment_unmap: unmapped_.push_back({addr, size, *action == trace_action::segment_map}); break;
      case trace_action::pause:  // ccalloc's: addr holds the bytes kept in host memory
        paused_.insert(tag);
        events_.push_back({time, 0, size, 0, *action, 0, tag, addr != 0});
        ++entries_;
        return;
      case trace_action::resume:
        if (paused_.erase(tag) == 0) {  // paused before the trace began: nothing in it to wake
          ++resumes_dropped_;
          return;
        }
        events_.push_back({time, 0, size, 0, *action, 0, tag});
        ++entries_;
        return;
      case trace_action::snapshot:
      case trace_action::oom:
      case trace_action::tag: break;  // not in a snapshot's entries (action_of never names it)
    }
    events_.push_back({time, addr, size, stream, *action, site});
    ++entries_;
  }

  /// The trace's index of the entry's or block's `tag` (trace::tags), added
  /// on first use: 0 for "default" or none (PyTorch's entries have none).
  std::uint16_t tag_of(value d, const std::string& at) {
    value v = 0;
    if (!t_.get(d, "tag", v)) return 0;
    if (t_.kind_of(v) != kind::str) throw convert_error(at + ".tag: expected a string, got " + kind_text(t_, v));
    const std::string_view name = t_.text(v);
    if (name == default_tag_name) return 0;
    if (!is_tag_name(name))
      throw convert_error(at + ".tag: bad tag '" + std::string(name.substr(0, 64)) +
                          "': a tag name is 1 to 64 ASCII letters, digits and the characters _-.:/");
    const auto [it, added] = tag_ids_.try_emplace(std::string(name), 0);
    if (added) {
      if (tags_.size() >= std::numeric_limits<std::uint16_t>::max()) {
        tag_ids_.erase(it);
        throw convert_error(at + ".tag: more than 65535 distinct tags");
      }
      tags_.push_back(it->first);
      it->second = static_cast<std::uint16_t>(tags_.size());
    }
    return it->second;
  }

  // Entry `at` has time `time`, before the entry ahead of it (last_time_):
  // the time of that entry, noted. PyTorch records its entries in order
  // under the allocator's lock, reading an approximate clock (the CPU's
  // time-stamp counter) that may step back slightly from one core to
  // another; the trace format wants time in order. A step back of more
  // than max_time_step_back_us comes from no clock: the entries are out of
  // order or the snapshot is corrupt, refused as the text trace refuses
  // any step back.
  std::uint64_t stepped_back(std::uint64_t time, const std::string& at) {
    const std::uint64_t back = *last_time_ - time;
    if (back > max_time_step_back_us)
      throw convert_error(at + ".time_us: goes backwards by " + std::to_string(back) + " us (" +
                          std::to_string(time) + " after " + std::to_string(*last_time_) +
                          "), more than the 1000000 us a clock may step back: the entries are out of order");
    if (steps_back_++ == 0) first_step_back_ = at + ": " + std::to_string(time) + " after " + std::to_string(*last_time_);
    largest_step_back_us_ = std::max(largest_step_back_us_, back);
    return *last_time_;
  }

  /// Blocks and segments alive at the end that the trace never allocated.
  void segments() {
    value segs = 0;
    if (!t_.get(t_.root, "segments", segs)) return;
    if (t_.kind_of(segs) != kind::list) throw convert_error("segments: expected a list, got " + kind_text(t_, segs));
    std::size_t n = 0;
    const value* s = t_.items(segs, n);
    std::vector<std::pair<std::size_t, value>> mine;  // (index, segment) of this device, each distinct segment once
    std::unordered_set<std::uint64_t> seen;
    std::set<std::uint64_t> expandable;
    for (std::size_t i = 0; i < n; ++i) {
      const std::string at = "segments[" + std::to_string(i) + "]";
      need_dict(s[i], at);
      if (!seen.insert(pickle::tree::id(s[i])).second) continue;
      if (uint_or(s[i], "device", 0, at) != device_) continue;
      value ex = 0;
      const bool is_expandable = t_.get(s[i], "is_expandable", ex) && t_.truthy(ex);
      if (is_expandable) expandable.insert(uint_field(s[i], "address", at));
      mine.emplace_back(i, s[i]);
    }
    // Bytes each expandable segment mapped minus unmapped during the trace
    // (a map or unmap belongs to the segment with the highest base at or
    // below its address).
    std::map<std::uint64_t, std::int64_t> mapped_net;
    for (const auto& [addr, size, map] : unmapped_) {
      auto it = expandable.upper_bound(addr);
      if (it == expandable.begin()) continue;
      --it;
      mapped_net[*it] += map ? static_cast<std::int64_t>(size) : -static_cast<std::int64_t>(size);
    }
    std::uint64_t blocks_walked = 0;
    for (const auto& [i, seg] : mine) {
      const std::string at = "segments[" + std::to_string(i) + "]";
      const std::uint64_t base = uint_field(seg, "address", at);
      const std::uint64_t total = uint_field(seg, "total_size", at);
      const std::uint64_t stream = uint_or(seg, "stream", 0, at);
      if (expandable.count(base) != 0) {
        const auto m = mapped_net.find(base);
        const std::int64_t before = static_cast<std::int64_t>(total) - (m == mapped_net.end() ? 0 : m->second);
        if (before > 0)
          start_segments_.try_emplace(base, trace_action::segment_map, static_cast<std::uint64_t>(before), stream);
      } else if (segment_seen_.count(base) == 0) {
        start_segments_.try_emplace(base, trace_action::segment_alloc, total, stream);
      }
      value blocks = 0;
      if (!t_.get(seg, "blocks", blocks)) continue;
      if (t_.kind_of(blocks) != kind::list)
        throw convert_error(at + ".blocks: expected a list, got " + kind_text(t_, blocks));
      std::size_t nb = 0;
      const value* b = t_.items(blocks, nb);
      // Distinct segments that share one blocks list would make this walk
      // quadratic in the pickle's size; a snapshot's blocks are its own.
      blocks_walked += nb;
      if (blocks_walked > t_.bytes)
        throw convert_error(at + ".blocks: the segments list more blocks (" + std::to_string(blocks_walked) +
                            " so far) than the pickle has bytes: segments share blocks lists");
      std::uint64_t addr = base;
      for (std::size_t j = 0; j < nb; ++j) {
        const std::string bat = at + ".blocks[" + std::to_string(j) + "]";
        need_dict(b[j], bat);
        const std::uint64_t size = uint_field(b[j], "size", bat);
        value state = 0;
        const std::string_view st = t_.get(b[j], "state", state) ? t_.text(state) : std::string_view();
        if ((st == "active_allocated" || st == "active_pending_free") && live_.count(addr) == 0 &&
            pending_.count(addr) == 0)
          start_allocs_.try_emplace(addr, uint_or(b[j], "requested_size", size, bat), stream, site_of(b[j]),
                                    tag_of(b[j], bat));
        addr += size;
      }
    }
  }

  trace finish() {
    trace out;
    const std::uint64_t t0 = first_time_.value_or(0);
    out.events.reserve(start_segments_.size() + start_allocs_.size() + events_.size());
    std::uint16_t alloc_tag = 0;  // the tag the replay makes allocations under (each pass starts at default)
    const auto add = [&](const event& from) {
      trace_event e;
      if (from.action == trace_action::alloc && from.tag != alloc_tag) {  // a tag event before it
        e.time_us = from.time;
        e.action = trace_action::tag;
        e.tag = alloc_tag = from.tag;
        e.line = out.events.size() + 1;
        out.events.push_back(e);
      }
      e.time_us = from.time;
      e.action = from.action;
      e.addr = from.addr;
      e.size = from.size;
      e.stream = from.stream;
      e.site = from.site;
      e.tag = from.action == trace_action::alloc ? 0 : from.tag;
      e.keep_contents = from.keep;
      e.line = out.events.size() + 1;
      out.events.push_back(e);
    };
    for (const auto& [addr, s] : start_segments_)
      add({t0, addr, std::get<1>(s), std::get<2>(s), std::get<0>(s), 0});
    for (const auto& [addr, s] : start_allocs_)
      add({t0, addr, std::get<0>(s), std::get<1>(s), trace_action::alloc, std::get<2>(s), std::get<3>(s)});
    for (const event& e : events_) add(e);
    if (!start_allocs_.empty() || !start_segments_.empty())
      out.notes.push_back(std::to_string(start_allocs_.size()) + " alloc and " + std::to_string(start_segments_.size()) +
                          " segment events added at the start (allocated before the trace)");
    if (repaired_ != 0) out.notes.push_back(std::to_string(repaired_) + " missing frees added");
    if (completions_added_ != 0)
      out.notes.push_back(std::to_string(completions_added_) +
                          " free_completed added before an alloc at an address freed without one (the first: " +
                          first_completion_added_ + ")");
    if (resumes_dropped_ != 0)
      out.notes.push_back(std::to_string(resumes_dropped_) +
                          (resumes_dropped_ == 1 ? " resume entry" : " resume entries") +
                          " of tags paused before the trace began dropped");
    if (!device_note_.empty()) out.notes.insert(out.notes.begin(), device_note_);
    if (steps_back_ != 0)
      out.notes.push_back("time_us steps back at " + std::to_string(steps_back_) +
                          (steps_back_ == 1 ? " entry (" : " entries (the first ") +
                          first_step_back_ + "; at most " + std::to_string(largest_step_back_us_) +
                          " us): each takes the time of the entry before it");
    if (!dropped_.empty()) {
      std::string text = "dropped actions ccalloc's trace format has not: ";
      bool first = true;
      for (const auto& [name, count] : dropped_) {
        text += (first ? "" : ", ") + name + " x" + std::to_string(count);
        first = false;
      }
      out.notes.push_back(text);
    }
    out.sites = std::move(sites_);
    out.tags = std::move(tags_);
    return out;
  }

  const pickle::tree& t_;
  std::int64_t wanted_device_ = -1;  // trace_read_options::snapshot_device
  std::size_t device_ = 0;
  std::string device_note_;  // the devices with entries that are not converted
  std::vector<event> events_;
  std::size_t entries_ = 0;
  std::optional<std::uint64_t> first_time_, last_time_;
  struct block_entry {
    std::uint64_t stream, size;
    std::size_t entry;  // its index in device_traces[device_]
  };
  std::unordered_map<std::uint64_t, block_entry> live_;     // addr -> its alloc, until its free_requested
  std::unordered_map<std::uint64_t, block_entry> pending_;  // addr -> its free_requested, until free_completed
  std::unordered_set<std::uint64_t> segment_seen_;         // segments with a segment_alloc in the trace
  // addr -> size, stream, site, tag
  std::map<std::uint64_t, std::tuple<std::uint64_t, std::uint64_t, std::uint32_t, std::uint16_t>> start_allocs_;
  std::map<std::uint64_t, std::tuple<trace_action, std::uint64_t, std::uint64_t>> start_segments_;  // action, size, stream
  std::vector<std::tuple<std::uint64_t, std::uint64_t, bool>> unmapped_;  // segment_map/unmap: addr, size, is map
  std::map<std::string, std::size_t> dropped_;
  std::size_t repaired_ = 0;  // free_requested added before a free_completed without one
  std::size_t completions_added_ = 0;  // free_completed added before an alloc at a pending address
  std::string first_completion_added_;  // the first such alloc: "device_traces[D][I] at address A"
  std::size_t steps_back_ = 0;  // entries whose time_us is before the entry's ahead of them
  std::string first_step_back_;  // the first of them: "device_traces[D][I]: <time> after <time>"
  std::uint64_t largest_step_back_us_ = 0;
  std::unordered_map<std::uint64_t, std::uint32_t> sites_by_id_;
  std::unordered_map<std::string, std::uint32_t> sites_by_text_;
  std::vector<std::string> sites_;
  std::vector<std::string> tags_;                          // trace::tags
  std::unordered_map<std::string, std::uint16_t> tag_ids_;  // name -> trace_event::tag
  std::unordered_set<std::uint16_t> paused_;                // tags paused by the trace, not resumed yet
  std::size_t resumes_dropped_ = 0;                         // resumes of tags the trace had not paused
};

std::string limit_hint(const pickle::limit_error& e) {
  if (e.which == 0)
    return " (raise it with ccalloc's --max-pickle-objects N, or trace_read_options::max_pickle_objects)";
  if (e.which == 2)
    return " (raise it with ccalloc's --max-pickle-memory SIZE, or trace_read_options::max_pickle_memory_bytes)";
  return " (raise it with ccalloc's --max-pickle-bytes N, or trace_read_options::max_pickle_bytes)";
}

trace convert(const pickle::read_fn& read, const std::string& source, const trace_read_options& options,
              const std::function<void(std::uint64_t)>& on_bytes) {
  try {
    const pickle::limits lim{options.max_pickle_objects, options.max_pickle_bytes, options.max_pickle_memory_bytes};
    trace t;
    {
      const pickle::tree tree = pickle::read(read, lim, on_bytes);
      t = converter(tree, options.snapshot_device).run();
    }
    t.source = source;
    t.has_source_lines = false;  // a pickle has no lines; the conversion's mean nothing to the user
    return t;
  } catch (const pickle::limit_error& e) {
    throw trace_error(source, 0, std::string("a PyTorch snapshot that cannot be read: ") + e.what() + limit_hint(e));
  } catch (const pickle::pickle_error& e) {
    throw trace_error(source, 0, std::string("a PyTorch snapshot that cannot be read: ") + e.what());
  } catch (const convert_error& e) {
    throw trace_error(source, 0, std::string("a PyTorch snapshot that cannot be read: ") + e.what());
  } catch (const std::bad_alloc&) {
    throw trace_error(source, 0,
                      "a PyTorch snapshot that cannot be read: out of host memory (lower --max-pickle-bytes to "
                      "fail sooner)");
  }
}

#if CCALLOC_HAVE_ZLIB
struct gz_closer {
  void operator()(gzFile f) const noexcept { gzclose(f); }
};
#endif

}  // namespace

bool is_pytorch_snapshot_file(const std::string& path) noexcept {
  // Not a pipe or a device: what is read from them here would be gone.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  unsigned char head[2] = {0, 0};
  int got = 0;
#if CCALLOC_HAVE_ZLIB
  const gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  got = gzread(f, head, 2);
  gzclose(f);
#else
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  got = static_cast<int>(std::fread(head, 1, 2, f));
  std::fclose(f);
#endif
  return got == 2 && head[0] == 0x80 && head[1] >= 2 && head[1] <= 5;
}

trace convert_pytorch_snapshot(const std::string& path, const trace_read_options& options) {
  struct stat st {};
  const std::uint64_t file_size = ::stat(path.c_str(), &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
  errno = 0;
#if CCALLOC_HAVE_ZLIB
  const std::unique_ptr<std::remove_pointer_t<gzFile>, gz_closer> f(gzopen(path.c_str(), "rb"));
  if (!f) throw trace_error(path, 0, std::string("cannot open: ") + std::strerror(errno != 0 ? errno : ENOMEM));
  gzbuffer(f.get(), 1u << 20);
  const pickle::read_fn read = [&](char* buf, std::size_t size) -> std::size_t {
    const int got = gzread(f.get(), buf, static_cast<unsigned>(size));
    if (got < 0) {
      int code = 0;
      const char* why = gzerror(f.get(), &code);
      throw pickle::pickle_error(code == Z_ERRNO ? std::string("cannot read: ") + std::strerror(errno)
                                                 : std::string("corrupt gzip data (") + why + ")");
    }
    return static_cast<std::size_t>(got);
  };
  const auto compressed_offset = [&] { return static_cast<std::uint64_t>(gzoffset(f.get())); };
#else
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) throw trace_error(path, 0, std::string("cannot open: ") + std::strerror(errno));
  const pickle::read_fn read = [&](char* buf, std::size_t size) -> std::size_t {
    const std::size_t got = std::fread(buf, 1, size, f.get());
    if (got < size && std::ferror(f.get())) throw pickle::pickle_error(std::string("cannot read: ") + std::strerror(errno));
    return got;
  };
  const auto compressed_offset = [&] { return static_cast<std::uint64_t>(std::ftell(f.get())); };
#endif
  std::function<void(std::uint64_t)> on_bytes;
  if (options.progress)
    on_bytes = [&](std::uint64_t) { options.progress(std::min(compressed_offset(), file_size), file_size); };
  trace t = convert(read, path, options, on_bytes);
  if (options.progress) options.progress(file_size, file_size);
  return t;
}

namespace detail {
trace convert_pytorch_snapshot_stream(const std::function<std::size_t(char*, std::size_t)>& read,
                                      const std::string& source, const trace_read_options& options) {
  return convert(read, source, options, {});
}
}  // namespace detail

trace convert_pytorch_snapshot_data(std::string_view data, const std::string& source,
                                    const trace_read_options& options) {
  std::size_t at = 0;
  const pickle::read_fn read = [&](char* buf, std::size_t size) -> std::size_t {
    const std::size_t n = std::min(size, data.size() - at);
    std::memcpy(buf, data.data() + at, n);
    at += n;
    return n;
  };
  return convert(read, source, options, {});
}

}  // namespace ccalloc

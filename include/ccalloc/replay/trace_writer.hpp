// ccalloc/replay/trace_writer.hpp: records a running program's allocator
// events as a trace in ccalloc's format (docs/trace-format.md), which
// `ccalloc replay` and `ccalloc report` read.
//
// A trace_writer attaches a trace tracker (caching_allocator::
// attach_allocator_trace_tracker) and turns every trace entry of one device
// into a line, as it happens:
//   alloc, free_requested, free_completed, segment_*, snapshot, oom
//                      "time_us action addr size stream"
//   an alloc under another tag than the previous alloc's
//                      "time_us tag 0 0 0 NAME" first
//   pause              "time_us pause 0 PAUSED_BYTES 0 NAME keep|drop"
//   resume             "time_us resume 0 MAPPED_BYTES 0 NAME"
// empty_cache entries have no line (the replay makes its own). Times are
// held non-decreasing (trackers of several threads may deliver out of
// order by a few microseconds).
//
// Header-only, on purpose: a program records a trace with the allocator
// alone (std + CUDA), without the replay library and its zlib; the text is
// plain (gzip it to bundle it). Thread safety: the tracker may run on any
// thread; text() and write() may be called from any thread. The tracker
// holds the writer's state, so the writer may go before the allocator.
// Cost: one formatted line per entry under a mutex, while attached.
#pragma once

#include <ccalloc/base/detail/fork_handlers.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/tags.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>

namespace ccalloc {

class trace_writer {
 public:
  /// Records the entries of `device` of `allocator` from now on, for the
  /// allocator's life (trackers cannot be detached). Throws what
  /// attach_allocator_trace_tracker throws.
  trace_writer(caching_allocator& allocator, int device) : state_(std::make_shared<state>()) {
    state_->device = device;
    state_->text = "# time_us action addr size stream [tag [keep|drop]]\n";
    allocator.attach_allocator_trace_tracker([s = state_](const trace_entry& e) { s->add(e); });
  }

  /// The trace so far (a header comment, then one line per entry).
  [[nodiscard]] std::string text() const {
    std::lock_guard lock(state_->mutex);
    return state_->text;
  }

  /// Writes text() to `path` (replacing it). Throws ccalloc::error naming
  /// the path when it cannot be written.
  void write(const std::string& path) const {
    const std::string t = text();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << t;
    out.flush();
    if (!out) throw error("trace_writer: cannot write the trace to '" + path + "'");
  }

 private:
  struct state {
    std::mutex mutex;
    // Around a fork (base/detail/fork_handlers.hpp): `mutex` with the front
    // ends' locks (its holder takes no allocator lock, at most the tag
    // table's, a later rank), so that a child's tracker calls find it free.
    detail::fork_registration fork{detail::fork_rank::front_end,
                                   detail::fork_hooks{this,
                                                      [](void* self) noexcept { static_cast<state*>(self)->mutex.lock(); },
                                                      [](void* self, bool) noexcept {
                                                        static_cast<state*>(self)->mutex.unlock();
                                                      }}};
    std::string text;
    int device = 0;
    tag_id alloc_tag = default_tag_id;  // the tag of the last alloc line
    std::uint64_t time_us = 0;          // the last line's (times never go back)

    void line(const char* action, std::uintptr_t addr, std::size_t size, stream_t stream) {
      text += std::to_string(time_us);
      text += ' ';
      text += action;
      text += ' ';
      text += std::to_string(addr);
      text += ' ';
      text += std::to_string(size);
      text += ' ';
      text += std::to_string(static_cast<std::uint64_t>(stream));
    }
    void add(const trace_entry& e) {
      if (e.device != device || e.action == trace_entry_action::empty_cache) return;
      const std::string name = std::string(to_string(e.action));
      std::lock_guard lock(mutex);
      time_us = std::max(time_us, e.time_us);
      switch (e.action) {
        case trace_entry_action::pause:
          line("pause", 0, e.size, 0);
          text += ' ' + tag_name(e.tag) + (e.addr != 0 ? " keep\n" : " drop\n");
          return;
        case trace_entry_action::resume:
          line("resume", 0, e.size, 0);
          text += ' ' + tag_name(e.tag) + '\n';
          return;
        case trace_entry_action::alloc:
          if (e.tag != alloc_tag) {
            line("tag", 0, 0, 0);
            text += ' ' + tag_name(e.tag) + '\n';
            alloc_tag = e.tag;
          }
          break;
        default:
          break;
      }
      line(name.c_str(), e.addr, e.size, e.stream);
      text += '\n';
    }
  };
  std::shared_ptr<state> state_;
};

}  // namespace ccalloc

// The device allocator's history API (include/ccalloc/core/device_caching_allocator.hpp,
// SPEC F13-F16, F18) and its malloc/free when history is on. Kept out of
// hot_path.cpp so that the hot path's translation unit, and
// with it the compiler's inlining there, does not change with history.
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/file_output.hpp>
#include <ccalloc/core/snapshot.hpp>

#include "detail/device_state.hpp"

#include <exception>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace ccalloc {

using detail::block;
using detail::world_lock;

// malloc with history on: the caller's context is gathered outside the
// locks, entries recorded inside (segment_alloc, oom) take it, and the
// trackers run once the locks are released.
allocation detail::malloc_recorded(detail::device_state& s, std::size_t size_bytes, stream_t stream) {
  detail::tracker_delivery deliver;
  detail::history_recorder& h = s.history();
  context_ptr context = h.gather(record_context::state);
  detail::context_scope scope(detail::context_kind::malloc, context);
  const allocation a = detail::malloc_unrecorded(s, size_bytes, stream);
  h.remember_block(a.block->ptr, context);
  h.record(trace_entry_action::alloc, a.block->ptr, size_bytes, stream, context,
           detail::tag_of(*a.block));
  return a;
}

void detail::free_recorded(detail::device_state& s, block* b) {
  detail::tracker_delivery deliver;
  detail::history_recorder& h = s.history();
  context_ptr context = h.gather(record_context::all);
  detail::context_scope scope(detail::context_kind::free, context);
  // The caller owns the live block: its fields do not change meanwhile.
  // Entries of this free (free_completed, segment changes) carry its tag.
  const tag_scope block_tag(detail::tag_of(*b));
  h.record(trace_entry_action::free_requested, b->ptr, b->requested_bytes, b->stream, context);
  // A block used on no other stream is free at once (free_block). Its
  // free_completed is recorded here, before any segment_free that freeing it
  // causes (no-caching mode); one that waits for events is recorded where
  // its events complete (event_queue::process_events and friends); one of a
  // paused tag, whose free is done at the resume, by that resume (the
  // memory figures count it until then).
  if (b->stream_uses.empty() && b->event_count == 0) {
    if (s.defer_free_while_paused(b)) return;
    h.record_free_completed(b->ptr, b->requested_bytes, b->stream, detail::tag_of(*b));
  }
  s.free(b);
}

std::string detail::write_oom_snapshot(device_caching_allocator& owner, const std::string& path) noexcept {
  const std::string where = " (oom_snapshot)";
  try {
    memory_snapshot snapshot;
    snapshot.config = owner.config();
    snapshot.segments = owner.snapshot_segments();
    // device_traces is indexed by device, as in PyTorch's snapshot.
    snapshot.device_traces.resize(static_cast<std::size_t>(owner.device()) + 1);
    snapshot.device_traces.back() = owner.trace_entries();
    snapshot.external_annotations = owner.annotations();
    const std::string bytes = to_pickle(snapshot);
    const auto failed = [&](int error, const std::string& what = {}) {
      return " The snapshot" + where + " could not be written to " + path + what + " (" +
             std::generic_category().message(error) + ").";
    };
    std::string step;
    if (const int error = write_file_whole(path, bytes, step); error != 0) return failed(error, step);
    return " A snapshot of device " + std::to_string(owner.device()) + "'s memory" + where + " was written to " +
           path + ".";
  } catch (const std::exception& e) {
    try {
      return " The snapshot" + where + " could not be written to " + path + " (" + e.what() + ").";
    } catch (...) {
      return {};
    }
  } catch (...) {
    return {};
  }
}

std::vector<mapped_run> mapped_runs(const segment_info& seg) {
  std::vector<mapped_run> out;
  if (seg.paused) return out;
  bool open = false;
  for (std::size_t i = 0; i < seg.blocks.size(); ++i) {
    const block_info& b = seg.blocks[i];
    if (seg.is_expandable && !b.mapped) {
      open = false;
      continue;
    }
    if (!open) out.push_back({i, i, b.address, 0});
    open = true;
    out.back().end_block = i + 1;
    out.back().size_bytes += b.size_bytes;
  }
  return out;
}

std::string_view to_string(block_state state) noexcept {
  switch (state) {
    case block_state::active_allocated: return "active_allocated";
    case block_state::active_pending_free: return "active_pending_free";
    case block_state::inactive: break;
  }
  return "inactive";
}

void device_caching_allocator::record_history(const history_options& options) {
  detail::tracker_delivery deliver;  // lets go of the contexts it drops
  state_->history().configure(options);
}

bool device_caching_allocator::is_history_enabled() const noexcept { return state_->history().enabled(); }

void device_caching_allocator::record_annotation(std::vector<std::pair<std::string, std::string>> metadata) {
  state_->history().record_annotation(std::move(metadata));
}

void device_caching_allocator::push_compile_context(std::string context) {
  state_->history().push_compile_context(std::move(context));
}

void device_caching_allocator::pop_compile_context() { state_->history().pop_compile_context(); }

void device_caching_allocator::set_user_metadata(std::string metadata) {
  state_->history().set_user_metadata(std::move(metadata));
}

std::string device_caching_allocator::user_metadata() const { return state_->history().user_metadata(); }

void device_caching_allocator::attach_trace_tracker(trace_tracker tracker) {
  state_->history().attach_tracker(std::move(tracker));
}

void device_caching_allocator::attach_mapping_listener(mapping_listener listener) {
  if (!listener) throw invalid_argument_error("ccalloc: attach_mapping_listener: the listener is empty");
  state_->mapping().attach(std::move(listener));
}

void device_caching_allocator::attach_mapping_listener(
    mapping_listener listener, const std::function<void(const std::vector<segment_info>&)>& listed) {
  if (!listener) throw invalid_argument_error("ccalloc: attach_mapping_listener: the listener is empty");
  // Announcements are made with the device's locks held: none comes between
  // the list and the attach. The list goes after the locks: its contexts may
  // be the last references (history.hpp: trace_context).
  std::vector<segment_info> now;
  world_lock w(*state_);
  now = segments_locked();
  state_->mapping().attach(std::move(listener));
  if (listed) listed(now);
}

std::vector<trace_entry> device_caching_allocator::trace_entries() const { return state_->history().entries(); }

std::vector<annotation_entry> device_caching_allocator::annotations() const {
  return state_->history().annotations();
}

void device_caching_allocator::record_snapshot_entry() {
  auto& s = *state_;
  if (!s.history().active()) return;
  detail::tracker_delivery deliver;
  world_lock w(s);
  s.stats().publish_all_pending(w);
  const auto active_bytes = static_cast<std::size_t>(s.stats().values().active_bytes[0].current);
  s.history().record(trace_entry_action::snapshot, 0, active_bytes, 0, nullptr);
}

std::vector<segment_info> device_caching_allocator::snapshot_segments(bool record_entry) {
  if (record_entry) record_snapshot_entry();
  // PyTorch's layout for expandable segments: each run of mapped pages is a
  // segment of its own (total_size = the run's bytes), unmapped ranges are
  // left out (torch.cuda.memory._snapshot() does the same).
  std::vector<segment_info> out;
  for (segment_info& seg : segments()) {
    if (!seg.is_expandable) {
      out.push_back(std::move(seg));
      continue;
    }
    segment_info run;
    auto flush = [&] {
      if (!run.blocks.empty()) out.push_back(std::move(run));
      run = segment_info{};
    };
    for (block_info& b : seg.blocks) {
      if (!b.mapped) {
        flush();
        continue;
      }
      if (run.blocks.empty()) {
        run.device = seg.device;
        run.address = b.address;
        run.stream = seg.stream;
        run.is_small_pool = seg.is_small_pool;
        run.is_expandable = true;
        run.pool = seg.pool;
        run.pool_id = seg.pool_id;  // the deprecated alias of pool, still filled in
        run.context = seg.context;
        run.tag = seg.tag;
        run.paused = seg.paused;  // its blocks' pages are released: shown, mapped nowhere
      }
      run.total_bytes += b.size_bytes;
      if (!seg.paused) run.mapped_bytes += b.size_bytes;
      if (b.state == block_state::active_allocated) run.allocated_bytes += b.size_bytes;
      if (b.state != block_state::inactive) {
        run.active_bytes += b.size_bytes;
        run.requested_bytes += b.requested_bytes;
      }
      run.blocks.push_back(std::move(b));
    }
    flush();
  }
  return out;
}

}  // namespace ccalloc

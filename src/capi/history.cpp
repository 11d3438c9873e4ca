// The C API: memory history, snapshots, mapped segments and observers (OOM,
// trace, mapping).
#include "capi.hpp"

#include <ccalloc/base/detail/locked_callback.hpp>
#include <ccalloc/base/detail/spin_mutex.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/snapshot.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <pthread.h>

using namespace ccalloc::capi_detail;  // NOLINT(google-build-using-namespace)

extern "C" {

// ---- history and snapshots -------------------------------------------------------------------------------

ccalloc_status_t ccalloc_record_history(ccalloc_allocator_t* alloc, int enabled, size_t max_entries) {
  return guarded([&] {
    ccalloc::history_options o;
    o.enabled = enabled != 0;
    o.max_entries = max_entries;
    o.when = ccalloc::record_context::never;
    resolve(alloc).record_history(o);
  });
}

namespace {

// ---- the switch of the observing callbacks (ccalloc_set_observers_enabled) ----------------------------
//
// Each call of an observing callback holds an observer_call: it counts
// itself in, then reads the switch (both sequentially consistent), so that a
// stop that then reads the count sees every call that may still go on.

std::atomic<bool> observers_stopped{false};
std::atomic<std::size_t> observer_calls_in_flight{0};
constinit thread_local std::size_t tls_observer_calls = 0;  // this thread's calls in flight (nested)

/// One call of an observing callback: made only when `open()`.
class observer_call {
 public:
  observer_call() noexcept {
    observer_calls_in_flight.fetch_add(1);
    ++tls_observer_calls;
    open_ = !observers_stopped.load();
  }
  ~observer_call() {
    --tls_observer_calls;
    observer_calls_in_flight.fetch_sub(1);
  }
  observer_call(const observer_call&) = delete;
  observer_call& operator=(const observer_call&) = delete;
  [[nodiscard]] bool open() const noexcept { return open_; }

 private:
  bool open_ = false;
};

/// In a child of fork() only the forking thread goes on: calls that other
/// threads had in flight are gone.
[[maybe_unused]] const int observer_count_reset_at_fork = pthread_atfork(
    nullptr, nullptr, [] { observer_calls_in_flight.store(tls_observer_calls); });

/// While the caller's `release` or `frames` function runs: it may run where
/// the allocator holds locks (the last reference to a context is dropped
/// under the history's or the device's locks), so a call from it back into
/// an allocator is refused with INVALID_ARGUMENT naming it, or, for malloc
/// and free that would wait on a lock this thread holds, stops the process
/// with a message, as for a mapping listener (base/detail/spin_mutex.hpp).
class locked_callback {
 public:
  explicit locked_callback(const char* name) noexcept : previous_(ccalloc::detail::tls_locked_callback) {
    ++ccalloc::detail::tls_mapping_listener_depth;
    ccalloc::detail::tls_locked_callback = name;
  }
  ~locked_callback() {
    ccalloc::detail::tls_locked_callback = previous_;
    --ccalloc::detail::tls_mapping_listener_depth;
  }
  locked_callback(const locked_callback&) = delete;
  locked_callback& operator=(const locked_callback&) = delete;

 private:
  const char* previous_;
};

/// Nonzero while this thread runs the caller's `record` function: a call
/// from it into the allocator (made outside the allocator's locks, so it
/// may) records its entries without a context instead of calling `record`
/// again, which would recurse without end.
constinit thread_local int tls_recording = 0;

/// A context handle that a C recorder returned: given back through the
/// recorder's release function with the last entry or block holding it,
/// turned into frames through its frames function when a snapshot is written.
class c_context final : public ccalloc::trace_context {
 public:
  c_context(void* handle, const ccalloc_history_options_t& fns) noexcept
      : handle_(handle), release_(fns.release), frames_(fns.frames), user_data_(fns.user_data) {}
  ~c_context() override {
    if (release_ == nullptr) return;
    const observer_call call;  // stopped: the handle is leaked (ccalloc_set_observers_enabled)
    if (!call.open()) return;
    const locked_callback running("the history's release function (ccalloc_history_options_t.release)");
    release_(user_data_, handle_);
  }
  c_context(const c_context&) = delete;
  c_context& operator=(const c_context&) = delete;
  [[nodiscard]] std::vector<ccalloc::stack_frame> to_frames() const override {
    std::vector<ccalloc::stack_frame> out;
    if (frames_ == nullptr) return out;
    const observer_call call;
    if (!call.open()) return out;
    const locked_callback running("the history's frames function (ccalloc_history_options_t.frames)");
    frames_(user_data_, handle_, &sink, &out);
    return out;
  }

 private:
  static void sink(void* sink_data, const char* name, const char* filename, int64_t line) noexcept {
    try {  // nothing may unwind through the caller's C frames: a frame that does not fit is dropped
      static_cast<std::vector<ccalloc::stack_frame>*>(sink_data)->push_back(
          {name != nullptr ? name : "", filename != nullptr ? filename : "", line});
    } catch (...) {
    }
  }
  void* handle_;
  void (*release_)(void*, void*);
  void (*frames_)(void*, void*, ccalloc_frame_sink_fn, void*);
  void* user_data_;
};

/// "alloc,free_requested" as actions; throws invalid_argument_error naming an unknown one.
std::vector<ccalloc::trace_entry_action> parse_skip_actions(const char* text) {
  std::vector<ccalloc::trace_entry_action> out;
  if (text == nullptr) return out;
  std::string_view rest(text);
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    std::string_view name = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    while (!name.empty() && name.front() == ' ') name.remove_prefix(1);
    while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
    if (name.empty()) continue;
    const auto action = ccalloc::parse_trace_entry_action(name);
    if (!action)
      throw ccalloc::invalid_argument_error(
          "ccalloc: ccalloc_record_history_ex: unknown action '" + std::string(name) +
          "' in skip_actions (accepted: alloc, free_requested, free_completed, segment_alloc, segment_free, "
          "segment_map, segment_unmap, snapshot, oom, empty_cache)");
    out.push_back(*action);
  }
  return out;
}

}  // namespace

void ccalloc_history_options_init(ccalloc_history_options_t* options) {
  if (options == nullptr) return;
  *options = ccalloc_history_options_t{};
  options->enabled = 1;
  options->max_entries = SIZE_MAX;
  options->when = CCALLOC_RECORD_CONTEXT_ALL;
}

ccalloc_status_t ccalloc_record_history_ex(ccalloc_allocator_t* alloc, const ccalloc_history_options_t* options) {
  return guarded([&] {
    require(options, "ccalloc_record_history_ex", "options");
    const ccalloc_history_options_t c = *options;
    if (c.when < CCALLOC_RECORD_CONTEXT_NEVER || c.when > CCALLOC_RECORD_CONTEXT_ALL)
      throw ccalloc::invalid_argument_error("ccalloc: ccalloc_record_history_ex: when must be 0 (never) to 3 (all), got " +
                                            std::to_string(c.when));
    ccalloc::history_options o;
    o.enabled = c.enabled != 0;
    o.max_entries = c.max_entries;
    o.when = static_cast<ccalloc::record_context>(c.when);
    o.clear = c.clear != 0;
    o.skip_actions = parse_skip_actions(c.skip_actions);
    if (c.record != nullptr) {
      o.recorder = [c]() -> ccalloc::context_ptr {
        if (tls_recording != 0) return nullptr;  // a call from `record` itself
        const observer_call call;
        if (!call.open()) return nullptr;
        void* handle = nullptr;
        {
          ++tls_recording;
          struct done {
            ~done() { --tls_recording; }
          } const recording;
          handle = c.record(c.user_data);
        }
        if (handle == nullptr) return nullptr;
        try {
          return std::make_shared<const c_context>(handle, c);
        } catch (...) {
          if (c.release != nullptr) {
            const locked_callback running("the history's release function (ccalloc_history_options_t.release)");
            c.release(c.user_data, handle);
          }
          throw;
        }
      };
    }
    resolve(alloc).record_history(o);
  });
}

ccalloc_status_t ccalloc_snapshot_json(ccalloc_allocator_t* alloc, int include_traces, char* buffer,
                                       size_t capacity, size_t* length) {
  return guarded([&] {
    require(length, "ccalloc_snapshot_json", "length");
    if (capacity > 0) require(buffer, "ccalloc_snapshot_json", "buffer (with capacity > 0)");
    // The `snapshot` history entry is recorded after the text is made and
    // only by a call that returns all of it: a size query (or a too small
    // buffer) leaves the history as it was, so the next call's text has the
    // length this one reported.
    auto& a = resolve(alloc);
    const std::string text = ccalloc::to_json(a.snapshot(include_traces != 0, /*record_entry=*/false));
    if (capacity > 0) {
      const std::size_t n = std::min(text.size(), capacity - 1);
      std::memcpy(buffer, text.data(), n);
      buffer[n] = '\0';
    }
    *length = text.size();
    if (capacity > text.size()) a.record_snapshot_entry();
  });
}

// ---- observers -------------------------------------------------------------------------------------------

ccalloc_status_t ccalloc_attach_out_of_memory_observer(ccalloc_allocator_t* alloc, ccalloc_oom_observer_fn fn,
                                                       void* user_data) {
  return guarded([&] {
    if (fn == nullptr)
      throw ccalloc::invalid_argument_error("ccalloc: ccalloc_attach_out_of_memory_observer: fn is NULL");
    resolve(alloc).attach_out_of_memory_observer(
        [fn, user_data](int device, std::size_t requested, std::size_t allowed, std::size_t free_bytes) {
          const observer_call call;
          if (call.open()) fn(user_data, device, requested, allowed, free_bytes);
        });
  });
}

ccalloc_status_t ccalloc_attach_trace_tracker(ccalloc_allocator_t* alloc, ccalloc_trace_tracker_fn fn,
                                              void* user_data) {
  return guarded([&] {
    if (fn == nullptr) throw ccalloc::invalid_argument_error("ccalloc: ccalloc_attach_trace_tracker: fn is NULL");
    resolve(alloc).attach_allocator_trace_tracker([fn, user_data](const ccalloc::trace_entry& e) {
      const observer_call call;
      if (!call.open()) return;
      const ccalloc_trace_entry_t c{static_cast<ccalloc_trace_action_t>(e.action), e.device, e.addr, e.size,
                                    from_stream(e.stream), e.time_us};
      fn(user_data, &c);
    });
  });
}

ccalloc_status_t ccalloc_attach_mapping_listener(ccalloc_allocator_t* alloc, ccalloc_mapping_listener_fn fn,
                                                 void* user_data) {
  return guarded([&] {
    if (fn == nullptr) throw ccalloc::invalid_argument_error("ccalloc: ccalloc_attach_mapping_listener: fn is NULL");
    resolve(alloc).attach_mapping_listener([fn, user_data](const ccalloc::mapping_event& e) {
      const observer_call call;
      if (!call.open()) return;
      const ccalloc_mapping_event_t c{static_cast<ccalloc_mapping_change_t>(e.change),
                                      static_cast<ccalloc_mapping_reason_t>(e.reason),
                                      e.device,
                                      e.expandable ? 1 : 0,
                                      e.addr,
                                      e.size_bytes,
                                      from_stream(e.stream)};
      fn(user_data, &c);
    });
  });
}
ccalloc_status_t ccalloc_set_observers_enabled(int enabled, uint32_t timeout_ms, size_t* still_running) {
  std::size_t running = 0;
  if (enabled != 0) {
    observers_stopped.store(false);
  } else {
    observers_stopped.store(true);
    // The calls of other threads still inside (this thread's own are not waited for).
    const auto others = [] { return observer_calls_in_flight.load() - tls_observer_calls; };
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while ((running = others()) != 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (still_running != nullptr) *still_running = running;
  return CCALLOC_OK;
}

// The device bound of ccalloc.h is the C++ one.
static_assert(CCALLOC_MAX_DEVICE_COUNT == ccalloc::max_device_count, "ccalloc.h and types.hpp disagree");
// The C enums follow the C++ ones value for value.
static_assert(static_cast<int>(ccalloc::trace_entry_action::empty_cache) == CCALLOC_TRACE_EMPTY_CACHE);
static_assert(static_cast<int>(ccalloc::trace_entry_action::pause) == CCALLOC_TRACE_PAUSE);
static_assert(static_cast<int>(ccalloc::trace_entry_action::resume) == CCALLOC_TRACE_RESUME);
static_assert(static_cast<int>(ccalloc::trace_entry_action::segment_unmap) == CCALLOC_TRACE_SEGMENT_UNMAP);
static_assert(static_cast<int>(ccalloc::mapping_change::unmap_completed) == CCALLOC_MAPPING_UNMAP_COMPLETED);
static_assert(static_cast<int>(ccalloc::mapping_reason::deferred_unmap) == CCALLOC_MAPPING_DEFERRED_UNMAP);
static_assert(static_cast<int>(ccalloc::mapping_reason::pages_resumed) == CCALLOC_MAPPING_PAGES_RESUMED);
static_assert(static_cast<int>(ccalloc::mapping_reason::pages_retired) == CCALLOC_MAPPING_PAGES_RETIRED);

// ---- mapped segments (snapshots) -------------------------------------------------------------------------

namespace {
// The mapped ranges of one segment (ccalloc::mapped_runs), with their blocks' figures.
void add_mapped_ranges(const ccalloc::segment_info& si, std::vector<ccalloc_mapped_segment_t>& out) {
  for (const ccalloc::mapped_run& run : ccalloc::mapped_runs(si)) {
    ccalloc_mapped_segment_t r{};
    r.device = si.device;
    r.address = static_cast<uintptr_t>(run.address);
    r.stream = from_stream(si.stream);
    r.is_large = si.is_small_pool ? 0 : 1;
    r.is_expandable = si.is_expandable ? 1 : 0;
    r.pool_id = ccalloc_mempool_id_t{si.pool.first, si.pool.second};
    r.total_bytes = run.size_bytes;
    for (std::size_t i = run.first_block; i < run.end_block; ++i) {
      const ccalloc::block_info& b = si.blocks[i];
      if (b.state == ccalloc::block_state::active_allocated) r.allocated_bytes += b.size_bytes;
      if (b.state != ccalloc::block_state::inactive) {
        r.active_bytes += b.size_bytes;
        r.requested_bytes += b.requested_bytes;
      }
    }
    out.push_back(r);
  }
}
}  // namespace

ccalloc_status_t ccalloc_mapped_segments(ccalloc_allocator_t* alloc, int device, ccalloc_mapped_segment_t* out,
                                         size_t* count) {
  return guarded([&] {
    require(count, "ccalloc_mapped_segments", "count");
    ccalloc::caching_allocator& a = resolve(alloc);
    const int devices = a.initialized_device_count();
    if (devices == 0) throw ccalloc::invalid_argument_error("ccalloc: ccalloc_mapped_segments before ccalloc_init()");
    if (device < -1 || device >= devices)
      throw ccalloc::invalid_argument_error("ccalloc: ccalloc_mapped_segments: device " + std::to_string(device) +
                                            " is out of range (-1 for every device, or 0.." +
                                            std::to_string(devices - 1) + ")");
    // Checked after the device: a bad device is named whatever `out` is.
    if (*count > 0) require(out, "ccalloc_mapped_segments", "out");
    std::vector<ccalloc_mapped_segment_t> ranges;
    for (int d = device < 0 ? 0 : device; d < (device < 0 ? devices : device + 1); ++d)
      for (const ccalloc::segment_info& si : a.device_allocator(d).segments())
        add_mapped_ranges(si, ranges);
    std::copy_n(ranges.begin(), std::min(*count, ranges.size()), out);
    *count = ranges.size();
  });
}

}  // extern "C"

// Memory history of one device (src/core/detail/history_recorder.hpp) and
// the names of trace-entry actions (include/ccalloc/core/history.hpp).
#include "detail/history_recorder.hpp"

#include <ccalloc/base/detail/thread_object.hpp>
#include <ccalloc/base/errors.hpp>

#include <array>
#include <chrono>

namespace ccalloc {

namespace {
constexpr std::array<std::string_view, trace_entry_action_count> action_names = {
    "alloc",         "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map",   "segment_unmap",  "snapshot",       "oom",           "empty_cache",
    "pause",         "resume",
};
}  // namespace

std::string_view to_string(trace_entry_action action) noexcept {
  const auto i = static_cast<std::size_t>(action);
  return i < action_names.size() ? action_names[i] : "unknown";
}

std::optional<trace_entry_action> parse_trace_entry_action(std::string_view name) noexcept {
  for (std::size_t i = 0; i < action_names.size(); ++i)
    if (action_names[i] == name) return static_cast<trace_entry_action>(i);
  return std::nullopt;
}

namespace detail {

namespace {

std::uint64_t now_us() noexcept {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

struct pending_entry {
  std::shared_ptr<const std::vector<trace_tracker>> trackers;
  trace_entry entry;
};

}  // namespace

// One per thread, made at its first use (not a C++ thread_local: a thread's
// first call must not stop the process when the host's memory is
// exhausted, base/detail/thread_object.hpp).
struct history_thread_state {
  std::vector<pending_entry> pending;       // entries for the trackers, delivered on the way out
  std::vector<context_ptr> released;        // references dropped under the locks, let go on the way out
  std::array<context_ptr, 2> context;       // [context_kind]
};
using thread_state_of = thread_object<history_thread_state>;

namespace {

// Lets go of `context` once the allocator's locks are released: the
// reference may be the last, and a context's destructor runs the caller's
// code (history.hpp: trace_context), which may call into the allocator. The
// thread's list holds it until deliver_pending; only when no host memory is
// left for that list is it dropped here.
void release_outside_locks(context_ptr& context) noexcept {
  if (context == nullptr) return;
  try {
    thread_state_of::get().released.push_back(std::move(context));
  } catch (...) {  // std::bad_alloc
    context.reset();
  }
}

void release_outside_locks(std::vector<trace_entry>& entries) noexcept {
  for (trace_entry& e : entries) release_outside_locks(e.context);
}

void release_outside_locks(std::unordered_map<std::uintptr_t, context_ptr>& contexts) noexcept {
  for (auto& [addr, context] : contexts) release_outside_locks(context);
}

}  // namespace

history_recorder::~history_recorder() = default;

void history_recorder::update_active() noexcept {
  const bool has_trackers = trackers_ && !trackers_->empty();
  active_.store(enabled_.load(std::memory_order_relaxed) || has_trackers, std::memory_order_relaxed);
}

void history_recorder::configure(const history_options& options) {
  if (options.max_entries == 0)
    throw invalid_argument_error("ccalloc: record_history: max_entries must be at least 1, got 0");
  std::uint32_t mask = 0;
  for (trace_entry_action a : options.skip_actions) mask |= 1u << static_cast<unsigned>(a);
  // What is dropped is destroyed after the lock (declared before it): a
  // context may hold a caller's handle whose release runs the caller's code.
  // Its contexts go later still (release_outside_locks): the caller of
  // record_history may hold other locks (caching_allocator's configuration).
  context_recorder old_recorder;
  std::vector<trace_entry> dropped_entries, cleared_entries;
  std::unordered_map<std::uintptr_t, context_ptr> dropped_blocks, dropped_segments;
  std::lock_guard lock(mutex_);
  const bool enabled = options.enabled;
  old_recorder = std::move(recorder_);
  recorder_ = enabled ? options.recorder : context_recorder{};
  when_.store(enabled ? options.when : record_context::never, std::memory_order_relaxed);
  skip_mask_ = mask;
  dropped_entries = entries_.set_capacity(options.max_entries);
  (void)annotations_.set_capacity(options.max_entries);
  if (!enabled || options.clear) {
    cleared_entries = entries_.take();
    (void)annotations_.take();
  }
  if (!enabled) {
    // Contexts of live blocks would go stale: their frees are not seen.
    dropped_blocks.swap(block_contexts_);
    dropped_segments.swap(segment_contexts_);
    compile_contexts_.clear();
  }
  enabled_.store(enabled, std::memory_order_relaxed);
  update_active();
  release_outside_locks(dropped_entries);
  release_outside_locks(cleared_entries);
  release_outside_locks(dropped_blocks);
  release_outside_locks(dropped_segments);
}

void history_recorder::attach_tracker(trace_tracker tracker) {
  if (!tracker) throw invalid_argument_error("ccalloc: attach_allocator_trace_tracker: the tracker is empty");
  std::lock_guard lock(mutex_);
  auto next = trackers_ ? std::make_shared<std::vector<trace_tracker>>(*trackers_)
                        : std::make_shared<std::vector<trace_tracker>>();
  next->push_back(std::move(tracker));
  trackers_ = std::move(next);
  update_active();
}

context_ptr history_recorder::gather(record_context level) const {
  if (!enabled() || when() < level) return nullptr;
  context_recorder recorder;
  {
    std::lock_guard lock(mutex_);
    recorder = recorder_;
  }
  return recorder ? recorder() : nullptr;
}

void history_recorder::record(trace_entry_action action, std::uintptr_t addr, std::size_t size, stream_t stream,
                              const context_ptr& context, tag_id tag) {
  trace_entry e;
  e.action = action;
  e.tag = tag;
  e.device = device_;
  e.addr = addr;
  e.size = size;
  e.stream = stream;
  e.time_us = now_us();
  std::shared_ptr<const std::vector<trace_tracker>> trackers;
  trace_entry dropped;  // the oldest entry, when the buffer is full: destroyed after the lock, its context later
  {
    std::lock_guard lock(mutex_);
    if (when() >= record_context::alloc) e.context = context;
    if (!compile_contexts_.empty()) e.compile_context = compile_contexts_.back();
    e.user_metadata = user_metadata_;
    trackers = trackers_;
    if (enabled() && (skip_mask_ & (1u << static_cast<unsigned>(action))) == 0) {
      if (trackers && !trackers->empty()) entries_.push(e, dropped);
      else entries_.push(std::move(e), dropped);
    }
  }
  release_outside_locks(dropped.context);
  if (trackers && !trackers->empty()) thread_state_of::get().pending.push_back({std::move(trackers), std::move(e)});
}

void history_recorder::record_free_completed(std::uintptr_t addr, std::size_t requested_bytes, stream_t stream,
                                             tag_id tag) {
  context_ptr allocated_with = forget_block(addr);
  const context_ptr& freed_with = current_context(context_kind::free);
  record(trace_entry_action::free_completed, addr, requested_bytes, stream, freed_with ? freed_with : allocated_with,
         tag);
  release_outside_locks(allocated_with);  // called under a stream's or the device's locks
}

void history_recorder::record_segment_alloc(std::uintptr_t addr, std::size_t size, stream_t stream) {
  const context_ptr& context = current_context(context_kind::malloc);
  record(trace_entry_action::segment_alloc, addr, size, stream, context);
  remember_segment(addr, context);
}

void history_recorder::record_segment_free(std::uintptr_t addr, std::size_t size, stream_t stream) {
  // As PyTorch: the context of the call that frees it, else the segment's own.
  context_ptr allocated_with = forget_segment(addr);
  const context_ptr& freed_with = current_context(context_kind::free);
  record(trace_entry_action::segment_free, addr, size, stream, freed_with ? freed_with : allocated_with);
  release_outside_locks(allocated_with);  // called under the device's locks
}

void history_recorder::record_segment_map(std::uintptr_t addr, std::size_t size, stream_t stream) {
  record(trace_entry_action::segment_map, addr, size, stream, current_context(context_kind::malloc));
}

void history_recorder::record_segment_unmap(std::uintptr_t addr, std::size_t size, stream_t stream) {
  // The context of the call that unmaps the pages: a free, or a malloc recycling them.
  const context_ptr& freed_with = current_context(context_kind::free);
  record(trace_entry_action::segment_unmap, addr, size, stream,
         freed_with ? freed_with : current_context(context_kind::malloc));
}

void history_recorder::record_oom(std::size_t device_free_bytes, std::size_t requested_bytes, stream_t stream) {
  record(trace_entry_action::oom, device_free_bytes, requested_bytes, stream, current_context(context_kind::malloc));
}

void history_recorder::remember(std::unordered_map<std::uintptr_t, context_ptr>& map, std::uintptr_t addr,
                                context_ptr context) {
  if (!context) return;
  {
    std::lock_guard lock(mutex_);
    std::swap(map[addr], context);  // a context there before goes with `context`
  }
  release_outside_locks(context);  // a segment's is remembered under the device's locks
}

context_ptr history_recorder::find(const std::unordered_map<std::uintptr_t, context_ptr>& map,
                                   std::uintptr_t addr) const {
  std::lock_guard lock(mutex_);
  auto it = map.find(addr);
  return it == map.end() ? nullptr : it->second;
}

void history_recorder::remember_block(std::uintptr_t addr, context_ptr context) {
  remember(block_contexts_, addr, std::move(context));
}

context_ptr history_recorder::forget_block(std::uintptr_t addr) {
  std::lock_guard lock(mutex_);
  auto it = block_contexts_.find(addr);
  if (it == block_contexts_.end()) return nullptr;
  context_ptr c = std::move(it->second);
  block_contexts_.erase(it);
  return c;
}

void history_recorder::remember_segment(std::uintptr_t addr, context_ptr context) {
  remember(segment_contexts_, addr, std::move(context));
}

context_ptr history_recorder::forget_segment(std::uintptr_t addr) {
  std::lock_guard lock(mutex_);
  auto it = segment_contexts_.find(addr);
  if (it == segment_contexts_.end()) return nullptr;
  context_ptr c = std::move(it->second);
  segment_contexts_.erase(it);
  return c;
}

context_ptr history_recorder::block_context(std::uintptr_t addr) const { return find(block_contexts_, addr); }

context_ptr history_recorder::segment_context(std::uintptr_t addr) const { return find(segment_contexts_, addr); }

void history_recorder::record_annotation(std::vector<std::pair<std::string, std::string>> metadata) {
  if (!enabled()) return;
  annotation_entry a;
  a.device = device_;
  a.time_us = now_us();
  a.metadata = std::move(metadata);
  annotation_entry dropped;
  std::lock_guard lock(mutex_);
  if (enabled()) annotations_.push(std::move(a), dropped);
}

void history_recorder::push_compile_context(std::string context) {
  std::lock_guard lock(mutex_);
  if (enabled()) compile_contexts_.push_back(std::move(context));
}

void history_recorder::pop_compile_context() {
  std::lock_guard lock(mutex_);
  if (enabled() && !compile_contexts_.empty()) compile_contexts_.pop_back();
}

void history_recorder::set_user_metadata(std::string metadata) {
  std::lock_guard lock(mutex_);
  user_metadata_ = std::move(metadata);
}

std::string history_recorder::user_metadata() const {
  std::lock_guard lock(mutex_);
  return user_metadata_;
}

std::vector<trace_entry> history_recorder::entries() const {
  std::lock_guard lock(mutex_);
  return entries_.items();
}

std::vector<annotation_entry> history_recorder::annotations() const {
  std::lock_guard lock(mutex_);
  return annotations_.items();
}

void history_recorder::deliver_pending() noexcept {
  // A tracker, or the destructor of a context let go here, may call back
  // into the allocator, which queues and delivers its own: take the queues
  // first.
  history_thread_state* state = thread_state_of::find();
  if (state == nullptr) return;
  while (!state->pending.empty() || !state->released.empty()) {
    {
      std::vector<context_ptr> released;
      released.swap(state->released);
    }
    std::vector<pending_entry> batch;
    batch.swap(state->pending);
    for (const pending_entry& p : batch)
      for (const trace_tracker& t : *p.trackers) {
        try {
          t(p.entry);
        } catch (...) {
          // Trackers are notifications: an exception must not reach the
          // allocator's caller nor stop the other trackers (trace_tracker).
        }
      }
  }
}

const context_ptr& history_recorder::current_context(context_kind kind) noexcept {
  static const context_ptr none;
  const history_thread_state* state = thread_state_of::find();
  return state != nullptr ? state->context[static_cast<std::size_t>(kind)] : none;
}

// A context that cannot be set (no host memory for the thread's state) is
// not: the call's entries go without it.
context_scope::context_scope(context_kind kind, context_ptr context) noexcept
    : kind_(kind), state_(thread_state_of::find()) {
  if (state_ == nullptr && context != nullptr) {
    try {
      state_ = &thread_state_of::get();
    } catch (...) {  // std::bad_alloc
    }
  }
  if (state_ == nullptr) return;
  previous_ = std::move(state_->context[static_cast<std::size_t>(kind)]);
  state_->context[static_cast<std::size_t>(kind)] = std::move(context);
}

context_scope::~context_scope() {
  if (state_ != nullptr) state_->context[static_cast<std::size_t>(kind_)] = std::move(previous_);
}

}  // namespace detail
}  // namespace ccalloc

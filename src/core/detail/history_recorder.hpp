// The history of one device (SPEC F14-F16, F18): the ring buffer of trace
// entries, the annotations, the compile-context stack, the user metadata,
// the trace trackers, and the contexts of live blocks and segments.
//
// Used by device_state (a member) and the public wrapper
// (device_caching_allocator.cpp, device_history.cpp). Everything is behind
// its own mutex, the innermost lock of the device (it never calls out while
// holding it), so the allocator may record while holding any of its locks.
//
// Hot path: active() is one relaxed atomic load; the allocator records only
// when it is true (history enabled or a tracker attached).
//
// Trackers run outside the allocator's locks: record() queues the entry for
// the recording thread (thread-local), and the public wrapper calls
// deliver_pending() when it has released its locks (tracker_delivery, an
// RAII guard, also on the exception path).
//
// Contexts: the wrapper calls the caller's recorder (outside the locks) and
// makes the result the thread's current context for the duration of the
// call (context_scope); entries recorded inside the core (segment_alloc,
// free_completed) take it from there. A context reference the recorder
// drops (an entry the ring buffer overwrites, a freed block's or segment's,
// those record_history clears) goes to the thread's list and is let go by
// deliver_pending, after the locks: a context's destructor may call into
// the allocator (history.hpp: trace_context).
#pragma once

#include "current_tag.hpp"

#include <ccalloc/core/history.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ccalloc::detail {

/// A thread's pending tracker entries and current contexts (history.cpp).
struct history_thread_state;

/// The newest `capacity` items, oldest first on read. Invariant:
/// items_.size() <= capacity_; when full, items_[next_] is the oldest.
template <class T>
class ring_buffer {
 public:
  /// Adds `item`; when full, the oldest item is moved to `dropped` (so that
  /// the caller destroys it after its lock: an entry's context may hold a
  /// caller's handle whose release runs the caller's code).
  void push(T item, T& dropped) {
    if (items_.size() < capacity_) {
      items_.push_back(std::move(item));
      return;
    }
    dropped = std::move(items_[next_]);
    items_[next_] = std::move(item);
    next_ = next_ + 1 == capacity_ ? 0 : next_ + 1;
  }
  /// Keeps the newest min(size, capacity) items, capacity >= 1; returns the
  /// items it drops (for the caller to destroy after its lock).
  std::vector<T> set_capacity(std::size_t capacity) {
    std::vector<T> ordered = items();
    std::vector<T> dropped;
    if (ordered.size() > capacity) {
      const auto keep_from = ordered.end() - static_cast<std::ptrdiff_t>(capacity);
      dropped.assign(std::make_move_iterator(ordered.begin()), std::make_move_iterator(keep_from));
      ordered.erase(ordered.begin(), keep_from);
    }
    std::swap(items_, ordered);  // the old items (copies of those kept, and the dropped) go with `ordered`
    next_ = 0;
    capacity_ = capacity;
    dropped.insert(dropped.end(), std::make_move_iterator(ordered.begin()), std::make_move_iterator(ordered.end()));
    return dropped;
  }
  /// Empties the buffer; returns its items (for the caller to destroy after its lock).
  std::vector<T> take() {
    std::vector<T> out;
    out.swap(items_);
    next_ = 0;
    return out;
  }
  [[nodiscard]] std::vector<T> items() const {
    std::vector<T> out;
    out.reserve(items_.size());
    for (std::size_t i = 0; i < items_.size(); ++i) out.push_back(items_[(next_ + i) % items_.size()]);
    return out;
  }
  void clear() {
    items_.clear();
    next_ = 0;
  }

 private:
  std::vector<T> items_;
  std::size_t next_ = 0;
  std::size_t capacity_ = 1;
};

/// Which public call a thread's current context belongs to: entries
/// recorded inside a malloc (segment_alloc, oom) take the malloc's, a
/// free_completed inside a free takes the free's (else the block's own).
enum class context_kind : std::uint8_t { malloc, free };

class history_recorder {
 public:
  explicit history_recorder(int device) : device_(device) {}
  ~history_recorder();
  history_recorder(const history_recorder&) = delete;
  history_recorder& operator=(const history_recorder&) = delete;

  /// History enabled or a tracker attached: the allocator must call record().
  [[nodiscard]] bool active() const noexcept { return active_.load(std::memory_order_relaxed); }
  [[nodiscard]] bool enabled() const noexcept { return enabled_.load(std::memory_order_relaxed); }
  [[nodiscard]] record_context when() const noexcept { return when_.load(std::memory_order_relaxed); }

  void configure(const history_options& options);
  void attach_tracker(trace_tracker tracker);

  /// Calls the recorder if history is enabled with `when` >= `level`, else
  /// returns null. Call outside the allocator's locks.
  [[nodiscard]] context_ptr gather(record_context level) const;

  /// Records one entry (stored unless skipped; queued for the trackers).
  /// `context` is kept only with record_context::alloc or more.
  void record(trace_entry_action action, std::uintptr_t addr, std::size_t size, stream_t stream,
              const context_ptr& context, tag_id tag = tls_current_tag);

  // The core's hooks, one out-of-line call each so that the hot functions
  // that contain them stay small (only called when active()).
  /// A block becomes free (free_block): forgets its context; the entry
  /// carries the free's context if inside a free, else the block's own,
  /// and the block's tag (not the tag in scope on the thread that
  /// completes it: events may complete inside another tag's malloc).
  /// Called before free_block merges it (b->ptr still the block's).
  [[gnu::cold]] void record_free_completed(std::uintptr_t addr, std::size_t requested_bytes, stream_t stream,
                                           tag_id tag);
  /// A segment came from the device (inside a malloc: its context).
  [[gnu::cold]] void record_segment_alloc(std::uintptr_t addr, std::size_t size, stream_t stream);
  /// A segment went back to the device: the entry carries the freeing
  /// call's context (inside a free), else the segment's own (PyTorch).
  [[gnu::cold]] void record_segment_free(std::uintptr_t addr, std::size_t size, stream_t stream);
  /// Pages of an expandable segment mapped (inside a malloc: its context) /
  /// unmapped; for the expandable-segment code (SPEC B7).
  [[gnu::cold]] void record_segment_map(std::uintptr_t addr, std::size_t size, stream_t stream);
  [[gnu::cold]] void record_segment_unmap(std::uintptr_t addr, std::size_t size, stream_t stream);
  /// PyTorch's oom entry: addr = the device's free bytes.
  [[gnu::cold]] void record_oom(std::size_t device_free_bytes, std::size_t requested_bytes, stream_t stream);

  // Contexts kept for snapshots (record_context::state or more).
  void remember_block(std::uintptr_t addr, context_ptr context);
  /// Forgets the block at `addr` and returns its context.
  context_ptr forget_block(std::uintptr_t addr);
  void remember_segment(std::uintptr_t addr, context_ptr context);
  /// Forgets the segment at `addr` and returns its context.
  context_ptr forget_segment(std::uintptr_t addr);
  [[nodiscard]] context_ptr block_context(std::uintptr_t addr) const;
  [[nodiscard]] context_ptr segment_context(std::uintptr_t addr) const;

  void record_annotation(std::vector<std::pair<std::string, std::string>> metadata);
  void push_compile_context(std::string context);
  void pop_compile_context();
  void set_user_metadata(std::string metadata);
  [[nodiscard]] std::string user_metadata() const;

  [[nodiscard]] std::vector<trace_entry> entries() const;
  [[nodiscard]] std::vector<annotation_entry> annotations() const;

  /// Delivers the entries the calling thread queued for trackers (of every
  /// device) and lets go of the context references it dropped under the
  /// allocator's locks. Never throws; call with no allocator lock held.
  static void deliver_pending() noexcept;
  /// The calling thread's current context of `kind` (see context_scope), or null.
  [[nodiscard]] static const context_ptr& current_context(context_kind kind) noexcept;

  /// The fork handlers' hold of the lock (base/detail/fork_handlers.hpp).
  void fork_lock() const noexcept { mutex_.lock(); }
  void fork_unlock() const noexcept { mutex_.unlock(); }

 private:
  void update_active() noexcept;  // [mutex_]
  void remember(std::unordered_map<std::uintptr_t, context_ptr>& map, std::uintptr_t addr, context_ptr context);
  [[nodiscard]] context_ptr find(const std::unordered_map<std::uintptr_t, context_ptr>& map,
                                 std::uintptr_t addr) const;

  const int device_;
  std::atomic<bool> active_{false};
  std::atomic<bool> enabled_{false};
  std::atomic<record_context> when_{record_context::never};

  mutable std::mutex mutex_;
  context_recorder recorder_;
  std::uint32_t skip_mask_ = 0;  // bit i: action i not stored
  ring_buffer<trace_entry> entries_;
  ring_buffer<annotation_entry> annotations_;
  std::vector<std::string> compile_contexts_;
  std::string user_metadata_;
  // Copy on write: a queued entry holds the list it must be delivered to.
  std::shared_ptr<const std::vector<trace_tracker>> trackers_;
  std::unordered_map<std::uintptr_t, context_ptr> block_contexts_;
  std::unordered_map<std::uintptr_t, context_ptr> segment_contexts_;
};

/// Makes `context` the calling thread's current context of `kind` while in scope.
class context_scope {
 public:
  context_scope(context_kind kind, context_ptr context) noexcept;
  ~context_scope();
  context_scope(const context_scope&) = delete;
  context_scope& operator=(const context_scope&) = delete;

 private:
  context_kind kind_;
  context_ptr previous_;
  history_thread_state* state_;  // the thread's, or null: nothing set (none made, or out of host memory)
};

/// On scope exit (normal or by exception), delivers the calling thread's
/// queued tracker entries and lets go of the context references it dropped
/// (deliver_pending). Construct it before taking any allocator lock.
class tracker_delivery {
 public:
  tracker_delivery() = default;
  ~tracker_delivery() { history_recorder::deliver_pending(); }
  tracker_delivery(const tracker_delivery&) = delete;
  tracker_delivery& operator=(const tracker_delivery&) = delete;
};

}  // namespace ccalloc::detail

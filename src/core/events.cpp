// Cross-stream use of a block (B4, X7): record_stream notes the other
// streams; the block's free records one event on each (insert_events), and
// the block returns to its pool once all of them have completed
// (process_events without blocking, synchronize_and_free_events waiting).
// The device's event pool (get_event) lives here too.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"
#include "detail/stats_sink.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ccalloc::detail {

namespace {
// Counts events taken off the queues and subtracts them from
// the pending count on scope exit, also when a backend call throws.
struct retired_events {
  std::atomic<std::size_t>& pending;
  std::size_t count = 0;
  ~retired_events() { pending.fetch_sub(count, std::memory_order_relaxed); }
};
}  // namespace

event_t event_queue::get_event() {
  if (!free_events_.empty()) {
    const event_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  return d_.backend().create_event(d_.device());
}

// B4: one event per stream that used the block; the block returns to the
// pool when all of them completed.
void event_queue::insert_events(block* b) {
  std::lock_guard device_lock(d_.device_mutex());
  insert_events_locked(b);
}

void event_queue::insert_events_locked(block* b) {
  std::vector<event_t> recorded;
  try {
    for (stream_t s : b->stream_uses) {
      const event_t e = get_event();
      recorded.push_back(e);
      d_.backend().record_event(d_.device(), e, s);
    }
  } catch (...) {
    for (event_t e : recorded) free_events_.push_back(e);
    throw;
  }
  for (std::size_t i = 0; i < recorded.size(); ++i) {
    const stream_t s = b->stream_uses[i];
    auto [at, made] = queue_of_.try_emplace(s, queues_.size());
    if (made) {
      try {
        queues_.push_back({s, {}});
      } catch (...) {
        queue_of_.erase(at);
        throw;
      }
    }
    queues_[at->second].events.push_back({recorded[i], b});
    ++b->event_count;
  }
  pending_event_count_.fetch_add(recorded.size(), std::memory_order_relaxed);
  b->stream_uses.clear();
}

// Pops the completed events of at most max_streams streams' queues, in
// order per stream (each queue is scanned up to its first pending event),
// and calls on_completed(block) for each. [device]. The pending count stays
// right if a query throws halfway.
template <class OnCompleted>
void event_queue::take_completed_events(OnCompleted on_completed, std::size_t max_streams,
                                        std::vector<block*>* room) {
  retired_events retired{pending_event_count_};
  const std::size_t n = queues_.size();
  const std::size_t visits = std::min(n, max_streams);
  // All queues: one pass from the first. Some: the next ones in turn, from
  // where the last call stopped, wrapping around once.
  const std::size_t start = visits == n || next_poll_ >= n ? 0 : next_poll_;
  std::size_t i = start;
  bool wrapped = false;
  for (std::size_t v = 0; v < visits; ++v) {
    if (i >= queues_.size()) {
      i = 0;
      wrapped = true;
    }
    auto& queue = queues_[i].events;
    while (!queue.empty()) {
      auto [e, b] = queue.front();
      if (!d_.backend().query_event(d_.device(), e)) break;
      // Room for the event in the pool (and the block in *room) first: out
      // of host memory, it stays queued (popped, it was lost, and its block
      // waited for ever).
      if (free_events_.size() == free_events_.capacity()) free_events_.reserve(free_events_.size() * 2 + 16);
      if (room != nullptr && room->size() == room->capacity()) room->reserve(room->size() * 2 + 16);
      queue.pop_front();
      free_events_.push_back(e);
      ++retired.count;
      on_completed(b);
    }
    if (!queue.empty()) {
      ++i;
      continue;
    }
    // The last queue moves to i: polled already when it was at or after
    // `start` and the walk has wrapped; else it is polled next.
    const std::size_t last = queues_.size() - 1;
    remove_queue(i);
    if (wrapped && last >= start) ++i;
  }
  next_poll_ = i;
}

void event_queue::remove_queue(std::size_t i) noexcept {
  queue_of_.erase(queues_[i].stream);
  if (i + 1 != queues_.size()) {
    queues_[i] = std::move(queues_.back());
    queue_of_.find(queues_[i].stream)->second = i;
  }
  queues_.pop_back();
}

// Returns blocks whose events completed, without blocking. The completed
// events are taken under the device lock; each block is then updated under
// its own stream's lock (never both: see the lock order).
void event_queue::process_events() {
  std::vector<block*> completed;
  std::exception_ptr failure;  // a failed query: blocks already taken are still returned
  {
    std::lock_guard device_lock(d_.device_mutex());
    try {
      take_completed_events([&](block* b) { completed.push_back(b); }, streams_polled_per_call, &completed);
    } catch (...) {
      failure = std::current_exception();
    }
    completions_in_flight_.fetch_add(completed.size(), std::memory_order_relaxed);
  }
  for (block* b : completed) {
    stream_state& ss = *b->pool->owner;
    {
      std::lock_guard lock(ss.mutex);
      if (--b->event_count == 0) {
        if (d_.history().active()) [[unlikely]]
          d_.history().record_free_completed(b->ptr, b->requested_bytes, b->stream, tag_of(*b));
        stats_sink sink(d_, ss);
        d_.free_block(b, sink.get(), false);
      }
    }
    completions_in_flight_.fetch_sub(1, std::memory_order_release);
  }
  if (failure) std::rethrow_exception(failure);
}

// One of b's events completed: at its last, b returns to its pool. [world]
void event_queue::free_after_last_event(block* b) {
  if (--b->event_count != 0) return;
  if (d_.history().active()) [[unlikely]]
    d_.history().record_free_completed(b->ptr, b->requested_bytes, b->stream, tag_of(*b));
  d_.free_block(b, d_.stats().values(), true);
}

void event_queue::process_events_locked(std::size_t max_streams) {
  take_completed_events([&](block* b) { free_after_last_event(b); }, max_streams, nullptr);
}

void event_queue::synchronize_and_free_events() {
  if (d_.pools().capture_underway()) return;  // waiting is not allowed while capturing
  ++d_.stats().values().num_sync_all_streams;
  retired_events retired{pending_event_count_};
  for (stream_events& q : queues_) {
    auto& queue = q.events;
    while (!queue.empty()) {
      auto [e, b] = queue.front();
      d_.backend().synchronize_event(d_.device(), e);
      queue.pop_front();
      free_events_.push_back(e);
      ++retired.count;
      free_after_last_event(b);
    }
  }
  queues_.clear();
  queue_of_.clear();
  next_poll_ = 0;
}

// X7: process_events returns blocks after dropping the device lock, so for a
// moment they are in no queue and not allocated: an OOM decided meanwhile
// would miss them, and a pause would release the pages under them. Waits
// (world lock released) until they are back; returns false when there were
// none (nothing new to try). Callers: the out-of-memory path, pause_tags.
bool event_queue::wait_for_completions_in_flight(world_lock& w) {
  if (completions_in_flight_.load(std::memory_order_acquire) == 0) return false;
  w.unlock();
  while (completions_in_flight_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  w.lock();
  d_.stats().publish_all_pending(w);
  return true;
}

bool event_queue::count_matches() const noexcept {
  std::size_t queued = 0;
  for (const stream_events& q : queues_) queued += q.events.size();
  if (queue_of_.size() != queues_.size()) return false;
  for (std::size_t i = 0; i < queues_.size(); ++i) {
    const auto at = queue_of_.find(queues_[i].stream);
    if (at == queue_of_.end() || at->second != i) return false;
  }
  return queued == pending_event_count_.load();
}

void event_queue::destroy_all(const std::vector<event_t>& more) noexcept {
  for (stream_events& q : queues_)
    for (auto& [e, b] : q.events) free_events_.push_back(e);
  free_events_.insert(free_events_.end(), more.begin(), more.end());
  for (event_t e : free_events_) {
    try {
      d_.backend().destroy_event(d_.device(), e);
    } catch (...) {  // teardown: the event stays with a device that refuses; nothing to report to
    }
  }
}

}  // namespace ccalloc::detail

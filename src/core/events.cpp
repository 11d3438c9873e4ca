// Cross-stream use of a block (B4, X7): record_stream notes the other
// streams; the block's free records one event on each (insert_events), and
// the block returns to its pool once all of them have completed
// (process_events without blocking, synchronize_and_free_events waiting).
// The device's event pool (get_event) lives here too.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"
#include "detail/stats_sink.hpp"

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
// pending_event_count_ on scope exit, also when a backend call throws.
struct retired_events {
  std::atomic<std::size_t>& pending;
  std::size_t count = 0;
  ~retired_events() { pending.fetch_sub(count, std::memory_order_relaxed); }
};
}  // namespace

// A use on a stream that is not live (destroyed, never created, another
// device's) is refused: the block's free would record an event on it, fail
// and keep the block. The block's own stream is ignored below, gone or not.
void device_state::check_recorded_stream(stream_t stream) const {
  // One message whether or not the allocator still has the stream's state
  // (a destroyed stream's goes once its memory moved on: forget_gone_streams).
  const auto known = streams_.find(stream);
  if (known != streams_.end() && !known->second->gone) return;
  if (backend_.is_stream(device_, stream)) return;  // a destroyed handle made again is a new stream
  throw invalid_argument_error("ccalloc: record_stream on stream " + std::to_string(stream) + " of device " +
                               std::to_string(device_) +
                               ", which is not a live stream of that device (never created, destroyed, or of "
                               "another device)");
}

void device_state::record_stream(block* b, stream_t stream) {
  if (stream != b->stream) {  // the block's stream is fixed while it is allocated
    std::lock_guard registry(registry_mutex_);
    check_recorded_stream(stream);
  }
  std::lock_guard lock(b->pool->owner->mutex);
  if (b->seg->paused) [[unlikely]]  // written under the world lock, which holds this one
    throw invalid_argument_error("ccalloc: record_stream of the block at " + std::to_string(b->ptr) +
                                 " on device " + std::to_string(device_) + ": its tag '" +
                                 tag_name(tag_of(*b->seg)) +
                                 "' is paused (its pages are released; no stream may use it until resume)");
  if (stream == b->stream) return;
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end())
    b->stream_uses.push_back(stream);
  b->reuse_version = no_reuse_version;  // its free waits for events: never parked
}

// stream_destroyed (gone) and stream_created (not gone). A stream that
// goes: its queued work completes first (synchronize_stream, before anything
// changes), so its fences, every free on it so far and every use of a live
// block on it (record_stream) are complete: the uses are dropped (their
// frees record nothing on it), and frees of its own blocks fence nothing.
void device_state::set_stream_gone(stream_t stream, bool gone) {
  if (!gone) {  // nothing to do (the usual case: a new handle) without the world lock
    std::lock_guard lock(registry_mutex_);
    const auto it = streams_.find(stream);
    if (it == streams_.end() || !it->second->gone) return;
  }
  world_lock w(*this);
  if (gone) {
    backend_.synchronize_stream(device_, stream);  // may throw: nothing changed
    for (auto& [base, seg] : segments_)
      for (block* b = seg->head; b != nullptr; b = b->next)
        std::erase(b->stream_uses, stream);
  }
  const auto it = streams_.find(stream);
  if (it == streams_.end()) return;
  stream_state& ss = *it->second;
  if (ss.gone != gone) gone ? ++gone_streams_ : --gone_streams_;
  ss.gone = gone;
  if (!gone) return;
  ss.fences.drop_outstanding([&](event_t e) { free_events_.push_back(e); });
  ss.fences.all_completed(ss.free_seq);
  forget_thread_stream();  // this thread's next malloc on it finds it gone
}

// A gone stream's state goes once it holds no segment: nothing refers to it
// then (blocks belong to segments; parked blocks count as allocated; its
// fences went when it was destroyed; a retired page names the stream that
// freed it, and such a page keeps its segment, so none names it unless the
// segment moved: checked).
void device_state::forget_gone_streams(world_lock& w) noexcept {
  if (gone_streams_ == 0) [[likely]]
    return;
  const auto names_retired = [&](const stream_state* ss) {
    if (expandable_.retired_pages() == 0) return false;
    for (const auto& [base, seg] : segments_)
      for (const segment::retired_page& r : seg->pages.retired())
        if (r.owner == ss) return true;
    return false;
  };
  bool forgot = false;
  for (std::size_t i = 0; i < w.streams().size();) {
    stream_state* ss = w.streams()[i];
    if (!ss->gone || ss->segments != 0 || !ss->fences.empty() || names_retired(ss)) {
      ++i;
      continue;
    }
    publish_pending_stats(stats_, *ss);
    w.drop(ss);  // streams()[i] is the next one now
    --gone_streams_;
    streams_.erase(ss->stream);  // deletes the state
    forgot = true;
  }
  if (!forgot) return;
  stream_cache_key_.store(fresh_state_key(), std::memory_order_relaxed);
}

event_t device_state::get_event() {
  if (!free_events_.empty()) {
    const event_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  return backend_.create_event(device_);
}

// B4: one event per stream that used the block; the block returns to the
// pool when all of them completed.
void device_state::insert_events(block* b) {
  std::lock_guard device_lock(device_mutex_);
  insert_events_locked(b);
}

void device_state::insert_events_locked(block* b) {
  std::vector<event_t> recorded;
  try {
    for (stream_t s : b->stream_uses) {
      const event_t e = get_event();
      recorded.push_back(e);
      backend_.record_event(device_, e, s);
    }
  } catch (...) {
    for (event_t e : recorded) free_events_.push_back(e);
    throw;
  }
  for (std::size_t i = 0; i < recorded.size(); ++i) {
    pending_events_[b->stream_uses[i]].emplace_back(recorded[i], b);
    ++b->event_count;
  }
  pending_event_count_.fetch_add(recorded.size(), std::memory_order_relaxed);
  b->stream_uses.clear();
}

// Pops every completed event, in order per stream (each queue is scanned up
// to its first pending event), and calls on_completed(block) for each.
// [device]. pending_event_count_ stays right if a query throws halfway.
template <class OnCompleted>
void device_state::take_completed_events(OnCompleted on_completed) {
  retired_events retired{pending_event_count_};
  for (auto it = pending_events_.begin(); it != pending_events_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      auto [e, b] = queue.front();
      if (!backend_.query_event(device_, e)) break;
      // Room for the event in the pool first: out of host memory, it stays
      // queued (popped, it was lost, and its block waited for ever).
      if (free_events_.size() == free_events_.capacity()) free_events_.reserve(free_events_.size() * 2 + 16);
      queue.pop_front();
      free_events_.push_back(e);
      ++retired.count;
      on_completed(b);
    }
    it = queue.empty() ? pending_events_.erase(it) : std::next(it);
  }
}

// Returns blocks whose events completed, without blocking. The completed
// events are taken under the device lock; each block is then updated under
// its own stream's lock (never both: see the lock order).
void device_state::process_events() {
  std::vector<block*> completed;
  std::exception_ptr failure;  // a failed query: blocks already taken are still returned
  {
    std::lock_guard device_lock(device_mutex_);
    completed.reserve(pending_event_count_.load(std::memory_order_relaxed));  // no allocation once events are taken
    try {
      take_completed_events([&](block* b) { completed.push_back(b); });
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
        if (history_.active()) [[unlikely]]
          history_.record_free_completed(b->ptr, b->requested_bytes, b->stream, tag_of(*b->seg));
        stats_sink sink(*this, ss);
        free_block(b, sink.get(), false);
      }
    }
    completions_in_flight_.fetch_sub(1, std::memory_order_release);
  }
  if (failure) std::rethrow_exception(failure);
}

void device_state::process_events_locked() {
  take_completed_events([&](block* b) {
    if (--b->event_count != 0) return;
    if (history_.active()) [[unlikely]]
      history_.record_free_completed(b->ptr, b->requested_bytes, b->stream, tag_of(*b->seg));
    free_block(b, stats_, true);
  });
}

void device_state::synchronize_and_free_events() {
  if (pools_.capture_underway()) return;  // waiting is not allowed while capturing
  ++stats_.num_sync_all_streams;
  retired_events retired{pending_event_count_};
  for (auto& [stream, queue] : pending_events_) {
    while (!queue.empty()) {
      auto [e, b] = queue.front();
      backend_.synchronize_event(device_, e);
      queue.pop_front();
      free_events_.push_back(e);
      ++retired.count;
      if (--b->event_count != 0) continue;
      if (history_.active()) [[unlikely]]
        history_.record_free_completed(b->ptr, b->requested_bytes, b->stream, tag_of(*b->seg));
      free_block(b, stats_, true);
    }
  }
  pending_events_.clear();
}

// X7: process_events returns blocks after dropping the device lock; an OOM
// decided meanwhile would miss them. Waits (world lock released) until they
// are back; returns false when there were none (nothing new to try).
bool device_state::wait_for_completions_in_flight(world_lock& w) {
  if (completions_in_flight_.load(std::memory_order_acquire) == 0) return false;
  w.unlock();
  while (completions_in_flight_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  w.lock();
  publish_all_pending_stats(w);
  return true;
}

}  // namespace ccalloc::detail

// The events of one device (SPEC B4, X7): the pool of created events, and
// the events recorded at the free of a block used on other streams, queued
// per stream in order, until they complete and the block returns to its
// pool. Owns the pool, the queues and their counters. Reaches the device's
// blocks (free_block), statistics and history through device_state's
// members (a completed event frees a block). The pool and the queues
// are guarded by the device lock (device_mutex_), or the world lock; the
// methods say which they need. pending_count() is read without a lock.
//
// Polling cost: a call polls at most streams_polled_per_call streams'
// queues, each up to its first pending event, continuing from where the
// last call stopped (round robin). With up to that many streams holding
// pending events every call polls all of them, as PyTorch's allocator
// does; with more (a program that frees thousands of blocks while their
// record_stream work is still queued), an event that has completed is
// found within ceil(streams / streams_polled_per_call) calls, and a malloc
// costs a bounded number of queries instead of one per such stream. A
// block found late only stays cached in its pool a little longer: before
// an out-of-memory error the ladder waits for every event
// (synchronize_and_free_events).
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include "block.hpp"

#include <atomic>
#include <cstddef>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ccalloc::detail {

class device_state;
class world_lock;

class event_queue {
 public:
  explicit event_queue(device_state& d) noexcept : d_(d) {}
  event_queue(const event_queue&) = delete;
  event_queue& operator=(const event_queue&) = delete;

  // The event pool: a reusable event, created when the pool has none; and
  // an event back to the pool. [device] or [world]
  event_t get_event();
  void give_event(event_t e) { free_events_.push_back(e); }

  // B4: one event recorded on each stream that used b (its stream_uses,
  // then cleared); b returns to its pool when all of them have completed.
  // On a throw nothing is recorded and stream_uses is kept.
  void insert_events(block* b);                                                // [stream] takes device
  void insert_events_locked(block* b);                                        // [stream, device]
  // Streams whose queues one call of process_events polls at most; and
  // the argument that polls them all.
  static constexpr std::size_t streams_polled_per_call = 64;
  static constexpr std::size_t all_streams = ~std::size_t{0};
  // Returns the blocks whose events completed, without blocking, from at
  // most max_streams streams' queues (the next ones in turn). [none]
  // takes device, then (device released) each block's stream
  void process_events();
  void process_events_locked(std::size_t max_streams = streams_polled_per_call);  // [world]
  // Waits for every queued event (not while a capture is underway). [world]
  void synchronize_and_free_events();
  // X7: process_events returns blocks after dropping the device lock; an
  // OOM decided meanwhile would miss them. Waits (world lock released)
  // until they are back; false when there were none. [world] drops it while waiting
  bool wait_for_completions_in_flight(world_lock& w);

  // Events queued: the fast path's test (a relaxed load). [none]
  [[nodiscard]] std::size_t pending_count() const noexcept {
    return pending_event_count_.load(std::memory_order_relaxed);
  }
  // Calls f(event, block) for each queued event. [device] or [world]
  template <class F>
  void for_each_pending(F f) const {
    for (const stream_events& q : queues_)
      for (const auto& [e, b] : q.events) f(e, b);
  }
  // pending_count() equals the events queued (check_invariants). [world]
  [[nodiscard]] bool count_matches() const noexcept;
  // Teardown: every queued event, then `more`, into the pool, and every
  // event of the pool destroyed; failures ignored. The device's destructor
  void destroy_all(const std::vector<event_t>& more) noexcept;

 private:
  // A first-in first-out queue of (event, block) on one vector: popping
  // moves a head index, and the vector is emptied (its capacity kept) when
  // the head reaches its end, or compacted when the popped front is most of
  // it. Lighter than a std::deque (which allocates about 600 bytes at its
  // first element and copies on a vector's growth): a stream with one
  // pending event costs one 16-byte allocation.
  class event_fifo {
   public:
    using entry = std::pair<event_t, block*>;
    [[nodiscard]] bool empty() const noexcept { return head_ == items_.size(); }
    [[nodiscard]] std::size_t size() const noexcept { return items_.size() - head_; }
    [[nodiscard]] const entry& front() const noexcept { return items_[head_]; }
    void push_back(entry e) { items_.push_back(e); }
    void pop_front() noexcept {
      if (++head_ == items_.size()) {
        items_.clear();
        head_ = 0;
      } else if (head_ >= 64 && head_ * 2 >= items_.size()) {
        items_.erase(items_.begin(), items_.begin() + std::ptrdiff_t(head_));
        head_ = 0;
      }
    }
    [[nodiscard]] std::vector<entry>::const_iterator begin() const noexcept {
      return items_.begin() + std::ptrdiff_t(head_);
    }
    [[nodiscard]] std::vector<entry>::const_iterator end() const noexcept { return items_.end(); }

   private:
    std::vector<entry> items_;
    std::size_t head_ = 0;  // the first entry not yet popped
  };
  // The events recorded on one stream at free time, in order.
  struct stream_events {
    stream_t stream;
    event_fifo events;
  };
  // Pops the completed events of at most max_streams streams' queues (all
  // of them from the first when that is all of them; else the next ones in
  // turn from next_poll_), in order per stream (each queue is scanned up to
  // its first pending event), and calls on_completed(block) for each, after
  // making room for one more in *room when room is given. [device].
  // pending_count() stays right if a query throws halfway.
  template <class OnCompleted>
  void take_completed_events(OnCompleted on_completed, std::size_t max_streams, std::vector<block*>* room);
  // Drops queues_[i] (empty): the last queue takes its place. [device]
  void remove_queue(std::size_t i) noexcept;
  // One of b's events completed: at its last, b returns to its pool. [world]
  void free_after_last_event(block* b);

  device_state& d_;
  // Events recorded at free time: one queue per stream with pending events
  // (one left empty by a failed wait is dropped at the next poll), and
  // where each stream's queue is.
  std::vector<stream_events> queues_;
  std::unordered_map<stream_t, std::size_t> queue_of_;
  std::size_t next_poll_ = 0;  // the queue a partial poll starts from
  std::atomic<std::size_t> pending_event_count_{0};  // events in pending_
  std::vector<event_t> free_events_;  // the pool: created and reusable
  // Blocks whose completed events process_events took but has not yet
  // returned to their pools (it drops the device lock in between).
  std::atomic<std::size_t> completions_in_flight_{0};
};

}  // namespace ccalloc::detail

// Page fences of one stream: when the pages of blocks freed on the stream
// may change hands (be unmapped, mapped elsewhere, taken by another
// stream). cuMemUnmap does not wait for queued work, so a block's pages
// move only once an event recorded on its stream after its free has
// completed.
//
// The stream numbers its frees (stream_state::free_seq; each freed block
// keeps its number in block::free_seq). A fence is an event recorded on the
// stream with the count it covers: every free numbered up to `covers` has
// no work of the stream left once the event has completed.
//
//   record     records a fence covering the frees up to a count (at most
//              max_outstanding outstanding: past that the newest is recorded
//              again, covering more; later fences complete after earlier
//              ones, so the oldest still tells first)
//   poll       takes the completed fences, oldest first, without blocking
//   completed  whether a free's fence has completed (poll; record one first
//              where none covers it and the stream may be recorded on)
//   covering   the oldest outstanding fence covering a free (for a
//              device-side wait by another stream)
//   wait       blocks until every free so far is covered by a completed
//              fence, under a named reason, counted per reason
//
// Invariant (check): at most max_outstanding fences outstanding, their
// counts non-decreasing, oldest first.
//
// Not thread-safe: [world], except record from free (stream lock + device
// lock; device_fences::fence_before_free).
#pragma once

#include <ccalloc/base/types.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>

namespace ccalloc::detail {

class page_fences {
 public:
  struct fence {
    event_t event;
    std::uint64_t covers;  // the free count it covers
  };
  static constexpr std::size_t max_outstanding = 4;

  /// Why the allocator blocked on a fence (device_stats counts them all in
  /// num_device_synchronizations; waits() counts them by reason).
  enum class wait_reason : unsigned char {
    reclaim_pages,       // free pages needed now: out of memory, the cap, emptyCache
    deferred_unmap,      // a retired page's old mapping must go before its address is reused
    adopt_segment,       // another stream's whole cached segment taken over
    garbage_collection,  // a free block's pages given back by garbage collection
  };
  static constexpr std::size_t wait_reason_count = 4;

  /// What the fences need of the allocator: its event pool and the device.
  class device {
   public:
    virtual event_t take_event() = 0;           // from the pool, or a new one
    virtual void give_event(event_t e) = 0;     // back to the pool
    virtual bool query(event_t e) = 0;          // completed? never blocks
    virtual void record(event_t e, stream_t stream) = 0;
    virtual void synchronize(event_t e) = 0;    // blocks until e completed
    virtual void synchronize_device() = 0;      // blocks until all work completed

   protected:
    ~device() = default;
  };

  /// No fence outstanding.
  [[nodiscard]] bool empty() const noexcept { return outstanding_.empty(); }
  /// Frees numbered up to this have no work of the stream left.
  [[nodiscard]] std::uint64_t completed_up_to() const noexcept { return completed_; }
  /// The count the newest fence covers, completed or not (completed_up_to()
  /// when none is outstanding).
  [[nodiscard]] std::uint64_t recorded_up_to() const noexcept {
    return outstanding_.empty() ? completed_ : outstanding_.back().covers;
  }
  [[nodiscard]] const std::deque<fence>& outstanding() const noexcept { return outstanding_; }
  /// Blocking waits so far, by reason.
  [[nodiscard]] std::uint64_t waits(wait_reason why) const noexcept { return waits_[static_cast<std::size_t>(why)]; }

  /// Takes the completed fences, oldest first, without blocking.
  void poll(device& d) {
    while (!outstanding_.empty()) {
      const fence f = outstanding_.front();
      if (!d.query(f.event)) break;
      outstanding_.pop_front();
      d.give_event(f.event);
      completed_ = completed_ < f.covers ? f.covers : completed_;
    }
  }

  /// Records a fence on `stream` covering frees up to `covers`. The stream
  /// must exist: a backend error from the record is the caller's, and
  /// nothing changed then (a new event goes back to the pool).
  void record(device& d, stream_t stream, std::uint64_t covers) {
    if (outstanding_.size() >= max_outstanding) {
      d.record(outstanding_.back().event, stream);
      outstanding_.back().covers = covers;
      return;
    }
    const event_t e = d.take_event();
    try {
      d.record(e, stream);
    } catch (...) {  // rethrown: only the event goes back to the pool
      d.give_event(e);
      throw;
    }
    outstanding_.push_back({e, covers});
  }

  /// Whether free `free_seq` has no work of the stream left: polls, and
  /// where no fence covers it and `may_record`, records one covering
  /// `frees_so_far` and polls again. Never blocks.
  bool completed(device& d, stream_t stream, std::uint64_t free_seq, std::uint64_t frees_so_far, bool may_record) {
    if (free_seq <= completed_) return true;
    poll(d);
    if (free_seq <= completed_) return true;
    if (recorded_up_to() < free_seq && may_record) {
      record(d, stream, frees_so_far);
      poll(d);
    }
    return free_seq <= completed_;
  }

  /// The oldest outstanding fence covering free `free_seq`, recording one
  /// covering `frees_so_far` first where none does and `may_record`;
  /// nullopt otherwise.
  std::optional<fence> covering(device& d, stream_t stream, std::uint64_t free_seq, std::uint64_t frees_so_far,
                                bool may_record) {
    if (recorded_up_to() < free_seq) {
      if (!may_record) return std::nullopt;
      record(d, stream, frees_so_far);
    }
    for (const fence& f : outstanding_)
      if (f.covers >= free_seq) return f;
    return std::nullopt;
  }

  /// Blocks until every free up to `frees_so_far` is covered by a completed
  /// fence: the newest fence where it covers them, else one recorded now
  /// where `may_record`, else the whole device. Returns whether it blocked
  /// (counted under `why`).
  bool wait(device& d, stream_t stream, std::uint64_t frees_so_far, bool may_record, wait_reason why) {
    poll(d);
    if (completed_ >= frees_so_far) return false;
    ++waits_[static_cast<std::size_t>(why)];
    if (recorded_up_to() >= frees_so_far) {
      d.synchronize(outstanding_.back().event);
    } else if (may_record) {
      record(d, stream, frees_so_far);
      d.synchronize(outstanding_.back().event);
    } else {
      d.synchronize_device();
      completed_ = frees_so_far;
    }
    poll(d);
    return true;
  }

  /// The stream is gone (destroyed): its work has completed. Every free up
  /// to `frees_so_far` is safe.
  void all_completed(std::uint64_t frees_so_far) noexcept { completed_ = frees_so_far; }

  /// Gives every outstanding fence's event to `give` and forgets them.
  template <class Give>
  void drop_outstanding(Give give) {
    for (const fence& f : outstanding_) give(f.event);
    outstanding_.clear();
  }

  /// The invariant above.
  [[nodiscard]] bool check() const noexcept {
    if (outstanding_.size() > max_outstanding) return false;
    std::uint64_t last = 0;
    for (const fence& f : outstanding_) {
      if (f.covers < last) return false;
      last = f.covers;
    }
    return true;
  }

 private:
  std::deque<fence> outstanding_;
  std::uint64_t completed_ = 0;
  std::array<std::uint64_t, wait_reason_count> waits_{};
};

}  // namespace ccalloc::detail

// How a block's free_requested .. free_completed gap holds on the device
// during a replay (private to src/replay/): the gap_model interface, the
// side streams that stand in for the program's other streams, and
// clock_gaps, the model on the simulated device's virtual clock. The other
// model, gate_gaps (host-controlled gates; a backend decorator), is in
// gate_gaps.hpp. Used by replay.cpp's event loop only.
#pragma once

#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/types.hpp>

#include <cstdint>
#include <functional>
#include <queue>
#include <set>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ccalloc::replay_detail {

// The trace index of a gap that never ends before the trace does.
constexpr std::uint64_t never = ~std::uint64_t{0};

// How a gap holds on the device: work queued on a side stream before the
// block is recorded on it and freed lasts until the gap's end.
class gap_model {
 public:
  virtual ~gap_model() = default;
  /// Trace event `index` is next: the gaps ending at or before it are over.
  virtual void advance_to(std::uint64_t index) = 0;
  /// True when `side` has no gap going on at trace index `index`.
  [[nodiscard]] virtual bool idle(stream_t side, std::uint64_t index) = 0;
  [[nodiscard]] virtual stream_t create_side_stream() = 0;
  /// Work queued on `side` from now on waits until trace index `end`.
  virtual void begin_gap(stream_t side, std::uint64_t end) = 0;
  /// The device runs behind the host: work queued on trace stream `stream`
  /// from now on runs until trace index `until` (replay_options::
  /// device_lag_events). Only the virtual clock models it.
  virtual void run_behind(stream_t stream, std::uint64_t until) = 0;
  /// The recording's time of the event about to be replayed (microseconds
  /// since the trace began, passes laid end to end): the host clock the
  /// allocator's time budgets read (device_backend::host_time_us) follows
  /// it plus the modelled cost of the virtual-memory calls made, so a replay
  /// sees the time the program took, on the simulated device and on a GPU.
  virtual void set_host_time_us(std::uint64_t us) = 0;
  /// After each event: throws if the replay cannot go on.
  virtual void check() {}
  /// The replay is over: every gap ends (before the allocator's memory goes back).
  virtual void end_all() = 0;
  /// After the allocator is gone: releases the side streams. Never throws.
  virtual void release() noexcept = 0;
  /// Whether the replay destroys each trace stream after its last event
  /// (replay_events), idle() telling when its work has run: on the virtual
  /// clock, where the trace's stream ids are the device's own streams.
  [[nodiscard]] virtual bool ends_trace_streams() const noexcept { return false; }
};

// Side streams standing in for the program's other streams during gaps; one
// is reused once its gap is over: the first one made that is idle, as a scan
// of every side stream would find, without the scan (N overlapping gaps
// would cost N^2 idle() calls). A stream whose last gap ends after `index`
// cannot be idle (the model's end is at least the one noted here), so only
// the streams whose noted end has passed are asked, lowest first.
class side_stream_pool {
 public:
  /// `trace_streams`: stream ids the trace itself uses; a side stream must
  /// differ from all of them (on the simulated device the trace's ids are used
  /// as they are, and a created stream could carry the same number).
  side_stream_pool(gap_model& gaps, std::unordered_set<stream_t> trace_streams)
      : gaps_(gaps), trace_streams_(std::move(trace_streams)) {}
  /// A side stream idle at trace index `index` (made if none is) for a gap
  /// that will end at `end`. `index` never decreases from call to call.
  stream_t acquire(std::uint64_t index, std::uint64_t end) {
    while (!busy_.empty() && busy_.top().first <= index) {
      maybe_idle_.insert(busy_.top().second);
      busy_.pop();
    }
    std::size_t chosen = streams_.size();
    for (const std::size_t i : maybe_idle_) {
      if (gaps_.idle(streams_[i], index)) {
        chosen = i;
        break;
      }
    }
    if (chosen == streams_.size()) {
      stream_t s = gaps_.create_side_stream();
      while (trace_streams_.count(s) != 0) s = gaps_.create_side_stream();  // skip a clashing id
      streams_.push_back(s);
    } else {
      maybe_idle_.erase(chosen);
    }
    busy_.emplace(end, chosen);
    return streams_[chosen];
  }

 private:
  using noted_end = std::pair<std::uint64_t, std::size_t>;  // (end of its last gap, index in streams_)
  gap_model& gaps_;
  std::unordered_set<stream_t> trace_streams_;
  std::vector<stream_t> streams_;  // in the order they were made
  std::priority_queue<noted_end, std::vector<noted_end>, std::greater<>> busy_;  // gaps not yet past
  std::set<std::size_t> maybe_idle_;  // streams whose noted gap is past, in the order they were made
};

// Gaps as work on the simulated device's virtual clock (one unit per event).
class clock_gaps final : public gap_model {
 public:
  explicit clock_gaps(sim_backend& sim) : sim_(sim) {}
  void advance_to(std::uint64_t index) override { sim_.advance_to(index); }
  bool idle(stream_t side, std::uint64_t index) override { return sim_.busy_until(0, side) <= index; }
  stream_t create_side_stream() override {
    side_streams_.push_back(sim_.create_stream(0));
    return side_streams_.back();
  }
  void begin_gap(stream_t side, std::uint64_t end) override { sim_.enqueue_work(0, side, end); }
  void run_behind(stream_t stream, std::uint64_t until) override { sim_.enqueue_work(0, stream, until); }
  void set_host_time_us(std::uint64_t us) override { sim_.set_host_time_us(us); }
  void end_all() override {}
  [[nodiscard]] bool ends_trace_streams() const noexcept override { return true; }
  void release() noexcept override {
    for (stream_t s : side_streams_) try {
        sim_.destroy_stream(0, s);
      } catch (...) {
      }
    side_streams_.clear();
  }

 private:
  sim_backend& sim_;
  std::vector<stream_t> side_streams_;
};

}  // namespace ccalloc::replay_detail

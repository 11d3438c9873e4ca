// gate_gaps: the gap model of host-controlled gates, a device_backend
// decorator (private to src/replay/; used by replay.cpp's replay_with_gates).
#pragma once

#include "gap_model.hpp"

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/backend/host_clock.hpp>
#include <ccalloc/base/errors.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <queue>
#include <set>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ccalloc::replay_detail {

// Gaps as host-controlled gates, on any backend with capabilities().gates.
//
// It is also the backend the allocator sees (device 0 = the real backend's
// `device`): every call is forwarded, except where a closed gate would
// deadlock the host on a real device --
//  - segment_free while a gap is open is deferred until none is (cudaFree
//    waits for the whole device, gated streams included);
//  - synchronize_event / _stream / _device on work behind a closed gate first
//    ends the gaps up to that work's end: the host waited for it, as the
//    simulated clock jumps ahead in synchronize_*.
// Its own clock (now_) is the trace index, pushed ahead by those waits like
// the simulated device's, so side streams are reused exactly when the
// simulated replay reuses them.
//
// Watchdog (with `watchdog`): if one backend call has been blocked for
// watchdog_limit while a gate is closed, a thread opens every gate, so that
// the call returns, and the replay then stops with an error naming it.
class gate_gaps final : public device_backend, public gap_model {
 public:
  static constexpr std::chrono::seconds watchdog_limit{10};

  gate_gaps(std::shared_ptr<device_backend> inner, int device, std::size_t gates_needed, bool watchdog)
      : inner_(std::move(inner)), device_(device) {
    // Make the gates now, while none is closed (allocating pinned memory may
    // wait for the device); the backend reuses them afterwards.
    std::vector<gate_t> made;
    try {
      for (std::size_t i = 0; i < gates_needed; ++i) made.push_back(inner_->create_gate(device_));
    } catch (...) {
      for (gate_t g : made) discard_gate(g);
      throw;
    }
    for (gate_t g : made) discard_gate(g);
    if (watchdog) watchdog_ = std::thread([this] { watch(); });
  }
  ~gate_gaps() override {
    release();
    if (watchdog_.joinable()) {
      {
        std::lock_guard lock(watchdog_mutex_);
        stop_ = true;
      }
      watchdog_cv_.notify_all();
      watchdog_.join();
    }
  }
  gate_gaps(const gate_gaps&) = delete;
  gate_gaps& operator=(const gate_gaps&) = delete;

  /// A stream for a trace stream (released with the side streams).
  stream_t create_trace_stream() {
    owned_streams_.push_back(call("create_stream", [&] { return inner_->create_stream(device_); }));
    return owned_streams_.back();
  }

  // ---- gap_model ---------------------------------------------------------------

  void advance_to(std::uint64_t index) override { reach(index); }
  bool idle(stream_t side, std::uint64_t index) override {
    auto it = side_end_.find(side);
    return std::max(now_, it == side_end_.end() ? 0 : it->second) <= index;
  }
  stream_t create_side_stream() override {
    const stream_t s = call("create_stream", [&] { return inner_->create_stream(device_); });
    owned_streams_.push_back(s);
    return s;
  }
  // replay_trace refuses device_lag_events with gates (a GPU has its own lag).
  void run_behind(stream_t, std::uint64_t) override {
    throw invalid_argument_error("replay: device_lag_events models a simulated device only");
  }
  void begin_gap(stream_t side, std::uint64_t end) override {
    const gate_t g = call("create_gate", [&] { return inner_->create_gate(device_); });
    try {
      call("wait_gate", [&] { inner_->wait_gate(device_, side, g); });
    } catch (...) {
      discard_gate(g);
      throw;
    }
    {
      std::lock_guard lock(gaps_mutex_);
      add_open({end, side, g, next_seq_++});
    }
    auto& e = side_end_[side];
    e = std::max(e, end);
    // A gap that ends at or before the clock (pushed ahead by a wait) ends at
    // the next advance_to, before the next event, as on the simulated device.
  }
  void set_host_time_us(std::uint64_t us) override { host_clock_.set_base_us(us); }
  void check() override {
    if (tripped_.load(std::memory_order_acquire))
      throw error("replay on '" + inner_->name() + "': " + tripped_call_ + " did not return within " +
                  std::to_string(watchdog_limit.count()) +
                  " s while side streams waited on closed gates (the device waits for them there: a "
                  "deadlock); every gate was opened to get it back and the replay stopped");
  }
  void end_all() override {
    reach(never);
    flush_deferred_frees();
  }
  void release() noexcept override {
    try {
      end_all();
    } catch (...) {
      // Best effort: open what is left so nothing stays blocked.
      {
        std::lock_guard lock(gaps_mutex_);
        for (const auto& [seq, g] : open_) try {
            inner_->open_gate(device_, g.gate);
          } catch (...) {  // best effort, as above
          }
        open_.clear();
        by_end_ = {};
        by_stream_.clear();
      }
      try {
        flush_deferred_frees();
      } catch (...) {  // best effort, as above
      }
    }
    for (stream_t s : owned_streams_) try {
        inner_->synchronize_stream(device_, s);
        inner_->destroy_stream(device_, s);
      } catch (...) {  // best effort, as above
      }
    owned_streams_.clear();
  }

  // ---- device_backend: forwarded to the real one (device 0 -> device_) ---------

  std::string name() const override { return inner_->name(); }
  std::optional<std::uint64_t> host_time_us() const override { return host_clock_.now_us(); }
  // No stream_wait_event: a stream made to wait on an event recorded in an
  // open gap would wait behind its gate, unknown to the synchronize_*
  // calls above that end the gaps first (a deadlock on a real device).
  backend_capabilities capabilities() const override {
    backend_capabilities c = inner_->capabilities();
    c.stream_wait = false;
    return c;
  }
  int device_count() const override { return 1; }
  int current_device() const override { return 0; }
  void set_device(int device) override { inner_->set_device(map(device)); }
  memory_info mem_get_info(int device) const override { return inner_->mem_get_info(map(device)); }

  void* segment_malloc(int device, std::size_t size_bytes) override {
    return call("segment_malloc", [&] { return inner_->segment_malloc(map(device), size_bytes); });
  }
  void segment_free(int device, void* ptr) override {
    const int d = map(device);
    if (!open_.empty()) {
      deferred_frees_.push_back(ptr);
      return;
    }
    flush_deferred_frees();
    call("segment_free", [&] { inner_->segment_free(d, ptr); });
  }

  stream_t create_stream(int device) override {
    return call("create_stream", [&] { return inner_->create_stream(map(device)); });
  }
  void destroy_stream(int device, stream_t stream) override {
    call("destroy_stream", [&] { inner_->destroy_stream(map(device), stream); });
  }
  bool is_stream(int device, stream_t stream) override {
    return call("is_stream", [&] { return inner_->is_stream(map(device), stream); });
  }
  event_t create_event(int device) override {
    return call("create_event", [&] { return inner_->create_event(map(device)); });
  }
  void destroy_event(int device, event_t event) override {
    event_end_.erase(event);
    call("destroy_event", [&] { inner_->destroy_event(map(device), event); });
  }
  void record_event(int device, event_t event, stream_t stream) override {
    call("record_event", [&] { inner_->record_event(map(device), event, stream); });
    const open_gap* g = gap_of(stream);
    if (g != nullptr)
      event_end_[event] = g->end;
    else
      event_end_.erase(event);
  }
  bool query_event(int device, event_t event) override {
    return call("query_event", [&] { return inner_->query_event(map(device), event); });
  }
  void synchronize_event(int device, event_t event) override {
    const int d = map(device);
    if (auto it = event_end_.find(event); it != event_end_.end()) reach(it->second);
    call("synchronize_event", [&] { inner_->synchronize_event(d, event); });
  }
  void synchronize_stream(int device, stream_t stream) override {
    const int d = map(device);
    if (const open_gap* g = gap_of(stream)) reach(g->end);
    call("synchronize_stream", [&] { inner_->synchronize_stream(d, stream); });
  }
  void synchronize_device(int device) override {
    const int d = map(device);
    std::uint64_t last = 0;  // the device is idle once every side stream's last gap is over
    for (const auto& [side, end] : side_end_) last = std::max(last, end);
    reach(last);
    call("synchronize_device", [&] { inner_->synchronize_device(d); });
  }

  std::size_t vm_granularity(int device) const override { return inner_->vm_granularity(map(device)); }
  void* vm_reserve(int device, std::size_t size_bytes) override {
    return call("vm_reserve", [&] { return inner_->vm_reserve(map(device), size_bytes); });
  }
  void vm_release(int device, void* base, std::size_t size_bytes) override {
    call("vm_release", [&] { inner_->vm_release(map(device), base, size_bytes); });
  }
  bool vm_create(int device, std::size_t size_bytes, physical_handle_t* handle) override {
    const bool made = call("vm_create", [&] { return inner_->vm_create(map(device), size_bytes, handle); });
    if (made) host_clock_.charge_vm_create(size_bytes);
    return made;
  }
  void vm_release_handle(int device, physical_handle_t handle) override {
    call("vm_release_handle", [&] { inner_->vm_release_handle(map(device), handle); });
    host_clock_.charge_vm_release_handle(vm_call_costs::page_bytes);  // handles are one page each
  }
  void vm_map(int device, void* addr, std::size_t size_bytes, physical_handle_t handle) override {
    call("vm_map", [&] { inner_->vm_map(map(device), addr, size_bytes, handle); });
    host_clock_.charge_vm_map(size_bytes);
  }
  void vm_unmap(int device, void* addr, std::size_t size_bytes) override {
    call("vm_unmap", [&] { inner_->vm_unmap(map(device), addr, size_bytes); });
    host_clock_.charge_vm_unmap(size_bytes);
  }
  void vm_set_access(int device, void* addr, std::size_t size_bytes, int peer) override {
    call("vm_set_access", [&] { inner_->vm_set_access(map(device), addr, size_bytes, map(peer)); });
    if (peer != device) host_clock_.charge_vm_set_access(size_bytes);
  }

 private:
  struct open_gap {
    std::uint64_t end = 0;  // trace index where the gap ends
    stream_t side = 0;
    gate_t gate = 0;
    std::uint64_t seq = 0;  // order of begin_gap calls
  };

  // Books an open gap (gaps_mutex_ held).
  void add_open(const open_gap& g) {
    open_.emplace(g.seq, g);
    by_end_.emplace(g.end, g.seq);
    by_stream_.emplace(g.side, g.seq);
  }

  int map(int device) const {
    if (device != 0)
      throw backend_error("replay: device " + std::to_string(device) + " is out of range [0, 1)");
    return device_;
  }

  // The open gap of `stream`, or nullptr.
  // (The earliest one begun, as a scan of open_ in order would find.)
  const open_gap* gap_of(stream_t stream) const {
    const auto it = by_stream_.lower_bound({stream, 0});
    if (it == by_stream_.end() || it->first != stream) return nullptr;
    return &open_.at(it->second);
  }

  // A gate nobody waits on: open it and give it back.
  void discard_gate(gate_t g) noexcept {
    try {
      inner_->open_gate(device_, g);
      inner_->destroy_gate(device_, g);
    } catch (...) {  // noexcept: a gate that cannot be opened or destroyed stays with the device
    }
  }

  // The clock moves to `index`: every gap ending at or before it ends. Its
  // gate opens and its side stream is synchronized, so the block's event has
  // completed before the replay goes on.
  void reach(std::uint64_t index) {
    now_ = std::max(now_, index);
    std::vector<open_gap> ending;
    {
      // The gaps ending, in the order they began (by_end_'s top has the
      // earliest end: no scan of every open gap at each event).
      std::lock_guard lock(gaps_mutex_);
      std::vector<std::uint64_t> seqs;
      while (!by_end_.empty() && by_end_.top().first <= now_) {
        seqs.push_back(by_end_.top().second);
        by_end_.pop();
      }
      std::sort(seqs.begin(), seqs.end());
      for (const std::uint64_t seq : seqs) {
        const auto it = open_.find(seq);
        ending.push_back(it->second);
        by_stream_.erase({it->second.side, seq});
        open_.erase(it);
      }
    }
    if (ending.empty()) return;
    std::size_t opened = 0;
    try {
      for (; opened < ending.size(); ++opened) inner_->open_gate(device_, ending[opened].gate);
    } catch (...) {
      // Keep the gates not opened on the books, so that release() opens them.
      std::lock_guard lock(gaps_mutex_);
      for (std::size_t i = opened; i < ending.size(); ++i) add_open(ending[i]);
      throw;
    }
    for (const open_gap& g : ending) {
      call("synchronize_stream", [&] { inner_->synchronize_stream(device_, g.side); });
      inner_->destroy_gate(device_, g.gate);
    }
    if (open_.empty()) flush_deferred_frees();
  }

  void flush_deferred_frees() {
    while (!deferred_frees_.empty()) {
      void* p = deferred_frees_.back();
      deferred_frees_.pop_back();
      call("segment_free", [&] { inner_->segment_free(device_, p); });
    }
  }

  // ---- watchdog ----------------------------------------------------------------------

  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // Runs `f`, a backend call the watchdog watches.
  template <class F>
  std::invoke_result_t<F&> call(const char* what, F&& f) {
    struct done {
      std::atomic<std::int64_t>& since;
      ~done() { since.store(0, std::memory_order_release); }
    };
    call_name_.store(what, std::memory_order_relaxed);
    call_since_.store(now_ns(), std::memory_order_release);
    done d{call_since_};
    return f();
  }

  void watch() {
    std::unique_lock lock(watchdog_mutex_);
    while (!stop_) {
      watchdog_cv_.wait_for(lock, std::chrono::milliseconds(200));
      if (stop_ || tripped_.load(std::memory_order_relaxed)) continue;
      const std::int64_t since = call_since_.load(std::memory_order_acquire);
      if (since == 0 || now_ns() - since < std::chrono::nanoseconds(watchdog_limit).count()) continue;
      std::lock_guard gaps_lock(gaps_mutex_);
      if (open_.empty()) continue;
      for (const auto& [seq, g] : open_) try {
          inner_->open_gate(device_, g.gate);
        } catch (...) {  // the watchdog opens what it can
        }
      tripped_call_ = call_name_.load(std::memory_order_relaxed);
      tripped_.store(true, std::memory_order_release);
    }
  }

  std::shared_ptr<device_backend> inner_;
  // The recording's time plus the modelled cost of the virtual-memory calls
  // (set_host_time_us): the replay on a GPU budgets as the simulated device
  // does, so both reach the same figures. Only the replay's thread uses it.
  modeled_host_clock host_clock_;
  int device_;
  std::uint64_t now_ = 0;                                 // trace index the replay has reached
  std::mutex gaps_mutex_;                                 // guards open_'s changes (the watchdog reads it)
  std::map<std::uint64_t, open_gap> open_;                // gaps whose gate is closed, by seq
  std::priority_queue<std::pair<std::uint64_t, std::uint64_t>, std::vector<std::pair<std::uint64_t, std::uint64_t>>,
                      std::greater<>>
      by_end_;                                            // (end, seq) of each gap in open_
  std::set<std::pair<stream_t, std::uint64_t>> by_stream_;  // (side, seq) of each gap in open_
  std::uint64_t next_seq_ = 0;
  std::unordered_map<stream_t, std::uint64_t> side_end_;  // side stream -> end of its last gap
  std::unordered_map<event_t, std::uint64_t> event_end_;  // event -> end of the gap it was recorded in
  std::vector<void*> deferred_frees_;
  std::vector<stream_t> owned_streams_;  // side streams and trace streams made here

  std::atomic<std::int64_t> call_since_{0};  // when the call in progress began (ns); 0: none
  std::atomic<const char*> call_name_{""};
  std::atomic<bool> tripped_{false};
  std::string tripped_call_;  // written before tripped_ is set
  std::mutex watchdog_mutex_;
  std::condition_variable watchdog_cv_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace ccalloc::replay_detail

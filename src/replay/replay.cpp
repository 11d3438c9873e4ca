// Trace replay on the simulated device or a GPU (SPEC X8). See
// include/ccalloc/replay/replay.hpp for the model.
//
// One event loop (replay_events) drives a caching_allocator for every device.
// What differs is how a block's free_requested .. free_completed gap holds on
// the device, behind the small gap_model interface:
//   clock_gaps  the simulated device's virtual clock (enqueue_work /
//               advance_to): the default, bit for bit the replay of old;
//   gate_gaps   host-controlled gates (device_backend::create_gate) on any
//               backend with capabilities().gates: the GPU (cuda_backend),
//               and sim_backend for the CPU test of this driver.
// The side-stream pool, which reuses a side stream once its gap is over, is
// shared (side_stream_pool).
#include <ccalloc/replay/replay.hpp>

#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#ifndef CCALLOC_HAVE_CUDA_BACKEND  // set by CMake (CCALLOC_WITH_CUDA)
#define CCALLOC_HAVE_CUDA_BACKEND 0
#endif
#if CCALLOC_HAVE_CUDA_BACKEND
#include <ccalloc/backend/cuda_backend.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ccalloc {

const char* to_string(replay_device device) noexcept { return device == replay_device::cuda ? "cuda" : "sim"; }

namespace {

constexpr std::uint64_t never = ~std::uint64_t{0};

// For each free_requested event, the index of its free_completed event
// (`never` if the trace ends first). Also validates the pairing.
std::vector<std::uint64_t> completion_indices(const trace& t) {
  std::vector<std::uint64_t> completion(t.events.size(), never);
  std::unordered_map<std::uint64_t, std::uint64_t> requested_at;  // addr -> free_requested index
  requested_at.reserve(1024);
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const trace_event& e = t.events[i];
    if (e.action == trace_action::free_requested) {
      requested_at[e.addr] = i;
    } else if (e.action == trace_action::free_completed) {
      auto it = requested_at.find(e.addr);
      if (it == requested_at.end())
        throw trace_error(t.source, e.line,
                          "free_completed of address " + std::to_string(e.addr) + " with no free_requested before it");
      completion[it->second] = i;
      requested_at.erase(it);
    }
  }
  return completion;
}

// The trace index where the gap of free_requested event `i` ends: its
// free_completed, or the end of the trace for a block never completed.
std::uint64_t gap_end(const trace& t, const std::vector<std::uint64_t>& completion, std::size_t i) {
  return completion[i] == never ? t.events.size() : completion[i];
}

// Gaps are free_requested events whose free_completed is not the next event.
bool has_gap(const std::vector<std::uint64_t>& completion, std::size_t i) { return completion[i] > i + 1; }

// The most gaps open at once (an upper bound: the replay may end some early).
std::size_t max_open_gaps(const trace& t, const std::vector<std::uint64_t>& completion) {
  std::map<std::uint64_t, std::int64_t> delta;  // index -> change in open gaps
  for (std::size_t i = 0; i < t.events.size(); ++i)
    if (t.events[i].action == trace_action::free_requested && has_gap(completion, i)) {
      ++delta[i];
      --delta[gap_end(t, completion, i)];
    }
  std::int64_t open = 0;
  std::int64_t most = 0;
  for (const auto& [index, d] : delta) most = std::max(most, open += d);
  return static_cast<std::size_t>(most);
}

// ---- the gap model ----------------------------------------------------------------

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
  /// After each event: throws if the replay cannot go on.
  virtual void check() {}
  /// The replay is over: every gap ends (before the allocator's memory goes back).
  virtual void end_all() = 0;
  /// After the allocator is gone: releases the side streams. Never throws.
  virtual void release() noexcept = 0;
};

// Side streams standing in for the program's other streams during gaps; one
// is reused once its gap is over.
class side_stream_pool {
 public:
  /// `trace_streams`: stream ids the trace itself uses; a side stream must
  /// differ from all of them (on the simulated device the trace's ids are used
  /// as they are, and a created stream could carry the same number).
  side_stream_pool(gap_model& gaps, std::unordered_set<stream_t> trace_streams)
      : gaps_(gaps), trace_streams_(std::move(trace_streams)) {}
  stream_t acquire(std::uint64_t index) {
    for (stream_t s : streams_)
      if (gaps_.idle(s, index)) return s;
    stream_t s = gaps_.create_side_stream();
    while (trace_streams_.count(s) != 0) s = gaps_.create_side_stream();  // skip a clashing id
    streams_.push_back(s);
    return s;
  }

 private:
  gap_model& gaps_;
  std::unordered_set<stream_t> trace_streams_;
  std::vector<stream_t> streams_;
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
  void end_all() override {}
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
      open_.push_back({end, side, g});
    }
    auto& e = side_end_[side];
    e = std::max(e, end);
    // A gap that ends at or before the clock (pushed ahead by a wait) ends at
    // the next advance_to, before the next event, as on the simulated device.
  }
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
        for (const open_gap& g : open_) try {
            inner_->open_gate(device_, g.gate);
          } catch (...) {
          }
        open_.clear();
      }
      try {
        flush_deferred_frees();
      } catch (...) {
      }
    }
    for (stream_t s : owned_streams_) try {
        inner_->synchronize_stream(device_, s);
        inner_->destroy_stream(device_, s);
      } catch (...) {
      }
    owned_streams_.clear();
  }

  // ---- device_backend: forwarded to the real one (device 0 -> device_) ---------

  std::string name() const override { return inner_->name(); }
  backend_capabilities capabilities() const override { return inner_->capabilities(); }
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
    return call("vm_create", [&] { return inner_->vm_create(map(device), size_bytes, handle); });
  }
  void vm_release_handle(int device, physical_handle_t handle) override {
    call("vm_release_handle", [&] { inner_->vm_release_handle(map(device), handle); });
  }
  void vm_map(int device, void* addr, std::size_t size_bytes, physical_handle_t handle) override {
    call("vm_map", [&] { inner_->vm_map(map(device), addr, size_bytes, handle); });
  }
  void vm_unmap(int device, void* addr, std::size_t size_bytes) override {
    call("vm_unmap", [&] { inner_->vm_unmap(map(device), addr, size_bytes); });
  }
  void vm_set_access(int device, void* addr, std::size_t size_bytes, int peer) override {
    call("vm_set_access", [&] { inner_->vm_set_access(map(device), addr, size_bytes, map(peer)); });
  }

 private:
  struct open_gap {
    std::uint64_t end = 0;  // trace index where the gap ends
    stream_t side = 0;
    gate_t gate = 0;
  };

  int map(int device) const {
    if (device != 0)
      throw backend_error("replay: device " + std::to_string(device) + " is out of range [0, 1)");
    return device_;
  }

  // The open gap of `stream`, or nullptr.
  const open_gap* gap_of(stream_t stream) const {
    for (const open_gap& g : open_)
      if (g.side == stream) return &g;
    return nullptr;
  }

  // A gate nobody waits on: open it and give it back.
  void discard_gate(gate_t g) noexcept {
    try {
      inner_->open_gate(device_, g);
      inner_->destroy_gate(device_, g);
    } catch (...) {
    }
  }

  // The clock moves to `index`: every gap ending at or before it ends. Its
  // gate opens and its side stream is synchronized, so the block's event has
  // completed before the replay goes on.
  void reach(std::uint64_t index) {
    now_ = std::max(now_, index);
    std::vector<open_gap> ending;
    {
      std::lock_guard lock(gaps_mutex_);
      std::size_t kept = 0;
      for (const open_gap& g : open_) {
        if (g.end > now_)
          open_[kept++] = g;
        else
          ending.push_back(g);
      }
      open_.resize(kept);
    }
    if (ending.empty()) return;
    std::size_t opened = 0;
    try {
      for (; opened < ending.size(); ++opened) inner_->open_gate(device_, ending[opened].gate);
    } catch (...) {
      // Keep the gates not opened on the books, so that release() opens them.
      std::lock_guard lock(gaps_mutex_);
      open_.insert(open_.end(), ending.begin() + static_cast<std::ptrdiff_t>(opened), ending.end());
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
      for (const open_gap& g : open_) try {
          inner_->open_gate(device_, g.gate);
        } catch (...) {
        }
      tripped_call_ = call_name_.load(std::memory_order_relaxed);
      tripped_.store(true, std::memory_order_release);
    }
  }

  std::shared_ptr<device_backend> inner_;
  int device_;
  std::uint64_t now_ = 0;                                 // trace index the replay has reached
  std::mutex gaps_mutex_;                                 // guards open_'s changes (the watchdog reads it)
  std::vector<open_gap> open_;                            // gaps whose gate is closed
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

// Trace stream -> the stream the replay uses for it.
struct stream_map {
  bool identity = true;  // the trace's handle itself (the simulated device accepts any)
  std::unordered_map<std::uint64_t, stream_t> streams;
  [[nodiscard]] stream_t operator()(std::uint64_t recorded) const {
    return identity ? static_cast<stream_t>(recorded) : streams.at(recorded);
  }
};

// Trace stream 0 -> the legacy default stream; every other one -> a new stream.
stream_map make_streams(const trace& t, gate_gaps& gates) {
  stream_map m;
  m.identity = false;
  m.streams.emplace(0, default_stream);
  for (const trace_event& e : t.events)
    if (e.action == trace_action::alloc && m.streams.count(e.stream) == 0)
      m.streams.emplace(e.stream, gates.create_trace_stream());
  return m;
}

// ---- the event loop --------------------------------------------------------------------

void replay_events(const trace& t, const std::vector<std::uint64_t>& completion,
                   std::shared_ptr<device_backend> backend, const allocator_config& config, gap_model& gaps,
                   const stream_map& streams, const replay_event_hook& after_event,
                   const std::optional<history_options>& history, replay_result& r) {
  // On every exit, gaps end before the allocator returns its memory to the
  // device, and side streams go only once the allocator is gone.
  struct cleanup {
    gap_model& gaps;
    std::unique_ptr<caching_allocator> allocator;
    ~cleanup() {
      try {
        gaps.end_all();
      } catch (...) {
      }
      allocator.reset();
      gaps.release();
    }
  } c{gaps, std::make_unique<caching_allocator>(std::move(backend), config)};
  caching_allocator& allocator = *c.allocator;
  allocator.init(1);
  // The replay models the pools' policy (best fit): no thread cache, whose
  // most-recently-freed reuse would change the layout (docs/perf.md).
  allocator.device_allocator(0).set_thread_cache_enabled(false);
  if (history) allocator.record_history(*history);

  struct live_alloc {
    void* ptr = nullptr;  // nullptr: the allocation failed (OOM) in this replay
    std::uint64_t line = 0;
  };
  std::unordered_map<std::uint64_t, live_alloc> live;  // trace address -> our allocation
  live.reserve(4096);
  std::unordered_set<stream_t> trace_streams;
  for (const trace_event& e : t.events) trace_streams.insert(static_cast<stream_t>(e.stream));
  side_stream_pool side_streams(gaps, std::move(trace_streams));

  const auto start = std::chrono::steady_clock::now();
  std::size_t replayed = t.events.size();
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const trace_event& e = t.events[i];
    gaps.advance_to(i);
    switch (e.action) {
      case trace_action::alloc: {
        auto [it, fresh] = live.try_emplace(e.addr);
        if (!fresh)
          throw trace_error(t.source, e.line,
                            "alloc at address " + std::to_string(e.addr) + ", which is still live (allocated at line " +
                                std::to_string(it->second.line) + ")");
        it->second.line = e.line;
        try {
          it->second.ptr = allocator.malloc(0, e.size, streams(e.stream));
        } catch (const out_of_memory_error&) {
          ++r.ooms;
          it->second.ptr = nullptr;
        }
        break;
      }
      case trace_action::free_requested: {
        auto it = live.find(e.addr);
        if (it == live.end())
          throw trace_error(t.source, e.line,
                            "free_requested of address " + std::to_string(e.addr) + " with no live allocation");
        void* ptr = it->second.ptr;
        live.erase(it);
        if (ptr == nullptr) break;  // its alloc failed
        if (has_gap(completion, i)) {
          // The block stays in use on another stream until its free_completed.
          const stream_t side = side_streams.acquire(i);
          gaps.begin_gap(side, gap_end(t, completion, i));
          allocator.record_stream(ptr, side);
        }
        allocator.free(ptr);
        break;
      }
      default:
        break;  // free_completed is the side stream's work ending; segment events are the recorder's
    }
    gaps.check();
    if (after_event && !after_event(i, allocator)) {
      replayed = i + 1;
      break;
    }
  }
  r.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.events = replayed;
  const device_stats s = allocator.get_device_stats(0);
  r.peak_requested_bytes = static_cast<std::uint64_t>(s.requested_bytes[0].peak);
  r.peak_allocated_bytes = static_cast<std::uint64_t>(s.allocated_bytes[0].peak);
  r.peak_reserved_bytes = static_cast<std::uint64_t>(s.reserved_bytes[0].peak);
  r.device_mallocs = static_cast<std::uint64_t>(s.num_device_alloc);
  r.device_frees = static_cast<std::uint64_t>(s.num_device_free);
  r.alloc_retries = static_cast<std::uint64_t>(s.num_alloc_retries);
  r.device_synchronizations = static_cast<std::uint64_t>(s.num_device_synchronizations);
  r.pages_remapped = static_cast<std::uint64_t>(s.num_pages_remapped);

  // Give everything back (the figures are taken): what the trace still
  // holds, then the gaps, then the cache.
  for (auto& [addr, a] : live)
    if (a.ptr != nullptr) allocator.free(a.ptr);
  gaps.end_all();
  allocator.empty_cache();
  gaps.check();
}

// The replay through gates on `backend`'s device `device`.
void replay_with_gates(const trace& t, const std::vector<std::uint64_t>& completion,
                       const std::shared_ptr<device_backend>& backend, int device, bool own_streams,
                       bool watchdog, const allocator_config& config, const replay_event_hook& after_event,
                       const std::optional<history_options>& history, replay_result& r) {
  auto gates = std::make_shared<gate_gaps>(backend, device, max_open_gaps(t, completion), watchdog);
  const stream_map streams = own_streams ? make_streams(t, *gates) : stream_map{};
  replay_events(t, completion, gates, config, *gates, streams, after_event, history, r);
}

#if CCALLOC_HAVE_CUDA_BACKEND
std::shared_ptr<device_backend> open_cuda(int device) {
  if (cuda_backend::available_device_count() < 1)
    throw error("replay on cuda: no CUDA device is usable (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)");
  std::shared_ptr<cuda_backend> b;
  try {
    b = std::make_shared<cuda_backend>();
  } catch (const backend_error& e) {
    throw error(std::string("replay on cuda: ") + e.what());
  }
  if (device < 0 || device >= b->device_count())
    throw error("replay on cuda: device " + std::to_string(device) + " is out of range [0, " +
                std::to_string(b->device_count()) + ")");
  if (!b->capabilities().gates)
    throw error(
        "replay on cuda: the CUDA driver lacks cuStreamWaitValue32, or a device cannot map host memory: the "
        "replay needs them to keep blocks in use on side streams");
  return b;
}
#endif

}  // namespace

replay_result replay_trace(const trace& t, const replay_options& options) {
  const allocator_config config = allocator_config::parse(options.config);
  const std::vector<std::uint64_t> completion = completion_indices(t);

  replay_result r;
  r.source = t.source;
  r.config = options.config;
  r.device = options.device;
  if (options.device == replay_device::sim) {
    sim_options so;
    so.capacity_bytes = options.device_memory_bytes;
    auto sim = std::make_shared<sim_backend>(so);
    r.device_memory_bytes = options.device_memory_bytes;
    if (options.use_gates_on_sim) {
      replay_with_gates(t, completion, sim, 0, /*own_streams=*/false, /*watchdog=*/false, config,
                        options.after_event, options.history, r);
    } else {
      clock_gaps gaps(*sim);
      replay_events(t, completion, sim, config, gaps, stream_map{}, options.after_event, options.history, r);
    }
    return r;
  }
#if CCALLOC_HAVE_CUDA_BACKEND
  const std::shared_ptr<device_backend> cuda = open_cuda(options.cuda_device);
  r.device_memory_bytes = cuda->mem_get_info(options.cuda_device).total_bytes;
  replay_with_gates(t, completion, cuda, options.cuda_device, /*own_streams=*/true, /*watchdog=*/true, config,
                    options.after_event, options.history, r);
  return r;
#else
  throw error(
      "replay on cuda: this build of ccalloc has no CUDA backend (configure with a CUDA toolkit and "
      "-DCCALLOC_WITH_CUDA=ON)");
#endif
}

std::size_t find_min_device_memory(const trace& t, const replay_options& options, std::size_t precision_bytes) {
  if (options.device != replay_device::sim)
    throw error("find_min_device_memory: only the simulated device can change its memory size");
  if (precision_bytes == 0) throw error("find_min_device_memory: precision_bytes must be > 0");
  replay_options probe = options;  // the caller's hook and history are for its own replay only
  probe.after_event = nullptr;
  probe.history.reset();
  const replay_result full = replay_trace(t, probe);
  if (full.ooms != 0)
    throw error("find_min_device_memory: " + t.source + " does not fit even in " +
                std::to_string(options.device_memory_bytes) + " bytes (" + std::to_string(full.ooms) +
                " allocations failed)");
  const auto round_up = [&](std::size_t v) { return (v + precision_bytes - 1) / precision_bytes * precision_bytes; };
  std::size_t fits = round_up(full.peak_reserved_bytes);  // a replay that never reserved more fits here
  std::size_t fails = full.peak_requested_bytes / precision_bytes * precision_bytes;  // below the lower bound
  if (fails >= fits) fails = fits - std::min(fits, precision_bytes);
  while (fits - fails > precision_bytes) {
    const std::size_t mid = fails + (fits - fails) / 2 / precision_bytes * precision_bytes;
    probe.device_memory_bytes = mid;
    if (replay_trace(t, probe).ooms == 0) fits = mid;
    else fails = mid;
  }
  return fits;
}

}  // namespace ccalloc

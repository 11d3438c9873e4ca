// ccalloc/backend/sim_backend.hpp: a simulated device in host memory.
//
// What it is: a device_backend whose "device memory" is host address space
// (anonymous mappings made with MAP_NORESERVE, so untouched pages cost no RAM),
// with a capacity per device, CUDA's 2 MiB allocation granularity, and streams
// and events driven by a virtual clock that the caller advances. It is the
// embedded default for `ccalloc replay` and what every CI test runs on.
//
// Time model: the clock is an unsigned counter of virtual time units (the
// replay uses one unit per trace event; tests pick their own). Each stream has
// a "busy until" time: enqueue_work(stream, until) says that work queued on the
// stream runs until `until`. An event recorded on a stream completes when the
// clock reaches the stream's busy-until time at the moment of recording.
// synchronize_* advance the clock to when the awaited work completes (the host
// waited that long). segment_free does not advance the clock, although
// cudaFree synchronizes the device: the caching allocator frees only segments
// with no pending work, so the wait would change no event's outcome, and a
// replay would otherwise skip ahead of the program it replays.
//
// Gates (capabilities().gates): a gate is an id. wait_gate on a closed gate
// makes the stream's work wait until the gate opens: its busy-until time is
// "never" (busy_until returns UINT64_MAX) and events recorded on it
// meanwhile do not complete. open_gate releases the waiting streams at the
// current time (busy-until becomes max(busy-until, now)) and lets those
// events complete at max(their time, now). The simulated device cannot block,
// so a wait that a real device would never finish (synchronize_event on such
// an event, synchronize_stream on a waiting stream, synchronize_device while
// one of its streams waits) throws backend_error naming the gate instead of
// deadlocking. destroy_gate of a closed gate throws backend_error.
//
// Capacity: every segment_malloc of n bytes uses n rounded up to the
// granularity; it returns nullptr when that would pass the capacity.
//
// Fault injection: fail_segment_malloc_after(n) makes the n-th segment_malloc
// from now (1 = the next one) return nullptr as if out of memory;
// fail_event_query_after(n) makes the n-th query_event throw backend_error.
//
// Thread safety: all functions may be called concurrently (one internal mutex;
// the simulated device is not a hot path).
#pragma once

#include <ccalloc/backend/device_backend.hpp>

#include <cstdint>
#include <memory>

namespace ccalloc {

struct sim_options {
  int device_count = 1;
  /// Capacity of each device in bytes. Default: 141 GB, an H200's.
  std::size_t capacity_bytes = std::size_t{141} * 1000 * 1000 * 1000;
  /// Allocation granularity (bytes, a power of two): segment sizes are
  /// charged rounded up to it.
  std::size_t granularity_bytes = 2 * mib;
};

/// Counters the simulated device keeps (for tests and the replay report).
struct sim_counters {
  std::uint64_t segment_mallocs = 0;  ///< successful segment_malloc calls
  std::uint64_t segment_frees = 0;
  std::uint64_t failed_mallocs = 0;   ///< segment_malloc calls that returned nullptr
  std::size_t used_bytes = 0;         ///< charged bytes of live segments, all devices
  std::uint64_t live_events = 0;      ///< created and not destroyed
  std::uint64_t live_streams = 0;
  std::uint64_t live_gates = 0;       ///< created and not destroyed
};

class sim_backend final : public device_backend {
 public:
  explicit sim_backend(sim_options options = {});
  ~sim_backend() override;
  sim_backend(const sim_backend&) = delete;
  sim_backend& operator=(const sim_backend&) = delete;

  [[nodiscard]] std::string name() const override { return "sim"; }
  /// gates: true; virtual_memory, peer_access, ipc: false.
  [[nodiscard]] backend_capabilities capabilities() const override;
  [[nodiscard]] int device_count() const override;
  [[nodiscard]] int current_device() const override;
  void set_device(int device) override;
  [[nodiscard]] memory_info mem_get_info(int device) const override;

  [[nodiscard]] void* segment_malloc(int device, std::size_t size_bytes) override;
  void segment_free(int device, void* ptr) override;

  [[nodiscard]] stream_t create_stream(int device) override;
  void destroy_stream(int device, stream_t stream) override;
  [[nodiscard]] event_t create_event(int device) override;
  void destroy_event(int device, event_t event) override;
  void record_event(int device, event_t event, stream_t stream) override;
  [[nodiscard]] bool query_event(int device, event_t event) override;
  void synchronize_event(int device, event_t event) override;
  void synchronize_stream(int device, stream_t stream) override;
  void synchronize_device(int device) override;

  // --- gates (see the header comment) ------------------------------------------

  [[nodiscard]] gate_t create_gate(int device) override;
  void wait_gate(int device, stream_t stream, gate_t gate) override;
  void open_gate(int device, gate_t gate) override;
  void destroy_gate(int device, gate_t gate) override;

  // --- simulation controls ----------------------------------------------------

  /// Current virtual time.
  [[nodiscard]] std::uint64_t now() const;
  /// Advances the clock to `time` (never moves it back).
  void advance_to(std::uint64_t time);
  /// Work queued on `stream` (of `device`) runs until virtual time `until`
  /// (the stream's busy-until becomes max(current, until)). Stream 0 and any
  /// handle the backend did not create are accepted: they are created lazily,
  /// so a trace's stream ids can be used directly.
  void enqueue_work(int device, stream_t stream, std::uint64_t until);
  /// Virtual time at which the work queued on `stream` so far completes;
  /// UINT64_MAX while the stream waits on a closed gate.
  [[nodiscard]] std::uint64_t busy_until(int device, stream_t stream) const;
  /// Changes a device's capacity (bytes); live segments stay.
  void set_capacity(int device, std::size_t capacity_bytes);
  /// The n-th segment_malloc from now (n >= 1) returns nullptr; 0 disarms.
  void fail_segment_malloc_after(std::uint64_t n);
  /// The n-th query_event from now (n >= 1) throws backend_error; 0 disarms.
  void fail_event_query_after(std::uint64_t n);
  [[nodiscard]] sim_counters counters() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace ccalloc

// bench/gpu/timed_backend.hpp: a device backend that forwards every call to
// another and counts, per kind of call, how often the allocator made it and
// the host time it took (steady clock, nanoseconds). bench_gpu wraps the CUDA
// backend in it for ccalloc's C++ API, so that each ring case can say how
// much of its time was the driver's (event records and queries, page
// mapping) and how much the allocator's own code (issue 18's mixed case).
//
// Thread safety: the counters are atomics (relaxed); the wrapped backend's
// own rules hold for the calls. Timing adds two clock reads to each call
// counted; the calls counted are the ones the allocator makes off its hot
// path (events, virtual memory, segments, synchronization), plus
// host_time_us, which the recycling time budget reads.
#pragma once

#include <ccalloc/backend/device_backend.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

namespace ccalloc::bench {

class timed_backend final : public device_backend {
 public:
  /// The kinds of call counted.
  enum call : int {
    record_event_call, query_event_call, synchronize_call, create_event_call, segment_malloc_call,
    segment_free_call, vm_create_call, vm_release_handle_call, vm_map_call, vm_unmap_call, vm_set_access_call,
    vm_reserve_call, host_time_call, mem_get_info_call, other_call, call_kinds
  };
  static constexpr std::array<const char*, call_kinds> call_names{
      "record_event", "query_event", "synchronize", "create_event", "segment_malloc", "segment_free", "vm_create",
      "vm_release_handle", "vm_map", "vm_unmap", "vm_set_access", "vm_reserve", "host_time_us", "mem_get_info",
      "other"};

  /// Wraps `inner` (shared ownership; not null).
  explicit timed_backend(std::shared_ptr<device_backend> inner) : inner_(std::move(inner)) {}

  /// Counts and nanoseconds since the last take(), as "name=count/us ..."
  /// for the kinds called at least once, then zeroes them; `total_ns` gets
  /// the sum of the nanoseconds.
  std::string take(double* total_ns) {
    std::string out;
    double sum = 0;
    char buf[96];
    for (std::size_t k = 0; k < call_kinds; ++k) {
      const std::uint64_t n = count_[k].exchange(0, std::memory_order_relaxed);
      const std::uint64_t ns = ns_[k].exchange(0, std::memory_order_relaxed);
      if (n == 0) continue;
      sum += static_cast<double>(ns);
      std::snprintf(buf, sizeof buf, "%s%s=%llu/%.0fus", out.empty() ? "" : " ", call_names[k],
                    static_cast<unsigned long long>(n), static_cast<double>(ns) / 1e3);
      out += buf;
    }
    *total_ns = sum;
    return out.empty() ? std::string("none") : out;
  }

  std::string name() const override { return inner_->name(); }
  backend_capabilities capabilities() const override { return inner_->capabilities(); }
  std::optional<std::uint64_t> host_time_us() const override {
    return timed(host_time_call, [&] { return inner_->host_time_us(); });
  }
  int device_count() const override { return inner_->device_count(); }
  int current_device() const override { return inner_->current_device(); }
  void set_device(int device) override { inner_->set_device(device); }
  memory_info mem_get_info(int device) const override {
    return timed(mem_get_info_call, [&] { return inner_->mem_get_info(device); });
  }
  void* segment_malloc(int device, std::size_t size_bytes) override {
    return timed(segment_malloc_call, [&] { return inner_->segment_malloc(device, size_bytes); });
  }
  void segment_free(int device, void* ptr) override {
    timed(segment_free_call, [&] { inner_->segment_free(device, ptr); });
  }
  stream_t resolve_stream(int device, stream_t stream) const override { return inner_->resolve_stream(device, stream); }
  stream_t create_stream(int device) override { return inner_->create_stream(device); }
  void destroy_stream(int device, stream_t stream) override { inner_->destroy_stream(device, stream); }
  bool is_stream(int device, stream_t stream) override { return inner_->is_stream(device, stream); }
  event_t create_event(int device) override {
    return timed(create_event_call, [&] { return inner_->create_event(device); });
  }
  void destroy_event(int device, event_t event) override {
    timed(other_call, [&] { inner_->destroy_event(device, event); });
  }
  void record_event(int device, event_t event, stream_t stream) override {
    timed(record_event_call, [&] { inner_->record_event(device, event, stream); });
  }
  bool query_event(int device, event_t event) override {
    return timed(query_event_call, [&] { return inner_->query_event(device, event); });
  }
  void synchronize_event(int device, event_t event) override {
    timed(synchronize_call, [&] { inner_->synchronize_event(device, event); });
  }
  void stream_wait_event(int device, stream_t stream, event_t event) override {
    timed(other_call, [&] { inner_->stream_wait_event(device, stream, event); });
  }
  void synchronize_stream(int device, stream_t stream) override {
    timed(synchronize_call, [&] { inner_->synchronize_stream(device, stream); });
  }
  void synchronize_device(int device) override {
    timed(synchronize_call, [&] { inner_->synchronize_device(device); });
  }
  bool is_capturing(int device, stream_t stream) override {
    return timed(other_call, [&] { return inner_->is_capturing(device, stream); });
  }
  std::size_t vm_granularity(int device) const override { return inner_->vm_granularity(device); }
  void* vm_reserve(int device, std::size_t size_bytes) override {
    return timed(vm_reserve_call, [&] { return inner_->vm_reserve(device, size_bytes); });
  }
  void vm_release(int device, void* base, std::size_t size_bytes) override {
    timed(other_call, [&] { inner_->vm_release(device, base, size_bytes); });
  }
  bool vm_create(int device, std::size_t size_bytes, physical_handle_t* handle) override {
    return timed(vm_create_call, [&] { return inner_->vm_create(device, size_bytes, handle); });
  }
  void vm_release_handle(int device, physical_handle_t handle) override {
    timed(vm_release_handle_call, [&] { inner_->vm_release_handle(device, handle); });
  }
  void vm_map(int device, void* addr, std::size_t size_bytes, physical_handle_t handle) override {
    timed(vm_map_call, [&] { inner_->vm_map(device, addr, size_bytes, handle); });
  }
  void vm_unmap(int device, void* addr, std::size_t size_bytes) override {
    timed(vm_unmap_call, [&] { inner_->vm_unmap(device, addr, size_bytes); });
  }
  void vm_set_access(int device, void* addr, std::size_t size_bytes, int peer) override {
    timed(vm_set_access_call, [&] { inner_->vm_set_access(device, addr, size_bytes, peer); });
  }
  ipc_mem_handle ipc_export_segment(int device, void* base) override {
    return inner_->ipc_export_segment(device, base);
  }
  void* ipc_open_segment(int device, const ipc_mem_handle& handle) override {
    return inner_->ipc_open_segment(device, handle);
  }
  void ipc_close_segment(int device, void* ptr) override { inner_->ipc_close_segment(device, ptr); }
  shareable_handle vm_export_handle(int device, physical_handle_t handle) override {
    return inner_->vm_export_handle(device, handle);
  }
  physical_handle_t vm_import_handle(int device, const shareable_handle& shared) override {
    return inner_->vm_import_handle(device, shared);
  }
  void memcpy_async(int device, void* dst, const void* src, std::size_t size_bytes, stream_t stream) override {
    inner_->memcpy_async(device, dst, src, size_bytes, stream);
  }
  void memcpy_peer_async(void* dst, int dst_device, const void* src, int src_device, std::size_t size_bytes,
                         stream_t stream) override {
    inner_->memcpy_peer_async(dst, dst_device, src, src_device, size_bytes, stream);
  }
  void copy_data(int device, void* dst, const void* src, std::size_t size_bytes) override {
    inner_->copy_data(device, dst, src, size_bytes);
  }
  bool can_access_peer(int device, int peer) const override { return inner_->can_access_peer(device, peer); }
  void enable_peer_access(int device, int peer) override { inner_->enable_peer_access(device, peer); }
  gate_t create_gate(int device) override { return inner_->create_gate(device); }
  void wait_gate(int device, stream_t stream, gate_t gate) override { inner_->wait_gate(device, stream, gate); }
  void open_gate(int device, gate_t gate) override { inner_->open_gate(device, gate); }
  void destroy_gate(int device, gate_t gate) override { inner_->destroy_gate(device, gate); }

 private:
  // f() timed and counted under `kind` (also when it throws).
  template <class F>
  auto timed(call kind, F f) const -> decltype(f()) {
    struct charge {
      const timed_backend* self;
      call kind;
      std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
      ~charge() {
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
        self->count_[static_cast<std::size_t>(kind)].fetch_add(1, std::memory_order_relaxed);
        self->ns_[static_cast<std::size_t>(kind)].fetch_add(static_cast<std::uint64_t>(ns.count()), std::memory_order_relaxed);
      }
    } c{this, kind};
    return f();
  }

  std::shared_ptr<device_backend> inner_;
  mutable std::array<std::atomic<std::uint64_t>, call_kinds> count_{};
  mutable std::array<std::atomic<std::uint64_t>, call_kinds> ns_{};
};

}  // namespace ccalloc::bench

// The simulated device: host address space as device memory, a virtual clock
// for streams and events. See include/ccalloc/backend/sim_backend.hpp.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace ccalloc {

namespace {
thread_local int tls_current_device = 0;
}

struct sim_backend::impl {
  struct device {
    std::size_t capacity_bytes = 0;
    std::size_t used_bytes = 0;
    std::unordered_map<void*, std::size_t> segments;       // ptr -> mapped bytes
    std::unordered_map<stream_t, std::uint64_t> busy_until;  // stream -> time
  };
  struct event {
    int device = 0;
    std::uint64_t complete_at = 0;
  };

  explicit impl(sim_options o) : options(o), devices(static_cast<std::size_t>(o.device_count)) {
    for (auto& d : devices) d.capacity_bytes = o.capacity_bytes;
  }

  device& dev(int index) {
    if (index < 0 || index >= static_cast<int>(devices.size()))
      throw backend_error("sim: device " + std::to_string(index) + " out of range [0, " +
                          std::to_string(devices.size()) + ")");
    return devices[static_cast<std::size_t>(index)];
  }
  event& ev(event_t e) {
    auto it = events.find(e);
    if (it == events.end()) throw backend_error("sim: unknown event " + std::to_string(e));
    return it->second;
  }
  std::size_t charged(std::size_t size_bytes) const {
    const std::size_t g = options.granularity_bytes;
    return (size_bytes + g - 1) / g * g;
  }

  sim_options options;
  mutable std::mutex mutex;
  std::vector<device> devices;
  std::unordered_map<event_t, event> events;
  event_t next_event = 1;
  stream_t next_stream = 0x1000;
  std::uint64_t now = 0;
  std::uint64_t fail_malloc_countdown = 0;
  std::uint64_t fail_query_countdown = 0;
  sim_counters counters;
};

sim_backend::sim_backend(sim_options options) {
  if (options.device_count < 1) throw backend_error("sim: device_count must be >= 1");
  if (options.granularity_bytes == 0 || (options.granularity_bytes & (options.granularity_bytes - 1)))
    throw backend_error("sim: granularity_bytes must be a power of two");
  impl_ = std::make_unique<impl>(options);
}

sim_backend::~sim_backend() {
  for (auto& d : impl_->devices)
    for (auto& [ptr, bytes] : d.segments) ::munmap(ptr, bytes);
}

int sim_backend::device_count() const { return impl_->options.device_count; }
int sim_backend::current_device() const { return tls_current_device; }
void sim_backend::set_device(int device) {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  tls_current_device = device;
}

memory_info sim_backend::mem_get_info(int device) const {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  return {d.capacity_bytes > d.used_bytes ? d.capacity_bytes - d.used_bytes : 0, d.capacity_bytes};
}

void* sim_backend::segment_malloc(int device, std::size_t size_bytes) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  if (size_bytes == 0) throw backend_error("sim: segment_malloc of 0 bytes");
  if (impl_->fail_malloc_countdown && --impl_->fail_malloc_countdown == 0) {
    ++impl_->counters.failed_mallocs;
    return nullptr;  // injected fault: behaves as out of memory
  }
  const std::size_t charged = impl_->charged(size_bytes);
  if (charged < size_bytes || d.used_bytes + charged > d.capacity_bytes) {
    ++impl_->counters.failed_mallocs;
    return nullptr;
  }
  // Address space only: pages cost memory only once touched.
  void* p = ::mmap(nullptr, charged, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
  if (p == MAP_FAILED) {
    ++impl_->counters.failed_mallocs;
    return nullptr;
  }
  d.segments.emplace(p, charged);
  d.used_bytes += charged;
  impl_->counters.used_bytes += charged;
  ++impl_->counters.segment_mallocs;
  return p;
}

void sim_backend::segment_free(int device, void* ptr) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  auto it = d.segments.find(ptr);
  if (it == d.segments.end())
    throw backend_error("sim: segment_free of " + std::to_string(reinterpret_cast<std::uintptr_t>(ptr)) +
                        ", which is not a live segment of device " + std::to_string(device));
  ::munmap(ptr, it->second);
  d.used_bytes -= it->second;
  impl_->counters.used_bytes -= it->second;
  d.segments.erase(it);
  ++impl_->counters.segment_frees;
  // cudaFree's implicit device synchronization is not modelled as a clock
  // advance (see the header).
}

stream_t sim_backend::create_stream(int device) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  const stream_t s = impl_->next_stream++;
  d.busy_until.emplace(s, impl_->now);
  ++impl_->counters.live_streams;
  return s;
}

void sim_backend::destroy_stream(int device, stream_t stream) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->dev(device).busy_until.erase(stream)) --impl_->counters.live_streams;
}

event_t sim_backend::create_event(int device) {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  const event_t e = impl_->next_event++;
  impl_->events.emplace(e, impl::event{device, 0});
  ++impl_->counters.live_events;
  return e;
}

void sim_backend::destroy_event(int, event_t event) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->events.erase(event)) --impl_->counters.live_events;
}

void sim_backend::record_event(int device, event_t event, stream_t stream) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  auto it = d.busy_until.find(stream);
  impl_->ev(event).complete_at = it == d.busy_until.end() ? impl_->now : std::max(impl_->now, it->second);
}

bool sim_backend::query_event(int, event_t event) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->fail_query_countdown && --impl_->fail_query_countdown == 0)
    throw backend_error("sim: injected failure of query_event(" + std::to_string(event) + ")");
  return impl_->ev(event).complete_at <= impl_->now;
}

void sim_backend::synchronize_event(int, event_t event) {
  std::lock_guard lock(impl_->mutex);
  impl_->now = std::max(impl_->now, impl_->ev(event).complete_at);
}

void sim_backend::synchronize_stream(int device, stream_t stream) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  auto it = d.busy_until.find(stream);
  if (it != d.busy_until.end()) impl_->now = std::max(impl_->now, it->second);
}

void sim_backend::synchronize_device(int device) {
  std::lock_guard lock(impl_->mutex);
  for (auto& [s, t] : impl_->dev(device).busy_until) impl_->now = std::max(impl_->now, t);
}

std::uint64_t sim_backend::now() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->now;
}

void sim_backend::advance_to(std::uint64_t time) {
  std::lock_guard lock(impl_->mutex);
  impl_->now = std::max(impl_->now, time);
}

void sim_backend::enqueue_work(int device, stream_t stream, std::uint64_t until) {
  std::lock_guard lock(impl_->mutex);
  auto& t = impl_->dev(device).busy_until.try_emplace(stream, impl_->now).first->second;
  t = std::max(t, until);
}

std::uint64_t sim_backend::busy_until(int device, stream_t stream) const {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  auto it = d.busy_until.find(stream);
  return it == d.busy_until.end() ? impl_->now : std::max(impl_->now, it->second);
}

void sim_backend::set_capacity(int device, std::size_t capacity_bytes) {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device).capacity_bytes = capacity_bytes;
}

void sim_backend::fail_segment_malloc_after(std::uint64_t n) {
  std::lock_guard lock(impl_->mutex);
  impl_->fail_malloc_countdown = n;
}

void sim_backend::fail_event_query_after(std::uint64_t n) {
  std::lock_guard lock(impl_->mutex);
  impl_->fail_query_countdown = n;
}

sim_counters sim_backend::counters() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->counters;
}

}  // namespace ccalloc

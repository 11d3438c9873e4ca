// The simulated device: host address space as device memory, a virtual clock
// for streams and events. See include/ccalloc/backend/sim_backend.hpp.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

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
    std::unordered_map<stream_t, std::vector<gate_t>> gated;  // stream -> closed gates it waits on
  };
  struct event {
    int device = 0;
    std::uint64_t complete_at = 0;
    std::vector<gate_t> gates;  // closed gates the work before the event waits on
  };
  struct gate {
    int device = 0;
    bool open = false;
    std::vector<stream_t> streams;  // streams that waited on it while closed
    std::vector<event_t> events;    // events recorded behind it while closed
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
  gate& gt(gate_t g, int on_device, const char* what) {
    auto it = gates.find(g);
    if (it == gates.end()) throw backend_error(std::string("sim: ") + what + ": unknown gate " + std::to_string(g));
    if (it->second.device != on_device)
      throw backend_error(std::string("sim: ") + what + ": gate " + std::to_string(g) + " belongs to device " +
                          std::to_string(it->second.device) + ", not " + std::to_string(on_device));
    return it->second;
  }
  // Forgets which closed gates `e`'s recorded work waited on.
  void unlink_gates(event_t e, event& ev) {
    for (gate_t g : ev.gates) {
      auto it = gates.find(g);
      if (it == gates.end()) continue;
      auto& list = it->second.events;
      list.erase(std::remove(list.begin(), list.end(), e), list.end());
    }
    ev.gates.clear();
  }
  [[noreturn]] static void throw_never(const std::string& what, gate_t g) {
    throw backend_error("sim: " + what + " would never return: it waits for closed gate " + std::to_string(g) +
                        " (open the gate first; a real device would deadlock)");
  }
  std::size_t charged(std::size_t size_bytes) const {
    const std::size_t g = options.granularity_bytes;
    return (size_bytes + g - 1) / g * g;
  }

  sim_options options;
  mutable std::mutex mutex;
  std::vector<device> devices;
  std::unordered_map<event_t, event> events;
  std::unordered_map<gate_t, gate> gates;
  event_t next_event = 1;
  gate_t next_gate = 1;
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
  auto& d = impl_->dev(device);
  d.gated.erase(stream);
  if (d.busy_until.erase(stream)) --impl_->counters.live_streams;
}

event_t sim_backend::create_event(int device) {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  const event_t e = impl_->next_event++;
  impl_->events.emplace(e, impl::event{device, 0, {}});
  ++impl_->counters.live_events;
  return e;
}

void sim_backend::destroy_event(int, event_t event) {
  std::lock_guard lock(impl_->mutex);
  auto it = impl_->events.find(event);
  if (it == impl_->events.end()) return;
  impl_->unlink_gates(event, it->second);
  impl_->events.erase(it);
  --impl_->counters.live_events;
}

void sim_backend::record_event(int device, event_t event, stream_t stream) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  auto it = d.busy_until.find(stream);
  auto& ev = impl_->ev(event);
  ev.complete_at = it == d.busy_until.end() ? impl_->now : std::max(impl_->now, it->second);
  if (!ev.gates.empty()) impl_->unlink_gates(event, ev);
  if (auto g = d.gated.find(stream); g != d.gated.end()) {
    ev.gates = g->second;
    for (gate_t id : ev.gates) impl_->gates.at(id).events.push_back(event);
  }
}

bool sim_backend::query_event(int, event_t event) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->fail_query_countdown && --impl_->fail_query_countdown == 0)
    throw backend_error("sim: injected failure of query_event(" + std::to_string(event) + ")");
  const auto& ev = impl_->ev(event);
  return ev.gates.empty() && ev.complete_at <= impl_->now;
}

void sim_backend::synchronize_event(int, event_t event) {
  std::lock_guard lock(impl_->mutex);
  const auto& ev = impl_->ev(event);
  if (!ev.gates.empty()) impl::throw_never("synchronize_event(event " + std::to_string(event) + ")", ev.gates.front());
  impl_->now = std::max(impl_->now, ev.complete_at);
}

void sim_backend::synchronize_stream(int device, stream_t stream) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  if (auto g = d.gated.find(stream); g != d.gated.end())
    impl::throw_never("synchronize_stream(stream " + std::to_string(stream) + ")", g->second.front());
  auto it = d.busy_until.find(stream);
  if (it != d.busy_until.end()) impl_->now = std::max(impl_->now, it->second);
}

void sim_backend::synchronize_device(int device) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  if (!d.gated.empty())
    impl::throw_never("synchronize_device(" + std::to_string(device) + ")", d.gated.begin()->second.front());
  for (auto& [s, t] : d.busy_until) impl_->now = std::max(impl_->now, t);
}

backend_capabilities sim_backend::capabilities() const {
  backend_capabilities c;
  c.gates = true;
  return c;
}

gate_t sim_backend::create_gate(int device) {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  const gate_t g = impl_->next_gate++;
  impl_->gates.emplace(g, impl::gate{device, false, {}, {}});
  ++impl_->counters.live_gates;
  return g;
}

void sim_backend::wait_gate(int device, stream_t stream, gate_t gate) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  auto& g = impl_->gt(gate, device, "wait_gate");
  d.busy_until.try_emplace(stream, impl_->now);  // any handle is accepted, as by enqueue_work
  if (g.open) return;
  auto& waits = d.gated[stream];
  if (std::find(waits.begin(), waits.end(), gate) != waits.end()) return;
  waits.push_back(gate);
  g.streams.push_back(stream);
}

void sim_backend::open_gate(int device, gate_t gate) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  auto& g = impl_->gt(gate, device, "open_gate");
  if (g.open) return;
  g.open = true;
  const std::uint64_t now = impl_->now;
  for (stream_t s : g.streams) {
    auto w = d.gated.find(s);
    if (w == d.gated.end()) continue;  // destroyed meanwhile
    w->second.erase(std::remove(w->second.begin(), w->second.end(), gate), w->second.end());
    if (!w->second.empty()) continue;  // still waits on another gate
    d.gated.erase(w);
    if (auto b = d.busy_until.find(s); b != d.busy_until.end()) b->second = std::max(b->second, now);
  }
  for (event_t e : g.events) {
    auto it = impl_->events.find(e);
    if (it == impl_->events.end()) continue;
    auto& waits = it->second.gates;
    waits.erase(std::remove(waits.begin(), waits.end(), gate), waits.end());
    it->second.complete_at = std::max(it->second.complete_at, now);
  }
  g.streams.clear();
  g.events.clear();
}

void sim_backend::destroy_gate(int device, gate_t gate) {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  if (!impl_->gt(gate, device, "destroy_gate").open)
    throw backend_error("sim: destroy_gate: gate " + std::to_string(gate) + " is still closed (open it first)");
  impl_->gates.erase(gate);
  --impl_->counters.live_gates;
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
  if (d.gated.count(stream) != 0) return ~std::uint64_t{0};
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

// The simulated device: host address space as device memory, a virtual clock
// for streams and events. See include/ccalloc/backend/sim_backend.hpp.
// Virtual memory, sharing, copies, host memory and peers: sim_backend_vm.cpp.
#include "sim_backend_impl.hpp"

namespace ccalloc {

namespace {
thread_local int tls_current_device = 0;
}  // namespace


sim_backend::sim_backend(sim_options options) {
  if (options.device_count < 1) throw backend_error("sim: device_count must be >= 1");
  if (options.device_count > max_device_count)
    throw backend_error("sim: device_count is " + std::to_string(options.device_count) + "; at most " +
                        std::to_string(max_device_count) + " devices (ccalloc::max_device_count)");
  if (options.granularity_bytes == 0 || (options.granularity_bytes & (options.granularity_bytes - 1)))
    throw backend_error("sim: granularity_bytes must be a power of two");
  impl_ = std::make_unique<impl>(options);
  impl_->fork.emplace(detail::fork_rank::backend,
                      detail::fork_hooks{impl_.get(),
                                         [](void* self) noexcept {
                                           auto& i = *static_cast<impl*>(self);
                                           i.mutex.lock();
                                           i.fork_snapshot();
                                         },
                                         [](void* self, bool in_child) noexcept {
                                           auto& i = *static_cast<impl*>(self);
                                           i.fork_adopt(in_child);
                                           i.mutex.unlock();
                                         }});
}

sim_backend::~sim_backend() {
  impl_->fork.reset();  // a fork under way finishes first
  // Mappings lie inside reservations: unmapping the reservations removes them.
  for (auto& [base, r] : impl_->reservations) ::munmap(reinterpret_cast<void*>(base), r.size_bytes);
  for (auto& [id, h] : impl_->handles)
    if (h.fd >= 0) ::close(h.fd);
  for (auto& [ptr, bytes] : impl_->host_memory) std::free(ptr);
  for (auto& d : impl_->devices) {
    for (auto& [ptr, bytes] : d.segments)
      if (!impl::in_arena(d, ptr)) ::munmap(ptr, bytes);
    if (d.arena_bytes != 0) ::munmap(reinterpret_cast<void*>(d.arena_base), d.arena_bytes);
    for (auto& [ptr, fd] : d.shared_segments) ::close(fd);
    for (auto& [ptr, bytes] : d.opened_segments) ::munmap(ptr, bytes);
    if (d.memfd >= 0) ::close(d.memfd);  // frees the handles' memory
  }
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
  // Address space only: pages cost memory only once touched. In the
  // device's arena (deterministic addresses), else wherever the host maps it.
  void* p = impl_->arena_take(d, charged);
  if (p == nullptr)
    p = ::mmap(nullptr, charged, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    // The simulated device has the memory; the host could not reserve the
    // address space for it (e.g. more than the process's virtual address
    // space). Not an out-of-memory of the device: say what failed.
    const int err = errno;
    const std::string what =
        "sim: segment_malloc(device " + std::to_string(device) + ", " + std::to_string(size_bytes) +
        " bytes): the host could not reserve the simulated memory: " + errno_text("mmap", err) +
        " (the simulated device has " + std::to_string(d.capacity_bytes - d.used_bytes) +
        " bytes free; the host's address space or memory limits, not the device, refused it)";
    if (err == ENOMEM) throw host_memory_error(what);
    throw backend_error(what);
  }
  try {
    d.segments.emplace(p, charged);
  } catch (...) {  // no host memory for the record: the segment goes back, nothing changed
    if (impl::in_arena(d, p)) impl_->arena_give(d, p, charged);
    else ::munmap(p, charged);
    throw;
  }
  ++d.plan_next;
  d.used_bytes += charged;
  impl_->counters.used_bytes += charged;
  ++impl_->counters.segment_mallocs;
  return p;
}

void sim_backend::place_segments(int device, std::vector<segment_placement> plan) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  const std::size_t g = impl_->options.granularity_bytes;
  for (const segment_placement& e : plan)
    if (e.offset_bytes % g != 0 || e.size_bytes == 0 || e.size_bytes % g != 0)
      throw invalid_argument_error("sim: place_segments(device " + std::to_string(device) + "): entry at offset " +
                                   std::to_string(e.offset_bytes) + " of " + std::to_string(e.size_bytes) +
                                   " bytes is not a nonzero multiple of the granularity (" + std::to_string(g) +
                                   " bytes)");
  d.plan = std::move(plan);
  d.plan_next = 0;
}

void sim_backend::segment_free(int device, void* ptr) {
  std::lock_guard lock(impl_->mutex);
  impl_->check_not_capturing(device, "segment_free");
  auto& d = impl_->dev(device);
  auto it = d.segments.find(ptr);
  if (it == d.segments.end())
    throw backend_error("sim: segment_free of " + std::to_string(reinterpret_cast<std::uintptr_t>(ptr)) +
                        ", which is not a live segment of device " + std::to_string(device));
  // cudaFree waits for the whole device: the host waited until every stream
  // of the device was idle (the clock jumps there, as in synchronize_device).
  // A stream behind a closed gate would never become idle: throw, as the GPU
  // would hang, before anything changes.
  if (impl_->options.segment_free_synchronizes) {
    if (!d.gated.empty())
      impl::throw_never("segment_free(device " + std::to_string(device) + ")", d.gated.begin()->second.front());
    for (auto& [s, t] : d.busy_until) impl_->now = std::max(impl_->now, t);
    impl_->now = std::max(impl_->now, d.destroyed_busy_until);
  }
  if (impl::in_arena(d, ptr)) impl_->arena_give(d, ptr, it->second);
  else ::munmap(ptr, it->second);
  if (auto shared = d.shared_segments.find(ptr); shared != d.shared_segments.end()) {
    ::close(shared->second);  // openers keep their mappings (a freed cudaMalloc would not)
    d.shared_segments.erase(shared);
  }
  d.used_bytes -= it->second;
  impl_->counters.used_bytes -= it->second;
  d.segments.erase(it);
  ++impl_->counters.segment_frees;
}

stream_t sim_backend::create_stream(int device) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  // Skip handles adopt_stream took.
  const auto taken = [&](stream_t s) {
    return std::any_of(impl_->devices.begin(), impl_->devices.end(),
                       [&](const impl::device& other) { return impl::created(other, s); });
  };
  stream_t s = impl_->next_stream++;
  while (taken(s)) s = impl_->next_stream++;
  d.busy_until.emplace(s, impl_->now);
  ++impl_->counters.live_streams;
  return s;
}

void sim_backend::adopt_stream(int device, stream_t stream) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  const std::string call = "sim: adopt_stream(device " + std::to_string(device) + ", stream " + std::to_string(stream) +
                           ")";
  if (stream == default_stream || stream == legacy_stream_handle || stream == per_thread_stream_handle ||
      is_per_thread_stream(stream))
    throw invalid_argument_error(call + ": the default streams' handles (0, 1, 2, per-thread) are not created");
  for (std::size_t i = 0; i < impl_->devices.size(); ++i)
    if (impl::created(impl_->devices[i], stream))
      throw invalid_argument_error(call + ": already a live stream of device " + std::to_string(i));
  d.busy_until.emplace(stream, impl_->now);
  ++impl_->counters.live_streams;
}

void sim_backend::destroy_stream(int device, stream_t stream) {
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  if (!impl::created(d, stream))
    throw invalid_argument_error("sim: destroy_stream: stream " + std::to_string(stream) +
                                 " is not a live stream that create_stream made on device " + std::to_string(device) +
                                 " (never created, destroyed already, a default stream, or another device's)");
  d.gated.erase(stream);
  d.work_start.erase(stream);
  if (auto it = d.busy_until.find(stream); it != d.busy_until.end())
    d.destroyed_busy_until = std::max(d.destroyed_busy_until, it->second);  // its queued work still runs
  d.busy_until.erase(stream);
  --impl_->counters.live_streams;
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
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  impl_->check_stream(device, stream, "record_event");
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
  ++impl_->counters.event_queries;
  if (impl_->fail_query_countdown && --impl_->fail_query_countdown == 0)
    throw backend_error("sim: injected failure of query_event(" + std::to_string(event) + ")");
  const auto& ev = impl_->ev(event);
  impl_->check_not_capturing(ev.device, "query_event");
  return ev.gates.empty() && ev.complete_at <= impl_->now;
}

void sim_backend::synchronize_event(int, event_t event) {
  std::lock_guard lock(impl_->mutex);
  const auto& ev = impl_->ev(event);
  impl_->check_not_capturing(ev.device, "synchronize_event");
  if (!ev.gates.empty()) impl::throw_never("synchronize_event(event " + std::to_string(event) + ")", ev.gates.front());
  impl_->now = std::max(impl_->now, ev.complete_at);
}

void sim_backend::stream_wait_event(int device, stream_t stream, event_t event) {
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  impl_->check_stream(device, stream, "stream_wait_event");
  const auto& ev = impl_->ev(event);
  if (ev.device != device)
    throw backend_error("sim: stream_wait_event: event " + std::to_string(event) + " is of device " +
                        std::to_string(ev.device) + ", not " + std::to_string(device));
  impl_->check_not_capturing(device, "stream_wait_event");
  if (impl_->fail_stream_wait_countdown && --impl_->fail_stream_wait_countdown == 0)
    throw backend_error("sim: stream_wait_event(stream " + std::to_string(stream) + ", event " +
                        std::to_string(event) + "): injected failure");
  auto& until = d.busy_until.try_emplace(stream, impl_->now).first->second;  // default streams: made on first use
  until = std::max(until, ev.complete_at);
  for (gate_t id : ev.gates) {  // the event's work waits on closed gates: so does the stream's from now on
    auto& waits = d.gated[stream];
    if (std::find(waits.begin(), waits.end(), id) != waits.end()) continue;
    waits.push_back(id);
    impl_->gates.at(id).streams.push_back(stream);
  }
  ++impl_->counters.stream_waits;
}

void sim_backend::synchronize_stream(int device, stream_t stream) {
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  impl_->check_stream(device, stream, "synchronize_stream");
  if (auto g = d.gated.find(stream); g != d.gated.end())
    impl::throw_never("synchronize_stream(stream " + std::to_string(stream) + ")", g->second.front());
  auto it = d.busy_until.find(stream);
  if (it != d.busy_until.end()) impl_->now = std::max(impl_->now, it->second);
}

void sim_backend::synchronize_device(int device) {
  std::lock_guard lock(impl_->mutex);
  impl_->check_not_capturing(device, "synchronize_device");
  auto& d = impl_->dev(device);
  if (!d.gated.empty())
    impl::throw_never("synchronize_device(" + std::to_string(device) + ")", d.gated.begin()->second.front());
  for (auto& [s, t] : d.busy_until) impl_->now = std::max(impl_->now, t);
  impl_->now = std::max(impl_->now, d.destroyed_busy_until);  // destroyed streams' work too
}

bool sim_backend::is_stream(int device, stream_t stream) {
  std::lock_guard lock(impl_->mutex);
  return stream == default_stream || is_calling_thread_stream(stream) || impl::created(impl_->dev(device), stream);
}

bool sim_backend::is_capturing(int device, stream_t stream) {
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  std::lock_guard lock(impl_->mutex);
  impl_->check_stream(device, stream, "is_capturing");
  const auto& c = impl_->dev(device).capturing;
  return std::find(c.begin(), c.end(), stream) != c.end();
}

void sim_backend::begin_capture(int device, stream_t stream) {
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  std::lock_guard lock(impl_->mutex);
  impl_->check_stream(device, stream, "begin_capture");
  auto& c = impl_->dev(device).capturing;
  if (std::find(c.begin(), c.end(), stream) != c.end())
    throw backend_error("sim: begin_capture: stream " + std::to_string(stream) + " of device " +
                        std::to_string(device) + " is capturing already");
  c.push_back(stream);
}

void sim_backend::end_capture(int device, stream_t stream) {
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  std::lock_guard lock(impl_->mutex);
  impl_->check_stream(device, stream, "end_capture");
  auto& c = impl_->dev(device).capturing;
  auto it = std::find(c.begin(), c.end(), stream);
  if (it == c.end())
    throw backend_error("sim: end_capture: stream " + std::to_string(stream) + " of device " +
                        std::to_string(device) + " is not capturing");
  c.erase(it);
}

backend_capabilities sim_backend::capabilities() const {
  backend_capabilities c;
  c.virtual_memory = impl_->vm_supported;
  c.peer_access = impl_->options.peer_access;
  c.gates = true;
  c.stream_wait = true;
  c.ipc = true;
  c.ipc_vm = impl_->vm_supported;
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
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  impl_->check_stream(device, stream, "wait_gate");
  auto& g = impl_->gt(gate, device, "wait_gate");
  d.busy_until.try_emplace(stream, impl_->now);  // the default streams' entries are made on first use
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

std::optional<std::uint64_t> sim_backend::host_time_us() const {
  std::lock_guard lock(impl_->mutex);
  switch (impl_->options.host_clock_mode) {
    case sim_options::host_clock::modeled:
      return impl_->host_clock.now_us();
    case sim_options::host_clock::steady:
      return *device_backend::host_time_us() + impl_->host_clock.now_us();
    case sim_options::host_clock::none:
      break;
  }
  return std::nullopt;
}

void sim_backend::set_host_time_us(std::uint64_t us) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->options.host_clock_mode == sim_options::host_clock::modeled) impl_->host_clock.set_base_us(us);
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
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  std::lock_guard lock(impl_->mutex);
  impl_->check_stream(device, stream, "enqueue_work");
  auto& d = impl_->dev(device);
  auto& t = d.busy_until.try_emplace(stream, impl_->now).first->second;
  d.work_start[stream] = std::max(impl_->now, t);  // after the work queued before (none: empty)
  t = std::max(t, until);
}

void sim_backend::use_memory(int device, const void* ptr, std::size_t size_bytes, stream_t stream) {
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  impl_->check_stream(device, stream, "use_memory");
  auto it = d.busy_until.find(stream);
  const std::uint64_t until = d.gated.count(stream) != 0 ? ~std::uint64_t{0}
                              : it == d.busy_until.end() ? impl_->now
                                                         : std::max(impl_->now, it->second);
  std::erase_if(d.in_use, [&](const impl::device::memory_use& u) { return u.until <= impl_->now; });
  if (size_bytes != 0 && impl_->unmapped_pages(reinterpret_cast<std::uintptr_t>(ptr), size_bytes) != 0)
    ++impl_->counters.unmapped_uses;
  if (until <= impl_->now || size_bytes == 0) return;
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  d.in_use.push_back({a, a + size_bytes, until});
  // The physical pages under the range (mapped ones): another stream's use
  // of the same page overlapping this one in time is an unsafe reuse.
  const auto start = d.work_start.find(stream);
  const std::uint64_t from = start == d.work_start.end() ? impl_->now : std::min(start->second, until);
  std::erase_if(d.handle_uses, [&](const impl::device::handle_use& u) { return u.until <= impl_->now; });
  auto m = impl_->mappings.upper_bound(a);
  if (m != impl_->mappings.begin()) --m;
  for (; m != impl_->mappings.end() && m->first < a + size_bytes; ++m) {
    if (m->first + m->second.size_bytes <= a || m->second.device != device) continue;
    const physical_handle_t h = m->second.handle;
    for (const auto& u : d.handle_uses)
      if (u.handle == h && u.stream != stream && from < u.until && u.from < until) {
        ++impl_->counters.unsafe_reuses;
        break;
      }
    d.handle_uses.push_back({h, stream, from, until});
  }
}

std::uint64_t sim_backend::busy_until(int device, stream_t stream) const {
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  impl_->check_stream(device, stream, "busy_until");
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

void sim_backend::fail_vm_create_after(std::uint64_t n) {
  std::lock_guard lock(impl_->mutex);
  impl_->fail_vm_create_countdown = n;
}

void sim_backend::fail_vm_map_after(std::uint64_t n) {
  std::lock_guard lock(impl_->mutex);
  impl_->fail_vm_map_countdown = n;
}

void sim_backend::fail_vm_unmap_after(std::uint64_t n) { fail_vm_unmap_after(n, 1); }

void sim_backend::fail_vm_unmap_after(std::uint64_t n, std::uint64_t count) {
  std::lock_guard lock(impl_->mutex);
  impl_->fail_vm_unmap_countdown = count == 0 ? 0 : n;
  impl_->fail_vm_unmap_repeats = n == 0 || count == 0 ? 0 : count - 1;
}

void sim_backend::fail_stream_wait_after(std::uint64_t n) {
  std::lock_guard lock(impl_->mutex);
  impl_->fail_stream_wait_countdown = n;
}

sim_counters sim_backend::counters() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->counters;
}

}  // namespace ccalloc

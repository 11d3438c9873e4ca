// Default implementations of the optional device_backend functions: each
// throws backend_error naming the function and the backend. And the
// resolution of the special stream handles, shared by every backend.
#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/base/errors.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cstdint>

namespace ccalloc {

namespace {
// A resolved per-thread default stream: the top bit, then the thread's serial
// (from 1, never reused). CUDA's stream handles are user-space pointers and
// the simulated device's are small counters: neither has the top bit set.
constexpr stream_t per_thread_tag = stream_t{1} << (sizeof(stream_t) * 8 - 1);

stream_t calling_thread_stream() noexcept {
  static std::atomic<std::uint64_t> next_serial{1};
  thread_local const stream_t handle =
      per_thread_tag | static_cast<stream_t>(next_serial.fetch_add(1, std::memory_order_relaxed));
  return handle;
}
}  // namespace

stream_t device_backend::resolve_stream(int device, stream_t stream) const {
  if (device < 0 || device >= device_count())
    throw backend_error(name() + ": resolve_stream: device " + std::to_string(device) + " out of range [0, " +
                        std::to_string(device_count()) + ")");
  if (stream == legacy_stream_handle) return default_stream;
  if (stream == per_thread_stream_handle) return calling_thread_stream();
  return stream;
}

bool device_backend::is_per_thread_stream(stream_t stream) noexcept { return (stream & per_thread_tag) != 0; }

bool device_backend::is_calling_thread_stream(stream_t stream) noexcept {
  return is_per_thread_stream(stream) && stream == calling_thread_stream();
}

void device_backend::throw_not_supported(const char* what) const {
  throw backend_error(std::string(what) + " is not supported by the '" + name() + "' backend");
}

void device_backend::stream_wait_event(int, stream_t, event_t) { throw_not_supported("stream_wait_event"); }
std::size_t device_backend::vm_granularity(int) const { throw_not_supported("vm_granularity"); }
void* device_backend::vm_reserve(int, std::size_t) { throw_not_supported("vm_reserve"); }
void device_backend::vm_release(int, void*, std::size_t) { throw_not_supported("vm_release"); }
bool device_backend::vm_create(int, std::size_t, physical_handle_t*) { throw_not_supported("vm_create"); }
void device_backend::vm_release_handle(int, physical_handle_t) { throw_not_supported("vm_release_handle"); }
void device_backend::vm_map(int, void*, std::size_t, physical_handle_t) { throw_not_supported("vm_map"); }
void device_backend::vm_unmap(int, void*, std::size_t) { throw_not_supported("vm_unmap"); }
void device_backend::vm_set_access(int, void*, std::size_t, int) { throw_not_supported("vm_set_access"); }
ipc_mem_handle device_backend::ipc_export_segment(int, void*) { throw_not_supported("ipc_export_segment"); }
void* device_backend::ipc_open_segment(int, const ipc_mem_handle&) { throw_not_supported("ipc_open_segment"); }
void device_backend::ipc_close_segment(int, void*) { throw_not_supported("ipc_close_segment"); }
shareable_handle device_backend::vm_export_handle(int, physical_handle_t) { throw_not_supported("vm_export_handle"); }
physical_handle_t device_backend::vm_import_handle(int, const shareable_handle&) {
  throw_not_supported("vm_import_handle");
}
void device_backend::memcpy_async(int, void*, const void*, std::size_t, stream_t) { throw_not_supported("memcpy_async"); }
void device_backend::memcpy_peer_async(void*, int, const void*, int, std::size_t, stream_t) {
  throw_not_supported("memcpy_peer_async");
}
void device_backend::copy_data(int, void*, const void*, std::size_t) { throw_not_supported("copy_data"); }
void* device_backend::host_alloc(int, std::size_t size_bytes) {
  return size_bytes == 0 ? nullptr : std::malloc(size_bytes);
}
void device_backend::host_free(int, void* ptr) noexcept { std::free(ptr); }
void device_backend::copy_to_host_async(int, void* host_dst, const void* device_src, std::size_t size_bytes,
                                        stream_t) {
  if (size_bytes > 0) std::memmove(host_dst, device_src, size_bytes);
}
void device_backend::copy_from_host_async(int, void* device_dst, const void* host_src, std::size_t size_bytes,
                                          stream_t) {
  if (size_bytes > 0) std::memmove(device_dst, host_src, size_bytes);
}
bool device_backend::can_access_peer(int, int) const { return false; }
bool device_backend::is_capturing(int, stream_t) { return false; }
bool device_backend::is_stream(int, stream_t) { return true; }
std::optional<std::uint64_t> device_backend::host_time_us() const {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}
void device_backend::enable_peer_access(int, int) { throw_not_supported("enable_peer_access"); }
gate_t device_backend::create_gate(int) { throw_not_supported("create_gate"); }
void device_backend::wait_gate(int, stream_t, gate_t) { throw_not_supported("wait_gate"); }
void device_backend::open_gate(int, gate_t) { throw_not_supported("open_gate"); }
void device_backend::destroy_gate(int, gate_t) { throw_not_supported("destroy_gate"); }

}  // namespace ccalloc

// The simulated device: host address space as device memory, a virtual clock
// for streams and events. See include/ccalloc/backend/sim_backend.hpp.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/detail/pointer_text.hpp>
#include <ccalloc/base/errors.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

namespace ccalloc {

namespace {
thread_local int tls_current_device = 0;

using detail::pointer_text;
std::string pointer_text(std::uintptr_t a) { return pointer_text(reinterpret_cast<const void*>(a)); }

// "sim: vm_map(device 0, 0x7f.., 2097152 bytes" (the caller closes it).
std::string call_text(const char* what, int device, const void* addr, std::size_t size_bytes) {
  return std::string("sim: ") + what + "(device " + std::to_string(device) + ", " + pointer_text(addr) + ", " +
         std::to_string(size_bytes) + " bytes";
}

// A call's text made only when an error quotes it (`call + "): ..."`): the
// calls that give memory back (vm_unmap, vm_release_handle, vm_release)
// allocate no host memory when they succeed, as a driver's do not use the
// program's operator new: an allocator may give back what a request made
// when host memory has run out.
struct lazy_call {
  const char* what;
  int device;
  const void* addr;  // call_text's address and size; nullptr: the handle instead
  std::size_t size_bytes;
  physical_handle_t handle = 0;
  [[nodiscard]] std::string text() const {
    if (addr == nullptr && handle != 0)
      return std::string("sim: ") + what + "(device " + std::to_string(device) + ", handle " + std::to_string(handle);
    return call_text(what, device, addr, size_bytes);
  }
};
std::string operator+(const lazy_call& call, const char* rest) { return call.text() + rest; }

// The errno text of a failed system call. `maps`: the call adds a mapping,
// so ENOMEM most likely means the per-process mapping limit.
std::string errno_text(const char* syscall, int err, bool maps = false) {
  std::string text = std::string(syscall) + " failed: " + std::strerror(err);
  if (maps && err == ENOMEM)
    text += " (the process may have reached vm.max_map_count mappings, see /proc/sys/vm/max_map_count)";
  return text;
}

// Replaces [addr, addr + size) with an inaccessible reservation placeholder.
bool map_placeholder(std::uintptr_t addr, std::size_t size_bytes) {
  return ::mmap(reinterpret_cast<void*>(addr), size_bytes, PROT_NONE,
                MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) != MAP_FAILED;
}
}  // namespace

struct sim_backend::impl {
  struct device {
    std::size_t capacity_bytes = 0;
    std::size_t used_bytes = 0;
    std::unordered_map<void*, std::size_t> segments;       // ptr -> mapped bytes
    // The device's own address space for segments (header: "Addresses"):
    // one host range reserved inaccessible on the first segment_malloc,
    // [arena_base, arena_base + arena_bytes); segments are mapped into it
    // first fit from its lowest address. arena_free holds its unused
    // stretches (offset -> bytes, coalesced, each a multiple of the
    // granularity). arena_bytes == 0: none (not made yet, or the host could
    // not reserve it: segments are then host mappings wherever mmap puts them).
    std::uintptr_t arena_base = 0;
    std::size_t arena_bytes = 0;
    bool arena_tried = false;
    std::map<std::size_t, std::size_t> arena_free;
    // place_segments: where the next successful segment_malloc calls go
    // (arena offsets); plan_next indexes the next call's entry.
    std::vector<segment_placement> plan;
    std::size_t plan_next = 0;
    std::unordered_map<void*, int> shared_segments;        // exported segment -> its memory file
    std::unordered_map<void*, std::size_t> opened_segments;  // ipc_open_segment result -> bytes
    std::unordered_map<stream_t, std::uint64_t> busy_until;  // stream -> time
    // The work of destroyed streams still runs (CUDA lets it complete): the
    // latest end among it, which device-wide waits wait for too.
    std::uint64_t destroyed_busy_until = 0;
    std::unordered_map<stream_t, std::vector<gate_t>> gated;  // stream -> closed gates it waits on
    // Physical memory: one sparse memory file (created on first vm_create).
    // Invariant: file_bytes = sum of live handles' sizes + sum of free_ranges.
    int memfd = -1;
    std::size_t file_bytes = 0;
    std::map<std::size_t, std::size_t> free_ranges;  // offset -> bytes, punched, coalesced
    std::vector<bool> peers_enabled;                 // enable_peer_access(this, peer)
    std::vector<stream_t> capturing;                 // streams between begin_capture and end_capture
    // use_memory: [begin, end) in use until the time (entries ended are dropped).
    struct memory_use {
      std::uintptr_t begin, end;
      std::uint64_t until;
    };
    std::vector<memory_use> in_use;
    // Where the work enqueue_work queued last on each stream starts (the
    // stream's busy-until before it, or the clock): use_memory's uses run
    // from there.
    std::unordered_map<stream_t, std::uint64_t> work_start;
    // use_memory on mapped pages: physical handle `handle` in use by
    // `stream`'s work over [from, until) (entries ended are dropped).
    struct handle_use {
      physical_handle_t handle;
      stream_t stream;
      std::uint64_t from, until;
    };
    std::vector<handle_use> handle_uses;
  };
  // Throws as CUDA does for a call not allowed while a stream captures.
  void check_not_capturing(int device_index, const char* what) {
    auto& d = dev(device_index);
    if (!d.capturing.empty())
      throw backend_error(std::string("sim: ") + what + " on device " + std::to_string(device_index) +
                          " while stream " + std::to_string(d.capturing.front()) +
                          " is capturing a graph (CUDA: cudaErrorStreamCaptureUnsupported)");
  }
  // Virtual memory. Each mapping lies inside one reservation of its device;
  // per handle, map_count = number of mappings of it.
  struct reservation {
    int device = 0;
    std::size_t size_bytes = 0;
  };
  struct mapping {
    int device = 0;
    std::size_t size_bytes = 0;
    physical_handle_t handle = 0;
    std::vector<int> peers;  // granted by vm_set_access, besides `device`
  };
  struct handle_state {
    int device = 0;
    std::size_t size_bytes = 0;
    std::size_t offset = 0;  // in the device's memory file, or in `fd`'s file when imported
    std::uint64_t map_count = 0;
    int fd = -1;  // imported (vm_import_handle): this process's own descriptor of the exporter's file
    bool exported = false;  // vm_export_handle gave it out: its range of the file is never reused
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
    for (auto& d : devices) {
      d.capacity_bytes = o.capacity_bytes;
      d.peers_enabled.assign(devices.size(), false);
    }
    const long page = ::sysconf(_SC_PAGESIZE);
    vm_supported = page > 0 && o.granularity_bytes % static_cast<std::size_t>(page) == 0;
  }

  device& dev(int index) {
    if (index < 0 || index >= static_cast<int>(devices.size()))
      throw backend_error("sim: device " + std::to_string(index) + " out of range [0, " +
                          std::to_string(devices.size()) + ")");
    return devices[static_cast<std::size_t>(index)];
  }
  // Throws invalid_argument_error unless `stream` (already resolved) is a
  // stream of `device_index`: the default stream, a per-thread default
  // stream, or one that create_stream or adopt_stream made on this device
  // and destroy_stream has not destroyed (CUDA fails such a call with
  // cudaErrorInvalidResourceHandle or worse).
  void check_stream(int device_index, stream_t stream, const char* what) {
    auto& d = dev(device_index);
    if (stream == default_stream || device_backend::is_per_thread_stream(stream) || d.busy_until.count(stream) != 0)
      return;
    throw invalid_argument_error(std::string("sim: ") + what + ": stream " + std::to_string(stream) +
                                 " is not a stream of device " + std::to_string(device_index) +
                                 " (never created by create_stream, destroyed, or another device's)");
  }
  // Whether `stream` is a live stream that create_stream or adopt_stream made.
  static bool created(const device& d, stream_t stream) {
    return stream != default_stream && !device_backend::is_per_thread_stream(stream) &&
           d.busy_until.count(stream) != 0;
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
  // Size and alignment rules shared by the vm_* functions (`call` is the
  // call's text, e.g. from call_text; addr 0 for calls without an address).
  template <class Call>  // std::string or lazy_call
  void check_granular(const Call& call, std::uintptr_t addr, std::size_t size_bytes) const {
    const std::size_t g = options.granularity_bytes;
    if (size_bytes == 0) throw backend_error(call + "): size must be > 0");
    if (size_bytes % g != 0)
      throw backend_error(call + "): size is not a multiple of the granularity (" + std::to_string(g) + " bytes)");
    if (addr % g != 0)
      throw backend_error(call + "): address is not aligned to the granularity (" + std::to_string(g) + " bytes)");
    if (addr > std::numeric_limits<std::uintptr_t>::max() - size_bytes)
      throw backend_error(call + "): range wraps around the address space");
  }
  // The entry of `ranges` (reservations or mappings: start -> {size_bytes})
  // whose range contains `addr`, or ranges.end().
  template <class Ranges>
  static auto containing(Ranges& ranges, std::uintptr_t addr) {
    auto it = ranges.upper_bound(addr);
    if (it == ranges.begin()) return ranges.end();
    --it;
    return addr < it->first + it->second.size_bytes ? it : ranges.end();
  }
  // The mappings that exactly tile [addr, addr + size_bytes) on device
  // `on_device`, in address order; throws naming the first address that
  // breaks the rule.
  std::vector<std::map<std::uintptr_t, mapping>::iterator> whole_mappings(const std::string& call, int on_device,
                                                                            std::uintptr_t addr,
                                                                            std::size_t size_bytes) {
    check_whole_mappings(call, on_device, addr, size_bytes);
    std::vector<std::map<std::uintptr_t, mapping>::iterator> found;
    for (std::uintptr_t at = addr; at < addr + size_bytes; at += found.back()->second.size_bytes)
      found.push_back(mappings.find(at));
    return found;
  }
  // Throws unless [addr, addr + size_bytes) is whole mappings of device
  // `on_device`; allocates nothing then.
  template <class Call>
  void check_whole_mappings(const Call& call, int on_device, std::uintptr_t addr, std::size_t size_bytes) const {
    check_granular(call, addr, size_bytes);
    const std::uintptr_t end = addr + size_bytes;
    for (std::uintptr_t at = addr; at < end;) {
      auto it = mappings.find(at);
      if (it == mappings.end()) {
        auto inside = containing(mappings, at);
        if (inside != mappings.end())
          throw backend_error(call + "): " + pointer_text(at) + " is inside the mapping at " +
                              pointer_text(inside->first) + " (" + std::to_string(inside->second.size_bytes) +
                              " bytes), not at its start (ranges must consist of whole mappings)");
        throw backend_error(call + "): nothing is mapped at " + pointer_text(at));
      }
      if (it->second.device != on_device)
        throw backend_error(call + "): the mapping at " + pointer_text(at) + " belongs to device " +
                            std::to_string(it->second.device));
      if (it->second.size_bytes > end - at)
        throw backend_error(call + "): the range ends inside the mapping at " + pointer_text(at) + " (" +
                            std::to_string(it->second.size_bytes) + " bytes; ranges must consist of whole mappings)");
      at += it->second.size_bytes;
    }
  }
  // Returns a handle's file range to the device's free ranges, merging with
  // its neighbours.
  static void free_range(device& d, std::size_t offset, std::size_t size_bytes) {
    auto next = d.free_ranges.lower_bound(offset);
    if (next != d.free_ranges.end() && offset + size_bytes == next->first) {
      size_bytes += next->second;
      next = d.free_ranges.erase(next);
    }
    if (next != d.free_ranges.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        prev->second += size_bytes;
        return;
      }
    }
    try {
      d.free_ranges.emplace(offset, size_bytes);
    } catch (const std::bad_alloc&) {  // no host memory: the range is not reused (the file grows instead)
    }
  }
  // The device's arena, reserved on first use: twice its capacity (rounded
  // up to the granularity), so that first fit finds room for every segment
  // the capacity allows even when freed stretches lie between live ones;
  // the capacity alone when the host refuses that; none when it refuses
  // both (or the capacity is beyond any address space).
  void make_arena(device& d) {
    d.arena_tried = true;
    const std::size_t g = options.granularity_bytes;
    if (d.capacity_bytes == 0 || d.capacity_bytes > (std::size_t{1} << 52)) return;
    const std::size_t cap = charged(d.capacity_bytes);
    for (const std::size_t size : {2 * cap, cap}) {
      void* raw = ::mmap(nullptr, size + g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (raw == MAP_FAILED) continue;
      const auto start = reinterpret_cast<std::uintptr_t>(raw);
      const std::uintptr_t base = (start + g - 1) & ~std::uintptr_t{g - 1};
      if (base > start) ::munmap(raw, base - start);
      if (const std::size_t tail = start + g - base; tail > 0) ::munmap(reinterpret_cast<void*>(base + size), tail);
      try {
        d.arena_free.emplace(0, size);
      } catch (...) {
        ::munmap(reinterpret_cast<void*>(base), size);
        d.arena_tried = false;
        throw;
      }
      d.arena_base = base;
      d.arena_bytes = size;
      return;
    }
  }
  // A stretch of `bytes` (a multiple of the granularity) of the device's
  // arena, mapped read/write: at the planned offset when the call's plan
  // entry (place_segments) has this size and its stretch is free, else from
  // the lowest free address; nullptr when the arena has no such stretch (or
  // no arena).
  void* arena_take(device& d, std::size_t bytes) {
    if (!d.arena_tried) make_arena(d);
    if (d.plan_next < d.plan.size()) {
      const segment_placement& want = d.plan[d.plan_next];
      if (want.size_bytes == bytes && want.offset_bytes <= d.arena_bytes) {
        auto it = d.arena_free.upper_bound(want.offset_bytes);
        if (it != d.arena_free.begin()) {
          --it;
          if (want.offset_bytes + bytes <= it->first + it->second) return arena_map(d, it, want.offset_bytes, bytes);
        }
      }
    }
    for (auto it = d.arena_free.begin(); it != d.arena_free.end(); ++it)
      if (it->second >= bytes) return arena_map(d, it, it->first, bytes);
    return nullptr;
  }
  // Maps [offset, offset + bytes) of the free stretch `it` (which holds it)
  // read/write and takes it out of the free stretches.
  void* arena_map(device& d, std::map<std::size_t, std::size_t>::iterator it, std::size_t offset, std::size_t bytes) {
    const std::uintptr_t addr = d.arena_base + offset;
    if (::mmap(reinterpret_cast<void*>(addr), bytes, PROT_READ | PROT_WRITE,
               MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) == MAP_FAILED)
      return nullptr;
    const std::size_t from = it->first, end = it->first + it->second;
    // The part before stays in its entry; the part after needs one (without
    // host memory for it, that stretch is not reused: address space only).
    if (offset > from) it->second = offset - from;
    else d.arena_free.erase(it);
    if (end > offset + bytes) {
      try {
        d.arena_free.emplace(offset + bytes, end - offset - bytes);
      } catch (const std::bad_alloc&) {
      }
    }
    return reinterpret_cast<void*>(addr);
  }
  // Whether [p, p + bytes) lies in the device's arena.
  static bool in_arena(const device& d, const void* p) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    return d.arena_bytes != 0 && a >= d.arena_base && a - d.arena_base < d.arena_bytes;
  }
  // Gives a segment's stretch back to the arena: inaccessible again (its
  // pages gone), coalesced with free neighbours. Throws nothing (a free runs
  // also when host memory has run out): a stretch that would need a new
  // entry then is not reused (address space only; the capacity goes back).
  void arena_give(device& d, void* p, std::size_t bytes) noexcept {
    map_placeholder(reinterpret_cast<std::uintptr_t>(p), bytes);
    const std::size_t offset = reinterpret_cast<std::uintptr_t>(p) - d.arena_base;
    auto next = d.arena_free.lower_bound(offset);
    const bool joins_next = next != d.arena_free.end() && offset + bytes == next->first;
    if (next != d.arena_free.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {  // grows in place
        prev->second += bytes;
        if (joins_next) {
          prev->second += next->second;
          d.arena_free.erase(next);
        }
        return;
      }
    }
    try {
      d.arena_free.emplace(offset, bytes + (joins_next ? next->second : 0));
      if (joins_next) d.arena_free.erase(next);
    } catch (const std::bad_alloc&) {
    }
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
  // Charged by every virtual-memory call; read only when
  // sim_options::host_clock_mode is not none. [mutex]
  modeled_host_clock host_clock;
  std::uint64_t fail_malloc_countdown = 0;
  std::uint64_t fail_query_countdown = 0;
  std::uint64_t fail_vm_create_countdown = 0;
  std::uint64_t fail_vm_map_countdown = 0;
  std::uint64_t fail_stream_wait_countdown = 0;
  bool vm_supported = false;  // granularity is a multiple of the host page size
  std::map<std::uintptr_t, reservation> reservations;  // base -> reservation
  std::map<std::uintptr_t, mapping> mappings;          // address -> mapping
  std::unordered_map<physical_handle_t, handle_state> handles;
  physical_handle_t next_handle = 1;
  std::unordered_map<void*, std::size_t> host_memory;  // host_alloc -> bytes
  sim_counters counters;

  // Pages of [a, a + size_bytes) inside a reservation with nothing mapped
  // at them (a device access there faults on a real device). [mutex]
  [[nodiscard]] std::uint64_t unmapped_pages(std::uintptr_t a, std::size_t size_bytes) const {
    const std::size_t page = options.granularity_bytes;
    std::uint64_t n = 0;
    for (std::uintptr_t p = a / page * page; p < a + size_bytes; p += page)
      if (containing(reservations, p) != reservations.end() && containing(mappings, p) == mappings.end()) ++n;
    return n;
  }
};

sim_backend::sim_backend(sim_options options) {
  if (options.device_count < 1) throw backend_error("sim: device_count must be >= 1");
  if (options.device_count > max_device_count)
    throw backend_error("sim: device_count is " + std::to_string(options.device_count) + "; at most " +
                        std::to_string(max_device_count) + " devices (ccalloc::max_device_count)");
  if (options.granularity_bytes == 0 || (options.granularity_bytes & (options.granularity_bytes - 1)))
    throw backend_error("sim: granularity_bytes must be a power of two");
  impl_ = std::make_unique<impl>(options);
}

sim_backend::~sim_backend() {
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
    throw backend_error("sim: segment_malloc(device " + std::to_string(device) + ", " + std::to_string(size_bytes) +
                        " bytes): the host could not reserve the simulated memory: " + errno_text("mmap", err) +
                        " (the simulated device has " + std::to_string(d.capacity_bytes - d.used_bytes) +
                        " bytes free; the host's address space or memory limits, not the device, refused it)");
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
  return stream == default_stream || is_per_thread_stream(stream) || impl::created(impl_->dev(device), stream);
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

// --- virtual memory ---------------------------------------------------------------

std::size_t sim_backend::vm_granularity(int device) const {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  if (!impl_->vm_supported) throw_not_supported("vm_granularity");
  return impl_->options.granularity_bytes;
}

void* sim_backend::vm_reserve(int device, std::size_t size_bytes) {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  if (!impl_->vm_supported) throw_not_supported("vm_reserve");
  const std::string call = "sim: vm_reserve(device " + std::to_string(device) + ", " + std::to_string(size_bytes) +
                           " bytes";
  impl_->check_granular(call, 0, size_bytes);
  const std::size_t g = impl_->options.granularity_bytes;
  if (size_bytes > std::numeric_limits<std::size_t>::max() - g) return nullptr;  // no address space that large
  // Over-reserve by one granule, then trim both ends to an aligned range.
  void* raw = ::mmap(nullptr, size_bytes + g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) {
    const int err = errno;
    if (err == ENOMEM) return nullptr;
    throw backend_error(call + "): " + errno_text("mmap", err));
  }
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t base = (start + g - 1) & ~std::uintptr_t{g - 1};
  if (base > start) ::munmap(raw, base - start);
  if (const std::size_t tail = start + g - base; tail > 0) ::munmap(reinterpret_cast<void*>(base + size_bytes), tail);
  impl_->reservations.emplace(base, impl::reservation{device, size_bytes});
  ++impl_->counters.live_reservations;
  impl_->counters.reserved_address_bytes += size_bytes;
  return reinterpret_cast<void*>(base);
}

void sim_backend::vm_release(int device, void* base, std::size_t size_bytes) {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  if (!impl_->vm_supported) throw_not_supported("vm_release");
  const lazy_call call{"vm_release", device, base, size_bytes};
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  auto it = impl_->reservations.find(addr);
  if (it == impl_->reservations.end()) {
    auto inside = impl::containing(impl_->reservations, addr);
    if (inside != impl_->reservations.end())
      throw backend_error(call + "): address is inside the reservation at " + pointer_text(inside->first) + " (" +
                          std::to_string(inside->second.size_bytes) + " bytes), not at its base");
    throw backend_error(call + "): address is not a live reservation");
  }
  const impl::reservation& r = it->second;
  if (r.device != device)
    throw backend_error(call + "): the reservation belongs to device " + std::to_string(r.device));
  if (size_bytes != r.size_bytes)
    throw backend_error(call + "): size differs from the reservation's " + std::to_string(r.size_bytes) +
                        " bytes (release whole reservations)");
  auto first = impl_->mappings.lower_bound(addr);
  if (first != impl_->mappings.end() && first->first < addr + r.size_bytes) {
    std::size_t inside = 0;
    for (auto m = first; m != impl_->mappings.end() && m->first < addr + r.size_bytes; ++m) ++inside;
    throw backend_error(call + "): " + std::to_string(inside) + " mapping(s) still inside, the first at " +
                        pointer_text(first->first) + " (vm_unmap them first)");
  }
  if (::munmap(base, size_bytes) != 0) throw backend_error(call + "): " + errno_text("munmap", errno));
  impl_->reservations.erase(it);
  --impl_->counters.live_reservations;
  impl_->counters.reserved_address_bytes -= size_bytes;
}

bool sim_backend::vm_create(int device, std::size_t size_bytes, physical_handle_t* handle) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  if (!impl_->vm_supported) throw_not_supported("vm_create");
  const std::string call = "sim: vm_create(device " + std::to_string(device) + ", " + std::to_string(size_bytes) +
                           " bytes";
  if (handle == nullptr) throw backend_error(call + "): handle is null");
  impl_->check_granular(call, 0, size_bytes);
  if ((impl_->fail_vm_create_countdown && --impl_->fail_vm_create_countdown == 0) ||  // injected fault
      size_bytes > d.capacity_bytes || d.used_bytes > d.capacity_bytes - size_bytes) {
    ++impl_->counters.failed_vm_creates;
    return false;
  }
  if (d.memfd < 0) {
    const std::string file = "ccalloc-sim-device-" + std::to_string(device);
    d.memfd = ::memfd_create(file.c_str(), MFD_CLOEXEC);
    if (d.memfd < 0) throw backend_error(call + "): " + errno_text("memfd_create", errno));
  }
  // First fit among the freed file ranges, else grow the (sparse) file.
  std::size_t offset = d.file_bytes;
  auto fit = std::find_if(d.free_ranges.begin(), d.free_ranges.end(),
                          [&](const auto& range) { return range.second >= size_bytes; });
  if (fit != d.free_ranges.end()) {
    offset = fit->first;
    const std::size_t rest = fit->second - size_bytes;
    d.free_ranges.erase(fit);
    if (rest > 0) d.free_ranges.emplace(offset + size_bytes, rest);
  } else {
    const std::size_t grown = d.file_bytes + size_bytes;
    if (grown < d.file_bytes || grown > static_cast<std::size_t>(std::numeric_limits<off_t>::max()))
      throw backend_error(call + "): the device's memory file would pass the largest file size");
    if (::ftruncate(d.memfd, static_cast<off_t>(grown)) != 0)
      throw backend_error(call + "): " + errno_text("ftruncate of the device's memory file", errno));
    d.file_bytes = grown;
  }
  const physical_handle_t id = impl_->next_handle++;
  impl_->handles.emplace(id, impl::handle_state{device, size_bytes, offset, 0});
  d.used_bytes += size_bytes;
  impl_->counters.used_bytes += size_bytes;
  impl_->counters.handle_bytes += size_bytes;
  ++impl_->counters.vm_creates;
  impl_->host_clock.charge_vm_create(size_bytes);
  ++impl_->counters.live_handles;
  *handle = id;
  return true;
}

void sim_backend::vm_release_handle(int device, physical_handle_t handle) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  if (!impl_->vm_supported) throw_not_supported("vm_release_handle");
  const lazy_call call{"vm_release_handle", device, nullptr, 0, handle};
  auto it = impl_->handles.find(handle);
  if (it == impl_->handles.end())
    throw backend_error(call + "): unknown handle (never created or already released)");
  const impl::handle_state& h = it->second;
  if (h.device != device) throw backend_error(call + "): the handle belongs to device " + std::to_string(h.device));
  if (h.map_count > 0) {
    auto m = std::find_if(impl_->mappings.begin(), impl_->mappings.end(),
                          [&](const auto& entry) { return entry.second.handle == handle; });
    throw backend_error(call + "): the handle is still mapped " + std::to_string(h.map_count) +
                        " time(s), the first at " + pointer_text(m->first) + " (vm_unmap it first)");
  }
  if (h.fd >= 0) {  // imported: the memory is the exporter's; only our descriptor goes
    ::close(h.fd);
    --impl_->counters.live_handles;
    ++impl_->counters.vm_release_handles;
    impl_->handles.erase(it);
    return;
  }
  // As on CUDA, an importer's mapping keeps exported memory alive: an
  // exported range stays as it is in the file (never punched out, never
  // handed out again; its pages go when every process has closed the
  // file). Other ranges give their pages back now and stay for reuse.
  if (!h.exported) {
    if (::fallocate(d.memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(h.offset),
                    static_cast<off_t>(h.size_bytes)) != 0)
      throw backend_error(call + "): " + errno_text("fallocate(FALLOC_FL_PUNCH_HOLE)", errno));
    impl::free_range(d, h.offset, h.size_bytes);
  }
  d.used_bytes -= h.size_bytes;
  impl_->counters.used_bytes -= h.size_bytes;
  impl_->counters.handle_bytes -= h.size_bytes;
  ++impl_->counters.vm_release_handles;
  --impl_->counters.live_handles;
  impl_->host_clock.charge_vm_release_handle(h.size_bytes);
  impl_->handles.erase(it);
}

void sim_backend::vm_map(int device, void* addr, std::size_t size_bytes, physical_handle_t handle) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  if (!impl_->vm_supported) throw_not_supported("vm_map");
  const std::string call = call_text("vm_map", device, addr, size_bytes) + ", handle " + std::to_string(handle);
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  impl_->check_granular(call, a, size_bytes);
  auto h = impl_->handles.find(handle);
  if (h == impl_->handles.end()) throw backend_error(call + "): unknown handle (never created or already released)");
  if (h->second.device != device)
    throw backend_error(call + "): the handle belongs to device " + std::to_string(h->second.device));
  if (size_bytes != h->second.size_bytes)
    throw backend_error(call + "): size differs from the handle's " + std::to_string(h->second.size_bytes) +
                        " bytes (vm_map maps whole handles)");
  auto in = impl::containing(impl_->reservations, a);
  if (in == impl_->reservations.end()) throw backend_error(call + "): address is not inside a reservation");
  const auto& [base, r] = *in;
  if (r.device != device)
    throw backend_error(call + "): address is inside a reservation of device " + std::to_string(r.device));
  if (size_bytes > base + r.size_bytes - a)
    throw backend_error(call + "): range passes the end of the reservation at " + pointer_text(base) + " (" +
                        std::to_string(r.size_bytes) + " bytes)");
  auto after = impl_->mappings.lower_bound(a + size_bytes);
  if (after != impl_->mappings.begin()) {
    const auto& [at, m] = *std::prev(after);
    if (at + m.size_bytes > a)
      throw backend_error(call + "): range overlaps the mapping at " + pointer_text(at) + " (" +
                          std::to_string(m.size_bytes) + " bytes)");
  }
  if (impl_->fail_vm_map_countdown && --impl_->fail_vm_map_countdown == 0)
    throw backend_error(call + "): injected failure");
  const int file = h->second.fd >= 0 ? h->second.fd : d.memfd;
  if (::mmap(addr, size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, file,
             static_cast<off_t>(h->second.offset)) == MAP_FAILED) {
    const int err = errno;
    // A failed MAP_FIXED mmap may have removed the placeholder: put it back.
    const bool restored = map_placeholder(a, size_bytes);
    throw backend_error(call + "): " + errno_text("mmap", err, /*maps=*/true) +
                        (restored ? "" : "; the range could not be reserved again"));
  }
  impl_->mappings.emplace(a, impl::mapping{device, size_bytes, handle, {}});
  ++h->second.map_count;
  ++impl_->counters.vm_maps;
  impl_->counters.mapped_bytes += size_bytes;
  impl_->host_clock.charge_vm_map(size_bytes);
}

void sim_backend::vm_unmap(int device, void* addr, std::size_t size_bytes) {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  if (!impl_->vm_supported) throw_not_supported("vm_unmap");
  const lazy_call call{"vm_unmap", device, addr, size_bytes};
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  impl_->check_whole_mappings(call, device, a, size_bytes);
  // One MAP_FIXED mmap swaps the pages for the placeholder: the range is
  // never free for another mapping in between.
  if (!map_placeholder(a, size_bytes))
    throw backend_error(call + "): " + errno_text("mmap of the reservation placeholder", errno, /*maps=*/true));
  for (std::uintptr_t at = a; at < a + size_bytes;) {
    const auto it = impl_->mappings.find(at);
    at += it->second.size_bytes;
    --impl_->handles.at(it->second.handle).map_count;
    impl_->counters.mapped_bytes -= it->second.size_bytes;
    ++impl_->counters.vm_unmaps;
    impl_->mappings.erase(it);
  }
  impl_->host_clock.charge_vm_unmap(size_bytes);
  auto& uses = impl_->dev(device).in_use;
  std::erase_if(uses, [&](const impl::device::memory_use& u) { return u.until <= impl_->now; });
  const std::size_t page = impl_->options.granularity_bytes;
  for (std::uintptr_t p = a; p < a + size_bytes; p += page)
    for (const auto& u : uses)
      if (u.begin < p + page && p < u.end) {
        ++impl_->counters.unsafe_unmaps;
        break;
      }
}

void sim_backend::vm_set_access(int device, void* addr, std::size_t size_bytes, int peer) {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  if (!impl_->vm_supported) throw_not_supported("vm_set_access");
  const std::string call = call_text("vm_set_access", device, addr, size_bytes) + ", peer " + std::to_string(peer);
  if (peer < 0 || peer >= static_cast<int>(impl_->devices.size()))
    throw backend_error(call + "): peer out of range [0, " + std::to_string(impl_->devices.size()) + ")");
  if (peer != device && !impl_->options.peer_access)
    throw backend_error(call + "): peer access is off (sim_options::peer_access)");
  const auto found = impl_->whole_mappings(call, device, reinterpret_cast<std::uintptr_t>(addr), size_bytes);
  if (peer == device) return;  // vm_map granted it already
  impl_->host_clock.charge_vm_set_access(size_bytes);
  for (auto it : found) {
    auto& peers = it->second.peers;
    if (std::find(peers.begin(), peers.end(), peer) == peers.end()) peers.push_back(peer);
  }
}

// --- inter-process sharing --------------------------------------------------------------

shareable_handle sim_backend::vm_export_handle(int device, physical_handle_t handle) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  if (!impl_->vm_supported) throw_not_supported("vm_export_handle");
  const std::string call =
      "sim: vm_export_handle(device " + std::to_string(device) + ", handle " + std::to_string(handle);
  auto it = impl_->handles.find(handle);
  if (it == impl_->handles.end())
    throw backend_error(call + "): unknown handle (never created or already released)");
  impl::handle_state& h = it->second;
  if (h.device != device) throw backend_error(call + "): the handle belongs to device " + std::to_string(h.device));
  const int fd = ::fcntl(h.fd >= 0 ? h.fd : d.memfd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) throw backend_error(call + "): " + errno_text("fcntl(F_DUPFD_CLOEXEC)", errno));
  h.exported = true;
  ++impl_->counters.vm_exports;
  return shareable_handle{fd, h.offset, h.size_bytes};
}

physical_handle_t sim_backend::vm_import_handle(int device, const shareable_handle& shared) {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  if (!impl_->vm_supported) throw_not_supported("vm_import_handle");
  const std::string call = "sim: vm_import_handle(device " + std::to_string(device) + ", fd " +
                           std::to_string(shared.fd) + ", offset " + std::to_string(shared.offset_bytes) + ", " +
                           std::to_string(shared.size_bytes) + " bytes";
  impl_->check_granular(call, 0, shared.size_bytes);
  if (shared.offset_bytes % impl_->options.granularity_bytes != 0)
    throw backend_error(call + "): offset is not a multiple of the granularity");
  struct stat st {};
  if (shared.fd < 0 || ::fstat(shared.fd, &st) != 0)
    throw backend_error(call + "): not an open file descriptor");
  if (!S_ISREG(st.st_mode)) throw backend_error(call + "): the descriptor is not a memory file");
  const auto file_bytes = static_cast<std::uint64_t>(st.st_size);
  if (shared.offset_bytes > file_bytes || shared.size_bytes > file_bytes - shared.offset_bytes)
    throw backend_error(call + "): the range passes the end of the file (" + std::to_string(file_bytes) +
                        " bytes; was the memory released?)");
  const int fd = ::fcntl(shared.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) throw backend_error(call + "): " + errno_text("fcntl(F_DUPFD_CLOEXEC)", errno));
  const physical_handle_t id = impl_->next_handle++;
  impl_->handles.emplace(id, impl::handle_state{device, shared.size_bytes, shared.offset_bytes, 0, fd});
  ++impl_->counters.vm_imports;
  ++impl_->counters.live_handles;
  return id;
}

namespace {
// The simulated cudaIpcMemHandle_t: which process's which descriptor holds
// the segment, and its size. Read back with /proc/<pid>/fd/<fd>.
struct sim_ipc_payload {
  char magic[8];
  std::uint32_t pid;
  std::int32_t fd;
  std::uint64_t size_bytes;
};
constexpr char sim_ipc_magic[8] = {'s', 'i', 'm', 'i', 'p', 'c', '0', '1'};
static_assert(sizeof(sim_ipc_payload) <= sizeof(ipc_mem_handle::bytes));
}  // namespace

ipc_mem_handle sim_backend::ipc_export_segment(int device, void* base) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  const std::string call = "sim: ipc_export_segment(device " + std::to_string(device) + ", " + pointer_text(base);
  auto seg = d.segments.find(base);
  if (seg == d.segments.end()) throw backend_error(call + "): not a live segment of the device");
  int fd = -1;
  if (auto shared = d.shared_segments.find(base); shared != d.shared_segments.end()) {
    fd = shared->second;
  } else {
    // Move the segment into a memory file, in place: copy its bytes into the
    // file, then map the file over the segment (same address, same bytes).
    fd = ::memfd_create("ccalloc-sim-ipc-segment", MFD_CLOEXEC);
    if (fd < 0) throw backend_error(call + "): " + errno_text("memfd_create", errno));
    void* tmp = MAP_FAILED;
    if (::ftruncate(fd, static_cast<off_t>(seg->second)) == 0)
      tmp = ::mmap(nullptr, seg->second, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (tmp == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      throw backend_error(call + "): " + errno_text("ftruncate/mmap of the segment's memory file", err));
    }
    std::memcpy(tmp, base, seg->second);
    ::munmap(tmp, seg->second);
    if (::mmap(base, seg->second, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      throw backend_error(call + "): " + errno_text("mmap", err, /*maps=*/true));
    }
    d.shared_segments.emplace(base, fd);
  }
  sim_ipc_payload payload{};
  std::memcpy(payload.magic, sim_ipc_magic, sizeof payload.magic);
  payload.pid = static_cast<std::uint32_t>(::getpid());
  payload.fd = fd;
  payload.size_bytes = seg->second;
  ipc_mem_handle out;
  std::memcpy(out.bytes.data(), &payload, sizeof payload);
  return out;
}

void* sim_backend::ipc_open_segment(int device, const ipc_mem_handle& handle) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  sim_ipc_payload payload{};
  std::memcpy(&payload, handle.bytes.data(), sizeof payload);
  const std::string call = "sim: ipc_open_segment(device " + std::to_string(device) + ")";
  if (std::memcmp(payload.magic, sim_ipc_magic, sizeof payload.magic) != 0)
    throw backend_error(call + ": not a handle of the simulated device");
  if (payload.pid == static_cast<std::uint32_t>(::getpid()))
    throw backend_error(call + ": the handle comes from this process (CUDA refuses that too; use the pointer)");
  const std::string path = "/proc/" + std::to_string(payload.pid) + "/fd/" + std::to_string(payload.fd);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0)
    throw backend_error(call + ": " + errno_text(("open " + path).c_str(), errno) +
                        " (has the producer exited or freed the segment?)");
  struct stat st {};
  void* p = MAP_FAILED;
  if (::fstat(fd, &st) == 0 && static_cast<std::uint64_t>(st.st_size) == payload.size_bytes)
    p = ::mmap(nullptr, payload.size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    throw backend_error(call + ": " + path + " is not the exported segment (size differs or mmap failed: " +
                        std::strerror(err) + ")");
  d.opened_segments.emplace(p, payload.size_bytes);
  return p;
}

void sim_backend::ipc_close_segment(int device, void* ptr) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  auto it = d.opened_segments.find(ptr);
  if (it == d.opened_segments.end())
    throw backend_error("sim: ipc_close_segment(device " + std::to_string(device) + ", " + pointer_text(ptr) +
                        "): not a segment opened with ipc_open_segment on this device");
  ::munmap(ptr, it->second);
  d.opened_segments.erase(it);
}

// --- copies ------------------------------------------------------------------------------

void sim_backend::memcpy_async(int device, void* dst, const void* src, std::size_t size_bytes, stream_t stream) {
  stream = resolve_stream(device, stream);  // the special handles, on this thread
  {
    std::lock_guard lock(impl_->mutex);
    impl_->check_stream(device, stream, "memcpy_async");
    ++impl_->counters.memcpy_async_calls;
  }
  if (size_bytes > 0) std::memmove(dst, src, size_bytes);
}

void sim_backend::memcpy_peer_async(void* dst, int dst_device, const void* src, int src_device,
                                    std::size_t size_bytes, stream_t stream) {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->dev(dst_device);
    impl_->dev(src_device);
    // A stream of either device (the special handles: the default streams).
    if (stream != legacy_stream_handle && stream != per_thread_stream_handle &&
        !impl::created(impl_->dev(src_device), stream))
      impl_->check_stream(dst_device, stream, "memcpy_peer_async");
    ++impl_->counters.memcpy_peer_async_calls;
  }
  if (size_bytes > 0) std::memmove(dst, src, size_bytes);
}

void sim_backend::copy_data(int device, void* dst, const void* src, std::size_t size_bytes) {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->dev(device);
    ++impl_->counters.copy_data_calls;
  }
  if (size_bytes > 0) std::memmove(dst, src, size_bytes);
}

// --- host memory and host copies ---------------------------------------------------------

void* sim_backend::host_alloc(int device, std::size_t size_bytes) {
  if (size_bytes == 0) return nullptr;
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  void* p = std::malloc(size_bytes);
  if (p == nullptr) return nullptr;
  try {
    impl_->host_memory.emplace(p, size_bytes);
  } catch (...) {
    std::free(p);
    return nullptr;
  }
  ++impl_->counters.host_allocs;
  impl_->counters.host_bytes += size_bytes;
  return p;
}

void sim_backend::host_free(int, void* ptr) noexcept {
  if (ptr == nullptr) return;
  std::lock_guard lock(impl_->mutex);
  if (auto it = impl_->host_memory.find(ptr); it != impl_->host_memory.end()) {
    impl_->counters.host_bytes -= it->second;
    impl_->host_memory.erase(it);
  }
  std::free(ptr);
}

void sim_backend::copy_to_host_async(int device, void* host_dst, const void* device_src, std::size_t size_bytes,
                                     stream_t stream) {
  stream = resolve_stream(device, stream);
  {
    std::lock_guard lock(impl_->mutex);
    impl_->check_stream(device, stream, "copy_to_host_async");
    if (size_bytes == 0) return;
    if (impl_->unmapped_pages(reinterpret_cast<std::uintptr_t>(device_src), size_bytes) != 0) {
      ++impl_->counters.unmapped_uses;
      return;  // a fault on a real device: nothing is read
    }
    impl_->counters.bytes_to_host += size_bytes;
    impl_->host_clock.charge_host_copy(size_bytes);
  }
  std::memmove(host_dst, device_src, size_bytes);
  use_memory(device, device_src, size_bytes, stream);  // the copy is stream work reading the range
}

void sim_backend::copy_from_host_async(int device, void* device_dst, const void* host_src, std::size_t size_bytes,
                                       stream_t stream) {
  stream = resolve_stream(device, stream);
  {
    std::lock_guard lock(impl_->mutex);
    impl_->check_stream(device, stream, "copy_from_host_async");
    if (size_bytes == 0) return;
    if (impl_->unmapped_pages(reinterpret_cast<std::uintptr_t>(device_dst), size_bytes) != 0) {
      ++impl_->counters.unmapped_uses;
      return;
    }
    impl_->counters.bytes_from_host += size_bytes;
    impl_->host_clock.charge_host_copy(size_bytes);
  }
  std::memmove(device_dst, host_src, size_bytes);
  use_memory(device, device_dst, size_bytes, stream);  // the copy is stream work writing the range
}

// --- peers ----------------------------------------------------------------------------

bool sim_backend::can_access_peer(int device, int peer) const {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  impl_->dev(peer);
  return device != peer && impl_->options.peer_access;
}

void sim_backend::enable_peer_access(int device, int peer) {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  impl_->dev(peer);
  if (!impl_->options.peer_access) throw_not_supported("enable_peer_access");
  if (device == peer)
    throw backend_error("sim: enable_peer_access(device " + std::to_string(device) + ", peer " +
                        std::to_string(peer) + "): a device cannot enable peer access to itself");
  d.peers_enabled[static_cast<std::size_t>(peer)] = true;
}

bool sim_backend::peer_access_enabled(int device, int peer) const {
  std::lock_guard lock(impl_->mutex);
  auto& d = impl_->dev(device);
  impl_->dev(peer);
  return d.peers_enabled[static_cast<std::size_t>(peer)];
}

bool sim_backend::peer_can_access(int device, const void* addr, int peer) const {
  std::lock_guard lock(impl_->mutex);
  impl_->dev(device);
  impl_->dev(peer);
  auto it = impl::containing(impl_->mappings, reinterpret_cast<std::uintptr_t>(addr));
  if (it == impl_->mappings.end() || it->second.device != device) return false;
  const auto& peers = it->second.peers;
  return peer == device || std::find(peers.begin(), peers.end(), peer) != peers.end();
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

void sim_backend::fail_stream_wait_after(std::uint64_t n) {
  std::lock_guard lock(impl_->mutex);
  impl_->fail_stream_wait_countdown = n;
}

sim_counters sim_backend::counters() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->counters;
}

}  // namespace ccalloc

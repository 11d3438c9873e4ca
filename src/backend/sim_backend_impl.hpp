// The simulated device's state (sim_backend::impl) and the helpers its
// files share: sim_backend.cpp (devices, segments, streams, events, capture,
// gates, the clock, fault injection) and sim_backend_vm.cpp (virtual memory,
// inter-process sharing, copies, host memory, peers). Private to them.
#pragma once

#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/detail/fork_handlers.hpp>
#include <ccalloc/base/detail/pointer_text.hpp>
#include <ccalloc/base/errors.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

namespace ccalloc {

namespace sim_detail {


using detail::pointer_text;
inline std::string pointer_text(std::uintptr_t a) { return pointer_text(reinterpret_cast<const void*>(a)); }

// "sim: vm_map(device 0, 0x7f.., 2097152 bytes" (the caller closes it).
inline std::string call_text(const char* what, int device, const void* addr, std::size_t size_bytes) {
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
inline std::string operator+(const lazy_call& call, const char* rest) { return call.text() + rest; }

// The decimal number at the start of file `path` (/proc and /sys files),
// or nothing. Reads with a buffer on the stack: it runs where an mmap has
// just failed, and allocates nothing.
inline std::optional<std::uint64_t> read_first_number(const char* path) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char buf[64];
  const ssize_t n = ::read(fd, buf, sizeof buf);
  ::close(fd);
  std::uint64_t value = 0;
  ssize_t i = 0;
  for (; i < n && buf[i] >= '0' && buf[i] <= '9'; ++i) value = value * 10 + static_cast<std::uint64_t>(buf[i] - '0');
  if (i == 0) return std::nullopt;
  return value;
}

// The number of the process's mappings (lines of /proc/self/maps), or nothing.
inline std::optional<std::uint64_t> count_mappings() {
  const int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char buf[4096];
  std::uint64_t lines = 0;
  ssize_t n = 0;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) lines += static_cast<std::uint64_t>(std::count(buf, buf + n, '\n'));
  ::close(fd);
  if (n < 0) return std::nullopt;
  return lines;
}

// Why an mmap adding a mapping of `bytes` failed with ENOMEM: the
// process's address-space limit (RLIMIT_AS, ulimit -v) when what it maps
// plus `bytes` passes it (over the limit, Linux refuses even an mmap that
// only replaces a range), the mapping limit vm.max_map_count when the
// process is at it, else both as possible causes.
inline std::string mapping_limit_hint(std::size_t bytes) {
  rlimit as{};
  const bool as_limited = ::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY;
  const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const std::optional<std::uint64_t> pages = read_first_number("/proc/self/statm");  // its size, in pages
  if (as_limited && pages && *pages * page + bytes > as.rlim_cur)
    return " (the process maps " + std::to_string(*pages * page) + " bytes, and " + std::to_string(bytes) +
           " more pass its address-space limit RLIMIT_AS (ulimit -v) of " + std::to_string(as.rlim_cur) +
           " bytes: raise the limit)";
  const std::optional<std::uint64_t> mappings = count_mappings();
  const std::optional<std::uint64_t> most = read_first_number("/proc/sys/vm/max_map_count");
  // A mapping inside a reservation splits it: up to 2 more at once.
  if (mappings && most && *mappings + 2 >= *most)
    return " (the process has " + std::to_string(*mappings) + " mappings, at its limit vm.max_map_count of " +
           std::to_string(*most) + ": raise it, see /proc/sys/vm/max_map_count, or use a larger granularity)";
  std::string text = " (the process may have reached vm.max_map_count mappings, see /proc/sys/vm/max_map_count";
  if (as_limited)
    text += ", or its address-space limit RLIMIT_AS (ulimit -v) of " + std::to_string(as.rlim_cur) + " bytes";
  return text + ")";
}

// The errno text of a failed system call. `maps`: the call adds a mapping
// of `bytes`, so ENOMEM means a limit on mappings (mapping_limit_hint).
inline std::string errno_text(const char* syscall, int err, bool maps = false, std::size_t bytes = 0) {
  std::string text = std::string(syscall) + " failed: " + std::strerror(err);
  if (maps && err == ENOMEM) text += mapping_limit_hint(bytes);
  return text;
}

// Replaces [addr, addr + size) with an inaccessible reservation placeholder.
inline bool map_placeholder(std::uintptr_t addr, std::size_t size_bytes) {
  return ::mmap(reinterpret_cast<void*>(addr), size_bytes, PROT_NONE,
                MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) != MAP_FAILED;
}

}  // namespace sim_detail

// Private to the two sim_backend files: their error texts name the calls.
using namespace sim_detail;  // NOLINT(google-build-using-namespace)

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
    // Around a fork (fork_snapshot): copies of memfd and of each shared
    // segment's file as they were at the fork, for the child (-1: none).
    int fork_memfd = -1;
    std::vector<std::pair<void*, int>> fork_shared;
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
  std::uint64_t fail_vm_unmap_countdown = 0;
  std::uint64_t fail_vm_unmap_repeats = 0;  // refusals left after the countdown's, in a row
  std::uint64_t fail_stream_wait_countdown = 0;
  bool vm_supported = false;  // granularity is a multiple of the host page size
  std::map<std::uintptr_t, reservation> reservations;  // base -> reservation
  // Where this backend's reservations go (place_reservation): below
  // reservation_floor (the lowest it has placed; 0 before the first), or
  // in a slot a released reservation left (base -> bytes). [mutex]
  std::uintptr_t reservation_floor = 0;
  std::map<std::uintptr_t, std::size_t> released_slots;

  // Where vm_reserve puts `size_bytes` (a multiple of the granularity), as a
  // driver's top-down virtual-address allocator would from its own books:
  // the highest slot a released reservation of this backend left that
  // holds it, else below the lowest reservation this backend placed (with
  // a guard: the host's small mappings, such as the allocator's page
  // tables, land top down just below the lowest mapping; larger guards
  // step over another backend's range). Each place is taken with
  // MAP_FIXED_NOREPLACE; returns the base, reserved, or 0 when there is no
  // such place yet (the first reservation) or every try found another
  // mapping there: the caller then takes whatever mmap gives. So which of
  // two reservations is lower (the best fit's tie-break between equal free
  // blocks) follows this backend's own calls, not other threads' mappings
  // (two replays at once in one process place their blocks the same way as
  // one alone). [mutex]
  [[nodiscard]] std::uintptr_t place_reservation(std::size_t size_bytes) const noexcept {
    const std::uintptr_t g = options.granularity_bytes;
    const auto take = [&](std::uintptr_t at) {
      void* p = ::mmap(reinterpret_cast<void*>(at), size_bytes, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
      if (p == reinterpret_cast<void*>(at)) return true;
      if (p != MAP_FAILED) ::munmap(p, size_bytes);  // a kernel without MAP_FIXED_NOREPLACE took it as a hint
      return false;
    };
    if (reservation_floor == 0 || size_bytes == 0) return 0;
    for (auto it = released_slots.rbegin(); it != released_slots.rend(); ++it)
      if (it->second >= size_bytes) {
        const std::uintptr_t at = (it->first + it->second - size_bytes) & ~(g - 1);
        if (at >= it->first && take(at)) return at;
      }
    for (const int shift : {30, 33, 36, 39, 41}) {
      const std::uintptr_t guard = std::uintptr_t{1} << shift;
      if (reservation_floor < size_bytes + guard + g) break;
      const std::uintptr_t at = (reservation_floor - size_bytes - guard) & ~(g - 1);
      if (take(at)) return at;
    }
    return 0;
  }
  // The slot a released reservation leaves, for place_reservation. A
  // release never fails for want of host memory (the allocator gives
  // reservations back on its error paths): without it, the slot is not
  // reused. Never throws.
  void note_released(std::uintptr_t base, std::size_t size_bytes) noexcept {
    try {
      released_slots.emplace(base, size_bytes);
    } catch (const std::bad_alloc&) {  // placement only: a later reservation goes below instead
    }
  }
  // Books a reservation at [base, base + size_bytes): off the released
  // slots it overlaps (what is left of a slot stays one, unless the host
  // is out of memory: then it is forgotten), and the floor. Never throws.
  void note_reserved(std::uintptr_t base, std::size_t size_bytes) noexcept {
    const std::uintptr_t end = base + size_bytes;
    for (auto it = released_slots.begin(); it != released_slots.end();) {
      const std::uintptr_t lo = it->first, hi = it->first + it->second;
      if (hi <= base || lo >= end) {
        ++it;
        continue;
      }
      it = released_slots.erase(it);
      try {
        if (lo < base) released_slots.emplace(lo, base - lo);
        if (hi > end) released_slots.emplace(end, hi - end);
      } catch (const std::bad_alloc&) {  // the remainder is not reused: placement only, nothing leaks
      }
    }
    if (reservation_floor == 0 || base < reservation_floor) reservation_floor = base;
  }
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

  // Around a fork (base/detail/fork_handlers.hpp): `mutex`, so that the
  // child's device calls find it free, and the device's memory files. Plain
  // segments are private host mappings, which the child gets copied on
  // write; physical memory (vm_create) and exported segments are shared
  // memory files, which the parent and the child would otherwise share and
  // both manage (one's release punching out or cutting off the other's
  // pages). So the parent copies each file's data, under `mutex` with
  // every allocator lock held, and the child maps its copies where the
  // files were mapped: the child's device memory is the parent's at the
  // fork, its own from then on. Files of other processes' memory (imported
  // handles, opened segments) stay shared, as IPC means them to be.
  std::optional<detail::fork_registration> fork;

  // Copies the data of `from` ([0, bytes), holes left out) into a new
  // memory file; -1 when the host refuses (the caller says so).
  static int copy_memory_file(int from, std::size_t bytes) noexcept {
    const int to = ::memfd_create("ccalloc-sim-device-copy", MFD_CLOEXEC);
    if (to < 0) return -1;
    if (::ftruncate(to, static_cast<off_t>(bytes)) != 0) {
      ::close(to);
      return -1;
    }
    char buffer[1 << 16];
    off_t at = 0;
    while (static_cast<std::size_t>(at) < bytes) {
      const off_t data = ::lseek(from, at, SEEK_DATA);
      if (data < 0) break;  // ENXIO: only a hole is left
      off_t hole = ::lseek(from, data, SEEK_HOLE);
      if (hole < 0 || static_cast<std::size_t>(hole) > bytes) hole = static_cast<off_t>(bytes);
      for (off_t p = data; p < hole;) {
        const ssize_t n = ::pread(from, buffer, std::min<std::size_t>(sizeof buffer, static_cast<std::size_t>(hole - p)), p);
        if (n <= 0 || ::pwrite(to, buffer, static_cast<std::size_t>(n), p) != n) {
          ::close(to);
          return -1;
        }
        p += n;
      }
      at = hole;
    }
    return to;
  }
  // [mutex] Before the fork: the copies.
  void fork_snapshot() noexcept {
    for (device& d : devices) {
      if (d.memfd >= 0) d.fork_memfd = copy_memory_file(d.memfd, d.file_bytes);
      for (const auto& [base, fd] : d.shared_segments) {
        const int copy = copy_memory_file(fd, segments_bytes(d, base));
        try {
          d.fork_shared.emplace_back(base, copy);
        } catch (...) {
          if (copy >= 0) ::close(copy);
        }
      }
    }
  }
  [[nodiscard]] static std::size_t segments_bytes(const device& d, void* base) noexcept {
    const auto it = d.segments.find(base);
    return it == d.segments.end() ? 0 : it->second;
  }
  // [mutex] After the fork: the parent drops the copies; the child maps them
  // over its shared mappings (what it cannot copy or map stays shared, and
  // it says so on stderr).
  void fork_adopt(bool in_child) noexcept {
    bool all = true;
    for (std::size_t i = 0; i < devices.size(); ++i) {
      device& d = devices[i];
      if (!in_child) {
        if (d.fork_memfd >= 0) ::close(d.fork_memfd);
        for (const auto& [base, fd] : d.fork_shared)
          if (fd >= 0) ::close(fd);
      } else {
        if (d.memfd >= 0 && d.fork_memfd < 0) all = false;
        if (d.fork_memfd >= 0) {
          for (const auto& [addr, m] : mappings) {
            const auto h = handles.find(m.handle);
            if (m.device != static_cast<int>(i) || h == handles.end() || h->second.fd >= 0) continue;
            all = ::mmap(reinterpret_cast<void*>(addr), m.size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                         d.fork_memfd, static_cast<off_t>(h->second.offset)) != MAP_FAILED && all;
          }
          ::close(d.memfd);
          d.memfd = d.fork_memfd;
        }
        for (auto& [base, copy] : d.fork_shared) {
          const auto it = d.shared_segments.find(base);
          if (copy < 0 || it == d.shared_segments.end() ||
              ::mmap(base, segments_bytes(d, base), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, copy, 0) ==
                  MAP_FAILED) {
            all = false;
            if (copy >= 0) ::close(copy);
            continue;
          }
          ::close(it->second);
          it->second = copy;
        }
      }
      d.fork_memfd = -1;
      d.fork_shared.clear();
    }
    if (!all)
      std::fputs("ccalloc: warning: sim: the host could not copy the simulated device's memory files for this fork() "
                 "child: some of its device memory stays shared with the parent\n",
                 stderr);
  }
};

}  // namespace ccalloc

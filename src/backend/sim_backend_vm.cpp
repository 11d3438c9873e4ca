// The simulated device: virtual memory (reservations, physical handles,
// mappings, access), inter-process sharing, copies, host memory and peers.
// See include/ccalloc/backend/sim_backend.hpp.
#include "sim_backend_impl.hpp"

namespace ccalloc {

// --- virtual memory ---------------------------------------------------------------

namespace {

// What a failed growth of the device's memory file to `grown` bytes adds
// when the process's file-size limit refused it (EFBIG under ulimit -f):
// the limit and the way out. Empty otherwise.
std::string file_size_limit_text(int err, std::size_t grown, std::size_t capacity_bytes) {
  rlimit limit{};
  if (err != EFBIG || ::getrlimit(RLIMIT_FSIZE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY ||
      grown <= limit.rlim_cur)
    return "";
  return " (the simulated device keeps its memory in a file, and the process's file-size limit RLIMIT_FSIZE "
         "(ulimit -f) of " + std::to_string(limit.rlim_cur) + " bytes is below the " + std::to_string(grown) +
         " bytes it needs now, of the device's " + std::to_string(capacity_bytes) +
         " bytes: raise the limit (ulimit -f unlimited) or give the device less memory (ccalloc replay "
         "--device-memory, the sim backend's capacity))";
}

}  // namespace

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
  std::uintptr_t base = impl_->place_reservation(size_bytes);
  if (base == 0) {
    // Over-reserve by one granule, then trim both ends to an aligned range.
    void* raw = ::mmap(nullptr, size_bytes + g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) {
      const int err = errno;
      if (err == ENOMEM) return nullptr;
      throw backend_error(call + "): " + errno_text("mmap", err));
    }
    const auto start = reinterpret_cast<std::uintptr_t>(raw);
    base = (start + g - 1) & ~std::uintptr_t{g - 1};
    if (base > start) ::munmap(raw, base - start);
    if (const std::size_t tail = start + g - base; tail > 0) ::munmap(reinterpret_cast<void*>(base + size_bytes), tail);
  }
  impl_->note_reserved(base, size_bytes);
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
  impl_->note_released(addr, size_bytes);
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
    if (::ftruncate(d.memfd, static_cast<off_t>(grown)) != 0) {
      const int err = errno;
      throw backend_error(call + "): " + errno_text("ftruncate of the device's memory file", err) +
                          file_size_limit_text(err, grown, d.capacity_bytes));
    }
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
  // The record first (it allocates): a throw leaves nothing mapped.
  const auto noted = impl_->mappings.emplace(a, impl::mapping{device, size_bytes, handle, {}}).first;
  if (::mmap(addr, size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, file,
             static_cast<off_t>(h->second.offset)) == MAP_FAILED) {
    const int err = errno;
    impl_->mappings.erase(noted);
    // A failed MAP_FIXED mmap may have removed the placeholder: put it back.
    const bool restored = map_placeholder(a, size_bytes);
    const std::string what = call + "): " + errno_text("mmap", err, /*maps=*/true, size_bytes) +
                             (restored ? "" : "; the range could not be reserved again");
    if (err == ENOMEM) throw host_memory_error(what);
    throw backend_error(what);
  }
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
  if (impl_->fail_vm_unmap_countdown && --impl_->fail_vm_unmap_countdown == 0) {
    if (impl_->fail_vm_unmap_repeats != 0) {  // the next call is refused too
      --impl_->fail_vm_unmap_repeats;
      impl_->fail_vm_unmap_countdown = 1;
    }
    throw backend_error(call + "): injected failure");
  }
  // One MAP_FIXED mmap swaps the pages for the placeholder: the range is
  // never free for another mapping in between. Over an address-space limit
  // (RLIMIT_AS set below what the process maps already) every mmap fails,
  // even one that only replaces a range: the pages then stay mapped but
  // inaccessible (mprotect, which the limit does not refuse), the range
  // stays taken and the next vm_map there replaces them. A device unmaps
  // whatever the host's limits; the allocator's books rely on it.
  if (!map_placeholder(a, size_bytes)) {
    const int err = errno;
    if (::mprotect(addr, size_bytes, PROT_NONE) != 0)
      throw backend_error(call + "): " + errno_text("mmap of the reservation placeholder", err, /*maps=*/true, size_bytes));
  }
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
// the segment, its size, and the memory file's identity (device and inode
// numbers). Read back with /proc/<pid>/fd/<fd>; the identity tells the
// segment's file from another that took its descriptor number after the
// segment was freed.
struct sim_ipc_payload {
  char magic[8];
  std::uint32_t pid;
  std::int32_t fd;
  std::uint64_t size_bytes;
  std::uint64_t file_dev;
  std::uint64_t file_ino;
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
      throw backend_error(call + "): " + errno_text("mmap", err, /*maps=*/true, seg->second));
    }
    d.shared_segments.emplace(base, fd);
  }
  struct stat file {};
  if (::fstat(fd, &file) != 0) throw backend_error(call + "): " + errno_text("fstat of the segment's memory file", errno));
  sim_ipc_payload payload{};
  std::memcpy(payload.magic, sim_ipc_magic, sizeof payload.magic);
  payload.pid = static_cast<std::uint32_t>(::getpid());
  payload.fd = fd;
  payload.size_bytes = seg->second;
  payload.file_dev = static_cast<std::uint64_t>(file.st_dev);
  payload.file_ino = static_cast<std::uint64_t>(file.st_ino);
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
  const bool same_file = ::fstat(fd, &st) == 0 && static_cast<std::uint64_t>(st.st_dev) == payload.file_dev &&
                         static_cast<std::uint64_t>(st.st_ino) == payload.file_ino;
  if (!same_file) {
    ::close(fd);
    throw backend_error(call + ": " + path +
                        " is another file than the exported segment's (has the producer freed the segment?)");
  }
  if (static_cast<std::uint64_t>(st.st_size) == payload.size_bytes)
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

}  // namespace ccalloc
